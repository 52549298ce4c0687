// Row-interleaved ("x8") copies of q4_1 and q8_0 weights for the AVX2 GEMM/GEMV hot path, owned by
// the CPU backend (cpu_backend.cpp packs each weight once and keeps the copy next to the original).
//
// Why: ggml's AVX2 dot product keeps, per output, one 8-lane float accumulator whose lane L sums
// elements 4L..4L+3 of each block (acc = fma(d_w * d_x, float(i32 lanes), acc)), then a fixed
// horizontal-sum tree. Row by row that costs a broadcast, scalar f16 loads and a scale multiply per
// row and block. In the x8 layout one 256-bit register holds the same 4-element group of 8 rows, so
// a single u8 x s8 multiply-add against the broadcast activation group yields lane L of 8 rows at
// once, the 8 per-row scales d_w * d_x come from one vector multiply, and the final tree sums whole
// vectors. Every output element sees exactly the operations, in the order, of ggml's row-by-row
// kernel (gemm_q32_exact in quants_x86_q32.h): results are bit-identical, for any M.
//
// Layout: rows are taken 8 at a time (a "group"); for each block b of the K/32 blocks, a group
// stores
//   q4_1 (160 B): d[8] f16 | m[8] f16 | 4 x 32 B quants, register k byte 4r+j =
//                 q(r, 8k+j) | q(r, 8k+4+j) << 4      (q(r, e): 4-bit element e of row r's block)
//   q8_0 (272 B): d[8] f16 | 8 x 32 B quants, register L byte 4r+j = q(r, 4L+j)
// Groups follow each other; a group's blocks are contiguous, so one group is one sequential stream.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace fathom::cpu {

// Whether weights of type t have an x8 kernel on this CPU (q4_1 / q8_0 / q5_0 with AVX2 active).
// q5_0 rows are stored in the q8_0 layout (each block converted exactly: int8 q - 16, same d) and
// multiplied by the q8_0 kernel: ggml's AVX2 q5_0 and q8_0 dots are the same arithmetic on those
// int8 values, so results stay bit-identical to gemm(q5_0, ...). Costs 34 instead of 22 bytes/block.
bool x8_supported(dtype t);

// Bytes of the x8 copy of n_groups groups (8 * n_groups rows) of K inputs. K % 32 == 0.
size_t x8_bytes(dtype t, int64_t K, int64_t n_groups);

// Pack groups [g0, g1) of W (rows w_stride bytes apart, ggml blocks) into dst, which holds the
// whole packed tensor (group g lands at g * x8_bytes(t, K, 1)).
void x8_pack(dtype t, int64_t K, const void *W, size_t w_stride, int64_t g0, int64_t g1, void *dst);

// y[m * ldy + r] = dot(row r, X row m) for rows r in [8 g0, 8 g1) and m in [0, M), reading the
// packed copy P. X rows are in vec_dot_type(t) (q8_1 for q4_1, q8_0 for q8_0), x_stride bytes apart.
// Bit-identical to gemm(t, ...) on the original rows. Single-threaded.
void x8_gemm(dtype t, int64_t K, const void *P, int64_t g0, int64_t g1, const void *X, size_t x_stride, int64_t M,
             float *y, int64_t ldy);

}  // namespace fathom::cpu

namespace fathom::cpu::detail {
// The AVX2 kernels behind x8_pack / x8_gemm (quants_x8_avx2.cpp); call only through those.
void x8_pack_avx2(bool q4_1, int64_t nb, const uint8_t *W, size_t w_stride, int64_t g0, int64_t g1, uint8_t *dst);
void x8_gemm_q4_1_avx2(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X, size_t x_stride,
                       int64_t M, float *y, int64_t ldy);
void x8_gemm_q8_0_avx2(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X, size_t x_stride,
                       int64_t M, float *y, int64_t ldy);
// AVX-512 VNNI versions (quants_x8_avx512.cpp): same results, used when active_isa() is avx512.
void x8_gemm_q4_1_avx512(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X,
                         size_t x_stride, int64_t M, float *y, int64_t ldy);
void x8_gemm_q8_0_avx512(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X,
                         size_t x_stride, int64_t M, float *y, int64_t ldy);
}  // namespace fathom::cpu::detail
