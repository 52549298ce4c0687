// Fast decode GEMV for DS4's dense weights (q8_0, f16, f32): y[r] = W_r . x for one token, with a
// grouped form (output projection A) and a multi-matrix form (several weights sharing one input in
// one launch). Kernels: ds4_gemv.cu; tests: tests/backend/cuda/test_cuda_ds4_gemv.cpp; benchmarks:
// bench/cuda/bench_ds4_gemv.cpp; their switches and probes: ds4_gemv_testing.h.
//
// Weights are prepared once at upload (gemv_prepare):
//   q8_0 is REPACKED (a layout change only: every quant byte and f16 scale keeps its bits) into
//     q      int8 [rows, cols], rows q_stride = cols bytes apart, element order (the blocks' quants end
//            to end): lane l's 16-byte load of tile t (512 elements) holds elements 512 t + 16 l .. + 15,
//            half (l & 1) of the tile's block l / 2; the 32 lanes read 512 contiguous bytes.
//     scales f16 [rows, cols / 32], rows s_stride = cols / 16 bytes apart, block order.
//   f16 / f32 rows are read in place (q = the GGUF rows, scales unused).
// Requirements (gemv_fast_supported): q8_0 cols % 512 == 0; f16 / f32 cols % 4 == 0 with 16-byte
// aligned rows (pointer and stride); x 16-byte aligned, cols floats per group.
//
// Kernels: tables of q8_0 and f16 weights (cols <= 16384; grouped only when a block's rows span at
// most two groups) run the persistent int8-activation kernel (gemv_q8x_kernel): x is quantised per
// 32-element block as the MoE kernels stage it (ggml q8_1 reference rounding, f32 scale). Other tables
// (f32 segments, or ds4_gemv_testing.h's set_gemv_q8_activations(false)) run the f32-activation kernel.
// Numerics of q8_0 rows with int8 x (the CANONICAL ORDER, which every kernel that computes such a row
// follows bit for bit, so a row's result never depends on how many x a launch takes): the plan
// (plan_q8x: warps per row W, from the table and the device) gives each row 16 W accumulators a(s, p),
// s < W, p < 16; a(s, p) starts at +0 and takes, for j = 0, 1, .. in order, the block b = 16 (s + W j) + p
// of the row (every W-th 512-element tile from tile s, its p-th block):
//   a = fma(d_w[b] * d_x[b], (float) dot_b, a), dot_b the exact integer dot of the block's 32 quants;
// the warp part of s is the xor-shuffle tree over 32 lanes holding a(s, 0), +0, a(s, 1), +0, .. (lane 2p
// holds a(s, p); steps 16, 8, 4, 2, 1, value of lane 0), and the row is part(0) + part(1) + .. + part(W - 1)
// in that order. f16 rows: f32 x, per-lane f32 accumulation and the same tree. (f32-activation kernel:
// d_block * sum_j q_j x_j per 4-element run, per-thread, then the tree.) No atomics: the same inputs give
// the same bits on every run.
//
// Launch ordering: the GEMVs are launched with programmatic dependent launch (PDL). A kernel starts
// streaming its WEIGHTS while the previous kernel in the stream is still finishing, and waits for
// that kernel (griddepcontrol.wait) before it reads x or writes y. Consequence for callers: weights
// must not be written by the kernel that immediately precedes a GEMV launch in the stream
// (gemv_prepare's kernel included: synchronise, or enqueue any other work, after preparing).
// Everything else (x, y) follows normal stream order. Graph capture keeps these edges.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/types.h"

