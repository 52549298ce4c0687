// Rank processes: spawn, join, supervise, and the session control protocol (see rank_procs.h).
#include "dist/rank_procs.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"

extern char **environ;

namespace fathom::dist {

namespace {

// Control ops (rank_procs.h); distinct from the pipeline / tp op codes (1..4), never 0.
enum ctl_op : int64_t { ctl_use = 21, ctl_free = 22, ctl_stop = 23 };
constexpr size_t ctl_len = 3;

struct child {
    int rank = 0;
    pid_t pid = 0;
    bool started = false;  // spawned (pid valid)
    bool exited = false;   // its exit was seen (the zombie is reaped right after, under the same lock)
    std::thread waiter;    // spawns the child, then waits for it
};

}  // namespace

std::string exit_status_text(int status) {
    if (WIFEXITED(status)) return "status " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) {
        const char *name = ::strsignal(WTERMSIG(status));
        return "killed by signal " + std::to_string(WTERMSIG(status)) + (name ? std::string(" (") + name + ")" : "");
    }
    return "wait status " + std::to_string(status);
}

struct rank_procs::impl {
    int world = 1;
    rank_procs_options o;
    mutable std::mutex mu;  // kids, failed, stopping, joined, t (pointer)
    std::condition_variable cv;
    std::vector<child> kids;  // [rank - 1]
    bool stopping = false;    // exits are expected from now on
    bool joined = false;      // on_failure is for failures after the join
    std::optional<std::string> failed;
    std::unique_ptr<socket_transport> t;
    std::mutex op_mu;  // one rank operation (or in-flight batch, with_sessions) at a time
    std::atomic<std::thread::id> holder{};  // the thread holding op_mu in with_sessions
    std::atomic<uint64_t> next_sid{1};

    // posix_spawn child i, then wait for its exit (this thread is the child's parent thread, which is
    // what PR_SET_PDEATHSIG follows, so it lives as long as the child).
    void run_child(size_t i, std::vector<std::string> argv) {
        std::vector<char *> cargv;
        for (auto &a : argv) cargv.push_back(a.data());
        cargv.push_back(nullptr);
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);  // chat's stdin is rank 0's
        posix_spawn_file_actions_adddup2(&fa, 2, 1);                         // stdout is rank 0's output
        // Own process group (a terminal's Ctrl-C is for rank 0, which stops the children itself), no
        // blocked signals (serve blocks SIGTERM in every thread for its sigwait), default dispositions.
        posix_spawnattr_t at;
        posix_spawnattr_init(&at);
        sigset_t none, defaults;
        sigemptyset(&none);
        sigemptyset(&defaults);
        for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGPIPE}) sigaddset(&defaults, sig);
        posix_spawnattr_setsigmask(&at, &none);
        posix_spawnattr_setsigdefault(&at, &defaults);
        posix_spawnattr_setpgroup(&at, 0);
        posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
        pid_t pid = 0;
        const int rc = argv.empty() ? EINVAL : ::posix_spawn(&pid, cargv[0], &fa, &at, cargv.data(), environ);
        posix_spawn_file_actions_destroy(&fa);
        posix_spawnattr_destroy(&at);
        const int rank = static_cast<int>(i) + 1;
        if (rc != 0) {
            {
                std::lock_guard<std::mutex> lock(mu);
                kids[i].exited = true;
                cv.notify_all();
            }
            fail("dist: rank " + std::to_string(rank) + ": cannot start '" + (argv.empty() ? "" : argv[0]) +
                 "': " + std::strerror(rc));
            return;
        }
        {
            std::lock_guard<std::mutex> lock(mu);
            kids[i].pid = pid;
            kids[i].started = true;
            cv.notify_all();  // the constructor waits for every spawned child's pid (pids())
        }
        // Wait without reaping (the pid stays ours, so kill() under mu cannot hit a reused pid) ...
        siginfo_t si{};
        while (::waitid(P_PID, static_cast<id_t>(pid), &si, WEXITED | WNOWAIT) < 0 && errno == EINTR) {
        }
        int status = 0;
        bool report;
        {
            std::lock_guard<std::mutex> lock(mu);
            kids[i].exited = true;  // ... then mark and reap under the lock
            while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
            }
            report = !stopping;
            cv.notify_all();
        }
        // The line should name the cause (the first failure): a rank that stopped only because a peer
        // failed first (rank_exit_after_peer) waits 2 s for the line of that cause; any other exit is
        // reported at once.
        if (report && WIFEXITED(status) && WEXITSTATUS(status) == rank_exit_after_peer) {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait_for(lock, std::chrono::milliseconds(2000), [&] { return failed.has_value() || stopping; });
            report = !failed && !stopping;
        }
        if (report)
            fail("dist: rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") exited: " +
                 exit_status_text(status));
    }

    // First failure only: remember the line, wake rank 0's transport, stop the children, tell the owner.
    void fail(const std::string &line) {
        socket_transport *tp;
        bool tell;
        {
            std::lock_guard<std::mutex> lock(mu);
            if (failed) return;
            failed = line;
            tp = t.get();
            tell = joined;
            cv.notify_all();
        }
        if (tp) tp->abort(line);
        if (tell && o.on_failure) o.on_failure(line);
        terminate_children();
    }

    // SIGTERM to every live child, SIGKILL to those still alive after kill_grace.
    void terminate_children() {
        std::unique_lock<std::mutex> lock(mu);
        const auto signal_all = [&](int sig) {
            for (auto &k : kids)
                if (k.started && !k.exited) ::kill(k.pid, sig);
        };
        signal_all(SIGTERM);
        cv.wait_for(lock, o.kill_grace, [&] {
            for (auto &k : kids)
                if (k.started && !k.exited) return false;
            return true;
        });
        signal_all(SIGKILL);
    }

    void send_control(int64_t op, uint64_t sid, int64_t arg = 0) {
        const int64_t c[ctl_len] = {op, static_cast<int64_t>(sid), arg};
        for (int r = 1; r < world; ++r) t->send(r, c, sizeof c);
    }

    std::optional<std::string> failure() const {
        std::lock_guard<std::mutex> lock(mu);
        return failed;
    }

    // An operation threw `line`: fail the group, with the supervisor's line when it knows the cause
    // better, and return the group's line. A peer failed: a child's exit status arrives a moment after its
    // socket's EOF, and a neighbour's abort reason -- "peer rank 1 exited" -- can arrive before that EOF.
    // A spawned child seen dead: wait for its status (at most 2 s behind, see run_child); another peer
    // failure: 0.5 s for an exit report.
    std::string fail_after(std::string line) {
        {
            std::unique_lock<std::mutex> lock(mu);
            const int dead = t->dead_peer();
            const bool spawned_dead =
                dead > 0 && dead <= static_cast<int>(kids.size()) && kids[static_cast<size_t>(dead - 1)].started;
            if (spawned_dead || t->peer_failed())
                cv.wait_for(lock, spawned_dead ? std::chrono::milliseconds(3000) : std::chrono::milliseconds(500),
                            [&] { return failed.has_value(); });
            if (failed) line = *failed;
        }
        fail(line);
        return *failure();
    }
};

