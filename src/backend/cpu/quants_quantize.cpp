// Scalar quantisers (float -> blocks).
//  - Activation types (q8_0, q8_1, q8_k, f16, bf16, f32): ggml's reference rounding, bit-exact.
//  - q4_0, q4_1, q5_0, q5_1, mxfp4: bit-exact with gguf-py's quantize (= ggml's *_ref functions).
//  - k-quants and iq2_xxs: simple round-to-nearest reference quantisers (no error-minimising
//    search like ggml's make_qkx2_quants); valid blocks whose dequantisation is close to the input.
// Not on hot paths: used by writers, tests, and activation conversion before a dot product.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "backend/cpu/iq_tables.h"
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu::detail {
namespace {

// First element of largest magnitude, with its sign (ggml's amax/max scan).
inline float signed_absmax(const float *x, int n) {
    float amax = 0, mx = 0;
    for (int j = 0; j < n; ++j)
        if (amax < std::fabs(x[j])) {
            amax = std::fabs(x[j]);
            mx = x[j];
        }
    return mx;
}

inline int nearest_int(float v) { return static_cast<int>(std::nearbyint(v)); }  // half to even

// ---- Plain types ---------------------------------------------------------------------------------
void quant_f32(const float *x, void *dst, int64_t n) { std::memcpy(dst, x, n * sizeof(float)); }
void quant_f16(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<uint16_t *>(dst);
    for (int64_t i = 0; i < n; ++i) y[i] = f32_to_f16(x[i]);
}
void quant_bf16(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<uint16_t *>(dst);
    for (int64_t i = 0; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}

// ---- Activation types ----------------------------------------------------------------------------
// q8_0: d = amax/127, q = roundf(x/d) (half away from zero).
void quant_q8_0(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_0 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float amax = 0;
        for (int j = 0; j < qk32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        y[i].d = f32_to_f16(d);
        for (int j = 0; j < qk32; ++j) y[i].qs[j] = static_cast<int8_t>(std::roundf(x[j] * id));
    }
}

// q8_1: as q8_0, plus s = d * sum(q) stored as f16.
void quant_q8_1(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_1 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float amax = 0;
        for (int j = 0; j < qk32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < qk32; ++j) {
            y[i].qs[j] = static_cast<int8_t>(std::roundf(x[j] * id));
            sum += y[i].qs[j];
        }
        y[i].d = f32_to_f16(d);
        y[i].s = f32_to_f16(static_cast<float>(sum) * d);
    }
}

// ggml-cpu's x86 activation conversion (quantize_row_q8_0/q8_1 with AVX/AVX2): same d, but the
// multiplier is 127/amax (not 1/d) and rounding is half to even. llama.cpp feeds its dot products
// with these, so the fast mul_mat uses them to reproduce llama.cpp's activations bit for bit.
void quant_q8_0_act(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_0 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float amax = 0;
        for (int j = 0; j < qk32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float id = amax != 0 ? 127.f / amax : 0.0f;
        y[i].d = f32_to_f16(amax / 127.f);
        for (int j = 0; j < qk32; ++j) y[i].qs[j] = static_cast<int8_t>(nearest_int(x[j] * id));
    }
}

void quant_q8_1_act(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_1 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float amax = 0;
        for (int j = 0; j < qk32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < qk32; ++j) {
            y[i].qs[j] = static_cast<int8_t>(nearest_int(x[j] * id));
            sum += y[i].qs[j];
        }
        y[i].d = f32_to_f16(d);
        y[i].s = f32_to_f16(static_cast<float>(sum) * d);
    }
}

// q8_k: iscale = -127/max (max signed), q = min(127, nearest_int(iscale*x)), d = 1/iscale.
void quant_q8_k(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q8_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        const float mx = signed_absmax(x, qk_k);
        if (mx == 0) {
            std::memset(&y[i], 0, sizeof(block_q8_k));
            continue;
        }
        const float iscale = -127.f / mx;
        for (int j = 0; j < qk_k; ++j) y[i].qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
        for (int j = 0; j < qk_k / 16; ++j) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * j + l];
            y[i].bsums[j] = static_cast<int16_t>(sum);
        }
        y[i].d = 1 / iscale;
    }
}

