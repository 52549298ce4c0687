// f32 helpers of the DS4 reference forward (see deepseek4_ops.h).
#include "models/deepseek4_ops.h"

#include <algorithm>
#include <cstring>
#include <numbers>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backend/cpu/quants.h"
#include "backend/cpu/thread_pool.h"

namespace fathom::ds4 {

// Compiled three times (AVX-512F, AVX2 and baseline) and picked at load time; none of those targets
// enables FMA (so no contraction) and the lane assignment is fixed, so every version returns the same bits.
__attribute__((target_clones("avx512f", "avx2", "default"))) float dot_f32(const float *a, const float *b,
                                                                           int64_t n) {
    // Products are exact in double; 16 double lanes, then a fixed pairwise reduction. Accumulating
    // in double keeps the result within about one f32 rounding of the exact dot product, i.e. as
    // close as an f32 evaluation can be to any other correct one (long QAT sequences amplify
    // order-dependent f32 noise, README of the goldens).
    constexpr int L = 16;
    double acc[L] = {};
    int64_t i = 0;
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; ++l) acc[l] += static_cast<double>(a[i + l]) * static_cast<double>(b[i + l]);
    for (; i < n; ++i) acc[i % L] += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    for (int w = L / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return static_cast<float>(acc[0]);
}

#if defined(__x86_64__)
// dot_f32 of one a against 4 rows of b at once (independent FMA chains instead of one latency-bound
// chain per dot), n a multiple of 16. Same bits as dot_f32: lane l of row r holds the double sum of
// elements l, l+16, ... in order; a product of two floats is exact in double, so fma(a, b, acc) rounds
// exactly as acc + a*b does; then the same pairwise reduction.
__attribute__((target("avx512f"))) static void dot_f32_rows4_avx512(const float *a, const float *b, int64_t n,
                                                                    float *out) {
    __m512d lo[4], hi[4];
    for (int r = 0; r < 4; ++r) lo[r] = hi[r] = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 av = _mm512_loadu_ps(a + i);
        const __m512d alo = _mm512_cvtps_pd(_mm512_castps512_ps256(av));
        const __m512d ahi =
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(av), 1)));
        for (int r = 0; r < 4; ++r) {
            const __m512 bv = _mm512_loadu_ps(b + r * n + i);
            lo[r] = _mm512_fmadd_pd(alo, _mm512_cvtps_pd(_mm512_castps512_ps256(bv)), lo[r]);
            hi[r] = _mm512_fmadd_pd(
                ahi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(bv), 1))),
                hi[r]);
        }
    }
    for (int r = 0; r < 4; ++r) {
        alignas(64) double acc[16];
        _mm512_store_pd(acc, lo[r]);
        _mm512_store_pd(acc + 8, hi[r]);
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
        out[r] = static_cast<float>(acc[0]);
    }
}
#endif

// ---- sink attention over heads in groups (AVX-512) ---------------------------------------------------
// Scores of 4 heads against every candidate row: each row's 16-float chunks are widened to double once
// and FMA'd into the 4 heads' lanes (the heads' queries widened once per group, kept in L1), instead of
// widening every row again for every head. Lane l of (row, head) holds the double sum of elements l,
// l+16, ... in order and the pairwise reduction is dot_f32's (acc[l] += acc[l + w], w = 8, 4, 2, 1, done
// here as one vector add per level): the same bits as dot_f32 (float products are exact in double, so
// fma(k, q, acc) rounds as acc + q*k does).
__attribute__((target("avx512f"))) static void scores_heads4_avx512(const float *q, const float *kv, int64_t n,
                                                                    int64_t d, float *s) {
    thread_local std::vector<double> qd_buf;
    qd_buf.resize(static_cast<size_t>(4 * d));
    double *qd = qd_buf.data();
    for (int64_t i = 0; i < 4 * d; ++i) qd[i] = static_cast<double>(q[i]);
    for (int64_t r = 0; r < n; ++r) {
        const float *k = kv + r * d;
        __m512d lo[4], hi[4];
        for (int h = 0; h < 4; ++h) lo[h] = hi[h] = _mm512_setzero_pd();
        for (int64_t i = 0; i < d; i += 16) {
            const __m512 kv16 = _mm512_loadu_ps(k + i);
            const __m512d klo = _mm512_cvtps_pd(_mm512_castps512_ps256(kv16));
            const __m512d khi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(kv16), 1)));
            for (int h = 0; h < 4; ++h) {
                lo[h] = _mm512_fmadd_pd(_mm512_loadu_pd(qd + h * d + i), klo, lo[h]);
                hi[h] = _mm512_fmadd_pd(_mm512_loadu_pd(qd + h * d + i + 8), khi, hi[h]);
            }
        }
        for (int h = 0; h < 4; ++h) {
            const __m512d a8 = _mm512_add_pd(lo[h], hi[h]);  // acc[l] += acc[l + 8]
            const __m256d a4 = _mm256_add_pd(_mm512_castpd512_pd256(a8), _mm512_extractf64x4_pd(a8, 1));
            const __m128d a2 = _mm_add_pd(_mm256_castpd256_pd128(a4), _mm256_extractf128_pd(a4, 1));
            const double a1 = _mm_cvtsd_f64(a2) + _mm_cvtsd_f64(_mm_unpackhi_pd(a2, a2));
            s[h * n + r] = static_cast<float>(a1);
        }
    }
}

