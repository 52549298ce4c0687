// Token masks (src/grammar/token_mask.h) over a tiny hand-made vocabulary: the allowed sets below
// are worked out by hand from the schema; then the trie walk (with its string fast path) is checked
// against the plain definition (feed each token's bytes to a fresh copy of the state) on a larger
// vocabulary of random byte strings along random documents.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "grammar/token_mask.h"

using namespace fathom::grammar;
using nlohmann::json;

namespace {

const std::vector<std::string> k_vocab = {
    "{",   "}",  "\"",       "a",  "\"a\"", ":",    " ",  "1",   "12", "\"}",  "<eos>",
    "<c>", "é", "\xC3", "\xA9", "{\"",    "true", ",", "ab", "\\n", "\n",
};
constexpr int32_t k_eos = 10, k_ctl = 11;

std::shared_ptr<const vocab_index> tiny_vocab() {
    return std::make_shared<const vocab_index>(
        int32_t(k_vocab.size()), [](int32_t id) { return k_vocab[size_t(id)]; },
        [](int32_t id) { return id == k_eos; }, [](int32_t id) { return id == k_ctl; });
}

std::set<int32_t> allowed(token_constraint &c) {
    std::vector<uint64_t> m;
    c.fill_mask(m);
    std::set<int32_t> out;
    for (int32_t i = 0; i < int32_t(m.size() * 64); ++i)
        if ((m[size_t(i) >> 6] >> (i & 63)) & 1) out.insert(i);
    return out;
}

void accept_all(token_constraint &c, std::initializer_list<int32_t> ids) {
    for (int32_t id : ids) ASSERT_TRUE(c.accept(id)) << "token " << id;
}

}  // namespace

TEST(TokenMask, HandWorkedMasks) {
    auto g = compile_schema(json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"},
        "b": {"type": "string", "maxLength": 2}}, "required": ["a"], "additionalProperties": false})"));
    token_constraint c(g, tiny_vocab());
    EXPECT_EQ(allowed(c), (std::set<int32_t>{0, 15}));  // "{" and "{\"": nothing else starts an object
    accept_all(c, {0});
    // After "{": whitespace, a key's quote, the whole key "a" ("}" waits for the required a).
    EXPECT_EQ(allowed(c), (std::set<int32_t>{2, 4, 6, 20}));
    accept_all(c, {4, 5});
    EXPECT_EQ(allowed(c), (std::set<int32_t>{6, 7, 8, 20}));  // an integer, or whitespace first
    accept_all(c, {7});
    // "1" may go on ("1", "12"), or end before whitespace, ',' (b is left) or '}' (a is given).
    EXPECT_EQ(allowed(c), (std::set<int32_t>{1, 6, 7, 8, 17, 20}));
    EXPECT_FALSE(c.accept(16));  // "true" cannot follow a number
    accept_all(c, {17, 2});
    EXPECT_FALSE(c.accept(3));   // a key "a" again: given already, and unlisted keys are refused
    // Only the byte 'b' (of the key "b") may come, and no token of this vocabulary starts with it.
    EXPECT_EQ(allowed(c), (std::set<int32_t>{}));
}

TEST(TokenMask, StringStates) {
    auto g = compile_schema(json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"},
        "b": {"type": "string", "maxLength": 2}}, "required": ["a"], "additionalProperties": false})"));
    auto v = std::make_shared<const vocab_index>(
        int32_t(k_vocab.size() + 1), [](int32_t id) { return id == int32_t(k_vocab.size()) ? std::string("\"b\"") : k_vocab[size_t(id)]; },
        [](int32_t id) { return id == k_eos; }, [](int32_t id) { return id == k_ctl; });
    const int32_t key_b = int32_t(k_vocab.size());
    token_constraint c(g, v);
    accept_all(c, {0, 4, 5, 7, 17, key_b, 5, 2});  // {"a":1,"b":"
    // Inside the string, 2 characters left: every pure token of at most 2 code points ("true" has 4),
    // the closing quote alone or with '}', an escape, a UTF-8 lead byte, "{\"" ('{' then the close);
    // not "\"a\"" (after the close 'a' cannot come), a lone continuation byte or a raw newline.
    EXPECT_EQ(allowed(c), (std::set<int32_t>{0, 1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 15, 17, 18, 19}));
    accept_all(c, {13});  // the lead byte of é
    EXPECT_EQ(allowed(c), (std::set<int32_t>{14}));
    accept_all(c, {14});  // é: 1 of 2 characters
    EXPECT_FALSE(c.accept(18));  // "ab" would make 3
    accept_all(c, {3});
    EXPECT_EQ(allowed(c), (std::set<int32_t>{2, 9}));  // full: only the close
    accept_all(c, {9});
    EXPECT_TRUE(c.complete());
    EXPECT_EQ(allowed(c), (std::set<int32_t>{k_eos}));  // complete: the end of generation only
    EXPECT_TRUE(c.accept(k_eos));
}

