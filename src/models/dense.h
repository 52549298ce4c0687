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

// Optional trace of intermediates, named as in llama.cpp's graph ("attn_norm", "Qcur", "kqv_out",
// "l_out", ...; layer -1 for whole-model tensors) so numerics can be compared with llama.cpp's eval
// callback tensor by tensor. Off (null) by default; set it only while no forward is running.
struct dense_trace {
    void (*fn)(void *user, const char *name, int32_t layer, const tensor &t) = nullptr;
    void *user = nullptr;
};
extern dense_trace g_dense_trace;

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

// Activation buffers for up to n_batch tokens, allocated once per session.
struct dense_scratch {
    int64_t n_batch = 0;
    int64_t n_logit_rows = 0;  // rows of logits computed per output matmul
    tensor x, xn, q, k, v, attn, o, gate, up, rope_g, rope_l, logits;
    std::vector<uint8_t *> kv_blocks;  // paged KV: block addresses of the sequence (reused per call)
    void *mem = nullptr;
    backend *be = nullptr;
    dense_scratch() = default;
    dense_scratch(const dense_scratch &) = delete;
    dense_scratch &operator=(const dense_scratch &) = delete;
    ~dense_scratch();
};
std::unique_ptr<dense_scratch> dense_scratch_create(const dense_hparams &hp, backend &be, int64_t n_batch);

// Evaluate tokens[0, n) at positions [p0, p0 + n), n <= n_batch: writes their K/V into the cache
// and, if logits != nullptr, the logits of the last n_out tokens to logits[n_out x n_vocab] (host).
void dense_forward(const dense_model &m, backend &be, const dense_kv &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits);
void dense_forward(const dense_model &m, backend &be, kv_cache &kv, dense_scratch &s, const int32_t *tokens,
                   int64_t n, int64_t p0, int64_t n_out, float *logits);

}  // namespace fathom
