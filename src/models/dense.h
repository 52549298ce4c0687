// The dense decoder-only transformer family (llama / SmolLM2, qwen3, gemma3): hyperparameters
// read from GGUF `<arch>.*` keys, weights validated and mapped (never copied), and one forward
// pass shared by all members. What differs between members is a handful of flags in
// dense_hparams, set by one small file per architecture (dense_llama.cpp, dense_qwen3.cpp,
// dense_gemma3.cpp).
//
// Shapes (rows x cols, row-major, one row per token; GGUF weights are [N rows x K cols]):
//   token_embd [n_vocab x n_embd]      attn_q [n_head*hd x n_embd]   attn_k/v [n_head_kv*hd x n_embd]
//   attn_output [n_embd x n_head*hd]   ffn_gate/up [n_ff x n_embd]   ffn_down [n_embd x n_ff]
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"

namespace fathom {

struct dense_hparams {
    std::string arch;
    int32_t n_vocab = 0;
    int32_t n_ctx_train = 0;
    int32_t n_embd = 0;
    int32_t n_layer = 0;
    int32_t n_ff = 0;
    int32_t n_head = 0;
    int32_t n_head_kv = 0;
    int32_t head_dim = 0;          // attention.key_length (== value_length)
    float rms_eps = 1e-5f;

    rope_params rope;              // global (full-attention) layers
    rope_params rope_local;        // sliding-window layers (gemma3: base 10000, no scaling)

