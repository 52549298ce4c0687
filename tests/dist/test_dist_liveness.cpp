// Liveness side channel (src/dist/liveness.*) between real processes (fork): a SIGKILLed peer is
// reported within 100 ms with its rank and pid (the pid fork() returned is the independent truth), in
// both directions (rank 0 <- rank r, rank r <- rank 0); a goodbye before exit is not a death; an abort
// reason crosses; bad addresses, missing ranks and stray connections give clear one-line errors.
#include <gtest/gtest.h>

#include <csignal>
#include <functional>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "core/error.h"
#include "dist/dist_test_util.h"
#include "dist/liveness.h"

namespace {

using namespace fathom;
using dist_test::error_of;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;
using dist::liveness;
using dist::liveness_listener;

const std::string tok = "t0k3n";

std::string host_name() {
    char b[256] = {};
    ::gethostname(b, sizeof b - 1);
    return b;
}

// A child process running `f` after fork(); it then reads commands from a pipe: 'k' = SIGKILL itself
// (no goodbye, no cleanup), 'b' = say goodbye and exit 0, 'x' = exit 0 without a goodbye. Exit 3 if f
// threw. Only single-threaded tests fork.
struct child {
    pid_t pid = -1;
    int cmd = -1;  // write end of the command pipe

    static child start(const std::function<std::unique_ptr<liveness>()> &f) {
        int p[2];
        if (::pipe(p) != 0) throw std::runtime_error("pipe");
        child c;
        c.pid = ::fork();
        if (c.pid == 0) {
            ::close(p[1]);
            std::unique_ptr<liveness> live;
            try {
                live = f();
            } catch (...) {
                ::_exit(3);
            }
            char x = 0;
            if (::read(p[0], &x, 1) != 1) ::_exit(4);
            if (x == 'k') ::kill(::getpid(), SIGKILL);
            if (x == 'b') live->say_bye();
            ::_exit(0);
        }
        ::close(p[0]);
        c.cmd = p[1];
        return c;
    }

