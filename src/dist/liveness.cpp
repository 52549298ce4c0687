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

namespace fathom::dist {

namespace {

using clk = std::chrono::steady_clock;
constexpr const char *hello_magic = "fathom-live";
constexpr size_t max_line = 4096;  // hello lines and abort reasons are one short line

std::string errno_text(int e) { return std::strerror(e); }

// Milliseconds left until `deadline` (0 when passed; rounded up, so a poll() never ends early), as poll()
// wants them.
int ms_left(clk::time_point deadline) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clk::now()).count();
    return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

std::string one_line(std::string s) {
    for (char &c : s)
        if (c == '\n' || c == '\r') c = ' ';
    return s;
}

std::string this_host() {
    char b[256] = {};
    if (::gethostname(b, sizeof b - 1) != 0 || b[0] == 0) return "unknown";
    std::string h(b);
    for (char &c : h)
        if (c == ' ' || c == '\t') c = '_';
    return h;
}

// "host:port" or "[v6]:port" -> (host, port). Throws on anything else.
std::pair<std::string, std::string> split_address(const std::string &a) {
    const size_t colon = a.rfind(':');
    const auto bad = [&] { return error("dist: liveness address '" + a + "' is not host:port"); };
    if (colon == std::string::npos || colon == 0 || colon + 1 == a.size()) throw bad();
    std::string host = a.substr(0, colon), port = a.substr(colon + 1);
    if (port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5 || std::stoi(port) == 0 ||
        std::stoi(port) > 65535)
        throw bad();
    if (host.front() == '[') {
        if (host.size() < 3 || host.back() != ']') throw bad();
        host = host.substr(1, host.size() - 2);
    } else if (host.find(':') != std::string::npos) {
        throw bad();  // an IPv6 literal needs brackets
    }
    return {host, port};
}

struct addrinfo_list {
    addrinfo *head = nullptr;
    ~addrinfo_list() {
        if (head) ::freeaddrinfo(head);
    }
};

void resolve(const std::string &host, const std::string &port, bool passive, addrinfo_list &out) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    const int r = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &out.head);
    if (r != 0) throw error("dist: liveness: cannot resolve '" + host + "': " + ::gai_strerror(r));
}

// Keep-alive so a peer host that vanishes without a FIN is noticed (~10 s idle + 4 probes 5 s apart).
void set_keepalive(int fd) {
    int on = 1, idle = 10, intvl = 5, cnt = 4;
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// Write all of `s` to the non-blocking socket `fd` before `deadline`; false on error or timeout.
bool write_all(int fd, const std::string &s, clk::time_point deadline) {
    size_t off = 0;
    while (off < s.size()) {
        const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off += static_cast<size_t>(n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            pollfd p{fd, POLLOUT, 0};
            if (::poll(&p, 1, ms_left(deadline)) <= 0) return false;
            continue;
        }
        return false;
    }
    return true;
}

// Read one '\n'-terminated line (byte by byte: nothing after it may be consumed) before `deadline`.
// nullopt on EOF, error, timeout or an over-long line.
std::optional<std::string> read_line(int fd, clk::time_point deadline) {
    std::string line;
    for (;;) {
        char c;
        const ssize_t n = ::recv(fd, &c, 1, MSG_DONTWAIT);
        if (n == 1) {
            if (c == '\n') return line;
            if (line.size() >= max_line) return std::nullopt;
            line += c;
            continue;
        }
        if (n == 0) return std::nullopt;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return std::nullopt;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, ms_left(deadline)) <= 0) return std::nullopt;
    }
}

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

// Non-blocking connect to one resolved address before `deadline`; the socket, or -1 with `err` set.
int connect_one(const addrinfo *ai, clk::time_point deadline, std::string &err) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
        err = errno_text(errno);
        return -1;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
    if (errno != EINPROGRESS) {
        err = errno_text(errno);
        ::close(fd);
        return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int r;
    while ((r = ::poll(&p, 1, ms_left(deadline))) < 0 && errno == EINTR) {
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    if (r == 0) {
        err = "timed out";
    } else if (r < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0 || soerr != 0) {
        err = errno_text(soerr ? soerr : errno);
    } else {
        return fd;
    }
    ::close(fd);
    return -1;
}

}  // namespace

// ---- liveness_listener -------------------------------------------------------------------------------

liveness_listener::liveness_listener(const std::string &host) {
    if (host.empty()) throw error("dist: liveness host is empty");
    addrinfo_list ai;
    resolve(host, "0", true, ai);
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
    address_ = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port_);
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
    const auto [host, port] = split_address(address);
    const auto deadline = clk::now() + timeout;
    addrinfo_list ai;
    resolve(host, port, false, ai);
    std::string err = "no address";
    int fd = -1;
    for (const addrinfo *a = ai.head; a && fd < 0; a = a->ai_next) fd = connect_one(a, deadline, err);
    const std::string me = "dist: rank " + std::to_string(rank) + ": liveness: ";
    if (fd < 0) throw error(me + "cannot connect to rank 0 at " + address + ": " + err);
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
