// Socket transport (src/dist/socket_transport.*) between real processes (fork): messages arrive in
// order per pair with their exact sizes over the full mesh (including 1 MiB messages sent by every rank
// to every rank at once, which needs the send path to keep reading); a size mismatch is one line and the
// stream stays usable; recv has its deadline; an abort reason crosses; a SIGKILLed peer (rank 0 or not)
// is reported within 1 s with the pid fork() returned; a goodbye before exit is not a death; bad ids,
// missing ranks and a cancelled join are one-line errors.
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <functional>
#include <thread>

#include "core/error.h"
#include "dist/dist_test_util.h"
#include "dist/socket_transport.h"

namespace {

using namespace fathom;
using dist_test::error_of;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;
using dist::make_socket_transport;
using dist::socket_options;
using dist::socket_root;
using dist::socket_transport;

// A forked child running f; what f returns (or "THROW: <what>") comes back through a pipe. Child exit
// codes: 0 f returned, 3 it threw. Only single-threaded tests fork (the transport starts no threads).
struct proc {
    pid_t pid = -1;
    int out = -1;  // read end of the child's result pipe

    static proc start(const std::function<std::string()> &f) {
        int p[2];
        if (::pipe(p) != 0) throw std::runtime_error("pipe");
        proc c;
        c.pid = ::fork();
        if (c.pid == 0) {
            ::close(p[0]);
            std::string r;
            int code = 0;
            try {
                r = f();
            } catch (const std::exception &e) {
                r = std::string("THROW: ") + e.what();
                code = 3;
            }
            size_t off = 0;
            while (off < r.size()) {
                const ssize_t n = ::write(p[1], r.data() + off, r.size() - off);
                if (n <= 0) break;
                off += static_cast<size_t>(n);
            }
            ::_exit(code);
        }
        ::close(p[1]);
        c.out = p[0];
        return c;
    }
    // Wait for the child; its result text and wait status.
    std::pair<std::string, int> finish() {
        std::string r;
        char b[4096];
        ssize_t n;
        while ((n = ::read(out, b, sizeof b)) > 0) r.append(b, static_cast<size_t>(n));
        ::close(out);
        int st = 0;
        EXPECT_EQ(::waitpid(pid, &st, 0), pid);
        return {r, st};
    }
};

socket_options opts(std::chrono::milliseconds timeout = 10s) {
    socket_options o;
    o.timeout = timeout;
    o.join_timeout = 10s;
    return o;
}

// Message i from `from` to `to`: sizes cover empty, odd and larger-than-a-socket-buffer messages.
std::vector<unsigned char> pattern(int from, int to, int i) {
    static const size_t sizes[] = {0, 1, 7, 4096, (1u << 20) + 3, 5};
    std::vector<unsigned char> v(sizes[i]);
    for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<unsigned char>(k * 31 + from * 7 + to * 3 + i);
    return v;
}
constexpr int n_msgs = 6;

// Every rank sends all its messages to every other rank first, then receives and checks everything.
std::string exchange(socket_transport &t) {
    const int P = t.size(), me = t.rank();
    for (int i = 0; i < n_msgs; ++i)
        for (int q = 0; q < P; ++q)
            if (q != me) {
                const auto m = pattern(me, q, i);
                t.send(q, m.data(), m.size());
            }
    for (int q = 0; q < P; ++q) {
        if (q == me) continue;
        for (int i = 0; i < n_msgs; ++i) {
            const auto want = pattern(q, me, i);
            std::vector<unsigned char> got(want.size(), 0xEE);  // poisoned
            t.recv(q, got.data(), got.size());
            if (got != want) return "rank " + std::to_string(me) + ": message " + std::to_string(i) + " from " +
                                    std::to_string(q) + " differs";
        }
    }
    return "ok";
}

TEST(dist_socket, ordered_exact_messages_over_the_full_mesh_and_goodbye_is_not_death) {
    constexpr int P = 3;
    socket_root root("127.0.0.1");
    const std::string id = root.id();
    std::vector<proc> kids;
    for (int r = 1; r < P; ++r)
        kids.push_back(proc::start([r, id] {
            auto t = make_socket_transport(r, P, id, opts());
            const std::string res = exchange(*t);
            int64_t done = 1;
            t->send(0, &done, sizeof done);
            return res;  // the transport's destructor says goodbye
        }));
    auto t = make_socket_transport(std::move(root), P, opts());
    for (int r = 1; r < P; ++r) EXPECT_EQ(t->peer_pid(r), kids[static_cast<size_t>(r - 1)].pid);
    EXPECT_EQ(exchange(*t), "ok");
    for (int r = 1; r < P; ++r) {
        int64_t done = 0;
        t->recv(r, &done, sizeof done);
        EXPECT_EQ(done, 1);
    }
    for (auto &k : kids) {
        const auto [res, st] = k.finish();
        EXPECT_EQ(res, "ok");
        EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    // Both children said goodbye and exited: not a death, but nothing more can come from them.
    int64_t x = 0;
    EXPECT_NE(error_of([&] { t->recv(1, &x, sizeof x); }).find("left (goodbye) before sending 8 bytes"),
              std::string::npos);
    EXPECT_NE(error_of([&] { t->recv_idle(2, &x, sizeof x); }).find("left (goodbye)"), std::string::npos);
    EXPECT_EQ(t->dead_peer(), -1);
}

TEST(dist_socket, size_mismatch_is_one_line_and_the_stream_stays_usable) {
    socket_root root("127.0.0.1");
    const std::string id = root.id();
    proc k = proc::start([id] {
        auto t = make_socket_transport(1, 2, id, opts());
        const int64_t a = 7;
        const int32_t b = 9;
        t->send(0, &a, sizeof a);
        t->send(0, &b, sizeof b);
        int32_t ack = 0;
        t->recv(0, &ack, sizeof ack);
        return std::to_string(ack);
    });
    auto t = make_socket_transport(std::move(root), 2, opts());
    char buf[16];
    EXPECT_EQ(error_of([&] { t->recv(1, buf, 16); }), "dist: rank 0 expected 16 bytes from rank 1, got 8");
    int32_t b = 0;
    t->recv(1, &b, sizeof b);
    EXPECT_EQ(b, 9);
    const int32_t ack = 42;
    t->send(1, &ack, sizeof ack);
    EXPECT_EQ(k.finish().first, "42");
    // Bad peers are refused before anything is sent.
    EXPECT_NE(error_of([&] { t->send(0, buf, 1); }).find("cannot send to rank 0"), std::string::npos);
    EXPECT_NE(error_of([&] { t->recv(2, buf, 1); }).find("cannot receive from rank 2"), std::string::npos);
}

TEST(dist_socket, recv_has_its_deadline) {
    socket_root root("127.0.0.1");
    const std::string id = root.id();
    int hold[2];
    ASSERT_EQ(::pipe(hold), 0);
    proc k = proc::start([id, hold] {
        ::close(hold[1]);
        auto t = make_socket_transport(1, 2, id, opts());
        char c;
        (void)!::read(hold[0], &c, 1);  // silent until the parent closes the pipe
        return std::string("ok");
    });
    ::close(hold[0]);
    auto t = make_socket_transport(std::move(root), 2, opts(300ms));
    int32_t x;
    const auto t0 = clk::now();
    EXPECT_EQ(error_of([&] { t->recv(1, &x, sizeof x); }),
              "dist: rank 0 timed out after 300 ms waiting for 4 bytes from rank 1");
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clk::now() - t0).count();
    EXPECT_GE(ms, 290);
    EXPECT_LT(ms, 2000);
    ::close(hold[1]);
    EXPECT_EQ(k.finish().first, "ok");
}

TEST(dist_socket, abort_reason_crosses_both_ways) {
    {
        socket_root root("127.0.0.1");
        const std::string id = root.id();
        proc k = proc::start([id] {
            auto t = make_socket_transport(1, 2, id, opts());
            t->abort("disk on fire\nsecond line");
            return std::string("ok");
        });
        auto t = make_socket_transport(std::move(root), 2, opts());
        int32_t x;
        EXPECT_EQ(error_of([&] { t->recv_idle(1, &x, sizeof x); }), "dist: rank 1 failed: disk on fire second line");
        EXPECT_NE(error_of([&] { t->send(1, &x, sizeof x); }).find("failed: disk on fire"), std::string::npos);
        EXPECT_EQ(k.finish().first, "ok");
    }
    {
        socket_root root("127.0.0.1");
        const std::string id = root.id();
        proc k = proc::start([id] {
            auto t = make_socket_transport(1, 2, id, opts());
            int32_t x;
            return error_of([&] { t->recv_idle(0, &x, sizeof x); });
        });
        auto t = make_socket_transport(std::move(root), 2, opts());
        t->abort("rank 0 gives up");
        int32_t x = 0;
        EXPECT_EQ(error_of([&] { t->send(1, &x, sizeof x); }), "dist: rank 0 aborted: rank 0 gives up");
        EXPECT_EQ(k.finish().first, "dist: rank 0 failed: rank 0 gives up");
    }
}

TEST(dist_socket, sigkilled_peer_is_reported_within_a_second) {
    // Rank 1 of 3 is killed while rank 0 and rank 2 idle: both see it at once, named with fork()'s pid.
    constexpr int P = 3;
    socket_root root("127.0.0.1");
    const std::string id = root.id();
    proc r1 = proc::start([id] {
        auto t = make_socket_transport(1, P, id, opts());
        ::pause();
        return std::string();
    });
    proc r2 = proc::start([id] {
        auto t = make_socket_transport(2, P, id, opts());
        int32_t x;
        const auto t0 = clk::now();
        const std::string e = error_of([&] { t->recv_idle(0, &x, sizeof x); });
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clk::now() - t0).count();
        return e + "|" + std::to_string(t->dead_peer()) + "|" + std::to_string(ms);
    });
    auto t = make_socket_transport(std::move(root), P, opts());
    std::this_thread::sleep_for(200ms);  // everyone idles
    ASSERT_EQ(::kill(r1.pid, SIGKILL), 0);
    const auto t0 = clk::now();
    int32_t x;
    const std::string e = error_of([&] { t->recv_idle(1, &x, sizeof x); });
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clk::now() - t0).count();
    const std::string who = "peer rank 1 (pid " + std::to_string(r1.pid) + ", host ";
    EXPECT_EQ(e.rfind("dist: rank 0: " + who, 0), 0u) << e;
    EXPECT_NE(e.find(") exited"), std::string::npos) << e;
    EXPECT_LT(ms, 1000);
    EXPECT_EQ(t->dead_peer(), 1);
    const auto [res2, st2] = r2.finish();
    EXPECT_EQ(res2.rfind("dist: rank 2: " + who, 0), 0u) << res2;
    EXPECT_NE(res2.find(") exited|1|"), std::string::npos) << res2;
    EXPECT_LT(std::stol(res2.substr(res2.rfind('|') + 1)), 1200) << res2;
    const auto [res1, st1] = r1.finish();
    EXPECT_TRUE(WIFSIGNALED(st1));
}

