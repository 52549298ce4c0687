// Decoding of GGUF block formats (host + device, so the layouts can be checked without a GPU), shared by the GEMV, dequantise-for-GEMM and get_rows
// kernels. Every supported type is cut into "units" of 16 weights laid out as two runs of 8
// consecutive elements of the row: unit u of a row yields w[0..8) for elements [s0, s0+8) and
// w[8..16) for [s1, s1+8). A unit is what one thread decodes at a time; neighbouring lanes decode
// neighbouring units, so a warp reads a contiguous stretch of the row.
//
// Layouts (bit-exact with ggml, docs/formats/quant-types.md):
//   q4_0 18 B: f16 d, u8 qs[16]            x[j] = (qs[j]&15 - 8) d, x[j+16] = (qs[j]>>4 - 8) d
//   q4_1 20 B: f16 d, f16 m, u8 qs[16]     x = q d + m
//   q5_0 22 B: f16 d, u8 qh[4], u8 qs[16]  5th bit of element j is bit j of qh (j < 32); q - 16
//   q5_1 24 B: f16 d, f16 m, qh[4], qs[16]
//   q8_0 34 B: f16 d, i8 qs[32]
//   q2_k 84 B / 256: u8 scales[16] (lo: scale, hi: min), u8 qs[64], f16 d, f16 dmin
//   q3_k 110 B / 256: u8 hmask[32], u8 qs[64], u8 scales[12] (16 6-bit signed scales), f16 d
//   q4_k 144 B / 256: f16 d, f16 dmin, u8 scales[12] (6-bit sc/min pairs), u8 qs[128]
//   q5_k 176 B / 256: as q4_k plus u8 qh[32] before qs
//   q6_k 210 B / 256: u8 ql[128], u8 qh[64], i8 scales[16], f16 d
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <cstdint>
#include <cstring>

#include "core/types.h"

// Loop unrolling hint for nvcc's device pass; nothing for host passes (g++ warns on the pragma, and
// tests include this header from plain C++).
#ifdef __CUDA_ARCH__
#define FATHOM_UNROLL _Pragma("unroll")
#else
#define FATHOM_UNROLL
#endif