TEST(TokenMask, ControlAndEmptyTokensNeverAllowed) {
    auto c = token_constraint(grammar_json_object(), tiny_vocab());
    accept_all(c, {15});  // {"  — a key string: "<c>" would be valid content but is a control token
    EXPECT_FALSE(allowed(c).count(k_ctl));
    EXPECT_FALSE(c.accept(k_ctl));
    EXPECT_FALSE(c.accept(k_eos));
}

TEST(TokenMask, ApplySetsMinusInfinity) {
    token_constraint c(grammar_json_object(), tiny_vocab());
    std::vector<float> logits(k_vocab.size() + 3, 1.0f);  // rows past the vocabulary: never allowed
    EXPECT_EQ(c.apply(logits), 2);
    for (size_t i = 0; i < logits.size(); ++i) EXPECT_EQ(std::isfinite(logits[i]), i == 0 || i == 15) << i;
}

// The trie walk (and the pure-string fast path) against the definition, on 3,000 random tokens of
// 1-4 bytes drawn from JSON-ish characters, along random valid documents of several schemas.
TEST(TokenMask, TrieWalkEqualsPerTokenDefinition) {
    std::mt19937 rng(7);
    const std::string alphabet = "{}[]\":,. -0123456789eEtrunlfasbx\\\n\xC3\xA9\xE2\x82\xAC";
    std::vector<std::string> pieces;
    std::set<std::string> seen;
    while (pieces.size() < 3000) {
        std::string p;
        const int len = 1 + int(rng() % 4);
        for (int k = 0; k < len; ++k) p += alphabet[rng() % alphabet.size()];
        if (seen.insert(p).second) pieces.push_back(p);
    }
    for (int b = 0; b < 256; ++b)  // every byte as a token, as byte-level vocabularies have
        if (seen.insert(std::string(1, char(b))).second) pieces.push_back(std::string(1, char(b)));
    pieces.push_back("<eos>");
    const int32_t eos = int32_t(pieces.size() - 1);
    auto v = std::make_shared<const vocab_index>(
        int32_t(pieces.size()), [&](int32_t id) { return pieces[size_t(id)]; }, [&](int32_t id) { return id == eos; },
        [](int32_t) { return false; });
    const char *schemas[] = {
        R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "tags": {"type": "array",
            "items": {"enum": ["a", "ab", 1, 12]}, "maxItems": 3}, "n": {"type": ["number", "null"]}},
            "required": ["name", "tags"], "additionalProperties": {"type": "boolean"}})",
        R"({"type": "object", "additionalProperties": true})",
    };
    for (const char *schema : schemas) {
        auto g = compile_schema(json::parse(schema));
        for (int doc = 0; doc < 20; ++doc) {
            token_constraint c(g, v);
            for (int step = 0; step < 40; ++step) {
                std::vector<uint64_t> mask;
                c.fill_mask(mask);
                std::vector<int32_t> ok;
                for (int32_t id = 0; id < eos; ++id) {
                    json_matcher probe = c.matcher();
                    const bool want = probe.feed(pieces[size_t(id)]);
                    const bool got = (mask[size_t(id) >> 6] >> (id & 63)) & 1;
                    ASSERT_EQ(got, want) << "token '" << pieces[size_t(id)] << "' at step " << step << " of " << schema;
                    if (want) ok.push_back(id);
                }
                json_matcher probe = c.matcher();
                ASSERT_EQ(bool((mask[size_t(eos) >> 6] >> (eos & 63)) & 1), probe.complete());
                if (ok.empty()) break;
                ASSERT_TRUE(c.accept(ok[rng() % ok.size()]));
            }
        }
    }
}