// o_h = sum over rows r in order of p[h][r] * v_r for 2 heads (h = 0, 1; p [2][n], o [2][d]): per
// element one float multiply and one add per row, as axpy_f32 row after row does, with 128 elements of
// both heads' outputs held in registers across the rows (each v chunk loaded once for both heads).
// Contraction off: GCC's avx512f implies FMA and would fuse the intrinsics' multiply and add.
__attribute__((target("avx512f"), optimize("fp-contract=off"))) static void values_heads2_avx512(const float *p, const float *kv, int64_t n,
                                                                    int64_t d, float *o) {
    for (int64_t c = 0; c < d; c += 128) {
        __m512 o0[8], o1[8];
        for (int j = 0; j < 8; ++j) o0[j] = o1[j] = _mm512_setzero_ps();
        for (int64_t r = 0; r < n; ++r) {
            const __m512 p0 = _mm512_set1_ps(p[r]), p1 = _mm512_set1_ps(p[n + r]);
            const float *v = kv + r * d + c;
            for (int j = 0; j < 8; ++j) {
                const __m512 vj = _mm512_loadu_ps(v + 16 * j);
                o0[j] = _mm512_add_ps(o0[j], _mm512_mul_ps(p0, vj));
                o1[j] = _mm512_add_ps(o1[j], _mm512_mul_ps(p1, vj));
            }
        }
        for (int j = 0; j < 8; ++j) {
            _mm512_storeu_ps(o + c + 16 * j, o0[j]);
            _mm512_storeu_ps(o + d + c + 16 * j, o1[j]);
        }
    }
}

// ---- the same kernels on AVX2 + FMA (16 ymm registers) --------------------------------------------
// Lanes as on AVX-512: the 16 double lanes of a dot are 4 ymm (lanes 0-3, 4-7, 8-11, 12-15), element
// i + l of a 16-float chunk into lane l; dot_f32's pairwise reduction is then (0-3 += 8-11, 4-7 +=
// 12-15), (0-3 += 4-7), (lanes 0,1 += 2,3), lane 0 += lane 1. FMA is exact here: a product of two
// floats is exact in double, so fma(a, b, acc) rounds as acc + a*b does. Same bits as dot_f32.
__attribute__((target("avx2,fma"))) static inline float reduce16_avx2(__m256d a0, __m256d a1, __m256d a2, __m256d a3) {
    a0 = _mm256_add_pd(a0, a2);  // acc[l] += acc[l + 8]
    a1 = _mm256_add_pd(a1, a3);
    a0 = _mm256_add_pd(a0, a1);  // acc[l] += acc[l + 4]
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a0), _mm256_extractf128_pd(a0, 1));  // += acc[l + 2]
    return static_cast<float>(_mm_cvtsd_f64(h) + _mm_cvtsd_f64(_mm_unpackhi_pd(h, h)));       // += acc[l + 1]
}

