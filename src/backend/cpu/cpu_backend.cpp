// The CPU backend: the reference implementation of backend.h. Every op runs at once, split across
// a persistent thread pool (thread_pool.h); scratch buffers are sized up front (cpu_options) and
// only ever grow, so a decode loop allocates nothing. Quantised kernels come from quants.h, the
// f32/f16 vector kernels from vec.h.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/quants.h"
#include "backend/cpu/quants_x8.h"
#include "backend/cpu/repack.h"
#include "backend/cpu/thread_pool.h"
#include "backend/cpu/vec.h"
#include "core/error.h"

namespace fathom {

// ---- tensor helpers ------------------------------------------------------------------------------

tensor make_tensor(dtype type, int64_t cols, int64_t rows, void *data) {
    tensor t;
    t.type = type;
    t.ne[0] = cols;
    t.ne[1] = rows;
    t.nb1 = dtype_row_bytes(type, cols);
    t.data = data;
    return t;
}

tensor view_rows(const tensor &t, int64_t r0, int64_t n) {
    if (r0 < 0 || n < 0 || r0 + n > t.ne[1])
        throw error("view_rows: rows [" + std::to_string(r0) + ", " + std::to_string(r0 + n) + ") outside " +
                    std::to_string(t.ne[1]));
    tensor v = t;
    v.ne[1] = n;
    v.data = static_cast<uint8_t *>(t.data) + static_cast<size_t>(r0) * t.nb1;
    return v;
}

tensor view_cols(const tensor &t, int64_t c0, int64_t n) {
    if (t.type != dtype::f32 && t.type != dtype::f16) throw error("view_cols: only f32/f16 tensors");
    if (c0 < 0 || n < 0 || c0 + n > t.ne[0]) throw error("view_cols: columns out of range");
    tensor v = t;
    v.ne[0] = n;
    v.data = static_cast<uint8_t *>(t.data) + dtype_row_bytes(t.type, c0);
    return v;
}

tensor reshape(const tensor &t, int64_t cols) {
    if (!t.contiguous() || cols <= 0 || (t.ne[0] * t.ne[1]) % cols != 0 ||
        cols % dtype_info(t.type).block_size != 0)
        throw error("reshape: cannot view " + std::to_string(t.ne[0]) + "x" + std::to_string(t.ne[1]) +
                    " as rows of " + std::to_string(cols));
    return make_tensor(t.type, cols, t.ne[0] * t.ne[1] / cols, t.data);
}

// Backends without paged KV (supports_paged_kv() false): the engine keeps contiguous caches for them.
void backend::kv_store_paged(const tensor &, const tensor &, const kv_pages &, int64_t) {
    throw error(std::string("backend ") + name() + ": paged KV is not supported");
}
void backend::attention_paged(const tensor &, const kv_pages &, const attn_params &, const tensor &) {
    throw error(std::string("backend ") + name() + ": paged KV is not supported");
}
void backend::attention_paged_rows(const tensor &q, std::span<const kv_pages> kv,
                                   std::span<const int64_t> n_past, const attn_params &p, const tensor &out) {
    if (static_cast<int64_t>(kv.size()) != q.ne[1] || static_cast<int64_t>(n_past.size()) != q.ne[1] ||
        out.ne[1] != q.ne[1])
        throw error("attention_paged_rows: " + std::to_string(q.ne[1]) + " query rows, " +
                    std::to_string(kv.size()) + " page tables, " + std::to_string(n_past.size()) +
                    " positions, " + std::to_string(out.ne[1]) + " output rows");
    attn_params pi = p;
    for (size_t i = 0; i < kv.size(); ++i) {
        pi.n_past = n_past[i];
        attention_paged(view_rows(q, static_cast<int64_t>(i), 1), kv[i], pi,
                        view_rows(out, static_cast<int64_t>(i), 1));
    }
}

// The fused ops' defaults (backend.h): exactly the separate ops, in the documented order.
void backend::mul_mat_normed(const tensor &x, const tensor &norm_w, float eps, const tensor &xn, int n_pairs,
                             const tensor *const *w, const tensor *const *out) {
    rms_norm(x, &norm_w, eps, xn);
    mul_mat(xn, n_pairs, w, out);
}
void backend::mul_mat_add(const tensor &x, const tensor &w, const tensor &tmp, const tensor &acc) {
    const tensor *pw[] = {&w};
    const tensor *pt[] = {&tmp};
    mul_mat(x, 1, pw, pt);
    add(acc, tmp, acc);
}
void backend::glu_mul_mat_add(const tensor &gate, const tensor &up, glu_kind kind, const tensor &w,
                              const tensor &tmp, const tensor &acc) {
    glu(gate, up, kind, gate);
    mul_mat_add(gate, w, tmp, acc);
}
void backend::rms_norm_add(const tensor &x, const tensor &w, float eps, const tensor &acc) {
    rms_norm(x, &w, eps, x);
    add(acc, x, acc);
}
void backend::qk_rope_store(const tensor &q, const tensor &k, const tensor &v, const qk_rope_store_params &p) {
    if (!p.table || !p.k_cache || !p.v_cache) throw error("qk_rope_store: missing rope table or caches");
    const int32_t hd = p.head_dim;
    if (p.q_norm) rms_norm(reshape(q, hd), p.q_norm, p.eps, reshape(q, hd));  // per head [n*H, hd]
    if (p.k_norm) rms_norm(reshape(k, hd), p.k_norm, p.eps, reshape(k, hd));
    rope(q, hd, *p.table, p.mode);
    rope(k, hd, *p.table, p.mode);
    if (p.q_scale != 1.0f) scale(q, p.q_scale);
    kv_store(k, *p.k_cache, p.n_head_kv, p.n_ctx, p.p0);
    kv_store(v, *p.v_cache, p.n_head_kv, p.n_ctx, p.p0);
}

// Host-memory attention_prob_max, queries split over up to `threads` std::threads (each owns agg
// rows: no two write the same element). Per (query, head) the exact loop the CPU drafter always ran:
// f16 dots, scale, optional softcap, exp against the max, a double sum, max into agg.
static void attention_prob_max_host(const tensor &q, const tensor &k, int32_t n_head, int32_t n_head_kv,
                                    int64_t n_ctx, float scale, float softcap, int64_t first_pos, const tensor &agg,
                                    int threads) {
    const int64_t n_q = q.ne[1], hd = k.ne[0], qw = q.ne[0];
    if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0 || qw != int64_t{n_head} * hd || k.type != dtype::f16 ||
        q.type != dtype::f32 || agg.type != dtype::f32 || agg.ne[1] != n_q || agg.ne[0] < first_pos + n_q ||
        k.ne[1] < int64_t{n_head_kv} * n_ctx || first_pos + n_q > n_ctx || first_pos < 0)
        throw error("attention_prob_max: bad shapes");
    const int64_t group = n_head / n_head_kv;
    const auto &vk = cpu::vec();
    const int nth = static_cast<int>(std::clamp<int64_t>(threads, 1, n_q));
    auto body = [&](int ith) {
        std::vector<float> p(static_cast<size_t>(first_pos + n_q));
        for (int64_t t = ith; t < n_q; t += nth) {
            const int64_t pos = first_pos + t;  // keys [0, pos]
            const float *qt = reinterpret_cast<const float *>(static_cast<const uint8_t *>(q.data) + static_cast<size_t>(t) * q.nb1);
            float *a = reinterpret_cast<float *>(static_cast<uint8_t *>(agg.data) + static_cast<size_t>(t) * agg.nb1);
            for (int64_t h = 0; h < n_head; ++h) {
                const float *qr = qt + h * hd;
                const auto *kbase = reinterpret_cast<const uint16_t *>(static_cast<const uint8_t *>(k.data) +
                                                                       static_cast<size_t>((h / group) * n_ctx) * k.nb1);
                float mx = -INFINITY;
                for (int64_t j = 0; j <= pos; ++j) {
                    float sc = vk.dot_f16(static_cast<int>(hd), kbase + j * hd, qr) * scale;
                    if (softcap > 0) sc = softcap * std::tanh(sc / softcap);
                    p[static_cast<size_t>(j)] = sc;
                    mx = std::max(mx, sc);
                }
                double sum = 0;
                for (int64_t j = 0; j <= pos; ++j) {
                    p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx);
                    sum += p[static_cast<size_t>(j)];
                }
                const float inv = static_cast<float>(1.0 / sum);
                for (int64_t j = 0; j <= pos; ++j) a[j] = std::max(a[j], p[static_cast<size_t>(j)] * inv);
            }
        }
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < nth; ++i) pool.emplace_back(body, i);
    body(0);
    for (auto &th : pool) th.join();
}

void backend::attention_prob_max(const tensor &q, const tensor &k, int32_t n_head, int32_t n_head_kv, int64_t n_ctx,
                                 float scale, float softcap, int64_t first_pos, const tensor &agg) {
    attention_prob_max_host(q, k, n_head, n_head_kv, n_ctx, scale, softcap, first_pos, agg, n_threads());
}

