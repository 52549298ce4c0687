// Scalar reference kernels: f16/bf16 conversions, dequantisation and quantised dot products for
// every compute dtype. These define the numerics every ISA override must reproduce (up to float
// summation order): integer products inside a block, one float scale multiply per (sub-)block,
// exactly as ggml's reference dot products. Block layouts: quants_impl.h.
#include <cmath>
#include <cstring>

#include "backend/cpu/iq_tables.h"
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu {

// ---- f16 / bf16 conversions (exact, round-to-nearest-even) --------------------------------------
float f16_to_f32(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);  // inf / nan (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        // Subnormal: value = man * 2^-24; normalise.
        int e = -1;
        do {
            man <<= 1;
            ++e;
        } while ((man & 0x400) == 0);
        bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7FFFFFFF;
    if (ax > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00 | ((ax >> 13) & 0x3FF));  // nan
    if (ax >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to >= 65520: inf
    if (ax >= 0x38800000) {                                             // normal f16 range
        uint32_t r = ax - 0x38000000;  // rebias exponent (127 -> 15)
        uint32_t half = (r >> 13) + (((r & 0x1FFF) > 0x1000 || ((r & 0x1FFF) == 0x1000 && ((r >> 13) & 1))) ? 1 : 0);
        return static_cast<uint16_t>(sign | half);
    }
    if (ax < 0x33000000) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero
    // Subnormal f16: value / 2^-24, rounded to nearest even.
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7FFFFF) | 0x800000;
    const uint32_t shift = 126 - e;  // value = m * 2^(e-150) = (m >> shift) * 2^-24; shift in [14, 24]
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1))) ++q;
    return static_cast<uint16_t>(sign | q);
}

