// Host launchers of DS4 (DeepSeek V4 Flash) prefill on CUDA: the building blocks of evaluating a
// CHUNK of n_tok consecutive tokens layer-major (every token of the chunk through layer l before
// layer l + 1), which is what makes prefill (and batched verification) compute-bound instead of
// re-reading every weight per token as the decode step does.
//
// Positions: as in the decode launchers (ds4_attn_kernels.h), the chunk's first position is read
// from device memory (`pos`, an int64); token t of the chunk is at *pos + t. Grids are sized from
// host-side maxima (n_tok, capacities), so a chunk of fixed n_tok can be captured in a CUDA graph.
//
// Chunk semantics (what the tests check): running a chunk through these launchers leaves the
// sequence state (raw ring, compressor frontiers, compressed and indexer rows) as n_tok decode steps
// would, and gives every token the outputs its decode step would give:
//   - element-wise stages (HC mixers, head norms, RoPE, QAT, compressors, indexer scores) are
//     BIT-IDENTICAL to the per-token decode launchers;
//   - matrix products use bf16 operands with f32 accumulation (cuBLAS), attention accumulates in f32
//     in its own order: these match the decode path within their precision (relative L2 ~1e-2 for
//     bf16 products, ~1e-6 for attention).
// The raw window of a token inside the chunk is read from the chunk's own KV rows (positions >=
// *pos), not from the ring: the ring is written only after the chunk's attention (ring_store_tail),
// so rows an in-chunk token overwrites are still seen by the earlier tokens that need them.
//
// Implementations: ds4_gemm.cu (matrix products), ds4_moe_prefill.cu (MoE), ds4_hc.cu (HC),
// ds4_attn.cu / ds4_attn_prefill.cu (query/KV rows, compressors, attention), ds4_indexer.cu
// (indexer). Reference semantics: src/models/deepseek4_*.cpp and the decode launchers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/types.h"

namespace fathom::cuda::ds4 {

// ---- matrix products over a chunk (ds4_gemm.cu) -------------------------------------------------

// A weight [rows, cols] as the prefill products see it: its GGUF rows, or (p == null) the decode
// GEMV's prepared form (ds4_gemv.h: q8_0 repacked at upload, the GGUF copy freed).
struct gemm_weight {
    dtype type = dtype::f32;
    const void *p = nullptr;  // GGUF rows, row_bytes apart (null: use *fast)
    size_t row_bytes = 0;
    const gemv_weight *fast = nullptr;
    int64_t rows = 0, cols = 0;
};

enum class gemm_precision {
    bf16,  // weights dequantised to bf16, activations rounded to bf16, f32 accumulation (cuBLAS)
    f32,   // weights dequantised to f32, f32 activations, f32 SGEMM without TF32 (router logits)
};

// Owns a cuBLAS handle bound to one stream and the scratch a product needs: the weight is
// dequantised in row tiles of at most max_w_elems elements; activations of up to max_x_elems
// elements (n_tok * cols) are converted once per call.
class gemm_runner {
  public:
    gemm_runner(cudaStream_t s, size_t max_x_elems, size_t max_w_elems = size_t{64} << 20);
    ~gemm_runner();
    gemm_runner(const gemm_runner &) = delete;
    gemm_runner &operator=(const gemm_runner &) = delete;
    cudaStream_t stream() const;
    // Moves the runner (its cuBLAS handle and every later launch) to stream s: a scratch shared by
    // sequences runs on the stream of the one using it.
    void set_stream(cudaStream_t s);

    // Types the products dequantise: the dense-weight types of the DS4 mixes (q8_0 in GGUF rows or
    // repacked, f16, f32, bf16), the expert types (iq2_xxs, q2_k, mxfp4) and the K-quants (q3_k, q4_k,
    // q5_k, q6_k: experts and dense weights of q4 / Q4_K_M-style files).
    static bool supported(const gemm_weight &w);
    // y[t * ldy + r] (=, or += with accumulate) W_r . x[t * ldx ...], t < n_tok, r < rows.
    void matmul(const gemm_weight &w, const float *x, int64_t ldx, int64_t n_tok, float *y, int64_t ldy,
                gemm_precision prec = gemm_precision::bf16, bool accumulate = false);
    // Grouped (output projection A, spec 4.7): row r multiplies x + t * ldx + (r / rows_per_group) * cols.
    void matmul_grouped(const gemm_weight &w, int64_t rows_per_group, const float *x, int64_t ldx, int64_t n_tok,
                        float *y, int64_t ldy);
    // Shape requirements (supported() checks them; matmul throws fathom::error otherwise): cols a
    // multiple of 32 (256 for iq2_xxs and the K-quants; 512 for repacked q8_0), rows aligned as the
    // type's decoder reads them (2 bytes: q8_0 / f16 / bf16 / iq2_xxs / q3_k / q6_k; 4: f32 / q2_k /
    // q4_k / q5_k; mxfp4: any), 16 bytes
    // of padding after the last row (the block decoders' funnel-shift loads), ldx >= cols, ldy >= rows,
    // n_tok * cols <= max_x_elems (bf16 precision), at least one row per tile (cols <= max_w_elems;
    // f32 tiles hold max_w_elems / 2 elements). matmul_grouped: rows % rows_per_group == 0, x holds
    // rows / rows_per_group groups of cols per token. matmul / matmul_grouped only enqueue work on
    // stream() (no synchronisation, no allocation): they can be captured in a CUDA graph.

