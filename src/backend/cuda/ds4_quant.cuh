// DS4 expert weight formats on the CUDA backend: decoding of 32-weight units of IQ2_XXS, Q2_K, MXFP4,
// Q8_0 (the shared expert of the q2 mix) and the K-quants Q3_K .. Q6_K (q4 / Q4_K_M files; their
// layouts in the K-quant section below), host + device so tests/backend/cuda/test_cuda_ds4.cpp checks
// every element against the CPU dequantize_row without a GPU. Used by ds4_moe.cu.
//
// A unit is 32 weights in 4 runs of 8: w[8 r + i] is row element base + r * stride + i.
//   iq2_xxs 66 B / 256: f16 d, u16 qs[32]; unit = group g of 32 (8 bytes: 4 grid indices | 4 x 7-bit
//                       sign codes + 4-bit scale); contiguous (stride 8). Element = db * grid * sign,
//                       db = d * (0.5 + scale) * 0.25.
//   q2_k    84 B / 256: u8 scales[16] (lo: scale, hi: min), u8 qs[64], f16 d, f16 dmin; unit =
//                       (half c, slice s): 8 bytes qs[32c + 8s ..], 2-bit field j -> run j,
//                       base 128c + 8s, stride 32. x = d * sc * q - dmin * m.
//   mxfp4   17 B / 32:  u8 e (e8m0), u8 qs[16]; lo nibbles -> 0..15, hi -> 16..31; x = 2^(e-128) * 2v.
//   q8_0    34 B / 32:  f16 d, i8 qs[32].
//   q3_k, q4_k, q5_k, q6_k / 256: Q2_K's unit (base 256 b + 128 c + 8 s, stride 32).
// The per-element products are written with round-to-nearest intrinsics on the device so nvcc cannot
// contract them into FMAs: decoded weights are bit-identical to the CPU's dequantisation.
// Loads may touch up to 4 bytes past a row's last block (funnel-shift loads of 2-byte / 1-byte
// aligned data): device buffers holding these formats need 16 bytes of padding (cuda_backend
// allocations have it).
#pragma once
#include <cmath>

#include "backend/cuda/cuda_quant.cuh"

