// Quantisation-aware-training round trips that are part of DS4's semantics (spec section 8):
//   QAT-1: FP8 e4m3fn round trip of KV rows (non-RoPE dims) in blocks of 64,
//   QAT-2: normalised Walsh-Hadamard transform + FP4 e2m1 round trip in blocks of 32 (indexer).
// Scales are powers of two (ue8m0): s = 2^ceil(log2(amax / fmt_max)); rounding is to nearest even.
#pragma once
#include <cstdint>

namespace fathom::ds4 {

// Nearest e4m3fn value of x, |x| <= 448 expected (clamped), ties to even. Subnormal step 2^-9.
float fp8_e4m3_round(float x);
// Nearest e2m1 value of x ({0, .5, 1, 1.5, 2, 3, 4, 6}), clamped to +-6, ties to even code.
float fp4_e2m1_round(float x);
// Smallest power of two >= v (v > 0, finite): 2^ceil(log2 v), computed exactly.
float pow2_ceil(float v);

// In-place FP8 round trip of n values in blocks of `block` (n a multiple of block):
// amax floored at 1e-4, s = pow2_ceil(amax/448), x = s * e4m3(x/s).
void fp8_round_trip(float *x, int64_t n, int64_t block = 64);
// In-place FP4 round trip in blocks of `block`: amax floored at 6*2^-126, s = pow2_ceil(amax/6).
void fp4_round_trip(float *x, int64_t n, int64_t block = 32);
// In-place Walsh-Hadamard transform (Sylvester order) scaled by 1/sqrt(n); n a power of two.
void hadamard_normalised(float *x, int64_t n);

}  // namespace fathom::ds4
