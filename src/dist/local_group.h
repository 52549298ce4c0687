// All ranks of a distributed model inside one process: the driver logic local_pipeline (pipeline.cpp)
// and local_tp (tp.cpp) share. One inprocess_hub, one endpoint per rank, ranks 1.. running serve() on
// their own threads while the caller drives rank 0; the destructor stops the ranks and joins the threads.
//
// `Rank` is pipeline_rank or tp_rank: anything with serve() (ranks > 0) and stop() (rank 0) over a
// dist::transport, following transport.h's failure contract (a failing rank aborts its endpoint, which
// wakes every peer), so no thread can be left waiting when rank 0 aborts.
#pragma once
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dist/transport.h"

namespace fathom::dist {

template <class Rank>
class local_group {
  public:
    // Builds rank r = make(r, endpoint r) for r = 0..n-1 on the calling thread (a rank that cannot be
    // built throws here, before any thread starts), then starts ranks 1.. serving. `what` names the group
    // in the abort reason when a thread cannot be started ("starting the pipeline", ...).
    local_group(int n, std::chrono::milliseconds timeout,
                const std::function<std::unique_ptr<Rank>(int rank, transport &t)> &make, const char *what) {
        hub_ = std::make_unique<inprocess_hub>(n, timeout);  // throws unless 1 <= n <= 1024
        for (int r = 0; r < n; ++r) {
            ends_.push_back(hub_->endpoint(r));
            ranks_.push_back(make(r, *ends_.back()));
        }
        errors_.resize(static_cast<size_t>(n));
        try {
            for (int r = 1; r < n; ++r)
                threads_.emplace_back([this, r] {
                    try {
                        ranks_[static_cast<size_t>(r)]->serve();
                    } catch (const std::exception &e) {
                        // serve() already aborted its endpoint (rank 0 sees the reason); keep the text.
                        errors_[static_cast<size_t>(r)] = e.what();
                    }
                });
        } catch (const std::exception &e) {
            // No thread for a rank (system limit): wake the started ones and join them before rethrowing.
            ends_[0]->abort(std::string(what) + ": " + e.what());
            for (auto &t : threads_) t.join();
            throw;
        }
    }

    ~local_group() {
        try {
            ranks_[0]->stop();
        } catch (const std::exception &e) {
            // A rank already failed: abort rank 0 too so every thread's recv returns at once.
            ends_[0]->abort(std::string("stopping: ") + e.what());
        }
        for (auto &t : threads_) t.join();
    }

    // The threads hold `this`: a group never moves.
    local_group(const local_group &) = delete;
    local_group &operator=(const local_group &) = delete;

    Rank &driver() { return *ranks_[0]; }  // rank 0, driven by the caller
    const Rank &driver() const { return *ranks_[0]; }
    const Rank &rank(int r) const { return *ranks_.at(static_cast<size_t>(r)); }
    int size() const { return static_cast<int>(ranks_.size()); }

  private:
    // Destroyed after ~local_group has joined the threads, in reverse order: the ranks before their
    // endpoints, the endpoints before the hub.
    std::unique_ptr<inprocess_hub> hub_;
    std::vector<std::unique_ptr<transport>> ends_;  // [rank] endpoint of hub_
    std::vector<std::unique_ptr<Rank>> ranks_;      // [rank] over ends_[rank]
    std::vector<std::thread> threads_;              // serve() of ranks 1..n-1
    std::vector<std::string> errors_;               // [rank] what serve() threw ("" = none)
};

}  // namespace fathom::dist
