// Quantised tensor kernels for the CPU backend: dequantisation, activation quantisation, dot
// products and small GEMM tiles, for every dtype with dtype_info(t).compute == true.
//
// Layouts are bit-exact with GGUF/ggml blocks (docs/formats/quant-types.md). Each kernel has a
// scalar reference (quants_generic.cpp) and ISA overrides (quants_avx2.cpp, quants_avx512.cpp)
// chosen once at start-up from CPUID; force_isa() lets tests compare every ISA with the scalar one.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace fathom::cpu {

enum class isa { scalar, avx2, avx512 };
isa detected_isa();          // best ISA this CPU supports
isa active_isa();            // the ISA kernels currently dispatch to
void force_isa(isa level);   // tests/benchmarks only; clamps to detected_isa()
const char *isa_name(isa level);

// The activation format a weight type's quantised dot product consumes:
//   q4_0, q5_0, q8_0, mxfp4 -> q8_0;  q4_1, q5_1 -> q8_1;  k-quants, iq2_xxs -> q8_k;
//   f16 -> f16; bf16 -> bf16; f32 -> f32.
dtype vec_dot_type(dtype weight);

// dst[0..n) = dequantised src. n must be a multiple of the block size.
void dequantize_row(dtype t, const void *src, float *dst, int64_t n);

// Quantise n floats into dtype t blocks. Implemented for the activation types (q8_0, q8_1, q8_k,
// f16, bf16, f32) with ggml's exact rounding, and for weight types with a reference quantiser
// (round-to-nearest per block; used by writers and tests, not on hot paths).
void quantize_row(dtype t, const float *src, void *dst, int64_t n);

// Activation conversion exactly as ggml-cpu's x86 build does it before a quantised dot product
// (llama.cpp's numerics): q8_0 and q8_1 use the multiplier 127/amax and round half to even (the
// reference quantize_row uses 1/d and roundf; they differ on ~1e-5 of elements); every other type
// as quantize_row. The fast-mode mul_mat uses this.
void quantize_row_act(dtype t, const float *src, void *dst, int64_t n);

// Dot product of one weight row (type w) with one activation row of type vec_dot_type(w), n elements.
float vec_dot(dtype w, int64_t n, const void *wrow, const void *arow);

// GEMM tile: y[m*ldy + r] = dot(W row r, X row m) for r in [r0, r1), m in [0, M).
// W rows are w_stride bytes apart, X rows (already in vec_dot_type(w)) x_stride bytes apart.
// Single-threaded; the caller splits [0, N) across threads. Register-blocked over rows and columns.
void gemm(dtype w, int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1,
          const void *X, size_t x_stride, int64_t M, float *y, int64_t ldy);

// f16/bf16 conversions (scalar reference, exact round-to-nearest-even).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);

}  // namespace fathom::cpu
