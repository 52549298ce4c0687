// Socket transport (see socket_transport.h for the join, the frames and the failure rules): one TCP
// connection per rank pair; every wait polls all of them plus an eventfd that abort() writes, so a
// peer's death, a peer's abort or this rank's abort ends any wait at once.
#include "dist/socket_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "dist/net_util.h"

namespace fathom::dist {

namespace {

using net::clk;
constexpr const char *hello_magic = "fathom-sock";
constexpr size_t max_line = 1 << 16;          // hello and mesh lines
constexpr size_t frame_len = 16;              // {kind, 7 zero bytes, uint64 n}
constexpr uint64_t max_data = uint64_t{1} << 40;  // a corrupt length fails instead of allocating
constexpr uint64_t max_reason = 4096;
constexpr auto poll_step = std::chrono::milliseconds(100);  // join: how often on_join_wait runs

std::string rank_text(int r) { return "dist: rank " + std::to_string(r); }

std::string random_token() {
    std::random_device rd;
    std::ostringstream s;
    for (int i = 0; i < 4; ++i) s << std::hex << rd();
    return s.str();
}

std::string frame(char kind, const std::string &payload) {
    std::string f(frame_len, '\0');
    f[0] = kind;
    const uint64_t n = payload.size();
    std::memcpy(f.data() + 8, &n, sizeof n);
    return f + payload;
}

struct hello {
    std::string token, addr, host;
    int rank = -1, size = 0;
    long pid = 0;
};

std::string hello_text(const std::string &token, int rank, int size, const std::string &addr) {
    return std::string(hello_magic) + " " + token + " " + std::to_string(rank) + " " + std::to_string(size) + " " +
           std::to_string(static_cast<long>(::getpid())) + " " + net::this_host() + " " + addr + "\n";
}

std::optional<hello> parse_hello(const std::optional<std::string> &line) {
    if (!line) return std::nullopt;
    std::istringstream in(*line);
    std::string magic;
    hello h;
    if (!(in >> magic >> h.token >> h.rank >> h.size >> h.pid >> h.host >> h.addr) || magic != hello_magic)
        return std::nullopt;
    return h;
}

// One connection to a peer rank: the receive state machine (header, then payload) and the messages
// received but not yet asked for.
struct peer_conn {
    int fd = -1;
    long pid = 0;
    std::string host;
    unsigned char hdr[frame_len] = {};
    size_t hdr_got = 0;
    bool in_body = false;
    std::vector<unsigned char> body;
    size_t body_got = 0;
    std::deque<std::vector<unsigned char>> box;  // complete 'D' payloads, in order
    bool said_bye = false;
    bool closed = false;      // goodbye then EOF: a clean stop, no longer polled
    bool out_broken = false;  // a send to it stopped mid-frame: no further frame can follow
    std::string failed;       // "" = alive; else the one-line reason (death, abort, bad frame)
};

class socket_endpoint final : public socket_transport {
  public:
    socket_endpoint(int rank, std::vector<peer_conn> peers, std::chrono::milliseconds timeout)
        : rank_(rank), peers_(std::move(peers)), timeout_(timeout) {
        wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (wake_fd_ < 0) {
            close_all();
            throw error(rank_text(rank_) + ": eventfd: " + net::errno_text(errno));
        }
    }
    ~socket_endpoint() override {
        bool failed;
        {
            std::lock_guard<std::mutex> lock(st_mu_);
            failed = !self_failed_.empty();
        }
        if (!failed && std::uncaught_exceptions() == 0) goodbye();
        close_all();
        ::close(wake_fd_);
    }

    int rank() const override { return rank_; }
    int size() const override { return static_cast<int>(peers_.size()); }
    long peer_pid(int r) const override { return r == rank_ ? 0 : peers_.at(static_cast<size_t>(r)).pid; }
    int dead_peer() const override {
        std::lock_guard<std::mutex> lock(st_mu_);
        return dead_;
    }
    bool peer_failed() const override { return peer_failed_.load(); }

    void send(int q, const void *data, size_t bytes) override {
        check_peer(q, "send to");
        std::lock_guard<std::mutex> io(io_mu_);
        const auto deadline = clk::now() + timeout_;
        throw_if_failed(q, true);
        unsigned char h[frame_len] = {};
        h[0] = 'D';
        const uint64_t n = bytes;
        std::memcpy(h + 8, &n, sizeof n);
        size_t off_h = 0, off_b = 0;
        try {
            write_bytes(q, h, frame_len, deadline, bytes, off_h);
            write_bytes(q, static_cast<const unsigned char *>(data), bytes, deadline, bytes, off_b);
        } catch (...) {
            // A frame begun but not finished: the stream to q cannot carry another frame.
            if (off_h > 0 && !(off_h == frame_len && off_b == bytes)) peers_[static_cast<size_t>(q)].out_broken = true;
            throw;
        }
    }