namespace fathom::cuda::ds4q {

// mul_rn / sub_rn (explicitly rounded f32 product and difference) and q3_k_scale: cuda_quant.cuh.
using cuda::mul_rn;
using cuda::sub_rn;
using cuda::q3_k_scale;

__host__ __device__ __forceinline__ int popc8(uint32_t v) {
#ifdef __CUDA_ARCH__
    return __popc(v);
#else
    return __builtin_popcount(v);
#endif
}

// 16 bytes from any byte address as 4 little-endian words (device: 4-5 aligned loads + funnel
// shifts, may read 3 bytes past p + 16).
__host__ __device__ __forceinline__ void ld16_any(const uint8_t *p, uint32_t q[4]) {
#ifdef __CUDA_ARCH__
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t *b = reinterpret_cast<const uint32_t *>(a & ~static_cast<uintptr_t>(3));
    const uint32_t sh = static_cast<uint32_t>(a & 3u) * 8u;
    uint32_t w[5];
    FATHOM_UNROLL
    for (int i = 0; i < 4; ++i) w[i] = b[i];
    w[4] = sh ? b[4] : w[3];
    FATHOM_UNROLL
    for (int i = 0; i < 4; ++i) q[i] = __funnelshift_r(w[i], w[i + 1], sh);
#else
    memcpy(q, p, 16);
#endif
}

// e8m0 exponent -> 2^(e-128) exactly (ggml's E8M0_TO_FP32_HALF; subnormal for e < 2).
__host__ __device__ __forceinline__ float e8m0_half(uint32_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
// e2m1 code -> 2 * value: 0 1 2 3 4 6 8 12, bit 3 = sign.
__host__ __device__ __forceinline__ int e2m1_x2(uint32_t c) {
    const int m = static_cast<int>(c & 7u);
    const int v = m < 4 ? m : (m < 6 ? (m - 2) * 2 : (m - 4) * 4);
    return (c & 8u) ? -v : v;
}

template <dtype T> struct unit_traits;
template <> struct unit_traits<dtype::iq2_xxs> { static constexpr int block = 256, bytes = 66, align = 2; };
template <> struct unit_traits<dtype::q2_k>    { static constexpr int block = 256, bytes = 84, align = 4; };
template <> struct unit_traits<dtype::mxfp4>   { static constexpr int block = 32,  bytes = 17, align = 1; };
template <> struct unit_traits<dtype::q8_0>    { static constexpr int block = 32,  bytes = 34, align = 2; };
// Float rows (the ds4-tiny reference model stores experts in f32): units of 32 consecutive elements;
// the last unit of a row whose length is not a multiple of 32 reads past it (into the next row or
// the buffer's padding) and those weights meet zeros in the staged activation. block = the column
// multiple the kernels need (float4 staging).
template <> struct unit_traits<dtype::f32>     { static constexpr int block = 4,   bytes = 4,  align = 4; };
template <> struct unit_traits<dtype::f16>     { static constexpr int block = 4,   bytes = 2,  align = 2; };

// Decode unit u of a row into w[32]; base/stride as in the banner. `grid` is the IQ2_XXS grid as
// 256 little-endian u64 (8 magnitudes each); other types ignore it.
template <dtype T>
__host__ __device__ __forceinline__ void decode32(const uint8_t *row, int64_t u, float w[32], int64_t &base,
                                                  int &stride, const uint64_t *grid);

template <>
__host__ __device__ __forceinline__ void decode32<dtype::iq2_xxs>(const uint8_t *row, int64_t u, float w[32],
                                                                  int64_t &base, int &stride, const uint64_t *grid) {
    const int64_t b = u >> 3;
    const int g = static_cast<int>(u & 7);
    const uint8_t *blk = row + 66 * b;
    const float d = ld_f16(blk);
    uint32_t a0, a1;
    ld8_a2(blk + 2 + 8 * g, a0, a1);
    const float db = mul_rn(mul_rn(d, 0.5f + static_cast<float>(a1 >> 28)), 0.25f);
    FATHOM_UNROLL
    for (int l = 0; l < 4; ++l) {
        const uint64_t gv = grid[(a0 >> (8 * l)) & 0xFFu];
        const uint32_t code = (a1 >> (7 * l)) & 127u;
        const uint32_t signs = code | (static_cast<uint32_t>(popc8(code) & 1) << 7);
        FATHOM_UNROLL
        for (int j = 0; j < 8; ++j) {
            const float m = mul_rn(db, static_cast<float>((gv >> (8 * j)) & 0xFFu));
            w[8 * l + j] = ((signs >> j) & 1u) ? -m : m;
        }
    }
    base = 32 * u;
    stride = 8;
}

template <>
__host__ __device__ __forceinline__ void decode32<dtype::q2_k>(const uint8_t *row, int64_t u, float w[32],
                                                               int64_t &base, int &stride, const uint64_t *) {
    const int64_t b = u >> 3;
    const int c = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
    const uint8_t *blk = row + 84 * b;
    const float d = ld_f16(blk + 80), dmin = ld_f16(blk + 82);
    uint32_t q0, q1, s0, s1;
    ld8_a4(blk + 16 + 32 * c + 8 * s, q0, q1);
    ld8_a4(blk + 8 * c, s0, s1);  // scales[8c .. 8c+8): run j uses byte 2j + (s >> 1)
    FATHOM_UNROLL
    for (int j = 0; j < 4; ++j) {
        const uint32_t sc = byte_of(s0, s1, 2 * j + (s >> 1));
        const float dl = mul_rn(d, static_cast<float>(sc & 0xFu)), ml = mul_rn(dmin, static_cast<float>(sc >> 4));
        FATHOM_UNROLL
        for (int i = 0; i < 8; ++i) {
            const uint32_t q = (byte_of(q0, q1, i) >> (2 * j)) & 3u;
            w[8 * j + i] = sub_rn(mul_rn(dl, static_cast<float>(q)), ml);
        }
    }
    base = 256 * b + 128 * c + 8 * s;
    stride = 32;
}

template <>
__host__ __device__ __forceinline__ void decode32<dtype::mxfp4>(const uint8_t *row, int64_t u, float w[32],
                                                                int64_t &base, int &stride, const uint64_t *) {
    const uint8_t *blk = row + 17 * u;
    const float d = e8m0_half(blk[0]);
    uint32_t q[4];
    ld16_any(blk + 1, q);
    FATHOM_UNROLL
    for (int j = 0; j < 16; ++j) {
        const uint32_t v = (q[j >> 2] >> (8 * (j & 3))) & 0xFFu;
        w[j] = mul_rn(d, static_cast<float>(e2m1_x2(v & 15u)));
        w[16 + j] = mul_rn(d, static_cast<float>(e2m1_x2(v >> 4)));
    }
    base = 32 * u;
    stride = 8;
}

template <>
__host__ __device__ __forceinline__ void decode32<dtype::q8_0>(const uint8_t *row, int64_t u, float w[32],
                                                               int64_t &base, int &stride, const uint64_t *) {
    const uint8_t *blk = row + 34 * u;
    const float d = ld_f16(blk);
    FATHOM_UNROLL
    for (int h = 0; h < 4; ++h) {
        uint32_t lo, hi;
        ld8_a2(blk + 2 + 8 * h, lo, hi);
        FATHOM_UNROLL
        for (int i = 0; i < 8; ++i)
            w[8 * h + i] = mul_rn(d, static_cast<float>(static_cast<int8_t>(byte_of(lo, hi, i))));
    }
    base = 32 * u;
    stride = 8;
}

template <>
__host__ __device__ __forceinline__ void decode32<dtype::f32>(const uint8_t *row, int64_t u, float w[32],
                                                              int64_t &base, int &stride, const uint64_t *) {
    const float *p = reinterpret_cast<const float *>(row) + 32 * u;
    FATHOM_UNROLL
    for (int i = 0; i < 32; ++i) w[i] = p[i];
    base = 32 * u;
    stride = 8;
}

template <>
__host__ __device__ __forceinline__ void decode32<dtype::f16>(const uint8_t *row, int64_t u, float w[32],
                                                              int64_t &base, int &stride, const uint64_t *) {
    FATHOM_UNROLL
    for (int i = 0; i < 32; ++i) w[i] = ld_f16(row + 2 * (32 * u + i));
    base = 32 * u;
    stride = 8;
}

// ---- K-quants (Q3_K, Q4_K, Q5_K, Q6_K: the q4 / Q4_K_M-style DS4 files) ------------------------------
// All four split a 256-weight block into two halves of 128 whose bytes serve 4 runs of 32 elements
// (2-bit fields or nibbles of the same 32 bytes), as Q2_K does, so they share Q2_K's unit: unit
// (half c, slice s) of block b = elements 256 b + 128 c + 32 j + 8 s + i (run j < 4, i < 8): base
// 256 b + 128 c + 8 s, stride 32; u = 8 b + 4 c + s. Within the block, element k = 128 c + 32 j + l
// with l = 8 s + i (< 32):
//   q3_k 110 B: u8 hmask[32], u8 qs[64], u8 scales[12] (16 6-bit signed scales), f16 d.
//        q = ((qs[32 c + l] >> 2 j) & 3) - (hmask[l] bit 4 c + j ? 0 : 4); scale 8 c + 2 j + (l >> 4);
//        x = (d * sc) * q.
//   q4_k 144 B: f16 d, f16 dmin, u8 scales[12] (8 6-bit (sc, m) pairs), u8 qs[128].
//        64-element group g = 2 c + (j >> 1), nibble j & 1 of qs[32 g + l]; pair 2 g + (j & 1) = 4 c + j;
//        x = (d * sc) * q - dmin * m.
//   q5_k 176 B: as q4_k with u8 qh[32] before qs: 5th bit = bit 4 c + j of qh[l].
//   q6_k 210 B: u8 ql[128], u8 qh[64], i8 scales[16], f16 d. Low 4 bits: nibble j >> 1 of
//        ql[64 c + 32 (j & 1) + l]; high 2: bits 2 j of qh[32 c + l]; q = that - 32; scale 8 c + 2 j +
//        (l >> 4); x = (d * sc) * q.
// The CPU (quants_generic.cpp dequant_q*_k) evaluates each product left to right in f32 without
// contraction: the explicitly rounded operations below give the same bits. A unit is loaded once into
// registers (unit_dot<T>::load: the 8 code bytes of each run source, the half's scales unpacked to
// 4 integers, d / dmin), then either decoded to f32 (decode: decode32, the f32 path) or dotted with
// q8 activations (dot_q8x, the integer path): run j's 8 codes as two words of unsigned bytes u
// (code(j, k)), the value being u - off (off = 4 for q3_k, 32 for q6_k, 0 for q4_k / q5_k). Quant
// bytes are read with the 8-byte loads of the block's alignment (q3_k and q6_k blocks are 2-byte
// aligned: ld8_a2, which may read 2 bytes either side).
template <> struct unit_traits<dtype::q3_k>    { static constexpr int block = 256, bytes = 110, align = 2; };
template <> struct unit_traits<dtype::q4_k>    { static constexpr int block = 256, bytes = 144, align = 4; };
template <> struct unit_traits<dtype::q5_k>    { static constexpr int block = 256, bytes = 176, align = 4; };
template <> struct unit_traits<dtype::q6_k>    { static constexpr int block = 256, bytes = 210, align = 2; };

// The K-quant unit structs (unit_dot<T>) and decode32<T> follow the fused unit dots below.

// ---- fused unit dot products (the MoE GEMV inner loop) ------------------------------------------
// unit_dot<T> holds one unit's raw bytes in registers (load: every global read of the unit, issued
// before any arithmetic so a lane keeps several units in flight) and computes sum_k w_k x_k for the
// 32 weights of the unit (dot). The scale factors are pulled out of the sums (iq2_xxs: db * sum q x;
// q2_k: dl * sum q x - ml * sum x per run; q8_0: d * sum q x): the same real number as dotting the
// decode32 weights, rounded differently (f32 sums, within the GEMV tolerance). Small integers are
// turned into floats with the 2^23 trick (one integer op + one FADD, exact) instead of I2F, which
// issues at 1/8 of the FMA rate on sm_80/sm_90 and bounded the decode-then-dot kernels.
// X is a functor: X(e) returns x[e .. e+4) as a float4 (e % 4 == 0).

__host__ __device__ __forceinline__ float bits_f32(uint32_t b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}
__host__ __device__ __forceinline__ uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
#endif
}
// Byte i (0..3) of w as a float, exact: 2^23 + b has b in its low mantissa bits.
__host__ __device__ __forceinline__ float byte_f32(uint32_t w, int i) {
    return bits_f32(0x4B000000u | ((w >> (8 * i)) & 0xFFu)) - 8388608.0f;
}
// The 8 floats x[e .. e+8) as an array.
template <class X>
__host__ __device__ __forceinline__ void x8(const X &x, int64_t e, float v[8]) {
    const float4 a = x(e), b = x(e + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

template <dtype T> struct unit_dot;

// iq2_xxs: f16 d + 8 bytes (4 grid indices, 4 x 7-bit sign codes + 4-bit scale).
template <> struct unit_dot<dtype::iq2_xxs> {
    float d;
    uint32_t a0, a1;
    int base;  // first element of the unit (rows are at most 2^31 elements)
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int64_t u) {
        const uint8_t *blk = row + 66 * (u >> 3);
        d = ld_f16(blk);
        ld8_a2(blk + 2 + 8 * (u & 7), a0, a1);
        base = static_cast<int>(32 * u);
    }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *grid) const {
        float acc = 0.0f;
        FATHOM_UNROLL
        for (int l = 0; l < 4; ++l) {
            const uint64_t gv = grid[(a0 >> (8 * l)) & 0xFFu];
            const uint32_t glo = static_cast<uint32_t>(gv), ghi = static_cast<uint32_t>(gv >> 32);
            const uint32_t code = (a1 >> (7 * l)) & 127u;
            const uint32_t signs = code | (static_cast<uint32_t>(popc8(code) & 1) << 7);
            float v[8];
            x8(x, base + 8 * l, v);
            FATHOM_UNROLL
            for (int j = 0; j < 8; ++j) {
                const float xs = bits_f32(f32_bits(v[j]) ^ ((signs << (31 - j)) & 0x80000000u));
                acc = fmaf(byte_f32(j < 4 ? glo : ghi, j & 3), xs, acc);
            }
        }
        const float db = mul_rn(mul_rn(d, 0.5f + static_cast<float>(a1 >> 28)), 0.25f);
        return db * acc;
    }
};

// q2_k: unit (half c, slice s) of block b: 8 bytes qs (2-bit field j -> run j), the 8 scale bytes of
// half c (run j uses byte 2j + (s >> 1)), f16 d and dmin.
template <> struct unit_dot<dtype::q2_k> {
    float d, dmin;
    uint32_t q0, q1, s0, s1;
    int hi;    // s >> 1
    int base;  // element of run 0
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int64_t u) {
        const int64_t b = u >> 3;
        const int c = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
        const uint8_t *blk = row + 84 * b;
        d = ld_f16(blk + 80);
        dmin = ld_f16(blk + 82);
        ld8_a4(blk + 16 + 32 * c + 8 * s, q0, q1);
        ld8_a4(blk + 8 * c, s0, s1);
        hi = s >> 1;
        base = static_cast<int>(256 * b + 128 * c + 8 * s);
    }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *) const {
        float acc = 0.0f;
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            const uint32_t sc = byte_of(s0, s1, 2 * j + hi);
            const uint32_t m0 = (q0 >> (2 * j)) & 0x03030303u, m1 = (q1 >> (2 * j)) & 0x03030303u;
            float v[8];
            x8(x, base + 32 * j, v);
            float sq = 0.0f, sx = 0.0f;
            FATHOM_UNROLL
            for (int i = 0; i < 8; ++i) {
                sq = fmaf(byte_f32(i < 4 ? m0 : m1, i & 3), v[i], sq);
                sx += v[i];
            }
            const float dl = d * byte_f32(sc & 0xFu, 0), ml = dmin * byte_f32(sc >> 4, 0);
            acc = fmaf(dl, sq, fmaf(-ml, sx, acc));
        }
        return acc;
    }
};

