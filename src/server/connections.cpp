// Connection lifecycle for `fathom serve` (see connections.h): head wait in one poller thread,
// one request per worker job, body deadline, per-address cap and lingering close.
#include "server/connections.h"

#include <httplib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

#include "fathom/error.h"

namespace fathom::server {

using clock_type = std::chrono::steady_clock;

// A request head larger than this is refused (the connection is closed): cpp-httplib caps lines
// at 8 KiB and headers at 100, and nothing we serve needs more.
constexpr size_t k_head_max = 32u << 10;
// After an early answer (413, 400 before the body was read), what the client still sends is read
// and dropped for this long before the socket is closed, so the client sees the answer rather
// than a reset.
constexpr std::chrono::milliseconds k_linger{2000};

// A body that stops arriving altogether: its read is failed this long after --body-timeout (the
// body reader answers 408 itself when bytes still trickle in; this is the backstop, with no answer:
// cpp-httplib sees a half-shut socket as dead).
constexpr std::chrono::milliseconds k_body_grace{1000};

static thread_local connection *tl_current = nullptr;

connection *connection_manager::current() { return tl_current; }

static std::string peer_address(int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getpeername(fd, reinterpret_cast<sockaddr *>(&ss), &len) != 0) return {};
    char buf[INET6_ADDRSTRLEN] = {0};
    if (ss.ss_family == AF_INET)
        inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in *>(&ss)->sin_addr, buf, sizeof(buf));
    else if (ss.ss_family == AF_INET6)
        inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6 *>(&ss)->sin6_addr, buf, sizeof(buf));
    return buf;
}

connection_manager::connection_manager(connection_limits lim, serve_fn serve) : lim_(lim), serve_(std::move(serve)) {
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) throw error(std::string("serve: eventfd: ") + std::strerror(errno));
    requests_ = std::make_unique<httplib::ThreadPool>(size_t(std::max(lim_.request_threads, 1)));
    control_ = std::make_unique<httplib::ThreadPool>(size_t(std::max(lim_.control_threads, 1)));
    poller_ = std::thread([this] { poll_loop(); });
}

connection_manager::~connection_manager() {
    stop();
    if (wake_fd_ >= 0) ::close(wake_fd_);
}

void connection_manager::wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void connection_manager::add(int fd) {
    auto c = std::make_shared<connection>();
    c->fd = fd;
    c->peer = peer_address(fd);
    {
        std::lock_guard<std::mutex> lk(mu_);
        int &n = per_peer_[c->peer];
        if (stopping_ || n >= lim_.max_per_client) {
            if (!stopping_) ++stats_.rejected_per_client;
            if (n == 0) per_peer_.erase(c->peer);
            ::shutdown(fd, SHUT_RDWR);
            ::close(fd);
            return;
        }
        ++n;
        c->deadline = clock_type::now() + lim_.header_timeout;
        conns_.push_back(c);
    }
    wake();
}