    void recv(int q, void *data, size_t bytes) override { receive(q, data, bytes, clk::now() + timeout_); }
    void recv_idle(int q, void *data, size_t bytes) override { receive(q, data, bytes, clk::time_point::max()); }

    void abort(const std::string &why) override {
        {
            std::lock_guard<std::mutex> lock(st_mu_);
            if (self_failed_.empty()) self_failed_ = net::one_line(why.empty() ? "aborted" : why);
        }
        const uint64_t one = 1;
        (void)!::write(wake_fd_, &one, sizeof one);
        // Tell the peers now unless another thread is inside send/recv: that one wakes up (eventfd) and
        // sends the abort frames itself, between frames.
        std::unique_lock<std::mutex> io(io_mu_, std::try_to_lock);
        if (io.owns_lock()) send_aborts();
    }

    void goodbye() override {
        std::lock_guard<std::mutex> io(io_mu_);
        if (bye_sent_) return;
        bye_sent_ = true;
        const auto deadline = clk::now() + std::chrono::milliseconds(200);  // never hang on a stuck peer
        for (auto &p : peers_)
            if (p.fd >= 0 && !p.closed && !p.out_broken) net::write_all(p.fd, frame('B', ""), deadline);
    }

  private:
    void close_all() {
        for (auto &p : peers_)
            if (p.fd >= 0) {
                ::close(p.fd);
                p.fd = -1;
            }
    }

    void check_peer(int q, const char *what) const {
        if (q < 0 || q >= size() || q == rank_)
            throw error(rank_text(rank_) + " cannot " + what + " rank " + std::to_string(q) + " (ranks 0.." +
                        std::to_string(size() - 1) + ", not itself)");
    }

    std::string who(int q) const {
        const peer_conn &p = peers_[static_cast<size_t>(q)];
        return rank_text(rank_) + ": peer rank " + std::to_string(q) + " (pid " + std::to_string(p.pid) + ", host " +
               p.host + ")";
    }

    // io_mu_ held. Send the abort frame to every peer once (errors ignored; 200 ms at most).
    void send_aborts() {
        std::string why;
        {
            std::lock_guard<std::mutex> lock(st_mu_);
            if (self_failed_.empty() || abort_sent_) return;
            abort_sent_ = true;
            why = self_failed_;
        }
        if (why.size() > max_reason) why.resize(max_reason);
        const auto deadline = clk::now() + std::chrono::milliseconds(200);
        for (auto &p : peers_) {
            if (p.fd < 0 || p.closed) continue;
            if (p.out_broken)
                ::shutdown(p.fd, SHUT_RDWR);  // mid-frame: it can only see an EOF
            else
                net::write_all(p.fd, frame('A', why), deadline);
        }
    }

    // io_mu_ held. Throws when this rank aborted, or (any_peer) when any peer failed, else when q failed.
    void throw_if_failed(int q, bool any_peer) {
        std::string self;
        {
            std::lock_guard<std::mutex> lock(st_mu_);
            self = self_failed_;
        }
        if (!self.empty()) {
            send_aborts();
            throw error(rank_text(rank_) + " aborted: " + self);
        }
        if (!peers_[static_cast<size_t>(q)].failed.empty()) throw error(peers_[static_cast<size_t>(q)].failed);
        if (any_peer)
            for (const auto &p : peers_)
                if (!p.failed.empty()) throw error(p.failed);
    }

    void mark_dead(int q, const std::string &why) {
        peer_conn &p = peers_[static_cast<size_t>(q)];
        if (p.failed.empty()) p.failed = why;
        peer_failed_ = true;
        std::lock_guard<std::mutex> lock(st_mu_);
        if (dead_ < 0) dead_ = q;
    }

