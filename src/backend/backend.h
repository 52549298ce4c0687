// The compute backend interface: memory (allocate, upload, download, views) and the ops a
// transformer forward needs, behind one small vtable. The model code calls ops on a `backend`
// object in order; the CPU backend (src/backend/cpu/) runs each op at once on its thread pool and
// is the numerical reference every other backend is tested against. A CUDA backend implements the
// same class by enqueueing kernels on a stream; synchronize() is then the only blocking call.
//
// Tensors are plain 2-D descriptors (rows of ne[0] elements, row stride nb1 bytes) with a pointer
// into backend memory. Activations are f32 and row-major: one row per token. Weights are GGUF
// tensors of any dtype with ne[0] = input features (K) and ne[1] = output features (N).
// Higher-rank GGUF tensors (experts, heads) are handled as 2-D row slices (view_rows).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "core/types.h"

namespace fathom {

// A 2-D view: ne[1] rows of ne[0] elements of `type`, rows nb1 bytes apart. Does not own memory.
struct tensor {
    dtype type = dtype::f32;
    int64_t ne[2] = {0, 0};  // [0]: elements per row, [1]: rows
    size_t nb1 = 0;          // bytes between consecutive rows
    void *data = nullptr;    // backend address (host address for the CPU backend)

    int64_t cols() const { return ne[0]; }
    int64_t rows() const { return ne[1]; }
    size_t row_bytes() const { return dtype_row_bytes(type, ne[0]); }
    bool contiguous() const { return nb1 == row_bytes(); }
    size_t nbytes() const { return nb1 * static_cast<size_t>(ne[1]); }
};

// A contiguous tensor over `data`.
tensor make_tensor(dtype type, int64_t cols, int64_t rows, void *data);
// Rows [r0, r0+n) of t.
tensor view_rows(const tensor &t, int64_t r0, int64_t n);
// Columns [c0, c0+n) of every row (f32/f16 only: no block boundary issues).
tensor view_cols(const tensor &t, int64_t c0, int64_t n);
// Reinterpret a contiguous tensor as rows of `cols` elements (e.g. [n_tok, n_head*hd] -> [n_tok*n_head, hd]).
tensor reshape(const tensor &t, int64_t cols);

enum class rope_mode {
    normal,  // rotate adjacent pairs (x[2i], x[2i+1])            — llama.cpp LLAMA_ROPE_TYPE_NORM
    neox,    // rotate halves     (x[i], x[i + n_rot/2])          — llama.cpp LLAMA_ROPE_TYPE_NEOX
};

// RoPE frequencies. theta_i(pos) = pos * base^(-2i/n_rot) / freq_factor_i, then YaRN-scaled:
// theta = freq_scale*theta (interpolation), blended back towards the unscaled theta for the
// dimensions below the correction range when ext_factor > 0; cos/sin multiplied by mscale.
struct rope_params {
    int32_t n_rot = 0;             // rotated dimensions per head (<= head_dim; the rest pass through)
    rope_mode mode = rope_mode::normal;
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;       // 1/linear scaling factor
    float ext_factor = 0.0f;       // YaRN extrapolation mix (0 = off)
    float attn_factor = 1.0f;      // YaRN magnitude scale
    float beta_fast = 32.0f;
    float beta_slow = 1.0f;
    int32_t n_ctx_orig = 0;        // YaRN original training context
    const float *freq_factors = nullptr;  // host array [n_rot/2] (llama3 rope_freqs) or null
};

struct attn_params {
    int32_t n_head = 0;        // query heads
    int32_t n_head_kv = 0;     // key/value heads (GQA: n_head % n_head_kv == 0)
    int32_t head_dim = 0;
    int64_t n_ctx = 0;         // cache capacity (rows per kv head in the cache tensors)
    int64_t n_past = 0;        // position of the first query token; keys [0, n_past + n_tok) are valid
    float scale = 1.0f;        // multiplies q.k
    float softcap = 0.0f;      // > 0: scores = softcap * tanh(scores / softcap)
    int32_t window = 0;        // > 0: query at p sees keys k with p - k < window (sliding window)
};

// One sequence's K/V of one layer in a paged KV pool (src/kv/kv_pool.h): the sequence's positions
// live in fixed-size blocks listed in position order, anywhere in the pool. Position p of kv head
// h is the row (p % block_tokens) of head h in block blocks[p / block_tokens]:
//   K row = blocks[p / block_tokens] + k_offset + (h * block_tokens + p % block_tokens) * row_bytes
//   (V the same with v_offset), rows of head_dim elements of `type` (f16 or f32), so each head's
//   keys inside one block are contiguous. block_tokens is a power of two >= 8 (the attention's
//   8-lane sums then split at block boundaries without changing their order).
struct kv_pages {
    uint8_t *const *blocks = nullptr;  // [n_blocks] base address of each block, position order
    int64_t n_blocks = 0;              // positions [0, n_blocks * block_tokens) are addressable
    int32_t block_tokens = 0;
    int32_t n_head_kv = 0;
    int32_t head_dim = 0;
    dtype type = dtype::f16;
    size_t k_offset = 0, v_offset = 0;  // bytes from a block's base to this layer's K / V [n_head_kv][block_tokens][head_dim]
};

// backend::qk_rope_store: what happens to one layer's q/k/v between the QKV projections and attention.
struct qk_rope_store_params {
    int32_t head_dim = 0;
    const tensor *q_norm = nullptr;  // [head_dim] f32 per-head RMSNorm weight of q (qwen3, gemma3), or none
    const tensor *k_norm = nullptr;  // the same for k
    float eps = 0.0f;                // of those norms
    const tensor *table = nullptr;   // [n_tok, n_rot] rope_table of the rows' positions
    rope_mode mode = rope_mode::normal;
    float q_scale = 1.0f;            // != 1: q scaled after RoPE (gemma3)
    const tensor *k_cache = nullptr, *v_cache = nullptr;  // kv_store's caches [n_head_kv*n_ctx, head_dim]
    int32_t n_head_kv = 0;
    int64_t n_ctx = 0;
    int64_t p0 = 0;                  // position of the first row (kv_store's p0)
};

enum class glu_kind {
    swiglu,  // silu(gate) * up
    geglu,   // gelu_tanh(gate) * up  (llama.cpp's tanh approximation)
};

// One backend. Not thread-safe: one caller issues ops in order. All sizes are validated by the
// implementation (mismatches throw fathom::error naming the op).
class backend {
public:
    virtual ~backend() = default;
    virtual const char *name() const = 0;
    virtual int n_threads() const = 0;

