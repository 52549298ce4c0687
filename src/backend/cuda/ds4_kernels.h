// Host launchers of the DS4 (DeepSeek V4 Flash) decode building blocks on CUDA: the MoE expert
// GEMVs reading only the selected experts' weights (ds4_moe.cu), the router (sqrt-softplus scores,
// hash or biased top-k, weight normalisation; ds4_moe_route.cu) and the hyper-connection pre/post mixers
// with Sinkhorn normalisation (ds4_hc.cu), the indexer's scoring and exact top-k (ds4_indexer.cu).
// One token per call (decode). Pointers are device
// addresses; every count that can change per token (token id, expert ids, routing weights) is read
// from device memory, so the launches can be captured in a CUDA graph and replayed.
// Reference semantics: src/models/deepseek4_moe.cpp (the CPU reference these are tested against,
// tests/backend/cuda/test_cuda_ds4.cpp), spec ../shared/reference/ds4-architecture.md sections 3 and 5.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace fathom::cuda::ds4 {

// Bits set in the host-mapped error word (beside cuda_kernels.h's device_error_bits 0..2).
enum ds4_error_bits : uint32_t {
    err_expert_id = 1u << 8,  // an expert id outside [0, n_expert): that slot is skipped
    err_token_id = 1u << 9,   // hash routing with a token outside [0, n_vocab): ids/weights not written
};

// True for the expert weight types the MoE GEMVs decode: iq2_xxs, q2_k, mxfp4, q8_0, the K-quants
// q3_k / q4_k / q5_k / q6_k (columns a multiple of 256), and f16/f32
// (float rows need a column count that is a multiple of 4; when it is not a multiple of 32 the last
// unit of a row reads up to 31 elements past it, so the buffer needs 128 bytes of padding).
bool expert_type_supported(dtype t);
// Byte alignment the row pointer and stride of type t need (rows of 2-byte aligned formats are
// read with funnel shifts; all buffers need 16 bytes of padding after the last row).
int expert_alignment(dtype t);

// A stack of n_expert matrices [rows, cols] (ggml {cols, rows, n}) or one matrix (n_expert = 1).
struct expert_bank {
    dtype type = dtype::f32;
    const void *data = nullptr;
    size_t row_bytes = 0;     // bytes per row (cols elements)
    size_t expert_bytes = 0;  // bytes per expert (rows * row_bytes)
    int64_t n_expert = 0;
    int64_t rows = 0, cols = 0;
};

// Gate/up half of n_slot experts for one token: for slot s (e = ids ? ids[s] : 0) and r < F:
//   h[(s0 + s) * F + r] = silu(min(g, clamp)) * clamp(v, -clamp, clamp) * (w ? w[s] : 1)
// with g = gate_e row r . x, v = up_e row r . x (x [D], 16-byte aligned). gate and up must have the
// same shape [F, D] and type. An id outside the bank sets err_expert_id and leaves that slot's h
// unwritten. The activation (x here, h rows for down) is staged in shared memory: D, F <= 8192.
// Activation precision: when every weight type of a launch is iq2_xxs, q2_k, q8_0 or a K-quant
// (q3_k .. q6_k) the activation (x here, each h row for down) is first quantised per block of 32 to
// int8 as ggml's q8_1 (d = amax / 127, q = roundf(x * (1 / d))) and the dots are integer (dp4a);
// results are the dots with the dequantised activation d * q (relative error ~0.5% per GEMV vs f32
// activations, like the CPU's quantised matmuls). Other types (f32, f16, mxfp4), and every type while
// set_moe_q8_activations(false) (ds4_kernels_testing.h), keep f32 activations (results = the CPU's
// dequantised rows dotted with x, to f32 rounding). Deterministic.
void launch_moe_gate_up(const expert_bank &gate, const expert_bank &up, const int32_t *ids, const float *w,
                        int n_slot, int s0, const float *x, float clamp, float *h, uint32_t *err, cudaStream_t s);