// q8_0: f16 d + 32 int8, read as 9 aligned words from the 4-byte boundary at or below the block
// (blocks are 2-byte aligned; may read up to 2 bytes before and 2 past the block).
template <> struct unit_dot<dtype::q8_0> {
    float d;
    uint32_t q[8];
    int base;
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int64_t u) {
        const uint8_t *blk = row + 34 * u;
        d = ld_f16(blk);
#ifdef __CUDA_ARCH__
        const uintptr_t a = reinterpret_cast<uintptr_t>(blk);
        const uint32_t *w = reinterpret_cast<const uint32_t *>(a & ~static_cast<uintptr_t>(3));
        const bool odd = (a & 2u) != 0;  // qs starts 4 bytes into the word run, else 2
        uint32_t W[9];
        FATHOM_UNROLL
        for (int i = 0; i < 9; ++i) W[i] = w[i];
        FATHOM_UNROLL
        for (int i = 0; i < 8; ++i) q[i] = odd ? W[i + 1] : __funnelshift_r(W[i], W[i + 1], 16);
#else
        memcpy(q, blk + 2, 32);
#endif
        base = static_cast<int>(32 * u);
    }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *) const {
        float acc = 0.0f;
        FATHOM_UNROLL
        for (int h = 0; h < 4; ++h) {
            // int8 -> offset binary (q + 128 in 0..255), then 2^23 + 128 + q - (2^23 + 128) = q exactly
            const uint32_t lo = q[2 * h] ^ 0x80808080u, hi = q[2 * h + 1] ^ 0x80808080u;
            float v[8];
            x8(x, base + 8 * h, v);
            FATHOM_UNROLL
            for (int i = 0; i < 8; ++i) {
                const uint32_t w = i < 4 ? lo : hi;
                const float qf = bits_f32(0x4B000000u | ((w >> (8 * (i & 3))) & 0xFFu)) - 8388736.0f;
                acc = fmaf(qf, v[i], acc);
            }
        }
        return d * acc;
    }
};

