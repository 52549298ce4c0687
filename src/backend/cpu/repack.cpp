// Q4_K 8-row repacking (layout in repack.h), its inverse, the scalar reference GEMV/GEMM over the
// repacked form (the same float operations, in the same order, as the AVX2 kernel in
// repack_avx2.cpp and llama.cpp's CPU_REPACK kernels), and the 4-row q8_K activation quantiser.
#include "backend/cpu/repack.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <string>

#include "backend/cpu/quants.h"
#include "core/error.h"

namespace fathom::cpu {
namespace {

constexpr int64_t kQK = 256;
constexpr size_t kQ4kBytes = 144;  // d, dmin (f16), scales[12], qs[128]
constexpr size_t kQ8kBytes = 292;  // f32 d, s8 qs[256], i16 bsums[16]
constexpr size_t kOffD = 0, kOffDmin = 16, kOffSc = 32, kOffMin = 96, kOffQs = 160;

// q4_K 12-byte scales -> 6-bit sc[8], m[8] (ggml's get_scale_min_k4).
void unpack_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for (int j = 4; j < 8; ++j) {
        sc[j] = static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        m[j] = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Inverse of unpack_scales (every bit of the 12 bytes is determined by sc/m).
void pack_scales(const uint8_t sc[8], const uint8_t m[8], uint8_t *s) {
    for (int j = 0; j < 4; ++j) {
        s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
        s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
}

void check_shape(int64_t K, int64_t N, const char *what) {
    if (K <= 0 || K % kQK != 0 || N <= 0 || N % 8 != 0)
        throw error(std::string(what) + ": q4_K repack needs K % 256 == 0 and N % 8 == 0, got K=" + std::to_string(K) +
                    " N=" + std::to_string(N));
}

// One output pair (acc, accm) of the scalar reference: weight row i (0..7) of the group block
// sequence wg, activation row xr, nb super-blocks, `per_sb` = GEMM order.
float ref_dot(int64_t nb, const uint8_t *wg, int i, const uint8_t *xr, bool per_sb) {
    float acc = 0.0f, accm = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wg + b * q4k_x8_block_bytes;
        const uint8_t *xb = xr + b * kQ8kBytes;
        uint16_t dh, mh;
        std::memcpy(&dh, blk + kOffD + 2 * i, 2);
        std::memcpy(&mh, blk + kOffDmin + 2 * i, 2);
        float da;
        std::memcpy(&da, xb, 4);
        const auto *aq = reinterpret_cast<const int8_t *>(xb + 4);
        int16_t bs[16];
        std::memcpy(bs, xb + 260, sizeof bs);
        const float dd = f16_to_f32(dh) * da, dm = f16_to_f32(mh) * da;
        int32_t isum_b = 0, imin_b = 0;
        for (int sb = 0; sb < 4; ++sb) {
            int32_t dot[2] = {0, 0};
            for (int g = 0; g < 8; ++g)
                for (int k = 0; k < 4; ++k) {
                    const uint8_t q = blk[kOffQs + 256 * sb + 32 * g + 4 * i + k];
                    dot[0] += (q & 0xF) * aq[64 * sb + 4 * g + k];
                    dot[1] += (q >> 4) * aq[64 * sb + 32 + 4 * g + k];
                }
            const int32_t isum = blk[kOffSc + 16 * sb + i] * dot[0] + blk[kOffSc + 16 * sb + 8 + i] * dot[1];
            const int32_t s0 = bs[4 * sb] + bs[4 * sb + 1], s1 = bs[4 * sb + 2] + bs[4 * sb + 3];
            const int32_t imin = blk[kOffMin + 16 * sb + i] * s0 + blk[kOffMin + 16 * sb + 8 + i] * s1;
            if (per_sb) {
                acc = std::fma(static_cast<float>(isum), dd, acc);
                accm = std::fma(static_cast<float>(imin), dm, accm);
            } else {
                isum_b += isum;
                imin_b += imin;
            }
        }
        if (!per_sb) {
            acc = std::fma(static_cast<float>(isum_b), dd, acc);
            accm = std::fma(static_cast<float>(imin_b), dm, accm);
        }
    }
    return acc - accm;
}

void q4k_x8_mul_scalar(int64_t K, const void *packed, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                       int64_t M, int64_t gemm_rows, float *y, int64_t ldy) {
    const int64_t nb = K / kQK;
    const auto *P = static_cast<const uint8_t *>(packed);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *wg = P + (r / 8) * nb * q4k_x8_block_bytes;
        for (int64_t m = 0; m < M; ++m)
            y[m * ldy + r] = ref_dot(nb, wg, static_cast<int>(r % 8), Xb + m * x_stride, m < gemm_rows);
    }
}

}  // namespace

size_t q4k_x8_bytes(int64_t K, int64_t N) {
    check_shape(K, N, "q4k_x8_bytes");
    return static_cast<size_t>(N / 8) * static_cast<size_t>(K / kQK) * q4k_x8_block_bytes;
}

void q4k_x8_repack(const void *src, size_t src_stride, int64_t K, int64_t N, void *dst) {
    check_shape(K, N, "q4k_x8_repack");
    const int64_t nb = K / kQK;
    const auto *S = static_cast<const uint8_t *>(src);
    auto *D = static_cast<uint8_t *>(dst);
    for (int64_t gi = 0; gi < N / 8; ++gi)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *blk = D + (gi * nb + b) * q4k_x8_block_bytes;
            for (int i = 0; i < 8; ++i) {
                const uint8_t *s = S + static_cast<size_t>(gi * 8 + i) * src_stride + static_cast<size_t>(b) * kQ4kBytes;
                std::memcpy(blk + kOffD + 2 * i, s, 2);
                std::memcpy(blk + kOffDmin + 2 * i, s + 2, 2);
                uint8_t sc[8], m[8];
                unpack_scales(s + 4, sc, m);
                for (int sb = 0; sb < 4; ++sb) {
                    blk[kOffSc + 16 * sb + i] = sc[2 * sb];
                    blk[kOffSc + 16 * sb + 8 + i] = sc[2 * sb + 1];
                    blk[kOffMin + 16 * sb + i] = m[2 * sb];
                    blk[kOffMin + 16 * sb + 8 + i] = m[2 * sb + 1];
                    for (int g = 0; g < 8; ++g)
                        std::memcpy(blk + kOffQs + 256 * sb + 32 * g + 4 * i, s + 16 + 32 * sb + 4 * g, 4);
                }
            }
        }
}

