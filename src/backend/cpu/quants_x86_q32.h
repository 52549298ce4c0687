// x86 SIMD kernels, included by quants_avx2.cpp and quants_avx512.cpp: each includes this header in its
// own ISA-flagged translation unit, and everything here has internal linkage (anonymous namespace),
// so the AVX2 and AVX-512 instantiations never mix. Under -mavx512* the same code gets EVEX
// encodings, 32 vector registers and (where noted) VNNI instructions.
//
// AVX2 kernels for the 32-element block types (q4_0, q4_1, q5_0, q5_1, q8_0, mxfp4) against q8_0 /
// q8_1 activations, and for f32 / f16 / bf16. k-quants: quants_x86_kquants.h.
//
// GEMM tile (the prefill and decode hot path): 4 weight rows x up to 4 activation rows. Per block,
// each weight row is unpacked once into 32 bytes and reused for every activation row; the 4 row
// products are reduced with two hadd levels into one vector [r0 r1 r2 r3 | r0 r1 r2 r3], so one
// accumulator per activation row holds all 4 outputs and one cvt + FMA scales 4 products at once.
// Unsigned quants (q4/q5 0..31, mxfp4 shifted to 0..24) use maddubs directly; the offset is folded
// into a per-block term coef_w * S_a, where S_a = d_a * sum(a) (q8_0, precomputed once per gemm
// call) or the stored s of q8_1 (ggml's numerics for q4_1/q5_1).
#pragma once
#include <cmath>
#include <cstring>

#include "backend/cpu/quants_avx2_common.h"
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu::detail {
namespace {

using namespace avx2;

// ---- Per-block scale vectors for 4 rows: d8 = [d0 d1 d2 d3 | d0 d1 d2 d3], c8 = [c0 c1 c2 c3 | 0] --
inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// f16 d at offset 0, coefficient c = k * d.
inline void scales_d(const uint8_t *const b[4], float k, __m256 &d8, __m256 &c8) {
    const __m128i h = _mm_setr_epi16(static_cast<short>(ld16(b[0])), static_cast<short>(ld16(b[1])),
                                     static_cast<short>(ld16(b[2])), static_cast<short>(ld16(b[3])), 0, 0, 0, 0);
    const __m128 d4 = _mm_cvtph_ps(h);
    d8 = _mm256_set_m128(d4, d4);
    c8 = _mm256_zextps128_ps256(_mm_mul_ps(d4, _mm_set1_ps(k)));
}

// f16 pair (d, m) at offset 0: coefficient c = m.
inline void scales_dm(const uint8_t *const b[4], __m256 &d8, __m256 &c8) {
    const __m128i h = _mm_setr_epi32(static_cast<int>(ld32(b[0])), static_cast<int>(ld32(b[1])),
                                     static_cast<int>(ld32(b[2])), static_cast<int>(ld32(b[3])));
    const __m256 f = _mm256_cvtph_ps(h);  // [d0 m0 d1 m1 d2 m2 d3 m3]
    d8 = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    c8 = _mm256_blend_ps(_mm256_permutevar8x32_ps(f, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)), _mm256_setzero_ps(), 0xF0);
}

// ---- Weight block traits --------------------------------------------------------------------------
// size: bytes per block; quants(): 32 unpacked values; scale/coef: d and the offset coefficient of one
// block, scales4: both for 4 blocks as vectors; has_coef: whether the activation-sum term applies;
// is_signed: quants are s8 (else u8 <= 31, so 8 maddubs products fit an i16: see tile4).
struct tr_q4_0 {
    static constexpr int ggml_off = 8;
    static constexpr int size = 18;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) { return nibbles32(b + 2); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *, float d) { return -8.0f * d; }
    static void scales4(const uint8_t *const b[4], __m256 &d8, __m256 &c8) { scales_d(b, -8.0f, d8, c8); }
};
struct tr_q4_1 {
    static constexpr int ggml_off = -1;
    static constexpr int size = 20;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = true;
    static __m256i quants(const uint8_t *b) { return nibbles32(b + 4); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *b, float) { return ldf16(b + 2); }
    static void scales4(const uint8_t *const b[4], __m256 &d8, __m256 &c8) { scales_dm(b, d8, c8); }
};
struct tr_q5_0 {
    static constexpr int ggml_off = 16;
    static constexpr int size = 22;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) { return _mm256_or_si256(nibbles32(b + 6), bits32_x16(b + 2)); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *, float d) { return -16.0f * d; }
    static void scales4(const uint8_t *const b[4], __m256 &d8, __m256 &c8) { scales_d(b, -16.0f, d8, c8); }
};
struct tr_q5_1 {
    static constexpr int ggml_off = -1;
    static constexpr int size = 24;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = true;
    static __m256i quants(const uint8_t *b) { return _mm256_or_si256(nibbles32(b + 8), bits32_x16(b + 4)); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *b, float) { return ldf16(b + 2); }
    static void scales4(const uint8_t *const b[4], __m256 &d8, __m256 &c8) { scales_dm(b, d8, c8); }
};
struct tr_q8_0 {
    static constexpr int ggml_off = 0;
    static constexpr int size = 34;
    static constexpr bool has_coef = false, is_signed = true, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2)); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *, float) { return 0.0f; }
    static void scales4(const uint8_t *const b[4], __m256 &d8, __m256 &c8) { scales_d(b, 0.0f, d8, c8); }
};
struct tr_mxfp4 {  // e2m1 codes -> (2 * value + 12) in 0..24 via pshufb, offset -12 folded into coef
    static constexpr int size = 17;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) {
        const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                             12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
        return _mm256_shuffle_epi8(lut, nibbles32(b + 1));
    }
    static float scale(const uint8_t *b) { return e8m0_to_fp32_half(b[0]); }
    static float coef(const uint8_t *, float d) { return -12.0f * d; }
    static void scales4(const uint8_t *const b[4], __m256 &d8, __m256 &c8) {
        const __m128 d4 = _mm_setr_ps(scale(b[0]), scale(b[1]), scale(b[2]), scale(b[3]));
        d8 = _mm256_set_m128(d4, d4);
        c8 = _mm256_zextps128_ps256(_mm_mul_ps(d4, _mm_set1_ps(-12.0f)));
    }
};

template <class T>
inline __m256i dot32(__m256i q, __m256i a) {  // one row: 8 x i32 partial sums
    if constexpr (T::is_signed) return dot_s8s8(q, a);
    else return dot_u8s8(q, a);
}

// Activation block geometry: q8_0 {f16 d; s8 qs[32]}, q8_1 {f16 d; f16 s; s8 qs[32]}.
template <class T> constexpr int act_size = T::act_q8_1 ? 36 : 34;
template <class T> constexpr int act_qs = T::act_q8_1 ? 4 : 2;