// Other expert types (mxfp4, the K-quants, f32, f16): decode32, then the dot (no integer conversions to save;
// the load happens inside dot).
template <dtype T> struct unit_dot_decoded {
    const uint8_t *row;
    int64_t u;
    __host__ __device__ __forceinline__ void load(const uint8_t *r, int64_t uu) {
        row = r;
        u = uu;
    }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *grid) const {
        float w[32];
        int64_t base;
        int stride;
        decode32<T>(row, u, w, base, stride, grid);
        float acc = 0.0f;
        FATHOM_UNROLL
        for (int r = 0; r < 4; ++r) {
            float v[8];
            x8(x, base + r * stride, v);
            FATHOM_UNROLL
            for (int i = 0; i < 8; ++i) acc = fmaf(w[8 * r + i], v[i], acc);
        }
        return acc;
    }
};
template <> struct unit_dot<dtype::mxfp4> : unit_dot_decoded<dtype::mxfp4> {};

// ---- K-quant units (layouts in the K-quant section above) ---------------------------------------
// Common to the four: the unit's block b = u >> 3, half c = (u >> 2) & 1, slice s = u & 3; element of
// run j, byte i = base + 32 j + i. code(j, k) = the unsigned codes of run j, elements 4 k .. 4 k + 3
// (byte i = element), scale(j) / minv(j) its integer scale / min; weight = (d * scale) * (u - off)
// [- dmin * min].
template <dtype T> struct kq_traits;
template <> struct kq_traits<dtype::q3_k> { static constexpr int off = 4, has_min = 0; };
template <> struct kq_traits<dtype::q4_k> { static constexpr int off = 0, has_min = 1; };
template <> struct kq_traits<dtype::q5_k> { static constexpr int off = 0, has_min = 1; };
template <> struct kq_traits<dtype::q6_k> { static constexpr int off = 32, has_min = 0; };

// The f32 weights and the FMA dot of a K-quant unit from its loaded fields (shared by the four).
template <dtype T, class U>
__host__ __device__ __forceinline__ void kq_decode(const U &w, float out[32]) {
    FATHOM_UNROLL
    for (int j = 0; j < 4; ++j) {
        const float dl = mul_rn(w.d, static_cast<float>(w.scale(j)));
        float ml = 0.0f;
        if constexpr (kq_traits<T>::has_min) ml = mul_rn(w.dmin, static_cast<float>(w.minv(j)));
        FATHOM_UNROLL
        for (int k = 0; k < 2; ++k) {
            const uint32_t c = w.code(j, k);
            FATHOM_UNROLL
            for (int i = 0; i < 4; ++i) {
                const float q = static_cast<float>(static_cast<int>((c >> (8 * i)) & 0xFFu) - kq_traits<T>::off);
                const float v = mul_rn(dl, q);
                if constexpr (kq_traits<T>::has_min) out[8 * j + 4 * k + i] = sub_rn(v, ml);
                else out[8 * j + 4 * k + i] = v;
            }
        }
    }
}
template <dtype T, class U, class X>
__host__ __device__ __forceinline__ float kq_dot_f32(const U &w, const X &x) {
    float wv[32];
    kq_decode<T>(w, wv);
    float acc = 0.0f;
    FATHOM_UNROLL
    for (int j = 0; j < 4; ++j) {
        float v[8];
        x8(x, w.base + 32 * j, v);
        FATHOM_UNROLL
        for (int i = 0; i < 8; ++i) acc = fmaf(wv[8 * j + i], v[i], acc);
    }
    return acc;
}
// Byte j (0..3) of w as a signed value.
__host__ __device__ __forceinline__ int sbyte(uint32_t w, int j) {
    return static_cast<int>(static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * j))));
}

// q3_k: qs[32 c + 8 s ..] (2-bit field j), hmask[8 s ..] shifted right by 4 c (bit j), the 4 signed
// scales 8 c + 2 j + (s >> 1) as bytes, d.
template <> struct unit_dot<dtype::q3_k> {
    uint32_t q[2], h[2], sc;
    float d;
    int base;
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int64_t u) {
        const int64_t b = u >> 3;
        const int c = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
        const uint8_t *blk = row + 110 * b;
        d = ld_f16(blk + 108);
        ld8_a2(blk + 32 + 32 * c + 8 * s, q[0], q[1]);
        ld8_a2(blk + 8 * s, h[0], h[1]);
        h[0] >>= 4 * c;
        h[1] >>= 4 * c;
        uint32_t a0, a1, b0, b1;  // scales[0 .. 8), scales[4 .. 12)
        ld8_a2(blk + 96, a0, a1);
        ld8_a2(blk + 100, b0, b1);
        sc = 0;
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {  // q3_k_scale(8 c + 2 j + (s >> 1)) from the bytes in registers
            const int i = 2 * j + (s >> 1);
            const uint32_t lo = (byte_of(a0, a1, i) >> (4 * c)) & 0xFu;
            const uint32_t hi = (byte_of(b0, b1, 4 + (i & 3)) >> (2 * (2 * c + (j >> 1)))) & 3u;
            sc |= (static_cast<uint32_t>(static_cast<int>(lo | (hi << 4)) - 32) & 0xFFu) << (8 * j);
        }
        base = static_cast<int>(256 * b + 128 * c + 8 * s);
    }
    __host__ __device__ __forceinline__ uint32_t code(int j, int k) const {
        return ((q[k] >> (2 * j)) & 0x03030303u) | (((h[k] >> j) & 0x01010101u) << 2);
    }
    __host__ __device__ __forceinline__ int scale(int j) const { return sbyte(sc, j); }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *) const {
        return kq_dot_f32<dtype::q3_k>(*this, x);
    }
};

