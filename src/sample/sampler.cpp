// Token sampler: implements include/fathom/sampling.h.
//
// One call of sampler::sample() runs the stages in llama.cpp's order on a candidate list
// [n_vocab] of (token, logit):
//
//   penalties (repeat / frequency / presence over the last N history tokens)
//     -> log-softmax of the full penalised distribution (the reported logprobs)
//     -> temperature == 0 ? argmax (ties -> lowest id)
//     -> top-k -> top-p -> min-p -> temperature -> draw with the seeded RNG.
//
// top-p and min-p see the logits before temperature (as in llama.cpp); temperature only reshapes
// the distribution the survivors are drawn from. All working buffers live in impl and are sized on
// the first call (or when n_vocab changes), so steady-state sampling does not allocate, except
// for sample_result::top when n_logprobs > 0 (it is returned by value).
#include "fathom/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <unordered_map>

#include "core/error.h"

namespace fathom {

// ---------------------------------------------------------------------------------------------
// Parameter validation
// ---------------------------------------------------------------------------------------------

namespace {

std::string fmt_float(float v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    return std::to_string(v);
}

[[noreturn]] void bad_param(const char *name, const std::string &value, const char *rule) {
    throw error(std::string("invalid sampling parameter ") + name + " = " + value + ": " + rule);
}

}  // namespace

void sampling_params::validate() const {
    // Written as !(ok) so that NaN, for which every comparison is false, fails each check.
    if (!(std::isfinite(temperature) && temperature >= 0.0f))
        bad_param("temperature", fmt_float(temperature), "must be a finite number >= 0");
    if (top_k < 0) bad_param("top_k", std::to_string(top_k), "must be >= 0 (0 = off)");
    if (!(top_p > 0.0f && top_p <= 1.0f))
        bad_param("top_p", fmt_float(top_p), "must be in (0, 1] (1 = off)");
    if (!(min_p >= 0.0f && min_p <= 1.0f))
        bad_param("min_p", fmt_float(min_p), "must be in [0, 1] (0 = off)");
    if (!(std::isfinite(repeat_penalty) && repeat_penalty > 0.0f))
        bad_param("repeat_penalty", fmt_float(repeat_penalty), "must be a finite number > 0 (1 = off)");
    if (repeat_last_n < -1)
        bad_param("repeat_last_n", std::to_string(repeat_last_n), "must be >= -1 (-1 = whole history, 0 = off)");
    if (!std::isfinite(frequency_penalty))
        bad_param("frequency_penalty", fmt_float(frequency_penalty), "must be finite");
    if (!std::isfinite(presence_penalty))
        bad_param("presence_penalty", fmt_float(presence_penalty), "must be finite");
    if (n_logprobs < 0) bad_param("n_logprobs", std::to_string(n_logprobs), "must be >= 0");
}

// ---------------------------------------------------------------------------------------------
// Sampler state
// ---------------------------------------------------------------------------------------------

namespace {

struct candidate {
    int32_t token;
    float logit;
};

// Descending logit, ties broken by ascending id: a strict weak order on finite-or--inf logits
// that makes every truncation and the greedy choice deterministic.
inline bool better(const candidate &a, const candidate &b) {
    if (a.logit != b.logit) return a.logit > b.logit;
    return a.token < b.token;
}

}  // namespace

struct sampler::impl {
    sampling_params params;
    std::mt19937_64 rng;

    std::vector<float> full;         // [n_vocab] penalised logits, indexed by token id
    std::vector<candidate> cand;     // [n_vocab] working set, shrinks through the truncation stages
    std::vector<candidate> ranked;   // [n_vocab] copy used to rank logprob alternatives
    std::vector<int32_t> counts;     // [n_vocab] occurrences in the penalty window (zeroed after use)
    std::vector<int32_t> touched;    // distinct tokens whose counts are non-zero
    std::vector<double> probs;       // [n_cand] unnormalised probabilities of the survivors
    bool sorted = false;             // cand is ordered by better()
    float full_max = 0.0f;           // max of `full`
    double full_z = 0.0;             // sum of exp(full - full_max): softmax normaliser of `full`

