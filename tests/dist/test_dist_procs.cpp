// Rank processes (src/dist/rank_procs.*) without a model: this test binary is also the rank process
// (rank_procs spawns /proc/self/exe --gtest_filter=dist_procs_child.DISABLED_serve
// --gtest_also_run_disabled_tests --fathom-rank ...; the test dist_procs_child.DISABLED_serve runs only so,
// and skips without those arguments). The toy rank keeps one counter per session, so the tests see that
// sessions are multiplexed and freed correctly; commands make it die (SIGKILL), exit, or fail with a reason.
// Checked: per-session state, the in-flight operation and every later one fail with "dist: rank R (pid N)
// exited: <status>" (pid from rank_procs, status from waitpid), on_failure runs once, the other children are
// stopped, a rank that exits during the join is named, a clean stop reaps every child with no failure.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/dist_test_util.h"
#include "dist/rank_procs.h"

namespace {

using namespace fathom;
using dist_test::error_of;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

// Toy protocol, one step: rank 0 sends int64 {cmd, value} to every rank; cmd 1 add: the rank adds value
// to its session's counter and sends the counter back; 2 die: SIGKILL itself; 3 fail: throw; 4 exit 7.
enum toy_cmd : int64_t { cmd_add = 1, cmd_die = 2, cmd_fail = 3, cmd_exit = 4 };

class toy_session final : public dist::session_rank {
  public:
    explicit toy_session(dist::transport &t) : t_(t) {}
    void step() override {
        int64_t c[2];
        t_.recv(0, c, sizeof c);
        if (c[0] == cmd_die) ::kill(::getpid(), SIGKILL);
        if (c[0] == cmd_fail) throw error("toy rank " + std::to_string(t_.rank()) + " refuses");
        if (c[0] == cmd_exit) ::_exit(7);
        counter_ += c[1] * (t_.rank() + 1);
        t_.send(0, &counter_, sizeof counter_);
    }

  private:
    dist::transport &t_;
    int64_t counter_ = 0;
};

std::vector<std::string> own_args() {
    std::ifstream f("/proc/self/cmdline", std::ios::binary);
    const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<std::string> out;
    size_t b = 0;
    for (size_t i = 0; i < all.size(); ++i)
        if (all[i] == '\0') {
            out.push_back(all.substr(b, i - b));
            b = i + 1;
        }
    return out;
}

TEST(dist_procs_child, DISABLED_serve) {
    const auto args = own_args();
    int rank = -1, world = 0;
    std::string join;
    for (size_t i = 0; i + 1 < args.size(); ++i) {
        if (args[i] == "--fathom-rank") rank = std::stoi(args[i + 1]);
        if (args[i] == "--fathom-world") world = std::stoi(args[i + 1]);
        if (args[i] == "--fathom-join") join = args[i + 1];
    }
    if (rank < 0) GTEST_SKIP() << "only as a rank process spawned by the dist_procs tests";
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int code = 0;
    try {
        dist::socket_options so;
        so.timeout = 20s;
        auto t = dist::make_socket_transport(rank, world, join, so);
        dist::serve_sessions(*t, [&t] { return std::make_unique<toy_session>(*t); });
    } catch (const dist::peer_failure &e) {
        std::fprintf(stderr, "toy rank %d: %s\n", rank, e.what());
        code = dist::rank_exit_after_peer;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "toy rank %d: %s\n", rank, e.what());
        code = 1;
    }
    ::_exit(code);  // no gtest summary from a rank process
}

std::string self_exe() {
    char b[4096];
    const ssize_t n = ::readlink("/proc/self/exe", b, sizeof b - 1);
    return n > 0 ? std::string(b, static_cast<size_t>(n)) : "/proc/self/exe";
}

struct failures {
    std::mutex mu;
    std::vector<std::string> lines;
};