// Per activation block: da = d, sa = d * sum(q) (q8_0) or the stored s (q8_1). Layout [m][nb].
template <class T>
void prepare_act(const uint8_t *X, size_t x_stride, int64_t M, int64_t nb, float *da, float *sa) {
    for (int64_t m = 0; m < M; ++m) {
        const uint8_t *x = X + m * x_stride;
        for (int64_t b = 0; b < nb; ++b, x += act_size<T>) {
            const float d = ldf16(x);
            da[m * nb + b] = d;
            if constexpr (T::act_q8_1) {
                sa[m * nb + b] = ldf16(x + 2);
            } else if constexpr (T::has_coef) {
                const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + act_qs<T>));
                const __m256i s = dot_u8s8(_mm256_set1_epi8(1), a);
                const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                const int sum = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
                sa[m * nb + b] = d * static_cast<float>(sum);
            } else {
                sa[m * nb + b] = 0.0f;
            }
        }
    }
}

// Sum over 32 elements of 4 rows' products with one activation block, as [r0 r1 r2 r3 | r0 r1 r2 r3]
// i32 halves. Unsigned quants <= 31: maddubs lanes are <= 2*31*128 = 7936, so two i16 hadd levels
// (4 lanes, <= 31744) cannot overflow and one madd widens at the end. s8 quants need i32 first.
template <class T>
inline __m256i dot4(const __m256i q[4], __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    // VNNI: u8 x s8 products summed into i32 in one instruction, no i16 intermediate.
    const __m256i z = _mm256_setzero_si256();
    if constexpr (T::is_signed) {
        auto d = [&](__m256i qq) { return _mm256_dpbusd_epi32(z, _mm256_sign_epi8(qq, qq), _mm256_sign_epi8(a, qq)); };
        return reduce4(d(q[0]), d(q[1]), d(q[2]), d(q[3]));
    } else {
        return reduce4(_mm256_dpbusd_epi32(z, q[0], a), _mm256_dpbusd_epi32(z, q[1], a), _mm256_dpbusd_epi32(z, q[2], a),
                       _mm256_dpbusd_epi32(z, q[3], a));
    }
#endif
    if constexpr (T::is_signed) {
        return reduce4(dot_s8s8(q[0], a), dot_s8s8(q[1], a), dot_s8s8(q[2], a), dot_s8s8(q[3], a));
    } else {
        const __m256i p01 = _mm256_hadd_epi16(_mm256_maddubs_epi16(q[0], a), _mm256_maddubs_epi16(q[1], a));
        const __m256i p23 = _mm256_hadd_epi16(_mm256_maddubs_epi16(q[2], a), _mm256_maddubs_epi16(q[3], a));
        return _mm256_madd_epi16(_mm256_hadd_epi16(p01, p23), _mm256_set1_epi16(1));
    }
}

// One block of 4 weight rows, decoded: 4 x 32 quants and the two scale vectors (192 bytes).
struct wblock4 {
    __m256i q[4];
    __m256 d8, c8;
};

template <class T>
inline void decode4(const uint8_t *const w[4], int64_t b, wblock4 &o) {
    const uint8_t *blk[4] = {w[0] + b * T::size, w[1] + b * T::size, w[2] + b * T::size, w[3] + b * T::size};
    for (int r = 0; r < 4; ++r) o.q[r] = T::quants(blk[r]);
    T::scales4(blk, o.d8, o.c8);
}

// 4 weight rows x MB activation rows over nb blocks; out[m] = the 4 row results. Weights come either
// straight from the rows (panel == nullptr: decode, M <= 4) or from a pre-decoded panel (prefill:
// the panel is decoded once per 4 rows and reused by all M/4 activation tiles).
template <class T, int MB>
inline void tile4(int64_t nb, const uint8_t *const w[4], const wblock4 *panel, const uint8_t *const x[MB],
                  const float *da, const float *sa, int64_t nbs, __m128 out[MB]) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        wblock4 dec;
        if (panel) dec = panel[b];
        else decode4<T>(w, b, dec);
        for (int m = 0; m < MB; ++m) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[m] + b * act_size<T> + act_qs<T>));
            const __m256i s = dot4<T>(dec.q, a);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dec.d8, _mm256_set1_ps(da[m * nbs + b])), acc[m]);
            if constexpr (T::has_coef) acc[m] = _mm256_fmadd_ps(dec.c8, _mm256_set1_ps(sa[m * nbs + b]), acc[m]);
        }
    }
    for (int m = 0; m < MB; ++m) out[m] = fold_halves(acc[m]);
}

thread_local scratch<float> t_act;      // per-thread [2][M][nb] activation scales / sums
thread_local scratch<wblock4> t_panel;  // per-thread decoded 4-row panel [nb]

template <class T>
void gemm_q32(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
              int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk32;
    if (M <= 0 || r1 <= r0) return;
    float *da = t_act.get(static_cast<size_t>(2 * M * nb) + 1), *sa = da + M * nb;
    const auto *Xb = static_cast<const uint8_t *>(X);
    prepare_act<T>(Xb, x_stride, M, nb, da, sa);
    const bool use_panel = M > 4;
    wblock4 *pbuf = use_panel ? t_panel.get(static_cast<size_t>(nb)) : nullptr;
    const auto *Wb = static_cast<const uint8_t *>(W);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;  // pad with last row
        const wblock4 *panel = nullptr;
        if (use_panel) {
            for (int64_t b = 0; b < nb; ++b) decode4<T>(w, b, pbuf[b]);
            panel = pbuf;
        }
        for (int64_t m = 0; m < M; m += 4) {
            const int mb = static_cast<int>(imin(4, M - m));
            const uint8_t *x[4];
            for (int j = 0; j < 4; ++j) x[j] = Xb + (m + imin(j, mb - 1)) * x_stride;
            __m128 out[4];
            const float *dam = da + m * nb, *sam = sa + m * nb;
            switch (mb) {
                case 1: tile4<T, 1>(nb, w, panel, x, dam, sam, nb, out); break;
                case 2: tile4<T, 2>(nb, w, panel, x, dam, sam, nb, out); break;
                case 3: tile4<T, 3>(nb, w, panel, x, dam, sam, nb, out); break;
                default: tile4<T, 4>(nb, w, panel, x, dam, sam, nb, out); break;
            }
            for (int j = 0; j < mb; ++j) {
                alignas(16) float o[4];
                _mm_store_ps(o, out[j]);
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = o[i];
            }
        }
    }
}

