// Ranks as processes (`--procs`, docs/dist.md "Several processes"): rank 0 (the engine's process)
// spawns one child process per further rank, joins them over the socket transport
// (socket_transport.h), supervises them, and runs every session's rank protocol (pipeline.h / tp.h)
// over that one transport.
//
// Sessions. Each engine session owns its rank states (a DS4 state cannot be swapped out of the ranks nor
// truncated, see src/engine/ds4_internal.h), but the child processes are shared by all sessions. So a
// child keeps one rank object (pipeline_rank / tp_rank: its blocks' KV state) per session id, and before
// each rank operation of a session rank 0 tells every child which session it is for:
//   control int64[3] = {op, session id, steps}   rank 0 -> every rank r > 0
//   op 21 use:  run `steps` steps (0 is read as 1) of that session's rank (created on first use): the
//               pipeline's or the tp protocol's next messages (forward, reset; a micro-batched pipeline
//               forward is one message per micro-batch) follow, from rank r-1 or rank 0;
//   op 22 free: drop the session's rank state;   op 23 stop: leave (exit 0).
// Sessions take turns: a whole operation (control + the rank protocol's messages) runs under one mutex,
// so the ranks see the operations of different sessions one after another, never interleaved.
// In-flight batches (with_sessions): one hold of that mutex covers several sessions' operations, begun
// in order (control, then rank 0's sends) before any is finished. Every link is ordered per (sender,
// receiver), every child reads rank 0's controls in order and steps one session at a time, so rank r
// receives session A's messages from rank r-1 before B's, and the last rank's answers reach rank 0 in
// the order the operations were begun: rank 0 finishes them in that order. While a child computes A,
// rank 0 computes B's first stage (and with 3+ ranks every stage can hold another session), which is
// the pipeline's throughput across sequences. A send blocked on a full socket reads incoming frames
// meanwhile (socket_transport.h), so rank 0 sending B while the last rank answers A cannot deadlock.
//
// Supervision: one thread per child spawns it (posix_spawn; the child's PR_SET_PDEATHSIG is tied to that
// thread, which lives until the child is reaped) and waits for its exit. An exit before stop() is a
// failure, "dist: rank R (pid N) exited: <status>": the transport is aborted (an in-flight operation
// ends at once), the other children get SIGTERM and SIGKILL 2 s later, every later operation throws that
// line, and on_failure is called once (the server exits with it). The child itself dies with the parent
// (PR_SET_PDEATHSIG = SIGKILL, then a getppid() check; tools/cli/rank.cpp), and exits when any peer's
// socket closes, so no rank outlives the group.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/socket_transport.h"

namespace fathom::dist {

struct rank_procs_options {
    std::string host = "127.0.0.1";  // rank 0's listening address (another host's ranks must reach it)
    // argv of rank `rank`'s process, given the join id ("token@host:port"); argv[0] is the executable.
    std::function<std::vector<std::string>(int rank, const std::string &join_id)> command;
    int spawn = -1;  // ranks 1..spawn-1 are spawned here, the rest join by hand (-1: all)
    // Called once the id is known, before waiting for the ranks (to print it for ranks started by hand).
    std::function<void(const std::string &join_id)> on_listening;
    std::chrono::milliseconds join_timeout{std::chrono::minutes(10)};  // a rank loads its model first
    std::chrono::milliseconds timeout{std::chrono::hours(1)};          // a rank's wait for its neighbour
    std::chrono::milliseconds kill_grace{2000};                        // SIGTERM -> SIGKILL
    // Called once, from a supervisor thread, with the one-line failure (child exit or transport failure).
    std::function<void(const std::string &line)> on_failure;
};

class rank_procs {
  public:
    // Spawn and join ranks 1..world-1. Throws one line (a child that exits during the join is named with
    // its status; the join's timeout).
    rank_procs(int world, rank_procs_options o);
    // Stop: every child gets the stop control and a goodbye, exits 0 and is reaped; children still alive
    // after kill_grace are killed.
    ~rank_procs();
    rank_procs(const rank_procs &) = delete;
    rank_procs &operator=(const rank_procs &) = delete;

    uint64_t new_session_id();  // never blocks (safe inside with_sessions)
    // Run `fn` (rank 0's side of one rank operation over link()) for session `sid`, after telling every
    // rank to step that session's rank `steps` times. Exclusive. Any failure fails the whole group for
    // good and throws its one-line reason (the child's exit status when a child died).
    // = with_sessions([&] { use(sid, steps); fn(); }).
    void with_session(uint64_t sid, const std::function<void()> &fn, int64_t steps = 1);
    // Run `fn` under one exclusive hold of the ranks: inside, use(sid, steps) before each session's
    // rank-0 operation tells every rank to step that session (see the banner for the order rule).
    // Nested calls from the holding thread (with_session, with_sessions, free_session) join the hold.
    // Failures as with_session; one inside a nested call fails the group at once, even when the caller
    // catches it (the ranks may wait for messages of that operation or hold answers queued for it).
    void with_sessions(const std::function<void()> &fn);
    void use(uint64_t sid, int64_t steps);  // inside with_sessions only (throws elsewhere)
    bool held_here() const;                 // the calling thread is inside with_sessions
    void free_session(uint64_t sid) noexcept;  // nothing when the group has failed
    transport &link();                         // rank 0's endpoint (use only inside with_session)
    std::optional<std::string> failure() const;
    std::vector<long> pids() const;  // [rank - 1] of the spawned children (0 for ranks joined by hand)

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

// What serve_sessions throws when this rank failed because a peer had failed first (died, aborted): a
// consequence, not a cause. A rank process exits with rank_exit_after_peer then, and the supervisor
// reports such an exit only when no other failure explains it within a second, so the line names the
// rank that failed first (a killed rank, not its neighbour that noticed).
struct peer_failure : error {
    using error::error;
};
constexpr int rank_exit_after_peer = 4;

// A child's per-session rank: one step = one of rank 0's rank-protocol operations.
class session_rank {
  public:
    virtual ~session_rank() = default;
    virtual void step() = 0;
};

// The child's loop (ranks > 0): read rank 0's controls, keep one session_rank per session id (made by
// `make`), step it on "use", drop it on "free", return on "stop". Throws (after aborting the transport)
// on any failure; peer_failure when a socket transport had seen a peer fail.
void serve_sessions(transport &t, const std::function<std::unique_ptr<session_rank>()> &make);

// "exited with status 3" / "killed by signal 9 (Killed)" for a waitpid status.
std::string exit_status_text(int status);

}  // namespace fathom::dist