namespace fathom::cuda {

__host__ __device__ __forceinline__ float ld_f16(const uint8_t *p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t *>(p)));
}
// 8 bytes from a 2-byte aligned address as two little-endian words. On the device this is three
// aligned 4-byte loads and a funnel shift (instead of four 2-byte loads); it may read the 2 bytes
// before p and the 2 bytes after p + 8. A tensor's first row starts 4-byte aligned (allocations
// are) and the backend pads every allocation by 16 bytes, so both stay inside the allocation.
__host__ __device__ __forceinline__ void ld8_a2(const uint8_t *p, uint32_t &lo, uint32_t &hi) {
#ifdef __CUDA_ARCH__
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t *b = reinterpret_cast<const uint32_t *>(a & ~static_cast<uintptr_t>(3));
    const uint32_t sh = static_cast<uint32_t>(a & 2u) * 8u;  // 0 or 16
    const uint32_t w0 = b[0], w1 = b[1], w2 = b[sh ? 2 : 1];
    lo = __funnelshift_r(w0, w1, sh);
    hi = __funnelshift_r(w1, w2, sh);
#else
    memcpy(&lo, p, 4);
    memcpy(&hi, p + 4, 4);
#endif
}
__host__ __device__ __forceinline__ void ld8_a4(const uint8_t *p, uint32_t &lo, uint32_t &hi) {
    const uint32_t *h = reinterpret_cast<const uint32_t *>(p);
    lo = h[0];
    hi = h[1];
}
__host__ __device__ __forceinline__ uint32_t byte_of(uint32_t lo, uint32_t hi, int i) {
    return ((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xFFu;
}
// f32 product / difference rounded once each on the device too (nvcc would otherwise contract
// a * b - c into one FMA): decoders written with them give the CPU dequantisation's bits.
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
__host__ __device__ __forceinline__ float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
// Q3_K scale i (0..15) as a signed value: low 4 bits from byte i (i < 8) or the high nibble of byte
// i - 8, high 2 bits from byte 8 + i % 4 at bit 2 (i / 4) (ggml's kmask unpacking, one scale).
__host__ __device__ __forceinline__ int q3_k_scale(const uint8_t *sc, int i) {
    const int lo = i < 8 ? (sc[i] & 0xF) : (sc[i - 8] >> 4);
    const int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// q4_k / q5_k 6-bit (scale, min) pair j of 8 (ggml get_scale_min_k4).
__host__ __device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <dtype T> struct qtraits;
template <> struct qtraits<dtype::f32>  { static constexpr int bs = 16,  ts = 64,  align = 16; };
template <> struct qtraits<dtype::f16>  { static constexpr int bs = 16,  ts = 32,  align = 16; };
template <> struct qtraits<dtype::bf16> { static constexpr int bs = 16,  ts = 32,  align = 16; };
template <> struct qtraits<dtype::q4_0> { static constexpr int bs = 32,  ts = 18,  align = 2; };
template <> struct qtraits<dtype::q4_1> { static constexpr int bs = 32,  ts = 20,  align = 4; };
template <> struct qtraits<dtype::q5_0> { static constexpr int bs = 32,  ts = 22,  align = 2; };
template <> struct qtraits<dtype::q5_1> { static constexpr int bs = 32,  ts = 24,  align = 4; };
template <> struct qtraits<dtype::q8_0> { static constexpr int bs = 32,  ts = 34,  align = 2; };
template <> struct qtraits<dtype::q2_k> { static constexpr int bs = 256, ts = 84,  align = 4; };
template <> struct qtraits<dtype::q3_k> { static constexpr int bs = 256, ts = 110, align = 2; };
template <> struct qtraits<dtype::q4_k> { static constexpr int bs = 256, ts = 144, align = 4; };
template <> struct qtraits<dtype::q5_k> { static constexpr int bs = 256, ts = 176, align = 4; };
template <> struct qtraits<dtype::q6_k> { static constexpr int bs = 256, ts = 210, align = 2; };

// Decode unit u of a row starting at `row` into w[16]; s0/s1 are the element offsets of the runs.
template <dtype T>
__host__ __device__ __forceinline__ void decode_unit(const uint8_t *row, int64_t u, float w[16], int64_t &s0, int64_t &s1);

// Plain types: 16-byte loads (rows and unit offsets are 16-byte aligned; mm_alignment says 16).
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::f32>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                        int64_t &s1) {
    const float4 *p = reinterpret_cast<const float4 *>(row + 64 * u);
FATHOM_UNROLL
    for (int i = 0; i < 4; ++i) {
        const float4 v = p[i];
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
    }
    s0 = 16 * u;
    s1 = s0 + 8;
}
__host__ __device__ __forceinline__ float half_bits(uint32_t h) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
__host__ __device__ __forceinline__ float bf16_bits(uint32_t h) {
    const uint32_t u = h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::f16>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                        int64_t &s1) {
    const uint4 *p = reinterpret_cast<const uint4 *>(row + 32 * u);
FATHOM_UNROLL
    for (int i = 0; i < 2; ++i) {
        const uint4 v = p[i];
        const uint32_t q[4] = {v.x, v.y, v.z, v.w};
FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            w[8 * i + 2 * j] = half_bits(q[j] & 0xFFFFu);
            w[8 * i + 2 * j + 1] = half_bits(q[j] >> 16);
        }
    }
    s0 = 16 * u;
    s1 = s0 + 8;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::bf16>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const uint4 *p = reinterpret_cast<const uint4 *>(row + 32 * u);
FATHOM_UNROLL
    for (int i = 0; i < 2; ++i) {
        const uint4 v = p[i];
        const uint32_t q[4] = {v.x, v.y, v.z, v.w};
FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            w[8 * i + 2 * j] = bf16_bits(q[j] & 0xFFFFu);
            w[8 * i + 2 * j + 1] = bf16_bits(q[j] >> 16);
        }
    }
    s0 = 16 * u;
    s1 = s0 + 8;
}

