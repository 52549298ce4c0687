// NCCL implementation of dist::transport: one rank per process (one GPU each), point-to-point
// ncclSend/ncclRecv on a private stream, host data staged through a device buffer (the CPU pipeline
// passes host arrays; a GPU pipeline would pass device pointers instead, see docs/dist.md).
//
// Failure handling: the communicator is created non-blocking, and every wait (init, send, recv,
// recv_idle) polls cudaStreamQuery + ncclCommGetAsyncError against a deadline (none for recv_idle),
// and the liveness side channel (liveness.h: a TCP connection rank 0 <-> every rank, made at join;
// the kernel closes a dead process's socket, SIGKILL included). On a timeout, an NCCL error, a peer
// process that exited or aborted, or abort() the communicator is aborted (ncclCommAbort) and the wait
// throws a one-line fathom::error, e.g. "dist: rank 1: peer rank 0 (pid 4711, host h) exited", so a
// dead or hung peer never leaves a rank waiting -- also a rank idling in recv_idle, on which NCCL
// reports nothing. A rank that aborts sends its reason over the side channel (rank 0 relays it to the
// others by aborting in turn); a clean stop (the transport destroyed other than by an exception) sends
// a goodbye first, so a normal exit is not reported as a death. NCCL_NVLS_ENABLE defaults to 0 (NVLink
// multicast off) unless set.
//
// Joining: rank 0 makes an nccl_root (NCCL id + liveness listener) and hands root.id() --
// "<256 hex>@host:port" -- to the other ranks (id file, command line), then joins with
// make_nccl_transport(std::move(root), ...). A bare 256-hex id from nccl_new_id() still works but has
// no side channel: then a dead peer is noticed only by NCCL or a deadline.
//
// Built only with -DFATHOM_CUDA=ON (the file extension keeps it out of fathom_core's *.cpp glob;
// tests/dist/tests.cmake builds it into the fathom_dist_nccl library and the NCCL smoke test).
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "dist/liveness.h"
#include "dist/transport.h"

namespace fathom::dist {

// A fresh NCCL unique id as 256 hex characters, without a liveness side channel (see nccl_root).
std::string nccl_new_id();

struct nccl_options {
    int device = 0;                                 // CUDA ordinal of this rank
    std::chrono::milliseconds timeout{60000};       // init / send / recv deadline (and liveness join)
    // Rank 0 only: the address its liveness listener binds to and publishes in nccl_root::id(); every
    // rank must reach it. 127.0.0.1 on one host; this host's interconnect address (or a name that
    // resolves to it) for ranks on several hosts.
    std::string liveness_host = "127.0.0.1";
};

// Rank 0's half of a rendezvous, made before the other ranks start: a fresh NCCL id and the liveness
// listener (bound at once, so the others can connect as soon as they read the id).
class nccl_root {
  public:
    explicit nccl_root(const nccl_options &o);  // throws fathom::error if the address cannot be bound
    // "<256 hex>@host:port": what every other rank passes to make_nccl_transport.
    const std::string &id() const { return id_; }

  private:
    friend std::unique_ptr<transport> make_nccl_transport(nccl_root &&root, int size, const nccl_options &o);
    std::string id_;
    std::unique_ptr<liveness_listener> listener_;
};

// Rank 0 joins: accepts the liveness connections of ranks 1..size-1, then initialises the
// communicator. Throws fathom::error (timeout included) if the other ranks do not join in time or NCCL
// refuses (e.g. two ranks on one GPU).
std::unique_ptr<transport> make_nccl_transport(nccl_root &&root, int size, const nccl_options &o);
// Rank `rank` joins the communicator `id` ("<hex>@host:port" from nccl_root::id(): connects to rank 0's
// liveness listener first; or a bare hex id from nccl_new_id(): no side channel, any rank). Throws
// fathom::error as above, and for rank 0 with an "@" id (rank 0 joins through its nccl_root).
std::unique_ptr<transport> make_nccl_transport(int rank, int size, const std::string &id, const nccl_options &o);

}  // namespace fathom::dist
