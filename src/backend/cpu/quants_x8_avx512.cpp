// AVX-512 VNNI kernels for the row-interleaved q4_1 / q8_0 layout (quants_x8.h). Same float
// operations, in the same order per output, as the AVX2 kernels (quants_x8_avx2.cpp) and so as
// ggml's AVX2 vec_dot:
//   acc_L = fma(d_w * d_x, float(isum_L), acc_L)   block after block (isum_L: the exact i32 sum of
//           the 4 products of elements 4L..4L+3),
//   out   = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7)) (+ summs for q4_1).
// Only the integer part differs: isum_L comes from one vpdpbusd (u8 x s8, four products summed into
// an i32 lane, no intermediate saturation) instead of maddubs + madd. Both are exact here:
//   q4_1: u8 nibbles 0..15 x s8 activations, so maddubs' i16 pair sums (|.| <= 3840) never saturate;
//   q8_0: the weights are biased to u8 (w ^ 0x80 = w + 128) and the accumulator starts at
//         -128 * (sum of the 4 activations), so the lane ends at exactly sum w * a. ggml's sign trick
//         (|w| x sign(a, w)) gives the same exact sum for activations in [-127, 127], which is the
//         range quantize_row_q8_0 produces.
// With M >= 2 activation rows a panel of 16 rows (two groups side by side: one 512-bit register per
// lane L holds lane L of rows 8g..8g+15) is decoded once and reused by every activation row, so one
// instruction does the work of two AVX2 ones and the weight decode is paid once per step.
// Measured (one core, K = 576, M = 16, weights in cache): q4_1 1.7x, q8_0 2x the AVX2 kernels.
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's avx512fintrin.h self-initialises its "undefined" vectors (as in quants_avx512.cpp).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cpu/quants_avx2_common.h"
#include "backend/cpu/quants_x8.h"

namespace fathom::cpu::detail {

namespace {

using avx2::ld32;
using avx2::ldf16;

constexpr int kPrefetch = 1536;  // bytes ahead of the packed block being read (M = 1 streams)
constexpr size_t kQ41Group = 160, kQ80Group = 272;  // packed bytes per block of one 8-row group

// hsum_float_8's tree, lane-wise (each lane is one output).
template <class V, V (*Add)(V, V)>
inline V tree(const V acc[8]) {
    const V t0 = Add(acc[0], acc[4]), t1 = Add(acc[1], acc[5]), t2 = Add(acc[2], acc[6]),
            t3 = Add(acc[3], acc[7]);
    return Add(Add(t0, t2), Add(t1, t3));
}
inline __m256 tree8(const __m256 acc[8]) {
    return tree<__m256, _mm256_add_ps>(acc);
}
inline __m512 tree16(const __m512 acc[8]) {
    return tree<__m512, _mm512_add_ps>(acc);
}

// Per-thread 64-byte aligned scratch, grown on demand and reused.
struct scratch {
    struct alignas(64) chunk {
        uint8_t b[64];
    };
    std::vector<chunk> v;
    uint8_t *get(size_t bytes) {
        if (v.size() * 64 < bytes) v.resize((bytes + 63) / 64);
        return reinterpret_cast<uint8_t *>(v.data());
    }
};
thread_local scratch t_panel, t_act;

// The panel loops decode a pair of groups (streamed from memory: the weights do not fit in cache),
// then compute on it for a while. To keep the memory busy during the compute, slice i of n of the
// next pair's packed bytes is prefetched before activation row i is processed (into L1: measured
// faster than into L2 on the 2-core EPYC, 2026-12-01).
inline void prefetch_slice(const uint8_t *base, size_t bytes, int64_t i, int64_t n) {
    const size_t lines = (bytes + 63) / 64,
                 per = (lines + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
    const size_t l0 = per * static_cast<size_t>(i), l1 = std::min(lines, l0 + per);
    for (size_t l = l0; l < l1; ++l) _mm_prefetch(reinterpret_cast<const char *>(base + 64 * l), _MM_HINT_T0);
}

// ---- q4_1 -----------------------------------------------------------------------------------------

// M = 1: 8 rows (one group, nb packed blocks at p) x one q8_1 row x -> y[0..8), nibbles split in registers.
void group_q4_1(int64_t nb, const uint8_t *p, const uint8_t *x, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    __m256 summs = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b, p += kQ41Group, x += 36) {
        _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch + 128), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16)));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(ldf16(x)));
        for (int k = 0; k < 4; ++k) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 32 + 32 * k));
            const __m256i lo = _mm256_and_si256(q, mask),
                          hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
            const __m256i s0 =
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_set1_epi32(ld32(x + 4 + 8 * k)));
            const __m256i s1 =
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, _mm256_set1_epi32(ld32(x + 8 + 8 * k)));
            acc[2 * k] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s0), acc[2 * k]);
            acc[2 * k + 1] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s1), acc[2 * k + 1]);
        }
        summs = _mm256_fmadd_ps(mw, _mm256_set1_ps(ldf16(x + 2)), summs);
    }
    _mm256_storeu_ps(y, _mm256_add_ps(tree8(acc), summs));
}

