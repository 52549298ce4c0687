// AVX2 + FMA + F16C versions of the vector kernels in vec.h. Compiled with -mavx2 -mfma -mf16c;
// vec_avx2() (vec.cpp, baseline ISA) checks CPUID before handing them out.
#include <immintrin.h>

#include <cmath>

#include "backend/cpu/vec.h"

namespace fathom::cpu {

namespace {

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

float dot_f32(int64_t n, const float *a, const float *b) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float r = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) r += a[i] * b[i];
    return r;
}

float dot_f16(int64_t n, const uint16_t *a, const float *b) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(load_f16(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(load_f16(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(load_f16(a + i), _mm256_loadu_ps(b + i), s0);
    float r = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) r += _cvtsh_ss(a[i]) * b[i];
    return r;
}

void axpy_f32(int64_t n, float a, const float *x, float *y) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}

void axpy_f16(int64_t n, float a, const uint16_t *x, float *y) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_f16(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * _cvtsh_ss(x[i]);
}

void f16_to_f32_row(int64_t n, const uint16_t *x, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load_f16(x + i));
    for (; i < n; ++i) y[i] = _cvtsh_ss(x[i]);
}

void f32_to_f16_row(int64_t n, const float *x, uint16_t *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i *>(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

// ---- llama.cpp-mirroring kernels (see vec.h) ---------------------------------------------------

float dot_f16_lanes(int64_t n, const uint16_t *a, const float *b) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(load_f16(a + i), _mm256_loadu_ps(b + i), s);
    float r = hsum(s);
    for (; i < n; ++i) r += _cvtsh_ss(a[i]) * b[i];
    return r;
}

float dot_f16_ggml(int64_t n, const uint16_t *a, const float *b) {
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) s[j] = _mm256_fmadd_ps(load_f16(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), s[j]);
    const __m256 x = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    double r = static_cast<double>(_mm_cvtss_f32(_mm_hadd_ps(t1, t1)));
    for (; i < n; ++i) r += static_cast<double>(_cvtsh_ss(a[i]) * b[i]);
    return static_cast<float>(r);
}

// exp(x) as ggml-cpu's AVX2 ggml_v_expf computes it (a published minimax scheme: n = round(x/ln2)
// via the 1.5*2^23 trick, two-constant Cody-Waite reduction, degree-5 polynomial j with
// exp(x) = 2^n * (1 + j)). Lanes with |n| > 126 (|x| > ~87) fall back to expf: there ggml's
// special path gives 0 / inf / denormals, which after f16 rounding or division are the same.
inline __m256 exp8(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0f))));
    const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), n), _mm256_set1_ps(126.0f), _CMP_GT_OQ);
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    __m256 res = _mm256_fmadd_ps(j, k, k);
    if (_mm256_movemask_ps(big)) {
        alignas(32) float xv[8], rv[8];
        _mm256_store_ps(xv, x);
        _mm256_store_ps(rv, res);
        const int mask = _mm256_movemask_ps(big);
        for (int l = 0; l < 8; ++l)
            if (mask & (1 << l)) rv[l] = std::exp(xv[l]);
        res = _mm256_load_ps(rv);
    }
    return res;
}

double softmax_exp(int64_t n, const float *x, float mx, float *y) {
    double sum = 0;
    int64_t i = 0;
    const __m256 vmx = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmx));
        _mm256_storeu_ps(y + i, v);
        sum += static_cast<double>(hsum(v));
    }
    if (i < n) {  // ggml's row continues with masked (-inf) cells: same 8-group, exp8 for all
        alignas(32) float t[8];
        for (int l = 0; l < 8; ++l) t[l] = i + l < n ? x[i + l] : -INFINITY;
        const __m256 v = exp8(_mm256_sub_ps(_mm256_load_ps(t), vmx));
        _mm256_store_ps(t, v);
        for (int l = 0; i + l < n; ++l) y[i + l] = t[l];
        sum += static_cast<double>(hsum(v));
    }
    return sum;
}

void swiglu(int64_t n, const float *g, const float *u, float *out) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void round_f16(int64_t n, const float *x, float s, float *y) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs),
                                                                _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; ++i) y[i] = _cvtsh_ss(_cvtss_sh(x[i] * s, _MM_FROUND_TO_NEAREST_INT));
}

// NQ queries share each converted 8-element chunk of a; per query the operations of dot_f16_lanes.
template <int NQ>
void dot_lanes_n(int64_t n, const uint16_t *a, const float *const *b, float *out) {
    __m256 s[NQ];
    for (int q = 0; q < NQ; ++q) s[q] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 w = load_f16(a + i);
        for (int q = 0; q < NQ; ++q) s[q] = _mm256_fmadd_ps(w, _mm256_loadu_ps(b[q] + i), s[q]);
    }
    for (int q = 0; q < NQ; ++q) {
        float r = hsum(s[q]);
        for (int64_t t = i; t < n; ++t) r += _cvtsh_ss(a[t]) * b[q][t];
        out[q] = r;
    }
}

void dot_f16_lanes_multi(int64_t n, const uint16_t *a, const float *const *b, int nq, float *out) {
    switch (nq) {
        case 1: out[0] = dot_f16_lanes(n, a, b[0]); break;
        case 2: dot_lanes_n<2>(n, a, b, out); break;
        case 3: dot_lanes_n<3>(n, a, b, out); break;
        default: dot_lanes_n<4>(n, a, b, out); break;
    }
}