// ---- 32-element weight types (match gguf-py / ggml reference) ------------------------------------
void quant_q4_0(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q4_0 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        const float d = signed_absmax(x, qk32) / -8;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        y[i].d = f32_to_f16(d);
        for (int j = 0; j < 16; ++j) {
            const int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
            const int q1 = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
            y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

void quant_q4_1(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q4_1 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float mn = x[0], mx = x[0];
        for (int j = 1; j < qk32; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
        const float d = (mx - mn) / 15;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        y[i].d = f32_to_f16(d);
        y[i].m = f32_to_f16(mn);
        for (int j = 0; j < 16; ++j) {
            const int q0 = std::min(15, static_cast<int>((x[j] - mn) * id + 0.5f));
            const int q1 = std::min(15, static_cast<int>((x[j + 16] - mn) * id + 0.5f));
            y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

// Packs 32 5-bit values into q5 nibbles + high-bit word.
inline void pack_q5(const int *q, uint8_t *qs, uint8_t *qh_bytes) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
        qs[j] = static_cast<uint8_t>((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
        qh |= static_cast<uint32_t>(q[j] >> 4) << j;
        qh |= static_cast<uint32_t>(q[j + 16] >> 4) << (j + 16);
    }
    std::memcpy(qh_bytes, &qh, 4);
}

void quant_q5_0(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q5_0 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        const float d = signed_absmax(x, qk32) / -16;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        int q[qk32];
        for (int j = 0; j < qk32; ++j) q[j] = std::min(31, static_cast<int>(x[j] * id + 16.5f));
        y[i].d = f32_to_f16(d);
        pack_q5(q, y[i].qs, y[i].qh);
    }
}

void quant_q5_1(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q5_1 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float mn = x[0], mx = x[0];
        for (int j = 1; j < qk32; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
        const float d = (mx - mn) / 31;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        int q[qk32];
        for (int j = 0; j < qk32; ++j) q[j] = std::min(31, static_cast<int>((x[j] - mn) * id + 0.5f));
        y[i].d = f32_to_f16(d);
        y[i].m = f32_to_f16(mn);
        pack_q5(q, y[i].qs, y[i].qh);
    }
}

// mxfp4 (gguf-py): e = floor(log2(amax)) - 2 + 127, then each value takes the nearest e2m1 code.
void quant_mxfp4(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_mxfp4 *>(dst);
    for (int64_t i = 0; i < n / qk32; ++i, x += qk32) {
        float amax = 0;
        for (int j = 0; j < qk32; ++j) amax = std::max(amax, std::fabs(x[j]));
        int e = 0;
        if (amax > 0) {
            int k;
            std::frexp(amax, &k);  // amax = f * 2^k, f in [0.5, 1): floor(log2(amax)) = k - 1
            e = std::clamp(k - 1 - 2 + 127, 0, 254);
        }
        y[i].e = static_cast<uint8_t>(e);
        const float d = e8m0_to_fp32_half(y[i].e);
        uint8_t code[qk32];
        for (int j = 0; j < qk32; ++j) {
            int best = 0;
            float best_err = std::fabs(d * kvalues_mxfp4[0] - x[j]);
            for (int c = 1; c < 16; ++c) {
                const float err = std::fabs(d * kvalues_mxfp4[c] - x[j]);
                if (err < best_err) best_err = err, best = c;
            }
            code[j] = static_cast<uint8_t>(best);
        }
        for (int j = 0; j < 16; ++j) y[i].qs[j] = static_cast<uint8_t>(code[j] | (code[j + 16] << 4));
    }
}

// ---- k-quants: round-to-nearest reference quantisers --------------------------------------------
// Asymmetric sub-blocks (q2_k, q4_k, q5_k): x ~= d*sc*q - dmin*m, with q in [0, nq], sc/m in
// [0, nsc]. Writes integer q[256], sc[], m[] and the two float super-scales.
void asym_subblocks(const float *x, int sub, int nq, int nsc, int *q, int *sc, int *m, float &d,
                    float &dmin) {
    const int nsub = qk_k / sub;
    float scale[16], minv[16];
    float max_scale = 0, max_min = 0;
    for (int s = 0; s < nsub; ++s) {
        float lo = 0, hi = x[s * sub];  // the min is clamped to <= 0 (m >= 0)
        for (int j = 0; j < sub; ++j) lo = std::min(lo, x[s * sub + j]), hi = std::max(hi, x[s * sub + j]);
        scale[s] = (hi - lo) / nq;
        minv[s] = -lo;
        max_scale = std::max(max_scale, scale[s]);
        max_min = std::max(max_min, minv[s]);
    }
    d = fp16(f32_to_f16(max_scale / nsc));  // use the values the block will store
    dmin = fp16(f32_to_f16(max_min / nsc));
    for (int s = 0; s < nsub; ++s) {
        sc[s] = d > 0 ? std::clamp(nearest_int(scale[s] / d), 0, nsc) : 0;
        m[s] = dmin > 0 ? std::clamp(nearest_int(minv[s] / dmin), 0, nsc) : 0;
        const float ds = d * sc[s], dm = dmin * m[s];
        for (int j = 0; j < sub; ++j)
            q[s * sub + j] = ds > 0 ? std::clamp(nearest_int((x[s * sub + j] + dm) / ds), 0, nq) : 0;
    }
}

// Symmetric sub-blocks of 16 (q3_k, q6_k): x ~= d*sc*q, q in [-qmax-1, qmax], sc in [-nsc, nsc].
void sym_subblocks(const float *x, int qmax, int nsc, int *q, int *sc, float &d) {
    float scale[16], max_abs = 0;
    for (int s = 0; s < 16; ++s) {
        scale[s] = signed_absmax(x + 16 * s, 16) / -(qmax + 1);
        max_abs = std::max(max_abs, std::fabs(scale[s]));
    }
    d = fp16(f32_to_f16(max_abs / nsc));
    for (int s = 0; s < 16; ++s) {
        sc[s] = d > 0 ? std::clamp(nearest_int(scale[s] / d), -nsc, nsc) : 0;
        const float ds = d * sc[s];
        for (int j = 0; j < 16; ++j)
            q[16 * s + j] = ds != 0 ? std::clamp(nearest_int(x[16 * s + j] / ds), -qmax - 1, qmax) : 0;
    }
}

void quant_q2_k(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q2_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        int q[qk_k], sc[16], m[16];
        float d, dmin;
        asym_subblocks(x, 16, 3, 15, q, sc, m, d, dmin);
        std::memset(&y[i], 0, sizeof(block_q2_k));
        for (int s = 0; s < 16; ++s) y[i].scales[s] = static_cast<uint8_t>(sc[s] | (m[s] << 4));
        for (int k = 0; k < qk_k; ++k) {  // k = 128c + 32j + l -> bits 2j of qs[32c + l]
            const int c = k / 128, j = (k % 128) / 32, l = k % 32;
            y[i].qs[32 * c + l] |= static_cast<uint8_t>(q[k] << (2 * j));
        }
        y[i].d = f32_to_f16(d);
        y[i].dmin = f32_to_f16(dmin);
    }
}

void quant_q3_k(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q3_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        int q[qk_k], sc[16];
        float d;
        sym_subblocks(x, 3, 31, q, sc, d);
        std::memset(&y[i], 0, sizeof(block_q3_k));
        for (int s = 0; s < 16; ++s) {
            const int v = sc[s] + 32;  // 6-bit biased scale
            if (s < 8) y[i].scales[s] |= static_cast<uint8_t>(v & 0xF);
            else y[i].scales[s - 8] |= static_cast<uint8_t>((v & 0xF) << 4);
            y[i].scales[8 + s % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (s / 4)));
        }
        for (int k = 0; k < qk_k; ++k) {
            const int c = k / 128, j = (k % 128) / 32, l = k % 32, u = q[k] + 4;
            y[i].qs[32 * c + l] |= static_cast<uint8_t>((u & 3) << (2 * j));
            if (u >> 2) y[i].hmask[l] |= static_cast<uint8_t>(1u << (4 * c + j));
        }
        y[i].d = f32_to_f16(d);
    }
}

// Inverse of get_scale_min_k4 for 8 (scale, min) pairs of 6 bits.
void pack_scale_min_k4(const int *sc, const int *m, uint8_t *s) {
    std::memset(s, 0, 12);
    for (int j = 0; j < 4; ++j) {
        s[j] = static_cast<uint8_t>(sc[j]);
        s[j + 4] = static_cast<uint8_t>(m[j]);
    }
    for (int j = 4; j < 8; ++j) {
        s[j + 4] = static_cast<uint8_t>((sc[j] & 0xF) | ((m[j] & 0xF) << 4));
        s[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
        s[j] |= static_cast<uint8_t>((m[j] >> 4) << 6);
    }
}

void quant_q4_k(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q4_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        int q[qk_k], sc[8], m[8];
        float d, dmin;
        asym_subblocks(x, 32, 15, 63, q, sc, m, d, dmin);
        pack_scale_min_k4(sc, m, y[i].scales);
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l)
                y[i].qs[32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
        y[i].d = f32_to_f16(d);
        y[i].dmin = f32_to_f16(dmin);
    }
}

void quant_q5_k(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q5_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        int q[qk_k], sc[8], m[8];
        float d, dmin;
        asym_subblocks(x, 32, 31, 63, q, sc, m, d, dmin);
        pack_scale_min_k4(sc, m, y[i].scales);
        std::memset(y[i].qh, 0, sizeof(y[i].qh));
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
                const int a = q[64 * c + l], b = q[64 * c + 32 + l];
                y[i].qs[32 * c + l] = static_cast<uint8_t>((a & 0xF) | ((b & 0xF) << 4));
                y[i].qh[l] |= static_cast<uint8_t>(((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1)));
            }
        y[i].d = f32_to_f16(d);
        y[i].dmin = f32_to_f16(dmin);
    }
}

