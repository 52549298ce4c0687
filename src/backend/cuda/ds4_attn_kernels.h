// Host launchers of the DS4 attention sublayer's decode kernels on CUDA (ds4_attn.cu; the indexer
// top-k in ds4_indexer.cu beside launch_indexer_select, whose kernels it shares): per-head
// norm + partial RoPE of the query, the KV row's norm/RoPE/FP8 round trip into the raw ring, the KV
// compressors' frontier update and row emission, the indexer's query preparation and top-k over a
// device-sized row set, sparse sink attention over raw window + compressed rows with inverse RoPE on
// the outputs, and the grouped low-rank output GEMV.
//
// One token per call (decode). The token's absolute position is read from device memory (`pos`, an
// int64), never passed by value, and every count derived from it (window rows, emitted compressed
// rows, selected rows) is computed on the device: the launches can be captured once in a CUDA graph
// and replayed at any position. Grids are sized from the host-side maxima given (capacities).
//
// Reference semantics (what tests/backend/cuda/test_cuda_ds4_attn.cpp compares against): the CPU functions in
// src/models/deepseek4_attn.cpp, deepseek4_ops.cpp (rms_norm, rope_apply), deepseek4_qat.cpp; spec
// ../shared/reference/ds4-architecture.md section 4 and 8.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace fathom::cuda::ds4 {

// RoPE tables are the CPU's rope_table.freq arrays uploaded as-is: f_i, i < n_rot / 2. A pair
// (x[2i], x[2i+1]) of the n_rot dims is rotated by ang = float(pos) * f_i (an f32 product, cos/sin
// of it as the CPU computes them, sign flipped for the inverse), spec 4.2.
struct rope_args {
    const float *freq = nullptr;  // device [n_rot / 2]
    int n_rot = 0;
};

// Which QAT round trip an emitted row / KV row gets (spec 8): none, FP8 e4m3 on the first
// `dim - n_rot` dims in blocks of 64 (QAT-1), or normalised Hadamard over all dims then FP4 e2m1 in
// blocks of 32 (QAT-2, indexer rows and queries).
enum class qat_kind { none, fp8_nope, hadamard_fp4 };

// Query heads: for each of n_head rows of x [n_head, hd] (in place): optional RMSNorm without weight
// (eps), then RoPE of the last n_rot dims at *pos, then the optional QAT round trip (`qat` over the
// whole head: hadamard_fp4 for indexer queries; none for attention queries).
void launch_head_norm_rope(float *x, int n_head, int hd, bool norm, float eps, const rope_args &rope,
                           qat_kind qat, const int64_t *pos, cudaStream_t s);

// KV row of the token (in place in kv [d]): RMSNorm with weight norm_w, RoPE of the last n_rot dims
// at *pos, QAT (fp8_nope or none); then stored into ring row (*pos mod window) (f16 rounding when
// ring_f16, else f32; rows ring_stride bytes apart). `window` here is the ring's row count (a
// sequence's ring keeps ds4::max_rollback rows more than the attention window, for rollback).
void launch_kv_finish_store(float *kv, int d, const float *norm_w, float eps, const rope_args &rope, qat_kind qat,
                            void *ring, bool ring_f16, size_t ring_stride, int window, const int64_t *pos,
                            cudaStream_t s);

// One compressor (spec 4.4) for the token at *pos: a, g [c*dim] are its projections (c = 2 when
// ratio == 4, else 1). The frontier is position-indexed (the CPU's compressor_state layout): kv/score
// [slots, c*dim] f32, position q in slot q mod slots, slots >= 2R for ratio 4 (the overlap reads the
// previous block too) else >= R; ds4::max_rollback slots more keep a rolled-back sequence's
// positions intact. The token writes a and g + ape[phase] into its slot. When (*pos + 1) mod R == 0
// it pools the block's candidates by position (ratio 4: the previous block's R positions, columns
// 0..dim, then the current block's, columns dim..2 dim; positions < 0 count as empty: score -inf;
// softmax over the candidates per channel, as compressor_push), applies RMSNorm(norm_w), RoPE of
// the last n_rot dims at the block start *pos + 1 - R, the QAT round trip `qat`, and stores the row
// at index (*pos + 1) / R - 1 of rows (f16 or f32, row_stride bytes apart; an index >= max_rows is
// not written and sets err bit err_comp_row). dim <= 512. Slots are never cleared: a slot a block
// reads was written by its own position (stale values of rolled-back positions are overwritten).
struct compressor_args {
    int ratio = 0, dim = 0;
    int slots = 0;                  // frontier rows (>= 2R for ratio 4, else >= R)
    const float *ape = nullptr;     // [ratio, c*dim]
    const float *norm_w = nullptr;  // [dim]
    float eps = 0;
    rope_args rope;  // the compressed layers' YaRN table
    qat_kind qat = qat_kind::none;
    float *state_kv = nullptr, *state_score = nullptr;
    void *rows = nullptr;
    bool rows_f16 = true;
    size_t row_stride = 0;
    int64_t max_rows = 0;
};
void launch_compressor_step(const compressor_args &a, const float *ca, const float *cg, const int64_t *pos,
                            uint32_t *err, cudaStream_t s);

