// AVX-512 (F, BW, VL, DQ, VNNI) kernel table. Starts from the AVX2 table and re-instantiates the x86
// kernels of quants_x86_q32.h / quants_x86_kquants.h in this -mavx512* translation unit (EVEX
// encodings, 32 vector registers, VNNI dpbusd in the 32-block tiles), then replaces the float-type
// GEMM with 512-bit FMAs. Not testable on AVX2-only machines: test_quant runs every ISA the CPU has
// (force_isa), so it is checked wherever AVX-512 exists.
// GCC 12's avx512fintrin.h builds "undefined" vectors by self-initialisation (__m512i __Y = __Y),
// which -Wuninitialized reports at every inlined use of the widening/shift intrinsics; the values
// are never read. Silenced for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "backend/cpu/quants_x86_kquants.h"
#include "backend/cpu/quants_x86_q32.h"

namespace fathom::cpu::detail {
namespace {

struct ld512_f32 {
    using elem = float;
    static __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
    static float one(const float *p) { return *p; }
};
struct ld512_f16 {
    using elem = uint16_t;
    static __m512 load16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
    static float one(const uint16_t *p) { return _cvtsh_ss(*p); }
};
struct ld512_bf16 {
    using elem = uint16_t;
    static __m512 load16(const uint16_t *p) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    static float one(const uint16_t *p) { return bf16_to_f32(*p); }
};

// NR weight rows x MB activation rows, 16 lanes per step, scalar tail.
template <class L, int NR, int MB>
inline void float_tile512(int64_t K, const typename L::elem *const w[NR], const typename L::elem *const x[MB],
                          float out[MB][NR]) {
    __m512 acc[MB][NR];
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = L::load16(w[r] + k);
        for (int m = 0; m < MB; ++m) {
            const __m512 xv = L::load16(x[m] + k);
            for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int r = 0; r < NR; ++r) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            for (int64_t t = k; t < K; ++t) s += L::one(w[r] + t) * L::one(x[m] + t);
            out[m][r] = s;
        }
}

template <class L>
void gemm_float512(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
                   size_t x_stride, int64_t M, float *y, int64_t ldy) {
    using E = typename L::elem;
    const auto *Wb = static_cast<const uint8_t *>(W);
    const auto *Xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = static_cast<int>(imin(4, r1 - r));
        const E *w[4];
        for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const E *>(Wb + (r + imin(i, rows - 1)) * w_stride);
        for (int64_t m = 0; m < M; m += 4) {
            const int mb = static_cast<int>(imin(4, M - m));
            const E *x[4];
            for (int j = 0; j < 4; ++j) x[j] = reinterpret_cast<const E *>(Xb + (m + imin(j, mb - 1)) * x_stride);
            float out[4][4];
            switch (mb) {
                case 1: float_tile512<L, 4, 1>(K, w, x, out); break;
                case 2: float_tile512<L, 4, 2>(K, w, x, out); break;
                case 3: float_tile512<L, 4, 3>(K, w, x, out); break;
                default: float_tile512<L, 4, 4>(K, w, x, out); break;
            }
            for (int j = 0; j < mb; ++j)
                for (int i = 0; i < rows; ++i) y[(m + j) * ldy + r + i] = out[j][i];
        }
    }
}

template <class L>
float dot_float512(int64_t n, const void *w, const void *a) {
    const typename L::elem *wp[1] = {static_cast<const typename L::elem *>(w)};
    const typename L::elem *xp[1] = {static_cast<const typename L::elem *>(a)};
    float out[1][1];
    float_tile512<L, 1, 1>(n, wp, xp, out);
    return out[0][0];
}

}  // namespace

void fill_avx512(kernel_table &t) {
    fill_x86_q32(t);
    fill_x86_kquants(t);
    t.dot[slot(dtype::f32)] = dot_float512<ld512_f32>;
    t.dot[slot(dtype::f16)] = dot_float512<ld512_f16>;
    t.dot[slot(dtype::bf16)] = dot_float512<ld512_bf16>;
    t.gemm[slot(dtype::f32)] = gemm_float512<ld512_f32>;
    t.gemm[slot(dtype::f16)] = gemm_float512<ld512_f16>;
    t.gemm[slot(dtype::bf16)] = gemm_float512<ld512_bf16>;
}

}  // namespace fathom::cpu::detail
