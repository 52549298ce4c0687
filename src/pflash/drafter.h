// PFlash's drafter: a small dense model (llama / qwen3 / gemma3 family) run through the model's
// forward with an attention hook (dense_attn_hook, models/dense.h) so that it can (a) prefill the
// prompt with sliding-window attention — its cost grows linearly with the prompt, not
// quadratically — and (b) capture pre-RoPE queries and keys, from which the last Q prompt tokens'
// attention over the whole prompt gives each token's importance.
//
// Score of token j (SpecPrefill / lucebox PFlash): for each of the last Q tokens t (queries, run with
// full attention) and every layer l and head h, p_lht(j) = softmax_j(scale * q_pre[l,h,t] . k_pre[l,h,j])
// over the keys j <= t; score(j) = mean_t max_{l,h} p_lht(j). Pre-RoPE vectors remove RoPE's distance
// decay, so far-away tokens are not penalised for being far.
//
// The drafter keeps the KV of the windowed part of its last prompt: the next call re-evaluates only
// the tokens after the common prefix (multi-turn prompts only pay for the new text).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "kv/kv_cache.h"
#include "models/dense.h"
#include "tokenizer/tokenizer.h"

namespace fathom::pflash {

struct drafter_score_params {
    int32_t query_tokens = 8;  // Q
    int32_t window = 512;      // sliding window of the prefill (0 = full attention)
};

struct drafter_stats {
    int64_t n_evaluated = 0;   // tokens run through the forward this call
    double prefill_s = 0, query_s = 0, score_s = 0;
};

class drafter {
public:
    // Loads weights and tokenizer on `device` ("cpu", or "cuda" / "cuda:N" in a CUDA build: weights,
    // KV and the scoring attention on that GPU). On failure nothing is left allocated (plain RAII
    // members).
    static std::unique_ptr<drafter> load(const std::string &path, int n_threads, int32_t n_batch,
                                         const std::string &device = "cpu");
    ~drafter();

    const tokenizer &tok() const { return *tok_; }
    const dense_hparams &hparams() const { return model_->hp; }
    uint64_t file_bytes() const { return file_->size(); }

    // Per-token importance of `ids` (see the banner), [ids.size()] floats >= 0.
    std::vector<float> score(std::span<const int32_t> ids, const drafter_score_params &p, drafter_stats &st);

    // Forget the held prefix (and its memory).
    void reset_state();

private:
    drafter() = default;
    void ensure_capacity(int64_t n);
    // Evaluate ids[0, n) at positions [p0, p0+n) with attention window `window` (0 = full), through
    // the last layer's q/k only: keeps their pre-RoPE keys in kpre_ and, if q_out is set, copies the
    // pre-RoPE queries of every layer to q_out[l] ([n, n_head*head_dim] f32 backend tensors).
    void forward(const int32_t *ids, int64_t n, int64_t p0, int32_t window, const std::vector<tensor> *q_out);

    // Declaration order = reverse destruction order: the backend outlives everything it allocated.
    std::shared_ptr<const gguf::file> file_;
    std::unique_ptr<backend> be_;
    std::unique_ptr<dense_model> model_;
    std::unique_ptr<tokenizer> tok_;
    int32_t n_batch_ = 512;
    int n_threads_ = 1;
    // State (sized by ensure_capacity).
    std::unique_ptr<kv_cache> kv_;            // post-RoPE K and V, as the model's own attention needs
    void *kpre_mem_ = nullptr;                // pre-RoPE keys, f16, same layout as kv_->k
    std::vector<tensor> kpre_;                // [n_layer] x [n_head_kv*n_ctx, head_dim]
    std::unique_ptr<dense_scratch> scratch_;
    std::vector<int32_t> held_;               // tokens whose windowed KV (and pre-RoPE K) are valid
};

}  // namespace fathom::pflash
