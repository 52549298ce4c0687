// Runs every ../shared/tokenizer-tests/*.gguf suite (expected ids from the reference Hugging Face tokenizers)
// and requires every line to match; also checks decode(encode(x)) == x on each suite string.
#include <gtest/gtest.h>

#include <algorithm>

#include "tokenizer_test_util.h"

namespace fathom::test {
namespace {

std::vector<std::string> suite_names() {
    std::vector<std::string> names;
    if (!std::filesystem::is_directory(suite_dir())) return names;
    for (const auto &e : std::filesystem::directory_iterator(suite_dir())) {
        const std::string fn = e.path().filename().string();
        const std::string prefix = "ggml-vocab-", suffix = ".gguf";
        if (fn.size() > prefix.size() + suffix.size() && fn.rfind(prefix, 0) == 0 &&
            fn.compare(fn.size() - suffix.size(), suffix.size(), suffix) == 0) {
            names.push_back(fn.substr(prefix.size(), fn.size() - prefix.size() - suffix.size()));
        }
    }
    std::sort(names.begin(), names.end());
    return names;
}

TEST(TokenizerSuites, AllExpectedSuitesPresent) {
    const auto names = suite_names();
    for (const char *want : {"gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "deepseek-llm", "llama-spm", "phi-3"}) {
        EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << "missing suite " << want;
    }
}

class Suite : public ::testing::TestWithParam<std::string> {};

TEST_P(Suite, EveryLineMatches) {
    const std::string name = GetParam();
    const auto cases = read_suite(suite_dir() / ("ggml-vocab-" + name + ".gguf"));
    ASSERT_FALSE(cases.empty());
    const tokenizer &tok = vocab(name);
    size_t failures = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
        const auto got = tok.encode(cases[i].text, /*add_special=*/false, /*parse_special=*/false);
        if (got != cases[i].ids) {
            ++failures;
            ADD_FAILURE() << name << " case " << i << " text [" << cases[i].text << "]\n  want:" << ids_str(cases[i].ids)
                          << "\n  got: " << ids_str(got);
        }
    }
    EXPECT_EQ(failures, 0u) << failures << " of " << cases.size() << " lines differ";
}

TEST_P(Suite, DecodeRoundTrip) {
    const std::string name = GetParam();
    const auto cases = read_suite(suite_dir() / ("ggml-vocab-" + name + ".gguf"));
    const tokenizer &tok = vocab(name);
    decode_options opt;
    opt.strip_prefix_space = true;  // undo the SPM dummy prefix; no-op for BPE vocabs
    for (size_t i = 0; i < cases.size(); ++i) {
        // Decode the reference ids (independent of our encoder) and our own encoding.
        EXPECT_EQ(tok.decode(cases[i].ids, opt), cases[i].text) << name << " case " << i << " (reference ids)";
        EXPECT_EQ(tok.decode(tok.encode(cases[i].text, false, false), opt), cases[i].text) << name << " case " << i;
    }
}

INSTANTIATE_TEST_SUITE_P(Vocab, Suite, ::testing::ValuesIn(suite_names()),
                         [](const ::testing::TestParamInfo<std::string> &info) {
                             std::string s = info.param;
                             for (char &c : s) {
                                 if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                             }
                             return s;
                         });

}  // namespace
}  // namespace fathom::test