rank_procs::rank_procs(int world, rank_procs_options o) : p_(std::make_unique<impl>()) {
    if (world < 2 || world > 1024) throw error("dist: rank processes: need 2..1024 ranks, got " + std::to_string(world));
    if (!o.command) throw error("dist: rank processes: no rank command");
    p_->world = world;
    p_->o = std::move(o);
    impl &p = *p_;
    socket_root root(p.o.host);
    const std::string id = root.id();
    if (p.o.on_listening) p.o.on_listening(id);
    const int spawn = p.o.spawn < 0 ? world : std::min(p.o.spawn, world);
    p.kids.resize(static_cast<size_t>(world - 1));
    for (int r = 1; r < world; ++r) p.kids[static_cast<size_t>(r - 1)].rank = r;
    socket_options so;
    so.timeout = p.o.timeout;
    so.join_timeout = p.o.join_timeout;
    so.on_join_wait = [&p] {
        if (auto f = p.failure()) throw error(*f);
    };
    try {
        for (int r = 1; r < spawn; ++r) {
            std::vector<std::string> argv = p.o.command(r, id);
            p.kids[static_cast<size_t>(r - 1)].waiter =
                std::thread([&p, r, argv = std::move(argv)]() mutable { p.run_child(static_cast<size_t>(r - 1), std::move(argv)); });
        }
        auto t = make_socket_transport(std::move(root), world, so);
        std::unique_lock<std::mutex> lock(p.mu);
        // A child can join before its waiter thread, descheduled after posix_spawn returned, records its
        // pid: wait for those records (moments), so pids() and the stop below see every spawned child.
        p.cv.wait(lock, [&p, spawn] {
            for (int r = 1; r < spawn; ++r) {
                const auto &k = p.kids[static_cast<size_t>(r - 1)];
                if (!k.started && !k.exited) return false;
            }
            return true;
        });
        if (p.failed) throw error(*p.failed);  // a child died right after joining
        p.t = std::move(t);
        p.joined = true;
    } catch (const std::exception &e) {
        // The line of a child that exited beats the join's own error (which only says it left).
        p.fail(e.what());
        const std::string line = *p.failure();
        for (auto &k : p.kids)
            if (k.waiter.joinable()) k.waiter.join();
        throw error(line);
    }
}

