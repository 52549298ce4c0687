// x86 SIMD kernels for IQ2_XXS weights against Q8_K activations: the dot product and the GEMM tile.
// Included by quants_iq2_avx2.cpp (-mavx2) and quants_iq2_avx512.cpp (-mavx512*, same code with EVEX
// encodings and 32 vector registers); everything here has internal linkage, so the two
// instantiations never mix.
//
// Float order (one order for every M, so it serves both numerics modes):
//   per output, one 8-lane f32 accumulator acc; per 256-element super-block b, lane L gets the exact
//   i32  S_L = sum over the 8 32-element groups g of (2 * ls_g + 1) * sum_{k in 4L..4L+3} w_gk * a_gk
//   (w = grid magnitude with the group's signs applied to the activation, as in ggml), then
//   acc = fma(float(fp16(d_w) * d_a), float(S), acc); result 0.125f * hsum(acc).
// This is ggml-cpu's AVX2 ggml_vec_dot_iq2_xxs_q8_K order (x86/quants.c): its lanes hold the same
// integers (integer sums are exact in any order; |S_L| < 2^23), its per-block scale is the same f32
// product, and its hsum_float_8 adds the two 128-bit halves, then the 64-bit halves, then the last
// pair, as avx2::hsum does. llama.cpp has no repacked or tiled IQ2_XXS path on x86, so its mul_mat
// is this vec_dot for every element and batch size. The GEMM tile below computes each (row, token)
// with exactly this sequence too, so gemm() == vec_dot() bit for bit for any M (batch invariance).
//
// Tiles: M == 1 (decode) runs row by row, decoding each super-block as it is consumed (on AVX-512, with
// the grid looked up in registers: iq2_rows_512, which also takes M = 2..8 with one decode per block for
// all of them); larger M decodes
// a panel of 4 rows x all super-blocks once per row group (thread-local scratch, 320 B per
// block-row: signs on the weights, activations offset to u8 once per gemm call, see iq2dec) and
// sweeps it over the activations 2 at a time.
#pragma once
#include <bit>
#include <cstring>

#include "backend/cpu/iq_tables.h"
#include "backend/cpu/quants_avx2_common.h"
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu::detail {
namespace {

using namespace avx2;

constexpr int iq2_bytes = 66;       // block_iq2_xxs: f16 d, then 8 groups x (u32 grid indices, u32 signs|scale)
constexpr int iq2_q8k_bytes = 292;  // block_q8_k: f32 d at 0, s8 qs[256] at 4, i16 bsums[16] at 260

// 7-bit IQ2 sign code c -> 8 bytes for _mm256_sign_epi8: byte j is -1 if bit j of c | parity(c) << 7
// is set (ksigns_iq2xs[c], the format's even-parity rule), else +1. Built from the rule at compile
// time; the tests check the decoded values against gguf-py's dequantisation.
struct iq2_sign_lut {
    uint64_t v[128];
};
constexpr iq2_sign_lut make_iq2_sign_lut() {
    iq2_sign_lut t{};
    for (unsigned c = 0; c < 128; ++c) {
        const unsigned bits = c | ((std::popcount(c) & 1u) << 7);
        uint64_t v = 0;
        for (int j = 0; j < 8; ++j) v |= static_cast<uint64_t>((bits >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        t.v[c] = v;
    }
    return t;
}
alignas(64) constexpr iq2_sign_lut kIq2Signs = make_iq2_sign_lut();

inline long long iq2_grid64(uint32_t i) {
    long long v;
    std::memcpy(&v, iq2xxs_grid[i & 255], 8);
    return v;
}
inline long long iq2_sign64(uint32_t code) { return static_cast<long long>(kIq2Signs.v[code & 127]); }

inline __m256i iq2_ld(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// Group g (elements 32g..32g+31) of a block: 32 grid magnitudes (u8) and 32 sign bytes (+-1).
inline __m256i iq2_grid32(uint32_t idx) {
    return _mm256_set_epi64x(iq2_grid64(idx >> 24), iq2_grid64(idx >> 16), iq2_grid64(idx >> 8), iq2_grid64(idx));
}
inline __m256i iq2_signs32(uint32_t sg) {
    return _mm256_set_epi64x(iq2_sign64(sg >> 21), iq2_sign64(sg >> 14), iq2_sign64(sg >> 7), iq2_sign64(sg));
}

// One group's contribution to the 8 i32 lanes: (2 ls + 1) * sum over lane L's 4 elements of q * (+-a).
inline __m256i iq2_group_dot(__m256i q, __m256i s, __m256i a, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_sign_epi8(a, s)), scale16);
}

// A decoded block-row of the M > 1 panel. The signs go on the weights (w = +-grid, |w| <= 43, s8) and
// the tile reads the activations offset to u8 (a ^ 0x80 = a + 128; Fathom's q8_k never holds -128, so
// w * a is exactly grid * sign(a, s), the product the other paths form): maddubs(a + 128, w) pairs stay
// below 2 * 255 * 43 (no i16 saturation), and the offset's contribution per lane,
// corr_L = 128 * sum_g (2 ls_g + 1) * (sum of w over lane L's 4 elements of group g), is subtracted by
// starting the lane sums at -corr: the same exact i32 S_L, one sign op fewer per (row, token, group).
struct iq2dec {
    __m256i w[8];   // signed grid values of group g
    __m256i ncorr;  // -corr_L (i32 x 8)
    int16_t sc[8];  // 2 * ls_g + 1
    float d;        // fp16(d_w) as f32
};

inline void iq2_decode(const uint8_t *b, iq2dec &o) {
    uint32_t aux[16];
    std::memcpy(aux, b + 2, 64);
    __m256i corr = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
        o.w[g] = _mm256_sign_epi8(iq2_grid32(aux[2 * g]), iq2_signs32(aux[2 * g + 1]));
        o.sc[g] = static_cast<int16_t>(2 * (aux[2 * g + 1] >> 28) + 1);
        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(static_cast<char>(0x80)), o.w[g]),
                                                        _mm256_set1_epi16(o.sc[g])));
    }
    o.ncorr = _mm256_sub_epi32(_mm256_setzero_si256(), corr);
    o.d = ldf16(b);
}