// Panel of G (1 or 2) groups, per block: 8 lanes x 32G bytes of u8 nibbles (lane L of group g at
// 32G L + 32 g), then d[8G] and m[8G] as f32 (row order). 320 B (G = 1) or 640 B (G = 2) per block.
template <int G>
constexpr size_t q41_panel_block = 320 * G;

template <int G>
void decode_panel_q4_1(int64_t nb, const uint8_t *p, uint8_t *pn) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const size_t gstride = static_cast<size_t>(nb) * kQ41Group;  // packed bytes of one group
    for (int64_t b = 0; b < nb; ++b, pn += q41_panel_block<G>) {
        for (int g = 0; g < G; ++g) {
            const uint8_t *s = p + g * gstride + static_cast<size_t>(b) * kQ41Group;
            for (int k = 0; k < 4; ++k) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + 32 + 32 * k));
                _mm256_store_si256(reinterpret_cast<__m256i *>(pn + 32 * G * (2 * k) + 32 * g),
                                   _mm256_and_si256(q, mask));
                _mm256_store_si256(reinterpret_cast<__m256i *>(pn + 32 * G * (2 * k + 1) + 32 * g),
                                   _mm256_and_si256(_mm256_srli_epi16(q, 4), mask));
            }
            _mm256_store_ps(reinterpret_cast<float *>(pn + 256 * G + 32 * g),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s))));
            _mm256_store_ps(reinterpret_cast<float *>(pn + 256 * G + 32 * G + 32 * g),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + 16))));
        }
    }
}

// The activation block's {d, s} (f16 at x) as f32 in lanes 0 and 1.
inline __m128 act_ds(const uint8_t *x) {
    return _mm_cvtph_ps(_mm_cvtsi32_si128(ld32(x)));
}

// One activation row (q8_1 blocks at x) against a G = 2 panel -> y[0..16).
void panel2_q4_1(int64_t nb, const uint8_t *pn, const uint8_t *x, float *y) {
    __m512 acc[8];
    for (auto &a : acc) a = _mm512_setzero_ps();
    __m512 summs = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, pn += q41_panel_block<2>, x += 36) {
        const __m128 ds = act_ds(x);
        const __m512 scale = _mm512_mul_ps(_mm512_load_ps(reinterpret_cast<const float *>(pn + 512)),
                                           _mm512_broadcastss_ps(ds));
        for (int L = 0; L < 8; ++L) {
            const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(pn + 64 * L),
                                                  _mm512_set1_epi32(ld32(x + 4 + 4 * L)));
            acc[L] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc[L]);
        }
        summs = _mm512_fmadd_ps(_mm512_load_ps(reinterpret_cast<const float *>(pn + 576)),
                                _mm512_broadcastss_ps(_mm_movehdup_ps(ds)), summs);
    }
    _mm512_storeu_ps(y, _mm512_add_ps(tree16(acc), summs));
}

// The same against a G = 1 panel -> y[0..8) (the odd last group of a range).
void panel1_q4_1(int64_t nb, const uint8_t *pn, const uint8_t *x, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    __m256 summs = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, pn += q41_panel_block<1>, x += 36) {
        const __m128 ds = act_ds(x);
        const __m256 scale = _mm256_mul_ps(_mm256_load_ps(reinterpret_cast<const float *>(pn + 256)),
                                           _mm256_broadcastss_ps(ds));
        for (int L = 0; L < 8; ++L) {
            const __m256i s = _mm256_dpbusd_epi32(
                _mm256_setzero_si256(), _mm256_load_si256(reinterpret_cast<const __m256i *>(pn + 32 * L)),
                _mm256_set1_epi32(ld32(x + 4 + 4 * L)));
            acc[L] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[L]);
        }
        summs = _mm256_fmadd_ps(_mm256_load_ps(reinterpret_cast<const float *>(pn + 288)),
                                _mm256_broadcastss_ps(_mm_movehdup_ps(ds)), summs);
    }
    _mm256_storeu_ps(y, _mm256_add_ps(tree8(acc), summs));
}

