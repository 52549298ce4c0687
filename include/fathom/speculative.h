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
#include <optional>
#include <utility>
#include <span>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"

namespace fathom::spec {

// What a verification of r rows costs (r = 1 + drafts), learnt from measured forwards: the one-row
// forward's time t(1) (a decayed mean) and, apart from it, a line t(r) = g + h (r - 2) over the forwards
// of r >= 2 rows, fitted by exponentially decayed least squares (recent forwards weigh more; the model's
// depth and the machine's load change it). Before any multi-row forward the prior t(1) (1 + 0.25 (r - 1));
// with one width r0 seen, its mean and beyond it the smaller of that slope and (t(r0) - t(1)) / (r0 - 1).
// The two parts
// because the curve need not be one line: a GPU's multi-row step pays a jump at r = 2 (another kernel
// path: 1.84 steps on the 8-layer H100 file) and ~0.3 a row after it, which a single line through the
// one- and two-row forwards would extrapolate to 4.4 at r = 5 (measured: 2.8). The CPU's rows cost ~0.85
// of a step each, the GPU's a few percent: the same code learns either.
// The drafter's own time is a second line, d(k) = d0 + d1 * (k - 1) for k >= 1 drafts asked for, fitted
// the same way from timed drafts (observe_draft; no prior: free until the first draft is timed): a model
// drafter (the MTP head) costs per token, a block drafter (DSpark) once per step whatever k. The width
// pays for both (draft_budget): a drafter that costs more than its kept tokens save is not asked.
class verify_cost {
  public:
    verify_cost() = default;
    explicit verify_cost(double fixed_row_cost) : fixed_(fixed_row_cost) {}  // >= 0: t(r) / t(1) = 1 + it (r - 1)
    void observe(int32_t rows, double seconds);  // rows >= 1, seconds > 0 (others ignored)
    // t(rows) / t(1) from the fit (>= 1, non-decreasing in rows); before any measurement the prior 1 + 0.25 (rows - 1).
    double ratio(int32_t rows) const;
    // A draft of k >= 1 tokens took `seconds` (others ignored).
    void observe_draft(int32_t k, double seconds);
    // d(k) / t(1): what drafting k tokens costs in one-row forwards; 0 for k <= 0, before any timed draft,
    // and with a fixed row cost (the deterministic widths of tests).
    double draft_ratio(int32_t k) const;
    int64_t observations() const { return n_; }
    // No recent forward of one row: the line's intercept rests on extrapolation (a run of wide drafts
    // cannot tell a row's price from the step's), so a plain step should be measured (draft_budget::next).
    bool wants_one_row() const { return fixed_ < 0 && w_one_ < 0.3; }

  private:
    // A line y = a + b x by exponentially decayed least squares.
    struct decayed_line {
        double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
        int64_t n = 0;
        void add(double x, double y, double w);
        void decay(double f);
        // (a, b) with b >= 0 (a cost never falls with more rows or drafts: the mean instead); b = 0 when
        // every point has the same x.
        std::pair<double, double> fit() const;
        bool spread() const;  // x varies enough to fit a slope
    };
    double alpha() const;  // t(1) in seconds (<= 0: unknown)
    double fixed_ = -1.0;  // >= 0: the fixed slope (observations ignored)
    decayed_line one_;     // one-row forwards (x = 0, y = seconds): their decayed mean
    decayed_line multi_;   // forwards of r >= 2 rows (x = r - 2, y = seconds)
    decayed_line draft_;   // (x = k - 1, y = seconds)
    int64_t n_ = 0;
    double w_one_ = 0;  // decayed weight of one-row forwards
};

// How many tokens to draft each step (shared by generate and the server's scheduler).
// Adaptive: the width k that maximises the expected tokens per unit of time,
//   E(k) / (c(1 + k) + d(k)),  E(k) = 1 + a + a^2 + ... + a^k,
// where a is the running per-draft acceptance (a draft is kept with probability a once its
// predecessors were; estimated from decayed counts of kept drafts and first rejections, starting near
// 2/3), c the verification cost ratio and d the drafter's (verify_cost; without one, c(r) = 1 and d = 0:
// the widest draft that pays at all). A single sequence (other_rows 0) whose cost model has no recent one-row forward gets a
// plain step first (verify_cost::wants_one_row: one in ~60 steps at worst). When k = 0 wins (the drafts cost more than they return), drafting pauses but probes one
// draft after 1, 3, 7, ... 63 steps (the pause grows with every probe while k = 0 keeps winning; kept
// probes raise the acceptance estimate until drafting pays again; a probe dearer than ~0.9 of a step,
// such as a DSpark block's, waits longer: up to 70 probe costs, at most 1023 steps), so an always-wrong or
// mediocre drafter costs ~1.5 % of plain decoding while a drafter that becomes good is noticed.
// Not adaptive: always max.
class draft_budget {
  public:
    draft_budget(int32_t max, bool adaptive) : max_(max), adaptive_(adaptive) {}
    // Drafts to ask for this step; 0 = none. cost: the verification costs (null: free rows);
    // other_rows: rows of other sequences in the same forward (batched serving), whose cost is paid
    // anyway: the drafts' price is then c(other + 1 + k) / c(other + 1).
    int32_t next(const verify_cost *cost = nullptr, int32_t other_rows = 0);
    // A drafter that predicts each draft's chance (session::draft_confidence: c[j] = P(draft j kept | the
    // ones before it kept)): the prefix width k' <= c.size() that maximises E(k') / c(1 + k') with
    // E(k') = 1 + c0 + c0 c1 + ... (the same objective as next(), this step's own odds instead of the
    // running acceptance; the drafter's time is spent by then and not counted). Confidences outside [0, 1]
    // (NaN included) count as 0.
    static size_t cut(std::span<const float> c, const verify_cost *cost = nullptr, int32_t other_rows = 0);
    void update(size_t drafted, size_t kept);
    double acceptance() const { return kept_ / (kept_ + rejected_); }