// M == 1: one weight row against one activation row, each super-block decoded and consumed at once.
// One row at a time on purpose: interleaving 4 rows here (as the k-quant tiles do) ran out of
// registers and spilled; measured ~1.3x slower in cache and ~1.8x slower streaming from DRAM.
inline float iq2_row_m1(int64_t nb, const uint8_t *w, const uint8_t *x) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *xb = x + b * iq2_q8k_bytes, *wb = w + b * iq2_bytes;
        float da;
        std::memcpy(&da, xb, 4);
        uint32_t aux[16];  // per group g: aux[2g] = 4 grid indices, aux[2g+1] = 4 sign codes | scale << 28
        std::memcpy(aux, wb + 2, 64);
        __m256i s1 = _mm256_setzero_si256(), s2 = _mm256_setzero_si256();  // even / odd groups
        for (int g = 0; g < 8; g += 2) {
            const uint32_t sg1 = aux[2 * g + 1], sg2 = aux[2 * g + 3];
            s1 = _mm256_add_epi32(s1, iq2_group_dot(iq2_grid32(aux[2 * g]), iq2_signs32(sg1), iq2_ld(xb + 4 + 32 * g),
                                                    _mm256_set1_epi16(static_cast<short>(2 * (sg1 >> 28) + 1))));
            s2 = _mm256_add_epi32(s2, iq2_group_dot(iq2_grid32(aux[2 * g + 2]), iq2_signs32(sg2), iq2_ld(xb + 36 + 32 * g),
                                                    _mm256_set1_epi16(static_cast<short>(2 * (sg2 >> 28) + 1))));
        }
        const float d = ldf16(wb) * da;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_add_epi32(s1, s2)), acc);
    }
    return 0.125f * hsum(acc);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
// ---- M == 1 with AVX-512: grid rows looked up in registers, two groups per 512-bit vector ---------------
// Every IQ2_XXS grid byte is one of three magnitudes (0x08, 0x19, 0x2b), so a grid row packs into a
// 16-bit code of eight 2-bit digits; the 256 codes fill 8 zmm registers. A super-block's 32 grid
// indices are looked up at once (4 two-table word permutes, merged on index bits 6 and 7); each pair of
// groups then broadcasts its 8 codes to 8 qwords, shifts word w of a qword right by 2w (digit layout:
// element 2w at bits 2w, element 2w+1 at bits 2w+8, so after the shift they are the word's two low
// byte digits) and maps the digits to magnitudes with one byte shuffle. This replaces 32 scalar table
// loads and vector inserts per super-block, which bounded the row-by-row kernel (~46 cycles per block).
// The 8 sign codes of two groups become one 64-bit mask (each code's 7 bits spread to a byte by pdep,
// bit 7 = the code's parity: ksigns_iq2xs[c]) that negates the activation bytes with a masked subtract
// (0 - a wraps -128 to -128, as _mm256_sign_epi8 does). Lanes 0..7 hold group g's lane sums, lanes 8..15
// group g+1's; the halves are added after the 8 groups, so lane L is the same exact integer S_L as in
// iq2_row_m1 and the float part is the same: the same bits (test_quants_iq2, against gguf-py's values).
struct iq2_code_table {
    alignas(64) uint16_t code[256];
};

