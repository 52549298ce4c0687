// N-gram speculative decoding (include/fathom/speculative.h, docs/speculative.md).
#include "fathom/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <string>

#include "core/error.h"

namespace fathom::spec {

void width_options::validate() const {
    if (draft_max < 1 || draft_max > 64) throw error("speculative: draft_max must be in [1, 64], got " + std::to_string(draft_max));
    if (!(row_cost < 0 || (row_cost >= 0 && row_cost <= 64)) || std::isnan(row_cost))
        throw error("speculative: row_cost must be < 0 (measured) or in [0, 64], got " + std::to_string(row_cost));
}

verify_cost width_options::cost() const {
    return row_cost >= 0 ? verify_cost(row_cost) : verify_cost();
}

void ngram_options::validate() const {
    width_options::validate();
    if (ngram_max < 1 || ngram_max > 16) throw error("speculative: ngram_max must be in [1, 16], got " + std::to_string(ngram_max));
    if (ngram_min < 1 || ngram_min > ngram_max)
        throw error("speculative: ngram_min must be in [1, ngram_max = " + std::to_string(ngram_max) + "], got " +
                    std::to_string(ngram_min));
}

std::vector<int32_t> ngram_draft(std::span<const int32_t> h, const ngram_options &o, int32_t max) {
    const size_t n = h.size();
    if (max <= 0) return {};
    for (size_t len = std::min<size_t>(static_cast<size_t>(o.ngram_max), n > 0 ? n - 1 : 0);
         len >= static_cast<size_t>(o.ngram_min) && len > 0; --len) {
        const int32_t *suffix = h.data() + (n - len);
        // Most recent earlier occurrence: start positions i < n - len, scanned from the end. An occurrence
        // overlapping the suffix is fine (a periodic history drafts its period).
        for (size_t i = n - len; i-- > 0;) {
            if (!std::equal(suffix, suffix + len, h.data() + i)) continue;
            const size_t from = i + len;  // < n: what followed that occurrence
            const size_t take = std::min<size_t>(static_cast<size_t>(max), n - from);
            return {h.begin() + static_cast<std::ptrdiff_t>(from), h.begin() + static_cast<std::ptrdiff_t>(from + take)};
        }
    }
    return {};
}

// ---- width ----------------------------------------------------------------------------------------

namespace {
constexpr double kCostDecay = 0.98;    // per measured forward: ~50 forwards of memory
constexpr double kCostPriorSlope = 0.25;  // prior beta / alpha
constexpr double kCostPriorWeight = 0.5;  // per prior point (they decay with the data)
constexpr double kAcceptDecay = 0.95;  // per verified step: ~20 steps of memory
constexpr int32_t kMaxPause = 63;      // steps between probes of an unprofitable drafter
constexpr double kProbeShare = 70;     // ... or probe costs (in steps) when that is more
constexpr double kProbeFloor = 40;     // the shortest pause, in probe costs
constexpr int32_t kMaxProbePause = 1023;
}  // namespace

void verify_cost::decayed_line::add(double x, double y, double w) {
    sw += w;
    sx += w * x;
    sy += w * y;
    sxx += w * x * x;
    sxy += w * x * y;
}

void verify_cost::decayed_line::decay(double f) {
    sw *= f;
    sx *= f;
    sy *= f;
    sxx *= f;
    sxy *= f;
}

std::pair<double, double> verify_cost::decayed_line::fit() const {
    if (!(sw > 0)) return {0.0, 0.0};
    const double den = sw * sxx - sx * sx;  // sw^2 * the weighted variance of x
    double b = spread() ? (sw * sxy - sx * sy) / den : 0.0;
    double a = (sy - b * sx) / sw;
    if (b < 0) {  // more rows (drafts) cannot cost less: the mean is the cost of any width
        b = 0;
        a = sy / sw;
    }
    return {a, b};
}

bool verify_cost::decayed_line::spread() const {
    // x varies enough to fix a slope: a weighted variance of at least 0.1 (decayed points of another width
    // from long ago do not count)
    return sw > 0 && (sw * sxx - sx * sx) >= 0.1 * sw * sw;
}

void verify_cost::observe(int32_t rows, double seconds) {
    if (fixed_ >= 0 || rows < 1 || !(seconds > 0) || !std::isfinite(seconds)) return;
    if (n_ == 0)  // the one-row time before one is measured, at this machine's scale: t(r) / (1 + 0.25 (r - 1))
        one_.add(0, seconds / (1 + kCostPriorSlope * (rows - 1)), kCostPriorWeight);
    one_.decay(kCostDecay);
    multi_.decay(kCostDecay);
    w_one_ = w_one_ * kCostDecay + (rows == 1 ? 1.0 : 0.0);
    if (rows == 1)
        one_.add(0, seconds, 1.0);
    else
        multi_.add(rows - 2, seconds, 1.0);
    ++n_;
}

double verify_cost::alpha() const {
    return one_.sw > 0 ? one_.sy / one_.sw : 0.0;
}

double verify_cost::ratio(int32_t rows) const {
    if (rows <= 1) return 1.0;
    const double x = rows - 1;
    if (fixed_ >= 0) return 1 + fixed_ * x;
    const double t1 = alpha();
    if (n_ == 0 || !(t1 > 0) || !(multi_.sw > 0)) return 1 + kCostPriorSlope * x;  // the prior
    if (multi_.spread()) {
        const auto [a, b] = multi_.fit();  // b >= 0: non-decreasing in rows
        return std::max(1.0, (a + b * (rows - 2)) / t1);
    }
    // One width r0 seen (the probes of a paused drafter): its mean m; beyond it the smaller of the prior's
    // slope and the average step from one row to r0 (a GPU's jump at two rows is not a slope).
    const double m = multi_.sy / multi_.sw, r0 = multi_.sx / multi_.sw + 2;
    const double slope = std::min(kCostPriorSlope * t1, std::max(0.0, (m - t1) / (r0 - 1)));
    return std::max(1.0, (m + slope * (rows - r0)) / t1);
}

void verify_cost::observe_draft(int32_t k, double seconds) {
    if (fixed_ >= 0 || k < 1 || !(seconds > 0) || !std::isfinite(seconds)) return;
    draft_.decay(kCostDecay);
    draft_.add(k - 1, seconds, 1.0);
    ++draft_.n;
}

double verify_cost::draft_ratio(int32_t k) const {
    if (k <= 0 || fixed_ >= 0 || draft_.n == 0) return 0.0;
    const double t1 = alpha();
    if (!(t1 > 0)) return 0.0;  // no forward timed yet: nothing to compare with
    const auto [a, b] = draft_.fit();
    return std::max(0.0, a + b * (k - 1)) / t1;
}

namespace {

// The width k in [0, n] that maximises E(k) / (c(base + k) / c(base)): E(k) = 1 + p1 + p1 p2 + ..., with
// p_j = odds(j) the chance that draft j is kept once the ones before it were, base = other_rows + 1
// (the step's rows without these drafts), c the cost curve (null: rows are free). next() and cut().
template <class Odds>
int32_t best_width(int32_t n, const verify_cost *cost, int32_t other_rows, bool draft_paid, Odds &&odds) {
    const int32_t base = std::max(other_rows, 0) + 1;
    const double c0 = cost ? cost->ratio(base) : 1.0;
    int32_t best_k = 0;
    double best = 1.0, e = 1.0, p = 1.0;  // E(0) / 1 = 1
    for (int32_t k = 1; k <= n; ++k) {
        p *= odds(k);
        e += p;
        // the verification's rows and (unless already spent) the drafter's time, relative to the step without drafts
        const double g = e / (cost ? (cost->ratio(base + k) + (draft_paid ? 0.0 : cost->draft_ratio(k))) / c0 : 1.0);
        if (g > best * (1 + 1e-9)) {
            best = g;
            best_k = k;
        }
    }
    return best_k;
}

}  // namespace

int32_t draft_budget::next(const verify_cost *cost, int32_t other_rows) {
    if (!adaptive_) return max_;
    if (cost && other_rows <= 0 && cost->wants_one_row()) return 0;  // measure a plain step first
    const double a = acceptance();
    const int32_t best_k = best_width(max_, cost, other_rows, false, [a](int32_t) { return a; });
    if (best_k > 0) {
        pause_ = 0;
        skip_ = 0;
        return best_k;
    }
    if (skip_ > 0) {
        --skip_;
        return 0;
    }
    // One draft, to learn whether the drafter got better; the next probe waits twice as long (a kept
    // probe only moves the acceptance estimate: drafting resumes when the estimate says it pays), at most
    // kMaxPause steps, or kProbeShare probe costs when a probe costs more (a DSpark block: its pause then
    // keeps the probes near 1.4 % of plain decoding's time); and from the first probe on at least
    // kProbeFloor probe costs (~2.5 %: a probe of a two-row step and a DSpark block is ~2 steps, so the
    // doubling 1, 3, 7, .. alone spent 6-12 % of the first 128-256 tokens in the 08:15 H100 run).
    int32_t cap = kMaxPause, floor = 0;
    if (cost) {
        const int32_t base = std::max(other_rows, 0) + 1;
        const double probe = (cost->ratio(base + 1) + cost->draft_ratio(1)) / cost->ratio(base) - 1;  // in steps
        if (probe * kProbeShare > kMaxPause) cap = static_cast<int32_t>(std::min(probe * kProbeShare, double(kMaxProbePause)));
        floor = static_cast<int32_t>(std::min(std::ceil(probe * kProbeFloor), double(cap)));
    }
    pause_ = std::min(std::max(pause_ * 2 + 1, floor), cap);
    skip_ = pause_;
    return 1;
}

size_t draft_budget::cut(std::span<const float> c, const verify_cost *cost, int32_t other_rows) {
    // the drafts exist: their drafting time is spent whatever the cut
    return static_cast<size_t>(best_width(static_cast<int32_t>(c.size()), cost, other_rows, true, [c](int32_t j) {
        const float q = c[static_cast<size_t>(j - 1)];
        return (q >= 0.0f && q <= 1.0f) ? static_cast<double>(q) : 0.0;
    }));
}

void draft_budget::update(size_t drafted, size_t kept) {
    if (!adaptive_ || drafted == 0) return;
    kept_ = kept_ * kAcceptDecay + static_cast<double>(kept);
    rejected_ = rejected_ * kAcceptDecay + (kept < drafted ? 1.0 : 0.0);
}

// ---- the loop -------------------------------------------------------------------------------------

spec_stats generate_ngram(session &s, sampler &smp, int64_t n_ctx, const ngram_options &o,
                          const std::function<token_verdict(int32_t)> &on_token) {
    o.validate();
    return generate(s, smp, n_ctx, o,
                    [&o](std::span<const int32_t> h, int32_t max) { return ngram_draft(h, o, max); }, on_token);
}

spec_stats generate(session &s, sampler &smp, int64_t n_ctx, const width_options &width, const drafter &draft,
                    const std::function<token_verdict(int32_t)> &on_token) {
    width.validate();
    if (!s.rolls_back())
        throw error("speculative decoding needs a session that can drop rejected positions; this engine's "
                    "sessions cannot (DeepSeek V4 rolls back on one device, the CPU or one GPU, not across several)");
    spec_stats st;
    std::vector<int32_t> hist = s.tokens();  // what the session holds (+ the kept tokens as they come)
    std::vector<float> rows;                 // [1 + k, n_vocab] logits of the step's forward
    std::span<const float> logits = s.logits();
    if (hist.empty() || logits.empty()) throw error("speculative decoding: the session holds no prompt logits");
    const size_t V = logits.size();
    std::vector<float> first(logits.begin(), logits.end());  // the session's buffer changes with eval
    std::span<const float> cur(first);
    draft_budget budget(width.draft_max, width.adaptive);
    verify_cost cost = width.cost();  // this session's forwards, timed (unless fixed)
    bool pending = false;  // `tok` was sampled (from the last step's logits) and not yet judged
    int32_t tok = -1;
    for (;;) {
        if (!pending) tok = smp.sample(cur, hist).token;
        pending = false;
        const token_verdict v = on_token(tok);
        if (v == token_verdict::stop) break;
        ++st.emitted;
        if (v == token_verdict::keep_and_stop) break;
        if (static_cast<int64_t>(hist.size()) >= n_ctx) {
            st.hit_ctx = true;
            break;
        }
        hist.push_back(tok);
        // Drafts that fit: the forward appends 1 + k tokens.
        const int64_t room = n_ctx - static_cast<int64_t>(hist.size());
        // ...and that the session can drop again (DS4: a few positions of history in its rings).
        const int32_t k_max = static_cast<int32_t>(std::min({static_cast<int64_t>(budget.next(&cost)), room, s.rollback_limit()}));
        std::vector<int32_t> drafts;
        if (k_max > 0) {  // the drafter's time joins the cost model (draft_budget pays for it)
            const auto d0 = std::chrono::steady_clock::now();
            drafts = draft(hist, k_max);
            cost.observe_draft(k_max, std::chrono::duration<double>(std::chrono::steady_clock::now() - d0).count());
        }
        if (drafts.size() > static_cast<size_t>(std::max(k_max, 0))) drafts.resize(static_cast<size_t>(std::max(k_max, 0)));
        if (const std::vector<float> conf = s.draft_confidence(); !conf.empty() && width.adaptive)
            drafts.resize(std::min(drafts.size(), draft_budget::cut(std::span<const float>(conf).first(
                                                                         std::min(conf.size(), drafts.size())),
                                                                     &cost)));
        std::vector<int32_t> batch;
        batch.reserve(1 + drafts.size());
        batch.push_back(tok);
        batch.insert(batch.end(), drafts.begin(), drafts.end());
        rows.resize(batch.size() * V);
        const auto t0 = std::chrono::steady_clock::now();
        // rows filled, or (a GPU session) left on the device and sampled there (sample_row)
        const bool host_rows = s.eval_verify(batch, rows.data());
        cost.observe(static_cast<int32_t>(batch.size()),
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        ++st.steps;
        st.drafted += static_cast<int64_t>(drafts.size());
        // A throw (the sampler, on_token) leaves the session holding only the kept tokens.
        struct trim_on_throw {
            session &s;
            const std::vector<int32_t> &hist;
            int n = std::uncaught_exceptions();
            ~trim_on_throw() {
                if (std::uncaught_exceptions() > n) {
                    try {
                        s.truncate(static_cast<int64_t>(hist.size()));
                    } catch (...) {
                    }
                }
            }
        } guard{s, hist};
        bool stop = false;
        int32_t last = -1;
        const size_t j = accept_drafts(
            drafts,
            [&](size_t i) -> std::optional<int32_t> {
                if (!host_rows) return s.sample_row(i, smp, hist).token;
                cur = std::span<const float>(rows.data() + i * V, V);
                return smp.sample(cur, hist).token;
            },
            [&](size_t, int32_t y) {
                const token_verdict w = on_token(y);
                if (w == token_verdict::stop) {
                    stop = true;
                    return draft_verdict::refuse;
                }
                ++st.emitted;
                ++st.accepted;
                if (w == token_verdict::keep_and_stop || static_cast<int64_t>(hist.size()) >= n_ctx) {
                    st.hit_ctx = w == token_verdict::keep;
                    stop = true;
                    return draft_verdict::take_and_stop;  // kept, not evaluated (as the plain loop's last)
                }
                hist.push_back(y);
                return draft_verdict::take;
            },
            &last);
        if (!stop) {
            tok = last;  // the next position's token, sampled from its logits: judged at the loop's top
            pending = true;
        }
        s.truncate(static_cast<int64_t>(hist.size()));  // drop the drafts after the kept ones
        budget.update(drafts.size(), j);
        if (stop) break;
    }
    return st;
}

model_drafter::model_drafter(engine &draft, const engine &target) : e_(draft) {
    const int32_t n = target.info().n_vocab;
    if (draft.info().n_vocab != n)
        throw error("draft model: vocabulary of " + std::to_string(draft.info().n_vocab) + " tokens, the target's has " +
                    std::to_string(n) + " (draft-model speculation needs the same tokenizer)");
    for (int32_t t = 0; t < n; ++t)
        if (draft.token_to_piece(t) != target.token_to_piece(t))
            throw error("draft model: token " + std::to_string(t) + " differs from the target's (draft-model "
                        "speculation needs the same tokenizer)");
    s_ = draft.new_session();
}

std::vector<int32_t> model_drafter::operator()(std::span<const int32_t> history, int32_t max) {
    std::vector<int32_t> out;
    const int64_t n_ctx = e_.info().n_ctx;
    if (max <= 0 || history.empty() || static_cast<int64_t>(history.size()) + max > n_ctx) return out;
    s_->sync(history);
    for (int32_t i = 0; i < max; ++i) {
        const std::span<const float> l = s_->logits();
        int32_t best = 0;
        for (size_t v = 1; v < l.size(); ++v)
            if (l[v] > l[static_cast<size_t>(best)]) best = static_cast<int32_t>(v);
        out.push_back(best);
        if (i + 1 < max) s_->eval(std::span<const int32_t>(&out.back(), 1));
    }
    return out;
}

}  // namespace fathom::spec