// ---- llama.cpp-exact GEMM: ggml-cpu's AVX2 vec_dot float order, for 4 weight rows x MB columns ------
// Per output: one 8-lane accumulator, lane L = the i32 sum of products of elements 4L..4L+3 of a
// block (maddubs + madd), acc = fma(d_w*d_a, float(lanes), acc) block after block; q4_1/q5_1 add
// summs = fma(m_w, s_a, summs) (GCC contracts ggml's `summs += m*s`); result hsum(acc) + summs.
// q4_0/q5_0 take the offset inside the integers (signed q - 8 / q - 16), as ggml does. Every
// output thus carries llama.cpp's exact rounding; the model is chaotic enough that the last-bit
// differences of any other association grow to percent-level logit differences.
template <class T>
inline __m256i exact_quants(const uint8_t *b) {
    if constexpr (T::ggml_off > 0) return _mm256_sub_epi8(T::quants(b), _mm256_set1_epi8(static_cast<char>(T::ggml_off)));
    else return T::quants(b);
}

template <class T, int MB>
inline void exact_tile4(int64_t nb, const uint8_t *const w[4], const uint8_t *const x[MB], float out[MB][4]) {
    __m256 acc[MB][4];
    float summs[MB][4];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) {
            acc[m][r] = _mm256_setzero_ps();
            summs[m][r] = 0.0f;
        }
    for (int64_t b = 0; b < nb; ++b) {
        __m256i q[4];
        float dw[4], mw[4];
        for (int r = 0; r < 4; ++r) {
            const uint8_t *blk = w[r] + b * T::size;
            q[r] = exact_quants<T>(blk);
            dw[r] = T::scale(blk);
            mw[r] = T::act_q8_1 ? T::coef(blk, dw[r]) : 0.0f;
        }
        for (int m = 0; m < MB; ++m) {
            const uint8_t *xb = x[m] + b * act_size<T>;
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xb + act_qs<T>));
            const float dx = ldf16(xb);
            for (int r = 0; r < 4; ++r) {
                const __m256i s = T::ggml_off < 0 ? dot_u8s8(q[r], a) : dot_s8s8(q[r], a);
                acc[m][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[r] * dx), _mm256_cvtepi32_ps(s), acc[m][r]);
            }
            if constexpr (T::act_q8_1) {
                const float sx = ldf16(xb + 2);
                for (int r = 0; r < 4; ++r) summs[m][r] = std::fma(mw[r], sx, summs[m][r]);
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) out[m][r] = hsum(acc[m][r]) + summs[m][r];
}

template <class T>
void gemm_q32_exact(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                    size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk32;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;  // pad with last row
        for (int64_t m = 0; m < M; m += 2) {
            const int mb = static_cast<int>(imin(2, M - m));
            const uint8_t *x[2] = {Xb + m * x_stride, Xb + (m + mb - 1) * x_stride};
            float out[2][4];
            if (mb == 2) exact_tile4<T, 2>(nb, w, x, out);
            else exact_tile4<T, 1>(nb, w, x, out);
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// fp16(d) of 4 blocks (at p[0..3]) as 4 floats: one F16C conversion instead of four scalar ones.
inline __m128 f16x4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
    return _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(ld16(p0)), static_cast<short>(ld16(p1)),
                                       static_cast<short>(ld16(p2)), static_cast<short>(ld16(p3)), 0, 0, 0, 0));
}

// ---- q8_0 with VNNI, in the same float order as gemm_q32_exact (ggml's) ---------------------------------
// The i32 lanes (lane L = sum of the products of elements 4L..4L+3 of a block) are exact integers, so
// any way of computing them gives the same bits: the activations are offset to u8 (a ^ 0x80 = a + 128,
// once per block and token, shared by the tile's 4 rows) and one dpbusd per (row, column) pair, started
// from the row's -128 * (lane sums of q), gives sum q*a directly (the sign trick needs four
// instructions). The row corrections wc are computed once per 4-row group (by its first tile, below) and
// reused by every tile of the panel: with the correction on the activation side (one dpbusd per token and block in every tile)
// the tile issued 20 dpbusd + 16 FMA per block on the two pipes that run both (Zen 4: 2 per cycle);
// now 16 + 16 (~10 % faster at the prefill shapes).
// The scale products dw*dx are the same f32 products, the FMA chain per output runs block after block
// as before: every output equals dot_q32_exact's bit for bit, for any M and tile (test_quant).
// The scale products of a block, sc[4 * m + r] = fp16(d_w[r]) * fp16(d_x[m]) (one 512-bit multiply per
// block for the whole tile), are stored to a small ring and read by the FMAs as embedded broadcasts; a
// multiply and a broadcast per (row, column, block) on the FMA pipes cost ~15 % of the throughput. They
// are made `dist` blocks ahead, inside the tile: a separate pass over the row's blocks before the tile
// (its 64-byte stores not overlapped with the tile's FMAs) cost ~15 % of the gemm. The distance keeps
// the broadcasts off stores still in flight.
// dw[16 * b + j] = fp16(d_w) of block b of row j % 4; dx[4 * b + m] = fp16(d_x) of block b of token m;
// wc[(4 * b + r) * 8 + L] = -128 * (lane L sum of block b of row r).
// Where the weight side (wc, dw) comes from, per tile: kRead takes the arrays that an earlier tile of the
// same 4-row group wrote; kMakeStore forms them from the rows as it goes (the group's first tile) and
// stores them for the later tiles; kMake forms them and stores nothing (a group with one tile: M <= 4; storing
// anyway measured ~5 % slower there, 2.8-3.0 against 3.0-3.3 ms at 4096 x 8192).
// Formed in the tile, the group's first pass over its weight rows (a DRAM stream) overlaps the tile's
// arithmetic; as separate passes before it (q8_0_row_corrections and the dw loop) they were a serial
// memory-bound phase per group, ~35 % of an M = 4 call. The integers and floats are the same either way.
enum class q8_side { kRead, kMakeStore, kMake };
template <int MB, q8_side kSide>
inline void q8_0_tile_vnni(int64_t nb, const uint8_t *const w[4], const uint8_t *const x[MB], float *dw,
                           const float *dx, int32_t *wc, float out[MB][4]) {
    constexpr bool make = kSide != q8_side::kRead, store = kSide == q8_side::kMakeStore;
    constexpr int64_t dist = 4, ring_n = 2 * dist;
    __m256 acc[MB][4];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) acc[m][r] = _mm256_setzero_ps();
    const __m256i off = _mm256_set1_epi8(static_cast<char>(0x80)), zero = _mm256_setzero_si256();
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    alignas(64) float ring[ring_n][16];
    auto scales = [&](int64_t b) {  // sc of block b into its ring slot
        const __m512 d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(dx + 4 * b)));
        __m512 wd;
        if constexpr (make) {
            wd = _mm512_broadcast_f32x4(f16x4(w[0] + b * 34, w[1] + b * 34, w[2] + b * 34, w[3] + b * 34));
            if constexpr (store) _mm512_storeu_ps(dw + 16 * b, wd);
        } else {
            wd = _mm512_loadu_ps(dw + 16 * b);
        }
        _mm512_store_ps(ring[b % ring_n], _mm512_mul_ps(wd, d));
    };
    for (int64_t b = 0; b < dist && b < nb; ++b) scales(b);
    for (int64_t b = 0; b < nb; ++b, wc += 32) {
        if (b + dist < nb) scales(b + dist);
        const float *sc = ring[b % ring_n];
        __m256i q[4], c[4];
        for (int r = 0; r < 4; ++r) {
            q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w[r] + b * 34 + 2));
            if constexpr (make) {
                c[r] = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, off, q[r]));
                if constexpr (store) _mm256_store_si256(reinterpret_cast<__m256i *>(wc + 8 * r), c[r]);
            } else {
                c[r] = _mm256_load_si256(reinterpret_cast<const __m256i *>(wc + 8 * r));
            }
        }
        for (int m = 0; m < MB; ++m) {
            const __m256i au =
                _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[m] + b * 34 + 2)), off);
            for (int r = 0; r < 4; ++r)
                acc[m][r] = _mm256_fmadd_ps(_mm256_set1_ps(sc[4 * m + r]),
                                            _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(c[r], au, q[r])), acc[m][r]);
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) out[m][r] = hsum(acc[m][r]);
}

