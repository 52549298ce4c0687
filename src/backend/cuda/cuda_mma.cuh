// Warp-level tensor-core MMA pieces shared by the attention and DS4 chunk kernels (cuda_attn_mma.cu,
// ds4_attn.cu, ds4_attn_prefill.cu, ds4_indexer.cu). Include only from .cu files.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace fathom::cuda {

// c += A . B for one m16n8k16 tile: A [16, 16] f16 row-major fragment (4 registers), B [16, 8] f16
// column-major fragment (2 registers), c f32 (PTX fragment layouts: g = lane / 4, t = lane % 4; A
// {row g | g + 8} x {k 2t, 2t + 8} pairs, B k {2t, 2t + 8} pairs at column g, C {c0, c1} = row g
// columns 2t, 2t + 1, {c2, c3} = row g + 8). Compiles to nothing before sm_80 (callers do not
// launch the kernels there).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c += (a_hi + a_lo) . B for an f32 A operand carried as two f16 parts (hi = f16(a), lo = the
// rounding residual), the hi product first.
__device__ __forceinline__ void mma_hi_lo(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t b0,
                                          uint32_t b1) {
    mma_m16n8k16_f16(c, ah, b0, b1);
    mma_m16n8k16_f16(c, al, b0, b1);
}
// The same for the two n8 tiles of an ldmatrix .x4 B fragment: c0 with (b[0], b[1]), then c1 with
// (b[2], b[3]).
__device__ __forceinline__ void mma_hi_lo_x2(float (&c0)[4], float (&c1)[4], const uint32_t (&ah)[4],
                                             const uint32_t (&al)[4], const uint32_t (&b)[4]) {
    mma_hi_lo(c0, ah, al, b[0], b[1]);
    mma_hi_lo(c1, ah, al, b[2], b[3]);
}

// ldmatrix .x4 (.trans when Trans): four 8x8 f16 matrices from shared memory. Lane l supplies the
// address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); r[i] = matrix i's fragment, lane
// holding row lane / 4, columns 2 (lane % 4), + 1 (with .trans: of the transposed matrix). sm_80+;
// zeros before (callers do not launch the kernels there).
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __half *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    if constexpr (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#else
    (void)p;
    r[0] = r[1] = r[2] = r[3] = 0u;
#endif
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __half *p) { ldmatrix_x4<false>(r, p); }
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const __half *p) { ldmatrix_x4<true>(r, p); }

// Online-softmax rescale of N m16n8 f32 accumulator tiles: rows g (c0, c1) times c_g, rows g + 8
// (c2, c3) times c_g8 (the fragment layout of mma_m16n8k16_f16).
template <int N>
__device__ __forceinline__ void mma_scale_rows(float (&acc)[N][4], float c_g, float c_g8) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        acc[j][0] *= c_g;
        acc[j][1] *= c_g;
        acc[j][2] *= c_g8;
        acc[j][3] *= c_g8;
    }
}

}  // namespace fathom::cuda