float bf16_to_f32(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t f32_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 64);  // quiet nan
    return static_cast<uint16_t>((static_cast<uint64_t>(x) + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

namespace detail {
namespace {

// ---- Dequantisation ----------------------------------------------------------------------------------
void dequant_f32(const void *src, float *dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
void dequant_f16(const void *src, float *dst, int64_t n) {
    const auto *s = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = fp16(s[i]);
}
void dequant_bf16(const void *src, float *dst, int64_t n) {
    const auto *s = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
}

void dequant_q4_0(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q4_0 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = fp16(x[i].d);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * ((x[i].qs[j] & 0xF) - 8);
            y[j + 16] = d * ((x[i].qs[j] >> 4) - 8);
        }
    }
}

void dequant_q4_1(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q4_1 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = fp16(x[i].d), m = fp16(x[i].m);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (x[i].qs[j] & 0xF) + m;
            y[j + 16] = d * (x[i].qs[j] >> 4) + m;
        }
    }
}

inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

void dequant_q5_0(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q5_0 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = fp16(x[i].d);
        const uint32_t qh = load_u32(x[i].qh);
        for (int j = 0; j < 16; ++j) {
            int lo = (x[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int hi = (x[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (lo - 16);
            y[j + 16] = d * (hi - 16);
        }
    }
}

void dequant_q5_1(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q5_1 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = fp16(x[i].d), m = fp16(x[i].m);
        const uint32_t qh = load_u32(x[i].qh);
        for (int j = 0; j < 16; ++j) {
            int lo = (x[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int hi = (x[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * lo + m;
            y[j + 16] = d * hi + m;
        }
    }
}

void dequant_q8_0(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q8_0 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = fp16(x[i].d);
        for (int j = 0; j < qk32; ++j) y[j] = d * x[i].qs[j];
    }
}

void dequant_q8_1(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q8_1 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = fp16(x[i].d);
        for (int j = 0; j < qk32; ++j) y[j] = d * x[i].qs[j];
    }
}

void dequant_mxfp4(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_mxfp4 *>(src);
    for (int64_t i = 0; i < n / qk32; ++i, y += qk32) {
        const float d = e8m0_to_fp32_half(x[i].e);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * kvalues_mxfp4[x[i].qs[j] & 0xF];
            y[j + 16] = d * kvalues_mxfp4[x[i].qs[j] >> 4];
        }
    }
}

// q2_k: 16 sub-blocks of 16; element (chunk c of 128, shift group j, l < 32) = bits 2j of qs[32c + l].
void dequant_q2_k(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q2_k *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i) {
        const float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        for (int c = 0; c < 2; ++c) {
            const uint8_t *q = x[i].qs + 32 * c;
            for (int j = 0; j < 4; ++j) {
                for (int l = 0; l < 32; ++l) {
                    const uint8_t sc = x[i].scales[8 * c + 2 * j + l / 16];
                    *y++ = d * (sc & 0xF) * ((q[l] >> (2 * j)) & 3) - dmin * (sc >> 4);
                }
            }
        }
    }
}

void dequant_q3_k(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q3_k *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i) {
        const float d = fp16(x[i].d);
        for (int c = 0; c < 2; ++c) {
            const uint8_t *q = x[i].qs + 32 * c;
            for (int j = 0; j < 4; ++j) {
                const uint8_t m = static_cast<uint8_t>(1u << (4 * c + j));
                for (int l = 0; l < 32; ++l) {
                    const float dl = d * q3k_scale(x[i].scales, 8 * c + 2 * j + l / 16);
                    const int v = ((q[l] >> (2 * j)) & 3) - ((x[i].hmask[l] & m) ? 0 : 4);
                    *y++ = dl * v;
                }
            }
        }
    }
}

void dequant_q4_k(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q4_k *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i) {
        const float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        for (int c = 0; c < 4; ++c) {  // 64 elements: low nibbles then high nibbles of 32 bytes
            const uint8_t *q = x[i].qs + 32 * c;
            uint8_t sc0, m0, sc1, m1;
            get_scale_min_k4(2 * c, x[i].scales, sc0, m0);
            get_scale_min_k4(2 * c + 1, x[i].scales, sc1, m1);
            for (int l = 0; l < 32; ++l) *y++ = d * sc0 * (q[l] & 0xF) - dmin * m0;
            for (int l = 0; l < 32; ++l) *y++ = d * sc1 * (q[l] >> 4) - dmin * m1;
        }
    }
}

void dequant_q5_k(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q5_k *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i) {
        const float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        for (int c = 0; c < 4; ++c) {
            const uint8_t *q = x[i].qs + 32 * c;
            uint8_t sc0, m0, sc1, m1;
            get_scale_min_k4(2 * c, x[i].scales, sc0, m0);
            get_scale_min_k4(2 * c + 1, x[i].scales, sc1, m1);
            for (int l = 0; l < 32; ++l)
                *y++ = d * sc0 * ((q[l] & 0xF) + (((x[i].qh[l] >> (2 * c)) & 1) << 4)) - dmin * m0;
            for (int l = 0; l < 32; ++l)
                *y++ = d * sc1 * ((q[l] >> 4) + (((x[i].qh[l] >> (2 * c + 1)) & 1) << 4)) - dmin * m1;
        }
    }
}

// q6_k value k (< 256) as a signed integer in [-32, 31], and its sub-block scale index.
inline int q6k_value(const block_q6_k &b, int k) {
    const int c = k / 128, r = k % 128, g = r / 32, l = r % 32;  // g: which of the 4 planes
    const uint8_t lo = b.ql[64 * c + l + 32 * (g & 1)];
    const int low4 = (g < 2) ? (lo & 0xF) : (lo >> 4);
    const int high2 = (b.qh[32 * c + l] >> (2 * g)) & 3;
    return (low4 | (high2 << 4)) - 32;
}

void dequant_q6_k(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q6_k *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i) {
        const float d = fp16(x[i].d);
        for (int k = 0; k < qk_k; ++k) *y++ = d * x[i].scales[k / 16] * q6k_value(x[i], k);
    }
}

void dequant_q8_k(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_q8_k *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i)
        for (int k = 0; k < qk_k; ++k) *y++ = x[i].d * x[i].qs[k];
}