inline const iq2_code_table &iq2_codes() {
    static const iq2_code_table t = [] {
        iq2_code_table c{};
        for (int i = 0; i < 256; ++i) {
            unsigned v = 0;
            for (int e = 0; e < 8; ++e) {
                const uint8_t g = iq2xxs_grid[i][e];
                const unsigned digit = g == 0x08 ? 0u : g == 0x19 ? 1u : 2u;  // the grid holds only these three
                v |= digit << (e % 2 == 0 ? e : e + 7);
            }
            c.code[i] = static_cast<uint16_t>(v);
        }
        return c;
    }();
    return t;
}

// Rows [r0, r1) of W (rows w_stride bytes apart) against MB activation rows x[m]: y[m * ldy + r] for each.
// A block's weight decode (grid codes, scales, sign masks) is done once for the MB rows; each row's integer
// products and float accumulation are the one-row kernel's, so its bits are those of MB = 1 (decode's 2-4
// rows: the panel path's i16 decode of 4 rows per tile cost 2.5x a one-row pass there).
template <int MB>
inline void iq2_rows_512(int64_t nb, const uint8_t *W, size_t w_stride, int64_t r0, int64_t r1,
                         const uint8_t *const *x, float *y, int64_t ldy) {
    const iq2_code_table &ct = iq2_codes();
    __m512i tab[8];
    for (int t = 0; t < 8; ++t) tab[t] = _mm512_load_si512(ct.code + 32 * t);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i even_dw = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i odd_dw = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i shift = _mm512_set1_epi64(0x0006000400020000ll);  // word w of a qword: 2w
    const __m512i digits = _mm512_set1_epi16(0x0303);
    const __m512i mag = _mm512_broadcast_i32x4(_mm_setr_epi8(0x08, 0x19, 0x2b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
    __m512i spread[4], scsel[4];  // pair k: code word 8k+i to all words of qword i; scale dword 2k / 2k+1
    for (int k = 0; k < 4; ++k) {
        alignas(64) uint16_t sp[32], ss[32];
        for (int j = 0; j < 32; ++j) {
            sp[j] = static_cast<uint16_t>(8 * k + j / 4);
            ss[j] = static_cast<uint16_t>(2 * (2 * k + j / 16));
        }
        spread[k] = _mm512_load_si512(sp);
        scsel[k] = _mm512_load_si512(ss);
    }
    for (int64_t r = r0; r < r1; ++r) {
    const uint8_t *w = W + r * w_stride;
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = w + b * iq2_bytes;
        uint32_t aux[16];  // per group g: aux[2g] = 4 grid indices, aux[2g+1] = 4 sign codes | scale << 28
        std::memcpy(aux, wb + 2, 64);
        const __m512i raw = _mm512_loadu_si512(wb + 2);
        // word 4g + j = grid index j of group g
        const __m512i idx = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi32(even_dw, raw)));
        const __mmask32 b6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64)),
                        b7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128));
        const __m512i c01 = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(tab[0], idx, tab[1]),
                                                    _mm512_permutex2var_epi16(tab[2], idx, tab[3]));
        const __m512i c23 = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(tab[4], idx, tab[5]),
                                                    _mm512_permutex2var_epi16(tab[6], idx, tab[7]));
        const __m512i codes = _mm512_mask_blend_epi16(b7, c01, c23);
        // dword g = 2 ls_g + 1
        const __m512i sc = _mm512_add_epi32(
            _mm512_slli_epi32(_mm512_srli_epi32(_mm512_permutexvar_epi32(odd_dw, raw), 28), 1), _mm512_set1_epi32(1));
        __m512i s[MB];
        for (int m = 0; m < MB; ++m) s[m] = zero;
        for (int k = 0; k < 4; ++k) {
            const int g = 2 * k;
            const __m512i q = _mm512_shuffle_epi8(
                mag, _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(spread[k], codes), shift), digits));
            const uint32_t sg1 = aux[2 * g + 1], sg2 = aux[2 * g + 3];
            const uint64_t bytes =
                _pdep_u64((sg1 & 0x0FFFFFFFu) | static_cast<uint64_t>(sg2 & 0x0FFFFFFFu) << 28, 0x7F7F7F7F7F7F7F7Full);
            uint64_t par = bytes ^ (bytes >> 4);
            par ^= par >> 2;
            par ^= par >> 1;  // bit 0 of each byte: the parity of that byte
            const __mmask64 neg = bytes | (par & 0x0101010101010101ull) << 7;
            const __m512i scs = _mm512_permutexvar_epi16(scsel[k], sc);
            for (int m = 0; m < MB; ++m) {
                const __m512i av = _mm512_loadu_si512(x[m] + b * iq2_q8k_bytes + 4 + 32 * g);
                const __m512i a = _mm512_mask_sub_epi8(av, neg, zero, av);
                s[m] = _mm512_dpwssd_epi32(s[m], _mm512_maddubs_epi16(q, a), scs);
            }
        }
        const float dw = ldf16(wb);
        for (int m = 0; m < MB; ++m) {
            float da;
            std::memcpy(&da, x[m] + b * iq2_q8k_bytes, 4);
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s[m]), _mm512_extracti64x4_epi64(s[m], 1));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), _mm256_cvtepi32_ps(s8), acc[m]);
        }
    }
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = 0.125f * hsum(acc[m]);
    }
}
#endif