namespace cpu {
namespace {

template <class T>
T *row_ptr(const tensor &t, int64_t r) {
    return reinterpret_cast<T *>(static_cast<uint8_t *>(t.data) + static_cast<size_t>(r) * t.nb1);
}

// Validation that builds its message only on failure: ops run hundreds of times per token and
// must not allocate.
#define FATHOM_CHECK(cond, op, what)                                      \
    do {                                                                  \
        if (!(cond)) throw error(std::string(op) + ": " + (what));        \
    } while (0)

std::string shape(const tensor &t) {
    return std::string(dtype_name(t.type)) + "[" + std::to_string(t.ne[1]) + "x" + std::to_string(t.ne[0]) + "]";
}

void check_f32(const tensor &t, const char *op, const char *name) {
    FATHOM_CHECK(t.type == dtype::f32, op, std::string(name) + " must be f32, got " + shape(t));
    FATHOM_CHECK(t.data != nullptr || t.ne[1] == 0, op, std::string(name) + " has no data");
}

void check_same(const tensor &a, const tensor &b, const char *op) {
    FATHOM_CHECK(a.ne[0] == b.ne[0] && a.ne[1] == b.ne[1], op, "shape mismatch " + shape(a) + " vs " + shape(b));
}

// gelu_tanh(h) rounded to f16 for every f16 bit pattern h (ggml-cpu's ggml_table_gelu_f16).
const uint16_t *gelu_f16_table() {
    static const std::vector<uint16_t> table = [] {
        std::vector<uint16_t> t(65536);
        constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f, kCoef = 0.044715f;
        for (uint32_t h = 0; h < 65536; ++h) {
            const float x = f16_to_f32(static_cast<uint16_t>(h));
            // 1 + a*x*x as one FMA: ggml-cpu is built with -march=native and GCC's default
            // -ffp-contract=fast, and near-tie f16 entries depend on that rounding.
            t[h] = f32_to_f16(0.5f * x * (1.0f + tanhf(kSqrt2OverPi * x * std::fma(kCoef * x, x, 1.0f))));
        }
        return t;
    }();
    return table.data();
}

// Work below this many elements runs on the calling thread: waking workers costs more.
constexpr int64_t kParallelMin = 16384;
// for_rows (norms, rope, residual adds, activation conversion, ...): split from 8192 elements, so the
// [16 x 576] rows of a 16-sequence decode step run on every thread instead of the caller alone.
constexpr int64_t kRowsParallelMin = 8192;

struct scratch_buf {
    std::vector<uint8_t, std::allocator<uint8_t>> bytes;
    uint8_t *get(size_t n) {
        if (bytes.size() < n) bytes.resize(n);
        return bytes.data();
    }
};

// A row-interleaved copy (quants_x8.h) of the first 8 * n_groups rows of a q4_1 / q8_0 weight.
struct x8_weight {
    void *data = nullptr;
    dtype type = dtype::f32;
    int64_t K = 0, n_groups = 0;
    size_t nb1 = 0;
};

// Rows [r0, r1) of W against M activation rows X: whole groups of 8 from the interleaved copy, any
// rows outside them (a range not aligned to 8, the last N % 8 rows) from W's own rows. Both kernels
// give identical results, so the split changes nothing numerically.
void x8_rows(const x8_weight &e, const tensor &W, int64_t r0, int64_t r1, const uint8_t *X,
             size_t x_stride, int64_t M, float *y, int64_t ldy) {
    const int64_t g0 = (r0 + 7) / 8, g1 = std::max(g0, std::min(r1 / 8, e.n_groups));
    const int64_t a = std::min(r1, 8 * g0), b = std::max(a, 8 * g1);
    if (r0 < a) gemm(W.type, e.K, W.data, W.nb1, r0, a, X, x_stride, M, y, ldy);
    if (g0 < g1) x8_gemm(W.type, e.K, e.data, g0, g1, X, x_stride, M, y, ldy);
    if (b < r1) gemm(W.type, e.K, W.data, W.nb1, b, r1, X, x_stride, M, y, ldy);
}

struct kv_source;  // where attention reads K/V (contiguous or paged), defined with the attention ops

class cpu_backend final : public backend {
public:
    explicit cpu_backend(const cpu_options &o) : opts_(o), pool_(std::max(1, o.n_threads)) {
        const int nth = pool_.size();
        thread_f32_.resize(static_cast<size_t>(nth));
        // Size scratch now so the first forward does not allocate either.
        if (o.max_cols > 0 && o.max_rows > 0)
            for (auto &s : act_) s.get(static_cast<size_t>(o.max_cols * o.max_rows) * sizeof(float) + 64);
        grow_thread_scratch(std::max<int64_t>(o.max_cols, o.max_ctx + 1024));
    }
    ~cpu_backend() override {
        for (auto &[p, n] : maps_) munmap(p, n);
    }

    const char *name() const override { return "cpu"; }
    int n_threads() const override { return pool_.size(); }

    void *alloc(size_t bytes) override {
        // Anonymous mappings: zero-filled and backed lazily, so a KV cache sized to n_ctx only
        // costs resident memory for the positions actually written.
        const size_t n = std::max<size_t>(bytes, 1);
        void *p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw error("cpu backend: cannot allocate " + std::to_string(bytes) + " bytes");
        maps_[p] = n;
        return p;
    }
    void release(void *ptr) override {
        auto it = maps_.find(ptr);
        if (it == maps_.end()) return;
        munmap(it->first, it->second);
        maps_.erase(it);
    }
    void *map_weights(const void *host, size_t bytes) override {
        weight_ranges_.emplace_back(static_cast<const uint8_t *>(host), bytes);  // eligible for repacking
        return const_cast<void *>(host);
    }
    void upload(const tensor &dst, const void *host) override {
        FATHOM_CHECK(dst.contiguous(), "upload", "destination must be contiguous");
        std::memcpy(dst.data, host, dst.nbytes());
    }
    void download(const tensor &src, void *host) override {
        FATHOM_CHECK(src.contiguous(), "download", "source must be contiguous");
        std::memcpy(host, src.data, src.nbytes());
    }
    void synchronize() override {}

    void get_rows(const tensor &table, const int32_t *ids, int64_t n, const tensor &out) override;
    void mul_mat(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) override;
    void rms_norm(const tensor &x, const tensor *w, float eps, const tensor &out) override;
    void rope_table(int64_t p0, int64_t n, const rope_params &p, const tensor &out) override;
    void rope(const tensor &x, int32_t head_dim, const tensor &table, rope_mode mode) override;
    void kv_store(const tensor &src, const tensor &cache, int32_t n_head_kv, int64_t n_ctx, int64_t p0) override;
    void attention(const tensor &q, const tensor &k, const tensor &v, const attn_params &p,
                   const tensor &out) override;
    bool supports_paged_kv() const override { return true; }
    void kv_store_paged(const tensor &k_src, const tensor &v_src, const kv_pages &kv, int64_t p0) override;
    void attention_paged(const tensor &q, const kv_pages &kv, const attn_params &p, const tensor &out) override;
    void attention_paged_rows(const tensor &q, std::span<const kv_pages> kv, std::span<const int64_t> n_past,
                              const attn_params &p, const tensor &out) override;
    void glu(const tensor &gate, const tensor &up, glu_kind kind, const tensor &out) override;
    void add(const tensor &a, const tensor &b, const tensor &out) override;
    void scale(const tensor &x, float s) override;
    void softcap(const tensor &x, float cap) override;
    void softmax(const tensor &x) override;
    void copy(const tensor &src, const tensor &dst) override;

private:
    // Run fn(r0, r1) over rows [0, n) split across threads when the work (n*cost) is large enough.
    template <class F>
    void for_rows(int64_t n, int64_t cost, F &&fn) {
        if (n <= 1 || n * cost < kRowsParallelMin || pool_.size() == 1) {
            fn(int64_t{0}, n);
            return;
        }
        pool_.run([&](int ith, int nth) {
            int64_t r0, r1;
            split_range(n, ith, nth, 1, r0, r1);
            if (r0 < r1) fn(r0, r1);
        }, static_cast<int>(std::min<int64_t>(n, pool_.size())));
    }
    void grow_thread_scratch(int64_t n_floats) {
        for (auto &s : thread_f32_) s.get(static_cast<size_t>(n_floats) * sizeof(float));
    }
    void mul_mat_exact(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out);
    void attention_rows(const tensor &q, const kv_source &src, const attn_params &p, const tensor &out);
    void attention_blocks(const tensor &q, const kv_source &src, const attn_params &p, const tensor &out);

    cpu_options opts_;
    thread_pool pool_;
    scratch_buf act_[4];                    // x converted to each distinct vec_dot_type of one mul_mat
    std::vector<scratch_buf> thread_f32_;   // per-thread f32 scratch (dequantised rows, scores)
    std::unordered_map<void *, size_t> maps_;

    // ---- weight preparation (repack.h) ------------------------------------------------------
    // Q4_K weights from map_weights (read-only file pages, so their bytes never change) are
    // repacked into 8-row interleaved blocks on first use by mul_mat, as llama.cpp's CPU_REPACK
    // buffer does at load; the source pages are then reclaimed (MADV_PAGEOUT: refaulted from the
    // file if get_rows ever reads them). Keyed by the tensor's data pointer.
    struct repacked {
        std::vector<uint8_t> bytes;
        int64_t K = 0, N = 0;
    };
    const uint8_t *prepared_q4k(const tensor &W);
    void prepare_weight(const tensor &w) override {
        if (opts_.exact) return;  // the reference path reads the GGUF rows as they are
        prepared_q4k(w);
        prepared_x8(w);
    }
    std::vector<std::pair<const uint8_t *, size_t>> weight_ranges_;
    std::unordered_map<const void *, repacked> repacked_;