    // ---- building blocks of moe_prefill (device operands, enqueued on stream()) ----
    // y[t * ldy + r] (=, or += with accumulate) W_r . x_t, bf16 operands (bit patterns) already on the
    // device: W [rows, cols] rows ldw elements apart, x [n_tok, cols] rows ldx apart; f32 accumulation.
    void gemm_bf16(const uint16_t *w, int64_t ldw, int64_t rows, int64_t cols, const uint16_t *x, int64_t ldx,
                   int64_t n_tok, float *y, int64_t ldy, bool accumulate = false);
    // Dequantises (bf16) every row of experts ids[0 .. n_ids) (host ids, n_ids <= max_dequant_experts) of
    // n_src (1 or 2) banks of one type and shape: dst row (i * n_src + j) * rows + r = row r of expert
    // ids[i] of bank j, dst rows cols elements apart (gate and up of an expert form one [2F, D] matrix).
    static constexpr int max_dequant_experts = 32;
    void dequant_experts_bf16(const expert_bank *src, int n_src, const int32_t *ids, int n_ids, uint16_t *dst);

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

// ---- MoE over a chunk (ds4_moe_prefill.cu) -----------------------------------------------------

// y [n_tok, D] = the MoE FFN (spec section 5) of xn [n_tok, D] for the tokens `tokens` (device ids,
// [n_tok]; hash routing reads them): router logits in f32 (gemm_precision::f32), routing exactly as
// launch_moe_route per token (same ids and weights bits), the routed experts grouped by expert (each
// expert's tokens gathered, gate/up/down as bf16 products), clamped SwiGLU, routing weights, plus the
// shared expert. Bad ids set the error bits of launch_moe_ffn and skip that slot. One host
// synchronisation per call (the per-expert token counts size the products), so forward() cannot be
// captured in a CUDA graph. Runs on g.stream(). Types: any gemm_runner dequantises (expert banks:
// cols % 32, % 256 for iq2_xxs and the K-quants). Cost: every expert with at least one token is dequantised
// whole (DS4-Flash: 50 MB of bf16 per expert), so small chunks (most experts with 1-2 tokens) are
// dequantisation-bound; the decode chain suits them better.
class moe_prefill {
  public:
    moe_prefill(gemm_runner &g, int64_t max_tok, int64_t dim, int64_t ff, int n_expert, int n_used);
    ~moe_prefill();
    moe_prefill(const moe_prefill &) = delete;
    moe_prefill &operator=(const moe_prefill &) = delete;
    void forward(const moe_layer &l, const float *xn, const int32_t *tokens, int64_t n_tok, float *y, uint32_t *err);
    // Device bytes of scratch the constructor allocated (DS4-Flash at max_tok 4096: ~1.7 GB).
    size_t scratch_bytes() const;

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

// launch_moe_route for each of n_tok tokens (ds4_moe_route.cu, the same kernel: ids and weights bit-identical
// to the per-token launch): logits [n_tok, E], tokens [n_tok] (hash routing), ids / weights [n_tok, k].
void launch_moe_route_batch(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                            const int32_t *tokens, int64_t n_tok, int k, float scale, int32_t *ids, float *weights,
                            uint32_t *err, cudaStream_t s);
// The device address of the IQ2_XXS grid table (ds4_moe.cu) that the prefill dequantisers read.
const uint64_t *iq2xxs_grid_device();

// ---- hyper-connections over a chunk (ds4_hc.cu) -------------------------------------------------

// launch_hc_pre for each of n_tok tokens (bit-identical): x [n_tok, n_hc * D] -> u [n_tok, D],
// post [n_tok, n_hc], comb [n_tok, n_hc * n_hc]; mix is scratch of n_tok * ((2 + n_hc) * n_hc + 1).
void launch_hc_pre_batch(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                         const float *scale, const float *x, int64_t n_tok, float *mix, float *u, float *post,
                         float *comb, cudaStream_t s);
// launch_hc_post for each of n_tok tokens (bit-identical): y [n_tok, D], x_old / x_new [n_tok, n_hc * D].
void launch_hc_post_batch(int n_hc, int64_t dim, int64_t n_tok, const float *y, const float *x_old, const float *post,
                          const float *comb, float *x_new, cudaStream_t s);

// The DSpark drafter's target feature of each of n_tok tokens (spec 7): out[t * out_stride + i] = the mean
// of the n_hc streams of x [n_tok, n_hc * D] at column i, summed in stream order then divided by n_hc (the
// CPU's ds4::dspark_capture, bit for bit). out_stride >= D.
void launch_hc_stream_mean(int n_hc, int64_t dim, int64_t n_tok, const float *x, float *out, int64_t out_stride,
                           cudaStream_t s);

// ---- query and KV rows, compressors (ds4_attn.cu) ----------------------------------------------

// launch_head_norm_rope for each token (bit-identical): x [n_tok, n_head, hd], token t at *pos + t.
void launch_head_norm_rope_batch(float *x, int64_t n_tok, int n_head, int hd, bool norm, float eps,
                                 const rope_args &rope, qat_kind qat, const int64_t *pos, cudaStream_t s);
// The KV rows of a chunk: kv [n_tok, d] normed / RoPE'd / QAT'd in place exactly as
// launch_kv_finish_store does, and row t stored (f16 rounding when rows_f16) at rows + t * row_stride
// instead of the ring: these chunk rows are bit-identical to the ring rows the decode steps write.
void launch_kv_finish_batch(float *kv, int64_t n_tok, int d, const float *norm_w, float eps, const rope_args &rope,
                            qat_kind qat, void *rows, bool rows_f16, size_t row_stride, const int64_t *pos,
                            cudaStream_t s);
// After the chunk's attention: ring row (p mod window) = chunk row of position p, for the last
// min(n_tok, window) positions of the chunk (rows and ring in the same precision, `elem` bytes per
// value, d values per row).
void launch_ring_store_tail(const void *rows, size_t row_stride, int64_t n_tok, int d, int elem, void *ring,
                            size_t ring_stride, int window, const int64_t *pos, cudaStream_t s);
// One compressor over a chunk: ca, cg [n_tok, c * dim]. Leaves the frontier state, the emitted rows
// and the error bits exactly (bit for bit) as n_tok successive launch_compressor_step calls at
// positions *pos .. *pos + n_tok - 1 would.
void launch_compressor_chunk(const compressor_args &a, const float *ca, const float *cg, int64_t n_tok,
                             const int64_t *pos, uint32_t *err, cudaStream_t s);

// ---- indexer and attention over a chunk (ds4_indexer.cu, ds4_attn_prefill.cu) -------------------

// launch_indexer_topk for each token t at *pos + t (same selection, bit for bit): q [n_tok, n_head,
// dim], w [n_tok, n_head] (unscaled), sel [n_tok, topk], n_sel [n_tok]. `score` is scratch of
// score_floats floats (at least max_n; with fewer than n_tok * max_n the tokens are scored in groups
// of score_floats / max_n, one score + top-k launch pair per group). Cost: the scores are exact double
// dot products (64 x 128 FMAs per row and token in f64): ~n_tok * n * 8192 DFMAs, FP64-bound.
// exact = false (prefill): for the DS4 geometry (64 x 128, f16 rows, sm_80+) the scores come from
// tensor cores instead (f16 rows exact, queries split f16 hi + lo, f32 accumulation: ~1e-6 relative,
// ~15x faster), so a near-tie between two rows may select the other one; other cases stay exact.
void launch_indexer_topk_batch(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16,
                               size_t row_stride, int ratio, int64_t max_n, int n_head, int dim, int topk,
                               int64_t n_tok, const int64_t *pos, float *score, size_t score_floats, int32_t *sel,
                               int32_t *n_sel, cudaStream_t s, bool exact = true);

// Sparse sink attention of n_tok tokens at *pos + t: for each token what launch_sparse_sink_attention
// computes (same row set and order: raw window rows, then the compressed rows of a.mode), except that
// window rows of positions >= *pos are read from the chunk rows (chunk + (p - *pos) * chunk_stride,
// the ring's precision a.ring_f16) and earlier ones from the ring; list mode reads token t's rows from
// a.sel + t * a_sel_stride, count a.n_sel[t]. q, o [n_tok, n_head, d]; inverse RoPE of the outputs at
// each token's position. Matches the per-token launcher within f32 rounding (relative ~1e-6; f16 rows
// on sm_80+: tensor cores with split f32 operands, ~3e-6).
// `part` is scratch of attn_batch_part_floats(a, n_tok) floats: 0 (part may be null) once
// n_tok * ceil(n_head / 16) >= 512 blocks (every block finishes its heads); smaller batches split each
// token's rows (at most 512 / (n_tok * ceil(n_head / 16)) splits): size it for the n_tok launched
// (the count is not monotone in n_tok). sel_stride >= a.max_comp in list mode (n_tok > 1).
size_t attn_batch_part_floats(const sparse_attn_args &a, int64_t n_tok);
void launch_sparse_sink_attention_batch(const sparse_attn_args &a, const void *chunk, size_t chunk_stride,
                                        int64_t n_tok, int sel_stride, const float *q, const int64_t *pos,
                                        float *part, float *o, cudaStream_t s);

}  // namespace fathom::cuda::ds4