// M == 1, rows [r0, r1): the AVX-512 kernel where this instantiation has it, else row by row.
inline void iq2_rows_m1(int64_t nb, const uint8_t *W, size_t w_stride, int64_t r0, int64_t r1, const uint8_t *x,
                        float *y) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__BMI2__)
    iq2_rows_512<1>(nb, W, w_stride, r0, r1, &x, y, 0);
#else
    for (int64_t r = r0; r < r1; ++r) y[r] = iq2_row_m1(nb, W + r * w_stride, x);
#endif
}

// M > 1: 4 decoded rows (panel[4 * b + r] = super-block b of row r) against MB activation rows, read
// offset to u8 from xu (xu[m]: [nb][256], see iq2dec) with their scales from da ([m]: [nb]).
template <int MB>
inline void iq2_tile_panel(int64_t nb, const iq2dec *panel, const uint8_t *const xu[MB], const float *const dam[MB],
                           float out[MB][4]) {
    __m256 acc[MB][4];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const iq2dec *dec = panel + 4 * b;
        for (int r = 0; r < 4; ++r) {
            __m256i sum[MB];
            for (int m = 0; m < MB; ++m) sum[m] = dec[r].ncorr;
            for (int g = 0; g < 8; ++g) {
                const __m256i sc = _mm256_set1_epi16(dec[r].sc[g]);
                for (int m = 0; m < MB; ++m)
                    sum[m] = _mm256_add_epi32(
                        sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(iq2_ld(xu[m] + b * 256 + 32 * g), dec[r].w[g]), sc));
            }
            for (int m = 0; m < MB; ++m)
                acc[m][r] = _mm256_fmadd_ps(_mm256_set1_ps(dec[r].d * dam[m][b]), _mm256_cvtepi32_ps(sum[m]), acc[m][r]);
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < 4; ++r) out[m][r] = 0.125f * hsum(acc[m][r]);
}

thread_local scratch<iq2dec> t_iq2_panel;  // per-thread decoded panel [nb][4]
thread_local scratch<uint8_t> t_iq2_xu;    // per-thread activations offset to u8 [M][nb][256]
thread_local scratch<float> t_iq2_da;      // and their scales [M][nb]