// q4_0 / q4_1: unit h (0/1) of a block = qs[8h..8h+8): low nibbles -> elements 8h+i, high -> 16+8h+i.
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q4_0>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 1;
    const int h = static_cast<int>(u & 1);
    const uint8_t *blk = row + 18 * b;
    const float d = ld_f16(blk);
    uint32_t lo, hi;
    ld8_a2(blk + 2 + 8 * h, lo, hi);
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const uint32_t q = byte_of(lo, hi, i);
        w[i] = (static_cast<int>(q & 15) - 8) * d;
        w[8 + i] = (static_cast<int>(q >> 4) - 8) * d;
    }
    s0 = 32 * b + 8 * h;
    s1 = s0 + 16;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q4_1>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 1;
    const int h = static_cast<int>(u & 1);
    const uint8_t *blk = row + 20 * b;
    const float d = ld_f16(blk), m = ld_f16(blk + 2);
    uint32_t lo, hi;
    ld8_a4(blk + 4 + 8 * h, lo, hi);
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const uint32_t q = byte_of(lo, hi, i);
        w[i] = static_cast<float>(q & 15) * d + m;
        w[8 + i] = static_cast<float>(q >> 4) * d + m;
    }
    s0 = 32 * b + 8 * h;
    s1 = s0 + 16;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q5_0>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 1;
    const int h = static_cast<int>(u & 1);
    const uint8_t *blk = row + 22 * b;
    const float d = ld_f16(blk);
    uint32_t qh, lo, hi;
    ld8_a2(blk + 2, qh, lo);  // qh[4] then qs[0..4): only qh used from this load
    ld8_a2(blk + 6 + 8 * h, lo, hi);
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const int j = 8 * h + i;
        const uint32_t q = byte_of(lo, hi, i);
        const int x0 = static_cast<int>((q & 15) | (((qh >> j) & 1u) << 4)) - 16;
        const int x1 = static_cast<int>((q >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
        w[i] = x0 * d;
        w[8 + i] = x1 * d;
    }
    s0 = 32 * b + 8 * h;
    s1 = s0 + 16;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q5_1>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 1;
    const int h = static_cast<int>(u & 1);
    const uint8_t *blk = row + 24 * b;
    const float d = ld_f16(blk), m = ld_f16(blk + 2);
    const uint32_t qh = *reinterpret_cast<const uint32_t *>(blk + 4);
    uint32_t lo, hi;
    ld8_a4(blk + 8 + 8 * h, lo, hi);
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const int j = 8 * h + i;
        const uint32_t q = byte_of(lo, hi, i);
        w[i] = static_cast<float>((q & 15) | (((qh >> j) & 1u) << 4)) * d + m;
        w[8 + i] = static_cast<float>((q >> 4) | (((qh >> (j + 16)) & 1u) << 4)) * d + m;
    }
    s0 = 32 * b + 8 * h;
    s1 = s0 + 16;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q8_0>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 1;
    const int h = static_cast<int>(u & 1);
    const uint8_t *blk = row + 34 * b;
    const float d = ld_f16(blk);
    uint32_t a, c, e, f;
    ld8_a2(blk + 2 + 16 * h, a, c);
    ld8_a2(blk + 10 + 16 * h, e, f);
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        w[i] = static_cast<float>(static_cast<int8_t>(byte_of(a, c, i))) * d;
        w[8 + i] = static_cast<float>(static_cast<int8_t>(byte_of(e, f, i))) * d;
    }
    s0 = 32 * b + 16 * h;
    s1 = s0 + 8;
}

