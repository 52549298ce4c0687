// Small f32/f16 vector kernels used by the CPU backend's attention and elementwise ops, with a
// scalar generic version (vec.cpp) and an AVX2+FMA+F16C override (vec_avx2.cpp) picked once from
// CPUID. (Quantised dot products live in quants.h, owned separately.)
#pragma once
#include <cstdint>

namespace fathom::cpu {

struct vec_kernels {
    float (*dot_f32)(int64_t n, const float *a, const float *b);
    float (*dot_f16)(int64_t n, const uint16_t *a, const float *b);      // a: f16 bits
    void (*axpy_f32)(int64_t n, float a, const float *x, float *y);      // y += a*x
    void (*axpy_f16)(int64_t n, float a, const uint16_t *x, float *y);   // y += a*x, x: f16 bits
    void (*f16_to_f32_row)(int64_t n, const uint16_t *x, float *y);
    void (*f32_to_f16_row)(int64_t n, const float *x, uint16_t *y);      // round to nearest even

    // llama.cpp-mirroring kernels (fast mode), reproducing ggml-cpu's x86 float order:
    // dot with ONE 8-lane FMA accumulator (lane = index mod 8) and the (lo+hi, movehl, movehdup)
    // horizontal sum — llamafile's tinyBLAS f16 kernel, which computes KQ and KQV.
    float (*dot_f16_lanes)(int64_t n, const uint16_t *a, const float *b);
    // ggml_vec_dot_f16 (which llama.cpp uses instead of tinyBLAS for a single-token batch): four
    // 8-lane FMA accumulators over steps of 32, reduced (0+2, 1+3, 0+1) and then two hadds; the
    // n % 32 tail is added in double.
    float (*dot_f16_ggml)(int64_t n, const uint16_t *a, const float *b);
    // y[i] = exp(x[i] - mx) with ggml's vectorised expf (8 at a time from i = 0); returns the sum as
    // ggml_vec_soft_max_f32 forms it: each group of 8 summed in float, groups added in double.
    double (*softmax_exp)(int64_t n, const float *x, float mx, float *y);
    // out[i] = silu(g[i]) * u[i] with ggml's vectorised silu (x / (1 + expf(-x))).
    void (*swiglu)(int64_t n, const float *g, const float *u, float *out);
    // y[i] = x[i] * s rounded to the nearest f16 (ties to even) and back to f32: llama.cpp's f16
    // copies of attention inputs (q, probabilities). In place allowed.
    void (*round_f16)(int64_t n, const float *x, float s, float *y);
    // Several queries against one f16 row, converting the row once; each result bit-identical to
    // the single-row kernel. nq in [1, 4].
    //   out[q] = dot_f16_lanes(n, a, b[q]);     y[q] += c[q] * x  (axpy_f16)
    void (*dot_f16_lanes_multi)(int64_t n, const uint16_t *a, const float *const *b, int nq, float *out);
    void (*axpy_f16_multi)(int64_t n, const float *c, const uint16_t *x, float *const *y, int nq);
    // Attention's KQV into 8 cell lanes, for cells j in [j0, j1] and nq in [1, 4] queries:
    //   lanes[q][(j % 8) * hd + d] += p[q][j] * v[j * v_stride + d]   (v: f16 rows)
    // bit-identical to axpy_f16 per cell in increasing j, but with the lane accumulators held in
    // registers while a lane's cells stream past. Needs hd % 16 == 0 for the fast path.
    void (*kqv_lanes_f16)(int64_t hd, int64_t j0, int64_t j1, const uint16_t *v, int64_t v_stride,
                          const float *const *p, int nq, float *const *lanes);
    // Several f16 rows (a + r * a_stride, r in [0, nr)) against one query, each result bit-identical
    // to dot_f16_lanes(n, row, b): attention's KQ for one decode token over a run of cached keys.
    void (*dot_f16_lanes_rows)(int64_t n, const uint16_t *a, int64_t a_stride, int64_t nr, const float *b,
                               float *out);
};

const vec_kernels &vec();            // best kernels for this CPU
const vec_kernels &vec_generic();    // scalar reference
const vec_kernels *vec_avx2();       // null if not compiled in / not supported

}  // namespace fathom::cpu