// dot_f32 of one a against 2 rows of b (n a multiple of 16): a's chunk widened once for both rows.
__attribute__((target("avx2,fma"))) static void dot_f32_rows2_avx2(const float *a, const float *b, int64_t n,
                                                                   float *out) {
    __m256d acc[2][4];
    for (int r = 0; r < 2; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        __m256d av[4];
        for (int j = 0; j < 4; ++j) av[j] = _mm256_cvtps_pd(_mm_loadu_ps(a + i + 4 * j));
        for (int r = 0; r < 2; ++r)
            for (int j = 0; j < 4; ++j)
                acc[r][j] = _mm256_fmadd_pd(av[j], _mm256_cvtps_pd(_mm_loadu_ps(b + r * n + i + 4 * j)), acc[r][j]);
    }
    for (int r = 0; r < 2; ++r) out[r] = reduce16_avx2(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

// Scores of 2 heads (q [2, d], widened to double once per call) against every row: each row's chunk
// widened once for both heads. s[h * n + r], d a multiple of 16.
__attribute__((target("avx2,fma"))) static void scores_heads2_avx2(const float *q, const float *kv, int64_t n, int64_t d,
                                                                   float *s, int64_t s_stride) {
    thread_local std::vector<double> qd_buf;
    qd_buf.resize(static_cast<size_t>(2 * d));
    double *qd = qd_buf.data();
    for (int64_t i = 0; i < 2 * d; ++i) qd[i] = static_cast<double>(q[i]);
    for (int64_t r = 0; r < n; ++r) {
        const float *k = kv + r * d;
        __m256d acc[2][4];
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_pd();
        for (int64_t i = 0; i < d; i += 16) {
            __m256d kd[4];
            for (int j = 0; j < 4; ++j) kd[j] = _mm256_cvtps_pd(_mm_loadu_ps(k + i + 4 * j));
            for (int h = 0; h < 2; ++h)
                for (int j = 0; j < 4; ++j)
                    acc[h][j] = _mm256_fmadd_pd(_mm256_loadu_pd(qd + h * d + i + 4 * j), kd[j], acc[h][j]);
        }
        for (int h = 0; h < 2; ++h) s[h * s_stride + r] = reduce16_avx2(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    }
}

// values_heads2_avx512 in 32-element chunks: per element one float multiply and one add per row, in row
// order (axpy_f32's bits), both heads' 32 outputs in 8 registers across the rows. Contraction off: the
// fma target would otherwise fuse the multiply and the add.
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) static void values_heads2_avx2(const float *p, const float *kv,
                                                                                             int64_t n, int64_t d, float *o) {
    for (int64_t c = 0; c < d; c += 32) {
        __m256 o0[4], o1[4];
        for (int j = 0; j < 4; ++j) o0[j] = o1[j] = _mm256_setzero_ps();
        for (int64_t r = 0; r < n; ++r) {
            const __m256 p0 = _mm256_set1_ps(p[r]), p1 = _mm256_set1_ps(p[n + r]);
            const float *v = kv + r * d + c;
            for (int j = 0; j < 4; ++j) {
                const __m256 vj = _mm256_loadu_ps(v + 8 * j);
                o0[j] = _mm256_add_ps(o0[j], _mm256_mul_ps(p0, vj));
                o1[j] = _mm256_add_ps(o1[j], _mm256_mul_ps(p1, vj));
            }
        }
        for (int j = 0; j < 4; ++j) {
            _mm256_storeu_ps(o + c + 8 * j, o0[j]);
            _mm256_storeu_ps(o + d + c + 8 * j, o1[j]);
        }
    }
}

namespace {
enum class grouped_isa { none, avx2, avx512 };
grouped_isa grouped_kernels() {
    static const grouped_isa isa = __builtin_cpu_supports("avx512f")                                       ? grouped_isa::avx512
                                   : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? grouped_isa::avx2
                                                                                                      : grouped_isa::none;
    return isa;
}
}  // namespace

bool attention_heads_grouped(int64_t d) {
    switch (grouped_kernels()) {
        case grouped_isa::avx512: return d % 128 == 0;
        case grouped_isa::avx2: return d % 32 == 0;
        default: return false;
    }
}

void attention_scores_heads4(const float *q, const float *kv, int64_t n, int64_t d, float *s) {
    if (grouped_kernels() == grouped_isa::avx512) return scores_heads4_avx512(q, kv, n, d, s);
    scores_heads2_avx2(q, kv, n, d, s, n);
    scores_heads2_avx2(q + 2 * d, kv, n, d, s + 2 * n, n);
}

void attention_values_heads2(const float *p, const float *kv, int64_t n, int64_t d, float *o) {
    if (grouped_kernels() == grouped_isa::avx512) return values_heads2_avx512(p, kv, n, d, o);
    values_heads2_avx2(p, kv, n, d, o);
}

namespace {

const exec_options default_exec{};
thread_local const exec_options *tl_exec = &default_exec;

// Reference rows [a, b) of W (absolute row ids) for n activations; y has row stride nr, column r - r0.
void reference_rows(const matrix &w, int64_t r0, int64_t a, int64_t b, const float *x, int64_t n, int64_t nr,
                    float *y) {
    const int64_t k = w.cols;
    std::vector<float> scratch;
    for (int64_t r = a; r < b; ++r) {
        const float *wr = nullptr;
        const uint8_t *src = w.row(r);
        if (w.type == dtype::f32 && reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) {
            wr = reinterpret_cast<const float *>(src);
        } else {
            scratch.resize(static_cast<size_t>(k));
            if (w.type == dtype::f32)
                std::memcpy(scratch.data(), src, static_cast<size_t>(k) * sizeof(float));
            else
                cpu::dequantize_row(w.type, src, scratch.data(), k);
            wr = scratch.data();
        }
        for (int64_t i = 0; i < n; ++i) y[i * nr + (r - r0)] = dot_f32(wr, x + i * k, k);
    }
}

// Thread ith's share [a, b) of [0, total), in whole multiples of `align` (the last share takes the rest).
void split_range(int64_t total, int64_t align, int ith, int nth, int64_t &a, int64_t &b) {
    const int64_t units = (total + align - 1) / align;
    a = std::min(total, units * ith / nth * align);
    b = std::min(total, units * (ith + 1) / nth * align);
}

// Run fn(a, b) over [0, total) split across the pool (or inline when there is none / it is small).
// Shares are multiples of `align` items (4 rows keep cpu::gemm's register blocks whole). The range is
// cut into up to 4 shares per thread, claimed as the threads come free: a thread slowed by another
// process on its core (or a late wake-up) takes fewer, instead of the other waiting for its half.
// Every row's result is independent of the cut (products are per row), so the bits are the same.
template <class F>
void parallel_rows(cpu::thread_pool *pool, int64_t total, int64_t work_per_row, F &&fn, int64_t align = 4) {
    // Below ~64k multiply-adds a dispatch costs more than it saves.
    if (!pool || pool->size() == 1 || total < 2 || total * work_per_row < (int64_t{1} << 16)) {
        fn(int64_t{0}, total);
        return;
    }
    const int64_t units = (total + align - 1) / align;
    const int n = static_cast<int>(std::min<int64_t>(units, 4 * static_cast<int64_t>(pool->size())));
    pool->run_tasks(
        [&](int ith, int nth) {
            int64_t a = 0, b = 0;
            split_range(total, align, ith, nth, a, b);
            if (a < b) fn(a, b);
        },
        n);
}

// Quantised path: X [n, k] -> vec_dot_type(w) rows once, then cpu::gemm over row shares.
void quantised_rows(const matrix &w, int64_t r0, int64_t r1, const float *x, int64_t n, float *y,
                    cpu::thread_pool *pool) {
    const int64_t k = w.cols, nr = r1 - r0;
    const dtype vt = cpu::vec_dot_type(w.type);
    const size_t xs = dtype_row_bytes(vt, k);
    thread_local std::vector<uint8_t> xq;  // per calling thread; reused across calls
    xq.resize(xs * static_cast<size_t>(n));
    uint8_t *xqd = xq.data();
    parallel_rows(pool, n, k, [&](int64_t a, int64_t b) {
        for (int64_t i = a; i < b; ++i) cpu::quantize_row(vt, x + i * k, xqd + static_cast<size_t>(i) * xs, k);
    });
    const uint8_t *w0 = w.row(r0);  // gemm row ids are relative to r0, so y's columns are too
    parallel_rows(pool, nr, k * n, [&](int64_t a, int64_t b) {
        cpu::gemm(w.type, k, w0, w.row_bytes, a, b, xqd, xs, n, y, nr);
    });
}

}  // namespace

void dot_f32_rows(const float *a, const float *b, int64_t rows, int64_t n, float *out) {
    int64_t r = 0;
#if defined(__x86_64__)
    if (n % 16 == 0) {
        if (grouped_kernels() == grouped_isa::avx512)
            for (; r + 4 <= rows; r += 4) dot_f32_rows4_avx512(a, b + r * n, n, out + r);
        else if (grouped_kernels() == grouped_isa::avx2)
            for (; r + 2 <= rows; r += 2) dot_f32_rows2_avx2(a, b + r * n, n, out + r);
    }
#endif
    for (; r < rows; ++r) out[r] = dot_f32(a, b + r * n, n);
}

void parallel_for(int64_t total, int64_t work_per_item, const std::function<void(int64_t, int64_t)> &fn) {
    parallel_rows(current_exec().pool, total, work_per_item, fn, 1);
}

const exec_options &current_exec() {
    return *tl_exec;
}

exec_scope::exec_scope(const exec_options &o) : prev_(tl_exec) {
    tl_exec = &o;
}

exec_scope::~exec_scope() {
    tl_exec = prev_;
}

void matmul_rows(const matrix &w, int64_t r0, int64_t r1, const float *x, int64_t n, float *y) {
    const exec_options &ex = current_exec();
    const int64_t nr = r1 - r0;
    if (nr <= 0 || n <= 0) return;
    if (ex.quantised && w.type != dtype::f32 && dtype_info(w.type).compute &&
        w.cols % dtype_info(cpu::vec_dot_type(w.type)).block_size == 0) {
        quantised_rows(w, r0, r1, x, n, y, ex.pool);
        return;
    }
    // Each row's dot products are independent of the split: same bits for any thread count.
    parallel_rows(ex.pool, nr, w.cols * n,
                  [&](int64_t a, int64_t b) { reference_rows(w, r0, r0 + a, r0 + b, x, n, nr, y); });
}

void matmul(const matrix &w, const float *x, int64_t n, float *y) {
    matmul_rows(w, 0, w.rows, x, n, y);
}

void rms_norm(const float *x, int64_t n, const float *w, float eps, float *out) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) out[i] = w ? w[i] * (x[i] * r) : x[i] * r;
}

