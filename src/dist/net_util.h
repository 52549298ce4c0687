// Small TCP helpers shared by the multi-process pieces of src/dist: the liveness side channel
// (liveness.cpp) and the socket transport (socket_transport.cpp). Every socket they create is
// close-on-exec (a spawned rank must not inherit a peer's connection: the kernel closes a dead
// process's sockets only when no other process holds them) and non-blocking; every wait has a deadline.
#pragma once
#include <netdb.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>

namespace fathom::dist::net {

using clk = std::chrono::steady_clock;

std::string errno_text(int e);

// Milliseconds left until `deadline` as poll() wants them (0 when passed; rounded up, so a poll never
// ends early); clk::time_point::max() -> -1 (no deadline).
int ms_left(clk::time_point deadline);

// `s` with line breaks replaced by spaces (abort reasons and hello fields are one line).
std::string one_line(std::string s);

// gethostname() with blanks replaced ("unknown" when it fails): one word for a hello line.
std::string this_host();

// "host:port" or "[v6]:port" -> (host, port). Throws "dist: <what> address 'A' is not host:port".
std::pair<std::string, std::string> split_address(const std::string &a, const char *what);

// "host:port" of a host and a port ("[host]:port" when host is an IPv6 literal).
std::string join_address(const std::string &host, int port);

struct addrinfo_list {
    addrinfo *head = nullptr;
    addrinfo_list() = default;
    addrinfo_list(const addrinfo_list &) = delete;
    addrinfo_list &operator=(const addrinfo_list &) = delete;
    ~addrinfo_list();
};

// getaddrinfo for a TCP stream socket. Throws "dist: <what>: cannot resolve 'host': ...".
void resolve(const std::string &host, const std::string &port, bool passive, addrinfo_list &out, const char *what);

// TCP_NODELAY plus keep-alive (10 s idle, 4 probes 5 s apart), so a peer host that vanishes without a
// FIN is noticed in about 30 s even by an idle rank.
void set_keepalive(int fd);

// Write all of `s` to the non-blocking socket `fd` before `deadline` (MSG_NOSIGNAL: a closed peer is an
// error, never a SIGPIPE); false on error or timeout.
bool write_all(int fd, const std::string &s, clk::time_point deadline);

// Read one '\n'-terminated line byte by byte (nothing after it is consumed) before `deadline`.
// nullopt on EOF, error, timeout or a line longer than `max_line`.
std::optional<std::string> read_line(int fd, clk::time_point deadline, size_t max_line);

// Non-blocking connect to one resolved address before `deadline`; the socket (close-on-exec,
// non-blocking), or -1 with `err` set.
int connect_one(const addrinfo *ai, clk::time_point deadline, std::string &err);

// Connect to "host:port" (every resolved address in turn) before `deadline`. Throws
// "<who>cannot connect to <peer> at A: <reason>"; a malformed or unresolvable address is reported as
// split_address / resolve do with `what`.
int connect_address(const std::string &address, clk::time_point deadline, const std::string &who,
                    const std::string &peer, const char *what);

// The local address of the connected socket `fd` (IP literal, no port): the interface this host uses
// to reach that peer, which is what a rank listens on for the other ranks.
std::string local_ip(int fd);

}  // namespace fathom::dist::net