    // Row-interleaved copies of q4_1 / q8_0 weights from map_weights (quants_x8.h: same results,
    // fewer instructions), made on first use by mul_mat and keyed by the tensor's data pointer. The
    // original rows stay in place (get_rows reads the tied embedding table from them).
    const x8_weight *prepared_x8(const tensor &W);
    std::unordered_map<const void *, x8_weight> x8_;
};

// ---- get_rows ------------------------------------------------------------------------------------

void cpu_backend::get_rows(const tensor &table, const int32_t *ids, int64_t n, const tensor &out) {
    check_f32(out, "get_rows", "out");
    FATHOM_CHECK(out.ne[0] == table.ne[0] && out.ne[1] == n, "get_rows", "out " + shape(out) + " vs table " + shape(table));
    FATHOM_CHECK(dtype_info(table.type).compute, "get_rows", "unsupported table type " + shape(table));
    for (int64_t i = 0; i < n; ++i)
        FATHOM_CHECK(ids[i] >= 0 && ids[i] < table.ne[1], "get_rows",
              "token id " + std::to_string(ids[i]) + " outside [0, " + std::to_string(table.ne[1]) + ")");
    for_rows(n, table.ne[0], [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i)
            dequantize_row(table.type, row_ptr<uint8_t>(table, ids[i]), row_ptr<float>(out, i), table.ne[0]);
    });
}

// ---- mul_mat -------------------------------------------------------------------------------------

void cpu_backend::mul_mat(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) {
    check_f32(x, "mul_mat", "x");
    FATHOM_CHECK(n_pairs >= 1 && n_pairs <= 8, "mul_mat", "1..8 weight/output pairs");
    const int64_t K = x.ne[0], M = x.ne[1];
    int64_t total_rows = 0;
    for (int i = 0; i < n_pairs; ++i) {
        const tensor &W = *w[i], &Y = *out[i];
        FATHOM_CHECK(W.ne[0] == K, "mul_mat", "weight " + shape(W) + " does not take " + std::to_string(K) + " inputs");
        FATHOM_CHECK(dtype_info(W.type).compute, "mul_mat", "unsupported weight type " + shape(W));
        check_f32(Y, "mul_mat", "out");
        FATHOM_CHECK(Y.ne[0] == W.ne[1] && Y.ne[1] == M, "mul_mat", "out " + shape(Y) + " for weight " + shape(W) +
              " and x " + shape(x));
        total_rows += W.ne[1];
    }
    if (M == 0) return;
    if (opts_.exact) {
        mul_mat_exact(x, n_pairs, w, out);
        return;
    }

    // Repacked Q4_K (repack.h). llama.cpp order (batch_invariant off): rows [0, M - M % 4) go
    // through its GEMM (their q8_K from ggml_quantize_mat_q8_K_4x8: the `x4` conversion below), the
    // rest through its GEMV. Batch-invariant mode: every row in GEMV order and plain q8_K.
    const uint8_t *rp[8];
    for (int i = 0; i < n_pairs; ++i) rp[i] = prepared_q4k(*w[i]);
    const x8_weight *px[8];  // row-interleaved q4_1 / q8_0 copies (quants_x8.h), or null
    for (int i = 0; i < n_pairs; ++i) px[i] = prepared_x8(*w[i]);
    const int64_t gemm_rows = opts_.batch_invariant ? 0 : M - M % 4;
    // llama.cpp sends K-quant weights it did not repack through ggml-cpu's tiled matmul once a
    // batch has >= 8 rows (another float order; repack.h). Mirrored for q6_K in llama.cpp mode
    // only; batch-invariant mode keeps the vec_dot order (llama.cpp's order for 1..7 rows).
    const bool q6_tiled = !opts_.batch_invariant && M >= kTiledMinRows;

    // 1. Convert x once per distinct activation type.
    const void *xq[8];
    size_t xs[8];
    dtype seen_t[4];
    bool seen_x4[4];
    const void *seen_p[4];
    size_t seen_s[4];
    int n_seen = 0;
    for (int i = 0; i < n_pairs; ++i) {
        const dtype vt = vec_dot_type(w[i]->type);
        const bool x4 = rp[i] && gemm_rows > 0;
        int j = 0;
        while (j < n_seen && (seen_t[j] != vt || seen_x4[j] != x4)) ++j;
        if (j == n_seen) {
            FATHOM_CHECK(n_seen < 4, "mul_mat", "too many distinct activation types");
            const size_t rb = dtype_row_bytes(vt, K);
            FATHOM_CHECK(K % dtype_info(vt).block_size == 0, "mul_mat",
                  std::to_string(K) + " inputs not a multiple of the " + std::string(dtype_name(vt)) + " block");
            if (vt == dtype::f32) {
                seen_p[j] = x.data;
                seen_s[j] = x.nb1;
            } else {
                uint8_t *buf = act_[j].get(rb * static_cast<size_t>(M));
                for_rows(M, K * 4, [&](int64_t r0, int64_t r1) {
                    for (int64_t m = r0; m < r1; ++m) {
                        uint8_t *dst = buf + rb * static_cast<size_t>(m);
                        if (x4 && m < gemm_rows) quantize_row_q8_k_x4(row_ptr<float>(x, m), dst, K);
                        else quantize_row_act(vt, row_ptr<float>(x, m), dst, K);
                    }
                });
                seen_p[j] = buf;
                seen_s[j] = rb;
            }
            seen_t[j] = vt;
            seen_x4[j] = x4;
            ++n_seen;
        }
        xq[i] = seen_p[j];
        xs[i] = seen_s[j];
    }

    // 2. Split the concatenated output rows of all pairs across threads in dynamic blocks of rows
    // (multiples of 16, so interleaved groups of 8 stay whole). Small M (decode, up to a serving
    // batch of 32): ~8 blocks per thread, so a thread that starts late (or runs slower) simply takes
    // fewer, and per-call set-up (activation scales, panel decode) is amortised over many groups.
    // Large M (prefill): 32 rows, each block swept over M in chunks so its weights stay in cache
    // while the activations stream.
    const int64_t row_block =
        M <= 32 ? std::max<int64_t>(16, (total_rows / (8 * pool_.size()) + 15) / 16 * 16) : 32;
    std::atomic<int64_t> next{0};
    auto do_rows = [&](int64_t a, int64_t b) {  // rows [a, b) of the concatenation
        int64_t off = 0;
        for (int i = 0; i < n_pairs && a < b; ++i) {
            const tensor &W = *w[i], &Y = *out[i];
            const int64_t n_i = W.ne[1];
            const int64_t r0 = std::max(a, off) - off, r1 = std::min(b, off + n_i) - off;
            if (r0 < r1) {
                constexpr int64_t kMChunk = 64;
                for (int64_t m0 = 0; m0 < M; m0 += kMChunk) {
                    const int64_t mc = std::min(kMChunk, M - m0);
                    if (q6_tiled && W.type == dtype::q6_k) {  // llama.cpp's tiled K-quant matmul order
                        q6k_mul_tiled(K, W.data, W.nb1, r0, r1, static_cast<const uint8_t *>(xq[i]) + xs[i] * m0, xs[i],
                                      mc, row_ptr<float>(Y, m0), static_cast<int64_t>(Y.nb1 / sizeof(float)));
                        continue;
                    }
                    if (rp[i]) {  // m0 % 4 == 0, so chunk rows below gemm_rows - m0 are whole GEMM tiles
                        q4k_x8_mul(K, rp[i], r0, r1, static_cast<const uint8_t *>(xq[i]) + xs[i] * m0, xs[i], mc,
                                   std::clamp<int64_t>(gemm_rows - m0, 0, mc), row_ptr<float>(Y, m0),
                                   static_cast<int64_t>(Y.nb1 / sizeof(float)));
                        continue;
                    }
                    if (px[i]) {
                        x8_rows(*px[i], W, r0, r1, static_cast<const uint8_t *>(xq[i]) + xs[i] * m0, xs[i], mc,
                                row_ptr<float>(Y, m0), static_cast<int64_t>(Y.nb1 / sizeof(float)));
                        continue;
                    }
                    gemm(W.type, K, W.data, W.nb1, r0, r1, static_cast<const uint8_t *>(xq[i]) + xs[i] * m0, xs[i],
                         mc, row_ptr<float>(Y, m0), static_cast<int64_t>(Y.nb1 / sizeof(float)));
                }
            }
            off += n_i;
        }
    };
    const int64_t work = total_rows * K * M;
    if (work < kParallelMin * 4 || pool_.size() == 1) {
        do_rows(0, total_rows);
        return;
    }
    pool_.run([&](int, int) {
        for (;;) {
            const int64_t a = next.fetch_add(row_block, std::memory_order_relaxed);
            if (a >= total_rows) break;
            do_rows(a, std::min(total_rows, a + row_block));
        }
    });
}

// The repacked form of W if it is a Q4_K weight from map_weights that the AVX2 kernels take
// (llama.cpp: Q4_K with N % 8 == 0 on AVX2), repacking it on first use; null otherwise.
const uint8_t *cpu_backend::prepared_q4k(const tensor &W) {
    if (W.type != dtype::q4_k || W.ne[1] % 8 != 0 || W.ne[0] % 256 != 0 || W.ne[1] == 0 || !W.contiguous() ||
        detected_isa() == isa::scalar)
        return nullptr;
    if (auto it = repacked_.find(W.data); it != repacked_.end())
        return it->second.K == W.ne[0] && it->second.N == W.ne[1] ? it->second.bytes.data() : nullptr;
    const auto *p = static_cast<const uint8_t *>(W.data);
    const size_t n = W.nbytes();
    bool mapped = false;
    for (const auto &[base, len] : weight_ranges_)
        mapped = mapped || (p >= base && n <= len && static_cast<size_t>(p - base) <= len - n);
    if (!mapped) return nullptr;  // activations or test buffers: contents may change, never cache
    repacked &r = repacked_[W.data];
    r.K = W.ne[0];
    r.N = W.ne[1];
    r.bytes.resize(q4k_x8_bytes(r.K, r.N));
    const size_t group_bytes = static_cast<size_t>(r.K / 256) * q4k_x8_block_bytes;  // 8 rows
    for_rows(r.N / 8, r.K * 8, [&](int64_t g0, int64_t g1) {
        q4k_x8_repack(p + static_cast<size_t>(g0 * 8) * W.nb1, W.nb1, r.K, (g1 - g0) * 8,
                      r.bytes.data() + group_bytes * static_cast<size_t>(g0));
    });
    // Reclaim the pages wholly inside the tensor so resident memory does not hold both copies.
    // MADV_PAGEOUT, not MADV_DONTNEED: clean file pages are dropped (refaulted from the GGUF if
    // read again) while anonymous memory a caller passed to map_weights keeps its contents.
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
    if (hi > lo) madvise(reinterpret_cast<void *>(lo), hi - lo, MADV_PAGEOUT);  // best effort: errors ignored
    return r.bytes.data();
}

// The row-interleaved copy of W (quants_x8.h) if W is a q4_1 / q8_0 weight from map_weights with
// at least 8 rows, packing it on first use; null otherwise (then mul_mat reads W's own rows).
const x8_weight *cpu_backend::prepared_x8(const tensor &W) {
    if (!x8_supported(W.type) || W.ne[1] < 8 || W.ne[0] % 32 != 0) return nullptr;
    if (auto it = x8_.find(W.data); it != x8_.end()) {
        const x8_weight &e = it->second;
        return e.type == W.type && e.K == W.ne[0] && e.n_groups == W.ne[1] / 8 && e.nb1 == W.nb1 ? &e : nullptr;
    }
    const auto *p = static_cast<const uint8_t *>(W.data);
    const size_t n = static_cast<size_t>(W.ne[1] - 1) * W.nb1 + dtype_row_bytes(W.type, W.ne[0]);
    bool mapped = false;
    for (const auto &[base, len] : weight_ranges_)
        mapped = mapped || (p >= base && n <= len && static_cast<size_t>(p - base) <= len - n);
    if (!mapped) return nullptr;  // activations or test buffers: contents may change, never cache
    x8_weight e;
    e.type = W.type;
    e.K = W.ne[0];
    e.n_groups = W.ne[1] / 8;
    e.nb1 = W.nb1;
    const size_t bytes = x8_bytes(e.type, e.K, e.n_groups);
    e.data = alloc(bytes);
    // Huge pages where the kernel allows them: fewer page faults while packing, fewer TLB misses
    // while streaming the weights each token. Advisory only.
    madvise(e.data, bytes, MADV_HUGEPAGE);
    for_rows(e.n_groups, e.K * 8, [&](int64_t g0, int64_t g1) { x8_pack(e.type, e.K, p, W.nb1, g0, g1, e.data); });
    // As for Q4_K above: drop the file pages wholly inside the packed rows so resident memory does
    // not hold both copies (map_weights memory is the read-only file mapping; get_rows refaults the
    // few pages of a tied embedding table it reads).
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + static_cast<size_t>(8 * e.n_groups) * W.nb1) / page * page;
    if (hi > lo) madvise(reinterpret_cast<void *>(lo), hi - lo, MADV_DONTNEED);
    return &(x8_[W.data] = e);
}

