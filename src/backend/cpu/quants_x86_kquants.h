// x86 SIMD kernels, included by quants_avx2.cpp and quants_avx512.cpp: each includes this header in its
// own ISA-flagged translation unit, and everything here has internal linkage (anonymous namespace),
// so the AVX2 and AVX-512 instantiations never mix. Under -mavx512* the same code gets EVEX
// encodings, 32 vector registers and (where noted) VNNI instructions.
//
// AVX2 kernels for the k-quants used by real models (q2_k, q4_k, q5_k, q6_k) against q8_k.
//
// Each 256-element weight super-block is decoded once per row into 8 chunks of 32 unsigned bytes,
// 8 vectors of per-16-lane i16 sub-block scales and one i16 vector of "min" coefficients aligned with
// q8_k's 16 bsums. The super-block's contribution is then
//     d_a * (d * sum_j madd(maddubs(q_j, a_j), sc_j)  -  dmin * madd(mn, bsums))
// all in int32 until the final scale, as in ggml. q6_k's -32 offset becomes a min term with
// dmin = d and mn = 32 * sc. A tile is 4 weight rows x up to 4 activation rows: the decoded rows stay
// in L1 (stack) and are reused by every activation row; the 4 row sums are reduced with hadds.
#pragma once
#include <cstring>

#include "backend/cpu/quants_avx2_common.h"
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu::detail {
namespace {

using namespace avx2;

struct kdec {
    __m256i q[8];   // unsigned quants, chunk j = elements 32j .. 32j+31
    __m256i sc[8];  // i16 per maddubs lane: low 128 bits = sub-block 2j (or 32-block j), high = 2j+1
    __m256i mn;     // i16 x16 multiplying q8_k bsums[0..15]
    float d, dmin;
};

// Sub-block scales as i16 lanes for chunk j, from 16 scale bytes in one register (pshufb + widen):
// pair: [s[2j] x8 | s[2j+1] x8] (16-element sub-blocks); one: s[j] x16 (32-element sub-blocks).
inline __m256i sc_pair_s8(__m128i s, int j) {
    const __m128i idx = _mm_unpacklo_epi64(_mm_set1_epi8(static_cast<char>(2 * j)), _mm_set1_epi8(static_cast<char>(2 * j + 1)));
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s, idx));
}
inline __m256i sc_pair_u8(__m128i s, int j) {
    const __m128i idx = _mm_unpacklo_epi64(_mm_set1_epi8(static_cast<char>(2 * j)), _mm_set1_epi8(static_cast<char>(2 * j + 1)));
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(s, idx));
}
inline __m256i sc_one_u8(__m128i s, int j) { return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(s, _mm_set1_epi8(static_cast<char>(j)))); }
inline __m256i ld256(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// q4_k / q5_k 12-byte scales -> bytes [sc0..sc7, m0..m7] (ggml's utmp bit shuffle).
inline __m128i unpack_k4_scales(const uint8_t *s) {
    uint32_t u[4];
    std::memcpy(u, s, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t aux = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = aux;
    u[0] &= k1;
    return _mm_setr_epi32(static_cast<int>(u[0]), static_cast<int>(u[1]), static_cast<int>(u[2]), static_cast<int>(u[3]));
}

struct tr_q4_k {
    static constexpr int size = 144;
    static void decode(const uint8_t *b, kdec &o) {
        const __m128i sm = unpack_k4_scales(b + 4);
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (int c = 0; c < 4; ++c) {
            const __m256i v = ld256(b + 16 + 32 * c);
            o.q[2 * c] = _mm256_and_si256(v, mask);
            o.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        for (int j = 0; j < 8; ++j) o.sc[j] = sc_one_u8(sm, j);
        const __m128i m8 = _mm_unpackhi_epi64(sm, sm);
        o.mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  // m_j for bsums 2j and 2j+1
        o.d = ldf16(b);
        o.dmin = ldf16(b + 2);
    }
};

struct tr_q5_k {
    static constexpr int size = 176;
    static void decode(const uint8_t *b, kdec &o) {
        const __m128i sm = unpack_k4_scales(b + 4);
        const __m256i mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        const __m256i qh = ld256(b + 16);
        for (int c = 0; c < 4; ++c) {
            const __m256i v = ld256(b + 48 + 32 * c);
            const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4);
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4);
            o.q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, mask), h0);
            o.q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), h1);
        }
        for (int j = 0; j < 8; ++j) o.sc[j] = sc_one_u8(sm, j);
        const __m128i m8 = _mm_unpackhi_epi64(sm, sm);
        o.mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        o.d = ldf16(b);
        o.dmin = ldf16(b + 2);
    }
};

