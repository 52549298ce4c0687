// AVX2 kernels for the row-interleaved q4_1 / q8_0 layout (quants_x8.h). One call computes 8 rows x
// one activation row at a time: 8 accumulators, accumulator L holding lane L (elements 4L..4L+3 of
// every block) of the 8 rows, so each output follows ggml's AVX2 vec_dot order exactly:
//   acc_L = fma(d_w * d_x, float(sum of 4 u8 x s8 products), acc_L)   block after block,
//   out   = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7))  (+ summs for q4_1,
//           summs = fma(m_w, s_x, summs) block after block),
// which is hsum_float_8's tree applied lane-wise. The integer sums are the same maddubs pairs as
// ggml's (bytes 4L..4L+3 of a row stay together), so even i16 saturation would agree.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "backend/cpu/quants_avx2_common.h"
#include "backend/cpu/quants_x8.h"

namespace fathom::cpu::detail {

namespace {

using avx2::ld32;
using avx2::ldf16;

// Decode streams each weight once from memory: software prefetch this far ahead of the block being read.
#ifndef FATHOM_X8_PREFETCH
#define FATHOM_X8_PREFETCH 1536
#endif
constexpr int kPrefetch = FATHOM_X8_PREFETCH;

inline __m256 lane_dot(__m256i w_u8, __m256i a_s8, __m256 scale, __m256 acc) {
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(w_u8, a_s8), _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc);
}

inline __m256 tree(const __m256 acc[8]) {
    const __m256 t0 = _mm256_add_ps(acc[0], acc[4]), t1 = _mm256_add_ps(acc[1], acc[5]);
    const __m256 t2 = _mm256_add_ps(acc[2], acc[6]), t3 = _mm256_add_ps(acc[3], acc[7]);
    return _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
}

// 8 rows (one group, nb blocks of 160 B at p) x one q8_1 activation row x -> y[0..8).
inline void group_q4_1(int64_t nb, const uint8_t *p, const uint8_t *x, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    __m256 summs = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b, p += 160, x += 36) {
        _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch + 128), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16)));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(ldf16(x)));
        for (int k = 0; k < 4; ++k) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 32 + 32 * k));
            const __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
            acc[2 * k] = lane_dot(lo, _mm256_set1_epi32(ld32(x + 4 + 8 * k)), scale, acc[2 * k]);
            acc[2 * k + 1] = lane_dot(hi, _mm256_set1_epi32(ld32(x + 8 + 8 * k)), scale, acc[2 * k + 1]);
        }
        summs = _mm256_fmadd_ps(mw, _mm256_set1_ps(ldf16(x + 2)), summs);
    }
    _mm256_storeu_ps(y, _mm256_add_ps(tree(acc), summs));
}

// Prefill: a q4_1 group decoded once into a panel of nb blocks x {8 x 32 B quants (register L =
// lane L of the 8 rows), d[8], m[8] as f32} = 320 B, then reused by every activation row, whose
// loop is loads (folded into maddubs) and arithmetic. The values are those group_q4_1 computes in
// registers, so results are unchanged.
constexpr size_t kPanelBlock = 320;

void decode_panel_q4_1(int64_t nb, const uint8_t *p, uint8_t *pn) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b, p += 160, pn += kPanelBlock) {
        for (int k = 0; k < 4; ++k) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 32 + 32 * k));
            _mm256_store_si256(reinterpret_cast<__m256i *>(pn + 64 * k), _mm256_and_si256(q, mask));
            _mm256_store_si256(reinterpret_cast<__m256i *>(pn + 64 * k + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), mask));
        }
        _mm256_store_ps(reinterpret_cast<float *>(pn + 256), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
        _mm256_store_ps(reinterpret_cast<float *>(pn + 288),
                        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 16))));
    }
}

// xs: the row's per-block d and s as f32 pairs (the same values ldf16 gives), converted once per call.
inline void panel_q4_1(int64_t nb, const uint8_t *pn, const uint8_t *x, const float *xs, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    __m256 summs = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, pn += kPanelBlock, x += 36, xs += 2) {
        const __m256 scale = _mm256_mul_ps(_mm256_load_ps(reinterpret_cast<const float *>(pn + 256)), _mm256_set1_ps(xs[0]));
        for (int L = 0; L < 8; ++L)
            acc[L] = lane_dot(_mm256_load_si256(reinterpret_cast<const __m256i *>(pn + 32 * L)),
                              _mm256_set1_epi32(ld32(x + 4 + 4 * L)), scale, acc[L]);
        summs = _mm256_fmadd_ps(_mm256_load_ps(reinterpret_cast<const float *>(pn + 288)), _mm256_set1_ps(xs[1]), summs);
    }
    _mm256_storeu_ps(y, _mm256_add_ps(tree(acc), summs));
}

// Per-thread panel storage (32-byte aligned), grown on demand and reused.
struct panel_buf {
    struct alignas(32) chunk {
        uint8_t b[32];
    };
    std::vector<chunk> v;  // over-aligned element type: C++17 allocates it 32-byte aligned
    uint8_t *get(size_t bytes) {
        if (v.size() * 32 < bytes) v.resize((bytes + 31) / 32);
        return reinterpret_cast<uint8_t *>(v.data());
    }
};
thread_local panel_buf t_panel, t_xs;

