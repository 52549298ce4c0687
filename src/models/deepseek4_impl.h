// Internal building blocks of the DS4 forward, exposed for the block-level unit tests
// (tests/ds4) and the MTP head. Shapes are in torch order: [rows, cols], row-major.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "models/deepseek4.h"
#include "models/deepseek4_ops.h"

namespace fathom::ds4 {

// ---- hyper-connections (deepseek4_moe.cpp) -------------------------------------------------------

// Split the mixer output m = r * (F v) into pre [n_hc], post [n_hc] and the Sinkhorn-normalised
// combine matrix comb [n_hc, n_hc] (row j = source stream, column k = destination). Spec 3.1-3.3.
void hc_split_sinkhorn(const float *mix, const float *scale, const float *base, int n_hc, int iters,
                       float eps, float *pre, float *post, float *comb);
// Sinkhorn normalisation alone (spec 3.3): comb [n, n] holds C0 on entry, C on return.
void sinkhorn(float *comb, int n, int iters, float eps);

// HCPre for one token: X [n_hc, D] -> u [D], post [n_hc], comb [n_hc, n_hc].
void hc_pre(const hparams &hp, const hc_weights &w, const float *x, float *u, float *post, float *comb);
// HCPost: x_new[k] = post[k]*y + sum_j comb[j][k] * x_old[j]. x_new must not alias x_old.
void hc_post(int n_hc, int64_t dim, const float *y, const float *x_old, const float *post, const float *comb,
             float *x_new);
// HC head collapse (spec 3.4): X [n_hc, D] -> z [D].
void hc_head(const hparams &hp, const hc_weights &w, const float *x, float *z);

// ---- MoE (deepseek4_moe.cpp) ---------------------------------------------------------------------

struct route {
    std::vector<int> experts;    // [used]
    std::vector<float> weights;  // [used], renormalised and scaled
};
// Routing from router logits [E] (spec 5.1-5.3): sqrt(softplus) scores, hash table or biased top-k.
route moe_route(const hparams &hp, const layer_weights &l, const float *logits, int32_t token);
// h[i] = silu(min(g[i], clamp)) * clamp(v[i], -clamp, clamp), in place in g.
void swiglu_clamped(float *g, const float *v, int64_t n, float clamp);
// MoE FFN of one token: xn [D] -> y [D].
void moe_forward(const hparams &hp, const layer_weights &l, const float *xn, int32_t token, float *y);
// MoE FFN of a chunk, each expert's products batched over the tokens routed to it:
// xn [n, D] -> y [n, D]; every token's result has the bits of moe_forward on it alone.
void moe_forward_batch(const hparams &hp, const layer_weights &l, const float *xn,
                       std::span<const int32_t> tokens, float *y);

// ---- attention (deepseek4_attn.cpp) --------------------------------------------------------------

// RoPE tables of a model: plain (ratio-0 layers) and YaRN (compressed layers, compressors, indexer).
struct rope_set {
    rope_table plain;
    rope_table yarn;
    const rope_table &for_ratio(int ratio) const { return ratio > 0 ? yarn : plain; }
};
rope_set make_rope_set(const hparams &hp);

// Push token `pos`'s compressor projections a, g [c*d'] into the frontier. When pos closes a block
// ((pos+1) mod R == 0) the pooled (pre-norm) row [d'] is written to `pooled` and true is returned.
bool compressor_push(compressor_state &s, const compressor_weights &w, const float *a, const float *g,
                     int64_t pos, float *pooled);

// Indexer selection (spec 4.5): q [idx_head, idx_dim], w [idx_head] (already scaled), rows [n, idx_dim].
// Returns the indices of the min(topk, n) rows with the largest scores, ascending.
std::vector<int64_t> indexer_select(const float *q, const float *w, const row_store &rows, int64_t n,
                                    int idx_head, int idx_dim, int topk);

// Sink attention of one query (spec 4.6): q [H, d], keys = values kv [n, d] -> o [H, d].
void attend_with_sink(const float *q, const float *kv, int64_t n, const float *sinks, int n_head, int64_t d,
                      float scale, float *o);

// Attention sublayer for a chunk of n consecutive tokens (state updated token by token):
// xn [n, D] (normed attention input) -> y [n, D].
void attention_layer(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                     qat_mode qat, const float *xn, std::span<const int64_t> positions, float *y);

// Full block (HC attention half + HC MoE half) for a chunk: x [n, n_hc, D] updated in place.
void block_forward(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                   qat_mode qat, float *x, std::span<const int32_t> tokens,
                   std::span<const int64_t> positions);

}  // namespace fathom::ds4
