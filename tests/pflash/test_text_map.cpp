// PFlash cross-tokenizer mapping: property tests over random multilingual / emoji / code texts with
// real vocabularies (Gemma3 SPM, SmolLM2 BPE, and the shared llama.cpp vocab files). Truth is checked
// by brute force here (byte-by-byte coverage, the tokenizer's own encode), never by the code under test.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "core/error.h"
#include "gguf/gguf.h"
#include "pflash/text_map.h"
#include "tokenizer/tokenizer.h"

namespace fathom::pflash {
namespace {

std::unique_ptr<tokenizer> load_tok(const std::string &path) {
    if (!std::filesystem::exists(path)) return nullptr;
    return std::make_unique<tokenizer>(*gguf::file::open(path));
}

std::string vocab(const std::string &name) { return std::string(FATHOM_SHARED_DIR) + "/tokenizer-tests/" + name; }

// Random text from pieces that stress byte offsets: multi-byte scripts, emoji (4-byte, ZWJ and flag
// sequences), code, JSON, whitespace runs and chat special-token texts.
std::string random_text(std::mt19937_64 &rng, int n_pieces) {
    static const char *pieces[] = {
        "hello", " world", "  ", "\n", "\n\n", "\t", "The quick brown fox", " jumps", "über", " naïve café",
        "日本語のテキスト", "中文", " 한국어", "Привет, мир", "مرحبا", "ελληνικά", "😀", "👩‍💻", "🇫🇷", "🤖🚀",
        "é", "e\xCC\x81", "def f(x):\n    return x**2\n", "int main() { return 0; }", "{\"a\": [1, 2, {\"b\": null}]}",
        "<|im_start|>user\n", "<|im_end|>\n", "<start_of_turn>model\n", "<end_of_turn>", "  \n  ", "1234567890",
        "3.14159", "a_b_c", "x+=1;", "<tool_call>{\"name\": \"f\"}</tool_call>", "’quoted’", "—", "…", "\r\n",
    };
    std::string s;
    std::uniform_int_distribution<size_t> pick(0, std::size(pieces) - 1);
    for (int i = 0; i < n_pieces; ++i) s += pieces[pick(rng)];
    return s;
}

bool is_cont(std::string_view t, uint64_t i) { return i < t.size() && (static_cast<uint8_t>(t[i]) & 0xC0) == 0x80; }

struct pair_case {
    const char *name, *target, *drafter;
};

class text_map_pairs : public ::testing::TestWithParam<pair_case> {};

TEST_P(text_map_pairs, kept_target_tokens_are_original_and_cover_ranges) {
    const auto target = load_tok(GetParam().target[0] == '/' ? GetParam().target : vocab(GetParam().target));
    const auto draft = load_tok(GetParam().drafter[0] == '/' ? GetParam().drafter : vocab(GetParam().drafter));
    if (!target || !draft) GTEST_SKIP() << "vocab file missing";
    std::mt19937_64 rng(1234);
    for (int iter = 0; iter < 60; ++iter) {
        const std::string src = random_text(rng, 1 + static_cast<int>(rng() % 40));
        SCOPED_TRACE("text: '" + src + "'");
        const std::vector<int32_t> tids = target->encode(src, true, true);
        const spanned_text tt = text_from_pieces(tids, [&](int32_t id) { return target->token_to_piece(id); });
        // Target spans tile the text, and the text is the tokenizer's own decode.
        ASSERT_EQ(tt.text, target->decode(tids));
        ASSERT_EQ(tt.spans.size(), tids.size());
        for (size_t i = 0; i < tt.spans.size(); ++i)
            ASSERT_EQ(tt.spans[i].begin, i ? tt.spans[i - 1].end : 0u);

        // Drafter tokens: the drafter's own encode, spans in order and matching their pieces.
        drafter_tokens dt;
        try {
            dt = encode_with_offsets(*draft, tt.text);
        } catch (const fathom::error &e) {
            FAIL() << e.what() << " in '" << tt.text << "'";
        }
        std::vector<int32_t> own = draft->encode(tt.text, false, true);
        if (draft->add_bos()) own.insert(own.begin(), draft->bos());
        ASSERT_EQ(dt.ids, own);
        uint64_t pos = 0;
        for (size_t i = 0; i < dt.ids.size(); ++i) {
            const byte_span s = dt.spans[i];
            ASSERT_GE(s.begin, pos);
            ASSERT_LE(s.end, tt.text.size());
            ASSERT_LE(s.begin, s.end);
            const std::string piece = draft->token_to_piece(dt.ids[i]);
            // SPM renders a literal U+2581 in the text as ' ': compare in that form.
            const bool spm = draft->model() == tokenizer::model_kind::spm;
            std::string got;
            for (uint64_t b = s.begin; b < s.end; ++b) {
                if (spm && tt.text.compare(b, 3, "\xE2\x96\x81") == 0) {
                    got += ' ';
                    b += 2;
                } else {
                    got += tt.text[b];
                }
            }
            if (s.end > s.begin) {
                // The piece (less an SPM dummy-prefix space) starts the span; only whitespace follows it.
                const std::string_view p = got.starts_with(piece) ? std::string_view(piece) : std::string_view(piece).substr(1);
                ASSERT_TRUE(got.starts_with(p)) << "token " << i << " piece '" << piece << "' span '" << got << "'";
                for (char ch : std::string_view(got).substr(p.size())) ASSERT_TRUE(ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r');
            }
            pos = s.end;
        }
        // Every byte of the text belongs to some drafter span (no byte is lost between tokenizers).
        std::vector<bool> seen(tt.text.size(), false);
        for (const byte_span &s : dt.spans)
            for (uint64_t b = s.begin; b < s.end; ++b) seen[b] = true;
        for (size_t b = 0; b < seen.size(); ++b) ASSERT_TRUE(seen[b]) << "byte " << b << " of '" << tt.text << "'";

        // Random kept drafter chunks -> byte ranges -> target tokens.
        if (dt.ids.empty()) continue;
        std::vector<byte_span> ranges;
        for (size_t i = 0; i < dt.ids.size(); i += 3)
            if (rng() % 3 == 0) ranges.push_back({dt.spans[i].begin, dt.spans[std::min(dt.ids.size() - 1, i + 2)].end});
        const std::vector<byte_span> snapped = snap_utf8(tt.text, ranges);
        for (const byte_span &r : snapped) {
            ASSERT_FALSE(is_cont(tt.text, r.begin)) << "range starts inside a character";
            ASSERT_FALSE(is_cont(tt.text, r.end)) << "range ends inside a character";
        }
        const std::vector<int64_t> kept = tokens_covering(tt.spans, snapped);
        std::vector<bool> covered(tt.text.size(), false);
        for (size_t k = 0; k < kept.size(); ++k) {
            if (k) {
                ASSERT_LT(kept[k - 1], kept[k]);  // original order, no duplicates
            }
            const byte_span s = tt.spans[static_cast<size_t>(kept[k])];
            for (uint64_t b = s.begin; b < s.end; ++b) covered[b] = true;
            // Minimal: every kept token with bytes touches a range (brute force).
            if (s.end > s.begin) {
                bool touches = false;
                for (const byte_span &r : snapped) touches |= r.begin < s.end && s.begin < r.end;
                ASSERT_TRUE(touches);
            }
        }
        for (const byte_span &r : ranges)
            for (uint64_t b = r.begin; b < r.end; ++b) ASSERT_TRUE(covered[b]) << "selected byte " << b << " not covered";
    }
}

INSTANTIATE_TEST_SUITE_P(
    vocab_pairs, text_map_pairs,
    ::testing::Values(pair_case{"llama_spm_to_qwen2", "ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf"},
                      pair_case{"qwen2_to_llama_spm", "ggml-vocab-qwen2.gguf", "ggml-vocab-llama-spm.gguf"},
                      pair_case{"deepseek_v3_to_phi3", "ggml-vocab-deepseek-v3.gguf", "ggml-vocab-phi-3.gguf"},
                      pair_case{"gpt2_to_llama_bpe", "ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-bpe.gguf"},
                      pair_case{"gemma3_to_smollm2", FATHOM_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf",
                                FATHOM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"},
                      pair_case{"smollm2_to_gemma3", FATHOM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                                FATHOM_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf"}),
    [](const ::testing::TestParamInfo<pair_case> &i) { return std::string(i.param.name); });

TEST(text_map, utf8_snapping_by_hand) {
    const std::string t = "a\xC3\xA9" "b\xF0\x9F\x98\x80" "c";  // a é b 😀 c: bytes 0 | 1-2 | 3 | 4-7 | 8
    EXPECT_EQ(snap_utf8(t, {{2, 3}}), (std::vector<byte_span>{{1, 3}}));
    EXPECT_EQ(snap_utf8(t, {{5, 6}}), (std::vector<byte_span>{{4, 8}}));
    EXPECT_EQ(snap_utf8(t, {{0, 1}, {1, 2}}), (std::vector<byte_span>{{0, 3}}));
    EXPECT_EQ(snap_utf8(t, {{8, 9}, {0, 0}}), (std::vector<byte_span>{{8, 9}}));
}

TEST(text_map, covering_by_hand) {
    // Tokens: [0,2) [2,2) [2,5) [5,9) ; ranges [3,4) -> tokens 1 (zero width) and 2.
    const std::vector<byte_span> toks = {{0, 2}, {2, 2}, {2, 5}, {5, 9}};
    EXPECT_EQ(tokens_covering(toks, std::vector<byte_span>{{3, 4}}), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(tokens_covering(toks, std::vector<byte_span>{{1, 6}}), (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(tokens_covering(toks, std::vector<byte_span>{}), (std::vector<int64_t>{1}));
    EXPECT_EQ(merge_ranges({{5, 7}, {1, 2}, {2, 3}, {6, 9}, {4, 4}}), (std::vector<byte_span>{{1, 3}, {5, 9}}));
}

}  // namespace
}  // namespace fathom::pflash
