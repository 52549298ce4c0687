// DSML: Python-compatible JSON text, parsing of model output (whole and streamed at every split),
// malformed input, unicode, render -> parse round trips, the exact-replay map and the server
// tool_format hook. Expected values are written out by hand (Python's json.dumps / repr rules and
// the official decode_dsml_to_arguments "{key: value, ...}" form).
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <nlohmann/json.hpp>

#include "chat/ds4_chat.h"
#include "core/error.h"
#include "chat/dsml.h"
#include "server/tool_calls.h"

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;
namespace d = fathom::ds4chat;

namespace {

const std::string k_block =
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

bool valid_utf8(const std::string &s) {
    size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (n == 0 || i + n > s.size()) return false;
        for (size_t k = 1; k < n; ++k)
            if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
        i += n;
    }
    return true;
}

// Feeds `text` split at the given cut points; checks the streaming invariants on the way and
// returns the concatenated deltas as a result.
d::dsml_result stream(const std::string &text, const std::vector<size_t> &cuts, d::dsml_parser_options o,
                      const d::dsml_result &whole) {
    d::dsml_stream_parser p(o);
    d::dsml_result acc;
    size_t prev = 0;
    auto add = [&](const d::dsml_delta &dl) {
        EXPECT_TRUE(valid_utf8(dl.content)) << "content delta splits a UTF-8 character";
        EXPECT_TRUE(valid_utf8(dl.reasoning)) << "reasoning delta splits a UTF-8 character";
        acc.content += dl.content;
        acc.reasoning += dl.reasoning;
        for (const auto &c : dl.calls) acc.calls.push_back(c);
        // Never emit what the whole parse does not have: no partial markup can leak.
        EXPECT_EQ(whole.content.compare(0, acc.content.size(), acc.content), 0) << "leaked: " << acc.content;
        EXPECT_EQ(whole.reasoning.compare(0, acc.reasoning.size(), acc.reasoning), 0);
    };
    for (size_t c : cuts) {
        add(p.feed(std::string_view(text).substr(prev, c - prev)));
        prev = c;
    }
    add(p.feed(std::string_view(text).substr(prev)));
    add(p.finish());
    EXPECT_EQ(p.result().raw_dsml, whole.raw_dsml);
    EXPECT_EQ(p.result().error, whole.error);
    EXPECT_EQ(p.result().replay_exact, whole.replay_exact);
    return acc;
}

void expect_split_invariant(const std::string &text, d::dsml_parser_options o = {}) {
    const auto whole = d::dsml_parse(text, o);
    for (size_t cut = 0; cut <= text.size(); ++cut) {
        const auto r = stream(text, {cut}, o, whole);
        ASSERT_EQ(r.content, whole.content) << "split at " << cut;
        ASSERT_EQ(r.reasoning, whole.reasoning) << "split at " << cut;
        ASSERT_EQ(r.calls, whole.calls) << "split at " << cut;
    }
    std::vector<size_t> every;
    for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
    const auto r = stream(text, every, o, whole);
    EXPECT_EQ(r.content, whole.content);
    EXPECT_EQ(r.reasoning, whole.reasoning);
    EXPECT_EQ(r.calls, whole.calls);
}

}  // namespace

// ---- Python json.dumps(ensure_ascii=False) ----

TEST(PyJson, StringsAndContainers) {
    EXPECT_EQ(d::py_json_dumps(ojson::parse(R"({"a": [1, 2, {"b": "c"}], "d": {}, "e": [], "f": null, "g": false})")),
              R"({"a": [1, 2, {"b": "c"}], "d": {}, "e": [], "f": null, "g": false})");
    EXPECT_EQ(d::py_json_dumps(ojson("q\"b\\s/\n\r\t\b\f\x01\x1f\x7f é 日本 😀")),
              "\"q\\\"b\\\\s/\\n\\r\\t\\b\\f\\u0001\\u001f\x7f é 日本 😀\"");
    EXPECT_EQ(d::py_json_dumps(ojson::parse(R"({"z": 1, "a": 2})")), R"({"z": 1, "a": 2})");  // order kept
    EXPECT_EQ(d::py_json_dumps(ojson(-42)), "-42");
    EXPECT_EQ(d::py_json_dumps(ojson(18446744073709551615ull)), "18446744073709551615");
}