thread_local scratch<float> t_q8_0_dw, t_q8_0_dx;  // per-thread scale scratch of gemm_q8_0_vnni
thread_local scratch<int32_t> t_q8_0_wc;                     // its row corrections (+16: 64-byte alignment)

// M == 1 (decode): one weight row at a time, a single sequential stream. Interleaving 4 rows (the tile
// above with MB = 1) streamed at about half the rate from DRAM (one thread: ~10 vs ~18 GB/s; the same
// finding as IQ2_XXS's row-by-row M == 1 path). Same per-block arithmetic, so the same bits.
inline float q8_0_row_vnni(int64_t nb, const uint8_t *w, const uint8_t *x) {
    const __m256i off = _mm256_set1_epi8(static_cast<char>(0x80)), zero = _mm256_setzero_si256();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, w += 34, x += 34) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + 2));
        const __m256i corr = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, off, a));
        const __m256i qu =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + 2)), off);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ldf16(w) * ldf16(x)),
                              _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(corr, qu, a)), acc);
    }
    return hsum(acc);
}

// q8_0_row_vnni for MB activation rows at once (decode's few rows: verification, a few batched sequences):
// each weight block is loaded and offset once for all of them; row m's arithmetic is q8_0_row_vnni's on
// x[m] (the same per-block products, accumulation order and final sum), so its bits are those of a one-row
// call. The panel tile below pays two extra passes over every 4 weight rows (lane corrections, scales) per
// call, which decode's 2-3 rows do not amortise (4096 x 8192, one thread: M = 2 3.8 ms against 1.25 ms for
// M = 1).
template <int MB>
inline void q8_0_rows_vnni(int64_t nb, const uint8_t *w, const uint8_t *const *x, float *out) {
    const __m256i off = _mm256_set1_epi8(static_cast<char>(0x80)), zero = _mm256_setzero_si256();
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = w + b * 34;
        const __m256i qu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(wb + 2)), off);
        const float dw = ldf16(wb);
        for (int m = 0; m < MB; ++m) {
            const uint8_t *xb = x[m] + b * 34;
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xb + 2));
            const __m256i corr = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, off, a));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ldf16(xb)), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(corr, qu, a)),
                                     acc[m]);
        }
    }
    for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
}

// Two rows: the activation side is the same for every weight row, so it is formed once per call (xc[b * 16 +
// 8 m + L] = q8_0_row_vnni's `corr` of block b of row m, xd[2 b + m] = its fp16(d)); per (row, block) there
// remain two loads, one dpbusd, the conversion and the fma, the same integers and floats as above. One thread,
// 4096 x 8192: 1.92-1.96 -> 1.65-1.69 ms (M = 1: 1.21-1.25). The same for three rows measured slower (2.6 ->
// 3.7-4.7 ms, also written out by hand): three x rows plus their corrections (27 KB at K = 4096) and the
// weight stream no longer fit the 32 KB L1, so three rows keep the form above.
thread_local scratch<int32_t> t_q8_0_xc;  // the corrections of q8_0_rows2_vnni (+16: 64-byte alignment)
thread_local scratch<float> t_q8_0_xd;    // and the scales
inline void q8_0_rows2_vnni(int64_t nb, const uint8_t *w, const uint8_t *const *x, const int32_t *xc, const float *xd,
                            float *out) {
    const __m256i off = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = w + b * 34;
        const __m256i qu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(wb + 2)), off);
        const float dw = ldf16(wb);
        const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[0] + b * 34 + 2));
        const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[1] + b * 34 + 2));
        const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i *>(xc + b * 16));
        const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i *>(xc + b * 16 + 8));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[2 * b]), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(c0, qu, a0)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[2 * b + 1]), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(c1, qu, a1)), acc1);
    }
    out[0] = hsum(acc0);
    out[1] = hsum(acc1);
}

// q8_0_tile_vnni<mb, S> for a runtime tile height mb (1..4).
template <q8_side S>
inline void q8_0_tile_dispatch(int mb, int64_t nb, const uint8_t *const w[4], const uint8_t *const x[4], float *dw,
                               const float *dx, int32_t *wc, float out[4][4]) {
    switch (mb) {
        case 1: q8_0_tile_vnni<1, S>(nb, w, x, dw, dx, wc, out); break;
        case 2: q8_0_tile_vnni<2, S>(nb, w, x, dw, dx, wc, out); break;
        case 3: q8_0_tile_vnni<3, S>(nb, w, x, dw, dx, wc, out); break;
        default: q8_0_tile_vnni<4, S>(nb, w, x, dw, dx, wc, out); break;
    }
}