// Indexer top-k for the token at *pos (spec 4.5): n = (*pos + 1) / ratio compressed indexer rows are
// visible (n <= max_n); score_c = sum_h (w_h * w_scale) * max(0, q_h . rows_c); sel [topk] receives
// the min(topk, n) best rows (ties: lower row) in ascending order and *n_sel their count. q [n_head,
// dim], w [n_head] unscaled. Same score bits as the CPU's indexer_select (see ds4_indexer.cu).
// score: scratch [max_n]. n_head <= 128, dim <= 256. exact = false: tensor-core scores for the DS4
// geometry (see launch_indexer_topk_batch in ds4_prefill.h): not the CPU's bits, near-ties may pick
// the other row, several times faster at long context.
void launch_indexer_topk(const float *q, const float *w, float w_scale, const void *rows, bool rows_f16,
                         size_t row_stride, int ratio, int64_t max_n, int n_head, int dim, int topk,
                         const int64_t *pos, float *score, int32_t *sel, int32_t *n_sel, cudaStream_t s, bool exact = true);

// Sparse sink attention of the token at *pos (spec 4.6) over, in this order: the raw window rows
// max(0, *pos - window + 1) .. *pos (ring row p mod window), then the compressed rows chosen by the
// layer kind:
//   comp_mode none : no compressed rows (ratio-0 layers),
//   comp_mode all  : rows 0 .. (*pos + 1) / ratio - 1 of comp (ratio-128 layers),
//   comp_mode list : rows sel[0 .. *n_sel) of comp (ratio-4 layers, indexer choice).
// q [n_head, d], keys = values; o[h] = sum_r p_hr row_r with p = softmax over (scores * scale, sink_h)
// (the sink is a logit in the denominator only). Then the inverse RoPE (rope, at *pos) of the last
// n_rot dims of each head's output. `part` is scratch of attn_part_floats(...) floats. d a multiple of
// 64, <= 512.
enum class comp_mode { none, all, list };
struct sparse_attn_args {
    int n_head = 0, d = 0;
    float scale = 0;
    const float *sinks = nullptr;  // [n_head]
    const void *ring = nullptr;
    bool ring_f16 = true;
    size_t ring_stride = 0;
    int window = 0;     // the raw rows attended: positions (pos - window, pos]
    int ring_rows = 0;  // rows of the ring (position p in row p mod ring_rows; >= window; 0: window)
    comp_mode mode = comp_mode::none;
    const void *comp = nullptr;
    bool comp_f16 = true;
    size_t comp_stride = 0;
    int ratio = 0;                   // comp_mode all
    const int32_t *sel = nullptr;    // comp_mode list
    const int32_t *n_sel = nullptr;  // comp_mode list
    int64_t max_comp = 0;            // the most compressed rows a call can see (grid sizing)
    rope_args rope;                  // inverse RoPE of outputs
    // Tensor-core split kernel (ds4_attn.cu) when every row is f16 and aligned to a dim pair, q is
    // 16-byte aligned, part 8-byte aligned and the device is sm_80+; ~1e-6 relative to the f32
    // kernel. false forces the f32 split kernel (tests, benchmarks). Same `part` size either way.
    bool tensor_cores = true;
    // Tensor-core path only: one launch instead of split + combine (the split kernel's busy blocks meet
    // at a barrier per head group and combine among themselves; same bits as the two launches; a PDL
    // launch). Needs the first attn_part_sync_bytes() of `part` zero before the first such call (every
    // call leaves them zero, so a memset at allocation or once per step suffices; buffers shared by
    // layers of different capacities share these words). Falls back to the two launches when the
    // grid cannot be resident all at once.
    bool fused_combine = false;
};
// Floats of `part` for a call: its first attn_part_sync_bytes() bytes are the fused combine's
// counters, at that fixed offset whatever the arguments.
size_t attn_part_floats(const sparse_attn_args &a);
size_t attn_part_sync_bytes();
void launch_sparse_sink_attention(const sparse_attn_args &a, const float *q, const int64_t *pos, float *part, float *o,
                                  cudaStream_t s);

// Grouped GEMV (spec 4.7, output projection A): W [groups * rows_per_group, K] (any launch_gemv
// type), x [groups, K] (group g's input at x + g * K); y[r] = W row r . x[r / rows_per_group].
void launch_gemv_grouped(dtype t, const void *W, size_t w_stride, int64_t K, int64_t rows_per_group, int groups,
                         const float *x, float *y, cudaStream_t s);

// Index of the largest of n logits (ties: lower index) into *out. n <= 2^31.
void launch_argmax(const float *x, int64_t n, int32_t *out, cudaStream_t s);
// The same for `rows` rows of x, ld floats apart, in one launch (one block per row, each row's reduction
// launch_argmax's): out[r] for row r.
void launch_argmax_rows(const float *x, int64_t n, int rows, int64_t ld, int32_t *out, cudaStream_t s);

// Bit set in the error word when a compressor row index lands outside its buffer.
constexpr uint32_t err_comp_row = 1u << 10;

}  // namespace fathom::cuda::ds4