rope_table rope_plain(float base, int n_rot) {
    rope_table t;
    t.freq.resize(static_cast<size_t>(n_rot / 2));
    for (int i = 0; i < n_rot / 2; ++i) {
        const float e = static_cast<float>(2 * i) / static_cast<float>(n_rot);
        t.freq[static_cast<size_t>(i)] = 1.0f / std::pow(base, e);
    }
    return t;
}

rope_table rope_yarn(float base, int n_rot, float factor, int64_t orig_ctx, float beta_fast,
                     float beta_slow) {
    rope_table t = rope_plain(base, n_rot);
    // Correction dim of a pair rotating `rot` times over the original context (spec 4.2).
    auto corr = [&](double rot) {
        return n_rot * std::log(static_cast<double>(orig_ctx) / (rot * 2 * std::numbers::pi)) /
               (2 * std::log(static_cast<double>(base)));
    };
    const double lo = std::max(std::floor(corr(beta_fast)), 0.0);
    double hi = std::min(std::ceil(corr(beta_slow)), static_cast<double>(n_rot - 1));
    if (lo == hi) hi += 0.001;
    for (size_t i = 0; i < t.freq.size(); ++i) {
        const float ramp =
            std::clamp(static_cast<float>((static_cast<double>(i) - lo) / (hi - lo)), 0.0f, 1.0f);
        const float smooth = 1.0f - ramp;
        const float f = t.freq[i];
        t.freq[i] = f / factor * (1.0f - smooth) + f * smooth;
    }
    return t;
}

void rope_apply(float *x, const rope_table &t, int64_t pos, bool inverse) {
    rope_apply_heads(x, 0, 1, t, pos, inverse);
}

// The cos/sin pair i is computed once per call and applied to every head (the same values rope_apply
// computes per head: n_heads times fewer sin/cos evaluations, the same bits).
void rope_apply_heads(float *x, int64_t stride, int64_t n_heads, const rope_table &t, int64_t pos, bool inverse) {
    for (size_t i = 0; i < t.freq.size(); ++i) {
        // The angle is an f32 product, as in the official f32 outer(t, freqs) table.
        const float ang = static_cast<float>(pos) * t.freq[i];
        const float c = static_cast<float>(std::cos(static_cast<double>(ang)));
        float s = static_cast<float>(std::sin(static_cast<double>(ang)));
        if (inverse) s = -s;
        for (int64_t h = 0; h < n_heads; ++h) {
            float *xh = x + h * stride;
            const float a = xh[2 * i], b = xh[2 * i + 1];
            xh[2 * i] = a * c - b * s;
            xh[2 * i + 1] = a * s + b * c;
        }
    }
}

}  // namespace fathom::ds4