    // Family flags.
    bool qk_norm = false;          // per-head RMSNorm of q and k before RoPE (qwen3, gemma3)
    bool post_norms = false;       // RMSNorm of the attention and FFN outputs before the residual add (gemma3)
    bool embed_scale = false;      // embeddings multiplied by sqrt(n_embd) (gemma3)
    glu_kind act = glu_kind::swiglu;
    float attn_scale = 0.0f;       // q.k scale; set by the family (default 1/sqrt(head_dim))
    bool scale_q = false;          // apply attn_scale to q before attention (gemma3, as llama.cpp does:
                                   // the scaled q is what gets rounded to f16) instead of to the scores
    float attn_softcap = 0.0f;     // > 0: attention score soft-capping
    float final_softcap = 0.0f;    // > 0: final logit soft-capping
    int32_t n_swa = 0;             // sliding window (tokens) of the SWA layers; 0 = none
    std::vector<bool> swa_layer;   // [n_layer] true where the layer uses the sliding window
};

struct dense_layer {
    tensor attn_norm, wq, wk, wv, wo;
    tensor bq, bk, bv, bo;          // optional biases (data == nullptr if absent)
    tensor attn_q_norm, attn_k_norm; // [hd] when qk_norm
    tensor post_attn_norm;          // when post_norms
    tensor ffn_norm, ffn_gate, ffn_up, ffn_down;
    tensor post_ffn_norm;           // when post_norms
};

struct dense_model {
    dense_hparams hp;
    tensor tok_embd, output_norm, output;  // output == tok_embd when tied
    std::vector<dense_layer> layers;
    std::vector<float> rope_freq_factors;  // llama3 rope_freqs (empty if absent)
    uint64_t n_params = 0;
};

// Read hyperparameters for a supported architecture (throws naming the key or the architecture).
dense_hparams dense_load_hparams(const gguf::file &f);
// Per-family hyperparameter rules (one file each).
void dense_hparams_llama(const gguf::file &f, dense_hparams &hp);
void dense_hparams_qwen3(const gguf::file &f, dense_hparams &hp);
void dense_hparams_gemma3(const gguf::file &f, dense_hparams &hp);
bool dense_supports_arch(const std::string &arch);

// Load and validate every tensor (shape and dtype), mapping weights through the backend.
std::unique_ptr<dense_model> dense_load(const gguf::file &f, backend &be);

// KV cache: per layer K and V tensors [n_head_kv*n_ctx x head_dim], head-major.
struct kv_cache;
class kv_pool;

// Where a forward keeps one sequence's K/V: a contiguous kv_cache (CUDA sessions, the PFlash
// drafter, tests), or sequence `seq` of a paged pool (CPU engine sessions; src/kv/kv_pool.h),
// whose table must already cover the positions being evaluated.
struct dense_kv {
    kv_cache *cache = nullptr;
    kv_pool *pool = nullptr;
    int seq = -1;
};

// Activation buffers for up to n_batch rows (tokens of all sequences of a forward), allocated once
// per session (or grown by the engine for its batched steps), plus the host-side bookkeeping of the
// forward using them (reused between calls). One forward at a time per scratch.
struct dense_scratch {
    int64_t n_batch = 0;
    int64_t n_logit_rows = 0;  // rows of logits computed per output matmul
    tensor x, xn, q, k, v, attn, o, gate, up, rope_g, rope_l, logits;
    // Row layout of the last forward (see dense_forward): row0[i] = first activation row of sequence i.
    std::vector<int64_t> row0;                      // [B]
    int64_t n_single = 0;                           // rows [0, n_single): the one-token sequences
    std::vector<int32_t> ids;                       // [rows] token ids in row order
    std::vector<std::vector<uint8_t *>> kv_blocks;  // [B] paged sequences' block addresses
    std::vector<kv_pages> pages;                    // [n_single] one layer's pages of the one-token rows
    std::vector<int64_t> past;                      // [n_single] their positions
    void *mem = nullptr;
    backend *be = nullptr;
    dense_scratch() = default;
    dense_scratch(const dense_scratch &) = delete;
    dense_scratch &operator=(const dense_scratch &) = delete;
    ~dense_scratch();
};
std::unique_ptr<dense_scratch> dense_scratch_create(const dense_hparams &hp, backend &be, int64_t n_batch);

// ---- the forward (dense_forward.cpp) ----

// One sequence of a forward: n_i >= 1 new tokens at positions [pos, pos + n_i) against its own K/V
// (positions [0, pos) hold its past). A single session's step is a batch of one.
struct dense_seq {
    dense_kv kv;
    int64_t pos = 0;                  // position of tokens[0]
    std::span<const int32_t> tokens;  // [n_i >= 1]
    float *logits = nullptr;          // out: [n_out, n_vocab] logits of the last n_out tokens (host); null: none
    int64_t n_out = 0;                // 0 <= n_out <= n_i
};

// Optional trace of intermediates, named as in llama.cpp's graph ("attn_norm", "Qcur", "kqv_out",
// "l_out", ...; layer -1 for whole-model tensors) so numerics can be compared with llama.cpp's eval
// callback tensor by tensor. t holds every row of the step (row layout as in dense_forward; a batch
// of one: token order) and is valid only during the call; "result_norm" holds the output rows only.
struct dense_trace {
    void (*fn)(void *user, const char *name, int32_t layer, const tensor &t) = nullptr;
    void *user = nullptr;
};

// Attention hook, for PFlash's drafter (src/engine/token_scorer.cpp: it keeps pre-RoPE keys and queries
// for its scores and prefills with a sliding window). Off (fn null, window 0, stop_layer -1) by default.
struct dense_attn_hook {
    // Called in each layer after the q/k projections (+ biases, + q/k norms), before RoPE and before
    // gemma3's q scale, with q [rows, n_head*head_dim] and k [rows, n_head_kv*head_dim] of every row
    // in the forward's row layout (dense_scratch::row0; a batch of one: token order). Backend tensors,
    // valid only during the call: the hook may read or copy them, not change them.
    void (*fn)(void *user, int32_t layer, const tensor &q, const tensor &k) = nullptr;
    void *user = nullptr;
    // > 0: every layer attends to at most the last `window` positions (the model's own window still
    // applies on its sliding-window layers: the smaller of the two).
    int32_t window = 0;
    // >= 0: the forward ends in this layer right after fn: no V projection, K/V store, attention or
    // FFN there, no later layers and no logits (the drafter's last layer is needed only for its q/k).
    int32_t stop_layer = -1;
};

// Evaluate every sequence's tokens in ONE forward pass: writes their K/V into their caches and the
// logits asked for. Every weight matmul runs once over all rows (M = sum n_i: the weights are streamed
// once for all sequences); RoPE uses each row's own position; K/V store and attention run per
// sequence against its own cache; the final norm and output head run only on the rows whose logits
// are wanted. Row layout: the one-token sequences first, in their order (their attention is one
// batched call when all sequences are paged), then each multi-token sequence as a contiguous block
// (one causal attention call over its rows). Every per-row op computes rows independently on the CPU
// backend's batch-invariant numerics, so a sequence's logits are bit-identical whatever else shares
// the step (tests/models/test_dense_forward.cpp, tests/engine/test_batch_decode.cpp).
// Requirements (checked, fathom::error): sum n_i <= s.n_batch; distinct caches (pool sequences) of
// the model's geometry; positions inside the cache (paged: inside the blocks its table holds); token
// ids inside the vocabulary. A contiguous cache's n_used is raised to pos + n_i.
void dense_forward(const dense_model &m, backend &be, dense_scratch &s, std::span<const dense_seq> seqs,
                   const dense_trace &trace = {}, const dense_attn_hook &hook = {});

// One sequence (a batch of one): tokens[0, n) at positions [p0, p0 + n), n <= n_batch; the logits of
// the last n_out tokens go to logits[n_out x n_vocab] (host) when logits != nullptr.
void dense_forward(const dense_model &m, backend &be, const dense_kv &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits, const dense_trace &trace = {});
void dense_forward(const dense_model &m, backend &be, kv_cache &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits, const dense_trace &trace = {});

}  // namespace fathom
