// In-process transport (see transport.h): one FIFO mailbox per ordered (sender, receiver) pair,
// guarded by one mutex and condition variable; a failed rank's reason wakes every waiter.
#include "dist/transport.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace fathom::dist {

struct inprocess_hub::impl {
    int n = 0;
    std::chrono::milliseconds timeout{0};
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::deque<std::vector<unsigned char>>> box;  // [from * n + to]
    std::vector<std::string> failed;                          // [rank] "" = alive
    std::vector<bool> taken;                                  // endpoint handed out
};

namespace {

class inprocess_endpoint final : public transport {
  public:
    inprocess_endpoint(inprocess_hub::impl &h, int rank) : h_(h), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return h_.n; }

    void send(int peer, const void *data, size_t bytes) override {
        check_peer(peer, "send to");
        std::lock_guard<std::mutex> lock(h_.mu);
        if (!h_.failed[static_cast<size_t>(rank_)].empty())
            throw error("dist: rank " + std::to_string(rank_) + " cannot send after it failed: " +
                        h_.failed[static_cast<size_t>(rank_)]);
        if (!h_.failed[static_cast<size_t>(peer)].empty())
            throw error("dist: rank " + std::to_string(peer) + " failed: " + h_.failed[static_cast<size_t>(peer)]);
        const auto *p = static_cast<const unsigned char *>(data);
        h_.box[static_cast<size_t>(rank_ * h_.n + peer)].emplace_back(p, p + bytes);
        h_.cv.notify_all();
    }

    void recv(int peer, void *data, size_t bytes) override { receive(peer, data, bytes, true); }
    void recv_idle(int peer, void *data, size_t bytes) override { receive(peer, data, bytes, false); }

    void abort(const std::string &why) override {
        std::lock_guard<std::mutex> lock(h_.mu);
        std::string &f = h_.failed[static_cast<size_t>(rank_)];
        if (f.empty()) f = why.empty() ? "aborted" : why;
        h_.cv.notify_all();
    }

  private:
    void receive(int peer, void *data, size_t bytes, bool deadline) {
        check_peer(peer, "receive from");
        std::unique_lock<std::mutex> lock(h_.mu);
        auto &q = h_.box[static_cast<size_t>(peer * h_.n + rank_)];
        const std::string &peer_failed = h_.failed[static_cast<size_t>(peer)];
        const std::string &self_failed = h_.failed[static_cast<size_t>(rank_)];
        // A message already delivered is consumed even if its sender failed afterwards.
        const auto wake = [&] { return !q.empty() || !peer_failed.empty() || !self_failed.empty(); };
        if (deadline)
            h_.cv.wait_for(lock, h_.timeout, wake);
        else
            h_.cv.wait(lock, wake);
        if (q.empty()) {
            if (!self_failed.empty())
                throw error("dist: rank " + std::to_string(rank_) + " aborted: " + self_failed);
            if (!peer_failed.empty()) throw error("dist: rank " + std::to_string(peer) + " failed: " + peer_failed);
            throw error("dist: rank " + std::to_string(rank_) + " timed out after " +
                        std::to_string(h_.timeout.count()) + " ms waiting for " + std::to_string(bytes) +
                        " bytes from rank " + std::to_string(peer));
        }
        std::vector<unsigned char> msg = std::move(q.front());
        q.pop_front();
        if (msg.size() != bytes)
            throw error("dist: rank " + std::to_string(rank_) + " expected " + std::to_string(bytes) +
                        " bytes from rank " + std::to_string(peer) + ", got " + std::to_string(msg.size()));
        if (bytes) std::memcpy(data, msg.data(), bytes);
    }

    void check_peer(int peer, const char *what) const {
        if (peer < 0 || peer >= h_.n || peer == rank_)
            throw error("dist: rank " + std::to_string(rank_) + " cannot " + what + " rank " + std::to_string(peer) +
                        " (ranks 0.." + std::to_string(h_.n - 1) + ", not itself)");
    }
    inprocess_hub::impl &h_;
    int rank_;
};

}  // namespace

inprocess_hub::inprocess_hub(int n_ranks, std::chrono::milliseconds timeout) : p_(std::make_unique<impl>()) {
    if (n_ranks < 1 || n_ranks > 1024)
        throw error("dist: in-process hub needs 1..1024 ranks, got " + std::to_string(n_ranks));
    if (timeout.count() <= 0)
        throw error("dist: in-process hub timeout must be positive, got " + std::to_string(timeout.count()) + " ms");
    p_->n = n_ranks;
    p_->timeout = timeout;
    p_->box.resize(static_cast<size_t>(n_ranks) * static_cast<size_t>(n_ranks));
    p_->failed.resize(static_cast<size_t>(n_ranks));
    p_->taken.assign(static_cast<size_t>(n_ranks), false);
}

inprocess_hub::~inprocess_hub() = default;

int inprocess_hub::size() const {
    return p_->n;
}

std::unique_ptr<transport> inprocess_hub::endpoint(int rank) {
    std::lock_guard<std::mutex> lock(p_->mu);
    if (rank < 0 || rank >= p_->n)
        throw error("dist: endpoint rank " + std::to_string(rank) + " outside [0, " + std::to_string(p_->n) + ")");
    if (p_->taken[static_cast<size_t>(rank)])
        throw error("dist: endpoint of rank " + std::to_string(rank) + " already taken");
    p_->taken[static_cast<size_t>(rank)] = true;
    return std::make_unique<inprocess_endpoint>(*p_, rank);
}

}  // namespace fathom::dist
