// Fathom's tokenizer on the installed models (scripts/install-models.sh) against llama.cpp's ids, recorded by
// gen_llamacpp_goldens.py in data/<model>.llamacpp.json: Gemma3 (SPM without dummy prefix, user-defined
// whitespace tokens) and SmolLM2 (BPE, pre "smollm"), with and without special-token handling.
// Skipped when the model file is not installed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tokenizer_test_util.h"

namespace fathom::test {
namespace {

class ModelGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelGolden, MatchesLlamaCpp) {
    const std::string name = GetParam();
    const auto doc = nlohmann::json::parse(read_file(std::filesystem::path(FATHOM_SOURCE_DIR) / "tests" / "tokenizer" / "data" /
                                                     (name + ".llamacpp.json")));
    const auto model = std::filesystem::path(FATHOM_SOURCE_DIR) / "models" / doc.at("model_file").get<std::string>();
    if (!std::filesystem::exists(model)) GTEST_SKIP() << model << " not installed (scripts/install-models.sh)";
    auto f = gguf::file::open(model.string());
    const tokenizer tok(*f);
    size_t n = 0, bad = 0;
    for (const auto &c : doc.at("cases")) {
        const std::string text = c.at("text").get<std::string>();
        const bool add_special = c.at("add_special").get<bool>();
        const bool parse_special = c.at("parse_special").get<bool>();
        const auto want = c.at("ids").get<std::vector<int32_t>>();
        const auto got = tok.encode(text, add_special, parse_special);
        ++n;
        if (got != want) {
            ++bad;
            ADD_FAILURE() << name << " [" << text << "] add_special=" << add_special
                          << " parse_special=" << parse_special << "\n  want:" << ids_str(want)
                          << "\n  got: " << ids_str(got);
        }
    }
    EXPECT_EQ(bad, 0u) << bad << " of " << n << " cases differ";
    EXPECT_GT(n, 100u);
}

INSTANTIATE_TEST_SUITE_P(Installed, ModelGolden, ::testing::Values("gemma3", "smollm2"));

TEST(ModelProps, Gemma3Metadata) {
    const auto model = std::filesystem::path(FATHOM_SOURCE_DIR) / "models" / "gemma-3-270m-q4_k_m.gguf";
    if (!std::filesystem::exists(model)) GTEST_SKIP() << "gemma3 not installed";
    auto f = gguf::file::open(model.string());
    const tokenizer tok(*f);
    EXPECT_EQ(tok.model(), tokenizer::model_kind::spm);
    EXPECT_EQ(tok.n_vocab(), 262144);
    EXPECT_FALSE(tok.add_space_prefix());
    EXPECT_TRUE(tok.add_bos());
    EXPECT_EQ(tok.bos(), 2);
    EXPECT_EQ(tok.eos(), 1);
    EXPECT_EQ(tok.eot(), tok.find_token("<end_of_turn>"));
    EXPECT_TRUE(tok.is_eog(tok.find_token("<end_of_turn>")));
    EXPECT_TRUE(tok.is_eog(1));
}

}  // namespace
}  // namespace fathom::test