  private:
    int32_t max_;
    bool adaptive_;
    double kept_ = 2.0, rejected_ = 1.0;  // decayed counts (the prior: a = 2/3)
    int32_t skip_ = 0, pause_ = 0;
};

// The draft width of every drafter (draft_budget).
struct width_options {
    int32_t draft_max = 8;  // most tokens drafted per step (1..64)
    // Adapt the draft length (draft_budget below). false: always draft_max.
    bool adaptive = true;
    // The verification cost of each extra row relative to a one-row forward, for the adaptive width:
    // < 0 (default) measured from the forwards as they run (verify_cost); >= 0 fixed (deterministic
    // widths: tests, reproducible comparisons).
    double row_cost = -1.0;
    void validate() const;  // throws fathom::error naming the option
    verify_cost cost() const;  // the cost model this asks for
};

struct ngram_options : width_options {
    int32_t ngram_min = 2;   // shortest suffix of the history looked up (1..ngram_max)
    int32_t ngram_max = 4;   // longest suffix looked up (<= 16)
    void validate() const;  // throws fathom::error naming the option
};

// Prompt lookup: the longest suffix of `history` of ngram_max down to ngram_min tokens that also
// occurs earlier in it; the tokens that followed its most recent earlier occurrence, at most `max`
// (fewer when the history ends first). Empty when no suffix recurs.
std::vector<int32_t> ngram_draft(std::span<const int32_t> history, const ngram_options &o, int32_t max);

// The acceptance rule, written once (generate, the scheduler): a verification's rows j = 0..k hold the
// logits after the pending token and drafts[0..j); position j is sampled from its own row with the
// history grown by the kept drafts, exactly as plain decoding would, and draft j is kept while it equals
// its position's sample. sample(j) returns position j's token, or nothing to stop (the caller ended the
// generation); take(j, token) is asked when position j matched its draft: the caller takes it (appends
// it to its history) and goes on, takes it and stops (a token limit), or refuses it (an end of
// generation: then it is the step's last sample, as a differing one is). Returns how many drafts were
// taken; *last receives the step's last sample when it was not taken (a sample that differed from its
// draft, row k's, or a refused match), else -1.
enum class draft_verdict { take, take_and_stop, refuse };
template <class Sample, class Take>
size_t accept_drafts(std::span<const int32_t> drafts, Sample &&sample, Take &&take, int32_t *last) {
    *last = -1;
    for (size_t j = 0;; ++j) {
        const std::optional<int32_t> y = sample(j);
        if (!y) return j;
        if (j < drafts.size() && *y == drafts[j]) {
            const draft_verdict v = take(j, *y);
            if (v == draft_verdict::take) continue;
            if (v == draft_verdict::take_and_stop) return j + 1;
        }
        *last = *y;
        return j;
    }
}

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
// The width as width_options say (validated here).
using drafter = std::function<std::vector<int32_t>(std::span<const int32_t> history, int32_t max)>;
spec_stats generate(session &s, sampler &smp, int64_t n_ctx, const width_options &width, const drafter &draft,
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