// ---- q8_0 -----------------------------------------------------------------------------------------

// M = 1: 8 rows x one q8_0 row -> y[0..8). The weights are biased to u8 in registers (xor 0x80);
// the correction -128 * sum(a) of lane L starts its dpbusd.
void group_q8_0(int64_t nb, const uint8_t *p, const uint8_t *x, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b, p += kQ80Group, x += 34) {
        for (int c = 0; c < 272; c += 64)
            _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch + c), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(ldf16(x)));
        // corr[L] = -128 * (a[4L] + .. + a[4L+3]) for the 8 lanes, as one vector; broadcast per lane below.
        alignas(32) int32_t corr[8];
        _mm256_store_si256(
            reinterpret_cast<__m256i *>(corr),
            _mm256_sub_epi32(
                _mm256_setzero_si256(),
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias,
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + 2)))));
        for (int L = 0; L < 8; ++L) {
            const __m256i w = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 16 + 32 * L)), bias);
            const __m256i s =
                _mm256_dpbusd_epi32(_mm256_set1_epi32(corr[L]), w, _mm256_set1_epi32(ld32(x + 2 + 4 * L)));
            acc[L] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[L]);
        }
    }
    _mm256_storeu_ps(y, tree8(acc));
}

// Panel of G groups, per block: 8 lanes x 32G bytes of biased u8 weights (lane L of group g at
// 32G L + 32 g), then d[8G] as f32. 288 B (G = 1) or 576 B (G = 2) per block.
template <int G>
constexpr size_t q80_panel_block = 288 * G;

template <int G>
void decode_panel_q8_0(int64_t nb, const uint8_t *p, uint8_t *pn) {
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    const size_t gstride = static_cast<size_t>(nb) * kQ80Group;
    for (int64_t b = 0; b < nb; ++b, pn += q80_panel_block<G>) {
        for (int g = 0; g < G; ++g) {
            const uint8_t *s = p + g * gstride + static_cast<size_t>(b) * kQ80Group;
            for (int L = 0; L < 8; ++L)
                _mm256_store_si256(
                    reinterpret_cast<__m256i *>(pn + 32 * G * L + 32 * g),
                    _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(s + 16 + 32 * L)),
                                     bias));
            _mm256_store_ps(reinterpret_cast<float *>(pn + 256 * G + 32 * g),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s))));
        }
    }
}

// Per activation row and block, what the panels need besides the quants: d as f32 and the eight
// lane corrections -128 * sum(a[4L..4L+3]). 64 B per (row, block): corr[8] i32, d, pad (32-byte aligned).
constexpr size_t kQ80Act = 64;

void prepare_act_q8_0(int64_t nb, const uint8_t *X, size_t x_stride, int64_t M, uint8_t *out) {
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t m = 0; m < M; ++m) {
        const uint8_t *x = X + static_cast<size_t>(m) * x_stride;
        for (int64_t b = 0; b < nb; ++b, x += 34, out += kQ80Act) {
            const __m256i s = _mm256_dpbusd_epi32(
                _mm256_setzero_si256(), bias, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + 2)));
            _mm256_store_si256(reinterpret_cast<__m256i *>(out), _mm256_sub_epi32(_mm256_setzero_si256(), s));
            const float d = ldf16(x);
            std::memcpy(out + 32, &d, 4);
        }
    }
}

void panel2_q8_0(int64_t nb, const uint8_t *pn, const uint8_t *x, const uint8_t *xa, float *y) {
    __m512 acc[8];
    for (auto &a : acc) a = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, pn += q80_panel_block<2>, x += 34, xa += kQ80Act) {
        float dx;
        std::memcpy(&dx, xa + 32, 4);
        const __m512 scale =
            _mm512_mul_ps(_mm512_load_ps(reinterpret_cast<const float *>(pn + 512)), _mm512_set1_ps(dx));
        for (int L = 0; L < 8; ++L) {
            const __m512i s =
                _mm512_dpbusd_epi32(_mm512_set1_epi32(ld32(xa + 4 * L)), _mm512_load_si512(pn + 64 * L),
                                    _mm512_set1_epi32(ld32(x + 2 + 4 * L)));
            acc[L] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc[L]);
        }
    }
    _mm512_storeu_ps(y, tree16(acc));
}