TEST(dist_socket, sigkilled_rank_0_is_reported_within_a_second) {
    // Rank 0 lives in a child (it publishes its id through the pipe); this process is rank 1.
    int idp[2];
    ASSERT_EQ(::pipe(idp), 0);
    const pid_t r0 = ::fork();
    if (r0 == 0) {
        ::close(idp[0]);
        try {
            socket_root root("127.0.0.1");
            const std::string id = root.id() + "\n";
            (void)!::write(idp[1], id.data(), id.size());
            auto t = make_socket_transport(std::move(root), 2, opts());
            ::pause();
        } catch (...) {
        }
        ::_exit(3);
    }
    ::close(idp[1]);
    std::string id;
    char c;
    while (::read(idp[0], &c, 1) == 1 && c != '\n') id += c;
    ::close(idp[0]);
    auto t = make_socket_transport(1, 2, id, opts());
    EXPECT_EQ(t->peer_pid(0), r0);
    std::this_thread::sleep_for(100ms);
    ASSERT_EQ(::kill(r0, SIGKILL), 0);
    const auto t0 = clk::now();
    int32_t x;
    const std::string e = error_of([&] { t->recv_idle(0, &x, sizeof x); });
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clk::now() - t0).count();
    EXPECT_EQ(e.rfind("dist: rank 1: peer rank 0 (pid " + std::to_string(r0) + ", host ", 0), 0u) << e;
    EXPECT_NE(e.find(") exited"), std::string::npos) << e;
    EXPECT_LT(ms, 1000);
    int st = 0;
    EXPECT_EQ(::waitpid(r0, &st, 0), r0);
}

