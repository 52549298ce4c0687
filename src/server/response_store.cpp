// The Responses API store (response_store.h): an LRU map bounded by count and bytes.
#include "server/response_store.h"

namespace fathom::server {

response_store::response_store(size_t max_entries, size_t max_bytes) : max_entries_(max_entries), max_bytes_(max_bytes) {}

static size_t json_bytes(const nlohmann::json &j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).size();
}

void response_store::drop_locked(std::unordered_map<std::string, slot>::iterator it) {
    bytes_ -= it->second.bytes;
    lru_.erase(it->second.lru);
    by_id_.erase(it);
}

bool response_store::put(const std::string &id, stored_response r) {
    const size_t n = id.size() + json_bytes(r.response) + json_bytes(r.history);
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = by_id_.find(id); it != by_id_.end()) drop_locked(it);
    if (max_entries_ == 0 || n > max_bytes_) return false;
    while (!lru_.empty() && (by_id_.size() + 1 > max_entries_ || bytes_ + n > max_bytes_)) {
        drop_locked(by_id_.find(lru_.back()));
        ++evictions_;
    }
    lru_.push_front(id);
    by_id_.emplace(id, slot{std::make_shared<const stored_response>(std::move(r)), n, lru_.begin()});
    bytes_ += n;
    return true;
}

std::shared_ptr<const stored_response> response_store::get(const std::string &id) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = by_id_.find(id);
    if (it == by_id_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second.lru);  // most recently used
    return it->second.value;
}

bool response_store::erase(const std::string &id) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = by_id_.find(id);
    if (it == by_id_.end()) return false;
    drop_locked(it);
    return true;
}

size_t response_store::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return by_id_.size();
}

size_t response_store::bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
}

size_t response_store::evictions() const {
    std::lock_guard<std::mutex> lock(mu_);
    return evictions_;
}

}  // namespace fathom::server