    // A complete header in p.hdr: start its payload (or finish a payload-less frame).
    void start_frame(int q) {
        peer_conn &p = peers_[static_cast<size_t>(q)];
        uint64_t n = 0;
        std::memcpy(&n, p.hdr + 8, sizeof n);
        const char kind = static_cast<char>(p.hdr[0]);
        bool pad_ok = true;
        for (size_t i = 1; i < 8; ++i) pad_ok = pad_ok && p.hdr[i] == 0;
        p.hdr_got = 0;
        if (pad_ok && kind == 'B' && n == 0) {
            p.said_bye = true;
            return;
        }
        if (!pad_ok || !((kind == 'D' && n <= max_data) || (kind == 'A' && n <= max_reason))) {
            peer_failed_ = true;
            p.failed = who(q) + " sent a bad frame header (kind " + std::to_string(static_cast<int>(p.hdr[0])) + ", " +
                       std::to_string(n) + " bytes)";
            return;
        }
        p.body.assign(static_cast<size_t>(n), 0);
        p.body_got = 0;
        p.in_body = true;
        if (n == 0) finish_frame(q);
    }

    void finish_frame(int q) {
        peer_conn &p = peers_[static_cast<size_t>(q)];
        p.in_body = false;
        if (p.hdr[0] == 'D') {
            p.box.push_back(std::move(p.body));
        } else if (p.failed.empty()) {
            p.failed = rank_text(q) + " failed: " + std::string(p.body.begin(), p.body.end());
            peer_failed_ = true;
        }
        p.body = {};
    }

    // Read everything available from peer q without blocking (messages to its box, failures to its state).
    void pump(int q) {
        peer_conn &p = peers_[static_cast<size_t>(q)];
        while (p.fd >= 0 && !p.closed && p.failed.empty()) {
            unsigned char *dst = p.in_body ? p.body.data() + p.body_got : p.hdr + p.hdr_got;
            const size_t want = p.in_body ? p.body.size() - p.body_got : frame_len - p.hdr_got;
            const ssize_t n = ::recv(p.fd, dst, want, MSG_DONTWAIT);
            if (n > 0) {
                if (p.in_body) {
                    p.body_got += static_cast<size_t>(n);
                    if (p.body_got == p.body.size()) finish_frame(q);
                } else {
                    p.hdr_got += static_cast<size_t>(n);
                    if (p.hdr_got == frame_len) start_frame(q);
                }
                continue;
            }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (p.said_bye && !p.in_body && p.hdr_got == 0) {
                p.closed = true;  // goodbye, then EOF: a clean stop
                return;
            }
            // EOF without a goodbye, or a reset (a killed process with unread bytes resets instead).
            if (n == 0 || errno == ECONNRESET || errno == EPIPE)
                mark_dead(q, who(q) + " exited");
            else
                mark_dead(q, who(q) + " is unreachable: " + net::errno_text(errno));
        }
    }

    // Wait until something is readable on any peer (or the eventfd), or `out` (>= 0) is writable, or
    // `deadline`; pump the readable peers. false on timeout.
    bool wait_io(clk::time_point deadline, int out) {
        std::vector<pollfd> fds;
        std::vector<int> who_at;
        fds.push_back({wake_fd_, POLLIN, 0});
        who_at.push_back(-1);
        for (int q = 0; q < size(); ++q) {
            const peer_conn &p = peers_[static_cast<size_t>(q)];
            if (q == rank_ || p.fd < 0 || p.closed || !p.failed.empty()) continue;
            fds.push_back({p.fd, static_cast<short>(POLLIN | (q == out ? POLLOUT : 0)), 0});
            who_at.push_back(q);
        }
        int r;
        while ((r = ::poll(fds.data(), fds.size(), net::ms_left(deadline))) < 0 && errno == EINTR) {
        }
        if (r < 0) throw error(rank_text(rank_) + ": poll: " + net::errno_text(errno));
        if (r == 0) return false;
        for (size_t i = 1; i < fds.size(); ++i)
            if (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) pump(who_at[i]);
        return true;
    }

    // Write n bytes to q (off = how many went out, also when it throws).
    void write_bytes(int q, const unsigned char *data, size_t n, clk::time_point deadline, size_t msg_bytes,
                     size_t &off) {
        peer_conn &p = peers_[static_cast<size_t>(q)];
        if (p.closed) throw error(who(q) + " has left (goodbye); cannot send " + std::to_string(msg_bytes) + " bytes");
        {
            while (off < n) {
                const ssize_t w = ::send(p.fd, data + off, n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w > 0) {
                    off += static_cast<size_t>(w);
                    continue;
                }
                if (w < 0 && errno == EINTR) continue;
                if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                    // Full socket buffer: read meanwhile (the peer may be blocked sending to us).
                    if (!wait_io(deadline, q))
                        throw error(rank_text(rank_) + " timed out after " + std::to_string(timeout_.count()) +
                                    " ms sending " + std::to_string(msg_bytes) + " bytes to rank " + std::to_string(q));
                    throw_if_failed(q, true);
                    continue;
                }
                const int e = errno;
                pump(q);  // an EOF / reset that explains the error, if it arrived
                mark_dead(q, who(q) + (e == EPIPE || e == ECONNRESET ? " exited" : " is unreachable: " + net::errno_text(e)));
                throw_if_failed(q, false);
            }
        }
    }