// iq2_xxs: 8 groups of 32; per group two u32: (4 grid indices) and (4 x 7-bit sign codes | 4-bit scale).
void dequant_iq2_xxs(const void *src, float *y, int64_t n) {
    const auto *x = static_cast<const block_iq2_xxs *>(src);
    for (int64_t i = 0; i < n / qk_k; ++i) {
        const float d = fp16(x[i].d);
        for (int g = 0; g < 8; ++g) {
            uint32_t aux[2];
            std::memcpy(aux, x[i].qs + 4 * g, 8);
            const float db = d * (0.5f + static_cast<float>(aux[1] >> 28)) * 0.25f;
            for (int l = 0; l < 4; ++l) {
                const uint8_t *grid = iq2xxs_grid_bytes((aux[0] >> (8 * l)) & 0xFF);
                const uint8_t signs = ksigns_iq2xs[(aux[1] >> (7 * l)) & 127];
                for (int j = 0; j < 8; ++j) *y++ = db * grid[j] * ((signs >> j) & 1 ? -1.f : 1.f);
            }
        }
    }
}

// ---- Dot products (weight row x activation row of vec_dot_type) -------------------------------------
float dot_f32(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const float *>(w), *y = static_cast<const float *>(a);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * y[i];
    return static_cast<float>(s);
}
float dot_f16(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const uint16_t *>(w), *y = static_cast<const uint16_t *>(a);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(fp16(x[i])) * fp16(y[i]);
    return static_cast<float>(s);
}
float dot_bf16(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const uint16_t *>(w), *y = static_cast<const uint16_t *>(a);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(bf16_to_f32(x[i])) * bf16_to_f32(y[i]);
    return static_cast<float>(s);
}

float dot_q4_0(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q4_0 *>(w);
    const auto *y = static_cast<const block_q8_0 *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk32; ++i) {
        int sum = 0;
        for (int j = 0; j < 16; ++j)
            sum += ((x[i].qs[j] & 0xF) - 8) * y[i].qs[j] + ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + 16];
        s += sum * fp16(x[i].d) * fp16(y[i].d);
    }
    return s;
}

float dot_q4_1(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q4_1 *>(w);
    const auto *y = static_cast<const block_q8_1 *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk32; ++i) {
        int sum = 0;
        for (int j = 0; j < 16; ++j) sum += (x[i].qs[j] & 0xF) * y[i].qs[j] + (x[i].qs[j] >> 4) * y[i].qs[j + 16];
        s += sum * fp16(x[i].d) * fp16(y[i].d) + fp16(x[i].m) * fp16(y[i].s);
    }
    return s;
}