// q2_k / q3_k: element k of a block = 128 c + 32 j + l (l < 32) is 2-bit field j of qs[32 c + l]; unit
// = (half c, run pair p, slice s of 8): runs j = 2 p (w[0..8)) and 2 p + 1 (w[8..16)), elements
// 128 c + 32 j + 8 s + i, so s1 = s0 + 32. Scale index 8 c + 2 j + (s >> 1).
//   q2_k: x = (d * (sc & 15)) * q - dmin * (sc >> 4), sc = scales[8 c + 2 j + (s >> 1)];
//   q3_k: q -= 4 unless bit 4 c + j of hmask[l]; x = (d * scale) * q.
// Products rounded as the CPU's dequant_q2_k / dequant_q3_k (mul_rn / sub_rn: bit-identical).
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q2_k>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 4;
    const int c = static_cast<int>((u >> 3) & 1), p = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
    const uint8_t *blk = row + 84 * b;
    const float d = ld_f16(blk + 80), dmin = ld_f16(blk + 82);
    uint32_t lo, hi;
    ld8_a4(blk + 16 + 32 * c + 8 * s, lo, hi);
FATHOM_UNROLL
    for (int r = 0; r < 2; ++r) {
        const int j = 2 * p + r;
        const uint32_t sc = blk[8 * c + 2 * j + (s >> 1)];
        const float dl = mul_rn(d, static_cast<float>(sc & 0xFu)), ml = mul_rn(dmin, static_cast<float>(sc >> 4));
FATHOM_UNROLL
        for (int i = 0; i < 8; ++i)
            w[8 * r + i] = sub_rn(mul_rn(dl, static_cast<float>((byte_of(lo, hi, i) >> (2 * j)) & 3u)), ml);
    }
    s0 = 256 * b + 128 * c + 64 * p + 8 * s;
    s1 = s0 + 32;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q3_k>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 4;
    const int c = static_cast<int>((u >> 3) & 1), p = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
    const uint8_t *blk = row + 110 * b;
    const float d = ld_f16(blk + 108);
    uint32_t lo, hi, hlo, hhi;
    ld8_a2(blk + 32 + 32 * c + 8 * s, lo, hi);  // qs[32 c + l]
    ld8_a2(blk + 8 * s, hlo, hhi);              // hmask[l]
FATHOM_UNROLL
    for (int r = 0; r < 2; ++r) {
        const int j = 2 * p + r;
        const float dl = mul_rn(d, static_cast<float>(q3_k_scale(blk + 96, 8 * c + 2 * j + (s >> 1))));
FATHOM_UNROLL
        for (int i = 0; i < 8; ++i) {
            const int q = static_cast<int>((byte_of(lo, hi, i) >> (2 * j)) & 3u) -
                          (((byte_of(hlo, hhi, i) >> (4 * c + j)) & 1u) ? 0 : 4);
            w[8 * r + i] = mul_rn(dl, static_cast<float>(q));
        }
    }
    s0 = 256 * b + 128 * c + 64 * p + 8 * s;
    s1 = s0 + 32;
}

// q4_k / q5_k: unit = (group g of 64, slice s of 8): qs[32g+8s+i] low -> 64g+8s+i (pair 2g),
// high -> 64g+32+8s+i (pair 2g+1).
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q4_k>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 4;
    const int g = static_cast<int>((u >> 2) & 3), s = static_cast<int>(u & 3);
    const uint8_t *blk = row + 144 * b;
    const float d = ld_f16(blk), dmin = ld_f16(blk + 2);
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * g, blk + 4, sc0, m0);
    scale_min_k4(2 * g + 1, blk + 4, sc1, m1);
    const float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
    uint32_t lo, hi;
    ld8_a4(blk + 16 + 32 * g + 8 * s, lo, hi);
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const uint32_t q = byte_of(lo, hi, i);
        w[i] = d0 * static_cast<float>(q & 15) - mm0;
        w[8 + i] = d1 * static_cast<float>(q >> 4) - mm1;
    }
    s0 = 256 * b + 64 * g + 8 * s;
    s1 = s0 + 32;
}
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q5_k>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 4;
    const int g = static_cast<int>((u >> 2) & 3), s = static_cast<int>(u & 3);
    const uint8_t *blk = row + 176 * b;
    const float d = ld_f16(blk), dmin = ld_f16(blk + 2);
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * g, blk + 4, sc0, m0);
    scale_min_k4(2 * g + 1, blk + 4, sc1, m1);
    const float d0 = d * sc0, mm0 = dmin * m0, d1 = d * sc1, mm1 = dmin * m1;
    uint32_t lo, hi, hlo, hhi;
    ld8_a4(blk + 48 + 32 * g + 8 * s, lo, hi);
    ld8_a4(blk + 16 + 8 * s, hlo, hhi);  // qh[l] for l = 8s+i: bit 2g (low), 2g+1 (high)
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const uint32_t q = byte_of(lo, hi, i), h = byte_of(hlo, hhi, i);
        w[i] = d0 * static_cast<float>((q & 15) | (((h >> (2 * g)) & 1u) << 4)) - mm0;
        w[8 + i] = d1 * static_cast<float>((q >> 4) | (((h >> (2 * g + 1)) & 1u) << 4)) - mm1;
    }
    s0 = 256 * b + 64 * g + 8 * s;
    s1 = s0 + 32;
}

