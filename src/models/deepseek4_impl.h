// Internal building blocks of the DS4 forward, exposed for the block-level unit tests
// (tests/models/ds4) and the MTP head. Shapes are in torch order: [rows, cols], row-major.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "models/deepseek4.h"
#include "models/deepseek4_ops.h"

namespace fathom::ds4 {

// ---- tensor-parallel shares (src/dist/tp.*) ------------------------------------------------------

// The part of a block one tensor-parallel rank evaluates: query heads [head0, head1) (rows of q_b,
// sinks), output groups [group0, group1) (rows of o_a, the matching column block of o_b; groups are
// head-contiguous, so group0 * H/G == head0), routed experts [expert0, expert1), shared-expert width
// [ff0, ff1) (rows of gate/up, the matching column block of down). The sublayer outputs are then this
// rank's partial sums. tp_whole() is everything: the single-rank forward, bit for bit.
struct tp_slice {
    int head0 = 0, head1 = 0;
    int group0 = 0, group1 = 0;
    int expert0 = 0, expert1 = 0;
    int64_t ff0 = 0, ff1 = 0;
};
tp_slice tp_whole(const hparams &hp);

// Views into the same weights (no copy): rows [r0, r1) of w, and columns [c0, c1) of every row (w.data
// then points inside the row; row_bytes is unchanged). A column block must start and end on the
// type's quantisation blocks (32 for Q8_0, 256 for K-quants, 1 for F32/F16): throws fathom::error
// naming `what` otherwise. The whole range returns w itself.
matrix matrix_rows(const matrix &w, int64_t r0, int64_t r1);
matrix matrix_cols(const matrix &w, int64_t c0, int64_t c1, const char *what);

// ---- tensors of a GGUF (deepseek4_load.cpp; the main model's and the drafters' loaders) ----------

// The tensor `name` with exactly the shape `ne` (ggml order); throws fathom::error naming it.
const gguf::tensor_info &tensor_shaped(const gguf::file &f, const std::string &name, std::vector<int64_t> ne);
// A 2-D weight, torch [rows, cols] = ggml {cols, rows}, of a type with CPU kernels.
matrix tensor_matrix(const gguf::file &f, const std::string &name, int64_t cols, int64_t rows);
// A small parameter vector of shape `ne` (f32, f16 or bf16, finite) copied to f32.
std::vector<float> tensor_vector(const gguf::file &f, const std::string &name, std::vector<int64_t> ne);

// ---- hyper-connections (deepseek4_moe.cpp) -------------------------------------------------------

// Split the mixer output m = r * (F v) into pre [n_hc], post [n_hc] and the Sinkhorn-normalised
// combine matrix comb [n_hc, n_hc] (row j = source stream, column k = destination). Spec 3.1-3.3.
void hc_split_sinkhorn(const float *mix, const float *scale, const float *base, int n_hc, int iters,
                       float eps, float *pre, float *post, float *comb);
// Sinkhorn normalisation alone (spec 3.3): comb [n, n] holds C0 on entry, C on return.
void sinkhorn(float *comb, int n, int iters, float eps);

// HCPre for one token: X [n_hc, D] -> u [D], post [n_hc], comb [n_hc, n_hc].
void hc_pre(const hparams &hp, const hc_weights &w, const float *x, float *u, float *post, float *comb);
// The same with the mixing product already taken: mix [w.fn.rows] = F x (matmul of this row, which any
// batch of rows gives bit for bit), scaled in place; hc_pre is matmul + this.
void hc_pre_mixed(const hparams &hp, const hc_weights &w, const float *x, float *mix, float *u, float *post,
                  float *comb);
// HCPost: x_new[k] = post[k]*y + sum_j comb[j][k] * x_old[j]. x_new must not alias x_old.
void hc_post(int n_hc, int64_t dim, const float *y, const float *x_old, const float *post, const float *comb,
             float *x_new);
// HC head collapse (spec 3.4): X [n_hc, D] -> z [D].
void hc_head(const hparams &hp, const hc_weights &w, const float *x, float *z);
// The output head over n final HC states: rows[i] -> X [n_hc, D]; logits row i [n_vocab] = output x
// RMSNorm(HCHead(X); norm). The rows' products go through the output matrix together (64 at a time), so a
// step's verification rows or batched sequences read the head once, not once per row; matmul gives every
// row the bits of a lone row.
void head_rows(const hparams &hp, const hc_weights &hc, const float *norm, const matrix &output,
               std::span<const float *const> rows, float *logits);

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
// `slice` (null: the whole layer) restricts it to one tensor-parallel rank's routed experts and
// shared-expert width: y is then that rank's partial sum (routing is still computed in full).
void moe_forward_batch(const hparams &hp, const layer_weights &l, const float *xn,
                       std::span<const int32_t> tokens, float *y, const tp_slice *slice = nullptr);

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
// `slice` (null: all heads) restricts the queries, attention and output projection to one
// tensor-parallel rank's heads and groups: y is then that rank's partial sum. KV, compressors and
// the indexer are always computed in full (replicated: one shared K=V row per token, MQA).
void attention_layer(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                     qat_mode qat, const float *xn, std::span<const int64_t> positions, float *y,
                     const tp_slice *slice = nullptr);
// The same for rows of several sequences (a multi-row step): row i is at positions[i] and reads and
// updates *states[i] (its sequence's state of this layer). Rows of one sequence must come in position
// order; the projections run over all rows at once, everything after them per row in row order.
void attention_rows(const hparams &hp, const rope_set &ropes, const layer_weights &l,
                    std::span<layer_state *const> states, qat_mode qat, const float *xn,
                    std::span<const int64_t> positions, float *y, const tp_slice *slice = nullptr);

// Only the state updates of attention_rows (each row's KV row into its ring, the compressors and the
// indexer compressor stepped): the layer's state afterwards equals attention_rows' bit for bit, with no
// query, attention or output computed. For rows whose attention output nothing reads (the MTP head's
// rows that only catch its history up, mtp_observe).
void attention_state_rows(const hparams &hp, const rope_set &ropes, const layer_weights &l,
                          std::span<layer_state *const> states, qat_mode qat, const float *xn,
                          std::span<const int64_t> positions);

// Full block (HC attention half + HC MoE half) for a chunk: x [n, n_hc, D] updated in place.
// Tensor parallel (tp non-null): each sublayer computes tp->slice's partial y [n, D], then
// tp->reduce(y) must replace it by the sum over all ranks (an all-reduce) before HCPost.
struct tp_block {
    tp_slice slice;
    std::function<void(std::span<float> y)> reduce;
};
void block_forward(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                   qat_mode qat, float *x, std::span<const int32_t> tokens,
                   std::span<const int64_t> positions, const tp_block *tp = nullptr);
// The block's state updates for a chunk (run_block_state: HCPre of the attention half, then
// attention_state_rows): ls ends as block_forward leaves it; x [n, n_hc, D] is only read.
void block_state(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls, qat_mode qat,
                 float *x, std::span<const int32_t> tokens, std::span<const int64_t> positions);

// forward_layers (deepseek4.h) for one tensor-parallel rank: blocks [l0, l1) with `tp`'s slice and
// all-reduce. Every rank keeps the full HC state x [n, n_hc, D] and every layer's full KV state.
void forward_layers_tp(const model &m, std::span<layer_state> layers, qat_mode qat, const exec_options &exec,
                       int l0, int l1, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                       std::span<float> x, const tp_block &tp);

}  // namespace fathom::ds4