float dot_q5_0(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q5_0 *>(w);
    const auto *y = static_cast<const block_q8_0 *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk32; ++i) {
        const uint32_t qh = load_u32(x[i].qh);
        int sum = 0;
        for (int j = 0; j < 16; ++j) {
            int lo = ((x[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16;
            int hi = ((x[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            sum += lo * y[i].qs[j] + hi * y[i].qs[j + 16];
        }
        s += sum * fp16(x[i].d) * fp16(y[i].d);
    }
    return s;
}

float dot_q5_1(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q5_1 *>(w);
    const auto *y = static_cast<const block_q8_1 *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk32; ++i) {
        const uint32_t qh = load_u32(x[i].qh);
        int sum = 0;
        for (int j = 0; j < 16; ++j) {
            int lo = (x[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int hi = (x[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            sum += lo * y[i].qs[j] + hi * y[i].qs[j + 16];
        }
        s += sum * fp16(x[i].d) * fp16(y[i].d) + fp16(x[i].m) * fp16(y[i].s);
    }
    return s;
}

float dot_q8_0(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q8_0 *>(w);
    const auto *y = static_cast<const block_q8_0 *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk32; ++i) {
        int sum = 0;
        for (int j = 0; j < qk32; ++j) sum += x[i].qs[j] * y[i].qs[j];
        s += sum * fp16(x[i].d) * fp16(y[i].d);
    }
    return s;
}

float dot_mxfp4(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_mxfp4 *>(w);
    const auto *y = static_cast<const block_q8_0 *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk32; ++i) {
        int sum = 0;
        for (int j = 0; j < 16; ++j)
            sum += kvalues_mxfp4[x[i].qs[j] & 0xF] * y[i].qs[j] + kvalues_mxfp4[x[i].qs[j] >> 4] * y[i].qs[j + 16];
        s += sum * (e8m0_to_fp32_half(x[i].e) * fp16(y[i].d));
    }
    return s;
}

// k-quants: the weight super-block is expanded to integers q[256] and per-16 integer scales, then
// dotted with the q8_k integers; mins use q8_k's precomputed 16-element sums (bsums).
float dot_q2_k(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q2_k *>(w);
    const auto *y = static_cast<const block_q8_k *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk_k; ++i) {
        int sumq = 0, summ = 0;
        for (int c = 0; c < 2; ++c)
            for (int j = 0; j < 4; ++j)
                for (int h = 0; h < 2; ++h) {
                    const int sb = 8 * c + 2 * j + h;
                    int acc = 0;
                    for (int l = 16 * h; l < 16 * h + 16; ++l)
                        acc += ((x[i].qs[32 * c + l] >> (2 * j)) & 3) * y[i].qs[128 * c + 32 * j + l];
                    sumq += (x[i].scales[sb] & 0xF) * acc;
                    summ += (x[i].scales[sb] >> 4) * y[i].bsums[sb];
                }
        s += y[i].d * (fp16(x[i].d) * sumq - fp16(x[i].dmin) * summ);
    }
    return s;
}

float dot_q3_k(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q3_k *>(w);
    const auto *y = static_cast<const block_q8_k *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk_k; ++i) {
        int sumq = 0;
        for (int c = 0; c < 2; ++c)
            for (int j = 0; j < 4; ++j) {
                const uint8_t m = static_cast<uint8_t>(1u << (4 * c + j));
                for (int h = 0; h < 2; ++h) {
                    int acc = 0;
                    for (int l = 16 * h; l < 16 * h + 16; ++l) {
                        const int v = ((x[i].qs[32 * c + l] >> (2 * j)) & 3) - ((x[i].hmask[l] & m) ? 0 : 4);
                        acc += v * y[i].qs[128 * c + 32 * j + l];
                    }
                    sumq += q3k_scale(x[i].scales, 8 * c + 2 * j + h) * acc;
                }
            }
        s += y[i].d * fp16(x[i].d) * sumq;
    }
    return s;
}

float dot_q4_k(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q4_k *>(w);
    const auto *y = static_cast<const block_q8_k *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk_k; ++i) {
        int sumq = 0, summ = 0;
        for (int sb = 0; sb < 8; ++sb) {  // 32-element sub-blocks
            uint8_t sc, m;
            get_scale_min_k4(sb, x[i].scales, sc, m);
            const uint8_t *q = x[i].qs + 32 * (sb / 2);
            const int shift = 4 * (sb & 1);
            int acc = 0;
            for (int l = 0; l < 32; ++l) acc += ((q[l] >> shift) & 0xF) * y[i].qs[32 * sb + l];
            sumq += sc * acc;
            summ += m * (y[i].bsums[2 * sb] + y[i].bsums[2 * sb + 1]);
        }
        s += y[i].d * (fp16(x[i].d) * sumq - fp16(x[i].dmin) * summ);
    }
    return s;
}

float dot_q5_k(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q5_k *>(w);
    const auto *y = static_cast<const block_q8_k *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk_k; ++i) {
        int sumq = 0, summ = 0;
        for (int sb = 0; sb < 8; ++sb) {
            uint8_t sc, m;
            get_scale_min_k4(sb, x[i].scales, sc, m);
            const uint8_t *q = x[i].qs + 32 * (sb / 2);
            const int shift = 4 * (sb & 1);
            int acc = 0;
            for (int l = 0; l < 32; ++l) {
                const int v = ((q[l] >> shift) & 0xF) | (((x[i].qh[l] >> sb) & 1) << 4);
                acc += v * y[i].qs[32 * sb + l];
            }
            sumq += sc * acc;
            summ += m * (y[i].bsums[2 * sb] + y[i].bsums[2 * sb + 1]);
        }
        s += y[i].d * (fp16(x[i].d) * sumq - fp16(x[i].dmin) * summ);
    }
    return s;
}

float dot_q6_k(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_q6_k *>(w);
    const auto *y = static_cast<const block_q8_k *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk_k; ++i) {
        int sumq = 0;
        for (int sb = 0; sb < 16; ++sb) {
            int acc = 0;
            for (int k = 16 * sb; k < 16 * sb + 16; ++k) acc += q6k_value(x[i], k) * y[i].qs[k];
            sumq += x[i].scales[sb] * acc;
        }
        s += y[i].d * fp16(x[i].d) * sumq;
    }
    return s;
}

float dot_iq2_xxs(int64_t n, const void *w, const void *a) {
    const auto *x = static_cast<const block_iq2_xxs *>(w);
    const auto *y = static_cast<const block_q8_k *>(a);
    float s = 0;
    for (int64_t i = 0; i < n / qk_k; ++i) {
        int sumq = 0;
        for (int g = 0; g < 8; ++g) {
            uint32_t aux[2];
            std::memcpy(aux, x[i].qs + 4 * g, 8);
            int acc = 0;
            for (int l = 0; l < 4; ++l) {
                const uint8_t *grid = iq2xxs_grid_bytes((aux[0] >> (8 * l)) & 0xFF);
                const uint8_t signs = ksigns_iq2xs[(aux[1] >> (7 * l)) & 127];
                for (int j = 0; j < 8; ++j) {
                    const int v = grid[j] * y[i].qs[32 * g + 8 * l + j];
                    acc += (signs >> j) & 1 ? -v : v;
                }
            }
            sumq += static_cast<int>(2 * (aux[1] >> 28) + 1) * acc;  // (0.5 + ls) * 2
        }
        s += 0.125f * fp16(x[i].d) * y[i].d * sumq;  // * 0.25 / 2
    }
    return s;
}

}  // namespace

