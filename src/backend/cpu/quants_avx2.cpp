// AVX2 kernels for the 32-element block types (q4_0, q4_1, q5_0, q5_1, q8_0, mxfp4) against q8_0 /
// q8_1 activations, and for f32 / f16 / bf16. k-quants live in quants_kquants_avx2.cpp.
//
// GEMM tile (the prefill and decode hot path): 4 weight rows x up to 4 activation rows. Per block,
// each weight row is unpacked once into 32 bytes and reused for every activation row; the 4 row
// products are reduced with two hadd levels into one vector [r0 r1 r2 r3 | r0 r1 r2 r3], so one
// accumulator per activation row holds all 4 outputs and one cvt + FMA scales 4 products at once.
// Unsigned quants (q4/q5 0..31, mxfp4 shifted to 0..24) use maddubs directly; the offset is folded
// into a per-block term coef_w * S_a, where S_a = d_a * sum(a) (q8_0, precomputed once per gemm
// call) or the stored s of q8_1 (ggml's numerics for q4_1/q5_1).
#include <algorithm>
#include <vector>

#include "backend/cpu/quants_avx2_common.h"
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu::detail {
namespace {

using namespace avx2;

// ---- Weight block traits --------------------------------------------------------------------------
// size: bytes per block; quants(): 32 unpacked values; scale4/coef4: per-row d and offset coefficient
// for 4 blocks; has_coef: whether the activation sum term applies; is_signed: quants are s8.
struct tr_q4_0 {
    static constexpr int size = 18;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) { return nibbles32(b + 2); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *, float d) { return -8.0f * d; }
};
struct tr_q4_1 {
    static constexpr int size = 20;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = true;
    static __m256i quants(const uint8_t *b) { return nibbles32(b + 4); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *b, float) { return ldf16(b + 2); }
};
struct tr_q5_0 {
    static constexpr int size = 22;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) { return _mm256_or_si256(nibbles32(b + 6), bits32_x16(b + 2)); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *, float d) { return -16.0f * d; }
};
struct tr_q5_1 {
    static constexpr int size = 24;
    static constexpr bool has_coef = true, is_signed = false, act_q8_1 = true;
    static __m256i quants(const uint8_t *b) { return _mm256_or_si256(nibbles32(b + 8), bits32_x16(b + 4)); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *b, float) { return ldf16(b + 2); }
};
struct tr_q8_0 {
    static constexpr int size = 34;
    static constexpr bool has_coef = false, is_signed = true, act_q8_1 = false;
    static __m256i quants(const uint8_t *b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2)); }
    static float scale(const uint8_t *b) { return ldf16(b); }
    static float coef(const uint8_t *, float) { return 0.0f; }
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
};

template <class T>
inline __m256i dot32(__m256i q, __m256i a) {
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

// 4 weight rows x MB activation rows over nb blocks; out[m] = 4 row results.
template <class T, int MB>
inline void tile4(int64_t nb, const uint8_t *const w[4], const uint8_t *const x[MB], const float *da,
                  const float *sa, int64_t nbs, __m128 out[MB]) {
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *b0 = w[0] + b * T::size, *b1 = w[1] + b * T::size;
        const uint8_t *b2 = w[2] + b * T::size, *b3 = w[3] + b * T::size;
        const __m256i q0 = T::quants(b0), q1 = T::quants(b1), q2 = T::quants(b2), q3 = T::quants(b3);
        const float d0 = T::scale(b0), d1 = T::scale(b1), d2 = T::scale(b2), d3 = T::scale(b3);
        const __m256 d8 = _mm256_setr_ps(d0, d1, d2, d3, d0, d1, d2, d3);
        __m256 c8 = _mm256_setzero_ps();
        if constexpr (T::has_coef)
            c8 = _mm256_setr_ps(T::coef(b0, d0), T::coef(b1, d1), T::coef(b2, d2), T::coef(b3, d3), 0, 0, 0, 0);
        for (int m = 0; m < MB; ++m) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[m] + b * act_size<T> + act_qs<T>));
            const __m256i s = reduce4(dot32<T>(q0, a), dot32<T>(q1, a), dot32<T>(q2, a), dot32<T>(q3, a));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d8, _mm256_set1_ps(da[m * nbs + b])), acc[m]);
            if constexpr (T::has_coef) acc[m] = _mm256_fmadd_ps(c8, _mm256_set1_ps(sa[m * nbs + b]), acc[m]);
        }
    }
    for (int m = 0; m < MB; ++m) out[m] = fold_halves(acc[m]);
}