struct tr_q6_k {
    static constexpr int size = 210;
    static void decode(const uint8_t *b, kdec &o) {
        const uint8_t *ql = b, *qh = b + 128;
        const auto *sc = reinterpret_cast<const int8_t *>(b + 192);
        const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
        for (int c = 0; c < 2; ++c) {
            const __m256i l0 = ld256(ql + 64 * c), l1 = ld256(ql + 64 * c + 32), h = ld256(qh + 32 * c);
            const __m256i lo[4] = {_mm256_and_si256(l0, mask), _mm256_and_si256(l1, mask),
                                   _mm256_and_si256(_mm256_srli_epi16(l0, 4), mask),
                                   _mm256_and_si256(_mm256_srli_epi16(l1, 4), mask)};
            for (int g = 0; g < 4; ++g) {
                const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), three), 4);
                o.q[4 * c + g] = _mm256_or_si256(lo[g], hi);
            }
        }
        const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(sc));
        for (int j = 0; j < 8; ++j) o.sc[j] = sc_pair_s8(s16, j);
        o.mn = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s16), 5);  // 32 * sc: the -32 offset
        o.d = ldf16(b + 208);
        o.dmin = o.d;
    }
};

struct tr_q2_k {
    static constexpr int size = 84;
    static void decode(const uint8_t *b, kdec &o) {
        const uint8_t *s = b;
        const __m256i three = _mm256_set1_epi8(3);
        for (int c = 0; c < 2; ++c) {
            const __m256i v = ld256(b + 16 + 32 * c);
            for (int j = 0; j < 4; ++j) o.q[4 * c + j] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), three);
        }
        const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s));
        const __m128i lo4 = _mm_and_si128(s16, _mm_set1_epi8(0x0F));
        for (int j = 0; j < 8; ++j) o.sc[j] = sc_pair_u8(lo4, j);
        o.mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s16, 4), _mm_set1_epi8(0x0F)));
        o.d = ldf16(b + 80);
        o.dmin = ldf16(b + 82);
    }
};

// acc + madd(maddubs(q, a), sc): with VNNI one vpdpwssd does the madd and the add (the same exact
// i32 pair sums, wrapping like add_epi32), so the AVX-512 build gives the same integers and bits.
inline __m256i madd_acc(__m256i acc, __m256i q, __m256i a, __m256i sc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(q, a), sc);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), sc));
#endif
}

// q8_k block: f32 d at 0, s8 qs[256] at 4, i16 bsums[16] at 260; 292 bytes.
constexpr int q8k_size = 292;

// The float part of one k-quant tile step (ktile and the q2_k panel tiles): acc += d da sum(sc q a) - dmin da
// sum(m bsums) for the 4 rows' lanes (d8 / m8: the rows' d / dmin twice), da the q8_k block's scale at xb.
inline __m256 kquant_float_step(__m256 acc, const __m256i (&sq)[4], const __m256i (&sm)[4], __m256 d8, __m256 m8,
                                const uint8_t *xb) {
    float da;
    std::memcpy(&da, xb, 4);
    const __m256 vda = _mm256_set1_ps(da);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce4(sq[0], sq[1], sq[2], sq[3])), _mm256_mul_ps(d8, vda), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(reduce4(sm[0], sm[1], sm[2], sm[3])), _mm256_mul_ps(m8, vda), acc);
}

// ---- q2_k for 1-8 activation rows (decode, verification, a few batched sequences: gemm_q2_k_rows) -------
// ktile<tr_q2_k, 4, MB> took 2-4 rows before: each block decoded once for 4 weight rows into a stack copy,
// then re-read and applied in the 256-bit form (maddubs + madd per 32 elements) per activation row; at
// 4096 x 8192, one thread, M = 2 cost 1.8x the one-row pass. Here one weight row at a time (one sequential
// weight stream, as ktile_m1), each super-block decoded once into registers as u8 products q * sc for
// all MB activation rows (q2k_rows with q2k_row_ints512 / q2k_row_ints_pan); the rows take reduce4's 4
// slots in place of ktile's 4 weight rows. sq[m] / sm[m] hold row m's integer lanes (the exact integers of ktile_m1's for that row),
// so lane m (m + 4) of the reduced vector is the low (high) 4-lane sum that ktile_m1's lane 0 (4) holds,
// and da8 = (d_a of rows 0..3) x 2 gives lane m the product d * d_a (one multiply, either order: the same
// float). Each lane then sees ktile_m1's cvt, fma and fnma per block and the final fold_halves: row m's
// bits are those of a one-row call (QuantGemm.KQuantGemmEqualsDotBitwise).
inline __m256 q2k_rows_float_step(__m256 acc, const __m256i (&sq)[4], const __m256i (&sm)[4], float d, float dmin,
                                  __m256 da8) {
    const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(d), da8), dm = _mm256_mul_ps(_mm256_set1_ps(dmin), da8);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce4(sq[0], sq[1], sq[2], sq[3])), dd, acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(reduce4(sm[0], sm[1], sm[2], sm[3])), dm, acc);
}

thread_local scratch<float> t_q2k_da;  // per-thread q8_k scales of the 1-8 activation rows [nb][groups][8]

