// DeepSeek V4 Flash ("DS4") behind the public engine API (include/fathom/engine.h): engine::load
// dispatches here when general.architecture == "deepseek4". The model, its explicit state and the
// forward live in src/models/deepseek4*; this file pair owns only the engine/session wrapping.
#pragma once
#include <memory>
#include <string>

#include "fathom/engine.h"
#include "fathom/rank_process.h"

namespace fathom {

namespace gguf {
class file;
}

// Build a DS4 engine from an already opened GGUF (general.architecture == "deepseek4").
// Throws fathom::error for invalid options (device, threads, ctx, batch, ds4_qat) or a bad model.
std::unique_ptr<engine> make_ds4_engine(const engine_options &opts, std::shared_ptr<const gguf::file> file);

// serve_ds4_rank (`fathom rank`): declared in the public include/fathom/rank_process.h.

}  // namespace fathom