thread_local std::vector<float> t_act;  // per-thread [2][M][nb] activation scales / sums

template <class T>
void gemm_q32(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X, size_t x_stride,
              int64_t M, float *y, int64_t ldy) {
    const int64_t nb = K / qk32;
    if (M <= 0 || r1 <= r0) return;
    t_act.resize(static_cast<size_t>(2 * M * nb) + 1);
    float *da = t_act.data(), *sa = t_act.data() + M * nb;
    const auto *Xb = static_cast<const uint8_t *>(X);
    prepare_act<T>(Xb, x_stride, M, nb, da, sa);
    const auto *Wb = static_cast<const uint8_t *>(W);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, r1 - r));
        const uint8_t *w[4];
        for (int i = 0; i < 4; ++i) w[i] = Wb + (r + std::min(i, rows - 1)) * w_stride;  // pad with last row
        for (int64_t m = 0; m < M; m += 4) {
            const int mb = static_cast<int>(std::min<int64_t>(4, M - m));
            const uint8_t *x[4];
            for (int j = 0; j < 4; ++j) x[j] = Xb + (m + std::min(j, mb - 1)) * x_stride;
            __m128 out[4];
            const float *dam = da + m * nb, *sam = sa + m * nb;
            switch (mb) {
                case 1: tile4<T, 1>(nb, w, x, dam, sam, nb, out); break;
                case 2: tile4<T, 2>(nb, w, x, dam, sam, nb, out); break;
                case 3: tile4<T, 3>(nb, w, x, dam, sam, nb, out); break;
                default: tile4<T, 4>(nb, w, x, dam, sam, nb, out); break;
            }
            for (int j = 0; j < mb; ++j) {
                alignas(16) float o[4];
                _mm_store_ps(o, out[j]);
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = o[i];
            }
        }
    }
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
        const int rows = static_cast<int>(std::min<int64_t>(4, r1 - r));
        const E *w[4];
        for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const E *>(Wb + (r + std::min(i, rows - 1)) * w_stride);
        for (int64_t m = 0; m < M; m += 2) {
            const int mb = static_cast<int>(std::min<int64_t>(2, M - m));
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

}  // namespace

void fill_avx2_kquants(kernel_table &t);  // quants_kquants_avx2.cpp

void fill_avx2(kernel_table &t) {
    t.dot[slot(dtype::q4_0)] = dot_q32<tr_q4_0>;
    t.dot[slot(dtype::q4_1)] = dot_q32<tr_q4_1>;
    t.dot[slot(dtype::q5_0)] = dot_q32<tr_q5_0>;
    t.dot[slot(dtype::q5_1)] = dot_q32<tr_q5_1>;
    t.dot[slot(dtype::q8_0)] = dot_q32<tr_q8_0>;
    t.dot[slot(dtype::mxfp4)] = dot_q32<tr_mxfp4>;
    t.gemm[slot(dtype::q4_0)] = gemm_q32<tr_q4_0>;
    t.gemm[slot(dtype::q4_1)] = gemm_q32<tr_q4_1>;
    t.gemm[slot(dtype::q5_0)] = gemm_q32<tr_q5_0>;
    t.gemm[slot(dtype::q5_1)] = gemm_q32<tr_q5_1>;
    t.gemm[slot(dtype::q8_0)] = gemm_q32<tr_q8_0>;
    t.gemm[slot(dtype::mxfp4)] = gemm_q32<tr_mxfp4>;
    t.dot[slot(dtype::f32)] = dot_float<ld_f32>;
    t.dot[slot(dtype::f16)] = dot_float<ld_f16>;
    t.dot[slot(dtype::bf16)] = dot_float<ld_bf16>;
    t.gemm[slot(dtype::f32)] = gemm_float<ld_f32>;
    t.gemm[slot(dtype::f16)] = gemm_float<ld_f16>;
    t.gemm[slot(dtype::bf16)] = gemm_float<ld_bf16>;
    fill_avx2_kquants(t);
}

}  // namespace fathom::cpu::detail