TEST(dist_socket, join_errors_are_one_line) {
    EXPECT_EQ(error_of([] { make_socket_transport(1, 2, "nonsense", opts()); }),
              "dist: socket transport id 'nonsense' is not token@host:port");
    EXPECT_EQ(error_of([] { make_socket_transport(2, 2, "t@127.0.0.1:1", opts()); }),
              "dist: socket transport: rank 2 of 2 cannot join (ranks 1..1 join rank 0)");
    EXPECT_EQ(error_of([] { make_socket_transport(1, 2, "t@127.0.0.1", opts()); }),
              "dist: socket transport address '127.0.0.1' is not host:port");
    int port;
    {
        dist::liveness_listener l("127.0.0.1");  // a port nobody listens on afterwards
        port = l.port();
    }
    const std::string refused = error_of([&] { make_socket_transport(1, 2, "t@127.0.0.1:" + std::to_string(port), opts()); });
    EXPECT_EQ(refused.rfind("dist: rank 1: cannot connect to rank 0 at 127.0.0.1:" + std::to_string(port) + ": ", 0), 0u)
        << refused;
    socket_options o = opts();
    o.join_timeout = 300ms;
    socket_root root("127.0.0.1");
    const std::string addr = root.id().substr(root.id().find('@') + 1);
    EXPECT_EQ(error_of([&] { make_socket_transport(std::move(root), 3, o); }),
              "dist: rank 0 timed out after 300 ms waiting for rank(s) 1, 2 to join at " + addr +
                  " (are all 3 ranks started?)");
    // on_join_wait cancels a join at once (the launcher: a rank process already exited).
    socket_root root2("127.0.0.1");
    o.join_timeout = 10s;
    o.on_join_wait = [] { throw error("dist: rank 1 (pid 1) exited: status 1"); };
    const auto t0 = clk::now();
    EXPECT_EQ(error_of([&] { make_socket_transport(std::move(root2), 2, o); }), "dist: rank 1 (pid 1) exited: status 1");
    EXPECT_LT(clk::now() - t0, 1s);
    // One rank: no peers, nothing to join.
    auto t1 = make_socket_transport(socket_root("127.0.0.1"), 1, opts());
    EXPECT_EQ(t1->size(), 1);
}

}  // namespace