// q4_k / q5_k: qs of groups 2 c and 2 c + 1 at slice s (q[2 g2], q[2 g2 + 1]), (Q5) qh[8 s ..] shifted
// right by 4 c, the 4 (scale, min) pairs 4 c + j unpacked to bytes, d, dmin.
template <bool Q5> struct unit_dot_q45_k {
    uint32_t q[4], h[2], sc, mn;
    float d, dmin;
    int base;
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int64_t u) {
        constexpr int bytes = Q5 ? 176 : 144, qs_off = Q5 ? 48 : 16;
        const int64_t b = u >> 3;
        const int c = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
        const uint8_t *blk = row + bytes * b;
        const uint32_t dm = *reinterpret_cast<const uint32_t *>(blk);
        d = half_bits(dm & 0xFFFFu);
        dmin = half_bits(dm >> 16);
        const uint32_t *sw = reinterpret_cast<const uint32_t *>(blk + 4);  // scales[12]
        const uint32_t s0 = sw[0], s1 = sw[1], s2 = sw[2];
        ld8_a4(blk + qs_off + 32 * (2 * c) + 8 * s, q[0], q[1]);
        ld8_a4(blk + qs_off + 32 * (2 * c + 1) + 8 * s, q[2], q[3]);
        h[0] = h[1] = 0;
        if constexpr (Q5) {
            ld8_a4(blk + 16 + 8 * s, h[0], h[1]);
            h[0] >>= 4 * c;
            h[1] >>= 4 * c;
        }
        // pair 4 c + j (scale_min_k4): c = 0: bytes j, j + 4 (low 6 bits); c = 1: low nibble / high
        // nibble of byte 8 + j with the top 2 bits of bytes j / j + 4 as bits 4-5
        sc = mn = 0;
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            const uint32_t bj = (s0 >> (8 * j)) & 0xFFu, bj4 = (s1 >> (8 * j)) & 0xFFu, bj8 = (s2 >> (8 * j)) & 0xFFu;
            const uint32_t scj = c ? ((bj8 & 0xFu) | ((bj >> 6) << 4)) : (bj & 63u);
            const uint32_t mj = c ? ((bj8 >> 4) | ((bj4 >> 6) << 4)) : (bj4 & 63u);
            sc |= scj << (8 * j);
            mn |= mj << (8 * j);
        }
        base = static_cast<int>(256 * b + 128 * c + 8 * s);
    }
    __host__ __device__ __forceinline__ uint32_t code(int j, int k) const {
        uint32_t v = (q[2 * (j >> 1) + k] >> (4 * (j & 1))) & 0x0F0F0F0Fu;
        if constexpr (Q5) v |= ((h[k] >> j) & 0x01010101u) << 4;
        return v;
    }
    __host__ __device__ __forceinline__ int scale(int j) const { return static_cast<int>((sc >> (8 * j)) & 0xFFu); }
    __host__ __device__ __forceinline__ int minv(int j) const { return static_cast<int>((mn >> (8 * j)) & 0xFFu); }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *) const {
        return kq_dot_f32<Q5 ? dtype::q5_k : dtype::q4_k>(*this, x);
    }
};
template <> struct unit_dot<dtype::q4_k> : unit_dot_q45_k<false> {};
template <> struct unit_dot<dtype::q5_k> : unit_dot_q45_k<true> {};

// q6_k: ql[64 c + 32 p + 8 s ..] (q[2 p], q[2 p + 1]; nibble j >> 1 for run j = p + 2 (j >> 1)),
// qh[32 c + 8 s ..] (bits 2 j), the 4 signed scales 8 c + 2 j + (s >> 1) as bytes, d.
template <> struct unit_dot<dtype::q6_k> {
    uint32_t q[4], h[2], sc;
    float d;
    int base;
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int64_t u) {
        const int64_t b = u >> 3;
        const int c = static_cast<int>((u >> 2) & 1), s = static_cast<int>(u & 3);
        const uint8_t *blk = row + 210 * b;
        d = ld_f16(blk + 208);
        ld8_a2(blk + 64 * c + 8 * s, q[0], q[1]);
        ld8_a2(blk + 64 * c + 32 + 8 * s, q[2], q[3]);
        ld8_a2(blk + 128 + 32 * c + 8 * s, h[0], h[1]);
        uint32_t a0, a1;  // scales[8 c .. 8 c + 8)
        ld8_a2(blk + 192 + 8 * c, a0, a1);
        sc = 0;
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) sc |= byte_of(a0, a1, 2 * j + (s >> 1)) << (8 * j);
        base = static_cast<int>(256 * b + 128 * c + 8 * s);
    }
    __host__ __device__ __forceinline__ uint32_t code(int j, int k) const {
        return ((q[2 * (j & 1) + k] >> (4 * (j >> 1))) & 0x0F0F0F0Fu) | (((h[k] >> (2 * j)) & 0x03030303u) << 4);
    }
    __host__ __device__ __forceinline__ int scale(int j) const { return sbyte(sc, j); }
    template <class X>
    __host__ __device__ __forceinline__ float dot(const X &x, const uint64_t *) const {
        return kq_dot_f32<dtype::q6_k>(*this, x);
    }
};

// decode32 of the K-quants: load the unit, decode it (base as above, stride 32).
template <dtype T>
__host__ __device__ __forceinline__ void decode32_kq(const uint8_t *row, int64_t u, float w[32], int64_t &base,
                                                     int &stride) {
    unit_dot<T> r;
    r.load(row, u);
    kq_decode<T>(r, w);
    base = r.base;
    stride = 32;
}
template <>
__host__ __device__ __forceinline__ void decode32<dtype::q3_k>(const uint8_t *row, int64_t u, float w[32],
                                                               int64_t &base, int &stride, const uint64_t *) {
    decode32_kq<dtype::q3_k>(row, u, w, base, stride);
}
template <>
__host__ __device__ __forceinline__ void decode32<dtype::q4_k>(const uint8_t *row, int64_t u, float w[32],
                                                               int64_t &base, int &stride, const uint64_t *) {
    decode32_kq<dtype::q4_k>(row, u, w, base, stride);
}
template <>
__host__ __device__ __forceinline__ void decode32<dtype::q5_k>(const uint8_t *row, int64_t u, float w[32],
                                                               int64_t &base, int &stride, const uint64_t *) {
    decode32_kq<dtype::q5_k>(row, u, w, base, stride);
}
template <>
__host__ __device__ __forceinline__ void decode32<dtype::q6_k>(const uint8_t *row, int64_t u, float w[32],
                                                               int64_t &base, int &stride, const uint64_t *) {
    decode32_kq<dtype::q6_k>(row, u, w, base, stride);
}
template <> struct unit_dot<dtype::f32> : unit_dot_decoded<dtype::f32> {};
template <> struct unit_dot<dtype::f16> : unit_dot_decoded<dtype::f16> {};