    // Send a command and wait until the process is gone; its wait status.
    int finish(char what) {
        EXPECT_EQ(::write(cmd, &what, 1), 1);
        ::close(cmd);
        int st = 0;
        EXPECT_EQ(::waitpid(pid, &st, 0), pid);
        return st;
    }
};

// Poll check() for up to `limit`; the reason and how long it took to appear.
std::pair<std::optional<std::string>, clk::duration> poll_for(liveness &l, clk::duration limit) {
    const auto t0 = clk::now();
    for (;;) {
        if (auto why = l.check()) return {why, clk::now() - t0};
        if (clk::now() - t0 > limit) return {std::nullopt, clk::now() - t0};
        std::this_thread::sleep_for(1ms);
    }
}

TEST(dist_liveness, sigkilled_rank_is_reported_to_rank0_within_100ms) {
    liveness_listener l("127.0.0.1");
    const std::string addr = l.address();
    ASSERT_EQ(addr, "127.0.0.1:" + std::to_string(l.port()));
    child c1 = child::start([&] { return liveness::connect_root(addr, tok, 1, 3, 5000ms); });
    child c2 = child::start([&] { return liveness::connect_root(addr, tok, 2, 3, 5000ms); });
    auto live = liveness::accept_ranks(l, tok, 3, 5000ms);
    ASSERT_EQ(live->peers().size(), 2u);
    for (const auto &p : live->peers()) EXPECT_EQ(p.pid, p.rank == 1 ? c1.pid : c2.pid) << "rank " << p.rank;
    EXPECT_FALSE(live->check().has_value());  // both alive

    const int st = c2.finish('k');
    ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    const auto [why, took] = poll_for(*live, 1s);
    ASSERT_TRUE(why.has_value());
    EXPECT_EQ(*why, "dist: rank 0: peer rank 2 (pid " + std::to_string(c2.pid) + ", host " + host_name() + ") exited");
    EXPECT_LT(took, 100ms);
    EXPECT_EQ(live->check(), why);  // sticky
    c1.finish('b');
}

TEST(dist_liveness, sigkilled_rank0_is_reported_to_rank1_within_100ms) {
    auto l = std::make_unique<liveness_listener>("127.0.0.1");
    const std::string addr = l->address();
    child c0 = child::start([&] { return liveness::accept_ranks(*l, tok, 2, 5000ms); });
    l.reset();  // the child accepts; this process only connects
    auto live = liveness::connect_root(addr, tok, 1, 2, 5000ms);
    ASSERT_EQ(live->peers().size(), 1u);
    EXPECT_EQ(live->peers()[0].rank, 0);
    EXPECT_EQ(live->peers()[0].pid, c0.pid);
    EXPECT_FALSE(live->check().has_value());

    const int st = c0.finish('k');
    ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    const auto [why, took] = poll_for(*live, 1s);
    ASSERT_TRUE(why.has_value());
    EXPECT_EQ(*why, "dist: rank 1: peer rank 0 (pid " + std::to_string(c0.pid) + ", host " + host_name() + ") exited");
    EXPECT_LT(took, 100ms);
}

TEST(dist_liveness, goodbye_then_exit_is_not_a_death_but_plain_exit_is) {
    liveness_listener l("127.0.0.1");
    const std::string addr = l.address();
    child c1 = child::start([&] { return liveness::connect_root(addr, tok, 1, 3, 5000ms); });
    child c2 = child::start([&] { return liveness::connect_root(addr, tok, 2, 3, 5000ms); });
    auto live = liveness::accept_ranks(l, tok, 3, 5000ms);

    int st = c1.finish('b');  // goodbye, then exit 0: the socket is closed by now
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    EXPECT_FALSE(poll_for(*live, 150ms).first.has_value());
    const auto &p1 = live->peers()[live->peers()[0].rank == 1 ? 0 : 1];
    EXPECT_TRUE(p1.said_bye);
    EXPECT_TRUE(p1.closed);

    st = c2.finish('x');  // a normal exit(0) without the goodbye is still a death to the peers
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    const auto why = poll_for(*live, 1s).first;
    ASSERT_TRUE(why.has_value());
    EXPECT_EQ(*why, "dist: rank 0: peer rank 2 (pid " + std::to_string(c2.pid) + ", host " + host_name() + ") exited");
}

TEST(dist_liveness, abort_reason_reaches_the_peer_before_the_exit) {
    liveness_listener l("127.0.0.1");
    const std::string addr = l.address();
    child c1 = child::start([&] {
        auto live = liveness::connect_root(addr, tok, 1, 2, 5000ms);
        live->say_abort("dist: rank 1 timed out\nafter 5000 ms");  // flattened to one line
        return live;
    });
    auto live = liveness::accept_ranks(l, tok, 2, 5000ms);
    const auto why = poll_for(*live, 1s).first;  // the child is still alive (waits for a command)
    ASSERT_TRUE(why.has_value());
    EXPECT_EQ(*why, "dist: rank 0: peer rank 1 (pid " + std::to_string(c1.pid) + ", host " + host_name() +
                        ") failed: dist: rank 1 timed out after 5000 ms");
    c1.finish('x');
}

TEST(dist_liveness, bad_addresses_are_one_line_errors) {
    for (const std::string a : {"nonsense", "127.0.0.1:", ":80", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1:8x",
                                "::1:5000", "[::1:5000"})
        EXPECT_EQ(error_of([&] { liveness::connect_root(a, tok, 1, 2, 500ms); }),
                  "dist: liveness address '" + a + "' is not host:port");
    // A port nobody listens on: refused at once, not after the deadline.
    int port = 0;
    {
        liveness_listener gone("127.0.0.1");
        port = gone.port();
    }
    const auto t0 = clk::now();
    const std::string e = error_of([&] { liveness::connect_root("127.0.0.1:" + std::to_string(port), tok, 1, 2, 5000ms); });
    EXPECT_EQ(e, "dist: rank 1: liveness: cannot connect to rank 0 at 127.0.0.1:" + std::to_string(port) +
                     ": Connection refused");
    EXPECT_LT(clk::now() - t0, 1s);
    // An address that is not this host's cannot be listened on (192.0.2.0/24 is TEST-NET-1).
    EXPECT_EQ(error_of([] { liveness_listener x("192.0.2.1"); }),
              "dist: liveness: cannot listen on '192.0.2.1': Cannot assign requested address");
    EXPECT_EQ(error_of([] { liveness_listener x(""); }), "dist: liveness host is empty");
    EXPECT_NE(error_of([] { liveness::connect_root("127.0.0.1:1", tok, 0, 2, 500ms); }).find("rank 0 of 2 cannot connect"),
              std::string::npos);
    EXPECT_EQ(error_of([] { liveness::connect_root("127.0.0.1:1", "two words", 1, 2, 500ms); }),
              "dist: liveness token must be one non-empty word");
}

TEST(dist_liveness, missing_rank_times_out_naming_it) {
    liveness_listener l("127.0.0.1");
    std::unique_ptr<liveness> r2;
    std::thread t([&] { r2 = liveness::connect_root(l.address(), tok, 2, 3, 5000ms); });
    const auto t0 = clk::now();
    const std::string e = error_of([&] { liveness::accept_ranks(l, tok, 3, 300ms); });
    const auto took = clk::now() - t0;
    t.join();
    EXPECT_EQ(e, "dist: rank 0 timed out after 300 ms waiting for the liveness connection of rank(s) 1 at " +
                     l.address() + " (are all 3 ranks started?)");
    // Waited for the deadline, not less (poll()'s millisecond granularity can end it a fraction of a
    // millisecond before steady_clock's 300 ms; 290 ms still catches an early give-up).
    EXPECT_GE(took, 290ms);
    EXPECT_LT(took, 2s);
    ASSERT_TRUE(r2);  // rank 2 did join; rank 0 has given up and closed its side since
    const auto why = poll_for(*r2, 1s).first;
    ASSERT_TRUE(why.has_value());
    EXPECT_NE(why->find("dist: rank 2: peer rank 0 (pid " + std::to_string(::getpid())), std::string::npos) << *why;
}

TEST(dist_liveness, stray_connection_is_ignored_and_mismatched_size_refused) {
    liveness_listener l("127.0.0.1");
    std::unique_ptr<liveness> root;
    std::string root_error;
    std::thread t([&] {
        root_error = error_of([&] { root = liveness::accept_ranks(l, tok, 2, 3000ms); });
    });
    // Another run's rank (other token): rank 0 closes it and keeps waiting.
    EXPECT_EQ(error_of([&] { liveness::connect_root(l.address(), "other", 1, 2, 1000ms); }),
              "dist: rank 1: liveness: rank 0 at " + l.address() +
                  " refused the hello or did not answer within 1000 ms (a different run, size or id?)");
    auto r1 = liveness::connect_root(l.address(), tok, 1, 2, 1000ms);
    t.join();
    EXPECT_EQ(root_error, "");
    ASSERT_TRUE(root);
    EXPECT_EQ(root->peers().size(), 1u);
    EXPECT_FALSE(root->check().has_value());
    EXPECT_FALSE(r1->check().has_value());

    // A rank of this run started with another size is a configuration error on rank 0.
    liveness_listener l2("127.0.0.1");
    std::thread t2([&] { root_error = error_of([&] { liveness::accept_ranks(l2, tok, 2, 3000ms); }); });
    const std::string e = error_of([&] { liveness::connect_root(l2.address(), tok, 1, 3, 1000ms); });
    t2.join();
    EXPECT_EQ(root_error, "dist: rank 0: liveness: rank 1 joined with size 3, rank 0 has 2");
    EXPECT_NE(e.find("refused the hello"), std::string::npos) << e;
}

}  // namespace