// Reference numerics: each weight row dequantised to f32 once, dotted with f32 activations.
void cpu_backend::mul_mat_exact(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) {
    const int64_t K = x.ne[0], M = x.ne[1];
    int64_t total_rows = 0;
    for (int i = 0; i < n_pairs; ++i) total_rows += w[i]->ne[1];
    grow_thread_scratch(K);
    const auto &vk = vec();
    pool_.run([&](int ith, int nth) {
        int64_t a, b;
        split_range(total_rows, ith, nth, 1, a, b);
        float *buf = reinterpret_cast<float *>(thread_f32_[static_cast<size_t>(ith)].bytes.data());
        int64_t off = 0;
        for (int i = 0; i < n_pairs; ++i) {
            const tensor &W = *w[i], &Y = *out[i];
            const int64_t r0 = std::max(a, off) - off, r1 = std::min(b, off + W.ne[1]) - off;
            for (int64_t r = r0; r < r1; ++r) {
                const float *wr = buf;
                if (W.type == dtype::f32) wr = row_ptr<const float>(W, r);
                else dequantize_row(W.type, row_ptr<const uint8_t>(W, r), buf, K);
                for (int64_t m = 0; m < M; ++m) row_ptr<float>(Y, m)[r] = vk.dot_f32(K, wr, row_ptr<const float>(x, m));
            }
            off += W.ne[1];
        }
    }, static_cast<int>(std::min<int64_t>(total_rows, pool_.size())));
}

// ---- norms, rope -----------------------------------------------------------------------------

void cpu_backend::rms_norm(const tensor &x, const tensor *w, float eps, const tensor &out) {
    check_f32(x, "rms_norm", "x");
    check_f32(out, "rms_norm", "out");
    check_same(x, out, "rms_norm");
    if (w) {
        FATHOM_CHECK(w->type == dtype::f32 && w->ne[0] == x.ne[0], "rms_norm", "weight " + shape(*w) + " for x " + shape(x));
    }
    const int64_t n = x.ne[0];
    for_rows(x.ne[1], n, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *xr = row_ptr<const float>(x, r);
            float *yr = row_ptr<float>(out, r);
            double ss = 0;  // double accumulation, as ggml does
            for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i] * xr[i]);
            const float s = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
            if (w) {
                const float *wr = static_cast<const float *>(w->data);
                for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] * s) * wr[i];
            } else {
                for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * s;
            }
        }
    });
}

namespace {
// YaRN correction range: the dims whose wavelength spans fewer than `n_rot_turns` turns over the
// original context (ggml_rope_yarn_corr_dims).
float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot_turns, float base) {
    return static_cast<float>(n_dims * std::log(n_ctx_orig / (n_rot_turns * 2.0 * M_PI)) / (2.0 * std::log(base)));
}
}  // namespace