// Weight rows [r0, r1) of q2_k against MB (<= 8) activation rows x[0..7] (past MB: the last again), in groups
// of 4 (reduce4's 4 slots each): each super-block decoded once (decode(block, Dec &)) for all of them, then
// ints(dec, activation block, sq[j], sm[j]) forms row 4g + j's integer lanes and group g's float part is
// q2k_rows_float_step's. da8[8 (G b + g) + l] = d_a of block b of row 4g + l % 4 (0 past MB), G = the groups.
template <int MB, class Dec, class Decode, class Ints>
inline void q2k_rows(Decode decode, Ints ints, int64_t nb, const uint8_t *W, size_t w_stride, int64_t r0, int64_t r1,
                     const uint8_t *const x[8], const float *da8, float *y, int64_t ldy) {
    constexpr int G = (MB + 3) / 4;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *w = W + r * w_stride;
        __m256 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            Dec dec;
            decode(w + b * tr_q2_k::size, dec);
            for (int g = 0; g < G; ++g) {
                __m256i sq[4], sm[4];
                for (int j = 0; j < 4; ++j) sq[j] = sm[j] = _mm256_setzero_si256();
                for (int j = 0; j < 4 && 4 * g + j < MB; ++j) ints(dec, x[4 * g + j] + b * q8k_size, sq[j], sm[j]);
                acc[g] = q2k_rows_float_step(acc[g], sq, sm, dec.d, dec.dmin, _mm256_loadu_ps(da8 + 8 * (G * b + g)));
            }
        }
        for (int g = 0; g < G; ++g) {
            float out[4];
            _mm_storeu_ps(out, fold_halves(acc[g]));
            for (int j = 0; j < 4 && 4 * g + j < MB; ++j) y[(4 * g + j) * ldy + r] = out[j];
        }
    }
}

// M (<= 8) activation rows through q2k_rows, with the activation scales gathered once per call instead of once
// per weight row and block. M = 1 runs here too: at MB = 1 these kernels are as fast as ktile_m1 row by row
// (4096 x 8192: 1.05 against 1.06 ms, AVX2 form 1.13 against 1.15) with the same bits, and one path serves all
// of decode's row counts. 5-8 rows (a batched step's experts) go in two groups of 4 per decoded block on AVX-512
// (4096 x 2048, one thread, against the panels: M = 5 0.60 -> 0.53 ms, 6 0.67 -> 0.59, 8 0.83 -> 0.76); the AVX2
// form measured no faster there (M = 5 0.69 -> 0.79 ms), so AVX2 keeps the panels from 5 rows on.
template <class Dec, class Decode, class Ints>
void gemm_q2_k_rows(Decode decode, Ints ints, int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1,
                    const void *X, size_t x_stride, int64_t M, float *y, int64_t ldy) {
    if (M <= 0) return;
    const int64_t nb = K / qk_k;
    const int G = static_cast<int>((M + 3) / 4);  // q2k_rows' groups of 4 (M <= 8)
    const auto *Xb = static_cast<const uint8_t *>(X);
    const auto *Wb = static_cast<const uint8_t *>(W);
    const uint8_t *x[8];
    for (int m = 0; m < 8; ++m) x[m] = Xb + imin(m, M - 1) * x_stride;
    float *da8 = t_q2k_da.get(static_cast<size_t>(8 * G * nb));
    for (int64_t b = 0; b < nb; ++b)
        for (int g = 0; g < G; ++g)
            for (int l = 0; l < 8; ++l) {
                const int m = 4 * g + (l & 3);
                float da = 0;
                if (m < M) std::memcpy(&da, x[m] + b * q8k_size, 4);
                da8[8 * (G * b + g) + l] = da;
            }
    switch (M) {
        case 1: return q2k_rows<1, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        case 2: return q2k_rows<2, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        case 3: return q2k_rows<3, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        case 4: return q2k_rows<4, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        case 5: return q2k_rows<5, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        case 6: return q2k_rows<6, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        case 7: return q2k_rows<7, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
        default: return q2k_rows<8, Dec>(decode, ints, nb, Wb, w_stride, r0, r1, x, da8, y, ldy);
    }
}

// NR weight rows (<= 4) x MB activation rows over nb super-blocks; out[m][r].
// Weights are decoded here (panel == nullptr: decode, M <= 4) or read from a panel of nb x NR
// decoded super-blocks that gemm_k fills once per 4 rows and reuses for every activation tile.
template <class T, int NR, int MB>
inline void ktile(int64_t nb, const uint8_t *const w[NR], const kdec *panel, const uint8_t *const x[MB],
                  float out[MB][4]) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    kdec local[NR];
    for (int64_t b = 0; b < nb; ++b) {
        const kdec *dec = local;
        if (panel) dec = panel + b * NR;
        else
            for (int r = 0; r < NR; ++r) T::decode(w[r] + b * T::size, local[r]);
        float dv[4] = {0, 0, 0, 0}, mv[4] = {0, 0, 0, 0};
        for (int r = 0; r < NR; ++r) dv[r] = dec[r].d, mv[r] = dec[r].dmin;
        const __m256 d8 = _mm256_setr_ps(dv[0], dv[1], dv[2], dv[3], dv[0], dv[1], dv[2], dv[3]);
        const __m256 m8 = _mm256_setr_ps(mv[0], mv[1], mv[2], mv[3], mv[0], mv[1], mv[2], mv[3]);
        for (int m = 0; m < MB; ++m) {
            const uint8_t *xb = x[m] + b * q8k_size;
            __m256i sq[4], sm[4];
            for (int r = 0; r < 4; ++r) sq[r] = sm[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                const __m256i a = ld256(xb + 4 + 32 * j);
                for (int r = 0; r < NR; ++r) sq[r] = madd_acc(sq[r], dec[r].q[j], a, dec[r].sc[j]);
            }
            const __m256i bs = ld256(xb + 260);
            for (int r = 0; r < NR; ++r) sm[r] = _mm256_madd_epi16(dec[r].mn, bs);
            acc[m] = kquant_float_step(acc[m], sq, sm, d8, m8, xb);
        }
    }
    for (int m = 0; m < MB; ++m) _mm_storeu_ps(out[m], fold_halves(acc[m]));
}