// 4 weight rows x 4 activation rows per tile; activation rows in panels of 64 (their blocks stay in L2
// while a thread's weight rows stream past). The scales are converted with F16C 4 at a time, once per
// panel (dx) and once per 4-row group (dw), and dx is kept compact: the earlier scalar conversions (16
// per block per tile group) and 4x-expanded dx cost 15-25 % of the gemm at the prefill shapes.
void gemm_q8_0_vnni(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                    size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk32;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    if (M == 1) {
        for (int64_t r = r0; r < r1; ++r) y[r] = q8_0_row_vnni(nb, Wb + r * w_stride, Xb);
        return;
    }
    if (M <= 3) {  // decode's few rows: one pass over the weights (q8_0_rows_vnni). From M = 4 on the panel's tile
                   // (one thread, 4096 x 8192, M = 4: 2.9-3.1 ms, against 4.3-4.6 ms when the tile's weight side
                   // came from separate passes; M = 3 through the tile measured the same as here, 2.9 ms)
        const uint8_t *xr[3];
        for (int64_t m = 0; m < 3; ++m) xr[m] = Xb + imin(m, M - 1) * x_stride;
        int32_t *xc = nullptr;
        float *xd = nullptr;
        if (M == 2) {  // q8_0_rows2_vnni's activation side, once per call
            xc = t_q8_0_xc.get(static_cast<size_t>(nb * 16 + 16));
            xc = reinterpret_cast<int32_t *>((reinterpret_cast<uintptr_t>(xc) + 63) & ~uintptr_t{63});
            xd = t_q8_0_xd.get(static_cast<size_t>(2 * nb));
            const __m256i off = _mm256_set1_epi8(static_cast<char>(0x80)), zero = _mm256_setzero_si256();
            for (int64_t b = 0; b < nb; ++b)
                for (int m = 0; m < 2; ++m) {
                    const uint8_t *xb = xr[m] + b * 34;
                    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xb + 2));
                    _mm256_store_si256(reinterpret_cast<__m256i *>(xc + b * 16 + 8 * m),
                                       _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, off, a)));
                    xd[2 * b + m] = ldf16(xb);
                }
        }
        float out[3];
        for (int64_t r = r0; r < r1; ++r) {
            if (M == 2) q8_0_rows2_vnni(nb, Wb + r * w_stride, xr, xc, xd, out);
            else q8_0_rows_vnni<3>(nb, Wb + r * w_stride, xr, out);
            for (int64_t m = 0; m < M; ++m) y[m * ldy + r] = out[m];
        }
        return;
    }
    constexpr int64_t panel = 64;
    // dx[(q * nb + b) * 4 + m] = fp16(d) of block b of token 4q + m of the panel (padded with the last
    // token): 4 floats per tile and block, 32 KiB per panel at K = 4096 (a 16-float expanded copy was
    // 128 KiB and pushed the activation rows out of L2: ~15 % slower); dw[b * 16 + j] = fp16(d) of
    // block b of row j % 4 (the tile multiplies them into the FMAs' scale operands); wc: the 4 rows'
    // lane corrections (64-byte aligned, 32 x i32 per block). Both written by a group's first tile.
    float *dx = t_q8_0_dx.get(static_cast<size_t>(panel * nb));
    float *dw = t_q8_0_dw.get(static_cast<size_t>(nb * 16));
    int32_t *wc = t_q8_0_wc.get(static_cast<size_t>(nb * 32 + 16));
    wc = reinterpret_cast<int32_t *>((reinterpret_cast<uintptr_t>(wc) + 63) & ~uintptr_t{63});
    for (int64_t m0 = 0; m0 < M; m0 += panel) {
        const int64_t m1 = imin(M, m0 + panel);
        for (int64_t m = m0; m < m1; m += 4) {
            const uint8_t *xr[4];
            for (int j = 0; j < 4; ++j) xr[j] = Xb + imin(m + j, m1 - 1) * x_stride;
            float *dxq = dx + (m - m0) / 4 * nb * 4;
            for (int64_t b = 0; b < nb; ++b)
                _mm_storeu_ps(dxq + b * 4, f16x4(xr[0] + b * 34, xr[1] + b * 34, xr[2] + b * 34, xr[3] + b * 34));
        }
        for (int64_t r = r0; r < r1; r += 4) {
            const int rows = static_cast<int>(imin(4, r1 - r));
            const uint8_t *w[4];
            for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;  // pad with last row
            // the group's first tile forms the weight side (and stores it when more tiles follow)
            const bool one_tile = m1 - m0 <= 4;
            for (int64_t m = m0; m < m1; m += 4) {
                const int mb = static_cast<int>(imin(4, m1 - m));
                const uint8_t *x[4];
                for (int j = 0; j < 4; ++j) x[j] = Xb + (m + imin(j, mb - 1)) * x_stride;
                const float *dxq = dx + (m - m0) / 4 * nb * 4;
                float out[4][4];
                if (m > m0) q8_0_tile_dispatch<q8_side::kRead>(mb, nb, w, x, dw, dxq, wc, out);
                else if (one_tile) q8_0_tile_dispatch<q8_side::kMake>(mb, nb, w, x, dw, dxq, wc, out);
                else q8_0_tile_dispatch<q8_side::kMakeStore>(mb, nb, w, x, dw, dxq, wc, out);
                for (int j = 0; j < mb; ++j)
                    for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
            }
        }
    }
}
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
// ---- q8_0 on AVX2, M > 3: gemm_q32_exact's arithmetic with the per-output overhead taken out -----------
// Every output is computed exactly as exact_tile4<tr_q8_0> does: per block the i32 lanes of
// madd(maddubs(|w|, sign(a, w)), 1) (the same instructions, so even saturation would agree), one
// fma(fp16(d_w) * fp16(d_x), float(lanes), acc) per block in block order, hsum at the end: same bits
// (test_quant, test_ds4). What changed is what surrounds those 5 ops per (row, token, block):
//  - the old tile converted the 6 f16 scales of a 4 x 2 tile with scalar F16C, multiplied the 8 scale
//    products as scalars and broadcast each on the FP pipes (~3 more FP-pipe ops per output and block,
//    and GCC spilled 7 of its 8 accumulators); here the scales are f32 arrays converted once per call
//    (dx, per token) and once per 4-row group (in the panel), one vector multiply per block gives all 8
//    products, stored to a small ring `dist` blocks ahead and read back by broadcast loads (load ports
//    only; the distance keeps them off stores in flight, as in q8_0_tile_vnni);
//  - |w| = sign(w, w) is made once per row and block for both tokens;
//  - the 4 rows are copied per call into an aligned panel (160 B per block, 20 KiB at K = 4096: stays
//    in L1 while every token pair of the activation panel passes over it; one pointer, no
//    cache-line-splitting loads, ~3 % in the lab);
//  - activations go in panels of up to 64 tokens (~256 KiB, so they stay in L2 while a thread's 4-row
//    groups pass over them; DS4 calls gemm with the whole prompt at once).
// What is left per (row, token, block) is the sign, maddubs, madd, cvt and fma that the order needs: on
// the Zen 3 box of docs/PERF.md that mix issues at ~2.3-2.9 ops per cycle (a dependency-free
// microbenchmark), ~40-52 GMAC/s per thread at 2.8 GHz; the tile runs at 34-40 GMAC/s, the old one at
// 27-31 (lab, K = 1024-8192, 256-1024 rows x 64-256 tokens). A mirrored sign trick (|a| made once per
// call, one sign less) and a 2-row x 4-token tile were no faster there.
constexpr int64_t kQ8PanelBlock = 160;  // bytes per block of a 4-row panel (q8_0_panel)

