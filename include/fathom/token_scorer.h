// Token importance scoring with a small dense model (llama / qwen3 / gemma3 family): PFlash's drafter
// (include/fathom/pflash.h, src/pflash) scores a prompt's tokens with it. Implemented by the engine
// (src/engine/token_scorer.cpp) over the dense models' forward and its attention hook, so that PFlash
// needs no backend, model or KV internals.
//
// The forward (a) prefills the prompt with sliding-window attention — its cost grows linearly with the
// prompt, not quadratically — and (b) captures pre-RoPE queries and keys, from which the last Q prompt
// tokens' attention over the whole prompt gives each token's importance.
//
// Score of token j (SpecPrefill / lucebox PFlash): for each of the last Q tokens t (queries, run with
// full attention) and every layer l and head h, p_lht(j) = softmax_j(scale * q_pre[l,h,t] . k_pre[l,h,j])
// over the keys j <= t; score(j) = mean_t max_{l,h} p_lht(j). Pre-RoPE vectors remove RoPE's distance
// decay, so far-away tokens are not penalised for being far.
//
// A scorer keeps the KV of the windowed part of its last prompt: the next call re-evaluates only the
// tokens after the common prefix (multi-turn prompts only pay for the new text). Not thread-safe.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace fathom {

struct token_score_params {
    int32_t query_tokens = 8;  // Q
    int32_t window = 512;      // sliding window of the prefill (0 = full attention)
};

struct token_score_stats {
    int64_t n_evaluated = 0;   // tokens run through the forward this call
    double prefill_s = 0, query_s = 0, score_s = 0;
};

class token_scorer {
public:
    // Loads the weights of the dense model at `path` on `device` ("cpu", or "cuda" / "cuda:N" in a CUDA
    // build: weights, KV and the scoring attention on that GPU), evaluating up to n_batch tokens per
    // forward with n_threads CPU threads (0 = the online cores). Throws fathom::error for another
    // architecture or an unusable device; on failure nothing is left allocated.
    static std::unique_ptr<token_scorer> load(const std::string &path, int n_threads, int32_t n_batch,
                                              const std::string &device = "cpu");
    virtual ~token_scorer() = default;

    virtual int32_t n_vocab() const = 0;
    virtual uint64_t file_bytes() const = 0;  // size of the model file

    // Per-token importance of `ids` (see the banner), [ids.size()] floats >= 0. Throws fathom::error
    // for a token outside the vocabulary.
    virtual std::vector<float> score(std::span<const int32_t> ids, const token_score_params &p,
                                     token_score_stats &st) = 0;

    // Forget the held prefix (and its memory).
    virtual void reset() = 0;
};

}  // namespace fathom