void quant_q6_k(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_q6_k *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        int q[qk_k], sc[16];
        float d;
        sym_subblocks(x, 31, 127, q, sc, d);
        std::memset(&y[i], 0, sizeof(block_q6_k));
        for (int s = 0; s < 16; ++s) y[i].scales[s] = static_cast<int8_t>(sc[s]);
        for (int k = 0; k < qk_k; ++k) {
            const int c = k / 128, r = k % 128, g = r / 32, l = r % 32, u = q[k] + 32;
            y[i].ql[64 * c + l + 32 * (g & 1)] |= static_cast<uint8_t>((u & 0xF) << (g < 2 ? 0 : 4));
            y[i].qh[32 * c + l] |= static_cast<uint8_t>((u >> 4) << (2 * g));
        }
        y[i].d = f32_to_f16(d);
    }
}

// iq2_xxs: per 32-group a 4-bit scale, per 8 values a grid point (nearest in L2) and an even-parity
// sign pattern (an odd number of negatives flips the smallest magnitude, the cheapest error).
void quant_iq2_xxs_group(const float *x, float db, uint32_t aux[2]) {
    for (int l = 0; l < 4; ++l) {
        const float *v = x + 8 * l;
        uint32_t signs = 0;
        int smallest = 0;
        for (int j = 0; j < 8; ++j) {
            if (v[j] < 0) signs |= 1u << j;
            if (std::fabs(v[j]) < std::fabs(v[smallest])) smallest = j;
        }
        if (std::popcount(signs) & 1) signs ^= 1u << smallest;
        int best = 0;
        float best_err = INFINITY;
        for (int g = 0; g < 256; ++g) {
            float err = 0;
            for (int j = 0; j < 8; ++j) {
                const float t = std::fabs(v[j]) - db * iq2xxs_grid[g][j];
                err += t * t;
            }
            if (err < best_err) best_err = err, best = g;
        }
        aux[0] |= static_cast<uint32_t>(best) << (8 * l);
        aux[1] |= (signs & 127u) << (7 * l);
    }
}