void cpu_backend::rope_table(int64_t p0, int64_t n, const rope_params &p, const tensor &out) {
    check_f32(out, "rope_table", "out");
    FATHOM_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0, "rope_table", "n_rot must be positive and even");
    FATHOM_CHECK(out.ne[0] == p.n_rot && out.ne[1] == n, "rope_table", "out " + shape(out));
    FATHOM_CHECK(p.freq_base > 0 && p.freq_scale > 0, "rope_table", "freq_base and freq_scale must be positive");
    const int half = p.n_rot / 2;
    float corr0 = 0, corr1 = 0;
    if (p.ext_factor != 0.0f) {
        FATHOM_CHECK(p.n_ctx_orig > 0, "rope_table", "YaRN needs the original context length");
        corr0 = std::max(0.0f, std::floor(yarn_corr_dim(p.n_rot, p.n_ctx_orig, p.beta_fast, p.freq_base)));
        corr1 = std::min(static_cast<float>(p.n_rot - 1),
                         std::ceil(yarn_corr_dim(p.n_rot, p.n_ctx_orig, p.beta_slow, p.freq_base)));
    }
    float mscale = p.attn_factor;
    if (p.ext_factor != 0.0f) mscale *= 1.0f + 0.1f * std::log(1.0f / p.freq_scale);
    if (!opts_.exact) {
        // Fast mode: ggml's float recurrence (theta_i = pos * theta_scale^i, multiplied up one
        // step at a time with theta_scale = powf(base, -2/n_rot)), then cosf/sinf. Its rounding
        // drifts ~1e-6 relative from the exact angle at the last dimensions; llama.cpp's K/Q carry
        // exactly that drift.
        const float theta_scale = powf(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
        for (int64_t t = 0; t < n; ++t) {
            float *row = row_ptr<float>(out, t);
            float theta_base = static_cast<float>(p0 + t);
            for (int i = 0; i < half; ++i, theta_base *= theta_scale) {
                const float theta_extrap = p.freq_factors ? theta_base / p.freq_factors[i] : theta_base;
                float theta = p.freq_scale * theta_extrap;
                if (p.ext_factor != 0.0f) {
                    const float y = (static_cast<float>(i) - corr0) / std::max(0.001f, corr1 - corr0);
                    const float ramp = (1.0f - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
                    theta = theta * (1.0f - ramp) + theta_extrap * ramp;
                }
                row[2 * i] = cosf(theta) * mscale;
                row[2 * i + 1] = sinf(theta) * mscale;
            }
        }
        return;
    }
    for (int64_t t = 0; t < n; ++t) {
        float *row = row_ptr<float>(out, t);
        const double pos = static_cast<double>(p0 + t);
        for (int i = 0; i < half; ++i) {
            double theta_extrap = pos * std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.n_rot);
            if (p.freq_factors) theta_extrap /= p.freq_factors[i];
            double theta = p.freq_scale * theta_extrap;
            if (p.ext_factor != 0.0f) {
                const float y = (static_cast<float>(i) - corr0) / std::max(0.001f, corr1 - corr0);
                const float ramp = (1.0f - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
                theta = theta * (1.0 - ramp) + theta_extrap * ramp;
            }
            row[2 * i] = static_cast<float>(std::cos(theta)) * mscale;
            row[2 * i + 1] = static_cast<float>(std::sin(theta)) * mscale;
        }
    }
}

void cpu_backend::rope(const tensor &x, int32_t head_dim, const tensor &table, rope_mode mode) {
    check_f32(x, "rope", "x");
    check_f32(table, "rope", "table");
    const int64_t n_rot = table.ne[0];
    FATHOM_CHECK(head_dim > 0 && x.ne[0] % head_dim == 0, "rope", "row of " + std::to_string(x.ne[0]) +
          " is not whole heads of " + std::to_string(head_dim));
    FATHOM_CHECK(n_rot <= head_dim && table.ne[1] == x.ne[1], "rope", "table " + shape(table) + " for x " + shape(x));
    const int64_t n_head = x.ne[0] / head_dim, half = n_rot / 2;
    const int64_t stride = mode == rope_mode::normal ? 1 : half;  // distance between pair members
    const int64_t step = mode == rope_mode::normal ? 2 : 1;       // distance between pairs
    const bool fused = !opts_.exact;
    for_rows(x.ne[1], x.ne[0], [&](int64_t r0, int64_t r1) {
        for (int64_t t = r0; t < r1; ++t) {
            const float *cs = row_ptr<const float>(table, t);
            float *xr = row_ptr<float>(x, t);
            for (int64_t h = 0; h < n_head; ++h) {
                float *xh = xr + h * head_dim;
                for (int64_t i = 0; i < half; ++i) {
                    float *a = xh + i * step, *b = a + stride;
                    const float c = cs[2 * i], s = cs[2 * i + 1], x0 = *a, x1 = *b;
                    if (fused) {  // ggml's rotation as GCC compiles it with FMA contraction
                        *a = std::fma(x0, c, -(x1 * s));
                        *b = std::fma(x0, s, x1 * c);
                    } else {
                        *a = x0 * c - x1 * s;
                        *b = x0 * s + x1 * c;
                    }
                }
            }
        }
    });
}

// ---- KV cache and attention ------------------------------------------------------------------

// Where attention finds the K or V rows (positions) of one kv head: a contiguous cache (blocks
// null: row j at base + j * nb1) or a paged sequence (row j at blocks[j >> shift] + off +
// (j & mask) * nb1). Both kinds go through the same loops below, so paged and contiguous attention
// perform the same operations in the same order (bit-identical results).
struct kv_rows {
    uint8_t *const *blocks = nullptr;
    uint8_t *base = nullptr;
    size_t off = 0, nb1 = 0;
    int shift = 0;
    int64_t mask = 0;
    template <class T>
    T *row(int64_t j) const {
        uint8_t *p = blocks ? blocks[j >> shift] + off + static_cast<size_t>(j & mask) * nb1
                            : base + static_cast<size_t>(j) * nb1;
        return reinterpret_cast<T *>(p);
    }
    // First row of the memory-contiguous run holding row j, and the end (exclusive) of that run.
    int64_t run_start(int64_t j) const { return blocks ? (j & ~mask) : 0; }
    int64_t run_end(int64_t j) const { return blocks ? (j | mask) + 1 : INT64_MAX; }
};

// The K and V of one attention call: either contiguous caches [n_head_kv * n_ctx, head_dim] or one
// layer of a paged sequence.
struct kv_source {
    const tensor *k = nullptr, *v = nullptr;  // contiguous
    int64_t n_ctx = 0;
    const kv_pages *pg = nullptr;             // paged
    dtype type = dtype::f16;

    kv_rows rows(int64_t hk, bool is_v) const {
        kv_rows r;
        if (pg) {
            r.blocks = pg->blocks;
            r.nb1 = dtype_row_bytes(pg->type, pg->head_dim);
            r.off = (is_v ? pg->v_offset : pg->k_offset) + static_cast<size_t>(hk) * static_cast<size_t>(pg->block_tokens) * r.nb1;
            r.shift = std::countr_zero(static_cast<uint32_t>(pg->block_tokens));
            r.mask = pg->block_tokens - 1;
        } else {
            const tensor &t = is_v ? *v : *k;
            r.nb1 = t.nb1;
            r.base = static_cast<uint8_t *>(t.data) + static_cast<size_t>(hk * n_ctx) * t.nb1;
        }
        return r;
    }
};

void check_pages(const kv_pages &kv, const char *op) {
    FATHOM_CHECK(kv.blocks != nullptr && kv.n_blocks > 0, op, "empty block table");
    FATHOM_CHECK(kv.block_tokens >= 8 && std::has_single_bit(static_cast<uint32_t>(kv.block_tokens)), op,
                 "block size " + std::to_string(kv.block_tokens) + " is not a power of two >= 8");
    FATHOM_CHECK(kv.type == dtype::f16 || kv.type == dtype::f32, op, "cache must be f16 or f32");
    FATHOM_CHECK(kv.n_head_kv > 0 && kv.head_dim > 0, op, "bad head geometry");
}

void cpu_backend::kv_store(const tensor &src, const tensor &cache, int32_t n_head_kv, int64_t n_ctx, int64_t p0) {
    check_f32(src, "kv_store", "src");
    FATHOM_CHECK(cache.type == dtype::f32 || cache.type == dtype::f16, "kv_store", "cache must be f16 or f32");
    FATHOM_CHECK(n_head_kv > 0 && src.ne[0] == n_head_kv * cache.ne[0] && cache.ne[1] == n_head_kv * n_ctx, "kv_store",
          "src " + shape(src) + " vs cache " + shape(cache));
    FATHOM_CHECK(p0 >= 0 && p0 + src.ne[1] <= n_ctx, "kv_store", "positions beyond the cache");
    const int64_t hd = cache.ne[0];
    const auto &vk = vec();
    for (int64_t t = 0; t < src.ne[1]; ++t) {
        const float *s = row_ptr<const float>(src, t);
        for (int64_t h = 0; h < n_head_kv; ++h) {
            const int64_t row = h * n_ctx + p0 + t;
            if (cache.type == dtype::f16) vk.f32_to_f16_row(hd, s + h * hd, row_ptr<uint16_t>(cache, row));
            else std::memcpy(row_ptr<float>(cache, row), s + h * hd, static_cast<size_t>(hd) * sizeof(float));
        }
    }
}

void cpu_backend::kv_store_paged(const tensor &k_src, const tensor &v_src, const kv_pages &kv, int64_t p0) {
    check_f32(k_src, "kv_store_paged", "k");
    check_f32(v_src, "kv_store_paged", "v");
    check_same(k_src, v_src, "kv_store_paged");
    check_pages(kv, "kv_store_paged");
    const int64_t hd = kv.head_dim;
    FATHOM_CHECK(k_src.ne[0] == kv.n_head_kv * hd, "kv_store_paged", "src " + shape(k_src) + " is not kv heads x head_dim");
    FATHOM_CHECK(p0 >= 0 && p0 + k_src.ne[1] <= kv.n_blocks * kv.block_tokens, "kv_store_paged",
                 "positions beyond the block table");
    const kv_source src{nullptr, nullptr, 0, &kv, kv.type};
    const auto &vk = vec();
    for (int64_t h = 0; h < kv.n_head_kv; ++h) {
        const kv_rows kr = src.rows(h, false), vr = src.rows(h, true);
        for (int64_t t = 0; t < k_src.ne[1]; ++t) {
            const float *ks = row_ptr<const float>(k_src, t) + h * hd, *vs = row_ptr<const float>(v_src, t) + h * hd;
            if (kv.type == dtype::f16) {
                vk.f32_to_f16_row(hd, ks, kr.row<uint16_t>(p0 + t));
                vk.f32_to_f16_row(hd, vs, vr.row<uint16_t>(p0 + t));
            } else {
                std::memcpy(kr.row<float>(p0 + t), ks, static_cast<size_t>(hd) * sizeof(float));
                std::memcpy(vr.row<float>(p0 + t), vs, static_cast<size_t>(hd) * sizeof(float));
            }
        }
    }
}

void cpu_backend::attention(const tensor &q, const tensor &k, const tensor &v, const attn_params &p,
                            const tensor &out) {
    FATHOM_CHECK(k.type == v.type && (k.type == dtype::f16 || k.type == dtype::f32), "attention", "cache must be f16 or f32");
    FATHOM_CHECK(k.ne[0] == p.head_dim && v.ne[0] == p.head_dim && k.ne[1] == p.n_head_kv * p.n_ctx &&
          v.ne[1] == k.ne[1], "attention", "cache " + shape(k) + " vs head layout");
    FATHOM_CHECK(p.n_past >= 0 && p.n_past + q.ne[1] <= p.n_ctx, "attention", "positions beyond the cache");
    attention_rows(q, kv_source{&k, &v, p.n_ctx, nullptr, k.type}, p, out);
}

void cpu_backend::attention_paged(const tensor &q, const kv_pages &kv, const attn_params &p, const tensor &out) {
    check_pages(kv, "attention_paged");
    FATHOM_CHECK(kv.head_dim == p.head_dim && kv.n_head_kv == p.n_head_kv, "attention_paged", "pages vs head layout");
    FATHOM_CHECK(p.n_past >= 0 && p.n_past + q.ne[1] <= kv.n_blocks * kv.block_tokens, "attention_paged",
                 "positions beyond the block table");
    attention_rows(q, kv_source{nullptr, nullptr, 0, &kv, kv.type}, p, out);
}

void cpu_backend::attention_rows(const tensor &q, const kv_source &src, const attn_params &p, const tensor &out) {
    check_f32(q, "attention", "q");
    check_f32(out, "attention", "out");
    check_same(q, out, "attention");
    FATHOM_CHECK(p.n_head > 0 && p.n_head_kv > 0 && p.n_head % p.n_head_kv == 0 && p.head_dim > 0, "attention",
          "bad head counts");
    FATHOM_CHECK(q.ne[0] == static_cast<int64_t>(p.n_head) * p.head_dim, "attention", "q " + shape(q) + " is not heads x head_dim");
    const int64_t n_tok = q.ne[1];
    grow_thread_scratch(p.n_past + n_tok + 33 * p.head_dim);
    const int64_t hd = p.head_dim, group = p.n_head / p.n_head_kv;
    const bool f16 = src.type == dtype::f16;
    const auto &vk = vec();
    const int64_t n_items = n_tok * p.n_head;  // (token, head) pairs, split across threads
    // Fast mode mirrors llama.cpp's CPU attention without flash attention: KQ = mul_mat(K f16,
    // Q -> f16) with f32 accumulation, soft_max_ext (scale, max subtraction, sum in double, rows
    // normalised), then KQV = mul_mat(V f16, P -> f16). Exact mode keeps q and the probabilities in
    // f32 and normalises once at the end.
    const bool mirror = !opts_.exact;
    // llama.cpp: ggml_vec_dot_f16 instead of tinyBLAS for one token; batch-invariant mode always takes
    // the batch order so a token's output does not depend on how many share its call.
    const bool single = n_tok == 1 && !opts_.batch_invariant;
    if (mirror && !single && f16) {
        attention_blocks(q, src, p, out);
        return;
    }
    auto body = [&](int ith, int nth) {
        float *scores = reinterpret_cast<float *>(thread_f32_[static_cast<size_t>(ith)].bytes.data());
        float *acc = scores + p.n_past + n_tok;  // [hd] (exact) or [8 or 32][hd] lanes (fast)
        float *q16 = acc + 32 * hd;              // q rounded through f16 (fast mode)
        int64_t a, b;
        split_range(n_items, ith, nth, 1, a, b);
        for (int64_t it = a; it < b; ++it) {
            const int64_t t = it / p.n_head, h = it % p.n_head, hk = h / group;
            const int64_t pos = p.n_past + t;
            const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
            const float *qr = row_ptr<const float>(q, t) + h * hd;
            if (mirror) {
                vk.round_f16(hd, qr, 1.0f, q16);
                qr = q16;
            }
            const kv_rows kr = src.rows(hk, false), vr = src.rows(hk, true);
            float mx = -INFINITY;
            for (int64_t j = lo; j <= pos; ++j) {
                float s;
                if (!f16) s = vk.dot_f32(hd, kr.row<const float>(j), qr);
                else if (mirror && single) s = vk.dot_f16_ggml(hd, kr.row<const uint16_t>(j), qr);
                else if (mirror) s = vk.dot_f16_lanes(hd, kr.row<const uint16_t>(j), qr);
                else s = vk.dot_f16(hd, kr.row<const uint16_t>(j), qr);
                s *= p.scale;
                if (p.softcap > 0) s = p.softcap * std::tanh(s / p.softcap);
                scores[j] = s;
                mx = std::max(mx, s);
            }
            float *o = row_ptr<float>(out, t) + h * hd;
            if (mirror) {
                // Probabilities over cells [0, pos] (masked cells below lo are exact zeros, as in
                // llama.cpp's masked row), so the 8-groups of the sum align with ggml's.
                std::fill(scores, scores + lo, -INFINITY);
                const double sum = vk.softmax_exp(pos + 1, scores, mx, scores);
                const float inv = static_cast<float>(1.0 / sum);
                vk.round_f16(pos + 1 - lo, scores + lo, inv, scores + lo);  // P -> f16, as llama.cpp's KQV input
                // KQV: batches of several tokens go through tinyBLAS (lane = cell mod 8, FMAs in
                // cell order, hsum tree); a single token through ggml_vec_dot_f16 (lane = cell mod
                // 32: four 8-lane accumulators, reduced 0+2, 1+3, 0+1, then two hadds).
                const int n_lanes = single ? 32 : 8;
                float *lanes = acc;  // [n_lanes][hd]
                std::fill(lanes, lanes + n_lanes * hd, 0.0f);
                for (int64_t j = lo; j <= pos; ++j) {
                    const float pj = scores[j];
                    float *lane = lanes + (j & (n_lanes - 1)) * hd;
                    if (f16) vk.axpy_f16(hd, pj, vr.row<const uint16_t>(j), lane);
                    else vk.axpy_f32(hd, pj, vr.row<const float>(j), lane);
                }
                for (int64_t i = 0; i < hd; ++i) {
                    const float *l = lanes + i;
                    if (single) {
                        float x[8];
                        for (int c = 0; c < 8; ++c)
                            x[c] = (l[c * hd] + l[(16 + c) * hd]) + (l[(8 + c) * hd] + l[(24 + c) * hd]);
                        const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
                        o[i] = (t0 + t1) + (t2 + t3);
                    } else {
                        o[i] = ((l[0] + l[4 * hd]) + (l[2 * hd] + l[6 * hd])) + ((l[hd] + l[5 * hd]) + (l[3 * hd] + l[7 * hd]));
                    }
                }
                continue;
            }
            float sum = 0;
            for (int64_t j = lo; j <= pos; ++j) {
                scores[j] = std::exp(scores[j] - mx);
                sum += scores[j];
            }
            std::fill(acc, acc + hd, 0.0f);
            for (int64_t j = lo; j <= pos; ++j) {
                if (f16) vk.axpy_f16(hd, scores[j], vr.row<const uint16_t>(j), acc);
                else vk.axpy_f32(hd, scores[j], vr.row<const float>(j), acc);
            }
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < hd; ++i) o[i] = acc[i] * inv;
        }
    };
    pool_.run(body, static_cast<int>(std::min<int64_t>(n_items, pool_.size())));
}