// Decode (M == 1): each row's super-block is decoded and consumed at once, so the decoded vectors
// can live in registers instead of a stack copy shared by 4 activation rows.
template <class T, int NR>
inline void ktile_m1(int64_t nb, const uint8_t *const w[NR], const uint8_t *x, float out[4]) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *xb = x + b * q8k_size;
        const __m256i bs = ld256(xb + 260);
        __m256i sq[4], sm[4];
        float dv[4] = {0, 0, 0, 0}, mv[4] = {0, 0, 0, 0};
        for (int r = 0; r < 4; ++r) sq[r] = sm[r] = _mm256_setzero_si256();
        for (int r = 0; r < NR; ++r) {
            kdec t;
            T::decode(w[r] + b * T::size, t);
            for (int j = 0; j < 8; ++j) sq[r] = madd_acc(sq[r], t.q[j], ld256(xb + 4 + 32 * j), t.sc[j]);
            sm[r] = _mm256_madd_epi16(t.mn, bs);
            dv[r] = t.d;
            mv[r] = t.dmin;
        }
        float da;
        std::memcpy(&da, xb, 4);
        const __m256 vda = _mm256_set1_ps(da);
        const __m256 d8 = _mm256_setr_ps(dv[0], dv[1], dv[2], dv[3], dv[0], dv[1], dv[2], dv[3]);
        const __m256 m8 = _mm256_setr_ps(mv[0], mv[1], mv[2], mv[3], mv[0], mv[1], mv[2], mv[3]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce4(sq[0], sq[1], sq[2], sq[3])), _mm256_mul_ps(d8, vda), acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(reduce4(sm[0], sm[1], sm[2], sm[3])), _mm256_mul_ps(m8, vda), acc);
    }
    _mm_storeu_ps(out, fold_halves(acc));
}


thread_local scratch<kdec> t_kpanel;  // per-thread decoded panel [nb][4]

