// AVX2 GEMV/GEMM over repacked Q4_K (layout and float order in repack.h). One 8-lane f32 register
// per activation row holds the 8 outputs of a row group (lane = weight row), so no horizontal sums
// are needed. Per sub-block pair (sb) and 4-element group g the 32 packed bytes give the low
// nibbles (sub-block 2sb) and high nibbles (2sb+1) of all 8 rows; the 4 matching activation bytes
// are broadcast to every lane and maddubs'ed in, 8 groups accumulate in i16 (|sum| <= 16*15*127),
// then madd with the per-row 6-bit scales gives i32. Integer sums are exact, so only the fma
// placement (per super-block for GEMV order, per sb for GEMM order) decides the float result,
// which the scalar reference in repack.cpp reproduces bit for bit.
#include <immintrin.h>

#include <cstring>

#include "backend/cpu/quants_x86_kquants.h"  // tr_q6_k: q6_K super-block decode (internal linkage)
#include "backend/cpu/repack.h"

namespace fathom::cpu::detail {
namespace {

constexpr int64_t kQK = 256;
constexpr size_t kQ8kBytes = 292;
constexpr size_t kOffD = 0, kOffDmin = 16, kOffSc = 32, kOffMin = 96, kOffQs = 160;

// (ld256 comes from quants_avx2_common.h through quants_x86_kquants.h.)
inline __m128i ld128(const uint8_t *p) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)); }
inline __m256i bcast32(const uint8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// MB activation rows (1..4) against one group of 8 weight rows over nb super-blocks; out[m][0..8).
template <int MB, bool PER_SB>
void tile(int64_t nb, const uint8_t *wg, const uint8_t *const x[MB], float out[MB][8]) {
    const __m128i dup_lo = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m128i dup_hi = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    const __m128i inter = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MB], accm[MB];
    for (int m = 0; m < MB; ++m) acc[m] = accm[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wg + b * q4k_x8_block_bytes;
        const __m256 d = _mm256_cvtph_ps(ld128(blk + kOffD)), dmin = _mm256_cvtph_ps(ld128(blk + kOffDmin));
        __m256 dd[MB], dm[MB];
        const uint8_t *xb[MB];
        __m256i isum_b[MB], imin_b[MB];
        for (int m = 0; m < MB; ++m) {
            xb[m] = x[m] + b * kQ8kBytes;
            float da;
            std::memcpy(&da, xb[m], 4);
            dd[m] = _mm256_mul_ps(d, _mm256_set1_ps(da));
            dm[m] = _mm256_mul_ps(dmin, _mm256_set1_ps(da));
            isum_b[m] = imin_b[m] = _mm256_setzero_si256();
        }
        for (int sb = 0; sb < 4; ++sb) {
            const __m128i sc = ld128(blk + kOffSc + 16 * sb), mn = ld128(blk + kOffMin + 16 * sb);
            const __m256i sc_lo = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc, dup_lo));
            const __m256i sc_hi = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc, dup_hi));
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(mn, inter));  // (m[2sb], m[2sb+1]) per row
            __m256i plo[MB], phi[MB];
            for (int m = 0; m < MB; ++m) plo[m] = phi[m] = _mm256_setzero_si256();
            const uint8_t *qs = blk + kOffQs + 256 * sb;
            for (int g = 0; g < 8; ++g) {
                const __m256i w = ld256(qs + 32 * g);
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                for (int m = 0; m < MB; ++m) {
                    const uint8_t *a = xb[m] + 4 + 64 * sb + 4 * g;
                    plo[m] = _mm256_add_epi16(plo[m], _mm256_maddubs_epi16(lo, bcast32(a)));
                    phi[m] = _mm256_add_epi16(phi[m], _mm256_maddubs_epi16(hi, bcast32(a + 32)));
                }
            }
            for (int m = 0; m < MB; ++m) {
                const __m256i is = _mm256_add_epi32(_mm256_madd_epi16(plo[m], sc_lo), _mm256_madd_epi16(phi[m], sc_hi));
                int16_t bs[4];
                std::memcpy(bs, xb[m] + 260 + 8 * sb, 8);  // bsums 4sb .. 4sb+3
                const int32_t s0 = bs[0] + bs[1], s1 = bs[2] + bs[3];
                const __m256i sp = _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(s0) & 0xFFFF) |
                                                                          (static_cast<uint32_t>(s1) << 16)));
                const __m256i im = _mm256_madd_epi16(mins, sp);
                if constexpr (PER_SB) {
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), dd[m], acc[m]);
                    accm[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), dm[m], accm[m]);
                } else {
                    isum_b[m] = _mm256_add_epi32(isum_b[m], is);
                    imin_b[m] = _mm256_add_epi32(imin_b[m], im);
                }
            }
        }
        if constexpr (!PER_SB)
            for (int m = 0; m < MB; ++m) {
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_b[m]), dd[m], acc[m]);
                accm[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin_b[m]), dm[m], accm[m]);
            }
    }
    for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], _mm256_sub_ps(acc[m], accm[m]));
}

