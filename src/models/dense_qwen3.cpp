// Family rules for `qwen3`: per-head RMSNorm of q and k (attn_q_norm / attn_k_norm, [head_dim])
// before NeoX-style RoPE, head_dim from attention.key_length (may differ from n_embd/n_head),
// SwiGLU, tied or untied output.
#include "models/dense.h"

namespace fathom {

void dense_hparams_qwen3(const gguf::file &, dense_hparams &hp) {
    hp.rope.mode = rope_mode::neox;
    hp.qk_norm = true;
    hp.act = glu_kind::swiglu;
}

}  // namespace fathom
