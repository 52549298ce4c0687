// Sampling parameters and a sampler usable by the CLI and the server (no model internals).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace fathom {

struct sampling_params {
    float temperature = 0.8f;   // 0 = greedy
    int32_t top_k = 40;         // 0 = off
    float top_p = 0.95f;        // 1 = off
    float min_p = 0.05f;        // 0 = off
    float repeat_penalty = 1.0f;     // 1 = off (llama.cpp semantics: divide positive, multiply negative logits)
    int32_t repeat_last_n = 64;      // window for penalties; -1 = whole history
    float frequency_penalty = 0.0f;  // OpenAI semantics
    float presence_penalty = 0.0f;
    uint64_t seed = 0xF47F47ull;     // reproducible stream of draws
    int32_t n_logprobs = 0;          // top-n logprobs to report (0 = none)
    // Validation: throws fathom::error naming the parameter (NaN, negative temperature, top_p outside (0,1], ...).
    void validate() const;
};

struct token_logprob {
    int32_t token;
    float logprob;
};

struct sample_result {
    int32_t token = -1;
    float logprob = 0.0f;                  // log-softmax of the chosen token over the full (penalised) distribution
    std::vector<token_logprob> top;        // n_logprobs best alternatives, descending
};

class sampler {
public:
    explicit sampler(const sampling_params &p);
    ~sampler();
    // Choose the next token from logits (n_vocab floats) given the history (for penalties).
    sample_result sample(std::span<const float> logits, std::span<const int32_t> history);
    void reset();  // re-seed
private:
    struct impl;
    std::unique_ptr<impl> p_;
};

}  // namespace fathom