// Fast-mode attention over an f16 cache in the batch order (KQ lane = dim mod 8, KQV lane = cell
// mod 8): the per-(token, head) operations of the loop in attention_rows(), but up to 4 consecutive
// tokens of one head share each K and V row conversion (the vec *_multi kernels give each query
// the single-query bits), and (token block, head) items are handed out dynamically, longest rows
// first, since causal rows grow with the position.
constexpr int kAttnQ = 4;  // tokens per attention_blocks item

// Floats of per-thread scratch one attention_block_item needs for score rows of length S.
int64_t attention_block_scratch(int64_t S, int64_t hd) {
    return kAttnQ * S + kAttnQ * 9 * hd;
}

// tinyBLAS's hsum tree over the 8 KQV lanes [8][hd] of one (token, head) into o [hd].
void lanes_hsum(const float *lanes, int64_t hd, float *o) {
    for (int64_t d = 0; d < hd; ++d) {
        const float *l = lanes + d;
        o[d] = ((l[0] + l[4 * hd]) + (l[2 * hd] + l[6 * hd])) + ((l[hd] + l[5 * hd]) + (l[3 * hd] + l[7 * hd]));
    }
}

// One decode token (row 0 of q, at position p.n_past) and nh <= kAttnQ query heads h0 .. h0 + nh - 1
// of one KV head: the batch-order operations of one token and head (attention_block_item's one-token
// case, which is this with nh = 1), but with nh > 1 every K and V row is converted from f16 once for all
// nh heads (dot_f16_lanes_multi / kqv_lanes_f16 with nq = nh give each
// query the single-query bits), so every head's output has attention_block_item's bits. scratch: as
// attention_block_item's (kAttnQ score rows, lanes and q copies).
void attention_heads_item(const vec_kernels &vk, const tensor &q, const kv_source &src, const attn_params &p,
                          const tensor &out, int64_t h0, int nh, float *scratch) {
    const int64_t hd = p.head_dim, group = p.n_head / p.n_head_kv, S = p.n_past + 1;
    float *scores = scratch;                 // [kAttnQ][S]
    float *lanes = scores + kAttnQ * S;      // [kAttnQ][8][hd]
    float *q16 = lanes + kAttnQ * 8 * hd;    // [kAttnQ][hd]
    const int64_t hk = h0 / group, pos = p.n_past;
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    const float *qp[kAttnQ] = {};
    float mx[kAttnQ];
    for (int g = 0; g < nh; ++g) {
        vk.round_f16(hd, row_ptr<const float>(q, 0) + (h0 + g) * hd, 1.0f, q16 + g * hd);
        qp[g] = q16 + g * hd;
        mx[g] = -INFINITY;
    }
    const kv_rows kr = src.rows(hk, false), vr = src.rows(hk, true);
    if (nh == 1) {  // one query: raw dots over each memory-contiguous run of keys at once
        for (int64_t j0 = lo; j0 <= pos;) {
            const int64_t j1 = std::min(pos, kr.run_end(j0) - 1);
            vk.dot_f16_lanes_rows(hd, kr.row<const uint16_t>(j0), static_cast<int64_t>(kr.nb1 / sizeof(uint16_t)),
                                  j1 - j0 + 1, qp[0], scores + j0);
            j0 = j1 + 1;
        }
    }
    for (int64_t j = lo; j <= pos; ++j) {  // KQ: (several queries) one conversion of key row j for all
        float sc[kAttnQ];
        if (nh == 1)
            sc[0] = scores[j];
        else
            vk.dot_f16_lanes_multi(hd, kr.row<const uint16_t>(j), qp, nh, sc);
        for (int g = 0; g < nh; ++g) {
            float x = sc[g] * p.scale;
            if (p.softcap > 0) x = p.softcap * std::tanh(x / p.softcap);
            scores[g * S + j] = x;
            mx[g] = std::max(mx[g], x);
        }
    }
    for (int g = 0; g < nh; ++g) {  // softmax over cells [0, pos] (masked cells exact zeros), P -> f16
        float *sc = scores + g * S;
        std::fill(sc, sc + lo, -INFINITY);
        const double sum = vk.softmax_exp(pos + 1, sc, mx[g], sc);
        vk.round_f16(pos + 1 - lo, sc + lo, static_cast<float>(1.0 / sum), sc + lo);
        std::fill(lanes + g * 8 * hd, lanes + (g + 1) * 8 * hd, 0.0f);
    }
    for (int64_t r0 = lo; r0 <= pos;) {  // KQV per memory-contiguous run of V rows, all nh queries
        const int64_t base = vr.run_start(r0), r1 = std::min(pos, vr.run_end(r0) - 1);
        const float *pq[kAttnQ];
        float *lq[kAttnQ];
        for (int g = 0; g < nh; ++g) {
            pq[g] = scores + g * S + base;
            lq[g] = lanes + g * 8 * hd;
        }
        vk.kqv_lanes_f16(hd, r0 - base, r1 - base, vr.row<const uint16_t>(base), static_cast<int64_t>(vr.nb1 / 2), pq,
                         nh, lq);
        r0 = r1 + 1;
    }
    for (int g = 0; g < nh; ++g) lanes_hsum(lanes + g * 8 * hd, hd, row_ptr<float>(out, 0) + (h0 + g) * hd);
}