template <class T>
void gemm_k(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
            int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk_k;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    const bool use_panel = M > 4;
    kdec *pbuf = use_panel ? t_kpanel.get(static_cast<size_t>(4 * nb)) : nullptr;
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;
        const kdec *panel = nullptr;
        if (use_panel) {
            for (int64_t b = 0; b < nb; ++b)
                for (int i = 0; i < 4; ++i) T::decode(w[i] + b * T::size, pbuf[4 * b + i]);
            panel = pbuf;
        }
        for (int64_t m = 0; m < M; m += 4) {
            const int mb = static_cast<int>(imin(4, M - m));
            const uint8_t *x[4];
            for (int j = 0; j < 4; ++j) x[j] = Xb + (m + imin(j, mb - 1)) * x_stride;
            float out[4][4];
            switch (mb) {
                case 1:
                    if (panel) {
                        ktile<T, 4, 1>(nb, w, panel, x, out);
                    } else {  // decode: row by row, one sequential weight stream (see q8_0_row_vnni)
                        for (int i = 0; i < rows; ++i) {
                            float o1[4];
                            ktile_m1<T, 1>(nb, &w[i], x[0], o1);
                            out[0][i] = o1[0];
                        }
                    }
                    break;
                case 2: ktile<T, 4, 2>(nb, w, panel, x, out); break;
                case 3: ktile<T, 4, 3>(nb, w, panel, x, out); break;
                default: ktile<T, 4, 4>(nb, w, panel, x, out); break;
            }
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

// ---- q2_k panels for M > 4 (AVX2) ---------------------------------------------------------------------
// The q2_k gemm for M > 4 over decoded panels (Pan: the AVX2 or the AVX-512 form): each group of 4 weight rows
// decoded once into the thread's panel (decode(block, pan)), then every 4 activation rows through
// tile(mb, nb, panel, x, out) (out[m][i]: activation row m, weight row i).
template <class Pan, class Decode, class Tile>
void gemm_q2_k_panels(scratch<Pan> &pan, Decode decode, Tile tile, int64_t K, const void *W, size_t w_stride,
                      int64_t r0, int64_t r1, const void *X, size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk_k;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    Pan *pbuf = pan.get(static_cast<size_t>(4 * nb));
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        for (int64_t b = 0; b < nb; ++b)
            for (int i = 0; i < 4; ++i) decode(Wb + (r + imin(i, rows - 1)) * w_stride + b * tr_q2_k::size, pbuf[4 * b + i]);
        for (int64_t m = 0; m < M; m += 4) {
            const int mb = static_cast<int>(imin(4, M - m));
            const uint8_t *x[4];
            for (int j = 0; j < 4; ++j) x[j] = Xb + (m + imin(j, mb - 1)) * x_stride;
            float out[4][4];
            tile(mb, nb, pbuf, x, out);
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

// A q2_k weight is q (0..3) times its 16-element sub-block scale (0..15), at most 45: the panel holds the
// products as u8 (chunk j = elements 32j..32j+31, as kdec's q[j]), so maddubs(w, a) pairs are at most
// 2 * 45 * 127 = 11430 and two chunks' pairs add in i16 without overflow (22860); one madd by ones per
// two chunks then gives i32 lane L = the sum of sc * q * a over elements 4L..4L+3 of both chunks, the
// exact integers of ktile's madd(maddubs(q, a), sc) lanes. Mins, reduce4 and the float part are ktile's:
// the same bits, with 5 ops per row and chunk pair instead of 6.
struct q2pan {
    __m256i w[8];  // u8 q * sc of chunk j
    __m256i mn;    // i16 x16 multiplying q8_k bsums[0..15]
    float d, dmin;
};

// The products come from a per-block table, one pshufb per chunk: byte 4 sb + q of the 64-byte table
// (tab[sb / 8], 128-bit lane (sb / 4) % 2, byte 4 (sb % 4) + q) = q * sc[sb] (sub-block sb = 0..15, q = 0..3).
// Chunk j (sub-blocks 2j, 2j+1) looks its q up in the lane of sub-blocks 4 (j / 2) .. +3, copied to both
// halves, at index 8 (j % 2) + 4 h + q in half h.
inline void q2k_decode_pan(const uint8_t *b, q2pan &o) {
    const __m256i three = _mm256_set1_epi8(3);
    const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b));
    const __m256i lo4 = _mm256_broadcastsi128_si256(_mm_and_si128(s16, _mm_set1_epi8(0x0F)));
    __m256i tab[2];
    for (int h = 0; h < 2; ++h) {
        const int s0 = 8 * h;  // dword d -> scale s0 + d in each of its 4 bytes
        const __m256i s4 = _mm256_shuffle_epi8(
            lo4, _mm256_setr_epi32(0x01010101 * s0, 0x01010101 * (s0 + 1), 0x01010101 * (s0 + 2), 0x01010101 * (s0 + 3),
                                   0x01010101 * (s0 + 4), 0x01010101 * (s0 + 5), 0x01010101 * (s0 + 6),
                                   0x01010101 * (s0 + 7)));
        // q * sc = (q & 1) * sc + (q & 2) * sc: bytes with q = 1, 3 take sc, those with q = 2, 3 add 2 sc
        const __m256i q13 = _mm256_set1_epi32(static_cast<int>(0xFF00FF00u)),
                      q23 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
        tab[h] = _mm256_add_epi8(_mm256_and_si256(s4, q13), _mm256_and_si256(_mm256_add_epi8(s4, s4), q23));
    }
    const __m256i off[2] = {_mm256_setr_m128i(_mm_set1_epi8(0), _mm_set1_epi8(4)),
                            _mm256_setr_m128i(_mm_set1_epi8(8), _mm_set1_epi8(12))};
    for (int c = 0; c < 2; ++c) {
        const __m256i v = ld256(b + 16 + 32 * c);
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * c + i;  // chunk j: bit pair i of v
            // the immediate must be a literal even where the loop is not unrolled (-O0 / -O1)
            const __m256i t = (j / 2) % 2 ? _mm256_permute4x64_epi64(tab[j / 4], 0xEE)
                                          : _mm256_permute4x64_epi64(tab[j / 4], 0x44);
            const __m256i idx = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * i), three), off[j % 2]);
            o.w[j] = _mm256_shuffle_epi8(t, idx);
        }
    }
    o.mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s16, 4), _mm_set1_epi8(0x0F)));
    o.d = ldf16(b + 80);
    o.dmin = ldf16(b + 82);
}

template <int MB>
inline void q2k_tile_pan(int64_t nb, const q2pan *panel, const uint8_t *const x[MB], float out[MB][4]) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        const q2pan *dec = panel + b * 4;
        const __m256 d8 = _mm256_setr_ps(dec[0].d, dec[1].d, dec[2].d, dec[3].d, dec[0].d, dec[1].d, dec[2].d, dec[3].d);
        const __m256 m8 =
            _mm256_setr_ps(dec[0].dmin, dec[1].dmin, dec[2].dmin, dec[3].dmin, dec[0].dmin, dec[1].dmin, dec[2].dmin, dec[3].dmin);
        for (int m = 0; m < MB; ++m) {
            const uint8_t *xb = x[m] + b * q8k_size;
            __m256i sq[4], sm[4];
            for (int r = 0; r < 4; ++r) sq[r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                const __m256i a0 = ld256(xb + 4 + 32 * j), a1 = ld256(xb + 36 + 32 * j);
                for (int r = 0; r < 4; ++r) {
                    const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(dec[r].w[j], a0), _mm256_maddubs_epi16(dec[r].w[j + 1], a1));
                    sq[r] = _mm256_add_epi32(sq[r], _mm256_madd_epi16(t, ones));
                }
            }
            const __m256i bs = ld256(xb + 260);
            for (int r = 0; r < 4; ++r) sm[r] = _mm256_madd_epi16(dec[r].mn, bs);
            acc[m] = kquant_float_step(acc[m], sq, sm, d8, m8, xb);
        }
    }
    for (int m = 0; m < MB; ++m) _mm_storeu_ps(out[m], fold_halves(acc[m]));
}

