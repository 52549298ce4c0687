// Point-to-point transport between the ranks of a distributed (multi-device) model: the interface the
// pipeline stages use to pass hyper-connection activations, and its in-process implementation
// (ranks = threads of one process; the CPU tests and single-host debugging use it). The NCCL
// implementation (one rank per GPU/process) follows the same contract; see docs/dist.md.
//
// Contract (NCCL point-to-point semantics): a send(peer, n bytes) is matched by exactly one
// recv(from, n bytes) on the peer, in order per (sender, receiver) pair; both sides know n.
// Failure handling: every recv has a deadline, and a rank that fails calls abort(why), after which
// its peers' pending and future recvs from it, and sends to it, throw at once with that reason.
// No call can hang forever.
#pragma once
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

namespace fathom::dist {

class transport {
  public:
    virtual ~transport() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    // Deliver `bytes` bytes to `peer` (may return before the peer received them). Throws
    // fathom::error if the peer is out of range, is this rank, or has failed.
    virtual void send(int peer, const void *data, size_t bytes) = 0;
    // Receive exactly `bytes` bytes from `peer`. Throws fathom::error on timeout, on a size mismatch
    // with the matching send, or when the peer has failed.
    virtual void recv(int peer, void *data, size_t bytes) = 0;
    // As recv, but without the deadline: for a rank waiting for its next request, where idling is
    // normal. Still throws at once when the peer (or this rank) fails.
    virtual void recv_idle(int peer, void *data, size_t bytes) = 0;
    // Mark this rank failed with a one-line reason (idempotent; the first reason wins).
    virtual void abort(const std::string &why) = 0;
};

// Shared mailboxes of `n_ranks` in-process ranks. Sends are buffered (never block); a recv waits at
// most `timeout` for the matching message. The hub must outlive its endpoints.
class inprocess_hub {
  public:
    inprocess_hub(int n_ranks, std::chrono::milliseconds timeout);
    ~inprocess_hub();
    inprocess_hub(const inprocess_hub &) = delete;
    inprocess_hub &operator=(const inprocess_hub &) = delete;
    // The endpoint of `rank` (one per rank; throws if out of range or already taken).
    std::unique_ptr<transport> endpoint(int rank);
    int size() const;

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

}  // namespace fathom::dist
