// The process of one rank > 0 of a model split over processes (dist_options::rank_procs, docs/dist.md
// "Several processes"): what `fathom rank` runs. Defined by the DeepSeek V4 engine (src/engine).
#pragma once
#include <string>

#include "fathom/engine.h"

namespace fathom {

// The process of rank `rank` (> 0) of `world` for dist_options::rank_procs (`fathom rank`): loads the
// model named by opts (the same options as rank 0's engine: devices, layout, threads, numerics, qat, kv),
// joins rank 0 at `join_id` ("token@host:port") and serves its share of every session until rank 0 stops
// it. Throws one line on any failure (load, join, a peer's death or abort).
void serve_ds4_rank(const engine_options &opts, int rank, int world, const std::string &join_id);

}  // namespace fathom