// ---- integer dot products against q8 activations (llama.cpp mmvq style) ---------------------------
// The activation vector is quantised per block of 32 like ggml's q8_1 (quantize_row_q8_1_ref): d =
// amax / 127, q = roundf(x * (1 / d)) (half away from zero; q = 0 when amax = 0), and stored as q8_blk, 40 bytes: the 32
// int8 then d and 4 bytes of padding. 40 = 10 words: in shared memory the 8-byte loads of lanes
// reading consecutive blocks (iq2_xxs / q8_0 units) or runs of 8 (q2_k units, see dot_q8) fall into
// distinct banks per half-warp, and every int2 load is 8-byte aligned.
// The weights' integer codes are dotted with the int8 activations by __dp4a (4 products + add per
// instruction); each sum is scaled once per run or unit in f32. The result is the dot of the
// dequantised weights with the dequantised activation d * q, up to f32 rounding of the scale
// products and sums (the integer parts are exact).
struct q8_blk {
    int32_t qs[8];  // 32 int8, element i in byte i % 4 of word i / 4
    float d;
    float pad;
};
static_assert(sizeof(q8_blk) == 40, "q8_blk is 10 words");

// Quantise one block of 32 floats as ggml's quantize_row_q8_1_ref: d = amax / 127, id = 1 / d (0 when
// d = 0), q = roundf(x * id). The host version is the reference the device staging reproduces bit
// for bit (explicitly rounded operations on the device: no contraction, IEEE division).
__host__ __device__ __forceinline__ float q8_scale(float amax) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(amax, 127.0f);
#else
    return amax / 127.0f;
#endif
}
__host__ __device__ __forceinline__ float q8_inv(float d) {
#ifdef __CUDA_ARCH__
    return d != 0.0f ? __frcp_rn(d) : 0.0f;
#else
    return d != 0.0f ? 1.0f / d : 0.0f;
#endif
}
__host__ __device__ __forceinline__ uint32_t q8_round(float x, float id) {
    return static_cast<uint8_t>(static_cast<int8_t>(roundf(mul_rn(x, id))));
}
inline void quantize_q8_block(const float *x, q8_blk &b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
    b.d = q8_scale(amax);
    b.pad = 0.0f;
    const float id = q8_inv(b.d);
    for (int w = 0; w < 8; ++w) {
        uint32_t q = 0;
        for (int i = 0; i < 4; ++i) q |= q8_round(x[4 * w + i], id) << (8 * i);
        b.qs[w] = static_cast<int32_t>(q);
    }
}

// __dp4a: c + the sum of the 4 products of the signed bytes of a and b.
__host__ __device__ __forceinline__ int dp4a(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; ++i)
        c += static_cast<int>(static_cast<int8_t>(a >> (8 * i))) * static_cast<int>(static_cast<int8_t>(b >> (8 * i)));
    return c;
#endif
}
// An int with |v| < 2^22 as a float, exactly: 1.5 * 2^23 + v has v in its mantissa (one integer add
// and one FADD instead of I2F, which issues at a quarter of the FMA rate).
__host__ __device__ __forceinline__ float i2f_exact(int v) {
    return bits_f32(0x4B400000u + static_cast<uint32_t>(v)) - 12582912.0f;
}
// Word w (0..7) of a q8 block (an 8-byte aligned pair: w even).
__host__ __device__ __forceinline__ void q8_pair(const q8_blk &b, int w, int &lo, int &hi) {
    const int2 v = *reinterpret_cast<const int2 *>(&b.qs[w]);
    lo = v.x;
    hi = v.y;
}
// The 8 sign bits of an IQ2_XXS run from its 7-bit code: bit 7 makes the parity even
// (= ksigns_iq2xs[code]).
__host__ __device__ __forceinline__ uint32_t iq2_signs(uint32_t code) {
    return code | (static_cast<uint32_t>(popc8(code) & 1) << 7);
}
// Bits 0..3 of n to bit 0 of bytes 0..3 (the four shifted copies of n in the product do not overlap,
// so there are no carries).
__host__ __device__ __forceinline__ uint32_t spread_nibble(uint32_t n) {
    return (n * 0x00204081u) & 0x01010101u;
}
// Four grid magnitudes g (bytes, 8..43) with the signs of bits 0..3 of `nib` applied, as int8x4:
// with b = 1 in the negated bytes, (g ^ 0xFF) + 1 = 256 - g is -g as int8, and each byte stays
// <= 248, so no carry crosses a byte. Computed, not looked up: a 128-entry shared-memory sign table
// costs ~3.3 bank-conflicted wavefronts per lookup (random indices), the shared-memory pipe was the
// gate/up kernel's limiter.
__host__ __device__ __forceinline__ int iq2_signed4(uint32_t g, uint32_t nib) {
    const uint32_t b = spread_nibble(nib);
    return static_cast<int>((g ^ (b * 0xFFu)) + b);
}

// Types with dot_q8 (the q8 path); the others keep the f32 activation path.
template <dtype T> constexpr bool is_kquant() {
    return T == dtype::q3_k || T == dtype::q4_k || T == dtype::q5_k || T == dtype::q6_k;
}
template <dtype T> constexpr bool has_q8_dot() {
    return T == dtype::iq2_xxs || T == dtype::q2_k || T == dtype::q8_0 || is_kquant<T>();
}

// The q8 activation words one weight unit of type T is dotted with, in registers (x_q8<T>::load):
// iq2_xxs / q8_0 unit u = q8 block u (8 words + d); q2_k unit (half c, slice s) of block b = run j
// (elements base + 32 j .. + 8, base = 256 b + 128 c + 8 s) in q8 block (base >> 5) + j at words
// 2 s, 2 s + 1. Loaded once per unit and reused by every weight row of a task (gate and up of
// several rows read the same x unit).
__host__ __device__ __forceinline__ int64_t q2_k_unit_base(int64_t u) {
    return 256 * (u >> 3) + 128 * ((u >> 2) & 1) + 8 * (u & 3);
}
template <dtype T> struct x_q8 {
    int q[8];
    float d;
    __host__ __device__ __forceinline__ void load(const q8_blk *xb, int64_t u) {
        const q8_blk &b = xb[u];
        FATHOM_UNROLL
        for (int w = 0; w < 8; w += 2) q8_pair(b, w, q[w], q[w + 1]);
        d = b.d;
    }
};
template <> struct x_q8<dtype::q2_k> {
    int q[8];    // run j: q[2 j], q[2 j + 1]
    float d[4];  // run j's block scale
    __host__ __device__ __forceinline__ void load(const q8_blk *xb, int64_t u) {
        const int64_t base = q2_k_unit_base(u);
        const q8_blk *xq = xb + (base >> 5);
        const int wo = static_cast<int>((base & 31) >> 2);  // 2 s
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            q8_pair(xq[j], wo, q[2 * j], q[2 * j + 1]);
            d[j] = xq[j].d;
        }
    }
};

