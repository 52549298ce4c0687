// PFlash's drafter: a small dense model (llama / qwen3 / gemma3 family) that scores the prompt's tokens
// (fathom::token_scorer, include/fathom/token_scorer.h: windowed prefill, pre-RoPE queries and keys, the
// last Q tokens' attention over the prompt), with its tokenizer, through which PFlash maps the target's
// text onto drafter tokens (text_map.h). The scoring rule is in token_scorer.h.
//
// The drafter keeps the KV of the windowed part of its last prompt: the next call re-evaluates only
// the tokens after the common prefix (multi-turn prompts only pay for the new text).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fathom/token_scorer.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace fathom::pflash {

using drafter_score_params = token_score_params;
using drafter_stats = token_score_stats;

class drafter {
public:
    // Loads weights and tokenizer on `device` ("cpu", or "cuda" / "cuda:N" in a CUDA build: weights,
    // KV and the scoring attention on that GPU). On failure nothing is left allocated.
    static std::unique_ptr<drafter> load(const std::string &path, int n_threads, int32_t n_batch,
                                         const std::string &device = "cpu");

    const tokenizer &tok() const { return *tok_; }
    int32_t n_vocab() const { return scorer_->n_vocab(); }
    uint64_t file_bytes() const { return scorer_->file_bytes(); }

    // Per-token importance of `ids` (token_scorer.h), [ids.size()] floats >= 0.
    std::vector<float> score(std::span<const int32_t> ids, const drafter_score_params &p, drafter_stats &st) {
        return scorer_->score(ids, p, st);
    }

    // Forget the held prefix (and its memory).
    void reset_state() { scorer_->reset(); }

private:
    drafter() = default;
    std::unique_ptr<token_scorer> scorer_;
    std::shared_ptr<const gguf::file> file_;  // the tokenizer's source
    std::unique_ptr<tokenizer> tok_;
};

}  // namespace fathom::pflash