    void receive(int q, void *data, size_t bytes, clk::time_point deadline) {
        check_peer(q, "receive from");
        std::lock_guard<std::mutex> io(io_mu_);
        peer_conn &p = peers_[static_cast<size_t>(q)];
        for (;;) {
            bool aborted;
            {
                std::lock_guard<std::mutex> lock(st_mu_);
                aborted = !self_failed_.empty();
            }
            if (aborted) throw_if_failed(q, false);
            pump(q);
            if (!p.box.empty()) {  // delivered messages are consumed even when a peer failed afterwards
                std::vector<unsigned char> msg = std::move(p.box.front());
                p.box.pop_front();
                if (msg.size() != bytes)
                    throw error(rank_text(rank_) + " expected " + std::to_string(bytes) + " bytes from rank " +
                                std::to_string(q) + ", got " + std::to_string(msg.size()));
                if (bytes) std::memcpy(data, msg.data(), bytes);
                return;
            }
            throw_if_failed(q, true);
            if (p.closed)
                throw error(who(q) + " left (goodbye) before sending " + std::to_string(bytes) + " bytes");
            if (!wait_io(deadline, -1))
                throw error(rank_text(rank_) + " timed out after " + std::to_string(timeout_.count()) +
                            " ms waiting for " + std::to_string(bytes) + " bytes from rank " + std::to_string(q));
        }
    }

    int rank_;
    std::vector<peer_conn> peers_;  // [rank]; this rank's entry unused
    std::chrono::milliseconds timeout_;
    int wake_fd_ = -1;
    std::mutex io_mu_;  // held by the thread inside send/recv/goodbye
    mutable std::mutex st_mu_;
    std::string self_failed_;  // abort reason ("" = not aborted)
    bool abort_sent_ = false;
    bool bye_sent_ = false;
    int dead_ = -1;
    std::atomic<bool> peer_failed_{false};
};

}  // namespace

// ---- joining ------------------------------------------------------------------------------------------

namespace {

// Closes the sockets of a join that throws.
struct fd_guard {
    std::vector<peer_conn> *peers;
    std::vector<int> extra;
    bool armed = true;
    ~fd_guard() {
        if (!armed) return;
        for (auto &p : *peers)
            if (p.fd >= 0) ::close(p.fd);
        for (int fd : extra)
            if (fd >= 0) ::close(fd);
    }
};

// poll `fds` for at most poll_step (or until deadline), running on_wait; the poll result.
int poll_step_wait(std::vector<pollfd> &fds, clk::time_point deadline, const socket_options &o) {
    if (o.on_join_wait) o.on_join_wait();
    const auto until = std::min(deadline, clk::now() + poll_step);
    int r;
    while ((r = ::poll(fds.data(), fds.size(), net::ms_left(until))) < 0 && errno == EINTR) {
    }
    return r;
}

std::string list_ranks(const std::set<int> &s) {
    std::string out;
    for (int r : s) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
}

// Accept hellos on `l` from every rank in `missing` (token checked; strays ignored) into peers; with
// watch >= 0 also fail when that socket (the connection to rank 0) closes. Answers each hello with
// `reply` when non-empty. Returns the hellos by rank.
std::vector<hello> accept_hellos(liveness_listener &l, const std::string &token, int me, int size,
                                 std::set<int> missing, std::vector<peer_conn> &peers, int watch,
                                 const std::string &reply, clk::time_point deadline,
                                 std::chrono::milliseconds timeout, const socket_options &o) {
    std::vector<hello> got(static_cast<size_t>(size));
    while (!missing.empty()) {
        std::vector<pollfd> fds{{l.fd(), POLLIN, 0}};
        if (watch >= 0) fds.push_back({watch, POLLIN, 0});
        const int r = poll_step_wait(fds, deadline, o);
        if (r < 0) throw error(rank_text(me) + ": socket transport: poll: " + net::errno_text(errno));
        if (watch >= 0 && fds[1].revents) throw error(rank_text(me) + ": rank 0 left while the ranks were joining");
        if (r == 0) {
            if (clk::now() < deadline) continue;
            throw error(rank_text(me) + " timed out after " + std::to_string(timeout.count()) +
                        " ms waiting for rank(s) " + list_ranks(missing) + " to join at " + l.address() +
                        " (are all " + std::to_string(size) + " ranks started?)");
        }
        if (!(fds[0].revents & POLLIN)) continue;
        const int fd = ::accept4(l.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) continue;  // EAGAIN / ECONNABORTED: the next poll decides
        // A stray connection gets 2 s to say something; it cannot hold the join for longer.
        const auto h = parse_hello(net::read_line(fd, std::min(deadline, clk::now() + std::chrono::seconds(2)), max_line));
        if (!h || h->token != token) {
            ::close(fd);
            continue;
        }
        std::string bad;
        if (h->size != size)
            bad = "rank " + std::to_string(h->rank) + " joined with size " + std::to_string(h->size) + ", rank " +
                  std::to_string(me) + " has " + std::to_string(size);
        else if (!missing.count(h->rank))
            bad = "rank " + std::to_string(h->rank) + " joined twice or was not expected here";
        if (!bad.empty()) {
            ::close(fd);
            throw error(rank_text(me) + ": socket transport: " + bad);
        }
        if (!reply.empty() && !net::write_all(fd, reply, deadline)) {
            ::close(fd);  // gone already: it stays missing and the deadline names it
            continue;
        }
        net::set_keepalive(fd);
        peer_conn &p = peers[static_cast<size_t>(h->rank)];
        p.fd = fd;
        p.pid = h->pid;
        p.host = h->host;
        got[static_cast<size_t>(h->rank)] = *h;
        missing.erase(h->rank);
    }
    return got;
}

}  // namespace

