// Liveness side channel for the ranks of a multi-process transport (used by the NCCL transport,
// nccl_transport.h): one TCP connection per rank pair (rank 0, rank r), made at join, that carries no
// data -- only a one-byte goodbye or a one-line abort reason. Why: NCCL reports nothing when a peer
// process dies (a rank waiting for its next request would wait forever), but the kernel closes every
// socket of a dead process, SIGKILL included, so EOF on this connection means "that process is gone".
//
// Topology: rank 0 listens (liveness_listener, ephemeral port on an address every rank can reach) and
// holds one accepted connection per other rank, so it notices the death of any rank; ranks > 0 hold one
// connection to rank 0 and notice rank 0's death (a middle rank's death reaches them through rank 0,
// which aborts and forwards its reason, or through their own deadline).
//
// Wire format (after connect): each side sends one hello line
//   "fathom-live <token> <rank> <size> <pid> <hostname>\n"
// (a rank > 0 first; rank 0 answers with its own). The token (from the NCCL id) makes rank 0 ignore a
// stray connection from another run. Then only: 'B' = goodbye (a clean stop follows; the EOF after it
// is not a death), or 'A' <reason> '\n' = this rank aborted for <reason>.
// Sockets are close-on-exec (a child process must not keep a dead rank's socket open) and use TCP
// keep-alive, so a vanished host (no FIN ever comes) is noticed within about 30 s.
#pragma once
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fathom::dist {

// Rank 0's listening socket. Create it before publishing its address(), so every rank that reads the
// address can connect at once (the kernel queues connections until accept).
class liveness_listener {
  public:
    // Bind `host` (IPv4/IPv6 literal or a name this host resolves: "127.0.0.1" for one host, this
    // host's interconnect address for several) on an ephemeral port. Throws fathom::error when the
    // address cannot be resolved or bound.
    explicit liveness_listener(const std::string &host);
    ~liveness_listener();
    liveness_listener(const liveness_listener &) = delete;
    liveness_listener &operator=(const liveness_listener &) = delete;

    // "host:port" ("[v6]:port" for an IPv6 literal) as the other ranks pass it to liveness::connect_root.
    const std::string &address() const { return address_; }
    int port() const { return port_; }
    int fd() const { return fd_; }

  private:
    int fd_ = -1;
    int port_ = 0;
    std::string address_;
};

// The liveness connections of one rank. check() never blocks; call it from every wait loop.
class liveness {
  public:
    struct peer {
        int rank = -1;
        long pid = 0;
        std::string host;
        int fd = -1;
        std::string inbox;  // bytes received after the hello, not yet parsed
        bool said_bye = false;
        bool closed = false;  // EOF after a goodbye: no longer polled
    };

    // Rank 0 of `size`: accept one connection from each rank 1..size-1 on `l` and exchange hellos.
    // Connections with another token are closed and ignored. Throws fathom::error after `timeout`
    // naming the ranks that did not connect, or on a duplicate / out-of-range rank.
    static std::unique_ptr<liveness> accept_ranks(liveness_listener &l, const std::string &token, int size,
                                                  std::chrono::milliseconds timeout);
    // Rank `rank` > 0 of `size`: connect to rank 0's `address` ("host:port") and exchange hellos.
    // Throws fathom::error on a malformed address, a refused connection, a refused hello (wrong token
    // or size) or after `timeout`.
    static std::unique_ptr<liveness> connect_root(const std::string &address, const std::string &token, int rank,
                                                  int size, std::chrono::milliseconds timeout);

    ~liveness();  // closes the connections without a goodbye (a peer sees an exit)
    liveness(const liveness &) = delete;
    liveness &operator=(const liveness &) = delete;

    // Non-blocking (poll with a zero timeout). The one-line reason when a peer died -- EOF or a socket
    // error without a goodbye: "dist: rank R: peer rank P (pid N, host H) exited" -- or announced an
    // abort ("... failed: <its reason>"); nullopt while every peer is alive or left with a goodbye.
    // Once a failure was seen, every later call reports it again.
    std::optional<std::string> check();
    // Clean stop: send the goodbye to every peer (then the destructor closes). Errors are ignored
    // (a peer may already be gone).
    void say_bye();
    // Tell every peer this rank aborted (`why`, flattened to one line); errors are ignored.
    void say_abort(const std::string &why);

    int rank() const { return rank_; }
    const std::vector<peer> &peers() const { return peers_; }

  private:
    liveness(int rank, std::vector<peer> peers) : rank_(rank), peers_(std::move(peers)) {}
    std::optional<std::string> drain(peer &p);  // read what is pending on p; a failure reason
    void send_all(const std::string &bytes);

    int rank_;
    std::vector<peer> peers_;
    std::optional<std::string> failed_;
    std::mutex mu_;  // check() may run in a waiting thread while another thread aborts
};

}  // namespace fathom::dist