dist::rank_procs_options toy_options(failures &f) {
    dist::rank_procs_options o;
    const std::string exe = self_exe();
    o.command = [exe](int rank, const std::string &id) {
        return std::vector<std::string>{exe,
                                        "--gtest_filter=dist_procs_child.DISABLED_serve",
                                        "--gtest_also_run_disabled_tests",
                                        "--fathom-rank",
                                        std::to_string(rank),
                                        "--fathom-world",
                                        "3",
                                        "--fathom-join",
                                        id};
    };
    o.join_timeout = 20s;
    o.timeout = 20s;
    o.kill_grace = 1000ms;
    o.on_failure = [&f](const std::string &line) {
        std::lock_guard<std::mutex> lock(f.mu);
        f.lines.push_back(line);
    };
    return o;
}

// One toy operation of session sid: every rank adds `value`; the counters of ranks 1, 2.
std::vector<int64_t> add(dist::rank_procs &g, uint64_t sid, int64_t value) {
    std::vector<int64_t> out;
    g.with_session(sid, [&] {
        const int64_t c[2] = {cmd_add, value};
        for (int r = 1; r < 3; ++r) g.link().send(r, c, sizeof c);
        for (int r = 1; r < 3; ++r) {
            int64_t v = -1;
            g.link().recv(r, &v, sizeof v);
            out.push_back(v);
        }
    });
    return out;
}

// One toy operation of session sid in which rank `bad` refuses (throws; its process exits 1) while rank
// `ok` adds; rank 0 waits for bad's answer. in_batch: inside with_sessions with use(), else with_session.
// The error line.
std::string refuse(dist::rank_procs &g, uint64_t sid, int bad, int ok, bool in_batch) {
    const auto op = [&] {
        const int64_t no[2] = {cmd_fail, 0}, yes[2] = {cmd_add, 1};
        g.link().send(bad, no, sizeof no);
        g.link().send(ok, yes, sizeof yes);
        int64_t v;
        g.link().recv(bad, &v, sizeof v);
    };
    return error_of([&] {
        if (in_batch) {
            g.with_sessions([&] {
                g.use(sid, 1);
                op();
            });
        } else {
            g.with_session(sid, op);
        }
    });
}

bool gone(long pid) {
    for (auto t0 = clk::now(); clk::now() - t0 < 3s; std::this_thread::sleep_for(20ms))
        if (::kill(static_cast<pid_t>(pid), 0) != 0) return true;  // reaped by the supervisor
    return false;
}

TEST(dist_procs, sessions_keep_their_own_state_and_a_clean_stop_reaps_everyone) {
    failures f;
    std::vector<long> pids;
    {
        dist::rank_procs g(3, toy_options(f));
        pids = g.pids();
        ASSERT_EQ(pids.size(), 2u);
        const uint64_t s1 = g.new_session_id(), s2 = g.new_session_id();
        EXPECT_EQ(add(g, s1, 1), (std::vector<int64_t>{2, 3}));
        EXPECT_EQ(add(g, s2, 10), (std::vector<int64_t>{20, 30}));
        EXPECT_EQ(add(g, s1, 1), (std::vector<int64_t>{4, 6}));  // s1's counters, untouched by s2
        g.free_session(s1);
        EXPECT_EQ(add(g, s1, 1), (std::vector<int64_t>{2, 3}));  // freed: a fresh state
        EXPECT_EQ(add(g, s2, 1), (std::vector<int64_t>{22, 33}));
        EXPECT_FALSE(g.failure());
    }
    for (long p : pids) EXPECT_TRUE(gone(p)) << p;
    EXPECT_TRUE(f.lines.empty());
}