// Row m's integer lanes for q2k_rows from a q2pan-decoded super-block: q2k_tile_pan's steps for one row.
inline void q2k_row_ints_pan(const q2pan &dec, const uint8_t *xb, __m256i &sq, __m256i &sm) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 8; j += 2) {
        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(dec.w[j], ld256(xb + 4 + 32 * j)),
                                           _mm256_maddubs_epi16(dec.w[j + 1], ld256(xb + 36 + 32 * j)));
        sq = _mm256_add_epi32(sq, _mm256_madd_epi16(t, ones));
    }
    sm = _mm256_madd_epi16(dec.mn, ld256(xb + 260));
}

thread_local scratch<q2pan> t_q2k_pan;  // per-thread decoded panel [nb][4]

void gemm_q2_k(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
              int64_t M, float *y, int64_t ldy) {
    if (M <= 4)
        return gemm_q2_k_rows<q2pan>(q2k_decode_pan, q2k_row_ints_pan, K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
    gemm_q2_k_panels(
        t_q2k_pan, q2k_decode_pan,
        [](int mb, int64_t nb, const q2pan *p, const uint8_t *const x[4], float out[4][4]) {
            switch (mb) {
                case 1: q2k_tile_pan<1>(nb, p, x, out); break;
                case 2: q2k_tile_pan<2>(nb, p, x, out); break;
                case 3: q2k_tile_pan<3>(nb, p, x, out); break;
                default: q2k_tile_pan<4>(nb, p, x, out); break;
            }
        },
        K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- q2_k panels with AVX-512 VNNI (M > 4) ------------------------------------------------------------
// A q2_k weight is q (0..3) times its 16-element scale (0..15), at most 45: the panel holds the products
// as u8, so one vpdpbusd (u8 weight x s8 activation) adds 64 of them into 16 i32 lanes, where the ktile
// above needs a maddubs and a vpdpwssd per 32. Lane i of 64-element chunk k holds elements 4i..4i+3
// (one scale each: 4-element lanes never straddle a 16-element sub-block); adding the two halves after
// the 4 chunks gives lane L = the sum over the 8 32-element groups of sc * (q . a) over elements
// 4L..4L+3, the integer ktile's sq lane L holds. The mins, reduce4 and the float part are ktile's, so
// the results are the same bits (QuantGemm.KQuantGemmEqualsDotBitwise: gemm == vec_dot for every M).
struct q2dec512 {
    __m512i w[4];  // chunk k = groups 2k (low 256 bits), 2k+1 (high): u8 q * sc
    __m256i mn;    // i16 x16 multiplying q8_k bsums[0..15]
    float d, dmin;
};

// The products come from a per-block table instead of two masked adds per chunk: byte 4 sb + q of tab =
// q * sc[sb] (sub-block sb = 0..15, q = 0..3; 128-bit lane L = sub-blocks 4L..4L+3), built once per
// block; chunk k's 128-bit lane l (sub-block 4k + l) then looks q up in tab's lane k at index 4l + q
// (one pshufb). The bit pairs come from one variable shift of the 32 quant bytes broadcast to both halves.
inline void q2k_decode512(const uint8_t *b, q2dec512 &o) {
    const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b));
    // dword d of the shuffle index = d x 4 bytes: lane L byte i -> scale 4L + i / 4
    const __m512i s4 = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_and_si128(s16, _mm_set1_epi8(0x0F))),
                                           _mm512_setr_epi32(0x00000000, 0x01010101, 0x02020202, 0x03030303, 0x04040404,
                                                             0x05050505, 0x06060606, 0x07070707, 0x08080808, 0x09090909,
                                                             0x0A0A0A0A, 0x0B0B0B0B, 0x0C0C0C0C, 0x0D0D0D0D, 0x0E0E0E0E,
                                                             0x0F0F0F0F));
    // q * sc = (q & 1) * sc + (q & 2) * sc: bytes with q = 1, 3 take sc, those with q = 2, 3 add 2 sc
    const __m512i t1 = _mm512_maskz_mov_epi8(0xAAAAAAAAAAAAAAAAull, s4);
    const __m512i tab = _mm512_mask_add_epi8(t1, 0xCCCCCCCCCCCCCCCCull, t1, _mm512_add_epi8(s4, s4));
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i lane4 = _mm512_setr_epi32(0, 0, 0, 0, 0x04040404, 0x04040404, 0x04040404, 0x04040404, 0x08080808,
                                            0x08080808, 0x08080808, 0x08080808, 0x0C0C0C0C, 0x0C0C0C0C, 0x0C0C0C0C,
                                            0x0C0C0C0C);  // 4l in 128-bit lane l
    for (int k = 0; k < 4; ++k) {
        // groups 2k (low 256 bits), 2k+1 (high) = bit pairs j, j+1 of bytes 16 + 32 (k / 2) .. +31
        const int j = 2 * (k % 2);
        const __m512i v = _mm512_broadcast_i64x4(ld256(b + 16 + 32 * (k / 2)));
        const int64_t lo = 2 * j, hi = 2 * j + 2;  // bit pair j in the low half, j + 1 in the high
        const __m512i q = _mm512_srlv_epi64(v, _mm512_setr_epi64(lo, lo, lo, lo, hi, hi, hi, hi));
        const __m512i idx = _mm512_ternarylogic_epi32(q, three, lane4, 0xEA);  // (q & 3) | 4l
        // lane k of tab in all four lanes; the immediate must be a literal even where the loop is not unrolled
        const __m512i tk = k == 0   ? _mm512_shuffle_i32x4(tab, tab, 0x00)
                           : k == 1 ? _mm512_shuffle_i32x4(tab, tab, 0x55)
                           : k == 2 ? _mm512_shuffle_i32x4(tab, tab, 0xAA)
                                    : _mm512_shuffle_i32x4(tab, tab, 0xFF);
        o.w[k] = _mm512_shuffle_epi8(tk, idx);
    }
    o.mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s16, 4), _mm_set1_epi8(0x0F)));
    o.d = ldf16(b + 80);
    o.dmin = ldf16(b + 82);
}