// One item of attention_blocks: tokens [t0, t0 + min(4, n_tok - t0)) of q (token i at position
// p.n_past + i) and head h, over src; writes those tokens' head h of out. scratch: the calling
// thread's attention_block_scratch(p.n_past + n_tok, head_dim) floats.
void attention_block_item(const vec_kernels &vk, const tensor &q, const kv_source &src, const attn_params &p,
                          const tensor &out, int64_t t0, int64_t h, float *scratch) {
    constexpr int kQ = kAttnQ;
    const int64_t n_tok = q.ne[1], hd = p.head_dim, group = p.n_head / p.n_head_kv;
    if (n_tok - t0 == 1) {  // one token (decode): the one-query item
        attn_params pi = p;
        pi.n_past = p.n_past + t0;
        attention_heads_item(vk, view_rows(q, t0, 1), src, pi, view_rows(out, t0, 1), h, 1, scratch);
        return;
    }
    const int64_t S = p.n_past + n_tok;  // score row length
    float *scores = scratch;             // [kQ][S]
    float *lanes = scores + kQ * S;      // [kQ][8][hd] KQV lane accumulators
    float *q16 = lanes + kQ * 8 * hd;    // [kQ][hd] q rounded through f16
    const int64_t hk = h / group;
    const int nq = static_cast<int>(std::min<int64_t>(kQ, n_tok - t0));
    int64_t pos[kQ] = {}, lo[kQ] = {};
    float mx[kQ] = {};
    const float *qp[kQ] = {};
    for (int i = 0; i < nq; ++i) {
        pos[i] = p.n_past + t0 + i;
        lo[i] = p.window > 0 ? std::max<int64_t>(0, pos[i] - p.window + 1) : 0;
        vk.round_f16(hd, row_ptr<const float>(q, t0 + i) + h * hd, 1.0f, q16 + i * hd);
        qp[i] = q16 + i * hd;
        mx[i] = -INFINITY;
    }
    // Queries that see cell j: lo[i] <= j <= pos[i], a contiguous run [a, b) (lo, pos grow with i).
    auto active = [&](int64_t j, int &a, int &b) {
        for (a = 0; a < nq && pos[a] < j; ++a) {
        }
        for (b = a; b < nq && lo[b] <= j; ++b) {
        }
    };
    const kv_rows kr = src.rows(hk, false), vr = src.rows(hk, true);
    for (int64_t j = lo[0]; j <= pos[nq - 1]; ++j) {
        int a, b;
        active(j, a, b);
        if (a == b) continue;
        float s[kQ];
        vk.dot_f16_lanes_multi(hd, kr.row<const uint16_t>(j), qp + a, b - a, s);
        for (int i = a; i < b; ++i) {
            float x = s[i - a] * p.scale;
            if (p.softcap > 0) x = p.softcap * std::tanh(x / p.softcap);
            scores[i * S + j] = x;
            mx[i] = std::max(mx[i], x);
        }
    }
    for (int i = 0; i < nq; ++i) {  // softmax over cells [0, pos] (masked cells exact zeros), P -> f16
        float *sc = scores + i * S;
        std::fill(sc, sc + lo[i], -INFINITY);
        const double sum = vk.softmax_exp(pos[i] + 1, sc, mx[i], sc);
        vk.round_f16(pos[i] + 1 - lo[i], sc + lo[i], static_cast<float>(1.0 / sum), sc + lo[i]);
        std::fill(lanes + i * 8 * hd, lanes + (i + 1) * 8 * hd, 0.0f);
    }
    // KQV: cells every query sees, [lo[nq-1], pos[0]], in one register-blocked pass per
    // memory-contiguous run of V rows (a paged cache splits it at block boundaries: blocks
    // start at multiples of 8 cells, so lanes and per-lane cell order are unchanged); the
    // cells before and after them per cell. Each lane still takes its cells in increasing j.
    const int64_t f0 = lo[nq - 1], f1 = pos[0];
    for (int64_t j = lo[0]; j <= pos[nq - 1]; ++j) {
        if (j == f0 && f0 <= f1) {
            for (int64_t r0 = f0; r0 <= f1;) {
                const int64_t base = vr.run_start(r0), r1 = std::min(f1, vr.run_end(r0) - 1);
                const float *pq[kQ];
                float *lq[kQ];
                for (int i = 0; i < nq; ++i) {
                    pq[i] = scores + i * S + base;  // indexed by cell - base, as the V rows
                    lq[i] = lanes + i * 8 * hd;
                }
                vk.kqv_lanes_f16(hd, r0 - base, r1 - base, vr.row<const uint16_t>(base),
                                 static_cast<int64_t>(vr.nb1 / 2), pq, nq, lq);
                r0 = r1 + 1;
            }
            j = f1;
            continue;
        }
        int a, b;
        active(j, a, b);
        if (a == b) continue;
        float c[kQ];
        float *y[kQ];
        for (int i = a; i < b; ++i) {
            c[i - a] = scores[i * S + j];
            y[i - a] = lanes + (i * 8 + (j & 7)) * hd;
        }
        vk.axpy_f16_multi(hd, c, vr.row<const uint16_t>(j), y, b - a);
    }
    for (int i = 0; i < nq; ++i) lanes_hsum(lanes + i * 8 * hd, hd, row_ptr<float>(out, t0 + i) + h * hd);
}

void cpu_backend::attention_blocks(const tensor &q, const kv_source &src, const attn_params &p,
                                   const tensor &out) {
    const int64_t n_tok = q.ne[1];
    grow_thread_scratch(attention_block_scratch(p.n_past + n_tok, p.head_dim));
    const auto &vk = vec();
    const int64_t n_blocks = (n_tok + kAttnQ - 1) / kAttnQ, n_items = n_blocks * p.n_head;
    std::atomic<int64_t> next{0};
    auto body = [&](int ith, int) {
        float *scratch = reinterpret_cast<float *>(thread_f32_[static_cast<size_t>(ith)].bytes.data());
        for (;;) {
            const int64_t it = next.fetch_add(1, std::memory_order_relaxed);
            if (it >= n_items) break;
            attention_block_item(vk, q, src, p, out, (n_blocks - 1 - it / p.n_head) * kAttnQ, it % p.n_head,
                                 scratch);
        }
    };
    pool_.run(body, static_cast<int>(std::min<int64_t>(n_items, pool_.size())));
}