TEST(PyJson, FloatsLikeRepr) {
    const std::pair<double, const char *> cases[] = {
        {1.0, "1.0"},         {0.1, "0.1"},           {100.0, "100.0"},         {-0.0, "-0.0"},
        {0.0, "0.0"},         {1.5, "1.5"},           {1e15, "1000000000000000.0"}, {1e16, "1e+16"},
        {1.5e16, "1.5e+16"},  {0.0001, "0.0001"},     {1e-05, "1e-05"},         {1.5e300, "1.5e+300"},
        {5e-324, "5e-324"},   {123456789.123, "123456789.123"}, {12345678901234567890.0, "1.2345678901234567e+19"},
        {-2.5e-7, "-2.5e-07"}, {1e22, "1e+22"},
    };
    for (const auto &[v, want] : cases) EXPECT_EQ(d::py_json_dumps(ojson(v)), want) << v;
}

// ---- parsing ----

TEST(DsmlParse, CanonicalBlock) {
    const auto r = d::dsml_parse("Let me check." + k_block);
    EXPECT_EQ(r.content, "Let me check.");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].name, "get_weather");
    EXPECT_EQ(r.calls[0].arguments, R"({"city": "Paris", "days": 3})");
    EXPECT_EQ(r.raw_dsml, k_block);
    EXPECT_TRUE(r.replay_exact);
    EXPECT_TRUE(r.error.empty());
}

TEST(DsmlParse, ThinkingSplitsReasoning) {
    d::dsml_parser_options o;
    o.thinking = true;
    const auto r = d::dsml_parse("I should call.</think>" + k_block, o);
    EXPECT_EQ(r.reasoning, "I should call.");
    EXPECT_TRUE(r.reasoning_closed);
    EXPECT_EQ(r.content, "");
    ASSERT_EQ(r.calls.size(), 1u);
    // Unclosed reasoning stays reasoning.
    const auto open = d::dsml_parse("still thinking <｜DSML｜tool_calls>", o);
    EXPECT_EQ(open.reasoning, "still thinking <｜DSML｜tool_calls>");
    EXPECT_FALSE(open.reasoning_closed);
    EXPECT_TRUE(open.calls.empty());
}

TEST(DsmlParse, DegradedPrefixes) {
    const auto s = d::dsml_parse(
        "<DSML｜tool_calls>\n<DSML｜invoke name=\"f\">\n<DSML｜parameter name=\"a\" string=\"true\">x</DSML｜parameter>\n"
        "</DSML｜invoke>\n</DSML｜tool_calls>");
    ASSERT_EQ(s.calls.size(), 1u);
    EXPECT_EQ(s.calls[0], (d::dsml_call{"f", R"({"a": "x"})"}));
    const auto bare = d::dsml_parse(
        "ok <tool_calls><invoke name=\"f\"><parameter name=\"a\" string=\"false\">[1, 2]</parameter></invoke></tool_calls>");
    EXPECT_EQ(bare.content, "ok ");
    ASSERT_EQ(bare.calls.size(), 1u);
    EXPECT_EQ(bare.calls[0], (d::dsml_call{"f", R"({"a": [1, 2]})"}));
    const auto ascii = d::dsml_parse(
        "<|DSML|tool_calls><|DSML|invoke name=\"g\"><|DSML|parameter name=\"n\" string=\"false\">7</|DSML|parameter>"
        "</|DSML|invoke></|DSML|tool_calls>");
    ASSERT_EQ(ascii.calls.size(), 1u);
    EXPECT_EQ(ascii.calls[0], (d::dsml_call{"g", R"({"n": 7})"}));
    // Mixed prefixes inside one block are accepted tag by tag.
    const auto mixed = d::dsml_parse(
        "<｜DSML｜tool_calls><DSML｜invoke name=\"h\"><parameter name=\"k\" string=\"true\">v</｜DSML｜parameter>"
        "</invoke></|DSML|tool_calls>");
    ASSERT_EQ(mixed.calls.size(), 1u) << mixed.error;
}

