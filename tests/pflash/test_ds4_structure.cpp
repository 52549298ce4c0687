// PFlash structure rules on DeepSeek V4 prompts rendered by the DS4 encoder (src/chat/ds4_chat.h):
// turn markers forced, the system prompt and the last user turn (a tool result counts as one, as in
// DS4's format) kept verbatim, DSML call blocks and tool results atomic. Expected byte ranges are
// found in the rendered text by hand-typed markers. End to end: ds4-tiny as the target (its
// byte-level vocabulary spells every DS4 marker in several tokens) and SmolLM2-135M as the drafter.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>

#include "chat/ds4_chat.h"
#include "fathom/engine.h"
#include "fathom/pflash.h"
#include "pflash/select.h"
#include "pflash/structure.h"

namespace fathom::pflash {
namespace {

using ojson = nlohmann::ordered_json;

#define BOS "<｜begin▁of▁sentence｜>"
#define EOS "<｜end▁of▁sentence｜>"
#define USR "<｜User｜>"
#define AST "<｜Assistant｜>"

std::string render(const char *messages, const char *tools = "null") {
    ds4chat::render_options o;  // thinking mode, old reasoning dropped
    return ds4chat::render_prompt(ojson::parse(messages), ojson::parse(tools), o);
}

bool covered(const std::vector<byte_span> &spans, const std::string &text, std::string_view what) {
    const uint64_t b = text.find(what), e = b + what.size();
    if (b == std::string::npos) {
        ADD_FAILURE() << "not in the prompt: " << what;
        return false;
    }
    for (const byte_span &f : spans)
        if (f.begin <= b && e <= f.end) return true;
    return false;
}

const char *k_tools = R"([{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])";

}  // namespace

TEST(pflash_ds4, turns_and_verbatim_rules) {
    const std::string text = render(R"([{"role":"system","content":"Be brief."},
        {"role":"user","content":"old question"},
        {"role":"assistant","content":"old answer","reasoning_content":"dropped"},
        {"role":"user","content":"new question"}])");
    ASSERT_EQ(text, BOS "Be brief." USR "old question" AST "</think>old answer" EOS USR "new question" AST "<think>");
    const prompt_structure st = find_structure(text, true, true);
    ASSERT_EQ(st.turns.size(), 5u);
    const std::vector<std::string> roles = {"system", "user", "assistant", "user", "assistant"};
    for (size_t i = 0; i < roles.size(); ++i) EXPECT_EQ(st.turns[i].role, roles[i]) << i;
    auto str = [&](byte_span s) { return text.substr(s.begin, s.end - s.begin); };
    EXPECT_EQ(str(st.turns[0].header), BOS);
    EXPECT_EQ(str(st.turns[0].content), "Be brief.");
    EXPECT_EQ(str(st.turns[2].header), AST "</think>");
    EXPECT_EQ(str(st.turns[2].content), "old answer");
    EXPECT_EQ(str(st.turns[2].footer), EOS);
    EXPECT_EQ(str(st.turns[3].content), "new question");
    EXPECT_EQ(str(st.turns[4].header), AST "<think>");  // the generation prompt
    EXPECT_TRUE(covered(st.forced, text, BOS "Be brief." USR));
    EXPECT_TRUE(covered(st.forced, text, USR "new question" AST "<think>"));
    EXPECT_TRUE(covered(st.forced, text, AST "</think>"));
    EXPECT_TRUE(covered(st.forced, text, EOS USR));
    EXPECT_FALSE(covered(st.forced, text, "old question"));
    EXPECT_FALSE(covered(st.forced, text, "old answer"));
    const prompt_structure loose = find_structure(text, false, false);
    EXPECT_FALSE(covered(loose.forced, text, "Be brief."));
    EXPECT_FALSE(covered(loose.forced, text, "new question"));
    EXPECT_TRUE(covered(loose.forced, text, USR));
}