void gemm_iq2_xxs(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                  int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk_k;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    if (M <= 0) return;
    if (M == 1) return iq2_rows_m1(nb, Wb, w_stride, r0, r1, Xb, y);
    iq2dec *pbuf = t_iq2_panel.get(static_cast<size_t>(4 * nb));
    uint8_t *xu = t_iq2_xu.get(static_cast<size_t>(M * nb * 256));
    float *da = t_iq2_da.get(static_cast<size_t>(M * nb));
    const __m256i off = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *xb = Xb + m * x_stride + b * iq2_q8k_bytes;
            std::memcpy(&da[m * nb + b], xb, 4);
            for (int g = 0; g < 8; ++g)
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(xu + (m * nb + b) * 256 + 32 * g),
                                    _mm256_xor_si256(iq2_ld(xb + 4 + 32 * g), off));
        }
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + imin(i, rows - 1)) * w_stride;  // tail: repeat the last row
        for (int64_t b = 0; b < nb; ++b)
            for (int i = 0; i < 4; ++i) iq2_decode(w[i] + b * iq2_bytes, pbuf[4 * b + i]);
        for (int64_t m = 0; m < M; m += 2) {
            const int mb = static_cast<int>(imin(2, M - m));
            const uint8_t *x[2] = {xu + m * nb * 256, xu + (m + mb - 1) * nb * 256};
            const float *dm[2] = {da + m * nb, da + (m + mb - 1) * nb};
            float out[2][4];
            if (mb == 2) iq2_tile_panel<2>(nb, pbuf, x, dm, out);
            else iq2_tile_panel<1>(nb, pbuf, x, dm, out);
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- M > 1 with AVX-512 VNNI: i16 weights with scale and sign applied, one vpdpwssd per group ---------
// Each panel weight is the exact integer (2 ls_g + 1) * (+-grid) (|.| <= 31 * 43, an i16); activations
// are sign-extended to i16 per group and shared by the tile's 4 rows, so one vpdpwssd per (row, token,
// group) adds 32 products into 16 i32 lanes (lane j: elements 2j, 2j+1). After a super-block's 8
// groups, lanes 2L and 2L+1 together are ggml's exact integer S_L (elements 4L..4L+3 of every group),
// and the float part (cvt, fma with fp16(d_w) * d_a, 0.125f * hsum) is that of the other paths: same
// bits as vec_dot for every M (tests/backend/cpu/test_quants_iq2.cpp).
struct iq2dec16 {
    __m512i w[8];  // group g: 32 x i16
};

inline void iq2_decode16(const uint8_t *b, iq2dec16 &o, float &d) {
    uint32_t aux[16];
    std::memcpy(aux, b + 2, 64);
    for (int g = 0; g < 8; ++g) {
        const __m256i sq = _mm256_sign_epi8(iq2_grid32(aux[2 * g]), iq2_signs32(aux[2 * g + 1]));
        const __m512i sc = _mm512_set1_epi16(static_cast<short>(2 * (aux[2 * g + 1] >> 28) + 1));
        o.w[g] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(sq), sc);
    }
    d = ldf16(b);
}

// The tile reads activations already widened to i16 (a16: [M][nb][8 groups][32], once per gemm call,
// not once per 4-row group) and pairs rows in its epilogue: for rows 2p and 2p+1 one two-source permute
// pair gives lanes 2L + 2L+1 of both (lanes 0..7: row 2p, 8..15: row 2p+1), converted and FMA'd as one
// 512-bit vector with scales pdw[b][p] = (fp16(d_w[2p]) x 8, fp16(d_w[2p+1]) x 8) times d_a: the same
// integers, products and FMA per lane as before, ~25 % fewer vector ops per super-block.
template <int MB>
inline void iq2_tile16(int64_t nb, const iq2dec16 *panel, const float *pdw, const int16_t *const a16[MB],
                       const uint8_t *const x[MB], float out[MB][4]) {
    __m512 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t b = 0; b < nb; ++b) {
        const iq2dec16 *dec = panel + 4 * b;
        __m512i S[MB][4];
        for (int m = 0; m < MB; ++m)
            for (int r = 0; r < 4; ++r) S[m][r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; ++g)
            for (int r = 0; r < 4; ++r) {
                const __m512i w = dec[r].w[g];
                for (int m = 0; m < MB; ++m)
                    S[m][r] = _mm512_dpwssd_epi32(S[m][r], w, _mm512_loadu_si512(a16[m] + (b * 8 + g) * 32));
            }
        for (int m = 0; m < MB; ++m) {
            float da;
            std::memcpy(&da, x[m] + b * iq2_q8k_bytes, 4);
            const __m512 vda = _mm512_set1_ps(da);
            for (int p = 0; p < 2; ++p) {
                const __m512i A = S[m][2 * p], B = S[m][2 * p + 1];
                const __m512i s16 =
                    _mm512_add_epi32(_mm512_permutex2var_epi32(A, ev, B), _mm512_permutex2var_epi32(A, od, B));
                acc[m][p] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(pdw + (2 * b + p) * 16), vda),
                                            _mm512_cvtepi32_ps(s16), acc[m][p]);
            }
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int p = 0; p < 2; ++p) {
            out[m][2 * p] = 0.125f * hsum(_mm512_castps512_ps256(acc[m][p]));
            out[m][2 * p + 1] = 0.125f * hsum(_mm512_extractf32x8_ps(acc[m][p], 1));
        }
}