TEST(DsmlParse, MultipleInvokesAndRawValues) {
    const std::string text =
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"b\">\n"
        "<｜DSML｜parameter name=\"code\" string=\"true\">if (a<b) {\n  x>y;\n}</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"o\" string=\"false\"> {\"k\": [true, null]} </｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    const auto r = d::dsml_parse(text);
    ASSERT_EQ(r.calls.size(), 2u) << r.error;
    EXPECT_EQ(r.calls[0], (d::dsml_call{"a", "{}"}));
    // string="false" values are kept verbatim, as the official decoder does.
    EXPECT_EQ(r.calls[1].arguments, "{\"code\": \"if (a<b) {\\n  x>y;\\n}\", \"o\":  {\"k\": [true, null]} }");
    EXPECT_EQ(json::parse(r.calls[1].arguments), json::parse(R"({"code":"if (a<b) {\n  x>y;\n}","o":{"k":[true,null]}})"));
    EXPECT_EQ(r.content, "");
}

TEST(DsmlParse, UnicodeArguments) {
    const std::string text =
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"write\">\n"
        "<｜DSML｜parameter name=\"text\" string=\"true\">naïve 😀 \"quotes\" \\ back\nline\ttab</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"名前\" string=\"true\">日本語</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    const auto r = d::dsml_parse(text);
    ASSERT_EQ(r.calls.size(), 1u) << r.error;
    EXPECT_EQ(r.calls[0].arguments,
              "{\"text\": \"naïve 😀 \\\"quotes\\\" \\\\ back\\nline\\ttab\", \"名前\": \"日本語\"}");
    EXPECT_EQ(json::parse(r.calls[0].arguments)["text"], "naïve 😀 \"quotes\" \\ back\nline\ttab");
    expect_split_invariant("Voilà — " + text);
}

