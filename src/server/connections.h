// Client connections of `fathom serve`, between cpp-httplib's accept loop and its request parser.
// A connection waits for a complete request head (request line + headers) in one poller thread,
// not on an HTTP worker: a client that trickles header bytes holds a file descriptor, never a
// thread, and is closed when --header-timeout passes. A complete head goes to a worker pool (GET,
// HEAD and OPTIONS to a small pool of their own, so /health and /metrics answer while every POST
// worker is busy), which parses and answers exactly one request and hands the connection back
// (keep-alive) or closes it. While a request's body is read, the poller also watches
// --body-timeout and shuts the socket's read side when it passes (the read fails; the request gets
// 408). Each client address may hold at most max_per_client connections; more are closed at accept.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace httplib {
class ThreadPool;
}

namespace fathom::server {

struct connection_limits {
    std::chrono::milliseconds header_timeout{10000};  // connect (or keep-alive reuse) -> complete head
    std::chrono::milliseconds body_timeout{60000};    // complete head -> complete body
    std::chrono::milliseconds keep_alive_idle{5000};  // an idle kept-alive connection is closed after this
    int max_per_client = 32;                          // open connections per client address
    int request_threads = 64;                         // workers for POST (and other) requests
    int control_threads = 4;                          // workers for GET / HEAD / OPTIONS
};

// One open connection. Fields other than fd and peer are guarded by connection_manager's mutex.
struct connection {
    int fd = -1;
    std::string peer;  // client address (no port)
    enum class state { waiting, active, draining } st = state::waiting;
    bool got_bytes = false;      // waiting: part of a head arrived
    size_t peeked = 0;           // waiting: bytes of the head seen so far
    bool body_due = false;       // active: body_deadline applies
    bool timed_out = false;      // active: the body deadline passed (the read side was shut)
    bool close_after = false;    // active: close (after draining what the client still sends) when done
    int served = 0;              // requests answered on this connection
    // The request being served, for the access log (set on the worker thread only).
    std::chrono::steady_clock::time_point started{};
    int64_t n_prompt = -1, n_generated = -1;  // tokens, when the request generated
    std::chrono::steady_clock::time_point deadline{};
    std::chrono::steady_clock::time_point body_deadline{};  // active: set and read on the worker only
};

struct connection_stats {
    uint64_t rejected_per_client = 0;  // closed at accept: the client address was at its cap
    uint64_t header_timeouts = 0;      // closed: no complete head in time
    uint64_t body_timeouts = 0;        // requests whose body did not arrive in time
};

class connection_manager {
public:
    // serve(fd) parses and answers one request on the worker thread that calls it; it returns
    // false when the connection must not be reused (parse failure, "Connection: close", ...).
    using serve_fn = std::function<bool(connection &)>;
    connection_manager(connection_limits lim, serve_fn serve);
    ~connection_manager();

    // A freshly accepted socket (called on the accept thread). Takes ownership of fd.
    void add(int fd);
    // Stops the poller and the workers (waits for requests in progress), closes every connection.
    void stop();

    // The connection being served on this thread (nullptr outside serve()).
    static connection *current();
    // Called from the request's pre-routing (head parsed): the body must arrive by now + body_timeout
    // (c.body_deadline, checked by the body reader as bytes arrive, which then answers 408); a
    // client that stops sending altogether has its read side shut a little later (k_body_grace).
    void body_started(connection &c);
    // The body reader found c.body_deadline passed (counted in stats).
    void body_timed_out();
    // Called when the handler runs (body read): no deadline while the response is produced.
    void body_done(connection &c);
    connection_stats stats() const;
    const connection_limits &limits() const { return lim_; }

private:
    void poll_loop();
    void on_readable(const std::shared_ptr<connection> &c, std::vector<char> &buf);
    void expire_locked(const std::shared_ptr<connection> &c);
    void serve_on_worker(const std::shared_ptr<connection> &c);
    void finish(const std::shared_ptr<connection> &c, bool reuse);
    void close_locked(const std::shared_ptr<connection> &c);
    void wake();

    connection_limits lim_;
    serve_fn serve_;
    mutable std::mutex mu_;
    std::list<std::shared_ptr<connection>> conns_;  // every open connection
    std::map<std::string, int> per_peer_;
    connection_stats stats_;
    bool stopping_ = false;
    int wake_fd_ = -1;  // eventfd: the poller re-reads its set
    std::unique_ptr<httplib::ThreadPool> requests_, control_;
    std::thread poller_;
};

}  // namespace fathom::server
