// DeepSeek V4 Flash ("DS4") behind the public engine API (include/fathom/engine.h): engine::load
// dispatches here when general.architecture == "deepseek4". The model, its explicit state and the
// forward live in src/models/deepseek4*; this file pair owns only the engine/session wrapping.
#pragma once
#include <memory>
#include <string>

#include "fathom/engine.h"

namespace fathom {

namespace gguf {
class file;
}

// Build a DS4 engine from an already opened GGUF (general.architecture == "deepseek4").
// Throws fathom::error for invalid options (device, threads, ctx, batch, ds4_qat) or a bad model.
std::unique_ptr<engine> make_ds4_engine(const engine_options &opts, std::shared_ptr<const gguf::file> file);

// The process of rank `rank` (> 0) of `world` for dist_options::rank_procs (`fathom rank`): loads the
// model named by opts (the same options as rank 0's engine: devices, layout, threads, numerics, qat, kv),
// joins rank 0 at `join_id` ("token@host:port") and serves its share of every session until rank 0 stops
// it. Throws one line on any failure (load, join, a peer's death or abort).
void serve_ds4_rank(const engine_options &opts, int rank, int world, const std::string &join_id);

}  // namespace fathom