// Where a tile reads its 4 weight rows: the aligned panel (q8_0_panel: prefill, where its copy pays
// over many tokens), or the rows where they lie (M <= 3: decode and verification rows, where a copy per
// call would cost as much as the tile). quants(r, b): row r's 32 quants of block b; dw8(b): the 4 rows'
// fp16(d) as f32, twice ([d0 d1 d2 d3 d0 d1 d2 d3]).
struct q8_0_panel_src {
    const uint8_t *pw;
    __m256i quants(int r, int64_t b) const {
        return _mm256_load_si256(reinterpret_cast<const __m256i *>(pw + b * kQ8PanelBlock + 32 * r));
    }
    __m256 dw8(int64_t b) const { return _mm256_load_ps(reinterpret_cast<const float *>(pw + b * kQ8PanelBlock + 128)); }
};
struct q8_0_rows_src {
    const uint8_t *const *w;  // 4 rows of q8_0 blocks (34 B: fp16 d, 32 quants)
    __m256i quants(int r, int64_t b) const {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w[r] + b * 34 + 2));
    }
    __m256 dw8(int64_t b) const {
        const int64_t o = b * 34;
        const __m128 d = _mm_cvtph_ps(_mm_setr_epi16(static_cast<short>(ld16(w[0] + o)), static_cast<short>(ld16(w[1] + o)),
                                                     static_cast<short>(ld16(w[2] + o)), static_cast<short>(ld16(w[3] + o)),
                                                     0, 0, 0, 0));
        return _mm256_set_m128(d, d);
    }
};

// src: the 4 weight rows; x: the two tokens' q8_0 rows; dx0 / dx1: their fp16(d) per block.
template <int MB, class Src>
inline void q8_0_tile_avx2(int64_t nb, const Src &src, const uint8_t *const x[2], const float *dx0, const float *dx1,
                           float out[2][4]) {
    constexpr int64_t dist = 4, ring_n = 2 * dist;
    alignas(32) float ring[ring_n][8];
    auto scales = [&](int64_t b) {  // [dw0 dw1 dw2 dw3] * dx0 | [dw0 dw1 dw2 dw3] * dx1 of block b
        const __m256 d = _mm256_set_m128(_mm_broadcast_ss(dx1 + b), _mm_broadcast_ss(dx0 + b));
        _mm256_store_ps(ring[b % ring_n], _mm256_mul_ps(src.dw8(b), d));
    };
    __m256 acc[MB][4];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) acc[m][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < dist && b < nb; ++b) scales(b);
    for (int64_t b = 0; b < nb; ++b) {
        if (b + dist < nb) scales(b + dist);
        const float *sc = ring[b % ring_n];
        __m256i a[MB];
        for (int m = 0; m < MB; ++m) a[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[m] + b * 34 + 2));
        for (int r = 0; r < 4; ++r) {
            const __m256i q = src.quants(r, b);
            const __m256i aq = _mm256_sign_epi8(q, q);
            for (int m = 0; m < MB; ++m) {
                const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(a[m], q)), ones);
                acc[m][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 4 * m + r), _mm256_cvtepi32_ps(s), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) out[m][r] = hsum(acc[m][r]);
}

// Per-thread scratch of gemm_q8_0_avx2: the 4-row panel (32-byte aligned: an over-aligned element type),
// dx, the f16 conversion buffer.
struct alignas(32) q8_0_chunk {
    uint8_t b[32];
};
thread_local scratch<q8_0_chunk> t_q8_0_pw;
thread_local scratch<float> t_q8_0_dx, t_q8_0_tmp;

// fp16(d) of the blocks of 8 rows (p[j] the first block of row j, blocks 34 B apart) -> out[8 * b + j].
inline void f16_scales8(int64_t nb, const uint8_t *const p[8], float *out) {
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t o = b * 34;
        const __m128i h = _mm_setr_epi16(
            static_cast<short>(ld16(p[0] + o)), static_cast<short>(ld16(p[1] + o)), static_cast<short>(ld16(p[2] + o)),
            static_cast<short>(ld16(p[3] + o)), static_cast<short>(ld16(p[4] + o)), static_cast<short>(ld16(p[5] + o)),
            static_cast<short>(ld16(p[6] + o)), static_cast<short>(ld16(p[7] + o)));
        _mm256_storeu_ps(out + 8 * b, _mm256_cvtph_ps(h));
    }
}

// The panel of 4 rows (w[0..3]): per block kQ8PanelBlock bytes, the 4 rows' quants (32 B each) then
// their fp16(d) as f32, twice ([d0 d1 d2 d3 d0 d1 d2 d3]).
inline void q8_0_panel(int64_t nb, const uint8_t *const w[4], uint8_t *pw) {
    const q8_0_rows_src src{w};
    for (int64_t b = 0; b < nb; ++b, pw += kQ8PanelBlock) {
        for (int r = 0; r < 4; ++r) _mm256_store_si256(reinterpret_cast<__m256i *>(pw + 32 * r), src.quants(r, b));
        _mm256_store_ps(reinterpret_cast<float *>(pw + 128), src.dw8(b));
    }
}

// One 4-row group (rows r .. r + rows - 1, packed in pw) x tokens [m0, m1) of the panel, in tiles of 2
// tokens (a lone last token: MB = 1).
inline void q8_0_group_avx2(int64_t nb, const uint8_t *pw, int rows, int64_t r, const uint8_t *Xb, size_t x_stride,
                            int64_t m0, int64_t m1, const float *dx, float *y, int64_t ldy) {
    for (int64_t m = m0; m < m1; m += 2) {
        const int mb = static_cast<int>(imin(2, m1 - m));
        const uint8_t *x[2] = {Xb + m * x_stride, Xb + (m + mb - 1) * x_stride};
        const float *d0 = dx + (m - m0) * nb, *d1 = dx + (m + mb - 1 - m0) * nb;
        float out[2][4];
        const q8_0_panel_src src{pw};
        if (mb == 2) q8_0_tile_avx2<2>(nb, src, x, d0, d1, out);
        else q8_0_tile_avx2<1>(nb, src, x, d0, d1, out);
        for (int j = 0; j < mb; ++j)
            for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
    }
}