// The q8 expert GEMVs (iq2_xxs, q2_k, q8_0 weights) stage weight rows through shared memory with
// cp.async where bases, strides and shared memory allow, else load them directly: bit-identical results
// either way. Tests and benchmarks switch the kernels and the activation precision with
// ds4_kernels_testing.h.
// Down half: y[r] = (accumulate ? y[r] : 0) + sum_{s < n_slot} down_{e_s} row r . h[(s0 + s) * F ..]
// summed in a fixed order (deterministic; not the CPU's slot order: f32 rounding differs), r < D.
// ids == null: expert 0 for every slot. h rows are q8-quantised as above (iq2_xxs / q2_k / q8_0 /
// K-quants).
void launch_moe_down(const expert_bank &down, const int32_t *ids, int n_slot, int s0, const float *h,
                     bool accumulate, float *y, uint32_t *err, cudaStream_t s);

// Router for one token from logits [E] (spec 5.1-5.3): s_e = sqrt(softplus(logit_e)); with `bias`
// (learned routing) the k experts with the largest s_e + bias_e (ties: lower id) in descending
// order, otherwise (hash routing) tid2eid[*token * k .. + k) (table [n_vocab, k]); then
// weights[j] = scale * s_{ids[j]} / sum_j s_{ids[j]}. E <= 1024, k <= 32. Hash ids outside
// [0, E) or a token outside the table set the error bits.
void launch_moe_route(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                      const int32_t *token, int k, float scale, int32_t *ids, float *weights, uint32_t *err,
                      cudaStream_t s);

// The MoE FFN of one token (spec section 5) as one chain of launches: router logits
// (gate_inp . xn, any type launch_gemv knows), routing, routed experts and the shared expert.
struct moe_layer {
    dtype gate_inp_type = dtype::f32;
    const void *gate_inp = nullptr;  // [E, D]
    size_t gate_inp_row_bytes = 0;
    const float *exp_bias = nullptr;   // [E] (learned routing) or null (hash routing)
    const int32_t *tid2eid = nullptr;  // [n_vocab, k] (hash routing)
    int64_t n_vocab = 0;
    int n_expert = 0, n_used = 0;
    float weights_scale = 0, clamp = 0, clamp_sh = 0;
    expert_bank gate, up, down;           // routed banks: [F, D], [F, D], [D, F]
    expert_bank gate_sh, up_sh, down_sh;  // shared expert (n_expert = 1), or data == null for none
};
// Scratch the chain needs: logits [E] f32, ids [k] i32, weights [k] f32, h [(k + 1) * F] f32.
struct moe_scratch {
    float *logits = nullptr;
    int32_t *ids = nullptr;
    float *weights = nullptr;
    float *h = nullptr;
};
// y [D] = MoE(xn [D]) for the token *token (device). xn 16-byte aligned. With the q2 mix (and any
// all-iq2_xxs/q2_k/q8_0 experts) xn and h are q8-quantised as launch_moe_gate_up/_down describe; the
// router GEMV stays f32.
// Launch ordering: the router GEMV (f16/f32 router: ds4_gemv.h's fast GEMV), the q8 gate/up and the
// down kernel use programmatic dependent launch (see ds4_gemv.h); the router weights must not be
// written by the kernel enqueued just before this call.
void launch_moe_ffn(const moe_layer &l, const float *xn, const int32_t *token, const moe_scratch &sc, float *y,
                    uint32_t *err, cudaStream_t s);

