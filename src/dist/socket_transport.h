// Socket transport: the dist::transport contract (transport.h) between ranks that are separate
// processes, possibly on separate hosts, over TCP -- the CPU data path of `--procs` (docs/dist.md,
// "Several processes"). NCCL (nccl_transport.h) stays the GPU data path; this one carries host bytes.
//
// Topology: a full mesh (one connection per rank pair), because the pipeline sends r -> r+1 and
// last -> 0, and the tp all-reduce every rank <-> 0 (collective.cpp).
//
// Join ("token@host:port", from socket_root::id()):
//   1. rank 0 listens on an ephemeral port of `host` (127.0.0.1 by default) and publishes the id;
//   2. rank r > 0 connects to rank 0, listens on the local address of that connection (the interface
//      that reaches rank 0's host) and sends  "fathom-sock <token> <r> <size> <pid> <host> <listen addr>\n";
//   3. when all ranks have joined, rank 0 answers each with  "fathom-sock <token> 0 <size> <pid> <host> -\n"
//      and  "mesh <addr 1> <pid 1> <host 1> ... <addr P-1> <pid P-1> <host P-1>\n";
//   4. rank r connects to every rank 0 < j < r (hello, answered by j's hello) and accepts the connection
//      of every rank j > r, then sends "ok\n" to rank 0; rank 0 waits for every "ok".
//   The token (random per run) makes a listener ignore stray connections from another run.
// Frames (after the join; integers little-endian as on every supported host):
//   header 16 bytes = {char kind, 7 zero bytes, uint64 n}, then n payload bytes
//   'D' data (one send; the receiver checks n against the size it expects: a mismatch is a one-line
//       error naming both sizes), 'A' abort (payload = the one-line reason), 'B' goodbye (n = 0).
// Failures: every wait polls every peer's socket and a wake-up eventfd, so a peer's death (EOF or a
// reset without a goodbye: the kernel closes a dead process's sockets, SIGKILL included) or abort
// fails this rank's pending and later calls at once: "dist: rank R: peer rank P (pid N, host H) exited",
// "dist: rank P failed: <why>". A peer that said goodbye and closed is not a death. recv waits at most
// the timeout, recv_idle without one; a send blocked by a full socket buffer reads incoming frames
// meanwhile (two ranks sending to each other never deadlock) and also has the deadline.
// Sockets are close-on-exec, TCP_NODELAY with keep-alive, and sends use MSG_NOSIGNAL (no SIGPIPE).
// Threads: one thread uses an endpoint at a time; abort() may come from any thread (it wakes the user).
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "dist/liveness.h"
#include "dist/transport.h"

namespace fathom::dist {

struct socket_options {
    std::string host = "127.0.0.1";  // rank 0's listening address (one every rank can reach)
    std::chrono::milliseconds timeout{60000};       // recv / send deadline
    std::chrono::milliseconds join_timeout{60000};  // joining the mesh
    // Called at least every 100 ms while joining; may throw to cancel the join (the launcher uses it to
    // stop waiting for a rank process that already exited).
    std::function<void()> on_join_wait;
};

// Rank 0's listener, created before the ranks start so the id can be handed to them.
class socket_root {
  public:
    explicit socket_root(const std::string &host);  // throws when host cannot be bound
    const std::string &id() const { return id_; }    // "token@host:port"
    liveness_listener &listener() { return *listener_; }
    const std::string &token() const { return token_; }

  private:
    std::unique_ptr<liveness_listener> listener_;
    std::string token_, id_;
};

class socket_transport : public transport {
  public:
    // The pid of `rank`'s process (0 for this rank) as told at join.
    virtual long peer_pid(int rank) const = 0;
    // The rank whose process was seen to exit without a goodbye (EOF / reset), or -1.
    virtual int dead_peer() const = 0;
    // A peer died, aborted or sent garbage (so a failure of this rank may be a consequence, not a cause).
    virtual bool peer_failed() const = 0;
    // Clean stop: a goodbye to every peer (the destructor sends it too unless this rank failed or an
    // exception is unwinding).
    virtual void goodbye() = 0;
};

// Rank 0 of `size` (accepts every other rank on root's listener).
std::unique_ptr<socket_transport> make_socket_transport(socket_root root, int size, const socket_options &o);
// Rank `rank` > 0 of `size`, joining the rank 0 that published `id`.
std::unique_ptr<socket_transport> make_socket_transport(int rank, int size, const std::string &id,
                                                        const socket_options &o);

}  // namespace fathom::dist