namespace fathom::cuda::ds4 {

// A weight ready for the fast GEMV (layout above). Pointers are device addresses.
struct gemv_weight {
    dtype type = dtype::f32;
    const void *q = nullptr;       // q8_0: int8 [rows, cols] repacked; f16 / f32: the rows themselves
    const void *scales = nullptr;  // q8_0: f16 [rows, cols / 32] repacked; otherwise null
    size_t q_stride = 0;           // bytes between rows of q
    size_t s_stride = 0;           // bytes between rows of scales (q8_0)
    int64_t rows = 0, cols = 0;
};

// True when the fast GEMV handles type t with cols columns (q8_0, f16, f32; see the banner).
bool gemv_fast_supported(dtype t, int64_t cols);
// Device bytes gemv_prepare needs at dst: rows * cols * 17 / 16 for q8_0, 0 for f16 / f32 (used in
// place).
size_t gemv_prepared_bytes(dtype t, int64_t rows, int64_t cols);
// src: the GGUF rows on the device (src_stride bytes apart; q8_0 rows 2-byte aligned, f16 / f32 rows
// 16-byte aligned). q8_0: enqueues the repack into dst (gemv_prepared_bytes, 16-byte aligned) on s;
// f16 / f32: returns a weight over src (dst unused). Throws on an unsupported type / shape.
gemv_weight gemv_prepare(dtype t, const void *src, size_t src_stride, int64_t rows, int64_t cols, void *dst,
                         cudaStream_t s);

// y [rows] = W . x, x [cols] f32.
void launch_gemv_fast(const gemv_weight &w, const float *x, float *y, cudaStream_t s);
// Grouped (DS4 output projection A): x [ceil(rows / rows_per_group), cols]; row r uses
// x + (r / rows_per_group) * cols.
void launch_gemv_fast_grouped(const gemv_weight &w, int64_t rows_per_group, const float *x, float *y,
                              cudaStream_t s);

// Several weights with the same cols and the same x in ONE launch (DS4: q_a, kv, compressor kv/gate,
// indexer projection and indexer compressor kv/gate all read the same normed input); types may
// differ per segment. Segment i writes segs[i].y [segs[i].w.rows], or with accumulate adds to it
// (y[r] = y[r] + W_r . x: a residual add folded into the GEMV that produces the addend; y must not
// overlap x or another segment's y).
struct gemv_segment {
    gemv_weight w;
    float *y = nullptr;
    bool accumulate = false;
};
constexpr int gemv_max_segments = 8;
void launch_gemv_multi(const gemv_segment *segs, int n_segs, const float *x, cudaStream_t s);
// The same with an RMSNorm of x first: y_i = W_i . ((x * r) * norm_w), r = 1 / sqrt(mean(x^2) + eps),
// with cuda::launch_rms_norm's arithmetic (same bits). The int8-activation kernel folds the norm into
// its x staging (no separate launch, x unchanged); tables it does not take get launch_rms_norm in
// place on x, then the plain launch. So x's contents after the call are unspecified (x or the normed
// x). norm_w [cols], 16-byte aligned for the folded form.
void launch_gemv_multi_normed(const gemv_segment *segs, int n_segs, float *x, const float *norm_w, float eps,
                              cudaStream_t s);
// True when launch_gemv_multi_normed folds the norm into the int8 kernel for these segments (x is then left
// unchanged; the current device's occupancy is queried). Same checks as the launch.
bool gemv_multi_normed_folds(const gemv_segment *segs, int n_segs, const float *x, const float *norm_w);
// The same weights (every one q8_0) applied to a gated-FFN activation formed in the int8 kernel's x staging:
// y_i = W_i . (act(gate) * up), act 0 = silu, 1 = gelu_tanh (cuda::launch_elementwise's swiglu / geglu
// arithmetic; neither gate nor up is written). Returns false, launching nothing, when the int8 kernel does
// not take the set (another type, up not 16-byte aligned): run the glu, then a plain launch.
bool launch_gemv_glu(const gemv_segment *segs, int n_segs, const float *gate, const float *up, int act,
                     cudaStream_t s);

// Several x at once (the rows of a multi-row decode step): x row c at x + c * x_stride (floats, a multiple
// of 4, >= the x a single launch reads), outputs of row c at y + c * rows (each segment's y [nx, rows]).
// Row c's outputs are bit-identical to the single-x launch above on x row c (the q8x kernel loads each
// weight chunk once for all rows and repeats every row's own arithmetic; tables it does not take run the
// single-x launches row by row). nx in 1..gemv_max_rows. The normed form leaves x's rows as the single
// launch does (unspecified: x or the normed x).
constexpr int gemv_max_rows = 16;
// Raises the columns kernels' shared-memory limit on the current device (once; a launch with more than
// 48 KiB does it too, which must not happen first inside a graph capture: call this at setup).
void gemv_rows_prepare();
void launch_gemv_rows(const gemv_weight &w, int nx, const float *x, int64_t x_stride, float *y, cudaStream_t s);
void launch_gemv_grouped_rows(const gemv_weight &w, int64_t rows_per_group, int nx, const float *x, int64_t x_stride,
                              float *y, cudaStream_t s);
void launch_gemv_multi_rows(const gemv_segment *segs, int n_segs, int nx, const float *x, int64_t x_stride,
                            cudaStream_t s);
void launch_gemv_multi_normed_rows(const gemv_segment *segs, int n_segs, int nx, float *x, int64_t x_stride,
                                   const float *norm_w, float eps, cudaStream_t s);

}  // namespace fathom::cuda::ds4
