// Liveness side channel (see liveness.h): TCP listener / connect with deadlines, the hello exchange,
// and the non-blocking poll that turns EOF into "peer exited".
#include "dist/liveness.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>

#include "core/error.h"
#include "dist/net_util.h"

namespace fathom::dist {

namespace {

using net::clk;
using net::errno_text;
using net::ms_left;
using net::one_line;
using net::set_keepalive;
using net::this_host;
using net::write_all;
constexpr const char *hello_magic = "fathom-live";
constexpr size_t max_line = 4096;  // hello lines and abort reasons are one short line

std::optional<std::string> read_line(int fd, clk::time_point deadline) { return net::read_line(fd, deadline, max_line); }

struct hello {
    std::string token;
    int rank = -1, size = 0;
    long pid = 0;
    std::string host;
};

std::string hello_text(const std::string &token, int rank, int size) {
    return std::string(hello_magic) + " " + token + " " + std::to_string(rank) + " " + std::to_string(size) + " " +
           std::to_string(static_cast<long>(::getpid())) + " " + this_host() + "\n";
}

std::optional<hello> parse_hello(const std::string &line) {
    std::istringstream in(line);
    std::string magic;
    hello h;
    if (!(in >> magic >> h.token >> h.rank >> h.size >> h.pid >> h.host) || magic != hello_magic) return std::nullopt;
    return h;
}

void check_token(const std::string &token) {
    if (token.empty() || token.find_first_of(" \t\r\n") != std::string::npos)
        throw error("dist: liveness token must be one non-empty word");
}

}  // namespace

// ---- liveness_listener -------------------------------------------------------------------------------

liveness_listener::liveness_listener(const std::string &host) {
    if (host.empty()) throw error("dist: liveness host is empty");
    net::addrinfo_list ai;
    net::resolve(host, "0", true, ai, "liveness");
    std::string err = "no address";
    for (const addrinfo *a = ai.head; a; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
            err = errno_text(errno);
            continue;
        }
        if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
            err = errno_text(errno);
            ::close(fd);
            continue;
        }
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        if (::getsockname(fd, reinterpret_cast<sockaddr *>(&ss), &len) != 0) {
            err = errno_text(errno);
            ::close(fd);
            continue;
        }
        port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6 *>(&ss)->sin6_port
                                               : reinterpret_cast<sockaddr_in *>(&ss)->sin_port);
        fd_ = fd;
        break;
    }
    if (fd_ < 0) throw error("dist: liveness: cannot listen on '" + host + "': " + err);
    address_ = net::join_address(host, port_);
}

liveness_listener::~liveness_listener() {
    if (fd_ >= 0) ::close(fd_);
}

// ---- liveness: joining ---------------------------------------------------------------------------------

std::unique_ptr<liveness> liveness::accept_ranks(liveness_listener &l, const std::string &token, int size,
                                                 std::chrono::milliseconds timeout) {
    check_token(token);
    if (size < 1) throw error("dist: liveness size must be positive");
    const auto deadline = clk::now() + timeout;
    std::vector<peer> peers;
    std::set<int> missing;
    for (int r = 1; r < size; ++r) missing.insert(r);
    auto cleanup = [&] {
        for (auto &p : peers) ::close(p.fd);
    };
    while (!missing.empty()) {
        pollfd pl{l.fd(), POLLIN, 0};
        const int r = ::poll(&pl, 1, ms_left(deadline));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            const int e = errno;
            cleanup();
            throw error("dist: rank 0: liveness: poll on the listener: " + errno_text(e));
        }
        if (r == 0) {
            cleanup();
            std::string who;
            for (int m : missing) who += (who.empty() ? "" : ", ") + std::to_string(m);
            throw error("dist: rank 0 timed out after " + std::to_string(timeout.count()) +
                        " ms waiting for the liveness connection of rank(s) " + who + " at " + l.address() +
                        " (are all " + std::to_string(size) + " ranks started?)");
        }
        const int fd = ::accept4(l.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) continue;  // EAGAIN / ECONNABORTED: the next poll decides
        const auto line = read_line(fd, deadline);
        const auto h = line ? parse_hello(*line) : std::nullopt;
        if (!h || h->token != token) {
            ::close(fd);  // not a rank of this run (or one that left at once): ignore it
            continue;
        }
        std::string bad;
        if (h->size != size)
            bad = "rank " + std::to_string(h->rank) + " joined with size " + std::to_string(h->size) + ", rank 0 has " +
                  std::to_string(size);
        else if (!missing.count(h->rank))
            bad = "rank " + std::to_string(h->rank) + " joined twice or is out of range 1.." + std::to_string(size - 1);
        if (!bad.empty()) {
            ::close(fd);
            cleanup();
            throw error("dist: rank 0: liveness: " + bad);
        }
        if (!write_all(fd, hello_text(token, 0, size), deadline)) {
            ::close(fd);  // that rank is already gone: it stays missing, and the deadline names it
            continue;
        }
        set_keepalive(fd);
        missing.erase(h->rank);
        peer p;
        p.rank = h->rank;
        p.pid = h->pid;
        p.host = h->host;
        p.fd = fd;
        peers.push_back(std::move(p));
    }
    return std::unique_ptr<liveness>(new liveness(0, std::move(peers)));
}