TEST(DsmlParse, StringFalseThatIsNotJsonBecomesString) {
    const auto r = d::dsml_parse(
        "<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"a\" string=\"false\">hello world"
        "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].arguments, R"({"a": "hello world"})");
}

TEST(DsmlParse, InvalidUtf8InValuesBecomesReplacementCharacter) {
    const auto r = d::dsml_parse(
        "<tool_calls><invoke name=\"f\"><parameter name=\"a\" string=\"true\">x\xE6\x97y\xFFz\xF0\x9F\x98</parameter>"
        "</invoke></tool_calls>");
    ASSERT_EQ(r.calls.size(), 1u);
    // "\xE6\x97" is one truncated 3-byte sequence -> one U+FFFD; "\xFF" -> one; "\xF0\x9F\x98" -> one.
    EXPECT_EQ(r.calls[0].arguments, "{\"a\": \"x\uFFFDy\uFFFDz\uFFFD\"}");
    EXPECT_FALSE(json::parse(r.calls[0].arguments, nullptr, false).is_discarded());
}

TEST(DsmlParse, ContentWithAngleBracketsIsUntouched) {
    const std::string t = "a < b and <b>bold</b> <tool_call> <tool_callsX> </think> end";
    const auto r = d::dsml_parse(t);
    EXPECT_EQ(r.content, t);
    EXPECT_TRUE(r.calls.empty());
    EXPECT_TRUE(r.raw_dsml.empty());
    expect_split_invariant(t);
}

TEST(DsmlParse, WhitespaceAroundBlockAndTrailingText) {
    // Only the "\n\n" right before the tag belongs to the block (official start token).
    const auto r = d::dsml_parse("Hi \n\n" + k_block.substr(2) + "\n  ");
    EXPECT_EQ(r.content, "Hi ");
    EXPECT_EQ(r.raw_dsml, k_block + "\n  ");
    EXPECT_TRUE(r.replay_exact);
    // Text after the block: kept as content, replay no longer exact.
    const auto t = d::dsml_parse("A" + k_block + "\nDone.");
    EXPECT_EQ(t.content, "A\nDone.");
    EXPECT_EQ(t.calls.size(), 1u);
    EXPECT_FALSE(t.replay_exact);
    // Two blocks separated by whitespace: both calls, one contiguous raw span.
    const auto two = d::dsml_parse("A" + k_block + k_block);
    EXPECT_EQ(two.calls.size(), 2u);
    EXPECT_EQ(two.raw_dsml, k_block + k_block);
    EXPECT_TRUE(two.replay_exact);
    EXPECT_EQ(two.content, "A");
}

TEST(DsmlParse, EosTextEndsOutput) {
    const auto r = d::dsml_parse("Hello<｜end▁of▁sentence｜>junk <｜DSML｜tool_calls>");
    EXPECT_EQ(r.content, "Hello");
    EXPECT_TRUE(r.saw_eos);
    EXPECT_TRUE(r.calls.empty());
    const auto after = d::dsml_parse("X" + k_block + "<｜end▁of▁sentence｜>");
    EXPECT_EQ(after.calls.size(), 1u);
    EXPECT_TRUE(after.saw_eos);
    EXPECT_TRUE(after.replay_exact);
}

// ---- malformed input ----

TEST(DsmlMalformed, ReportedAsErrorOrText) {
    const std::string bad = "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\ngarbage here";
    const auto r = d::dsml_parse(bad);
    EXPECT_EQ(r.content, "Hi");
    EXPECT_TRUE(r.calls.empty());
    EXPECT_EQ(r.error, "unexpected text in DSML tool_calls block");
    EXPECT_EQ(r.error_text, bad.substr(2));
    EXPECT_FALSE(r.replay_exact);
    d::dsml_parser_options o;
    o.malformed_as_text = true;
    const auto t = d::dsml_parse(bad, o);
    EXPECT_EQ(t.content, bad);
    EXPECT_TRUE(t.calls.empty());
    expect_split_invariant(bad);
    expect_split_invariant(bad, o);
}

TEST(DsmlMalformed, EachKindHasItsMessage) {
    const std::string open = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">";
    const std::pair<std::string, std::string> cases[] = {
        {open + "<｜DSML｜parameter name=\"a\" string=\"true\">abc", "unterminated DSML parameter value"},
        {open, "unterminated DSML tool_calls block"},
        {open + "<｜DSML｜parameter name=\"a\" str", "unterminated DSML tag"},
        {open + "<｜DSML｜parameter name=\"a\" string=\"maybe\">x</｜DSML｜parameter>",
         "malformed DSML parameter tag <｜DSML｜parameter name=\"a\" string=\"maybe\">"},
        {open + "<｜DSML｜parameter name=\"a\" string=\"true\">1</｜DSML｜parameter>"
                "<｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter>",
         "duplicate DSML parameter \"a\" in invoke \"f\""},
        {"<｜DSML｜tool_calls><｜DSML｜invoke>", "DSML invoke without a name: <｜DSML｜invoke>"},
        {"<｜DSML｜tool_calls></｜DSML｜invoke>", "unexpected DSML tag </｜DSML｜invoke>"},
        {"<｜DSML｜tool_calls><｜DSML｜invoke name=f>", "malformed DSML tag <｜DSML｜invoke name=f>"},
        {"<｜DSML｜tool_calls><x" + std::string(5000, 'a'), "DSML tag longer than 4096 bytes"},
    };
    for (const auto &[text, msg] : cases) {
        const auto r = d::dsml_parse(text);
        EXPECT_EQ(r.error, msg) << text.substr(0, 100);
        EXPECT_TRUE(r.calls.empty());
        EXPECT_EQ(r.content, "");
    }
    // A malformed second block keeps the calls of the first, well-formed one.
    const auto r = d::dsml_parse(k_block + k_block.substr(0, 25));  // ends after "<｜DSML｜tool_calls>\n"
    EXPECT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.error, "unterminated DSML tool_calls block");
}