// q6_k: half n (128 elements), pair p, slice s: p = 0 uses ql[64n+8s+i] (low -> 128n+8s+i with
// qh bits 0-1, high -> 128n+64+8s+i with bits 4-5); p = 1 uses ql[64n+32+8s+i] (low -> +32 with
// bits 2-3, high -> +96 with bits 6-7). qh byte qh[32n+8s+i]; scales 8n + s/2 + {0,4} or {2,6}.
template <>
__host__ __device__ __forceinline__ void decode_unit<dtype::q6_k>(const uint8_t *row, int64_t u, float w[16], int64_t &s0,
                                                         int64_t &s1) {
    const int64_t b = u >> 4;
    const int n = static_cast<int>((u >> 3) & 1), p = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
    const uint8_t *blk = row + 210 * b;
    const float d = ld_f16(blk + 208);
    const int8_t *sc = reinterpret_cast<const int8_t *>(blk + 192) + 8 * n + (s >> 1) + 2 * p;
    const float d0 = d * sc[0], d1 = d * sc[4];
    uint32_t lo, hi, hlo, hhi;
    ld8_a2(blk + 64 * n + 32 * p + 8 * s, lo, hi);
    ld8_a2(blk + 128 + 32 * n + 8 * s, hlo, hhi);
    const int sh0 = 2 * p, sh1 = 2 * p + 4;
FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) {
        const uint32_t q = byte_of(lo, hi, i), h = byte_of(hlo, hhi, i);
        w[i] = d0 * static_cast<float>(static_cast<int>((q & 15) | (((h >> sh0) & 3u) << 4)) - 32);
        w[8 + i] = d1 * static_cast<float>(static_cast<int>((q >> 4) | (((h >> sh1) & 3u) << 4)) - 32);
    }
    s0 = 256 * b + 128 * n + 32 * p + 8 * s;
    s1 = s0 + 64;
}

// Calls f.template operator()<T>() for the runtime dtype t; returns false for unsupported types.
template <class F>
bool dispatch_qtype(dtype t, F &&f) {
    switch (t) {
    case dtype::f32: f.template operator()<dtype::f32>(); return true;
    case dtype::f16: f.template operator()<dtype::f16>(); return true;
    case dtype::bf16: f.template operator()<dtype::bf16>(); return true;
    case dtype::q4_0: f.template operator()<dtype::q4_0>(); return true;
    case dtype::q4_1: f.template operator()<dtype::q4_1>(); return true;
    case dtype::q5_0: f.template operator()<dtype::q5_0>(); return true;
    case dtype::q5_1: f.template operator()<dtype::q5_1>(); return true;
    case dtype::q8_0: f.template operator()<dtype::q8_0>(); return true;
    case dtype::q2_k: f.template operator()<dtype::q2_k>(); return true;
    case dtype::q3_k: f.template operator()<dtype::q3_k>(); return true;
    case dtype::q4_k: f.template operator()<dtype::q4_k>(); return true;
    case dtype::q5_k: f.template operator()<dtype::q5_k>(); return true;
    case dtype::q6_k: f.template operator()<dtype::q6_k>(); return true;
    default: return false;
    }
}

}  // namespace fathom::cuda