    // ---- memory --------------------------------------------------------------------------------
    // Allocate zero-initialised backend memory (64-byte aligned). Freed with release().
    virtual void *alloc(size_t bytes) = 0;
    virtual void release(void *ptr) = 0;
    // Make a weight usable by ops. host points into the mapped GGUF file; the CPU backend returns
    // it unchanged (weights are never copied), a device backend uploads.
    virtual void *map_weights(const void *host, size_t bytes) = 0;
    // Optional, after map_weights: w (a view of mapped weights) will be a mul_mat weight. A backend
    // may build its faster layout now instead of on first use (the CPU backend's row-interleaved
    // copies), so the first forward pass is not slowed by it. Default: nothing.
    virtual void prepare_weight(const tensor &w) { (void)w; }
    virtual void upload(const tensor &dst, const void *host) = 0;   // dst must be contiguous
    virtual void download(const tensor &src, void *host) = 0;       // src must be contiguous

    // ---- ops -----------------------------------------------------------------------------------
    // out[i] = dequantised table row ids[i]. ids are host memory, validated against table rows.
    virtual void get_rows(const tensor &table, const int32_t *ids, int64_t n, const tensor &out) = 0;
    // out[m] = x[m] . W^T for each (W, out) pair: x [M, K] f32, W [N, K] any compute dtype,
    // out [M, N] f32. Activations are converted once for all pairs sharing x.
    virtual void mul_mat(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) = 0;
    // out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w: one row of x.cols(), or null).
    virtual void rms_norm(const tensor &x, const tensor *w, float eps, const tensor &out) = 0;
    // cos/sin table for positions [p0, p0+n): out [n, n_rot] f32 as (cos, sin) pairs.
    virtual void rope_table(int64_t p0, int64_t n, const rope_params &p, const tensor &out) = 0;
    // In place: x [n_tok, n_head*head_dim]; each head's first n_rot dims rotated by table row.
    virtual void rope(const tensor &x, int32_t head_dim, const tensor &table, rope_mode mode) = 0;
    // Store rows of src [n_tok, n_head_kv*head_dim] f32 at positions [p0, p0+n_tok) of a cache
    // tensor [n_head_kv*n_ctx, head_dim] (f16 or f32; head-major so each head's keys are contiguous).
    virtual void kv_store(const tensor &src, const tensor &cache, int32_t n_head_kv, int64_t n_ctx, int64_t p0) = 0;
    // Causal attention of q [n_tok, n_head*head_dim] (query i at position n_past+i) over the caches
    // k, v [n_head_kv*n_ctx, head_dim]; out [n_tok, n_head*head_dim].
    virtual void attention(const tensor &q, const tensor &k, const tensor &v, const attn_params &p,
                           const tensor &out) = 0;
    // Paged KV (optional; supports_paged_kv() says whether a backend has it, the defaults throw):
    // kv_store and attention with the sequence's K/V read and written through its block table
    // instead of a contiguous cache. Results are bit-identical to the contiguous ops on the same
    // values. p.n_ctx is not used: the table bounds the positions.
    virtual bool supports_paged_kv() const { return false; }
    virtual void kv_store_paged(const tensor &k_src, const tensor &v_src, const kv_pages &kv, int64_t p0);
    virtual void attention_paged(const tensor &q, const kv_pages &kv, const attn_params &p, const tensor &out);
    // Batched decode over paged sequences: row i of q [n, n_head*head_dim] is one token at position
    // n_past[i] of the sequence with pages kv[i] (its K/V already stored); out row i is what
    // attention_paged(q row i, kv[i], p with n_past = n_past[i]) writes, bit for bit. The default
    // makes exactly those calls; a backend may run all rows in one pass (one thread-pool job).
    virtual void attention_paged_rows(const tensor &q, std::span<const kv_pages> kv,
                                      std::span<const int64_t> n_past, const attn_params &p,
                                      const tensor &out);
    // PFlash scoring (src/engine/token_scorer.cpp): for each query row t of q [n_q, n_head*head_dim] (f32)
    // at position first_pos + t and each head h, p = softmax over keys j in [0, first_pos + t] of
    // s_j = scale * (q_th . k_j), softcapped (cap * tanh(s / cap)) when softcap > 0, with k_j row
    // (h / (n_head / n_head_kv)) * n_ctx + j of k [n_head_kv*n_ctx, head_dim] (f16); then
    // agg[t, j] = max(agg[t, j], p_j) for agg [n_q, >= first_pos + n_q] f32 (other columns untouched).
    // The default runs on host memory (the CPU backend's tensors); a device backend overrides it.
    virtual void attention_prob_max(const tensor &q, const tensor &k, int32_t n_head, int32_t n_head_kv,
                                    int64_t n_ctx, float scale, float softcap, int64_t first_pos,
                                    const tensor &agg);
    virtual void glu(const tensor &gate, const tensor &up, glu_kind kind, const tensor &out) = 0;
    virtual void add(const tensor &a, const tensor &b, const tensor &out) = 0;
    virtual void scale(const tensor &x, float s) = 0;            // in place
    virtual void softcap(const tensor &x, float cap) = 0;        // in place: cap * tanh(x / cap)
    virtual void softmax(const tensor &x) = 0;                   // in place, per row
    virtual void copy(const tensor &src, const tensor &dst) = 0; // same shape; f32 -> f32/f16