// M <= 8 (decode, verification rows, a few batched sequences): the same tile reading the rows where
// they lie (q8_0_rows_src), no panel copy; the tokens' scales converted once per call. A 2-row step of
// the DS4 CPU model spent ~2x its 1-row step's time here with gemm_q32_exact's tile (its scalar scale
// conversions and products and the |w| per token made the q8_0 products compute-bound at 2 tokens,
// where one token is about at the memory's rate).
void gemm_q8_0_small_avx2(int64_t K, const uint8_t *Wb, size_t w_stride, int64_t r0, int64_t r1, const uint8_t *Xb,
                          size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk32;
    float *dx = t_q8_0_dx.get(static_cast<size_t>(M * nb));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) dx[m * nb + b] = ldf16(Xb + m * x_stride + b * 34);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;  // pad with last row
        const q8_0_rows_src src{w};
        for (int64_t m = 0; m < M; m += 2) {
            const int mb = static_cast<int>(imin(2, M - m));
            const uint8_t *x[2] = {Xb + m * x_stride, Xb + (m + mb - 1) * x_stride};
            float out[2][4];
            if (mb == 2) q8_0_tile_avx2<2>(nb, src, x, dx + m * nb, dx + (m + 1) * nb, out);
            else q8_0_tile_avx2<1>(nb, src, x, dx + m * nb, dx + m * nb, out);
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

// 4 weight rows x 2 tokens per tile (8 accumulators; |w|, the two a, temporaries, scale and ones fill
// the 16 ymm registers); M > 8 through 4-row panels, M <= 8 from the rows (gemm_q8_0_small_avx2: the
// per-call panels do not pay there: 0.9x at 16 rows x 3 tokens in the lab; 4096 x 8192, one thread, on the
// AVX-512 box running this AVX2 code: M = 4 5.29-5.36 -> 4.40 ms, 5 6.30-6.52 -> 5.33, 8 8.16-8.82 -> 7.44,
// the same bits).
void gemm_q8_0_avx2(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                    size_t x_stride, int64_t M, float *y, int64_t ldy) {
    if (M <= 0) return;
    if (M <= 8) {
        gemm_q8_0_small_avx2(K, static_cast<const uint8_t *>(W), w_stride, r0, r1, static_cast<const uint8_t *>(X), x_stride,
                             M, y, ldy);
        return;
    }
    const int64_t nb = K / qk32;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    // Tokens per panel: ~256 KiB of activation rows (half of Zen 3's 512 KiB L2), 8..64.
    const int64_t fit = static_cast<int64_t>((size_t{256} << 10) / x_stride) / 8 * 8;
    const int64_t panel = fit < 8 ? 8 : imin(64, fit);
    // dx[(m - m0) * nb + b] = fp16(d) of block b of token m of the panel, converted 8 tokens at a time
    // (tokens past the panel's end repeat its last one).
    float *dx = t_q8_0_dx.get(static_cast<size_t>(panel * nb));
    float *tmp = t_q8_0_tmp.get(static_cast<size_t>(nb * 8));
    auto *pw = reinterpret_cast<uint8_t *>(t_q8_0_pw.get(static_cast<size_t>(nb * kQ8PanelBlock / 32)));
    for (int64_t m0 = 0; m0 < M; m0 += panel) {
        const int64_t m1 = imin(M, m0 + panel);
        for (int64_t m = m0; m < m1; m += 8) {
            const uint8_t *xr[8];
            for (int j = 0; j < 8; ++j) xr[j] = Xb + imin(m + j, m1 - 1) * x_stride;
            f16_scales8(nb, xr, tmp);
            for (int j = 0; j < 8 && m + j < m1; ++j)
                for (int64_t b = 0; b < nb; ++b) dx[(m + j - m0) * nb + b] = tmp[8 * b + j];
        }
        for (int64_t r = r0; r < r1; r += 4) {
            const int rows = static_cast<int>(imin(4, r1 - r));
            const uint8_t *w[4];
            for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;  // pad with last row
            q8_0_panel(nb, w, pw);
            q8_0_group_avx2(nb, pw, rows, r, Xb, x_stride, m0, m1, dx, y, ldy);
        }
    }
}
#endif

template <class T>
float dot_q32_exact(int64_t n, const void *w, const void *a) {
    const uint8_t *wr[4] = {static_cast<const uint8_t *>(w), static_cast<const uint8_t *>(w),
                            static_cast<const uint8_t *>(w), static_cast<const uint8_t *>(w)};
    const uint8_t *x[1] = {static_cast<const uint8_t *>(a)};
    float out[1][4];
    exact_tile4<T, 1>(n / qk32, wr, x, out);
    return out[0][0];
}

// Single row x single column (vec_dot): ggml-style block loop.
template <class T>
float dot_q32(int64_t n, const void *w, const void *a) {
    const auto *wb = static_cast<const uint8_t *>(w);
    const auto *ab = static_cast<const uint8_t *>(a);
    __m256 acc = _mm256_setzero_ps();
    float coef_sum = 0;
    for (int64_t b = 0; b < n / qk32; ++b, wb += T::size, ab += act_size<T>) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ab + act_qs<T>));
        const float dw = T::scale(wb), dx = ldf16(ab);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<T>(T::quants(wb), av)), _mm256_set1_ps(dw * dx), acc);
        if constexpr (T::act_q8_1) {
            coef_sum += T::coef(wb, dw) * ldf16(ab + 2);
        } else if constexpr (T::has_coef) {
            const __m256i s = dot_u8s8(_mm256_set1_epi8(1), av);
            coef_sum += T::coef(wb, dw) * dx * hsum(_mm256_cvtepi32_ps(s));
        }
    }
    return hsum(acc) + coef_sum;
}

// ---- Float types: 4 weight rows x 2 activation rows of FMAs, scalar tail -----------------------------
struct ld_f32 {
    using elem = float;
    static __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
    static float one(const float *p) { return *p; }
};
struct ld_f16 {
    using elem = uint16_t;
    static __m256 load8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
    static float one(const uint16_t *p) { return _cvtsh_ss(*p); }
};
struct ld_bf16 {
    using elem = uint16_t;
    static __m256 load8(const uint16_t *p) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    static float one(const uint16_t *p) { return bf16_to_f32(*p); }
};

template <class L, int NR, int MB>
inline void float_tile(int64_t K, const typename L::elem *const w[NR], const typename L::elem *const x[MB],
                       float out[MB][NR]) {
    __m256 acc[MB][NR];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = L::load8(w[r] + k);
        for (int m = 0; m < MB; ++m) {
            const __m256 xv = L::load8(x[m] + k);
            for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < NR; ++r) {
            float s = hsum(acc[m][r]);
            for (int64_t t = k; t < K; ++t) s += L::one(w[r] + t) * L::one(x[m] + t);
            out[m][r] = s;
        }
}