// In-flight batch: one hold, both sessions' operations begun (control + sends) before either answer is
// read; the answers come back per rank in the order begun, each from its own session's state. Nested
// calls from the holder (with_session, free_session) join the hold instead of deadlocking; use() outside
// a hold is refused.
TEST(dist_procs, with_sessions_begins_several_operations_before_finishing_any) {
    failures f;
    dist::rank_procs g(3, toy_options(f));
    const uint64_t s1 = g.new_session_id(), s2 = g.new_session_id();
    EXPECT_EQ(add(g, s1, 1), (std::vector<int64_t>{2, 3}));
    EXPECT_FALSE(g.held_here());
    EXPECT_EQ(error_of([&] { g.use(s1, 1); }), "dist: rank processes: use() outside with_sessions");
    std::vector<int64_t> a, b, c;
    g.with_sessions([&] {
        EXPECT_TRUE(g.held_here());
        for (const auto &[sid, value] : {std::pair<uint64_t, int64_t>{s1, 5}, {s2, 100}}) {
            g.use(sid, 1);
            const int64_t cmd[2] = {cmd_add, value};
            for (int r = 1; r < 3; ++r) g.link().send(r, cmd, sizeof cmd);
        }
        for (auto *out : {&a, &b})
            for (int r = 1; r < 3; ++r) {
                int64_t v = -1;
                g.link().recv(r, &v, sizeof v);
                out->push_back(v);
            }
        c = add(g, s1, 1);  // nested with_session
        g.free_session(s2);  // nested free
    });
    EXPECT_FALSE(g.held_here());
    EXPECT_EQ(a, (std::vector<int64_t>{12, 18}));  // s1: 1 + 5 per unit
    EXPECT_EQ(b, (std::vector<int64_t>{200, 300}));
    EXPECT_EQ(c, (std::vector<int64_t>{14, 21}));
    EXPECT_EQ(add(g, s2, 1), (std::vector<int64_t>{2, 3}));  // freed inside the batch: fresh
    EXPECT_FALSE(g.failure());
    // A failure inside the batch fails the group with the rank's line, as with_session does: its reason,
    // or its exit status when the supervisor saw the exit first.
    const long pid1 = g.pids()[0];
    const std::string e = refuse(g, s1, 1, 2, true);
    EXPECT_TRUE(e == "dist: rank 1 failed: toy rank 1 refuses" ||
                e == "dist: rank 1 (pid " + std::to_string(pid1) + ") exited: status 1")
        << e;
    EXPECT_EQ(g.failure(), e);
    EXPECT_FALSE(g.held_here());
}

// A failure inside a nested call fails the group at once, even when the batch's caller catches it and goes
// on (the engine's run_inflight keeps every session's failure and goes on to the next): here the children
// were told to step s1 and wait for its command, so s2's control or a free_session of s1 would be taken for
// that command. Before the fix the group stayed healthy and use(s2) went out on the desynchronised link.
TEST(dist_procs, with_sessions_failure_in_a_nested_call_fails_the_group_even_when_caught) {
    failures f;
    dist::rank_procs g(3, toy_options(f));
    const uint64_t s1 = g.new_session_id(), s2 = g.new_session_id();
    EXPECT_EQ(add(g, s1, 1), (std::vector<int64_t>{2, 3}));
    const std::string why = "rank 0: s1's forward failed here";
    std::string first, then;
    g.with_sessions([&] {
        first = error_of([&] { g.with_session(s1, [&] { throw error(why); }); });
        then = error_of([&] { g.use(s2, 1); });
        g.free_session(s1);  // the session's cleanup: nothing to send once the group failed
    });
    EXPECT_EQ(first, why);
    EXPECT_EQ(then, why);
    EXPECT_EQ(g.failure(), why);
    EXPECT_EQ(error_of([&] { add(g, s2, 1); }), why);
    for (auto t1 = clk::now(); clk::now() - t1 < 3s; std::this_thread::sleep_for(10ms)) {
        std::lock_guard<std::mutex> lock(f.mu);
        if (!f.lines.empty()) break;
    }
    std::lock_guard<std::mutex> lock(f.mu);
    EXPECT_EQ(f.lines, std::vector<std::string>{why});
}

