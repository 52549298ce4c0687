// Host-callable launchers for the CUDA backend's kernels (cuda_mm.cu: weight formats; cuda_ops.cu:
// everything else). Pointers are device addresses; strides are in elements unless named *_bytes.
// Launchers only enqueue on `s`; shape validation happens in cuda_backend.cpp before they are called.
// Device-side checks (positions and ids that only exist on the device) set bits in `err`, a
// host-mapped word read by synchronize().
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace fathom::cuda {

enum device_error_bits : uint32_t {
    err_get_rows_id = 1u << 0,   // a device token id outside the table
    err_kv_pos = 1u << 1,        // kv_store position outside the cache
    err_attn_pos = 1u << 2,      // attention span outside the cache
};

// True when the GEMV / dequantise kernels know dtype t.
bool mm_supported(dtype t);
// Byte alignment a weight row pointer and stride need for dtype t's kernels.
int mm_alignment(dtype t);

// y[m*ldy + r] = W row r . x row m, r < N, m < M. W rows w_stride bytes apart, K % 16 == 0,
// x rows 16-byte aligned. Meant for small M (decode); each 4 rows of x re-read W.
void launch_gemv(dtype t, const void *W, size_t w_stride, int64_t K, int64_t N, const float *x, int64_t ldx,
                 int64_t M, float *y, int64_t ldy, cudaStream_t s);
// dst[r*K + k] (bf16) = dequantised W, all N rows.
void launch_dequant_bf16(dtype t, const void *W, size_t w_stride, int64_t K, int64_t N, uint16_t *dst,
                         cudaStream_t s);
// dst[m*K + k] (bf16) = x[m*ldx + k].
void launch_f32_to_bf16(const float *x, int64_t ldx, int64_t K, int64_t M, uint16_t *dst, cudaStream_t s);
// out[i*ldo + k] = dequantised table row ids[i]; ids >= n_rows or < 0 set err_get_rows_id.
void launch_get_rows(dtype t, const void *table, size_t t_stride, int64_t K, int64_t n_rows, const int32_t *ids,
                     int64_t n, float *out, int64_t ldo, uint32_t *err, cudaStream_t s);

// ---- cuda_ops.cu ---------------------------------------------------------------------------------
void launch_rms_norm(const float *x, int64_t ldx, const float *w, float eps, int64_t n, int64_t rows, float *y,
                     int64_t ldy, cudaStream_t s);

// Table of (cos, sin) for positions *pos_base + p0 + t, t < n (pos_base: device int64).
struct rope_table_args {
    int32_t n_rot;
    float freq_base, freq_scale, ext_factor, mscale, corr0, corr1;
    const float *freq_factors;  // device [n_rot/2] or null
};
void launch_rope_table(const int64_t *pos_base, int64_t p0, int64_t n, const rope_table_args &a, float *out,
                       int64_t ldo, cudaStream_t s);
void launch_rope(float *x, int64_t ldx, int64_t rows, int64_t n_head, int32_t head_dim, const float *table,
                 int64_t ldt, int32_t n_rot, bool neox, cudaStream_t s);
// cache rows h*n_ctx + *pos_base + p0 + t get src row t's head h (f16 or f32 cache).
void launch_kv_store(const float *src, int64_t lds, int64_t n_tok, int32_t n_head_kv, int32_t hd, void *cache,
                     bool f16, size_t cache_stride_bytes, int64_t n_ctx, const int64_t *pos_base, int64_t p0,
                     uint32_t *err, cudaStream_t s);
// backend::qk_rope_store in one launch: per-head RMSNorm of q / k (norm weights [hd] or null), RoPE by
// table row t (n_rot dims, neox or normal pairs), q * q_scale, then k (final values) and v stored at cache
// rows h*n_ctx + *pos_base + p0 + t (outside the cache: err_kv_pos). q and k are updated in place.
// hd <= 512.
struct qk_rope_store_args {
    int32_t n_head, n_head_kv, hd, n_rot;
    bool neox, f16;
    const float *q_norm, *k_norm;
    float eps, q_scale;
    void *k_cache, *v_cache;
    size_t cache_stride;  // bytes between cache rows (k and v alike)
    int64_t n_ctx, p0;
};
void launch_qk_rope_store(float *q, int64_t ldq, float *k, int64_t ldk, const float *v, int64_t ldv, int64_t n_tok,
                          const float *table, int64_t ldt, const qk_rope_store_args &a, const int64_t *pos_base,
                          uint32_t *err, cudaStream_t s);
// acc[r*lda + i] += rms_norm(x row r)[i] * w[i] (backend::rms_norm_add; x unchanged).
void launch_rms_norm_add(const float *x, int64_t ldx, const float *w, float eps, int64_t n, int64_t rows, float *acc,
                         int64_t lda, cudaStream_t s);
struct attn_args {
    int32_t n_head, n_head_kv, head_dim;
    int64_t n_ctx, n_past;  // n_past is an offset added to *pos_base
    float scale, softcap;
    int32_t window;
};
// Key splits for n_tok queries of n_head heads over a cache of n_ctx rows (position-independent;
// from kAttnMmaMinTokens tokens on, attention_mma_splits).
int attention_splits(int64_t n_tok, int32_t n_head, int64_t n_ctx);
// With n_split > 1, `part` holds n_tok*n_head*n_split*(head_dim+2) floats of scratch.
void launch_attention(const float *q, int64_t ldq, int64_t n_tok, const void *k, const void *v, bool f16,
                      size_t kv_stride_bytes, const attn_args &a, const int64_t *pos_base, float *out, int64_t ldo,
                      uint32_t *err, float *part, int n_split, cudaStream_t s);

// ---- cuda_attn_mma.cu: tensor-core flash attention (prefill) --------------------------------------
// launch_attention takes it for f16 caches, n_tok >= kAttnMmaMinTokens and attention_mma_usable; same
// contract as launch_attention (n_split > 1: partials in `part` for the caller's combine pass).
// From 2 queries on: a block reads each K/V tile once for all its queries, where the scalar kernel
// re-reads the whole span per (query, head) - PFlash's 8 scoring queries over a 128K prompt took
// 18 ms per layer that way. Single-token decode keeps the scalar split kernel.
constexpr int64_t kAttnMmaMinTokens = 2;
// head_dim 64 / 128 / 256, 16-byte aligned K/V bases and row stride, sm_80+ with enough shared memory.
bool attention_mma_usable(int32_t head_dim, const void *k, const void *v, size_t kv_stride_bytes);
// Key splits of the tensor-core kernel (blocks of 64 queries x one head; position-independent).
int attention_mma_splits(int64_t n_tok, int32_t n_head, int64_t n_ctx);
void launch_attention_mma(const float *q, int64_t ldq, int64_t n_tok, const void *k, const void *v,
                          size_t kv_stride_bytes, const attn_args &a, const int64_t *pos_base, float *out,
                          int64_t ldo, uint32_t *err, float *part, int n_split, cudaStream_t s);

enum class ew_op { add, add_bcast, scale, softcap, swiglu, geglu, copy_f32, copy_f16 };
// Row-wise elementwise: out = op(a, b) over rows x n. Pointers/strides per operand (b may be null).
void launch_elementwise(ew_op op, const float *a, int64_t lda, const float *b, int64_t ldb, void *out,
                        int64_t ldo, int64_t n, int64_t rows, float param, cudaStream_t s);
void launch_softmax(float *x, int64_t ldx, int64_t n, int64_t rows, cudaStream_t s);
// backend::attention_prob_max (PFlash scoring): query t (of n_q, rows ldq floats apart) at position
// first_pos + t, head h against f16 key rows (h / group) * n_ctx + j, j <= first_pos + t (hd halves
// each, contiguous): agg[t * ld_agg + j] = max(agg, softmax_j). hd <= 512, hd % 8 == 0.
void launch_attn_prob_max(const float *q, int64_t ldq, const uint16_t *k, int n_head, int group, int64_t n_ctx,
                          int hd, float scale, float softcap, int64_t first_pos, int64_t n_q, float *agg,
                          int64_t ld_agg, cudaStream_t s);
void launch_set_i64(int64_t *dst, int64_t v, cudaStream_t s);

}  // namespace fathom::cuda
