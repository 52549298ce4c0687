// Warp-level tensor-core MMA shared by the DS4 chunk kernels (ds4_attn_prefill.cu, ds4_indexer.cu).
// Include only from .cu files.
#pragma once
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

}  // namespace fathom::cuda