rank_procs::~rank_procs() {
    impl &p = *p_;
    {
        std::lock_guard<std::mutex> lock(p.mu);
        p.stopping = true;
        p.cv.notify_all();
    }
    if (!p.failure()) {
        try {
            std::lock_guard<std::mutex> op(p.op_mu);
            p.send_control(ctl_stop, 0);
            p.t->goodbye();
        } catch (const std::exception &) {
            // a child is already gone: the grace period below ends it
        }
    }
    {
        std::unique_lock<std::mutex> lock(p.mu);
        p.cv.wait_for(lock, p.o.kill_grace, [&] {
            for (auto &k : p.kids)
                if (k.started && !k.exited) return false;
            return true;
        });
        for (auto &k : p.kids)
            if (k.started && !k.exited) ::kill(k.pid, SIGKILL);
    }
    // The waiters may still be inside fail() (using the transport, calling on_failure): join them first,
    // then close the sockets.
    for (auto &k : p.kids)
        if (k.waiter.joinable()) k.waiter.join();
    std::lock_guard<std::mutex> lock(p.mu);
    p.t.reset();
}

uint64_t rank_procs::new_session_id() {
    return p_->next_sid.fetch_add(1);
}

bool rank_procs::held_here() const {
    return p_->holder.load() == std::this_thread::get_id();
}

void rank_procs::use(uint64_t sid, int64_t steps) {
    impl &p = *p_;
    if (!held_here()) throw error("dist: rank processes: use() outside with_sessions");
    if (steps < 1 || steps > (int64_t{1} << 24)) throw error("dist: rank processes: bad step count " + std::to_string(steps));
    if (auto f = p.failure()) throw error(*f);
    p.send_control(ctl_use, sid, steps);
}

void rank_procs::with_session(uint64_t sid, const std::function<void()> &fn, int64_t steps) {
    if (steps < 1 || steps > (int64_t{1} << 24)) throw error("dist: rank processes: bad step count " + std::to_string(steps));
    with_sessions([&] {
        use(sid, steps);
        fn();
    });
}

void rank_procs::with_sessions(const std::function<void()> &fn) {
    impl &p = *p_;
    if (held_here()) {
        // Nested: the outer call holds the ranks. A failure here fails the group at once, as the outer
        // call would, even when the caller catches it and goes on (the engine's in-flight batch does, for
        // its other sessions): the ranks may be waiting for this operation's messages or have answers
        // queued for it, so nothing else may use the link, not even a free_session in the caller's cleanup.
        try {
            fn();
        } catch (const std::exception &e) {
            throw error(p.fail_after(e.what()));
        }
        return;
    }
    std::lock_guard<std::mutex> op(p.op_mu);
    struct holding {
        std::atomic<std::thread::id> &h;
        explicit holding(std::atomic<std::thread::id> &x) : h(x) { h.store(std::this_thread::get_id()); }
        ~holding() { h.store(std::thread::id{}); }
    } hold(p.holder);
    if (auto f = p.failure()) throw error(*f);
    try {
        fn();
    } catch (const std::exception &e) {
        throw error(p.fail_after(e.what()));
    }
}

void rank_procs::free_session(uint64_t sid) noexcept {
    impl &p = *p_;
    try {
        // Inside with_sessions on this thread (a session dropped in an in-flight batch): the hold is ours.
        std::unique_lock<std::mutex> op(p.op_mu, std::defer_lock);
        if (!held_here()) op.lock();
        if (p.failure()) return;
        p.send_control(ctl_free, sid);
    } catch (const std::exception &e) {
        p.fail_after(e.what());
    }
}

transport &rank_procs::link() {
    return *p_->t;
}

std::optional<std::string> rank_procs::failure() const {
    return p_->failure();
}

std::vector<long> rank_procs::pids() const {
    std::lock_guard<std::mutex> lock(p_->mu);
    std::vector<long> out;
    for (const auto &k : p_->kids) out.push_back(k.started ? static_cast<long>(k.pid) : 0);
    return out;
}

// ---- the child's side ------------------------------------------------------------------------------

void serve_sessions(transport &t, const std::function<std::unique_ptr<session_rank>()> &make) {
    std::map<int64_t, std::unique_ptr<session_rank>> sessions;
    try {
        for (;;) {
            int64_t c[ctl_len];
            t.recv_idle(0, c, sizeof c);  // idle between requests is normal
            if (c[0] == ctl_use) {
                if (c[2] < 0 || c[2] > (int64_t{1} << 24))
                    throw error("dist: rank " + std::to_string(t.rank()) + " received a bad step count " +
                                std::to_string(c[2]));
                auto &s = sessions[c[1]];
                if (!s) s = make();
                for (int64_t k = 0; k < std::max<int64_t>(c[2], 1); ++k) s->step();
            } else if (c[0] == ctl_free) {
                sessions.erase(c[1]);
            } else if (c[0] == ctl_stop) {
                return;
            } else {
                throw error("dist: rank " + std::to_string(t.rank()) + " received a bad control {" +
                            std::to_string(c[0]) + ", " + std::to_string(c[1]) + ", " + std::to_string(c[2]) + "}");
            }
        }
    } catch (const std::exception &e) {
        t.abort(e.what());
        const auto *s = dynamic_cast<const socket_transport *>(&t);
        if (s && s->peer_failed()) throw peer_failure(e.what());
        throw;
    }
}

}  // namespace fathom::dist