thread_local scratch<iq2dec16> t_iq2_panel16;  // per-thread decoded panel [nb][4]
thread_local scratch<float> t_iq2_pdw;         // its fp16(d_w) as f32, row pairs [nb][2][16] (see iq2_tile16)
thread_local scratch<int16_t> t_iq2_a16;       // the activations widened to i16 [M][nb][8][32]

void gemm_iq2_xxs_vnni(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                       size_t x_stride, int64_t M, float *y, int64_t ldy) {
    if (M <= 1) return gemm_iq2_xxs(K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
    const int64_t nb = K / qk_k;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
#if defined(__BMI2__)
    if (M <= 8) {  // decode's few rows (verification, batched sequences, an expert's rows in a batched step): one
                   // weight decode per block for all of them (iq2_rows_512). One thread, 4096 x 2048, against the
                   // panel below: M = 5 1.19 -> 0.77 ms, 6 1.23 -> 0.88, 8 1.37 -> 1.09; at 16 the two are equal.
        const uint8_t *xr[8];
        for (int64_t m = 0; m < 8; ++m) xr[m] = Xb + imin(m, M - 1) * x_stride;
        switch (M) {
            case 2: iq2_rows_512<2>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
            case 3: iq2_rows_512<3>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
            case 4: iq2_rows_512<4>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
            case 5: iq2_rows_512<5>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
            case 6: iq2_rows_512<6>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
            case 7: iq2_rows_512<7>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
            default: iq2_rows_512<8>(nb, Wb, w_stride, r0, r1, xr, y, ldy); break;
        }
        return;
    }
#endif
    iq2dec16 *pbuf = t_iq2_panel16.get(static_cast<size_t>(4 * nb));
    float *pdw = t_iq2_pdw.get(static_cast<size_t>(32 * nb));
    int16_t *a16 = t_iq2_a16.get(static_cast<size_t>(M * nb * 256));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b)
            for (int g = 0; g < 8; ++g)
                _mm512_storeu_si512(a16 + ((m * nb + b) * 8 + g) * 32,
                                    _mm512_cvtepi8_epi16(iq2_ld(Xb + m * x_stride + b * iq2_q8k_bytes + 4 + 32 * g)));
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        for (int64_t b = 0; b < nb; ++b) {
            float pd[4];
            for (int i = 0; i < 4; ++i)
                iq2_decode16(Wb + (r + imin(i, rows - 1)) * w_stride + b * iq2_bytes, pbuf[4 * b + i], pd[i]);
            for (int j = 0; j < 32; ++j) pdw[32 * b + j] = pd[j / 8];
        }
        for (int64_t m = 0; m < M; m += 4) {
            const int mb = static_cast<int>(imin(4, M - m));
            const uint8_t *x[4];
            const int16_t *a[4];
            for (int j = 0; j < 4; ++j) {
                x[j] = Xb + (m + imin(j, mb - 1)) * x_stride;
                a[j] = a16 + (m + imin(j, mb - 1)) * nb * 256;
            }
            float out[4][4];
            switch (mb) {
                case 1:
                    iq2_tile16<1>(nb, pbuf, pdw, a, x, out);
                    break;
                case 2:
                    iq2_tile16<2>(nb, pbuf, pdw, a, x, out);
                    break;
                case 3:
                    iq2_tile16<3>(nb, pbuf, pdw, a, x, out);
                    break;
                default:
                    iq2_tile16<4>(nb, pbuf, pdw, a, x, out);
                    break;
            }
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}
#endif

float dot_iq2_xxs_x86(int64_t n, const void *w, const void *a) {
    float y = 0;
    iq2_rows_m1(n / qk_k, static_cast<const uint8_t *>(w), 0, 0, 1, static_cast<const uint8_t *>(a), &y);
    return y;
}

inline void fill_x86_iq2(kernel_table &t) {
    t.dot[slot(dtype::iq2_xxs)] = dot_iq2_xxs_x86;
    t.gemm[slot(dtype::iq2_xxs)] = gemm_iq2_xxs;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    t.gemm[slot(dtype::iq2_xxs)] = gemm_iq2_xxs_vnni;
#endif
}

}  // namespace
}  // namespace fathom::cpu::detail
