// Needle-in-a-haystack generator and scorer (see niah.h).
#include "pflash/niah.h"

#include <algorithm>
#include <random>

#include "core/error.h"

namespace fathom::pflash {

niah_filler parse_niah_filler(const std::string &s) {
    if (s == "prose") return niah_filler::prose;
    if (s == "code") return niah_filler::code;
    if (s == "json") return niah_filler::json;
    if (s == "mixed") return niah_filler::mixed;
    throw error("niah filler '" + s + "': expected prose, code, json or mixed");
}

const char *niah_filler_name(niah_filler f) {
    switch (f) {
    case niah_filler::prose: return "prose";
    case niah_filler::code: return "code";
    case niah_filler::json: return "json";
    case niah_filler::mixed: return "mixed";
    }
    return "?";
}

namespace {

constexpr const char *k_nouns[] = {"river", "garden", "engine", "village", "library", "mountain", "market", "harbor",
                                   "window", "teacher", "bridge", "forest", "signal", "kitchen", "planet", "station",
                                   "letter", "island", "circuit", "meadow", "lantern", "archive", "compass", "orchard"};
constexpr const char *k_verbs[] = {"follows", "describes", "crosses", "protects", "measures", "reflects", "connects",
                                   "remembers", "supports", "collects", "reveals", "shelters", "divides", "carries"};
constexpr const char *k_adjs[] = {"quiet", "ancient", "narrow", "bright", "distant", "careful", "hollow", "gentle",
                                  "crowded", "silver", "patient", "broken", "early", "northern", "simple", "heavy"};
constexpr const char *k_key_a[] = {"amber", "cobalt", "crimson", "ivory", "jade", "onyx", "russet", "saffron", "teal",
                                   "umber", "violet", "scarlet", "olive", "indigo", "coral", "slate"};
constexpr const char *k_key_b[] = {"falcon", "otter", "lynx", "heron", "badger", "marten", "osprey", "gecko", "bison",
                                   "walrus", "ibis", "panther", "stoat", "condor", "mantis", "tapir"};

template <size_t N>
const char *pick(std::mt19937_64 &rng, const char *const (&a)[N]) {
    return a[std::uniform_int_distribution<size_t>(0, N - 1)(rng)];
}

std::string prose_unit(std::mt19937_64 &rng) {
    std::string s = "The ";
    s += pick(rng, k_adjs);
    s += " ";
    s += pick(rng, k_nouns);
    s += " ";
    s += pick(rng, k_verbs);
    s += " the ";
    s += pick(rng, k_nouns);
    s += " near the ";
    s += pick(rng, k_adjs);
    s += " ";
    s += pick(rng, k_nouns);
    s += std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? ".\n" : ". ";
    return s;
}

std::string code_unit(std::mt19937_64 &rng) {
    const std::string a = pick(rng, k_nouns), b = pick(rng, k_nouns), c = pick(rng, k_adjs);
    const int k = std::uniform_int_distribution<int>(2, 99)(rng);
    return "def " + c + "_" + a + "(" + b + ", limit=" + std::to_string(k) + "):\n    total = 0\n    for item in " + b +
           ":\n        if item." + c + " < limit:\n            total += item.size\n    return total\n\n";
}

std::string json_unit(std::mt19937_64 &rng) {
    const int id = std::uniform_int_distribution<int>(1000, 99999)(rng);
    return std::string("{\"id\": ") + std::to_string(id) + ", \"name\": \"" + pick(rng, k_adjs) + " " + pick(rng, k_nouns) +
           "\", \"tags\": [\"" + pick(rng, k_nouns) + "\", \"" + pick(rng, k_adjs) + "\"], \"active\": " +
           (id % 2 ? "true" : "false") + "}\n";
}

std::string filler_unit(std::mt19937_64 &rng, niah_filler f) {
    if (f == niah_filler::mixed) f = static_cast<niah_filler>(std::uniform_int_distribution<int>(0, 2)(rng));
    switch (f) {
    case niah_filler::code: return code_unit(rng);
    case niah_filler::json: return json_unit(rng);
    default: return prose_unit(rng);
    }
}

}  // namespace

niah_case niah_generate(const niah_options &o, const std::function<int64_t(std::string_view)> &count_tokens) {
    if (o.n_needles < 1 || o.n_needles > 16) throw error("niah: needles must be in [1, 16], got " + std::to_string(o.n_needles));
    if (o.n_tokens < 256) throw error("niah: length must be at least 256 tokens, got " + std::to_string(o.n_tokens));
    std::mt19937_64 rng(o.seed);
    niah_case c;
    // Distinct keys and 5-digit values.
    while (static_cast<int32_t>(c.needles.size()) < o.n_needles) {
        const std::string key = std::string(pick(rng, k_key_a)) + "-" + pick(rng, k_key_b);
        if (std::any_of(c.needles.begin(), c.needles.end(), [&](const auto &kv) { return kv.first == key; })) continue;
        c.needles.push_back({key, std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng))});
    }
    std::string question = "\n\nThe document above states the secret value of each of these keys: ";
    for (size_t i = 0; i < c.needles.size(); ++i) question += (i ? ", " : "") + c.needles[i].first;
    question += ".\nList every key with its secret value, one per line, in the format key=value.\nAnswer:\n";
    c.answer_prefix = c.needles[0].first + "=";
    const std::string head = "Read the following document carefully.\n\n";

    // Filler units until the document reaches its share of the length (unit counts are additive
    // up to a token or so at the joins, which is close enough for sizing).
    const int64_t budget = o.n_tokens - count_tokens(head) - count_tokens(question + c.answer_prefix);
    std::vector<std::string> units;
    for (int64_t have = 0; have < budget;) {
        units.push_back(filler_unit(rng, o.filler));
        have += count_tokens(units.back());
    }
    // Needles at spread-out depths: slot i in [(i + 0.1) / K, (i + 0.9) / K) of the document.
    std::vector<size_t> at;
    for (int32_t i = 0; i < o.n_needles; ++i) {
        const double lo = (i + 0.1) / o.n_needles, hi = (i + 0.9) / o.n_needles;
        at.push_back(static_cast<size_t>(std::uniform_real_distribution<double>(lo, hi)(rng) * static_cast<double>(units.size())));
    }
    c.prompt = head;
    size_t next = 0;
    for (size_t u = 0; u <= units.size(); ++u) {
        while (next < at.size() && at[next] == u) {
            const auto &[k, v] = c.needles[next++];
            c.prompt += "\nThe secret value of " + k + " is " + v + ".\n";
        }
        if (u < units.size()) c.prompt += units[u];
    }
    c.prompt += question + c.answer_prefix;
    return c;
}

int32_t niah_score(const niah_case &c, std::string_view generation) {
    const std::string all = c.answer_prefix + std::string(generation);
    int32_t ok = 0;
    for (const auto &[k, v] : c.needles) {
        const std::string want = k + "=" + v;
        bool found = false;
        for (size_t b = 0; b < all.size() && !found;) {
            size_t e = all.find('\n', b);
            if (e == std::string::npos) e = all.size();
            std::string_view line(all.data() + b, e - b);
            while (!line.empty() && (line.back() == ' ' || line.back() == '\r' || line.back() == '.')) line.remove_suffix(1);
            while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
            found = line == want;
            b = e + 1;
        }
        ok += found ? 1 : 0;
    }
    return ok;
}

}  // namespace fathom::pflash
