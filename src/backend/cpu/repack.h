// Repacked Q4_K weights for the CPU backend: an in-memory layout chosen at load (the GGUF stays as
// is) that interleaves 8 weight rows so one AVX2 register holds 4 quants of each of the 8 rows, and
// the GEMV/GEMM kernels over it. The float order of each output reproduces llama.cpp's CPU_REPACK
// path (ggml-cpu's block_q4_Kx8 with ggml_gemv_q4_K_8x8_q8_K / ggml_gemm_q4_K_8x8_q8_K on AVX2):
//
//   per output (weight row r, activation row m), over super-blocks b (256 elements):
//     isum(b, sb) = sc[2sb] * dot32(2sb) + sc[2sb+1] * dot32(2sb+1)        (i32, sb = 0..3)
//     imin(b, sb) = m[2sb] * S[2sb] + m[2sb+1] * S[2sb+1]    (S = 32-element q8_K sums, i32)
//     GEMV order: acc  = fma(float(sum_sb isum), d_r * d_a, acc)   once per super-block,
//                 accm = fma(float(sum_sb imin), dmin_r * d_a, accm)
//     GEMM order: the same two fmas once per (b, sb), i.e. four per super-block
//     y = acc - accm
//
// llama.cpp takes the GEMM order for activation rows [0, M - M % 4) when M > 3 and the GEMV order
// for the rest (repack.cpp forward_mul_mat_one_chunk); q4k_x8_mul's gemm_rows argument expresses
// that choice, and gemm_rows = 0 gives every row the GEMV order whatever M is (batch invariant).
//
// Layout: groups of 8 rows; per group, per super-block, one 1184-byte block:
//   [0, 16)     d    f16 x 8 (row order)          [16, 32)   dmin f16 x 8
//   [32, 96)    scales: per sb 16 bytes = sc[2sb] of rows 0..7, then sc[2sb+1] of rows 0..7 (6-bit)
//   [96, 160)   mins:   the same arrangement
//   [160, 1184) quants: per sb, per 4-element group g (0..7): 32 bytes = 4 bytes of each row r in
//               order, each byte = q(sub-block 2sb, 4g+k) | q(sub-block 2sb+1, 4g+k) << 4 -- which
//               is exactly the source byte qs[32 sb + 4 g + k] of row r.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fathom::cpu {

constexpr int64_t q4k_x8_block_bytes = 1184;  // one super-block of 8 interleaved rows

// Bytes of the repacked form of an N x K Q4_K matrix (K % 256 == 0, N % 8 == 0).
size_t q4k_x8_bytes(int64_t K, int64_t N);

// Repack N rows of K Q4_K elements (rows src_stride bytes apart) into dst (q4k_x8_bytes). Throws
// fathom::error on a shape it cannot take.
void q4k_x8_repack(const void *src, size_t src_stride, int64_t K, int64_t N, void *dst);

// Inverse of q4k_x8_repack (bit-exact round trip; tests and debugging).
void q4k_x8_unpack(const void *packed, int64_t K, int64_t N, void *dst, size_t dst_stride);

// y[m * ldy + r] = dot(W row r, X row m) for r in [r0, r1), m in [0, M), W repacked (K x N).
// X rows are q8_K blocks (292 bytes per 256 elements), x_stride bytes apart. Rows m < gemm_rows
// (a multiple of 4) use the GEMM float order, the others the GEMV order (see above).
// Single-threaded; the caller splits rows (any r0/r1; whole groups of 8 are fastest).
void q4k_x8_mul(int64_t K, const void *packed, int64_t r0, int64_t r1, const void *X, size_t x_stride, int64_t M,
                int64_t gemm_rows, float *y, int64_t ldy);

// Activation -> q8_K as ggml_quantize_mat_q8_K_4x8 does it for rows that go through the GEMM
// (x86): amax = max |x|; iscale = -127/amax if +amax occurs in the block, else 127/amax; values
// round half to even. Differs from quantize_row(q8_k) (iscale = -127/x of the FIRST max-|x|
// element) only when both +amax and -amax occur and -amax comes first. Writes plain q8_K blocks.
void quantize_row_q8_k_x4(const float *x, void *dst, int64_t K);

// Q6_K (plain GGUF rows) x q8_K in the float order of llama.cpp's "tiled" K-quant matmul
// (ggml-cpu/tiled, taken for batches of >= 8 activation rows, kTiledMinRows, when the weight is
// not repacked): per super-block b the exact integer s1 = sum_j sc_j * sum (q - 32) * a, then
//   acc = fma(d_w * float(s1), d_a, acc)        (d_w * float(s1) rounded to f32 first)
// y[m * ldy + r] for r in [r0, r1), m in [0, M); W rows w_stride bytes apart. Single-threaded.
constexpr int64_t kTiledMinRows = 8;
void q6k_mul_tiled(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                   int64_t M, float *y, int64_t ldy);

namespace detail {
// AVX2 kernels (repack_avx2.cpp); only called when active_isa() != isa::scalar.
void q4k_x8_mul_avx2(int64_t K, const void *packed, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                     int64_t M, int64_t gemm_rows, float *y, int64_t ldy);
void q6k_mul_tiled_avx2(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                        size_t x_stride, int64_t M, float *y, int64_t ldy);
}  // namespace detail

}  // namespace fathom::cpu
