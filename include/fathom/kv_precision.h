// The element type of a session's KV cache (engine_options::kv). Its own header because the models,
// the KV cache and the saved-state code below the engine use it too (docs/architecture.md "Layers").
#pragma once

namespace fathom {

enum class kv_precision { f16, f32 };

}  // namespace fathom
