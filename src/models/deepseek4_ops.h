// Small self-contained f32 helpers for the DS4 reference forward: matrix x vectors over dequantised
// rows, RMSNorm, interleaved partial RoPE with YaRN frequencies, and scalar activations.
// Reductions accumulate in a fixed order (double for norms and dot products) so
// results do not depend on threading or chunking.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "models/deepseek4.h"

namespace fathom::ds4 {

// The exec_options that matmul/matmul_rows use on this thread: forward() and mtp_forward() install
// their state's options for the duration of the call (thread-local, so sessions on different
// threads do not interfere; the pool's workers never call matmul themselves).
const exec_options &current_exec();
class exec_scope {
  public:
    explicit exec_scope(const exec_options &o);
    ~exec_scope();
    exec_scope(const exec_scope &) = delete;
    exec_scope &operator=(const exec_scope &) = delete;

  private:
    const exec_options *prev_;
};

// Run fn(a, b) over sub-ranges covering [0, total), split across current_exec().pool (inline when
// there is none or total * work_per_item is small). fn must only write disjoint outputs per item.
void parallel_for(int64_t total, int64_t work_per_item, const std::function<void(int64_t, int64_t)> &fn);

// Dot product of n floats, accumulated in double (16 lanes, then a fixed pairwise sum).
float dot_f32(const float *a, const float *b, int64_t n);
// out[r] = dot_f32(a, b + r * n, n) for r in [0, rows), bit for bit (several rows per pass where the
// CPU allows: one a against the rows of b, e.g. a query head against the candidate K rows).
void dot_f32_rows(const float *a, const float *b, int64_t rows, int64_t n, float *out);

// Sink attention over heads in groups when attention_heads_grouped(d) (AVX-512F: d a multiple of 128;
// AVX2 + FMA: of 32): s[h*n + r] = dot_f32(q + h*d, kv + r*d, d) for 4 heads (q [4, d]), bit for bit;
// and o[h*d + i] = sum over r in order of p[h*n + r] * kv[r*d + i] (a float multiply then an add per
// row, as the one-head loop does) for 2 heads (p [2, n], o [2, d]).
bool attention_heads_grouped(int64_t d);
void attention_scores_heads4(const float *q, const float *kv, int64_t n, int64_t d, float *s);
void attention_values_heads2(const float *p, const float *kv, int64_t n, int64_t d, float *o);

// y[i*W.rows + r] = sum_c W[r][c] * x[i*W.cols + c] for i in [0, n). Reference path (default): rows
// are dequantised once per call (any dtype with CPU dequantisation; f32 rows are read in place when
// aligned). current_exec() may thread it over rows and/or route quantised weights through cpu::gemm.
void matmul(const matrix &w, const float *x, int64_t n, float *y);
// Same for a row range [r0, r1): y[i*(r1-r0) + (r-r0)].
void matmul_rows(const matrix &w, int64_t r0, int64_t r1, const float *x, int64_t n, float *y);

// out = x / sqrt(mean(x^2) + eps) * w (w may be null: no weight). out may alias x.
void rms_norm(const float *x, int64_t n, const float *w, float eps, float *out);

// RoPE frequencies for one layer kind (spec 4.2): f_i for i in [0, n_rot/2).
struct rope_table {
    std::vector<float> freq;
};
// Plain RoPE: f_i = base^(-2i/n_rot), in f32 as the official table computes it.
rope_table rope_plain(float base, int n_rot);
// YaRN-blended frequencies (no magnitude factor): pairs below the correction range keep b_i,
// pairs above are divided by `factor`, linear ramp in between.
rope_table rope_yarn(float base, int n_rot, float factor, int64_t orig_ctx, float beta_fast, float beta_slow);
// Rotate interleaved pairs (x[2i], x[2i+1]) of the n_rot dims at x by pos*f_i (inverse: -pos*f_i).
void rope_apply(float *x, const rope_table &t, int64_t pos, bool inverse);
// rope_apply on n_heads vectors at the same position, x + h * stride for h in [0, n_heads).
void rope_apply_heads(float *x, int64_t stride, int64_t n_heads, const rope_table &t, int64_t pos, bool inverse);

inline float sigmoid(float x) {
    return 1.0f / (1.0f + std::exp(-x));
}
inline float silu(float x) {
    return x / (1.0f + std::exp(-x));
}
// torch softplus (beta 1, threshold 20).
inline float softplus(float x) {
    return x > 20.0f ? x : std::log1p(std::exp(x));
}

}  // namespace fathom::ds4