// Random truncations and byte edits of valid output: no crash, and byte-by-byte streaming agrees
// with the whole-text parse on content, calls and error.
TEST(DsmlMalformed, RandomMutationsAgreeWhenStreamed) {
    const std::string base = "Intro é." + k_block + "\n\n<tool_calls><invoke name=\"x\"><parameter name=\"p\" string=\"false\">"
                             "[1, {\"a\": \"</parameter\"}]</parameter></invoke></tool_calls>";
    const std::string alphabet = "<>/\"=｜ \nDSMLtoolcalsinvkeparm";
    std::mt19937 rng(1234);
    for (int it = 0; it < 300; ++it) {
        std::string t = base.substr(0, rng() % (base.size() + 1));
        for (int k = rng() % 4; k > 0 && !t.empty(); --k) t[rng() % t.size()] = alphabet[rng() % alphabet.size()];
        d::dsml_parser_options o;
        o.thinking = it % 5 == 0;
        o.malformed_as_text = it % 2 == 0;
        const auto whole = d::dsml_parse(t, o);
        d::dsml_stream_parser p(o);
        std::string content;
        std::vector<d::dsml_call> calls;
        for (char c : t) {
            const auto dl = p.feed(std::string_view(&c, 1));
            content += dl.content;
            calls.insert(calls.end(), dl.calls.begin(), dl.calls.end());
        }
        const auto dl = p.finish();
        content += dl.content;
        calls.insert(calls.end(), dl.calls.begin(), dl.calls.end());
        ASSERT_EQ(content, whole.content) << it;
        ASSERT_EQ(calls, whole.calls) << it;
        ASSERT_EQ(p.result().error, whole.error) << it;
        for (const auto &c : calls) EXPECT_FALSE(json::parse(c.arguments, nullptr, false).is_discarded()) << c.arguments;
    }
}

// ---- streaming ----

TEST(DsmlStream, EverySplitGivesTheSameResult) {
    expect_split_invariant("Let me check the weather for you." + k_block);
    expect_split_invariant("Trailing ws \n\n" + k_block + "\n\nafter text é");
    expect_split_invariant(
        "x<tool_calls><invoke name=\"f\"><parameter name=\"a\" string=\"false\">{\"k\": \"</parameter\"}"
        "</parameter></invoke></tool_calls>");
    d::dsml_parser_options think;
    think.thinking = true;
    expect_split_invariant("Reasoning with 日本 and </thin k>.</think>Answer 😀." + k_block, think);
    expect_split_invariant("no close <｜end▁of▁sentence｜>", think);
}

TEST(DsmlStream, DeltasComeAsEarlyAsPossible) {
    d::dsml_stream_parser p;
    EXPECT_EQ(p.feed("Hello wor").content, "Hello wor");
    EXPECT_EQ(p.feed("ld ").content, "ld");  // trailing space held: it may precede a block
    EXPECT_EQ(p.feed("<｜DS").content, "");  // possible tag start held
    EXPECT_EQ(p.feed("ML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n").content, " ");
    EXPECT_TRUE(p.feed("</｜DSML｜invoke>\n").calls.empty());
    const auto dl = p.feed("</｜DSML｜tool_calls>");
    ASSERT_EQ(dl.calls.size(), 1u);  // calls arrive when the block closes
    EXPECT_EQ(dl.calls[0], (d::dsml_call{"f", "{}"}));
    EXPECT_TRUE(p.finish().empty());
    EXPECT_EQ(p.result().content, "Hello world ");
}

