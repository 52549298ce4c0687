// Speculative decoding with n-gram (prompt-lookup) drafts, for any session that can drop positions
// cheaply (session::rolls_back()): the dense families on the CPU and on CUDA. docs/speculative.md.
//
// Each step evaluates the pending token and up to k drafted tokens in ONE forward (all rows' logits),
// then samples each position from the target's own logits with the caller's sampler, in order, exactly
// as plain decoding would: a drafted token is kept while it equals the token sampled at its position;
// the first position whose sampled token differs ends the step (that sampled token is the next pending
// token, its draft and everything after it are dropped with session::truncate). Every position is sampled
// once, from the logits plain decoding would see there, with the same history for the penalties and the
// same draws from the sampler's RNG, so when the engine's logits do not depend on how many tokens one
// forward evaluates (the CPU's default batch-invariant numerics) the output is the plain decoding output
// token for token, greedy or sampled with a seed. Drafts only change the speed. (Compared with the usual
// accept-with-probability-p(d) rule for a deterministic draft, this accepts d with the same probability
// p(d) and otherwise yields a token from p conditioned on "not d": the same distribution, plus identity.)
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"

namespace fathom::spec {

struct ngram_options {
    int32_t draft_max = 8;   // most tokens drafted per step (1..64)
    int32_t ngram_min = 2;   // shortest suffix of the history looked up (1..ngram_max)
    int32_t ngram_max = 4;   // longest suffix looked up (<= 16)
    // Adapt the draft length (draft_budget below). false: always draft_max.
    bool adaptive = true;
    void validate() const;  // throws fathom::error naming the option
};

// Prompt lookup: the longest suffix of `history` of ngram_max down to ngram_min tokens that also
// occurs earlier in it; the tokens that followed its most recent earlier occurrence, at most `max`
// (fewer when the history ends first). Empty when no suffix recurs.
std::vector<int32_t> ngram_draft(std::span<const int32_t> history, const ngram_options &o, int32_t max);

// How many tokens to draft each step (shared by generate and the server's scheduler). Adaptive: after a
// step that kept every draft the next may draft twice as many (up to max), after one that kept none half
// as many; a step at one draft that keeps none also pauses drafting for 1, 3, 7, ... 31 steps (the pause
// grows while drafts keep failing, resets on any kept draft), so text that does not repeat pays almost
// nothing for the drafts' extra rows. Not adaptive: always max.
class draft_budget {
  public:
    draft_budget(int32_t max, bool adaptive) : max_(max), k_(max), adaptive_(adaptive) {}
    int32_t next() {  // drafts to ask for this step; 0 = none (paused)
        if (skip_ > 0) {
            --skip_;
            return 0;
        }
        return adaptive_ ? k_ : max_;
    }
    void update(size_t drafted, size_t kept) {
        if (!adaptive_ || drafted == 0) return;
        if (kept == drafted) {
            k_ = k_ * 2 > max_ ? max_ : k_ * 2;
            pause_ = 0;
        } else if (kept == 0) {
            if (k_ == 1) {
                pause_ = pause_ * 2 + 1 > 31 ? 31 : pause_ * 2 + 1;
                skip_ = pause_;
            }
            k_ = k_ / 2 < 1 ? 1 : k_ / 2;
        } else {
            pause_ = 0;
        }
    }

  private:
    int32_t max_, k_;
    bool adaptive_;
    int32_t skip_ = 0, pause_ = 0;
};

struct spec_stats {
    int64_t steps = 0;     // forwards of the decode loop
    int64_t drafted = 0;   // tokens drafted and evaluated
    int64_t accepted = 0;  // of those, kept
    int64_t emitted = 0;   // tokens handed to on_token and kept (end-of-generation excluded)
    bool hit_ctx = false;  // stopped because the context is full
};

// What to do with a sampled token: keep it (true: go on) or stop. The callback decides about
// end-of-generation (return false without keeping it), token limits and stop strings (keep it, then
// return false).
enum class token_verdict { keep, keep_and_stop, stop };

// Decode from a session that holds the prompt and its last token's logits (after sync), until
// on_token says stop or the context (n_ctx) is full: the plain loop
//   for (;;) { t = smp.sample(logits, held tokens); v = on_token(t); if (v != keep) end;
//              if (n_past >= n_ctx) end (hit_ctx); eval(t); }
// with drafts. Afterwards the session holds the prompt and the kept tokens that were evaluated (the last
// kept token is not evaluated, as in the plain loop). Throws fathom::error when the session cannot roll
// back (session::rolls_back() false) or the sampler throws; the session then holds a prefix of the
// output.
spec_stats generate_ngram(session &s, sampler &smp, int64_t n_ctx, const ngram_options &o,
                          const std::function<token_verdict(int32_t token)> &on_token);

// The same loop with any drafter: draft(history, max) proposes at most `max` tokens to follow `history`
// (the held tokens and the pending one; more are cut). generate_ngram = generate with ngram_draft.
// draft_max and adaptive as in ngram_options (draft_max in [1, 64]).
using drafter = std::function<std::vector<int32_t>(std::span<const int32_t> history, int32_t max)>;
spec_stats generate(session &s, sampler &smp, int64_t n_ctx, int32_t draft_max, bool adaptive, const drafter &draft,
                    const std::function<token_verdict(int32_t token)> &on_token);

// Draft-model speculation: a smaller model with the same vocabulary proposes the drafts. Each call syncs
// the draft session to the history (it keeps the longest common prefix, so it evaluates only what the
// target kept since the last call) and decodes up to `max` tokens greedily (argmax, lowest id on ties).
// A history longer than the draft engine's context gets no drafts. Use as the `drafter` of generate().
class model_drafter {
  public:
    // Throws fathom::error when the vocabularies differ (size, or any token's bytes).
    model_drafter(engine &draft, const engine &target);
    std::vector<int32_t> operator()(std::span<const int32_t> history, int32_t max);

  private:
    engine &e_;
    std::unique_ptr<session> s_;
};

}  // namespace fathom::spec