void q4k_x8_unpack(const void *packed, int64_t K, int64_t N, void *dst, size_t dst_stride) {
    check_shape(K, N, "q4k_x8_unpack");
    const int64_t nb = K / kQK;
    const auto *P = static_cast<const uint8_t *>(packed);
    auto *D = static_cast<uint8_t *>(dst);
    for (int64_t gi = 0; gi < N / 8; ++gi)
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = P + (gi * nb + b) * q4k_x8_block_bytes;
            for (int i = 0; i < 8; ++i) {
                uint8_t *d = D + static_cast<size_t>(gi * 8 + i) * dst_stride + static_cast<size_t>(b) * kQ4kBytes;
                std::memcpy(d, blk + kOffD + 2 * i, 2);
                std::memcpy(d + 2, blk + kOffDmin + 2 * i, 2);
                uint8_t sc[8], m[8];
                for (int sb = 0; sb < 4; ++sb) {
                    sc[2 * sb] = blk[kOffSc + 16 * sb + i];
                    sc[2 * sb + 1] = blk[kOffSc + 16 * sb + 8 + i];
                    m[2 * sb] = blk[kOffMin + 16 * sb + i];
                    m[2 * sb + 1] = blk[kOffMin + 16 * sb + 8 + i];
                    for (int g = 0; g < 8; ++g)
                        std::memcpy(d + 16 + 32 * sb + 4 * g, blk + kOffQs + 256 * sb + 32 * g + 4 * i, 4);
                }
                pack_scales(sc, m, d + 4);
            }
        }
}

void q4k_x8_mul(int64_t K, const void *packed, int64_t r0, int64_t r1, const void *X, size_t x_stride, int64_t M,
                int64_t gemm_rows, float *y, int64_t ldy) {
    if (K <= 0 || K % kQK != 0 || r0 < 0 || r1 < r0 || M < 0 || gemm_rows < 0 || gemm_rows % 4 != 0)
        throw error("q4k_x8_mul: bad arguments K=" + std::to_string(K) + " rows [" + std::to_string(r0) + ", " +
                    std::to_string(r1) + ") M=" + std::to_string(M) + " gemm_rows=" + std::to_string(gemm_rows));
    if (active_isa() == isa::scalar) q4k_x8_mul_scalar(K, packed, r0, r1, X, x_stride, M, gemm_rows, y, ldy);
    else detail::q4k_x8_mul_avx2(K, packed, r0, r1, X, x_stride, M, gemm_rows, y, ldy);
}