// An agent turn: tools in the system prompt, a DSML call, its result as the last "user" turn.
TEST(pflash_ds4, dsml_blocks_and_tool_results) {
    const std::string text = render(R"([{"role":"system","content":"You are a bot."},
        {"role":"user","content":"Weather in Paris?"},
        {"role":"assistant","content":"","reasoning_content":"Need weather.","tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
        {"role":"tool","tool_call_id":"call_1","content":"Sunny, 20C"}])",
                                    k_tools);
    const std::string block =
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    const std::string result = "<tool_result>Sunny, 20C</tool_result>";
    const prompt_structure st = find_structure(text, true, true);
    const uint64_t bb = text.find(block), rb = text.find(result);
    ASSERT_NE(bb, std::string::npos);
    ASSERT_NE(rb, std::string::npos);
    // The DSML example inside the tools text is atomic too (kept with the system prompt anyway).
    EXPECT_NE(std::find(st.atomic.begin(), st.atomic.end(), byte_span{bb, bb + block.size()}), st.atomic.end());
    EXPECT_NE(std::find(st.atomic.begin(), st.atomic.end(), byte_span{rb, rb + result.size()}), st.atomic.end());
    EXPECT_EQ(st.turns.back().role, "assistant");
    EXPECT_EQ(st.turns[st.turns.size() - 2].role, "user");
    EXPECT_TRUE(covered(st.forced, text, USR + result + AST "<think>"));  // the last user turn: the result
    EXPECT_TRUE(covered(st.forced, text, "## Tools"));                   // the system prompt, tools included
    EXPECT_FALSE(covered(st.forced, text, "Weather in Paris?"));

    // Selection keeps a touched DSML block whole: one chunk scored inside it keeps all of it.
    const std::string hist = render(R"([{"role":"user","content":"Weather in Paris?"},
        {"role":"assistant","content":"","tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
        {"role":"tool","tool_call_id":"call_1","content":"Sunny, 20C"},
        {"role":"assistant","content":"It is sunny."},
        {"role":"user","content":"Thanks"}])");
    const prompt_structure sh = find_structure(hist, false, false);
    const uint64_t b = hist.find(block), e = b + block.size();
    ASSERT_NE(b, std::string::npos);
    std::vector<int32_t> ids;
    std::vector<byte_span> spans;
    for (uint64_t i = 0; i < hist.size(); ++i) {
        ids.push_back(1000 + static_cast<int32_t>(i % 7));
        spans.push_back({i, i + 1});
    }
    options o;
    o.drafter_path = "unused";
    o.chunk_tokens = 4;
    o.head_chunks = 0;
    o.tail_chunks = 0;
    o.min_chunks = 0;
    o.anchor_ngram = 0;
    const size_t n_chunks = (hist.size() + 3) / 4;
    o.keep_ratio = 1.0 / static_cast<double>(n_chunks);  // budget: 1 chunk
    std::vector<float> sc(n_chunks, 0.0f);
    sc[(b + 40) / 4] = 5;  // inside the block
    const selection s = select_spans(ids, spans, sc, sh, hist, o);
    EXPECT_TRUE(std::any_of(s.kept.begin(), s.kept.end(), [&](const byte_span &k) { return k.begin <= b && e <= k.end; }));
    for (const byte_span &k : s.kept)  // no kept span cuts the block
        EXPECT_TRUE(k.end <= b || k.begin >= e || (k.begin <= b && e <= k.end)) << k.begin << ".." << k.end;
}

namespace {

// An agent conversation of ~4 KB: tools, filler turns, a DSML call with its result, a last question.
std::string agent_prompt() {
    const std::string filler = "The harbor lights flickered over the quiet water while farmers carried apples to market. ";
    ojson m = ojson::array();
    m.push_back({{"role", "system"}, {"content", "You are a terse travel assistant."}});
    for (int t = 0; t < 4; ++t) {
        std::string u = "Note " + std::to_string(t) + ": ";
        for (int k = 0; k < 6; ++k) u += filler;
        m.push_back({{"role", "user"}, {"content", u}});
        m.push_back({{"role", "assistant"}, {"content", "Noted " + std::to_string(t) + "."}});
    }
    m.push_back({{"role", "user"}, {"content", "Weather in Paris?"}});
    m.push_back({{"role", "assistant"}, {"content", ""}, {"tool_calls", ojson::parse(R"([{"id":"call_1","type":"function",
        "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}])")}});
    m.push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "Sunny, 20C, light wind from the west."}});
    m.push_back({{"role", "user"}, {"content", "And what should I wear there tomorrow?"}});
    ds4chat::render_options o;
    return ds4chat::render_prompt(m, ojson::parse(k_tools), o);
}

size_t count(const std::string &s, std::string_view what) {
    size_t n = 0;
    for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
    return n;
}

}  // namespace

TEST(pflash_ds4, compress_ds4_tiny_target_with_dense_drafter) {
    const std::string target_path = FATHOM_SHARED_DIR "/golden/ds4-tiny/ds4-tiny-a.gguf";
    const std::string drafter_path = FATHOM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(target_path) || !std::filesystem::exists(drafter_path)) GTEST_SKIP() << "models missing";
    engine_options eo;
    eo.model_path = target_path;
    eo.n_threads = 2;
    eo.n_ctx = 8192;
    auto target = engine::load(eo);
    const std::string text = agent_prompt();
    const std::vector<int32_t> prompt = target->tokenize(text, true, false);
    options o;
    o.drafter_path = drafter_path;
    o.n_threads = 2;
    o.chunk_tokens = 16;
    o.keep_ratio = 0.2;
    auto c = compressor::create(o);
    const result r = c->compress(*target, prompt);
    EXPECT_LT(r.n_effective, r.n_original * 6 / 10);
    const std::string kept = target->detokenize(r.tokens);
    // The system prompt (tools included) and the last user turn verbatim, with the generation prompt.
    // The tool result and the question after it share that turn (DS4 rule 6).
    const size_t sys_end = text.find(USR);
    EXPECT_EQ(kept.rfind(text.substr(0, sys_end), 0), 0u);
    const std::string result_text = "<tool_result>Sunny, 20C, light wind from the west.</tool_result>";
    const std::string last = USR + result_text + "\n\nAnd what should I wear there tomorrow?" AST "<think>";
    ASSERT_GT(kept.size(), last.size());
    EXPECT_EQ(kept.substr(kept.size() - last.size()), last);
    // Every role marker kept; DSML blocks and tool results whole or not at all.
    for (std::string_view mk : {std::string_view(USR), std::string_view(AST), std::string_view(EOS)})
        EXPECT_EQ(count(kept, mk), count(text, mk)) << mk;
    const std::string block_open = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">";
    const std::string block =
        block_open + "\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
                     "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    EXPECT_EQ(count(kept, block_open), count(kept, block));
    EXPECT_EQ(count(kept, "<tool_result>"), count(kept, result_text));
    EXPECT_EQ(count(kept, "<tool_result>"), count(kept, "</tool_result>"));
}

}  // namespace fathom::pflash
