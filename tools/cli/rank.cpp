// `fathom rank` (hidden): the process of one rank > 0 of a model split over processes (`--procs`,
// docs/dist.md "Several processes"). Rank 0's engine spawns it as
//   fathom rank --rank R --world P --join TOKEN@HOST:PORT --parent-pid PID -m MODEL --devices ... [options]
//       --rank-layers 0-2,3-5 --ctx N
// with rank 0's model options, its block ranges and its context (so both sides split the model the same
// way and a CUDA stage holds rank 0's sequence length; a CUDA rank uploads its blocks once per process);
// on another host it is started by hand with the command rank 0 prints (no --parent-pid). It loads the
// model, joins the ranks over TCP and serves its share of every session until rank 0 stops it (exit 0)
// or fails (one line on stderr; exit 1 from tools/fathom.cpp, or dist::rank_exit_after_peer = 4 when a
// peer failed first).
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "dist/rank_procs.h"
#include "fathom/error.h"
#include "fathom/rank_process.h"

namespace fathom::cli {

namespace {

struct rank_args {
    model_args model;
    int rank = 0, world = 0;
    std::string join;
    long parent_pid = 0;
    std::string layers;  // --rank-layers: rank 0's block ranges (dist_options::rank_layers)
};

void rank_main(const rank_args &a) {
    if (a.parent_pid > 0) {
        // Die with the spawning parent (SIGKILL when its spawning thread ends, even if the parent was
        // SIGKILLed); it may already be gone between the spawn and this call, hence the check after.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (static_cast<long>(::getppid()) != a.parent_pid)
            throw error("rank " + std::to_string(a.rank) + ": parent process " + std::to_string(a.parent_pid) +
                        " is gone");
    }
    engine_options o = engine_options_of(a.model);
    o.dist.rank_procs = false;  // this process is a rank, not a launcher
    o.dist.rank_layers = a.layers;
    try {
        serve_ds4_rank(o, a.rank, a.world, a.join);
    } catch (const dist::peer_failure &e) {
        // A consequence of another rank's failure: a distinct status, so the supervisor names the cause.
        std::fprintf(stderr, "error: %s\n", e.what());
        std::fflush(stderr);
        std::_Exit(dist::rank_exit_after_peer);
    }
}

}  // namespace

void add_rank_command(CLI::App &app) {
    auto a = std::make_shared<rank_args>();
    auto *cmd = app.add_subcommand("rank", "Serve one rank of a model split over processes (spawned by --procs)");
    cmd->group("");  // hidden from --help: rank 0 starts it
    add_model_options(cmd, a->model, /*model_required=*/true);
    set_group(cmd, "Rank");
    cmd->add_option("--rank", a->rank, "This rank (1..world-1)")->required()->check(at_least(1));
    cmd->add_option("--world", a->world, "Number of ranks")->required()->check(at_least(2));
    cmd->add_option("--join", a->join, "Rank 0's id, TOKEN@HOST:PORT")->required();
    cmd->add_option("--parent-pid", a->parent_pid, "Exit with this process (spawned ranks)")->check(at_least(1));
    cmd->add_option("--rank-layers", a->layers,
                    "Pipeline layout: every rank's block range as rank 0 chose it, e.g. 0-2,3-5 (inclusive); "
                    "required with CUDA entries, else the even split");
    cmd->callback([a]() { rank_main(*a); });
}

}  // namespace fathom::cli