template <class L>
void gemm_float(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                int64_t M, float *y, int64_t ldy) {
    using E = typename L::elem;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const E *w[4];
        for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const E *>(Wb + (r + imin(i, rows - 1)) * w_stride);
        for (int64_t m = 0; m < M; m += 2) {
            const int mb = static_cast<int>(imin(2, M - m));
            const E *x[2] = {reinterpret_cast<const E *>(Xb + m * x_stride),
                             reinterpret_cast<const E *>(Xb + (m + mb - 1) * x_stride)};
            float out[2][4];
            if (mb == 2) float_tile<L, 4, 2>(K, w, x, out);
            else float_tile<L, 4, 1>(K, w, x, out);
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

template <class L>
float dot_float(int64_t n, const void *w, const void *a) {
    const typename L::elem *wp[1] = {static_cast<const typename L::elem *>(w)};
    const typename L::elem *xp[1] = {static_cast<const typename L::elem *>(a)};
    float out[1][1];
    float_tile<L, 1, 1>(n, wp, xp, out);
    return out[0][0];
}

// ---- Activation quantisers, bit-exact with the scalar reference (quants_quantize.cpp) ------------------
// roundf (half away from zero) from round-to-even: they differ only on exact ties, where the
// fraction v - trunc(v) (exact in float) is +-0.5.
inline __m256 roundf8(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 e = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    const __m256 tie = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_EQ_OQ);
    return _mm256_blendv_ps(e, _mm256_add_ps(t, _mm256_or_ps(_mm256_set1_ps(1.0f), sign)), tie);
}

inline float absmax32(const float *x) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_and_ps(_mm256_loadu_ps(x), abs_mask);
    for (int j = 8; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

// 32 floats * id, rounded, packed to s8 in element order; returns the sum of the 32 integers.
inline int quant32(const float *x, float id, int8_t *qs, bool away_from_zero) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
        __m256 f = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), _mm256_set1_ps(id));
        f = away_from_zero ? roundf8(f) : _mm256_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[k] = _mm256_cvtps_epi32(f);
    }
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    // packs interleave 128-bit lanes; the permute restores element order.
    const __m256i p16a = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(qs),
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

// f32 -> f16 bits with F16C, round to nearest even: the same bits as the scalar f32_to_f16
// (normals, subnormals, overflow to inf, NaN with its top payload bits and the quiet bit), inline
// instead of a call per block scale.
inline uint16_t f16_bits(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }

void quant_q8_0_avx2(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_0 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        const float d = absmax32(x) / 127;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        y[i].d = f16_bits(d);
        quant32(x, id, y[i].qs, true);
    }
}

void quant_q8_1_avx2(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_1 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        const float d = absmax32(x) / 127;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        const int sum = quant32(x, id, y[i].qs, true);
        y[i].d = f16_bits(d);
        y[i].s = f16_bits(static_cast<float>(sum) * d);
    }
}

// ggml-cpu's own x86 conversion (see quant_q8_0_act in quants_quantize.cpp): id = 127/amax, half to even.
void quant_q8_0_act_avx2(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_0 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        const float amax = absmax32(x);
        y[i].d = f16_bits(amax / 127.f);
        quant32(x, amax != 0 ? 127.f / amax : 0.0f, y[i].qs, false);
    }
}

void quant_q8_1_act_avx2(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_1 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        const float amax = absmax32(x), d = amax / 127.f;
        const int sum = quant32(x, amax != 0 ? 127.f / amax : 0.0f, y[i].qs, false);
        y[i].d = f16_bits(d);
        y[i].s = f16_bits(static_cast<float>(sum) * d);
    }
}

// q8_k: iscale = -127/max (max = first element of largest |x|), q = min(127, round-to-even), bsums.
void quant_q8_k_avx2(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        float amax = 0;
        for (int j = 0; j < qk_k; j += 32) {
            const float a = absmax32(x + j);
            amax = a > amax ? a : amax;
        }
        if (amax == 0) {
            std::memset(&y[i], 0, sizeof(block_q8_k));
            continue;
        }
        int first = 0;
        while (std::fabs(x[first]) != amax) ++first;
        const float iscale = -127.f / x[first];
        // |iscale * x| <= 127 up to float rounding; the saturating packs in quant32 give the reference's
        // min(127, .) (and -128 cannot arise).
        for (int j = 0; j < qk_k; j += 32) quant32(x + j, iscale, y[i].qs + j, false);
        for (int g = 0; g < 16; ++g) {
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(y[i].qs + 16 * g));
            const __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(_mm_set1_epi8(1), q), _mm_set1_epi16(1));
            const __m128i h = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            y[i].bsums[g] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1))));
        }
        y[i].d = 1 / iscale;
    }
}

void quant_f16_avx2(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<uint16_t *>(dst);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) y[i] = f32_to_f16(x[i]);
}

inline void fill_x86_q32(kernel_table &t) {
    t.dot[slot(dtype::q4_0)] = dot_q32_exact<tr_q4_0>;
    t.dot[slot(dtype::q4_1)] = dot_q32_exact<tr_q4_1>;
    t.dot[slot(dtype::q5_0)] = dot_q32_exact<tr_q5_0>;
    t.dot[slot(dtype::q5_1)] = dot_q32_exact<tr_q5_1>;
    t.dot[slot(dtype::q8_0)] = dot_q32_exact<tr_q8_0>;
    t.dot[slot(dtype::mxfp4)] = dot_q32<tr_mxfp4>;
    t.gemm[slot(dtype::q4_0)] = gemm_q32_exact<tr_q4_0>;
    t.gemm[slot(dtype::q4_1)] = gemm_q32_exact<tr_q4_1>;
    t.gemm[slot(dtype::q5_0)] = gemm_q32_exact<tr_q5_0>;
    t.gemm[slot(dtype::q5_1)] = gemm_q32_exact<tr_q5_1>;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    t.gemm[slot(dtype::q8_0)] = gemm_q8_0_vnni;
#else
    t.gemm[slot(dtype::q8_0)] = gemm_q8_0_avx2;
#endif
    t.gemm[slot(dtype::mxfp4)] = gemm_q32<tr_mxfp4>;
    t.dot[slot(dtype::f32)] = dot_float<ld_f32>;
    t.dot[slot(dtype::f16)] = dot_float<ld_f16>;
    t.dot[slot(dtype::bf16)] = dot_float<ld_bf16>;
    t.gemm[slot(dtype::f32)] = gemm_float<ld_f32>;
    t.gemm[slot(dtype::f16)] = gemm_float<ld_f16>;
    t.gemm[slot(dtype::bf16)] = gemm_float<ld_bf16>;
    t.quant[slot(dtype::q8_0)] = quant_q8_0_avx2;
    t.quant[slot(dtype::q8_1)] = quant_q8_1_avx2;
    t.quant_act[slot(dtype::q8_0)] = quant_q8_0_act_avx2;
    t.quant_act[slot(dtype::q8_1)] = quant_q8_1_act_avx2;
    t.quant[slot(dtype::f16)] = quant_f16_avx2;
    t.quant[slot(dtype::q8_k)] = quant_q8_k_avx2;
}

}  // namespace
}  // namespace fathom::cpu::detail