socket_root::socket_root(const std::string &host) {
    listener_ = std::make_unique<liveness_listener>(host);
    token_ = random_token();
    id_ = token_ + "@" + listener_->address();
}

std::unique_ptr<socket_transport> make_socket_transport(socket_root root, int size, const socket_options &o) {
    if (size < 1 || size > 1024) throw error("dist: socket transport needs 1..1024 ranks, got " + std::to_string(size));
    const auto deadline = clk::now() + o.join_timeout;
    std::vector<peer_conn> peers(static_cast<size_t>(size));
    fd_guard guard{&peers, {}};
    std::set<int> missing;
    for (int r = 1; r < size; ++r) missing.insert(r);
    const auto got = accept_hellos(root.listener(), root.token(), 0, size, missing, peers, -1, "", deadline,
                                   o.join_timeout, o);
    // Everyone is here: answer with rank 0's hello and the mesh table.
    std::string mesh = "mesh";
    for (int r = 1; r < size; ++r) {
        const hello &h = got[static_cast<size_t>(r)];
        mesh += " " + h.addr + " " + std::to_string(h.pid) + " " + h.host;
    }
    mesh += "\n";
    const std::string reply = hello_text(root.token(), 0, size, "-") + mesh;
    for (int r = 1; r < size; ++r)
        if (!net::write_all(peers[static_cast<size_t>(r)].fd, reply, deadline))
            throw error("dist: rank 0: rank " + std::to_string(r) + " (pid " + std::to_string(peers[static_cast<size_t>(r)].pid) +
                        ") left while the ranks were joining");
    // Wait for every rank's "ok" (its connections to the other ranks are made).
    std::set<int> waiting = missing;
    while (!waiting.empty()) {
        std::vector<pollfd> fds;
        for (int r : waiting) fds.push_back({peers[static_cast<size_t>(r)].fd, POLLIN, 0});
        const int n = poll_step_wait(fds, deadline, o);
        if (n < 0) throw error("dist: rank 0: socket transport: poll: " + net::errno_text(errno));
        if (n == 0) {
            if (clk::now() < deadline) continue;
            throw error("dist: rank 0 timed out after " + std::to_string(o.join_timeout.count()) +
                        " ms waiting for rank(s) " + list_ranks(waiting) + " to connect to the other ranks");
        }
        size_t i = 0;
        for (auto it = waiting.begin(); it != waiting.end(); ++i) {
            const int r = *it;
            if (!fds[i].revents) {
                ++it;
                continue;
            }
            const peer_conn &p = peers[static_cast<size_t>(r)];
            const auto line = net::read_line(p.fd, deadline, max_line);
            if (!line || *line != "ok")
                throw error("dist: rank 0: rank " + std::to_string(r) + " (pid " + std::to_string(p.pid) + ", host " +
                            p.host + ") left while the ranks were joining");
            it = waiting.erase(it);
        }
    }
    guard.armed = false;
    return std::make_unique<socket_endpoint>(0, std::move(peers), o.timeout);
}