void axpy_f16_multi(int64_t n, const float *c, const uint16_t *x, float *const *y, int nq) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = load_f16(x + i);
        for (int q = 0; q < nq; ++q)
            _mm256_storeu_ps(y[q] + i, _mm256_fmadd_ps(_mm256_set1_ps(c[q]), xv, _mm256_loadu_ps(y[q] + i)));
    }
    for (; i < n; ++i)
        for (int q = 0; q < nq; ++q) y[q][i] += c[q] * _cvtsh_ss(x[i]);
}

// Per (lane, chunk of 8 * DC dims): NQ x DC accumulators loaded once, every cell of the lane folded
// in with axpy_f16's fma(p, v, y), stored once. DC is chosen so NQ x DC >= 8 where hd allows: that
// many independent FMA chains keep the FMA pipes busy (one query's two chains would wait on the FMA
// latency at every cell). Each element still takes its cells in increasing j: same bits.
template <int NQ, int DC>
void kqv_lanes_n(int64_t hd, int64_t j0, int64_t j1, const uint16_t *v, int64_t v_stride,
                 const float *const *p, float *const *lanes) {
    for (int64_t l = 0; l < 8; ++l) {
        const int64_t first = j0 + ((l - j0) % 8 + 8) % 8;  // first cell >= j0 in lane l
        if (first > j1) continue;
        for (int64_t d = 0; d < hd; d += 8 * DC) {
            __m256 acc[NQ][DC];
            for (int q = 0; q < NQ; ++q)
                for (int c = 0; c < DC; ++c) acc[q][c] = _mm256_loadu_ps(lanes[q] + l * hd + d + 8 * c);
            for (int64_t j = first; j <= j1; j += 8) {
                __m256 vv[DC];
                for (int c = 0; c < DC; ++c) vv[c] = load_f16(v + j * v_stride + d + 8 * c);
                for (int q = 0; q < NQ; ++q) {
                    const __m256 pj = _mm256_set1_ps(p[q][j]);
                    for (int c = 0; c < DC; ++c) acc[q][c] = _mm256_fmadd_ps(pj, vv[c], acc[q][c]);
                }
            }
            for (int q = 0; q < NQ; ++q)
                for (int c = 0; c < DC; ++c) _mm256_storeu_ps(lanes[q] + l * hd + d + 8 * c, acc[q][c]);
        }
    }
}

void kqv_lanes_f16(int64_t hd, int64_t j0, int64_t j1, const uint16_t *v, int64_t v_stride, const float *const *p,
                   int nq, float *const *lanes) {
    if (hd % 16 != 0) {
        for (int64_t j = j0; j <= j1; ++j)
            for (int q = 0; q < nq; ++q) axpy_f16(hd, p[q][j], v + j * v_stride, lanes[q] + (j & 7) * hd);
        return;
    }
    switch (nq) {
        case 1:
            if (hd % 64 == 0)
                kqv_lanes_n<1, 8>(hd, j0, j1, v, v_stride, p, lanes);
            else if (hd % 32 == 0)
                kqv_lanes_n<1, 4>(hd, j0, j1, v, v_stride, p, lanes);
            else
                kqv_lanes_n<1, 2>(hd, j0, j1, v, v_stride, p, lanes);
            break;
        case 2:
            if (hd % 32 == 0)
                kqv_lanes_n<2, 4>(hd, j0, j1, v, v_stride, p, lanes);
            else
                kqv_lanes_n<2, 2>(hd, j0, j1, v, v_stride, p, lanes);
            break;
        case 3:
            kqv_lanes_n<3, 2>(hd, j0, j1, v, v_stride, p, lanes);
            break;
        default:
            kqv_lanes_n<4, 2>(hd, j0, j1, v, v_stride, p, lanes);
            break;
    }
}

// NR rows of a against one query: dot_f16_lanes per row (one 8-lane accumulator each, the same
// FMAs in the same order, hsum), with the rows' chains interleaved so they overlap.
template <int NR>
void dot_rows_n(int64_t n, const uint16_t *a, int64_t a_stride, const float *b, float *out) {
    __m256 s[NR];
    for (int r = 0; r < NR; ++r) s[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 bv = _mm256_loadu_ps(b + i);
        for (int r = 0; r < NR; ++r) s[r] = _mm256_fmadd_ps(load_f16(a + r * a_stride + i), bv, s[r]);
    }
    for (int r = 0; r < NR; ++r) {
        float x = hsum(s[r]);
        for (int64_t t = i; t < n; ++t) x += _cvtsh_ss(a[r * a_stride + t]) * b[t];
        out[r] = x;
    }
}

void dot_f16_lanes_rows(int64_t n, const uint16_t *a, int64_t a_stride, int64_t nr, const float *b,
                        float *out) {
    int64_t r = 0;
    for (; r + 8 <= nr; r += 8) dot_rows_n<8>(n, a + r * a_stride, a_stride, b, out + r);
    if (r + 4 <= nr) {
        dot_rows_n<4>(n, a + r * a_stride, a_stride, b, out + r);
        r += 4;
    }
    for (; r < nr; ++r) out[r] = dot_f16_lanes(n, a + r * a_stride, b);
}

const vec_kernels kAvx2{dot_f32,        dot_f16,        axpy_f32,          axpy_f16,
                        f16_to_f32_row, f32_to_f16_row, dot_f16_lanes,     dot_f16_ggml,
                        softmax_exp,    swiglu,         round_f16,         dot_f16_lanes_multi,
                        axpy_f16_multi, kqv_lanes_f16,  dot_f16_lanes_rows};

}  // namespace

const vec_kernels *vec_avx2_table() { return &kAvx2; }

}  // namespace fathom::cpu