// One thread-pool job for all rows (items = (row, head), claimed dynamically) instead of one job per
// row. Each item runs attention_block_item exactly as attention_paged -> attention_blocks runs it for
// a one-token call, so every row's bits are those of its own call. Other numerics (exact, llama.cpp's
// single-token order) and f32 caches take the per-row default.
void cpu_backend::attention_paged_rows(const tensor &q, std::span<const kv_pages> kv,
                                       std::span<const int64_t> n_past, const attn_params &p,
                                       const tensor &out) {
    const int64_t n = q.ne[1];
    bool fast = !opts_.exact && opts_.batch_invariant && n > 1 && static_cast<int64_t>(kv.size()) == n &&
                static_cast<int64_t>(n_past.size()) == n && out.ne[1] == n;
    for (size_t i = 0; fast && i < kv.size(); ++i) fast = kv[i].type == dtype::f16;
    if (!fast) {
        backend::attention_paged_rows(q, kv, n_past, p, out);  // per-row calls, each fully checked
        return;
    }
    check_f32(q, "attention_paged_rows", "q");
    check_f32(out, "attention_paged_rows", "out");
    check_same(q, out, "attention_paged_rows");
    FATHOM_CHECK(p.n_head > 0 && p.n_head_kv > 0 && p.n_head % p.n_head_kv == 0 && p.head_dim > 0,
                 "attention_paged_rows", "bad head counts");
    FATHOM_CHECK(q.ne[0] == static_cast<int64_t>(p.n_head) * p.head_dim, "attention_paged_rows",
                 "q " + shape(q) + " is not heads x head_dim");
    int64_t max_past = 0;
    for (int64_t i = 0; i < n; ++i) {
        const kv_pages &pg = kv[static_cast<size_t>(i)];
        const int64_t np = n_past[static_cast<size_t>(i)];
        check_pages(pg, "attention_paged_rows");
        FATHOM_CHECK(pg.head_dim == p.head_dim && pg.n_head_kv == p.n_head_kv, "attention_paged_rows",
                     "pages vs head layout");
        FATHOM_CHECK(np >= 0 && np + 1 <= pg.n_blocks * pg.block_tokens, "attention_paged_rows",
                     "positions beyond the block table");
        max_past = std::max(max_past, np);
    }
    grow_thread_scratch(attention_block_scratch(max_past + 1, p.head_dim));
    const auto &vk = vec();
    // Items: (row, up to kAttnQ query heads of one KV head), so a GQA group's heads share each K / V row
    // conversion (attention_heads_item: the same bits as one item per head).
    const int64_t group = p.n_head / p.n_head_kv, chunks = (group + kAttnQ - 1) / kAttnQ;
    const int64_t per_row = p.n_head_kv * chunks, n_items = n * per_row;
    std::atomic<int64_t> next{0};
    auto body = [&](int ith, int) {
        float *scratch = reinterpret_cast<float *>(thread_f32_[static_cast<size_t>(ith)].bytes.data());
        attn_params pi = p;
        for (;;) {
            const int64_t it = next.fetch_add(1, std::memory_order_relaxed);
            if (it >= n_items) break;
            const size_t i = static_cast<size_t>(it / per_row);
            const int64_t k = it % per_row, hk = k / chunks, c = k % chunks;
            const int64_t h0 = hk * group + c * kAttnQ;
            const int nh = static_cast<int>(std::min<int64_t>(kAttnQ, group - c * kAttnQ));
            pi.n_past = n_past[i];
            const kv_source src{nullptr, nullptr, 0, &kv[i], dtype::f16};
            attention_heads_item(vk, view_rows(q, static_cast<int64_t>(i), 1), src, pi,
                                 view_rows(out, static_cast<int64_t>(i), 1), h0, nh, scratch);
        }
    };
    pool_.run(body, static_cast<int>(std::min<int64_t>(n_items, pool_.size())));
}

// ---- elementwise -------------------------------------------------------------------------------

void cpu_backend::glu(const tensor &gate, const tensor &up, glu_kind kind, const tensor &out) {
    check_f32(gate, "glu", "gate");
    check_f32(up, "glu", "up");
    check_f32(out, "glu", "out");
    check_same(gate, up, "glu");
    check_same(gate, out, "glu");
    const int64_t n = gate.ne[0];
    for_rows(gate.ne[1], n * 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *g = row_ptr<const float>(gate, r), *u = row_ptr<const float>(up, r);
            float *o = row_ptr<float>(out, r);
            if (kind == glu_kind::swiglu && !opts_.exact) {
                vec().swiglu(n, g, u, o);  // ggml's vectorised silu (llama.cpp numerics)
            } else if (kind == glu_kind::swiglu) {
                for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
            } else if (!opts_.exact) {
                // ggml-cpu (GGML_GELU_FP16): gelu looked up by the f16 rounding of x in a table of
                // f16-rounded values; saturated outside (-10, 10).
                const uint16_t *tab = gelu_f16_table();
                for (int64_t i = 0; i < n; ++i) {
                    const float x = g[i];
                    o[i] = x <= -10.0f ? 0.0f : x >= 10.0f ? x * u[i] : f16_to_f32(tab[f32_to_f16(x)]) * u[i];
                }
            } else {
                constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f, kCoef = 0.044715f;
                for (int64_t i = 0; i < n; ++i) {
                    const float x = g[i];
                    o[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + kCoef * x * x))) * u[i];
                }
            }
        }
    });
}

void cpu_backend::add(const tensor &a, const tensor &b, const tensor &out) {
    check_f32(a, "add", "a");
    check_f32(b, "add", "b");
    check_f32(out, "add", "out");
    check_same(a, out, "add");
    const bool bcast = b.ne[1] == 1 && a.ne[1] != 1;  // b: one row added to every row
    FATHOM_CHECK(b.ne[0] == a.ne[0] && (bcast || b.ne[1] == a.ne[1]), "add", "shape mismatch " + shape(a) + " vs " + shape(b));
    for_rows(a.ne[1], a.ne[0], [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const float *x = row_ptr<const float>(a, r), *y = row_ptr<const float>(b, bcast ? 0 : r);
            float *o = row_ptr<float>(out, r);
            for (int64_t i = 0; i < a.ne[0]; ++i) o[i] = x[i] + y[i];
        }
    });
}

void cpu_backend::scale(const tensor &x, float s) {
    check_f32(x, "scale", "x");
    for_rows(x.ne[1], x.ne[0], [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            float *o = row_ptr<float>(x, r);
            for (int64_t i = 0; i < x.ne[0]; ++i) o[i] *= s;
        }
    });
}

void cpu_backend::softcap(const tensor &x, float cap) {
    check_f32(x, "softcap", "x");
    FATHOM_CHECK(cap > 0, "softcap", "cap must be positive");
    for_rows(x.ne[1], x.ne[0] * 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            float *o = row_ptr<float>(x, r);
            for (int64_t i = 0; i < x.ne[0]; ++i) o[i] = cap * std::tanh(o[i] / cap);
        }
    });
}

void cpu_backend::softmax(const tensor &x) {
    check_f32(x, "softmax", "x");
    for_rows(x.ne[1], x.ne[0] * 4, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            float *o = row_ptr<float>(x, r);
            float mx = -INFINITY;
            for (int64_t i = 0; i < x.ne[0]; ++i) mx = std::max(mx, o[i]);
            double sum = 0;
            for (int64_t i = 0; i < x.ne[0]; ++i) {
                o[i] = std::exp(o[i] - mx);
                sum += o[i];
            }
            const float inv = static_cast<float>(1.0 / sum);
            for (int64_t i = 0; i < x.ne[0]; ++i) o[i] *= inv;
        }
    });
}

void cpu_backend::copy(const tensor &src, const tensor &dst) {
    check_f32(src, "copy", "src");
    FATHOM_CHECK(dst.type == dtype::f32 || dst.type == dtype::f16, "copy", "dst must be f32 or f16");
    check_same(src, dst, "copy");
    const auto &vk = vec();
    for_rows(src.ne[1], src.ne[0], [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            if (dst.type == dtype::f16) vk.f32_to_f16_row(src.ne[0], row_ptr<const float>(src, r), row_ptr<uint16_t>(dst, r));
            else std::memcpy(row_ptr<float>(dst, r), row_ptr<const float>(src, r), static_cast<size_t>(src.ne[0]) * 4);
        }
    });
}

}  // namespace
}  // namespace cpu

std::unique_ptr<backend> make_cpu_backend(const cpu_options &opts) {
    if (opts.n_threads < 1 || opts.n_threads > 1024)
        throw error("cpu backend: n_threads must be in [1, 1024], got " + std::to_string(opts.n_threads));
    return std::make_unique<cpu::cpu_backend>(opts);
}

}  // namespace fathom