// iq2_xxs unit u = q8 block u (32 consecutive elements): db * d8 * sum of the signed grid bytes times
// the int8 activations (exact integer, dp4a). Grid bytes are 8..43.
__host__ __device__ __forceinline__ float iq2_xxs_dot_x(const unit_dot<dtype::iq2_xxs> &w, const x_q8<dtype::iq2_xxs> &x,
                                                         const uint64_t *grid) {
    int s = 0;
    FATHOM_UNROLL
    for (int l = 0; l < 4; ++l) {
        const uint64_t gv = grid[(w.a0 >> (8 * l)) & 0xFFu];
        const uint32_t signs = iq2_signs((w.a1 >> (7 * l)) & 127u);
        s = dp4a(iq2_signed4(static_cast<uint32_t>(gv), signs & 0xFu), x.q[2 * l], s);
        s = dp4a(iq2_signed4(static_cast<uint32_t>(gv >> 32), signs >> 4), x.q[2 * l + 1], s);
    }
    const float db = mul_rn(mul_rn(w.d, 0.5f + static_cast<float>(w.a1 >> 28)), 0.25f);
    return db * x.d * i2f_exact(s);  // |s| <= 32 * 43 * 127 < 2^22
}

// q2_k unit: per run j, dl * sum q x - ml * sum x = d * sc * dp4a(q, x) - dmin * m * dp4a(1, x),
// scaled by the run's d8; d and dmin factor out of the unit (scale byte 2j + (s >> 1)).
__host__ __device__ __forceinline__ float q2_k_dot_x(const unit_dot<dtype::q2_k> &w, const x_q8<dtype::q2_k> &x) {
    float accd = 0.0f, accm = 0.0f;
    FATHOM_UNROLL
    for (int j = 0; j < 4; ++j) {
        const uint32_t sc = byte_of(w.s0, w.s1, 2 * j + w.hi);
        const int q0 = static_cast<int>((w.q0 >> (2 * j)) & 0x03030303u), q1 = static_cast<int>((w.q1 >> (2 * j)) & 0x03030303u);
        const int dot = dp4a(q0, x.q[2 * j], dp4a(q1, x.q[2 * j + 1], 0));             // |dot| <= 3 * 8 * 127
        const int sum = dp4a(0x01010101, x.q[2 * j], dp4a(0x01010101, x.q[2 * j + 1], 0));  // |sum| <= 8 * 127
        accd = fmaf(x.d[j], i2f_exact(dot * static_cast<int>(sc & 0xFu)), accd);
        accm = fmaf(x.d[j], i2f_exact(sum * static_cast<int>(sc >> 4)), accm);
    }
    return w.d * accd - w.dmin * accm;
}

// The K-quants share Q2_K's unit, so their activation words too.
template <> struct x_q8<dtype::q3_k> : x_q8<dtype::q2_k> {};
template <> struct x_q8<dtype::q4_k> : x_q8<dtype::q2_k> {};
template <> struct x_q8<dtype::q5_k> : x_q8<dtype::q2_k> {};
template <> struct x_q8<dtype::q6_k> : x_q8<dtype::q2_k> {};

// K-quant unit: per run j, with its unsigned codes u (value u - off) and its activation words (block
// scale d8): sum (u - off) x = dp4a(u, x) - off * dp4a(1, x), times the run's integer scale, scaled by
// d8 in f32; q4_k / q5_k also accumulate d8 * min * sum x. d and dmin factor out of the unit, as in
// q2_k_dot_x. Integer parts are exact; i2f_exact needs |v| < 2^22: q6_k |scale| <= 128 and
// |sum (u - 32) x| <= 8 * 32 * 127, product <= 4161536 < 4194304; q5_k 63 * 31 * 8 * 127; q3_k
// 32 * 4 * 8 * 127; mins 63 * 8 * 127.
template <dtype T>
__host__ __device__ __forceinline__ float kq_dot_x(const unit_dot<T> &w, const x_q8<T> &x) {
    constexpr int off = kq_traits<T>::off;
    constexpr bool has_min = kq_traits<T>::has_min != 0;
    float accd = 0.0f, accm = 0.0f;
    FATHOM_UNROLL
    for (int j = 0; j < 4; ++j) {
        const int dot = dp4a(static_cast<int>(w.code(j, 0)), x.q[2 * j], dp4a(static_cast<int>(w.code(j, 1)), x.q[2 * j + 1], 0));
        int sum = 0;
        if constexpr (off != 0 || has_min) sum = dp4a(0x01010101, x.q[2 * j], dp4a(0x01010101, x.q[2 * j + 1], 0));
        accd = fmaf(x.d[j], i2f_exact((dot - off * sum) * w.scale(j)), accd);
        if constexpr (has_min) accm = fmaf(x.d[j], i2f_exact(sum * w.minv(j)), accm);
    }
    if constexpr (has_min) return w.d * accd - w.dmin * accm;
    else return w.d * accd;
}

// q8_0 unit u = q8 block u: d * d8 * sum q x.
__host__ __device__ __forceinline__ float q8_0_dot_x(const unit_dot<dtype::q8_0> &w, const x_q8<dtype::q8_0> &x) {
    int s = 0;
    FATHOM_UNROLL
    for (int i = 0; i < 8; ++i) s = dp4a(static_cast<int>(w.q[i]), x.q[i], s);
    return w.d * x.d * i2f_exact(s);  // |s| <= 32 * 128 * 127 < 2^22
}

// The q8 dot of a loaded unit of type T with its activation words in registers.
template <dtype T>
__host__ __device__ __forceinline__ float dot_q8x(const unit_dot<T> &w, const x_q8<T> &x, const uint64_t *grid) {
    if constexpr (T == dtype::iq2_xxs) return iq2_xxs_dot_x(w, x, grid);
    else if constexpr (T == dtype::q2_k) return q2_k_dot_x(w, x);
    else if constexpr (is_kquant<T>()) return kq_dot_x<T>(w, x);
    else return q8_0_dot_x(w, x);
}
// The same with the activation words read from the q8 row xb (unit u of the row; a unit's x words
// depend only on u).
template <dtype T>
__host__ __device__ __forceinline__ float dot_q8(const unit_dot<T> &w, int64_t u, const q8_blk *xb,
                                                 const uint64_t *grid) {
    x_q8<T> x;
    x.load(xb, u);
    return dot_q8x<T>(w, x, grid);
}