template <int MB>
inline void q2k_tile512(int64_t nb, const q2dec512 *panel, const uint8_t *const x[MB], float out[MB][4]) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const q2dec512 *dec = panel + b * 4;
        const __m256 d8 = _mm256_setr_ps(dec[0].d, dec[1].d, dec[2].d, dec[3].d, dec[0].d, dec[1].d, dec[2].d, dec[3].d);
        const __m256 m8 =
            _mm256_setr_ps(dec[0].dmin, dec[1].dmin, dec[2].dmin, dec[3].dmin, dec[0].dmin, dec[1].dmin, dec[2].dmin, dec[3].dmin);
        for (int m = 0; m < MB; ++m) {
            const uint8_t *xb = x[m] + b * q8k_size;
            __m512i a[4];
            for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_si512(xb + 4 + 64 * k);
            __m256i sq[4], sm[4];
            const __m256i bs = ld256(xb + 260);
            for (int r = 0; r < 4; ++r) {
                __m512i S = _mm512_dpbusd_epi32(_mm512_setzero_si512(), dec[r].w[0], a[0]);
                for (int k = 1; k < 4; ++k) S = _mm512_dpbusd_epi32(S, dec[r].w[k], a[k]);
                sq[r] = _mm256_add_epi32(_mm512_castsi512_si256(S), _mm512_extracti64x4_epi64(S, 1));
                sm[r] = _mm256_madd_epi16(dec[r].mn, bs);
            }
            acc[m] = kquant_float_step(acc[m], sq, sm, d8, m8, xb);
        }
    }
    for (int m = 0; m < MB; ++m) _mm_storeu_ps(out[m], fold_halves(acc[m]));
}

// Row m's integer lanes for q2k_rows from a q2k_decode512 super-block: q2k_tile512's 4 vpdpbusd for one row.
inline void q2k_row_ints512(const q2dec512 &dec, const uint8_t *xb, __m256i &sq, __m256i &sm) {
    __m512i S = _mm512_dpbusd_epi32(_mm512_setzero_si512(), dec.w[0], _mm512_loadu_si512(xb + 4));
    for (int k = 1; k < 4; ++k) S = _mm512_dpbusd_epi32(S, dec.w[k], _mm512_loadu_si512(xb + 4 + 64 * k));
    sq = _mm256_add_epi32(_mm512_castsi512_si256(S), _mm512_extracti64x4_epi64(S, 1));
    sm = _mm256_madd_epi16(dec.mn, ld256(xb + 260));
}

thread_local scratch<q2dec512> t_q2k_panel512;  // per-thread decoded panel [nb][4]