namespace {
// Exact integer sum_j sc_j * sum (q - 32) * a over one q6_K super-block (ggml's element order).
int32_t q6k_block_isum(const uint8_t *w, const uint8_t *xb) {
    const uint8_t *ql = w, *qh = w + 128;
    const auto *sc = reinterpret_cast<const int8_t *>(w + 192);
    const auto *a = reinterpret_cast<const int8_t *>(xb + 4);
    int32_t s = 0;
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
            const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + l + 32], hb = qh[32 * h + l];
            const int q[4] = {(lo0 & 0xF) | ((hb & 3) << 4), (lo1 & 0xF) | (((hb >> 2) & 3) << 4),
                              (lo0 >> 4) | (((hb >> 4) & 3) << 4), (lo1 >> 4) | (((hb >> 6) & 3) << 4)};
            for (int k = 0; k < 4; ++k) s += sc[8 * h + l / 16 + 2 * k] * (q[k] - 32) * a[128 * h + 32 * k + l];
        }
    return s;
}
}  // namespace

void q6k_mul_tiled(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
                   int64_t M, float *y, int64_t ldy) {
    if (K <= 0 || K % kQK != 0 || r0 < 0 || r1 < r0 || M < 0)
        throw error("q6k_mul_tiled: bad arguments K=" + std::to_string(K) + " rows [" + std::to_string(r0) + ", " +
                    std::to_string(r1) + ") M=" + std::to_string(M));
    if (active_isa() != isa::scalar) {
        detail::q6k_mul_tiled_avx2(K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
        return;
    }
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.0f;
            for (int64_t b = 0; b < K / kQK; ++b) {
                const uint8_t *w = Wb + static_cast<size_t>(r) * w_stride + static_cast<size_t>(b) * 210;
                const uint8_t *xb = Xb + static_cast<size_t>(m) * x_stride + static_cast<size_t>(b) * kQ8kBytes;
                uint16_t dh;
                std::memcpy(&dh, w + 208, 2);
                float da;
                std::memcpy(&da, xb, 4);
                const float res = f16_to_f32(dh) * static_cast<float>(q6k_block_isum(w, xb));
                acc = std::fma(res, da, acc);
            }
            y[m * ldy + r] = acc;
        }
}

void quantize_row_q8_k_x4(const float *x, void *dst, int64_t K) {
    if (K % kQK != 0) throw error("quantize_row_q8_k_x4: " + std::to_string(K) + " not a multiple of 256");
    auto *y = static_cast<uint8_t *>(dst);
    for (int64_t b = 0; b < K / kQK; ++b, x += kQK, y += kQ8kBytes) {
        float amax = 0.0f;
        for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
        bool pos = false;  // +amax occurs (ggml's maskAbs/finalMask)
        for (int j = 0; j < kQK; ++j) pos = pos || x[j] == amax;
        const float iscale = amax != 0.0f ? (pos ? -127.f : 127.f) / amax : 0.0f;
        const float d = amax != 0.0f ? 1 / iscale : 0.0f;
        std::memcpy(y, &d, 4);
        auto *q = reinterpret_cast<int8_t *>(y + 4);
        for (int j = 0; j < kQK; ++j) {
            // _mm256_round_ps(nearest) + cvtps_epi32 (out of range / NaN -> INT_MIN) + saturating packs.
            const float r = std::nearbyint(x[j] * iscale);
            const int v = (r >= -2147483648.0f && r < 2147483648.0f) ? static_cast<int>(r) : INT_MIN;
            q[j] = static_cast<int8_t>(std::clamp(v, -128, 127));
        }
        int16_t bs[16];
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int l = 0; l < 16; ++l) s += q[16 * g + l];
            bs[g] = static_cast<int16_t>(s);
        }
        std::memcpy(y + 260, bs, sizeof bs);
    }
}

}  // namespace fathom::cpu