template <bool PER_SB>
void run_tile(int mb, int64_t nb, const uint8_t *wg, const uint8_t *const x[4], float out[4][8]) {
    switch (mb) {
        case 1: tile<1, PER_SB>(nb, wg, x, out); break;
        case 2: tile<2, PER_SB>(nb, wg, x, out); break;
        case 3: tile<3, PER_SB>(nb, wg, x, out); break;
        default: tile<4, PER_SB>(nb, wg, x, out); break;
    }
}

}  // namespace

void q4k_x8_mul_avx2(int64_t K, const void *packed, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                     int64_t M, int64_t gemm_rows, float *y, int64_t ldy) {
    const int64_t nb = K / kQK;
    const auto *P = static_cast<const uint8_t *>(packed);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t g0 = r0 / 8 * 8; g0 < r1; g0 += 8) {
        const uint8_t *wg = P + (g0 / 8) * nb * q4k_x8_block_bytes;
        const int64_t lo = g0 < r0 ? r0 : g0, hi = g0 + 8 > r1 ? r1 : g0 + 8;  // rows to store
        for (int64_t m = 0; m < M;) {
            // A 4-row tile in GEMM order only if all of it is below gemm_rows; the rest in GEMV
            // order (whose per-row result does not depend on how many rows share the tile).
            const bool gemm = m + 4 <= gemm_rows;
            const int mb = static_cast<int>(gemm ? 4 : (M - m < 4 ? M - m : 4));
            const uint8_t *x[4];
            for (int j = 0; j < 4; ++j) x[j] = Xb + (m + (j < mb ? j : mb - 1)) * x_stride;
            float out[4][8];
            if (gemm) run_tile<true>(mb, nb, wg, x, out);
            else run_tile<false>(mb, nb, wg, x, out);
            for (int j = 0; j < mb; ++j)
                for (int64_t r = lo; r < hi; ++r) y[(m + j) * ldy + r] = out[j][r - g0];
            m += mb;
        }
    }
}

// Tiled-order q6_K (repack.h): per (row, super-block) the exact i32 sum, shared decode across 4
// activation rows; lanes are summed as integers, so only the two float steps are ordered.
void q6k_mul_tiled_avx2(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                        size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / kQK;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *wr = Wb + static_cast<size_t>(r) * w_stride;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mb = static_cast<int>(M - m0 < 4 ? M - m0 : 4);
            float acc[4] = {0, 0, 0, 0};
            for (int64_t b = 0; b < nb; ++b) {
                kdec t;
                tr_q6_k::decode(wr + b * tr_q6_k::size, t);
                for (int j = 0; j < mb; ++j) {
                    const uint8_t *xb = Xb + static_cast<size_t>(m0 + j) * x_stride + static_cast<size_t>(b) * kQ8kBytes;
                    __m256i s = _mm256_setzero_si256();
                    for (int c = 0; c < 8; ++c) {
                        const __m256i p = _mm256_maddubs_epi16(t.q[c], ld256(xb + 4 + 32 * c));
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, t.sc[c]));
                    }
                    s = _mm256_sub_epi32(s, _mm256_madd_epi16(t.mn, ld256(xb + 260)));  // the -32 offset
                    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
                    float da;
                    std::memcpy(&da, xb, 4);
                    const float res = t.d * static_cast<float>(_mm_cvtsi128_si32(h));
                    acc[j] = std::fma(res, da, acc[j]);
                }
            }
            for (int j = 0; j < mb; ++j) y[(m0 + j) * ldy + r] = acc[j];
        }
    }
}

}  // namespace fathom::cpu::detail
