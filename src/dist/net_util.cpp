// TCP helpers of src/dist (see net_util.h); moved out of liveness.cpp so the socket transport shares them.
#include "dist/net_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace fathom::dist::net {

std::string errno_text(int e) { return std::strerror(e); }

int ms_left(clk::time_point deadline) {
    if (deadline == clk::time_point::max()) return -1;
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

std::pair<std::string, std::string> split_address(const std::string &a, const char *what) {
    const size_t colon = a.rfind(':');
    const auto bad = [&] { return error(std::string("dist: ") + what + " address '" + a + "' is not host:port"); };
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

std::string join_address(const std::string &host, int port) {
    return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

addrinfo_list::~addrinfo_list() {
    if (head) ::freeaddrinfo(head);
}

void resolve(const std::string &host, const std::string &port, bool passive, addrinfo_list &out, const char *what) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    const int r = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &out.head);
    if (r != 0) throw error(std::string("dist: ") + what + ": cannot resolve '" + host + "': " + ::gai_strerror(r));
}

void set_keepalive(int fd) {
    int on = 1, idle = 10, intvl = 5, cnt = 4;
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

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

std::optional<std::string> read_line(int fd, clk::time_point deadline, size_t max_line) {
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

int connect_address(const std::string &address, clk::time_point deadline, const std::string &who,
                    const std::string &peer, const char *what) {
    const auto [host, port] = split_address(address, what);
    addrinfo_list ai;
    resolve(host, port, false, ai, what);
    std::string err = "no address";
    int fd = -1;
    for (const addrinfo *a = ai.head; a && fd < 0; a = a->ai_next) fd = connect_one(a, deadline, err);
    if (fd < 0) throw error(who + "cannot connect to " + peer + " at " + address + ": " + err);
    return fd;
}

std::string local_ip(int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getsockname(fd, reinterpret_cast<sockaddr *>(&ss), &len) != 0)
        throw error("dist: getsockname: " + errno_text(errno));
    char b[INET6_ADDRSTRLEN] = {};
    const void *a = ss.ss_family == AF_INET6 ? static_cast<const void *>(&reinterpret_cast<sockaddr_in6 *>(&ss)->sin6_addr)
                                             : static_cast<const void *>(&reinterpret_cast<sockaddr_in *>(&ss)->sin_addr);
    if (!::inet_ntop(ss.ss_family, a, b, sizeof b)) throw error("dist: inet_ntop: " + errno_text(errno));
    return b;
}

}  // namespace fathom::dist::net
