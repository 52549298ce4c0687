// Needle-in-a-haystack cases for PFlash's quality gate (`fathom eval niah`, tests/pflash): a filler
// document (prose, code, JSON lines, or a mix) of about a given number of target tokens with K
// key -> value needles at spread-out depths, then a question listing the keys and asking for
// "key=value" lines. Scoring is exact match per needle. Deterministic for a given seed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fathom::pflash {

enum class niah_filler { prose, code, json, mixed };
niah_filler parse_niah_filler(const std::string &s);  // prose | code | json | mixed
const char *niah_filler_name(niah_filler f);

struct niah_options {
    int64_t n_tokens = 4096;   // approximate prompt length in target tokens
    int32_t n_needles = 5;
    niah_filler filler = niah_filler::mixed;
    uint64_t seed = 1;
};

struct niah_case {
    std::string prompt;  // document + question + answer prefix (the first key and '=')
    std::vector<std::pair<std::string, std::string>> needles;  // (key, value) in document order
    std::string answer_prefix;  // the end of `prompt`, prepended to the generation before scoring
};

// count_tokens(text) = target tokens of a piece of text (used to size the document).
niah_case niah_generate(const niah_options &o, const std::function<int64_t(std::string_view)> &count_tokens);

// Needles whose "key=value" line appears exactly in answer_prefix + generation.
int32_t niah_score(const niah_case &c, std::string_view generation);

}  // namespace fathom::pflash