    explicit impl(const sampling_params &p) : params(p), rng(p.seed) {}

    void prepare(std::span<const float> logits);
    void apply_penalties(std::span<const int32_t> history);
    void normalise_full();
    void fill_logprobs(sample_result &out, int32_t chosen);
    int32_t argmax() const;
    void apply_top_k();
    void softmax_stats(float &max_l, double &z) const;
    void apply_top_p(float max_l, double z);
    void apply_min_p();
    int32_t draw();
};

// Copies logits into `full`, rejecting values no distribution can be built from
// (NaN, +inf, or nothing but -inf). Buffers grow only when n_vocab does.
void sampler::impl::prepare(std::span<const float> logits) {
    const size_t n = logits.size();
    if (n == 0) throw error("sampler: empty logits");
    if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
        throw error("sampler: vocabulary too large (" + std::to_string(n) + " logits)");
    if (full.size() != n) {
        full.resize(n);
        counts.assign(n, 0);
        touched.reserve(n);  // distinct tokens in any window <= n_vocab: never regrows
        cand.reserve(n);
        ranked.reserve(n);
        probs.reserve(n);
    }
    bool any_finite = false;
    for (size_t i = 0; i < n; ++i) {
        const float v = logits[i];
        if (std::isnan(v) || v == std::numeric_limits<float>::infinity())
            throw error("sampler: logit of token " + std::to_string(i) + " is " + fmt_float(v));
        any_finite |= std::isfinite(v);
        full[i] = v;
    }
    if (!any_finite) throw error("sampler: every logit is -inf");
}

// llama.cpp semantics for the repeat penalty (a positive logit is divided by it, a negative one
// multiplied, so the token always becomes less likely); OpenAI semantics for frequency
// (count * penalty) and presence (penalty once if count > 0), both subtracted.
// The history tokens the penalties look at: the last repeat_last_n (all with -1), or none when no
// penalty is configured.
static std::span<const int32_t> penalty_window(const sampling_params &p, std::span<const int32_t> history) {
    if (p.repeat_penalty == 1.0f && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f) return {};
    if (p.repeat_last_n == 0) return {};
    size_t window = history.size();
    if (p.repeat_last_n > 0) window = std::min(window, static_cast<size_t>(p.repeat_last_n));
    return history.subspan(history.size() - window);
}

void sampler::impl::apply_penalties(std::span<const int32_t> history) {
    const auto recent = penalty_window(params, history);
    if (recent.empty()) return;
    const sampling_params &p = params;
    const int64_t n_vocab = static_cast<int64_t>(full.size());
    touched.clear();
    for (int32_t t : recent) {
        if (t < 0 || t >= n_vocab) {
            for (int32_t u : touched) counts[u] = 0;  // leave counts clean for the next call
            throw error("sampler: history token " + std::to_string(t) + " outside vocabulary [0, " +
                        std::to_string(n_vocab) + ")");
        }
        if (counts[t]++ == 0) touched.push_back(t);
    }
    for (int32_t t : touched) {
        float &l = full[t];
        const int32_t c = counts[t];
        if (std::isfinite(l)) {  // a masked (-inf) token stays masked
            l = l > 0.0f ? l / p.repeat_penalty : l * p.repeat_penalty;
            l -= static_cast<float>(c) * p.frequency_penalty + p.presence_penalty;
            // Extreme (finite) penalties can overflow to +-inf; keep the logit finite so the
            // softmax and the comparator stay well defined.
            l = std::clamp(l, -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
        }
        counts[t] = 0;
    }
}

// Softmax normaliser of the full penalised distribution; top-p reuses it when no top-k ran
// before it (then its candidates are exactly `full`), saving a second pass over the vocabulary.
void sampler::impl::normalise_full() {
    float max_l = -std::numeric_limits<float>::infinity();
    for (float l : full) max_l = std::max(max_l, l);
    double sum = 0.0;
    for (float l : full) sum += std::exp(l - max_l);  // float exp: one pass over up to ~256k logits
    full_max = max_l;
    full_z = sum;
}

// Log-softmax over the full penalised distribution (before truncation and temperature).
void sampler::impl::fill_logprobs(sample_result &out, int32_t chosen) {
    const double log_z = full_max + std::log(full_z);
    out.logprob = static_cast<float>(full[chosen] - log_z);
    const size_t n_top = std::min(static_cast<size_t>(params.n_logprobs), full.size());
    if (n_top == 0) return;
    ranked.resize(full.size());
    for (size_t i = 0; i < full.size(); ++i) ranked[i] = {static_cast<int32_t>(i), full[i]};
    std::partial_sort(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(n_top), ranked.end(), better);
    out.top.resize(n_top);
    for (size_t i = 0; i < n_top; ++i)
        out.top[i] = {ranked[i].token, static_cast<float>(ranked[i].logit - log_z)};
}

// Greedy choice: highest penalised logit; the strict > keeps the lowest id among ties.
int32_t sampler::impl::argmax() const {
    size_t best = 0;
    for (size_t i = 1; i < full.size(); ++i)
        if (full[i] > full[best]) best = i;
    return static_cast<int32_t>(best);
}

void sampler::impl::apply_top_k() {
    const size_t k = static_cast<size_t>(params.top_k);
    if (k == 0 || k >= cand.size()) return;
    // Partition the k best to the front, then order only those.
    std::nth_element(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k - 1), cand.end(), better);
    cand.resize(k);
    std::sort(cand.begin(), cand.end(), better);
    sorted = true;
}

// Keeps the shortest best-first prefix whose probability mass (softmax of the current logits)
// reaches top_p; the token that crosses the threshold is kept, and at least one token always is.
// Without a preceding top-k the list is unsorted and may be the whole vocabulary: rather than
// sorting all of it, sort a best-first window of m candidates and widen it (x4) only if the mass
// in it stays below top_p. The comparator is a total order, so every window is a prefix of the
// fully sorted list and the result equals that of a full sort.
// Max logit and softmax normaliser of the current candidates (reusing those of `full` when the
// candidates are still the whole vocabulary).
void sampler::impl::softmax_stats(float &max_l, double &z) const {
    if (cand.size() == full.size()) {
        max_l = full_max;
        z = full_z;
        return;
    }
    max_l = -std::numeric_limits<float>::infinity();
    for (const candidate &c : cand) max_l = std::max(max_l, c.logit);
    z = 0.0;
    for (const candidate &c : cand) z += std::exp(c.logit - max_l);
}

// (max_l, z): softmax_stats() of the candidate set top-p is defined on (see sample()).
void sampler::impl::apply_top_p(float max_l, double z) {
    if (params.top_p >= 1.0f || cand.size() <= 1) return;
    const size_t n = cand.size();
    const double target = static_cast<double>(params.top_p);
    size_t m = sorted ? n : std::min<size_t>(n, 256);
    for (;;) {
        if (!sorted) {
            const auto mid = cand.begin() + static_cast<std::ptrdiff_t>(m);
            if (m < n) std::nth_element(cand.begin(), mid - 1, cand.end(), better);
            std::sort(cand.begin(), mid, better);
            sorted = m == n;
        }
        double cum = 0.0;
        for (size_t i = 0; i < m; ++i) {
            cum += std::exp(cand[i].logit - max_l) / z;
            if (cum >= target) {
                cand.resize(i + 1);
                sorted = true;  // what remains is the sorted window prefix
                return;
            }
        }
        if (m == n) return;  // the mass never reached top_p (rounding, or min-p cut first): keep all
        m = std::min(n, m * 4);
    }
}

// Keeps tokens whose probability is at least min_p times the best one's:
// p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p). The best token always survives.
void sampler::impl::apply_min_p() {
    if (params.min_p <= 0.0f || cand.size() <= 1) return;
    float max_l = -std::numeric_limits<float>::infinity();
    for (const candidate &c : cand) max_l = std::max(max_l, c.logit);
    const double threshold = static_cast<double>(max_l) + std::log(static_cast<double>(params.min_p));
    size_t w = 0;
    for (size_t i = 0; i < cand.size(); ++i)
        if (static_cast<double>(cand[i].logit) >= threshold) cand[w++] = cand[i];
    cand.resize(w);  // order-preserving compaction: a sorted list stays sorted
}

// Softmax of logit / temperature over the survivors, then one inverse-CDF draw with a 53-bit
// uniform from the seeded generator.
int32_t sampler::impl::draw() {
    const double inv_t = 1.0 / static_cast<double>(params.temperature);
    double max_s = -std::numeric_limits<double>::infinity();
    for (const candidate &c : cand) max_s = std::max(max_s, c.logit * inv_t);
    probs.resize(cand.size());
    double z = 0.0;
    for (size_t i = 0; i < cand.size(); ++i) {
        // exp(-inf - finite) = 0: a masked token can never be drawn.
        probs[i] = std::exp(cand[i].logit * inv_t - max_s);
        z += probs[i];
    }
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * z;  // u in [0, z)
    double cum = 0.0;
    for (size_t i = 0; i < cand.size(); ++i) {
        cum += probs[i];
        if (u < cum) return cand[i].token;
    }
    // Rounding left u at or above the final sum: take the last token with non-zero mass.
    for (size_t i = cand.size(); i-- > 0;)
        if (probs[i] > 0.0) return cand[i].token;
    return cand[0].token;
}

// ---------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------

sampler::sampler(const sampling_params &p) {
    p.validate();
    p_ = std::make_unique<impl>(p);
}

sampler::~sampler() = default;

void sampler::reset() { p_->rng.seed(p_->params.seed); }

const sampling_params &sampler::params() const { return p_->params; }

size_t sampler::top_candidates() const {
    const sampling_params &p = p_->params;
    const size_t lp = static_cast<size_t>(std::max(p.n_logprobs, 1));
    return p.top_k > 0 ? std::max(static_cast<size_t>(p.top_k), lp) : std::max<size_t>(256, lp);
}

std::vector<std::pair<int32_t, int32_t>> sampler::penalty_counts(std::span<const int32_t> history,
                                                                int64_t n_vocab) const {
    std::vector<std::pair<int32_t, int32_t>> out;
    std::unordered_map<int32_t, size_t> at;
    for (int32_t t : penalty_window(p_->params, history)) {
        if (t < 0 || t >= n_vocab)
            throw error("sampler: history token " + std::to_string(t) + " outside vocabulary [0, " +
                        std::to_string(n_vocab) + ")");
        const auto [it, fresh] = at.emplace(t, out.size());
        if (fresh) out.emplace_back(t, 0);
        ++out[it->second].second;
    }
    return out;
}

// The stages of sample() on a best-first prefix of the candidates (see sampling.h). Every
// stage keeps a prefix of the descending order, so when the summary holds the prefix a stage
// keeps, its result is that of the full list; the candidate ORDER handed to draw() is also the
// one sample() would have (sorted, except top-k off with no top-p: vocabulary order).
std::optional<sample_result> sampler::sample_top(const logits_top &t) {
    impl &s = *p_;
    const sampling_params &p = s.params;
    const size_t n = t.ids.size();
    if (n == 0 || t.logits.size() != n || t.n_vocab <= 0 || static_cast<int64_t>(n) > t.n_vocab || !(t.z >= 1.0))
        throw error("sampler: malformed logits summary");
    if (!std::isfinite(t.max_logit)) throw error("sampler: every logit is -inf");
    const bool whole = static_cast<int64_t>(n) == t.n_vocab;
    s.cand.resize(n);
    for (size_t i = 0; i < n; ++i) {
        if (t.ids[i] < 0 || t.ids[i] >= t.n_vocab) throw error("sampler: malformed logits summary");
        s.cand[i] = {t.ids[i], t.logits[i]};
    }
    std::sort(s.cand.begin(), s.cand.end(), better);
    const size_t n_top = std::min(static_cast<size_t>(p.n_logprobs), static_cast<size_t>(t.n_vocab));
    if (n_top > n) return std::nullopt;
    std::vector<candidate> best(s.cand.begin(), s.cand.begin() + static_cast<std::ptrdiff_t>(n_top));
    int32_t chosen;
    float chosen_logit;
    if (p.temperature == 0.0f) {
        chosen = s.cand[0].token;
        chosen_logit = s.cand[0].logit;
    } else {
        s.sorted = true;
        const bool top_k = p.top_k > 0 && static_cast<int64_t>(p.top_k) < t.n_vocab;
        float max_l = t.max_logit;  // softmax_stats() of the set top-p is defined on
        double z = t.z;
        if (top_k) {
            if (static_cast<size_t>(p.top_k) > n) return std::nullopt;
            s.cand.resize(static_cast<size_t>(p.top_k));
            max_l = s.cand[0].logit;
            z = 0.0;
            for (const candidate &c : s.cand) z += std::exp(c.logit - max_l);
        }
        bool decided = whole || top_k;
        const size_t before = s.cand.size();
        s.apply_min_p();  // a sorted list stays sorted
        decided = decided || s.cand.size() < before;
        if (p.top_p < 1.0f && s.cand.size() > 1) {
            const size_t m = s.cand.size();
            s.apply_top_p(max_l, z);
            if (!decided && s.cand.size() == m) return std::nullopt;  // the mass is not reached inside
            decided = true;
        } else if (!top_k && decided) {
            // sample() draws from the survivors of min-p in vocabulary order when neither top-k nor
            // top-p sorted them.
            std::sort(s.cand.begin(), s.cand.end(), [](const candidate &a, const candidate &b) { return a.token < b.token; });
        }
        if (!decided) return std::nullopt;
        chosen = s.draw();
        chosen_logit = std::find_if(s.cand.begin(), s.cand.end(), [&](const candidate &c) { return c.token == chosen; })->logit;
    }
    sample_result out;
    const double log_z = t.max_logit + std::log(t.z);
    out.token = chosen;
    out.logprob = static_cast<float>(chosen_logit - log_z);
    out.top.resize(n_top);
    for (size_t i = 0; i < n_top; ++i) out.top[i] = {best[i].token, static_cast<float>(best[i].logit - log_z)};
    return out;
}

sample_result sampler::sample(std::span<const float> logits, std::span<const int32_t> history) {
    impl &s = *p_;
    s.prepare(logits);
    s.apply_penalties(history);
    s.normalise_full();

    sample_result out;
    int32_t chosen;
    if (s.params.temperature == 0.0f) {
        chosen = s.argmax();
    } else {
        s.cand.resize(s.full.size());
        for (size_t i = 0; i < s.full.size(); ++i) s.cand[i] = {static_cast<int32_t>(i), s.full[i]};
        s.sorted = false;
        s.apply_top_k();
        // top-p then min-p keep best-first prefixes of the same order, and min-p's threshold
        // (relative to the max, which both keep) does not depend on what top-p removed, so the
        // result is the shorter of the two prefixes. Filtering min-p first, in O(n), therefore gives
        // the same set while leaving top-p far fewer candidates to sort. top-p still normalises
        // over the set it is defined on, captured before the filter.
        float max_l;
        double z;
        s.softmax_stats(max_l, z);
        s.apply_min_p();
        s.apply_top_p(max_l, z);
        chosen = s.draw();
    }
    s.fill_logprobs(out, chosen);
    out.token = chosen;
    return out;
}

int32_t think_control::forced(std::span<const int32_t> generated) const {
    if (generated.size() < open.size()) return open[generated.size()];
    if (budget < 0 || close.empty()) return -1;
    const std::span<const int32_t> thought = generated.subspan(open.size());
    if (std::search(thought.begin(), thought.end(), close.begin(), close.end()) != thought.end()) return -1;  // closed
    if (thought.size() < static_cast<size_t>(budget)) return -1;
    // Budget spent: the next token of `close`, after the longest partial match at the end of the thinking.
    for (size_t k = std::min(thought.size(), close.size() - 1); k > 0; --k)
        if (std::equal(close.begin(), close.begin() + static_cast<std::ptrdiff_t>(k), thought.end() - static_cast<std::ptrdiff_t>(k)))
            return close[k];
    return close[0];
}

}  // namespace fathom