void quant_iq2_xxs(const float *x, void *dst, int64_t n) {
    auto *y = static_cast<block_iq2_xxs *>(dst);
    for (int64_t i = 0; i < n / qk_k; ++i, x += qk_k) {
        float want[8], max_db = 0;  // want: group scale mapping the group's max |x| to grid value 43
        for (int g = 0; g < 8; ++g) {
            float amax = 0;
            for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * g + j]));
            want[g] = amax / 43;
            max_db = std::max(max_db, want[g]);
        }
        const float d = fp16(f32_to_f16(max_db / (15.5f * 0.25f)));
        y[i].d = f32_to_f16(d);
        for (int g = 0; g < 8; ++g) {
            const int ls = d > 0 ? std::clamp(nearest_int(want[g] / (d * 0.25f) - 0.5f), 0, 15) : 0;
            uint32_t aux[2] = {0, static_cast<uint32_t>(ls) << 28};
            quant_iq2_xxs_group(x + 32 * g, d * (0.5f + ls) * 0.25f, aux);
            std::memcpy(y[i].qs + 4 * g, aux, 8);
        }
    }
}

}  // namespace

void fill_quantizers(kernel_table &t) {
    t.quant[slot(dtype::f32)] = quant_f32;
    t.quant[slot(dtype::f16)] = quant_f16;
    t.quant[slot(dtype::bf16)] = quant_bf16;
    t.quant[slot(dtype::q8_0)] = quant_q8_0;
    t.quant[slot(dtype::q8_1)] = quant_q8_1;
    t.quant_act[slot(dtype::q8_0)] = quant_q8_0_act;
    t.quant_act[slot(dtype::q8_1)] = quant_q8_1_act;
    t.quant[slot(dtype::q8_k)] = quant_q8_k;
    t.quant[slot(dtype::q4_0)] = quant_q4_0;
    t.quant[slot(dtype::q4_1)] = quant_q4_1;
    t.quant[slot(dtype::q5_0)] = quant_q5_0;
    t.quant[slot(dtype::q5_1)] = quant_q5_1;
    t.quant[slot(dtype::mxfp4)] = quant_mxfp4;
    t.quant[slot(dtype::q2_k)] = quant_q2_k;
    t.quant[slot(dtype::q3_k)] = quant_q3_k;
    t.quant[slot(dtype::q4_k)] = quant_q4_k;
    t.quant[slot(dtype::q5_k)] = quant_q5_k;
    t.quant[slot(dtype::q6_k)] = quant_q6_k;
    t.quant[slot(dtype::iq2_xxs)] = quant_iq2_xxs;
}

}  // namespace fathom::cpu::detail