// 8 rows (nb blocks of 272 B at p) x one q8_0 activation row x -> y[0..8).
inline void group_q8_0(int64_t nb, const uint8_t *p, const uint8_t *x, float *y) {
    __m256 acc[8];
    for (auto &a : acc) a = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, p += 272, x += 34) {
        for (int c = 0; c < 272; c += 64) _mm_prefetch(reinterpret_cast<const char *>(p + kPrefetch + c), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(ldf16(x)));
        for (int L = 0; L < 8; ++L) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 16 + 32 * L));
            const __m256i a = _mm256_set1_epi32(ld32(x + 2 + 4 * L));
            // ggml's signed trick: |w| (u8) x (a with w's sign) (s8).
            acc[L] = lane_dot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w), scale, acc[L]);
        }
    }
    _mm256_storeu_ps(y, tree(acc));
}

// 8 x 8 transpose of 32-bit elements: out[L] dword r = in[r] dword L.
inline void transpose8(const __m256i in[8], __m256i out[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);      // [r0[0] r1[0] r0[1] r1[1] | 4, 5]
        t[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]);  // [r0[2] r1[2] r0[3] r1[3] | 6, 7]
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);        // dword 0 (| 4) of rows i..i+3
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);    // dword 1 (| 5)
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);  // dword 2 (| 6)
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);  // dword 3 (| 7)
    }
    for (int L = 0; L < 4; ++L) {
        out[L] = _mm256_permute2x128_si256(u[L], u[L + 4], 0x20);
        out[L + 4] = _mm256_permute2x128_si256(u[L], u[L + 4], 0x31);
    }
}

template <void (*Group)(int64_t, const uint8_t *, const uint8_t *, float *)>
void gemm_groups(int64_t nb, size_t group_bytes, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X,
                 size_t x_stride, int64_t M, float *y, int64_t ldy) {
    // Group-major: a group's packed stream (nb * group_bytes, a few KiB) stays in L1 while every
    // activation row passes over it.
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *p = P + static_cast<size_t>(g) * group_bytes;
        for (int64_t m = 0; m < M; ++m) Group(nb, p, X + static_cast<size_t>(m) * x_stride, y + m * ldy + 8 * g);
    }
}

}  // namespace

void x8_pack_avx2(bool q4_1, int64_t nb, const uint8_t *W, size_t w_stride, int64_t g0, int64_t g1, uint8_t *dst) {
    const size_t gb = q4_1 ? 160 : 272, bs = q4_1 ? 20 : 34;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t g = g0; g < g1; ++g) {
        uint8_t *o = dst + static_cast<size_t>(g) * static_cast<size_t>(nb) * gb;
        const uint8_t *rows = W + static_cast<size_t>(8 * g) * w_stride;
        for (int64_t b = 0; b < nb; ++b, o += gb) {
            __m256i q[8], t[8];
            for (int r = 0; r < 8; ++r) {
                const uint8_t *blk = rows + r * w_stride + static_cast<size_t>(b) * bs;
                std::memcpy(o + 2 * r, blk, 2);                      // d
                if (q4_1) {
                    std::memcpy(o + 16 + 2 * r, blk + 2, 2);         // m
                    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 4));
                    q[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), mask);  // elements 0..31
                } else {
                    q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 2));
                }
            }
            transpose8(q, t);  // t[L] = elements 4L..4L+3 of rows 0..7
            if (q4_1) {
                for (int k = 0; k < 4; ++k)
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(o + 32 + 32 * k),
                                        _mm256_or_si256(t[2 * k], _mm256_slli_epi16(t[2 * k + 1], 4)));
            } else {
                for (int L = 0; L < 8; ++L) _mm256_storeu_si256(reinterpret_cast<__m256i *>(o + 16 + 32 * L), t[L]);
            }
        }
    }
}

void x8_gemm_q4_1_avx2(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X, size_t x_stride,
                       int64_t M, float *y, int64_t ldy) {
    if (M >= 2) {  // decode each group once, reuse for all M rows
        uint8_t *pn = t_panel.get(static_cast<size_t>(nb) * kPanelBlock);
        auto *xs = reinterpret_cast<float *>(t_xs.get(static_cast<size_t>(M * nb) * 2 * sizeof(float)));
        for (int64_t m = 0; m < M; ++m)
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t *xb = X + static_cast<size_t>(m) * x_stride + static_cast<size_t>(b) * 36;
                xs[2 * (m * nb + b)] = ldf16(xb);
                xs[2 * (m * nb + b) + 1] = ldf16(xb + 2);
            }
        for (int64_t g = g0; g < g1; ++g) {
            decode_panel_q4_1(nb, P + static_cast<size_t>(g) * static_cast<size_t>(nb) * 160, pn);
            for (int64_t m = 0; m < M; ++m)
                panel_q4_1(nb, pn, X + static_cast<size_t>(m) * x_stride, xs + 2 * m * nb, y + m * ldy + 8 * g);
        }
        return;
    }
    gemm_groups<group_q4_1>(nb, static_cast<size_t>(nb) * 160, P, g0, g1, X, x_stride, M, y, ldy);
}

void x8_gemm_q8_0_avx2(int64_t nb, const uint8_t *P, int64_t g0, int64_t g1, const uint8_t *X, size_t x_stride,
                       int64_t M, float *y, int64_t ldy) {
    gemm_groups<group_q8_0>(nb, static_cast<size_t>(nb) * 272, P, g0, g1, X, x_stride, M, y, ldy);
}

}  // namespace fathom::cpu::detail
