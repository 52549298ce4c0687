// The server-side store of the Responses API (POST /v1/responses with `store`, previous_response_id,
// GET / DELETE /v1/responses/{id}; docs/server.md "Responses API").
//
// Each entry keeps one finished response: the Response object as it was returned, and the
// conversation it ends as a list of input items (the previous response's history + this request's
// input items + this response's output items; `instructions` excluded, as the API does not carry
// them over). A follow-up request naming it as previous_response_id continues from that history
// alone, so entries do not depend on each other: evicting one never breaks another's chain (the
// price is that a long conversation's history is held once per turn, counted in the byte bound).
//
// Bounded by a count and a byte total (the JSON text sizes of the object and the history); the least
// recently used entries (stored or looked up) are evicted first; an entry larger than the whole byte
// bound is not kept. Thread-safe; entries are shared immutable snapshots.
#pragma once
#include <nlohmann/json.hpp>

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace fathom::server {

struct stored_response {
    nlohmann::json response;  // the Response object (status completed or incomplete)
    nlohmann::json history;   // input items: the conversation up to and including this response's output
};

class response_store {
public:
    response_store(size_t max_entries, size_t max_bytes);
    // Keeps `r` under `id` (replacing an entry of that id), evicting least recently used entries until
    // both bounds hold. false (nothing kept) when the entry alone exceeds max_bytes or max_entries is 0.
    bool put(const std::string &id, stored_response r);
    // The entry, marked most recently used; nullptr when unknown or evicted.
    std::shared_ptr<const stored_response> get(const std::string &id);
    // true when an entry was removed.
    bool erase(const std::string &id);
    size_t size() const;
    size_t bytes() const;
    size_t evictions() const;

private:
    struct slot {
        std::shared_ptr<const stored_response> value;
        size_t bytes = 0;
        std::list<std::string>::iterator lru;  // position in lru_ (front = most recent)
    };
    void drop_locked(std::unordered_map<std::string, slot>::iterator it);
    size_t max_entries_, max_bytes_;
    size_t bytes_ = 0, evictions_ = 0;
    mutable std::mutex mu_;
    std::list<std::string> lru_;  // ids, most recently used first
    std::unordered_map<std::string, slot> by_id_;
};

}  // namespace fathom::server