std::unique_ptr<socket_transport> make_socket_transport(int rank, int size, const std::string &id,
                                                        const socket_options &o) {
    if (rank < 1 || rank >= size || size > 1024)
        throw error("dist: socket transport: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                    " cannot join (ranks 1.." + std::to_string(size - 1) + " join rank 0)");
    const size_t at = id.find('@');
    if (at == std::string::npos || at == 0 || id.find_first_of(" \t\r\n") != std::string::npos)
        throw error("dist: socket transport id '" + id + "' is not token@host:port");
    const std::string token = id.substr(0, at), root_addr = id.substr(at + 1);
    const std::string me = rank_text(rank) + ": ";
    const auto deadline = clk::now() + o.join_timeout;
    std::vector<peer_conn> peers(static_cast<size_t>(size));
    fd_guard guard{&peers, {}};
    peer_conn &p0 = peers[0];
    p0.fd = net::connect_address(root_addr, deadline, me, "rank 0", "socket transport");
    // Listen where rank 0 reaches us: the local address of this connection.
    liveness_listener l(net::local_ip(p0.fd));
    if (!net::write_all(p0.fd, hello_text(token, rank, size, l.address()), deadline))
        throw error(me + "rank 0 at " + root_addr + " closed the connection during the hello");
    // Rank 0 answers once every rank has joined (that can take a model load): wait in steps.
    for (;;) {
        std::vector<pollfd> fds{{p0.fd, POLLIN, 0}};
        const int r = poll_step_wait(fds, deadline, o);
        if (r > 0) break;
        if (r < 0 && errno != EINTR) throw error(me + "socket transport: poll: " + net::errno_text(errno));
        if (clk::now() >= deadline)
            throw error(me + "timed out after " + std::to_string(o.join_timeout.count()) +
                        " ms waiting for rank 0 at " + root_addr + " to answer (are all " + std::to_string(size) +
                        " ranks started?)");
    }
    const auto h0 = parse_hello(net::read_line(p0.fd, deadline, max_line));
    const auto mesh = net::read_line(p0.fd, deadline, max_line);
    if (!h0 || h0->token != token || h0->rank != 0 || h0->size != size || !mesh)
        throw error(me + "rank 0 at " + root_addr + " refused the hello or left (a different run, size or id?)");
    net::set_keepalive(p0.fd);
    p0.pid = h0->pid;
    p0.host = h0->host;
    std::istringstream in(*mesh);
    std::string word;
    in >> word;
    std::vector<std::string> addr(static_cast<size_t>(size));
    for (int r = 1; r < size; ++r) {
        peer_conn &p = peers[static_cast<size_t>(r)];
        if (!(in >> addr[static_cast<size_t>(r)] >> p.pid >> p.host) || word != "mesh")
            throw error(me + "rank 0 sent a malformed mesh table");
    }
    // Connect to the lower ranks (each answers with its hello), then accept the higher ones.
    for (int j = 1; j < rank; ++j) {
        peer_conn &p = peers[static_cast<size_t>(j)];
        p.fd = net::connect_address(addr[static_cast<size_t>(j)], deadline, me, "rank " + std::to_string(j),
                                    "socket transport");
        const bool sent = net::write_all(p.fd, hello_text(token, rank, size, "-"), deadline);
        const auto h = sent ? parse_hello(net::read_line(p.fd, deadline, max_line)) : std::nullopt;
        if (!h || h->token != token || h->rank != j)
            throw error(me + "rank " + std::to_string(j) + " at " + addr[static_cast<size_t>(j)] +
                        " refused the hello or left");
        net::set_keepalive(p.fd);
    }
    std::set<int> higher;
    for (int j = rank + 1; j < size; ++j) higher.insert(j);
    accept_hellos(l, token, rank, size, higher, peers, p0.fd, hello_text(token, rank, size, "-"), deadline,
                  o.join_timeout, o);
    if (!net::write_all(p0.fd, "ok\n", deadline)) throw error(me + "rank 0 left while the ranks were joining");
    guard.armed = false;
    return std::make_unique<socket_endpoint>(rank, std::move(peers), o.timeout);
}

}  // namespace fathom::dist