    // ---- fused ops (optional) -----------------------------------------------------------------
    // Coarse ops a decode step uses to issue fewer kernels. Each default is exactly the composition
    // of the ops written beside it, so the CPU backend's results are those of the separate ops bit
    // for bit; a device backend may run one as fewer kernels (cuda_backend.cpp, docs/cuda.md), with
    // results within its ops' usual tolerances. Scratch operands (xn, tmp, x of rms_norm_add) hold
    // the intermediate or are left unspecified: a fused backend may never write them.
    //
    // out_i = rms_norm(x, norm_w, eps) . W_i^T: rms_norm(x, &norm_w, eps, xn); mul_mat(xn, n_pairs, w, out).
    virtual void mul_mat_normed(const tensor &x, const tensor &norm_w, float eps, const tensor &xn, int n_pairs,
                                const tensor *const *w, const tensor *const *out);
    // acc += x . W^T: mul_mat(x, 1, {w}, {tmp}); add(acc, tmp, acc). tmp [M, N] scratch.
    virtual void mul_mat_add(const tensor &x, const tensor &w, const tensor &tmp, const tensor &acc);
    // acc += glu(gate, up) . W^T: glu(gate, up, kind, gate); mul_mat_add(gate, w, tmp, acc). gate is
    // scratch afterwards.
    virtual void glu_mul_mat_add(const tensor &gate, const tensor &up, glu_kind kind, const tensor &w,
                                 const tensor &tmp, const tensor &acc);
    // acc += rms_norm(x, w, eps): rms_norm(x, &w, eps, x); add(acc, x, acc). x is scratch afterwards.
    virtual void rms_norm_add(const tensor &x, const tensor &w, float eps, const tensor &acc);
    // q [n, H*hd], k / v [n, Hkv*hd] of one sequence with a contiguous cache, in this order:
    //   p.q_norm / p.k_norm: rms_norm(reshape(q, hd), q_norm, eps) in place, the same for k;
    //   rope(q, hd, *p.table, p.mode); rope(k, ...); p.q_scale != 1: scale(q, p.q_scale);
    //   kv_store(k, *p.k_cache, p.n_head_kv, p.n_ctx, p.p0); kv_store(v, *p.v_cache, ...).
    // q and k hold their final values afterwards (as after the separate ops).
    virtual void qk_rope_store(const tensor &q, const tensor &k, const tensor &v, const qk_rope_store_params &p);

    // Wait until every issued op has completed (no-op for the CPU backend).
    virtual void synchronize() = 0;
};

struct cpu_options {
    int n_threads = 1;   // workers including the calling thread
    bool exact = false;  // mul_mat: dequantise weight rows, f32 dot, f32 accumulation
    // Fast mode only: attention sums a single token's row in the same order as a batch's (results
    // independent of batch shape). false: llama.cpp's single-token order (ggml_vec_dot_f16).
    bool batch_invariant = true;
    int64_t max_cols = 0;  // largest K any mul_mat will see (sizes the activation scratch); 0 = grow
    int64_t max_rows = 0;  // largest M any mul_mat will see
    int64_t max_ctx = 0;   // largest attention span (sizes per-thread score scratch)
};
std::unique_ptr<backend> make_cpu_backend(const cpu_options &opts);

}  // namespace fathom