void panel1_q8_0(int64_t nb, const uint8_t *pn, const uint8_t *x, const uint8_t *xa, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, pn += q80_panel_block<1>, x += 34, xa += kQ80Act) {
        float dx;
        std::memcpy(&dx, xa + 32, 4);
        const __m256 scale =
            _mm256_mul_ps(_mm256_load_ps(reinterpret_cast<const float *>(pn + 256)), _mm256_set1_ps(dx));
        for (int L = 0; L < 8; ++L) {
            const __m256i s =
                _mm256_dpbusd_epi32(_mm256_set1_epi32(ld32(xa + 4 * L)),
                                    _mm256_load_si256(reinterpret_cast<const __m256i *>(pn + 32 * L)),
                                    _mm256_set1_epi32(ld32(x + 2 + 4 * L)));
            acc[L] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[L]);
        }
    }
    _mm256_storeu_ps(y, tree8(acc));
}

}  // namespace

void x8_gemm_q4_1_avx512(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X,
                         size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const size_t gbytes = static_cast<size_t>(nb) * kQ41Group;
    if (M < 2) {
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t m = 0; m < M; ++m)
                group_q4_1(nb, P + static_cast<size_t>(g) * gbytes, X + static_cast<size_t>(m) * x_stride,
                           y + m * ldy + 8 * g);
        return;
    }
    uint8_t *pn = t_panel.get(static_cast<size_t>(nb) * q41_panel_block<2>);
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2) {
        decode_panel_q4_1<2>(nb, P + static_cast<size_t>(g) * gbytes, pn);
        const size_t ahead = static_cast<size_t>(std::clamp<int64_t>(g1 - g - 2, 0, 2)) *
                             gbytes;  // the next pair (or odd group)
        for (int64_t m = 0; m < M; ++m) {
            if (ahead) prefetch_slice(P + static_cast<size_t>(g + 2) * gbytes, ahead, m, M);
            panel2_q4_1(nb, pn, X + static_cast<size_t>(m) * x_stride, y + m * ldy + 8 * g);
        }
    }
    if (g < g1) {
        decode_panel_q4_1<1>(nb, P + static_cast<size_t>(g) * gbytes, pn);
        for (int64_t m = 0; m < M; ++m)
            panel1_q4_1(nb, pn, X + static_cast<size_t>(m) * x_stride, y + m * ldy + 8 * g);
    }
}

void x8_gemm_q8_0_avx512(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X,
                         size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const size_t gbytes = static_cast<size_t>(nb) * kQ80Group;
    if (M < 2) {
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t m = 0; m < M; ++m)
                group_q8_0(nb, P + static_cast<size_t>(g) * gbytes, X + static_cast<size_t>(m) * x_stride,
                           y + m * ldy + 8 * g);
        return;
    }
    uint8_t *xa = t_act.get(static_cast<size_t>(M * nb) * kQ80Act);
    prepare_act_q8_0(nb, X, x_stride, M, xa);
    uint8_t *pn = t_panel.get(static_cast<size_t>(nb) * q80_panel_block<2>);
    const size_t arow = static_cast<size_t>(nb) * kQ80Act;
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2) {
        decode_panel_q8_0<2>(nb, P + static_cast<size_t>(g) * gbytes, pn);
        const size_t ahead = static_cast<size_t>(std::clamp<int64_t>(g1 - g - 2, 0, 2)) *
                             gbytes;  // the next pair (or odd group)
        for (int64_t m = 0; m < M; ++m) {
            if (ahead) prefetch_slice(P + static_cast<size_t>(g + 2) * gbytes, ahead, m, M);
            panel2_q8_0(nb, pn, X + static_cast<size_t>(m) * x_stride, xa + m * arow, y + m * ldy + 8 * g);
        }
    }
    if (g < g1) {
        decode_panel_q8_0<1>(nb, P + static_cast<size_t>(g) * gbytes, pn);
        for (int64_t m = 0; m < M; ++m)
            panel1_q8_0(nb, pn, X + static_cast<size_t>(m) * x_stride, xa + m * arow, y + m * ldy + 8 * g);
    }
}

}  // namespace fathom::cpu::detail