void fill_quantizers(kernel_table &t);  // quants_quantize.cpp

void fill_generic(kernel_table &t) {
    t.dequant[slot(dtype::f32)] = dequant_f32;
    t.dequant[slot(dtype::f16)] = dequant_f16;
    t.dequant[slot(dtype::bf16)] = dequant_bf16;
    t.dequant[slot(dtype::q4_0)] = dequant_q4_0;
    t.dequant[slot(dtype::q4_1)] = dequant_q4_1;
    t.dequant[slot(dtype::q5_0)] = dequant_q5_0;
    t.dequant[slot(dtype::q5_1)] = dequant_q5_1;
    t.dequant[slot(dtype::q8_0)] = dequant_q8_0;
    t.dequant[slot(dtype::q8_1)] = dequant_q8_1;
    t.dequant[slot(dtype::mxfp4)] = dequant_mxfp4;
    t.dequant[slot(dtype::q2_k)] = dequant_q2_k;
    t.dequant[slot(dtype::q3_k)] = dequant_q3_k;
    t.dequant[slot(dtype::q4_k)] = dequant_q4_k;
    t.dequant[slot(dtype::q5_k)] = dequant_q5_k;
    t.dequant[slot(dtype::q6_k)] = dequant_q6_k;
    t.dequant[slot(dtype::q8_k)] = dequant_q8_k;
    t.dequant[slot(dtype::iq2_xxs)] = dequant_iq2_xxs;

    t.dot[slot(dtype::f32)] = dot_f32;
    t.dot[slot(dtype::f16)] = dot_f16;
    t.dot[slot(dtype::bf16)] = dot_bf16;
    t.dot[slot(dtype::q4_0)] = dot_q4_0;
    t.dot[slot(dtype::q4_1)] = dot_q4_1;
    t.dot[slot(dtype::q5_0)] = dot_q5_0;
    t.dot[slot(dtype::q5_1)] = dot_q5_1;
    t.dot[slot(dtype::q8_0)] = dot_q8_0;
    t.dot[slot(dtype::mxfp4)] = dot_mxfp4;
    t.dot[slot(dtype::q2_k)] = dot_q2_k;
    t.dot[slot(dtype::q3_k)] = dot_q3_k;
    t.dot[slot(dtype::q4_k)] = dot_q4_k;
    t.dot[slot(dtype::q5_k)] = dot_q5_k;
    t.dot[slot(dtype::q6_k)] = dot_q6_k;
    t.dot[slot(dtype::iq2_xxs)] = dot_iq2_xxs;

    fill_quantizers(t);
}

}  // namespace detail
}  // namespace fathom::cpu