TEST(dist_procs, killed_rank_fails_the_in_flight_and_later_operations_with_its_status) {
    failures f;
    dist::rank_procs g(3, toy_options(f));
    const auto pids = g.pids();
    const uint64_t s = g.new_session_id();
    EXPECT_EQ(add(g, s, 1), (std::vector<int64_t>{2, 3}));
    const std::string want =
        "dist: rank 1 (pid " + std::to_string(pids[0]) + ") exited: killed by signal 9 (Killed)";
    const auto t0 = clk::now();
    // Rank 1 dies while rank 0 waits for its answer (in flight).
    EXPECT_EQ(error_of([&] {
                  g.with_session(s, [&] {
                      const int64_t die[2] = {cmd_die, 0}, ok[2] = {cmd_add, 1};
                      g.link().send(1, die, sizeof die);
                      g.link().send(2, ok, sizeof ok);
                      int64_t v;
                      g.link().recv(1, &v, sizeof v);
                  });
              }),
              want);
    EXPECT_LT(clk::now() - t0, 3s);
    EXPECT_EQ(error_of([&] { add(g, s, 1); }), want);
    EXPECT_EQ(error_of([&] { add(g, g.new_session_id(), 1); }), want);
    EXPECT_EQ(g.failure(), want);
    EXPECT_TRUE(gone(pids[1]));  // the other rank was stopped
    for (auto t1 = clk::now(); clk::now() - t1 < 3s; std::this_thread::sleep_for(10ms)) {
        std::lock_guard<std::mutex> lock(f.mu);
        if (!f.lines.empty()) break;
    }
    std::lock_guard<std::mutex> lock(f.mu);
    EXPECT_EQ(f.lines, std::vector<std::string>{want});
}

TEST(dist_procs, failing_rank_gives_its_reason_and_an_exiting_one_its_status) {
    {
        failures f;
        dist::rank_procs g(3, toy_options(f));
        // Rank 2 fails with a reason and exits 1; rank 1 (answering normally) then stops because of it.
        // The line names rank 2: its reason, or its exit status when the supervisor saw the exit first.
        const auto pids = g.pids();
        const std::string e = refuse(g, 1, 2, 1, false);
        EXPECT_TRUE(e == "dist: rank 2 failed: toy rank 2 refuses" ||
                    e == "dist: rank 2 (pid " + std::to_string(pids[1]) + ") exited: status 1")
            << e;
        EXPECT_EQ(*g.failure(), e);
    }
    {
        failures f;
        dist::rank_procs g(3, toy_options(f));
        const auto pids = g.pids();
        EXPECT_EQ(error_of([&] {
                      g.with_session(1, [&] {
                          const int64_t c[2] = {cmd_exit, 0};
                          g.link().send(2, c, sizeof c);
                          int64_t v;
                          g.link().recv(2, &v, sizeof v);
                      });
                  }),
                  "dist: rank 2 (pid " + std::to_string(pids[1]) + ") exited: status 7");
    }
}

TEST(dist_procs, rank_that_exits_during_the_join_is_named) {
    failures f;
    dist::rank_procs_options o = toy_options(f);
    o.command = [](int, const std::string &) { return std::vector<std::string>{"/bin/false"}; };
    const auto t0 = clk::now();
    const std::string e = error_of([&] { dist::rank_procs g(2, o); });
    EXPECT_EQ(e.rfind("dist: rank 1 (pid ", 0), 0u) << e;
    EXPECT_NE(e.find(") exited: status 1"), std::string::npos) << e;
    EXPECT_LT(clk::now() - t0, 3s);
    o.command = [](int, const std::string &) { return std::vector<std::string>{"/nonexistent/fathom"}; };
    EXPECT_EQ(error_of([&] { dist::rank_procs g(2, o); }),
              "dist: rank 1: cannot start '/nonexistent/fathom': No such file or directory");
    EXPECT_TRUE(f.lines.empty());  // on_failure is for failures after the join
    EXPECT_EQ(error_of([&] { dist::rank_procs g(1, o); }), "dist: rank processes: need 2..1024 ranks, got 1");
}

}  // namespace