TEST(DsmlStream, SafeContentPrefix) {
    EXPECT_EQ(d::dsml_safe_content_prefix("Hello\n\n<｜DS"), 5u);
    EXPECT_EQ(d::dsml_safe_content_prefix("Hello wor"), 9u);
    EXPECT_EQ(d::dsml_safe_content_prefix("Hello "), 5u);
    EXPECT_EQ(d::dsml_safe_content_prefix("abc\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv"), 3u);
    EXPECT_EQ(d::dsml_safe_content_prefix("abc" + k_block + " more text"), 3u);
    EXPECT_EQ(d::dsml_safe_content_prefix("caf\xC3"), 3u);  // incomplete UTF-8 held
}

TEST(DsmlStream, LongValueStreamsInLinearTime) {
    std::string value;
    for (int i = 0; i < 20000; ++i) value += "line " + std::to_string(i) + " <a> | x\n";  // ~400 KB
    const std::string text = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"w\"><｜DSML｜parameter name=\"c\" string=\"true\">" +
                             value + "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>";
    const auto t0 = std::chrono::steady_clock::now();
    d::dsml_stream_parser p;
    for (size_t i = 0; i < text.size(); i += 3) p.feed(std::string_view(text).substr(i, 3));
    p.finish();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(p.result().calls.size(), 1u);
    EXPECT_EQ(json::parse(p.result().calls[0].arguments)["c"], value);
    EXPECT_LT(s, 2.0);
}

// ---- render -> parse round trips ----

TEST(DsmlRoundTrip, RenderParseRender) {
    const std::vector<d::dsml_call> calls = {
        {"search", R"({"query": "C++ \"quotes\" & <tags>", "limit": 10, "filters": {"lang": ["en", "fr"], "safe": true}})"},
        {"noop", "{}"},
        {"write", "{\"path\": \"/tmp/ü.txt\", \"content\": \"multi\\nline\\ttext 😀\", \"mode\": null, \"ratio\": 0.25}"},
    };
    const std::string rendered = d::dsml_render_tool_calls(calls);
    const auto r = d::dsml_parse("Sure." + rendered);
    ASSERT_TRUE(r.error.empty()) << r.error;
    EXPECT_EQ(r.content, "Sure.");
    EXPECT_EQ(r.raw_dsml, rendered);
    ASSERT_EQ(r.calls.size(), calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
        EXPECT_EQ(r.calls[i].name, calls[i].name);
        EXPECT_EQ(json::parse(r.calls[i].arguments), json::parse(calls[i].arguments)) << i;
    }
    EXPECT_EQ(d::dsml_render_tool_calls(r.calls), rendered);  // parsed form re-renders identically
    expect_split_invariant("Sure." + rendered);
}

// ---- exact replay ----

TEST(DsmlReplay, LookupNeedsTheExactIdList) {
    d::dsml_replay_map m(10);
    m.remember({"c1", "c2"}, "RAW");
    EXPECT_EQ(m.lookup({"c1", "c2"}), "RAW");
    EXPECT_EQ(m.lookup({"c1"}), std::nullopt);
    EXPECT_EQ(m.lookup({"c2", "c1"}), std::nullopt);
    EXPECT_EQ(m.lookup({"c1", "c2", "c3"}), std::nullopt);
    EXPECT_EQ(m.lookup({}), std::nullopt);
    EXPECT_EQ(m.size(), 2u);
    EXPECT_THROW(m.remember({}, "x"), fathom::error);
    EXPECT_THROW(m.remember({"a", "a"}, "x"), fathom::error);
    EXPECT_THROW(m.remember({""}, "x"), fathom::error);
}

