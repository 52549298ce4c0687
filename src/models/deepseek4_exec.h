// The DS4 forward written once (spec section 2), over an executor that owns the step's rows and
// activations. A step is R rows, each (sequence, position, token): the rows of one sequence are its
// next positions (causal among themselves: a verification), rows of different sequences share the
// step (batched decode), a prompt chunk is many rows of one sequence. The forward below is the only
// place the layer order lives; executors implement its coarse, fusable operations:
//
//   embed                       X[r] = embedding of row r's token in all n_hc streams
//   per block l (run_block):
//     hc_pre(l, attention)      (u, post, comb) = HCPre(X); xn = RMSNorm(u; attn_norm)
//     attention(l)              y = Attn(xn): query path, KV row + compressors + indexer into each
//                               row's own sequence state, sparse sink attention, output projection
//     hc_post                   X = HCPost(y, X, post, comb)
//     hc_pre(l, ffn)            ... ffn_norm
//     moe(l)                    y = MoE(xn): route, routed experts, shared expert
//     hc_post
//   head                        logits of the rows asked for: HCHead, RMSNorm, output projection
//
// The CPU executor (deepseek4_forward.cpp) is the reference; a pipeline stage runs blocks [l0, l1)
// with embed only on the first stage and head only on the last; a tensor-parallel rank's executor
// all-reduces the attention and MoE outputs. An executor may fuse across calls (a deferred HCPost
// folded into the next HCPre, say) as long as the results are those of this sequence.
#pragma once
#include <functional>
#include <span>

#include "models/deepseek4.h"

namespace fathom::ds4 {

enum class sublayer { attention, ffn };

class executor {
  public:
    virtual ~executor() = default;
    virtual void embed() = 0;
    virtual void hc_pre(const layer_weights &l, sublayer which) = 0;
    // il: the block's index in the model (selects each row's layer state).
    virtual void attention(const layer_weights &l, int il) = 0;
    virtual void moe(const layer_weights &l) = 0;
    virtual void hc_post() = 0;
    // Logits of the step's rows `rows` into out [rows.size(), n_vocab].
    virtual void head(std::span<const int32_t> rows, std::span<float> out) = 0;
};

// One DS4 block: HC-wrapped attention, then HC-wrapped MoE.
inline void run_block(executor &ex, const layer_weights &l, int il) {
    ex.hc_pre(l, sublayer::attention);
    ex.attention(l, il);
    ex.hc_post();
    ex.hc_pre(l, sublayer::ffn);
    ex.moe(l);
    ex.hc_post();
}

// Blocks [l0, l1) of `m` (the whole model: 0, n_layer), with the embedding when the range starts at
// block 0 and `embed`, and the head of rows `logit_rows` when it ends at the last block and `out` is
// not empty. after_block (may be empty) runs after each block with its index (a drafter's feature
// capture reads the executor's state there).
inline void run_forward(const model &m, executor &ex, int l0, int l1, bool embed, std::span<const int32_t> logit_rows,
                        std::span<float> out, const std::function<void(int)> &after_block = {}) {
    if (embed && l0 == 0) ex.embed();
    for (int il = l0; il < l1; ++il) {
        run_block(ex, m.layers[static_cast<size_t>(il)], il);
        if (after_block) after_block(il);
    }
    if (l1 == static_cast<int>(m.layers.size()) && !out.empty()) ex.head(logit_rows, out);
}

}  // namespace fathom::ds4