// ---- 64-column steps (the down kernel's lane unit on the q8 path) --------------------------------
// Step U of a row covers 64 of its columns (the steps U < ceil(units / 2) cover each column once).
// A step's weights are loaded once (load) and dotted with the activation words of that step held in
// registers (xs_q8::load), so a warp doing several rows reads each step's activation words from
// shared memory once.
//   iq2_xxs / q8_0: units 2 U and 2 U + 1 (columns 64 U .. 64 U + 64, q8 blocks 2 U and 2 U + 1; the
//     second absent when the row has an odd number of 32-column units), as unit_dot / dot_q8x. The
//     K-quants take the same two units (slices 2 (U & 1) and 2 (U & 1) + 1 of half (U >> 1) & 1 of
//     block U >> 2: the columns of q2_k's step U below), each as unit_dot / dot_q8x.
//   q2_k: Q2_K block b = U >> 2, half c = (U >> 1) & 1, h = U & 1: the 16 bytes qs[32 c + 16 h ..]
//     (byte 4 m + i, 2-bit field j -> element 256 b + 128 c + 32 j + 16 h + 4 m + i), so run j (16
//     elements, one sub-block: scale byte 8 c + 2 j + h) lies in q8 block 8 b + 4 c + j, words
//     4 h .. 4 h + 3. Per run: 4 dp4a for sum q x, 4 for m * sum x (m replicated in the 4 bytes),
//     one f32 scale by the q8 block's d: 16 weights per scaling instead of 8 (q2_k unit_dot), and 7
//     loaded words per 64 weights. Bounds: |sc * sum q x| <= 15 * 3 * 16 * 127 < 2^22.
template <dtype T> struct step_q8 {
    unit_dot<T> w[2];
    bool two;
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int U, int units) {
        w[0].load(row, 2 * U);
        two = 2 * U + 1 < units;
        if (two) w[1].load(row, 2 * U + 1);
    }
};
template <> struct step_q8<dtype::q2_k> {
    uint32_t q[4];    // qs[32 c + 16 h .. + 16)
    uint32_t s0, s1;  // scales[8 c + h .. 8 c + 8) (shifted by h bytes): run j uses byte 2 j
    uint32_t dm;      // f16 d (low half), f16 dmin (high half)
    __host__ __device__ __forceinline__ void load(const uint8_t *row, int U, int) {
        const uint8_t *blk = row + 84 * (U >> 2);
        const int c = (U >> 1) & 1, h = U & 1;
        const uint32_t *qw = reinterpret_cast<const uint32_t *>(blk + 16 + 32 * c + 16 * h);
        FATHOM_UNROLL
        for (int m = 0; m < 4; ++m) q[m] = qw[m];
        ld8_a4(blk + 8 * c, s0, s1);
        if (h) {
            s0 = (s0 >> 8) | (s1 << 24);
            s1 >>= 8;
        }
        dm = *reinterpret_cast<const uint32_t *>(blk + 80);
    }
};
// The activation words of step U (what step_q8<T> is dotted with).
template <dtype T> struct xs_q8 {
    x_q8<T> x[2];
    __host__ __device__ __forceinline__ void load(const q8_blk *xb, int U, int units) {
        x[0].load(xb, 2 * U);
        if (2 * U + 1 < units) x[1].load(xb, 2 * U + 1);
    }
};
template <> struct xs_q8<dtype::q2_k> {
    int q[4][4];  // run j: words 4 h .. 4 h + 3 of q8 block 8 b + 4 c + j
    float d[4];
    __host__ __device__ __forceinline__ void load(const q8_blk *xb, int U, int) {
        const q8_blk *xq = xb + 8 * (U >> 2) + 4 * ((U >> 1) & 1);
        const int wo = 4 * (U & 1);
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            q8_pair(xq[j], wo, q[j][0], q[j][1]);
            q8_pair(xq[j], wo + 2, q[j][2], q[j][3]);
            d[j] = xq[j].d;
        }
    }
};
__host__ __device__ __forceinline__ float f16_bits_f32(uint32_t b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b & 0xFFFFu)));
}
template <dtype T>
__host__ __device__ __forceinline__ float dot_step_q8(const step_q8<T> &w, const xs_q8<T> &x, const uint64_t *grid) {
    if constexpr (T == dtype::q2_k) {
        float accd = 0.0f, accm = 0.0f;
        FATHOM_UNROLL
        for (int j = 0; j < 4; ++j) {
            const uint32_t sc = byte_of(w.s0, w.s1, 2 * j);
            int dot = 0, sum = 0;
            const int mrep = static_cast<int>((sc >> 4) * 0x01010101u);
            FATHOM_UNROLL
            for (int m = 0; m < 4; ++m) {
                dot = dp4a(static_cast<int>((w.q[m] >> (2 * j)) & 0x03030303u), x.q[j][m], dot);
                sum = dp4a(mrep, x.q[j][m], sum);
            }
            accd = fmaf(x.d[j], i2f_exact(dot * static_cast<int>(sc & 0xFu)), accd);
            accm = fmaf(x.d[j], i2f_exact(sum), accm);
        }
        return f16_bits_f32(w.dm) * accd - f16_bits_f32(w.dm >> 16) * accm;
    } else {
        float acc = dot_q8x<T>(w.w[0], x.x[0], grid);
        if (w.two) acc += dot_q8x<T>(w.w[1], x.x[1], grid);
        return acc;
    }
}

// Calls f.template operator()<T>() for the expert types above; false for any other type.
template <class F>
bool dispatch_expert_type(dtype t, F &&f) {
    switch (t) {
    case dtype::iq2_xxs: f.template operator()<dtype::iq2_xxs>(); return true;
    case dtype::q2_k: f.template operator()<dtype::q2_k>(); return true;
    case dtype::mxfp4: f.template operator()<dtype::mxfp4>(); return true;
    case dtype::q3_k: f.template operator()<dtype::q3_k>(); return true;
    case dtype::q4_k: f.template operator()<dtype::q4_k>(); return true;
    case dtype::q5_k: f.template operator()<dtype::q5_k>(); return true;
    case dtype::q6_k: f.template operator()<dtype::q6_k>(); return true;
    case dtype::q8_0: f.template operator()<dtype::q8_0>(); return true;
    case dtype::f32: f.template operator()<dtype::f32>(); return true;
    case dtype::f16: f.template operator()<dtype::f16>(); return true;
    default: return false;
    }
}

}  // namespace fathom::cuda::ds4q