// The same chain for n rows at once (the rows of a multi-row decode step; n in 1..gemv_max_rows): row
// r's y (y + r * y_stride) and h are bit-identical to launch_moe_ffn on xn + r * x_stride and
// tokens[r] alone, while the shared expert's weights and the rows common to several rows' experts are
// read from HBM about once (ds4_moe.cu, "multi-row MoE"). Needs moe_rows_supported(l): the q8
// activation path of the decode chain (the DS4 q2 mix, q8_0, the K-quants) with one fused launch per
// stage; other layers run launch_moe_ffn row by row. No PDL; xn 16-byte aligned, x_stride % 4 == 0.
struct moe_rows_scratch {
    float *logits = nullptr;   // [n, E]
    int32_t *ids = nullptr;    // [n, k]
    float *weights = nullptr;  // [n, k]
    float *h = nullptr;        // [n, k + 1, F]
    void *xq = nullptr;        // moe_rows_q8_bytes(n, D)
    void *hq = nullptr;        // moe_rows_q8_bytes(n * (k + 1), F)
};
size_t moe_rows_q8_bytes(int64_t rows, int64_t cols);
bool moe_rows_supported(const moe_layer &l);
void launch_moe_ffn_rows(const moe_layer &l, int n, const float *xn, int64_t x_stride, const int32_t *tokens,
                         const moe_rows_scratch &sc, float *y, int64_t y_stride, uint32_t *err, cudaStream_t s);

// ---- hyper-connections (ds4_hc.cu) ---------------------------------------------------------------
// HCPre for one token (spec 3.1-3.3): X [n_hc, D] (stream-major, 16-byte aligned) ->
// u [D] = sum_s pre_s X_s, post [n_hc], comb [n_hc, n_hc] (row = source, column = destination).
// fn [(2 + n_hc) * n_hc, n_hc * D] is f32 or f16 (rows fn_row_bytes apart); base [(2+n_hc)*n_hc],
// scale [3] f32. `mix` is scratch of (2 + n_hc) * n_hc + 1 floats. n_hc <= 5.
struct hc_params {
    int n_hc = 0;
    int64_t dim = 0;
    int sinkhorn_iters = 0;
    float hc_eps = 0, rms_eps = 0;
};
void launch_hc_pre(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                   const float *scale, const float *x, float *mix, float *u, float *post, float *comb,
                   cudaStream_t s);
// HC head collapse (spec 3.4): z [D] = sum_s pre_s X_s, pre_s = sigmoid(r (fn_s . X) scale[0] +
// base[s]) + hc_eps. fn [n_hc, n_hc * D] f32 or f16; base [n_hc], scale [1]; mix scratch n_hc + 1.
void launch_hc_head(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                    const float *scale, const float *x, float *mix, float *z, cudaStream_t s);
// HCPost (spec 3.2): x_new[k*D + i] = post[k] * y[i] + sum_j comb[j*n_hc + k] * x_old[j*D + i].
void launch_hc_post(int n_hc, int64_t dim, const float *y, const float *x_old, const float *post,
                    const float *comb, float *x_new, cudaStream_t s);