TEST(DsmlReplay, BoundedOldestFirst) {
    d::dsml_replay_map m(3);
    m.remember({"a"}, "A");
    m.remember({"b"}, "B");
    m.remember({"c"}, "C");
    m.remember({"d"}, "D");
    EXPECT_EQ(m.size(), 3u);
    EXPECT_EQ(m.lookup({"a"}), std::nullopt);
    EXPECT_EQ(m.lookup({"d"}), "D");
    m.remember({"e", "f"}, "EF");  // evicts b, c
    EXPECT_EQ(m.lookup({"b"}), std::nullopt);
    EXPECT_EQ(m.lookup({"e", "f"}), "EF");
    m.remember({"g", "h"}, "GH");  // evicts d, then e: the EF record is no longer complete
    EXPECT_EQ(m.size(), 3u);
    EXPECT_EQ(m.lookup({"e", "f"}), std::nullopt);
    EXPECT_EQ(m.lookup({"g", "h"}), "GH");
    // Re-storing one id many times replaces it and does not grow the map.
    d::dsml_replay_map r(5);
    for (int i = 0; i < 1000; ++i) r.remember({"x"}, std::to_string(i));
    EXPECT_EQ(r.size(), 1u);
    EXPECT_EQ(r.lookup({"x"}), "999");
}

// A sampled call with unusual spacing re-renders byte-identically from the map, and canonically
// without it.
TEST(DsmlReplay, HistoryRerendersSampledBytes) {
    const std::string sampled_raw =
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        "<｜DSML｜parameter name=\"a\" string=\"false\"> 5 </｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n";
    const std::string output = "Checking." + sampled_raw;  // what the model generated before EOS
    const auto r = d::dsml_parse(output);
    ASSERT_TRUE(r.replay_exact);
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].arguments, R"({"a":  5 })");
    d::dsml_replay_map map;
    map.remember({"call_x"}, r.raw_dsml);

    ojson msgs = ojson::array();
    msgs.push_back({{"role", "user"}, {"content", "go"}});
    ojson tc = {{"id", "call_x"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", r.calls[0].arguments}}}};
    msgs.push_back({{"role", "assistant"}, {"content", r.content}, {"tool_calls", ojson::array({tc})}});
    msgs.push_back({{"role", "tool"}, {"tool_call_id", "call_x"}, {"content", "ok"}});
    d::render_options o;
    o.thinking = false;
    o.replay = &map;
    EXPECT_EQ(d::render_prompt(msgs, nullptr, o),
              "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>" + output +
                  "<｜end▁of▁sentence｜><｜User｜><tool_result>ok</tool_result><｜Assistant｜></think>");
    o.replay = nullptr;
    EXPECT_EQ(d::render_prompt(msgs, nullptr, o),
              "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>Checking.\n\n<｜DSML｜tool_calls>\n"
              "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"false\">5</｜DSML｜parameter>\n"
              "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>ok</tool_result>"
              "<｜Assistant｜></think>");
}

// ---- server hook ----

TEST(DsmlServerFormat, RegisteredForDeepseek4) {
    auto f = fathom::server::make_tool_format("dsml");
    ASSERT_EQ(f->name(), "dsml");
    const auto p = f->parse("Let me check." + k_block, {"get_weather"});
    EXPECT_EQ(p.content, "Let me check.");
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(p.calls[0].name, "get_weather");
    EXPECT_EQ(p.calls[0].id.rfind("call_", 0), 0u);
    EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"city", "Paris"}, {"days", 3}}));
    EXPECT_EQ(f->safe_content_prefix("Let me\n\n<｜DSML"), 6u);
    EXPECT_EQ(f->render_result("f", "x<y"), "<tool_result>x<y</tool_result>");
    EXPECT_EQ(f->render_calls({{"id", "get_weather", R"({"city": "Paris", "days": 3})"}}), k_block);
    const auto prompt = f->system_prompt(json::parse(R"([{"type":"function","function":{"name":"f"}}])"), {});
    EXPECT_EQ(prompt.rfind("## Tools\n\n", 0), 0u);
    EXPECT_NE(prompt.find("\n\n{\"name\": \"f\"}\n\n"), std::string::npos);
    // Malformed DSML keeps its text as content (the interface has no error channel).
    EXPECT_EQ(f->parse("Hi<tool_calls>oops", {}).content, "Hi<tool_calls>oops");
}
