// Family rules for `llama` (SmolLM2, Llama 2/3, Mistral-style dense models): RMSNorm, normal
// (adjacent-pair) RoPE — llama.cpp's converter permutes Q/K so the GGUF expects LLAMA_ROPE_TYPE_NORM —
// GQA, SwiGLU, tied embeddings when output.weight is absent. Nothing beyond the defaults.
#include "models/dense.h"

namespace fathom {

void dense_hparams_llama(const gguf::file &, dense_hparams &hp) {
    hp.rope.mode = rope_mode::normal;
    hp.act = glu_kind::swiglu;
}

}  // namespace fathom