// Fused decode HC (one launch per sublayer instead of post + mixer + apply + RMSNorm): optionally the
// previous sublayer's HCPost, then HCPre (or the HC head) and the RMSNorm of its output, bit for bit
// what launch_hc_post, launch_hc_pre / launch_hc_head and launch_rms_norm(out, D, norm, rms_eps, D, 1,
// out, D) give in sequence (same operations in the same order; tests/backend/cuda/test_cuda_ds4_hc_fused.cpp).
// The kernel is launched with programmatic dependent launch: before its griddepcontrol.wait it only
// touches fn (prefetch, or the split kernel's staging), so fn must not be written by the kernel just
// before it; it lets the next kernel start early (that kernel must wait before reading out / post /
// comb / x_new, as every PDL kernel of this backend does). Falls back to the unfused launches when
// one block cannot hold the n_hc * D state in shared memory.
// With part set, the column-split kernel runs instead (ds4_hc.cu, hc_split_kernel: up to
// kHcFusedMaxBlocks blocks, each a slice of the D columns): the same state bits, and the mixer sums
// in double in another order, so mix (and through it out, post, comb) can differ from the unfused
// chain only where that double sum rounds to a different float (tested: relative error <= 1e-6).
constexpr int kHcFusedMaxBlocks = 128;
// Doubles the split kernel's part scratch must hold for n_hc streams.
constexpr size_t hc_fused_part_count(int n_hc) {
    return static_cast<size_t>(kHcFusedMaxBlocks) * static_cast<size_t>((2 + n_hc) * n_hc + 1);
}
struct hc_fused_io {
    const float *y = nullptr;  // [D] output of the sublayer to fold in (HCPost), or null: x is the state
    const float *x = nullptr;  // [n_hc, D] the previous state (with y) or the state itself (16-byte aligned)
    float *x_new = nullptr;    // [n_hc, D] the new state (with y; written, must not alias x), else unused
    float *post = nullptr;     // [n_hc]        in: the split x was made with (with y); out: the new split
    float *comb = nullptr;     // [n_hc, n_hc]  (sublayer form; the head only reads them, with y)
    float *mix = nullptr;      // scratch [(2 + n_hc) * n_hc + 1] (head: n_hc + 1 suffice)
    uint32_t *sync = nullptr;  // arrival counter: zero before the first launch, every launch leaves it zero
    const float *norm = nullptr;  // [D] RMSNorm weight, or null (no weight)
    float *out = nullptr;         // [D] RMSNorm(u) (sublayer) / RMSNorm(z) (head)
    double *part = nullptr;  // scratch [hc_fused_part_count(n_hc)] (8-byte aligned): the column-split
                             // kernel's per-block partial sums; null: the one-block-per-row kernel
    int part_blocks = 0;     // split kernel's block count (0: kHcFusedMaxBlocks; benchmarks sweep it)
};
void launch_hc_pre_fused(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                         const float *scale, const hc_fused_io &io, cudaStream_t s);
void launch_hc_head_fused(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                          const float *scale, const hc_fused_io &io, cudaStream_t s);
// The same for `rows` rows at once (the rows of a multi-row step), each bit-identical to the one-row
// launch on its own buffers: row r's at r * n_hc * D (x, x_new), r * D (y, out), r * n_hc (post),
// r * n_hc^2 (comb), r * hc_rows_mix_floats(n_hc) (mix), r (sync: one zeroed counter per row) and
// r * hc_fused_part_count(n_hc) (part). With io.part: one launch of the split kernel (gridDim.y = rows).
constexpr size_t hc_rows_mix_floats(int n_hc) {
    return static_cast<size_t>((2 + n_hc) * n_hc + 2);
}
void launch_hc_pre_fused_rows(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes, const float *base,
                              const float *scale, const hc_fused_io &io, int rows, cudaStream_t s);
void launch_hc_head_fused_rows(const hc_params &p, dtype fn_type, const void *fn, size_t fn_row_bytes,
                               const float *base, const float *scale, const hc_fused_io &io, int rows, cudaStream_t s);

// ---- indexer (ds4_indexer.cu) -----------------------------------------------------------------------
// Indexer selection (spec 4.5) for one query: q [n_head, dim], w [n_head] (already scaled), rows
// [n, dim] (f32 or f16, row_stride bytes apart). out [min(topk, n)] = the rows with the largest
// score_c = sum_h w_h * max(0, q_h . rows_c) (ties: lower row), ascending, as the CPU's
// indexer_select. score: scratch [n]. n_head <= 128, dim <= 256.
void launch_indexer_select(const float *q, const float *w, const void *rows, bool rows_f16, size_t row_stride,
                           int64_t n, int n_head, int dim, int topk, float *score, int32_t *out, cudaStream_t s);

// ---- benchmark support ----------------------------------------------------------------------------
// One thread that spins for ns nanoseconds of device time (profiling: lets the host enqueue a whole
// step before the device starts, so per-phase event times are not launch-gap bound).
void launch_gpu_sleep(uint64_t ns, cudaStream_t s);
// Fills n bytes with a deterministic pseudo-random stream (splitmix64 of seed and the byte index).
void launch_fill_random(void *dst, size_t n, uint64_t seed, cudaStream_t s);

}  // namespace fathom::cuda::ds4