void gemm_q2_k_512(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                  int64_t M, float *y, int64_t ldy) {
    if (M <= 8)  // 5-8 rows too: see gemm_q2_k_rows
        return gemm_q2_k_rows<q2dec512>(q2k_decode512, q2k_row_ints512, K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
    gemm_q2_k_panels(
        t_q2k_panel512, q2k_decode512,
        [](int mb, int64_t nb, const q2dec512 *p, const uint8_t *const x[4], float out[4][4]) {
            switch (mb) {
                case 1: q2k_tile512<1>(nb, p, x, out); break;
                case 2: q2k_tile512<2>(nb, p, x, out); break;
                case 3: q2k_tile512<3>(nb, p, x, out); break;
                default: q2k_tile512<4>(nb, p, x, out); break;
            }
        },
        K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
}
#endif

template <class T>
float dot_k(int64_t n, const void *w, const void *a) {
    const uint8_t *wp[1] = {static_cast<const uint8_t *>(w)};
    const uint8_t *xp[1] = {static_cast<const uint8_t *>(a)};
    float out[4];
    ktile_m1<T, 1>(n / qk_k, wp, xp[0], out);
    return out[0];
}

// ---- llama.cpp-exact q4_k / q6_k (ggml-cpu's AVX2 vec_dot float order) ---------------------------
// Per output: one 8-lane accumulator; lane L = the i32 sum over the super-block of scale * w * a for
// elements 4L..4L+3 of every 32-chunk (q6_k: unsigned 6-bit w, and lane k then loses the -32 offset
// of 32-element group k, 32 * sum sc * bsums, as current ggml-cpu does it); acc = fma(d_a * d,
// float(lanes), acc). q4_k's mins: 4 lanes m[2k]*S[2k] + m[2k+1]*S[2k+1] (S = 32-element activation
// sums) into acc_m = fma(-d_a * dmin, ., acc_m). Result hsum(acc) + hsum(acc_m).
// panel: null = decode the 4 rows here; else nb x 4 decoded super-blocks (gemm_k_exact fills it once
// per row group when M > 2 and reuses it for every activation pair; same arithmetic either way).
template <class T, int MB>
inline void ktile_exact(int64_t nb, const uint8_t *const w[4], const kdec *panel, const uint8_t *const x[MB],
                        float out[MB][4]) {
    constexpr bool q6 = T::size == 210;
    __m256 acc[MB][4];
    __m128 accm[MB][4];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) {
            acc[m][r] = _mm256_setzero_ps();
            accm[m][r] = _mm_setzero_ps();
        }
    for (int64_t b = 0; b < nb; ++b) {
        kdec local[4];
        const kdec *t = local;
        if (panel) t = panel + 4 * b;
        else
            for (int r = 0; r < 4; ++r) T::decode(w[r] + b * T::size, local[r]);
        for (int m = 0; m < MB; ++m) {
            const uint8_t *xb = x[m] + b * q8k_size;
            float da;
            std::memcpy(&da, xb, 4);
            __m256i a[8];
            for (int j = 0; j < 8; ++j) a[j] = ld256(xb + 4 + 32 * j);
            const __m256i bs = ld256(xb + 260);
            for (int r = 0; r < 4; ++r) {
                __m256i sumi = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j) sumi = madd_acc(sumi, t[r].q[j], a[j], t[r].sc[j]);
                // q6_k: the -32 offset leaves the lanes as one term per 32-element group,
                // lane k -= 32 * (sc[2k] * bsums[2k] + sc[2k+1] * bsums[2k+1]) (ggml's q8sclsub).
                if constexpr (q6) sumi = _mm256_sub_epi32(sumi, _mm256_madd_epi16(t[r].mn, bs));
                acc[m][r] = _mm256_fmadd_ps(_mm256_set1_ps(da * t[r].d), _mm256_cvtepi32_ps(sumi), acc[m][r]);
                if constexpr (!q6) {
                    const __m256i v = _mm256_madd_epi16(t[r].mn, bs);  // m_i * S_i
                    const __m128i prod = _mm_hadd_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                    accm[m][r] = _mm_fmadd_ps(_mm_set1_ps(-da * t[r].dmin), _mm_cvtepi32_ps(prod), accm[m][r]);
                }
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) out[m][r] = hsum(acc[m][r]) + (q6 ? 0.0f : hsum(accm[m][r]));
}

template <class T>
void gemm_k_exact(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                  int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk_k;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    kdec *pbuf = M > 2 ? t_kpanel.get(static_cast<size_t>(4 * nb)) : nullptr;
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;
        if (pbuf)
            for (int64_t b = 0; b < nb; ++b)
                for (int i = 0; i < 4; ++i) T::decode(w[i] + b * T::size, pbuf[4 * b + i]);
        for (int64_t m = 0; m < M; m += 2) {
            const int mb = static_cast<int>(imin(2, M - m));
            const uint8_t *x[2] = {Xb + m * x_stride, Xb + (m + mb - 1) * x_stride};
            float out[2][4];
            if (mb == 2) ktile_exact<T, 2>(nb, w, pbuf, x, out);
            else ktile_exact<T, 1>(nb, w, pbuf, x, out);
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

template <class T>
float dot_k_exact(int64_t n, const void *w, const void *a) {
    const auto *wp = static_cast<const uint8_t *>(w);
    const uint8_t *wr[4] = {wp, wp, wp, wp};
    const uint8_t *x[1] = {static_cast<const uint8_t *>(a)};
    float out[1][4];
    ktile_exact<T, 1>(n / qk_k, wr, nullptr, x, out);
    return out[0][0];
}

inline void fill_x86_kquants(kernel_table &t) {
    t.dot[slot(dtype::q2_k)] = dot_k<tr_q2_k>;
    t.dot[slot(dtype::q4_k)] = dot_k_exact<tr_q4_k>;
    t.dot[slot(dtype::q5_k)] = dot_k<tr_q5_k>;
    t.dot[slot(dtype::q6_k)] = dot_k_exact<tr_q6_k>;
    t.gemm[slot(dtype::q2_k)] = gemm_q2_k;
    t.gemm[slot(dtype::q4_k)] = gemm_k_exact<tr_q4_k>;
    t.gemm[slot(dtype::q5_k)] = gemm_k<tr_q5_k>;
    t.gemm[slot(dtype::q6_k)] = gemm_k_exact<tr_q6_k>;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    t.gemm[slot(dtype::q2_k)] = gemm_q2_k_512;
#endif
}

}  // namespace
}  // namespace fathom::cpu::detail