void connection_manager::close_locked(const std::shared_ptr<connection> &c) {
    if (c->fd < 0) return;
    ::close(c->fd);
    c->fd = -1;
    auto it = per_peer_.find(c->peer);
    if (it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
    conns_.remove(c);
}

// A deadline passed (under mu_).
void connection_manager::expire_locked(const std::shared_ptr<connection> &c) {
    if (c->st == connection::state::active) {
        // The worker is blocked reading a body that stopped coming: its read fails now.
        ::shutdown(c->fd, SHUT_RD);
        c->timed_out = true;
        c->body_due = false;
        ++stats_.body_timeouts;
        return;
    }
    if (c->st == connection::state::waiting && (c->got_bytes || c->served == 0)) ++stats_.header_timeouts;
    close_locked(c);
}

static bool is_control_method(std::string_view head) {
    for (std::string_view m : {"GET ", "HEAD ", "OPTIONS "})
        if (head.substr(0, m.size()) == m) return true;
    return false;
}

// Poll says the socket is readable (poller thread; c is waiting or draining).
void connection_manager::on_readable(const std::shared_ptr<connection> &c, std::vector<char> &buf) {
    if (c->st == connection::state::draining) {
        for (;;) {
            const ssize_t n = recv(c->fd, buf.data(), buf.size(), MSG_DONTWAIT);
            if (n > 0) continue;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
            std::lock_guard<std::mutex> lk(mu_);
            close_locked(c);
            return;
        }
    }
    const ssize_t n = recv(c->fd, buf.data(), buf.size(), MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    std::unique_lock<std::mutex> lk(mu_);
    if (n <= 0) {  // closed or failed
        close_locked(c);
        return;
    }
    const std::string_view head(buf.data(), size_t(n));  // the head, and maybe body bytes after it
    if (head.find("\r\n\r\n") == std::string_view::npos) {
        // A head too large to be ours, or no byte more than last time although poll said readable:
        // the client shut its side down mid-head (EOF keeps the socket readable).
        if (size_t(n) > k_head_max || size_t(n) <= c->peeked) {
            close_locked(c);
            return;
        }
        c->peeked = size_t(n);
        if (!c->got_bytes && c->served > 0) c->deadline = clock_type::now() + lim_.header_timeout;
        c->got_bytes = true;
        // Poll again only once more bytes than these have arrived (Linux honours SO_RCVLOWAT in poll).
        const int low = int(n) + 1;
        setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &low, sizeof(low));
        return;
    }
    const int one = 1;
    setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
    c->st = connection::state::active;
    c->peeked = 0;
    c->body_due = c->timed_out = c->close_after = false;
    lk.unlock();
    (is_control_method(head) ? control_ : requests_)->enqueue([this, c] { serve_on_worker(c); });
}

void connection_manager::poll_loop() {
    std::vector<pollfd> pfds;
    std::vector<std::shared_ptr<connection>> who;
    std::vector<char> buf(k_head_max + 1);
    for (;;) {
        pfds.assign(1, pollfd{wake_fd_, POLLIN, 0});
        who.clear();
        const auto now = clock_type::now();
        auto next = now + std::chrono::hours(1);
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stopping_) return;
            const std::vector<std::shared_ptr<connection>> all(conns_.begin(), conns_.end());
            for (const auto &c : all) {
                const bool active = c->st == connection::state::active;
                if (!active || c->body_due) {
                    if (c->deadline <= now) {
                        expire_locked(c);
                        continue;
                    }
                    next = std::min(next, c->deadline);
                }
                if (!active) {
                    pfds.push_back(pollfd{c->fd, POLLIN, 0});
                    who.push_back(c);
                }
            }
        }
        const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
        if (::poll(pfds.data(), pfds.size(), int(std::min<int64_t>(wait, 3600000))) < 0) {
            if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // ENOMEM: retry
            continue;
        }
        if (pfds[0].revents) {
            uint64_t v;
            [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof(v));
        }
        for (size_t i = 1; i < pfds.size(); ++i)
            if (pfds[i].revents) on_readable(who[i - 1], buf);
    }
}

void connection_manager::serve_on_worker(const std::shared_ptr<connection> &c) {
    tl_current = c.get();
    bool reuse = false;
    try {
        reuse = serve_(*c);
    } catch (...) {
        reuse = false;
    }
    tl_current = nullptr;
    finish(c, reuse);
}

void connection_manager::finish(const std::shared_ptr<connection> &c, bool reuse) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        ++c->served;
        c->body_due = false;
        if (stopping_ || (!reuse && !c->close_after)) {
            close_locked(c);
            return;
        }
        c->got_bytes = false;
        if (c->close_after) {  // answered before the body was read: drop what still comes, then close
            ::shutdown(c->fd, SHUT_WR);
            c->st = connection::state::draining;
            c->deadline = clock_type::now() + k_linger;
        } else {
            c->st = connection::state::waiting;
            c->deadline = clock_type::now() + std::min(lim_.keep_alive_idle, lim_.header_timeout);
        }
    }
    wake();
}

void connection_manager::body_started(connection &c) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        c.body_due = true;
        c.body_deadline = clock_type::now() + lim_.body_timeout;
        c.deadline = c.body_deadline + k_body_grace;
    }
    wake();
}

void connection_manager::body_timed_out() {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.body_timeouts;
}

void connection_manager::body_done(connection &c) {
    std::lock_guard<std::mutex> lk(mu_);
    c.body_due = false;
}

connection_stats connection_manager::stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
}

void connection_manager::stop() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stopping_) return;
        stopping_ = true;
    }
    wake();
    if (poller_.joinable()) poller_.join();
    {
        // Waiting and draining connections close now; active ones when their request ends.
        std::lock_guard<std::mutex> lk(mu_);
        const std::vector<std::shared_ptr<connection>> all(conns_.begin(), conns_.end());
        for (const auto &c : all)
            if (c->st != connection::state::active) close_locked(c);
    }
    requests_->shutdown();
    control_->shutdown();
}

}  // namespace fathom::server
