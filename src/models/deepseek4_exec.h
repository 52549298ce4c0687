// The DS4 forward written once (spec section 2), over an executor that owns the step's rows and
// activations. A step is R rows, each (sequence, position, token): the rows of one sequence are its
// next positions (causal among themselves: a verification), rows of different sequences share the
// step (batched decode), a prompt chunk is many rows of one sequence. The forward below is the only
// place the layer order lives; executors implement its coarse, fusable operations:
//
//   embed                       X[r] = embedding of row r's token in all n_hc streams
//   per block il (run_block):
//     hc_pre(il, attention)     (u, post, comb) = HCPre(X); xn = RMSNorm(u; attn_norm)
//     attention(il)             y = Attn(xn): query path, KV row + compressors + indexer into each
//                               row's own sequence state, sparse sink attention, output projection
//     hc_post                   X = HCPost(y, X, post, comb)
//     hc_pre(il, ffn)           ... ffn_norm
//     moe(il)                   y = MoE(xn): route, routed experts, shared expert
//     hc_post
//   head                        logits of the rows the executor was asked for: HCHead, RMSNorm, output
//   state-only rows (run_block_state): hc_pre(il, attention), then attention_state(il): the KV row and
//                               compressors of each row into its sequence state, nothing else
//
// Blocks are named by their index in the model (il): an executor holds its own weights (host tensors
// on the CPU, device copies on a GPU) and each row's sequence state. Executors:
//   - the CPU executor (deepseek4_forward.cpp), the reference: products over all rows at once, state
//     updates row by row in row order; a tensor-parallel rank's variant all-reduces the attention and
//     MoE outputs; a pipeline stage runs blocks [l0, l1) with embed only on the first stage and head
//     only on the last;
//   - the CUDA executors (src/models/cuda/deepseek4_cuda.cpp): the decode step (fused HC kernels that
//     fold a deferred HCPost into the next HCPre or the head, the attention's parallel graph branches,
//     captured once as a CUDA graph and replayed at every position) and the prefill chunk (layer-major
//     matrix-matrix products over the chunk's rows).
// An executor may fuse across calls (a deferred HCPost folded into the next HCPre, say) as long as the
// results are those of this sequence.
#pragma once
#include <functional>
#include <span>

#include "core/error.h"
#include "models/deepseek4.h"

namespace fathom::ds4 {

enum class sublayer { attention, ffn };

class executor {
  public:
    virtual ~executor() = default;
    virtual void embed() = 0;
    virtual void hc_pre(int il, sublayer which) = 0;
    virtual void attention(int il) = 0;
    virtual void moe(int il) = 0;
    virtual void hc_post() = 0;
    virtual void head() = 0;
    // The attention sublayer's state updates alone (KV rows, compressors), its output not computed
    // (run_block_state). Executors that never run such rows keep this default.
    virtual void attention_state(int il) {
        (void)il;
        throw error("ds4: this executor has no state-only attention");
    }
};

// One DS4 block: HC-wrapped attention, then HC-wrapped MoE.
inline void run_block(executor &ex, int il) {
    ex.hc_pre(il, sublayer::attention);
    ex.attention(il);
    ex.hc_post();
    ex.hc_pre(il, sublayer::ffn);
    ex.moe(il);
    ex.hc_post();
}

// What a block keeps from a row whose output nothing reads (the MTP head catching its history up): the
// attention half's HCPre and state updates. x is not advanced (no HCPost follows).
inline void run_block_state(executor &ex, int il) {
    ex.hc_pre(il, sublayer::attention);
    ex.attention_state(il);
}

// Blocks [l0, l1) of a model of n_layer blocks (the whole model: 0, n_layer), with the embedding when
// the range starts at block 0 and `embed`, and the head when it ends at the last block and `head`.
// after_block (may be empty) runs after each block with its index (a drafter's feature capture reads
// the executor's state there).
inline void run_forward(executor &ex, int n_layer, int l0, int l1, bool embed, bool head,
                        const std::function<void(int)> &after_block = {}) {
    if (embed && l0 == 0) ex.embed();
    for (int il = l0; il < l1; ++il) {
        run_block(ex, il);
        if (after_block) after_block(il);
    }
    if (head && l1 == n_layer) ex.head();
}

}  // namespace fathom::ds4
