// Sampling parameters and a sampler usable by the CLI and the server (no model internals).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
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

// What a device hands the sampler instead of every logit (sampler::sample_top): the best candidates
// of the PENALISED logits (penalty_counts() applied with the sampler's penalty formula; any order,
// ties at the cut resolved towards lower ids), and the softmax statistics of the whole penalised
// distribution: max_logit and z = sum over all tokens of exp(l - max_logit) (f32 exp, f64 sum).
struct logits_top {
    std::vector<int32_t> ids;
    std::vector<float> logits;  // logits[i] is token ids[i]'s
    float max_logit = 0.0f;
    double z = 0.0;
    int64_t n_vocab = 0;
};

// Thinking control of one generation (the server's reasoning mode; docs/server.md "Thinking"): tokens
// the generator must emit instead of sampling. forced(generated) is a pure function of the tokens
// generated so far, so a speculative verification that samples each draft position in turn gets the
// same answer as plain decoding.
//   open   — emitted as the first generated tokens (e.g. DS4's "<think>": the prompt then ends at
//            "<｜Assistant｜>", a prefix of every later turn's prompt; docs/ds4-chat-format.md).
//   close  — the end-of-thinking sequence ("</think>" tokenized).
//   budget — thinking tokens allowed after `open` (-1: unlimited). When that many were generated and
//            `close` has not appeared, the generator emits `close` (continuing a partial match of its
//            first tokens at the end of the thinking) and sampling resumes for the answer.
struct think_control {
    std::vector<int32_t> open;
    std::vector<int32_t> close;
    int32_t budget = -1;
    // The token that must come next, or -1 (sample).
    int32_t forced(std::span<const int32_t> generated) const;
};

class sampler {
public:
    explicit sampler(const sampling_params &p);
    ~sampler();
    // Choose the next token from logits (n_vocab floats) given the history (for penalties).
    sample_result sample(std::span<const float> logits, std::span<const int32_t> history);
    void reset();  // re-seed
    const sampling_params &params() const;

    // Sampling from a device's summary of the logits (the device applies the penalties and keeps the
    // best candidates, so n_vocab logits never cross to the host). top_candidates(): how many best
    // candidates the summary should hold: max(top_k, n_logprobs, 1) with top-k on, otherwise 256.
    size_t top_candidates() const;
    // (token, count) of every distinct token in the penalty window of `history`, in first-seen order,
    // or empty when no penalty applies; throws like sample() on a history token outside [0, n_vocab).
    std::vector<std::pair<int32_t, int32_t>> penalty_counts(std::span<const int32_t> history, int64_t n_vocab) const;
    // The result sample(all logits, history) would give, draws from the RNG included, when the summary
    // determines it: greedy, top-k within the summary, or (top-k off) a min-p or top-p cut inside it.
    // nullopt otherwise (the RNG untouched): the caller then passes every logit to sample().
    // Equality with sample() holds up to the f64 rounding of z, which the device sums in another order.
    std::optional<sample_result> sample_top(const logits_top &t);
private:
    struct impl;
    std::unique_ptr<impl> p_;
};

}  // namespace fathom