std::unique_ptr<liveness> liveness::connect_root(const std::string &address, const std::string &token, int rank,
                                                 int size, std::chrono::milliseconds timeout) {
    check_token(token);
    if (rank < 1 || rank >= size)
        throw error("dist: liveness: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                    " cannot connect to rank 0 (ranks 1.." + std::to_string(size - 1) + " do)");
    const auto deadline = clk::now() + timeout;
    const std::string me = "dist: rank " + std::to_string(rank) + ": liveness: ";
    const int fd = net::connect_address(address, deadline, me, "rank 0", "liveness");
    const auto line = write_all(fd, hello_text(token, rank, size), deadline) ? read_line(fd, deadline) : std::nullopt;
    const auto h = line ? parse_hello(*line) : std::nullopt;
    if (!h || h->token != token || h->rank != 0 || h->size != size) {
        ::close(fd);
        throw error(me + "rank 0 at " + address + " refused the hello or did not answer within " +
                    std::to_string(timeout.count()) + " ms (a different run, size or id?)");
    }
    set_keepalive(fd);
    peer p;
    p.rank = 0;
    p.pid = h->pid;
    p.host = h->host;
    p.fd = fd;
    std::vector<peer> peers;
    peers.push_back(std::move(p));
    return std::unique_ptr<liveness>(new liveness(rank, std::move(peers)));
}

liveness::~liveness() {
    for (auto &p : peers_)
        if (p.fd >= 0) ::close(p.fd);
}

// ---- liveness: polling -----------------------------------------------------------------------------------

std::optional<std::string> liveness::drain(peer &p) {
    const std::string who = "dist: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(p.rank) +
                            " (pid " + std::to_string(p.pid) + ", host " + p.host + ")";
    char buf[512];
    for (;;) {
        const ssize_t n = ::recv(p.fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) {
            p.inbox.append(buf, static_cast<size_t>(n));
            // Parse complete messages: 'B' (goodbye) and 'A' <reason> '\n' (abort).
            while (!p.inbox.empty()) {
                if (p.inbox[0] == 'B') {
                    p.said_bye = true;
                    p.inbox.erase(0, 1);
                } else if (p.inbox[0] == 'A') {
                    const size_t nl = p.inbox.find('\n');
                    if (nl == std::string::npos) {
                        if (p.inbox.size() > max_line) return who + " sent an over-long abort reason";
                        break;
                    }
                    return who + " failed: " + p.inbox.substr(1, nl - 1);
                } else {
                    return who + " sent an unknown liveness message";
                }
            }
            continue;
        }
        if (n == 0) {
            if (p.said_bye) {
                p.closed = true;  // a clean stop
                return std::nullopt;
            }
            return who + " exited";
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return std::nullopt;
        if (p.said_bye) {
            p.closed = true;
            return std::nullopt;
        }
        // A killed process with unread bytes resets the connection instead of closing it.
        if (errno == ECONNRESET) return who + " exited";
        return who + " is unreachable: " + errno_text(errno);
    }
}

std::optional<std::string> liveness::check() {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return failed_;
    pollfd fds[64];
    size_t i = 0;
    while (i < peers_.size()) {
        // Poll in batches of 64 (no allocation in the hot wait loop).
        size_t n = 0, first = i;
        for (; i < peers_.size() && n < 64; ++i) fds[n++] = {peers_[i].closed ? -1 : peers_[i].fd, POLLIN, 0};
        if (::poll(fds, n, 0) <= 0) continue;
        for (size_t k = 0; k < n; ++k) {
            if (fds[k].fd < 0 || fds[k].revents == 0) continue;
            if (auto why = drain(peers_[first + k])) {
                failed_ = why;
                return failed_;
            }
        }
    }
    return std::nullopt;
}

void liveness::send_all(const std::string &bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = clk::now() + std::chrono::milliseconds(200);  // never hang on a stuck peer
    for (auto &p : peers_)
        if (!p.closed) write_all(p.fd, bytes, deadline);
}

void liveness::say_bye() { send_all("B"); }

void liveness::say_abort(const std::string &why) {
    std::string w = one_line(why.empty() ? "aborted" : why);
    if (w.size() > max_line - 2) w.resize(max_line - 2);
    send_all("A" + w + "\n");
}

}  // namespace fathom::dist
