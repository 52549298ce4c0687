// DSML calls streamed as they decode (dsml_delta::call_deltas): hand-worked delta sequences for a
// token-like split, the hold-back of a possible closing tag inside a string value, and for every
// split of a harder text, fragments that concatenate to the arguments the whole-text parse gives
// (themselves checked by hand in test_dsml.cpp: official decode_dsml_to_arguments form).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "chat/dsml.h"

namespace d = fathom::ds4chat;

namespace {

// One feed's call deltas, flattened for comparison: "B<index>:<name>:<args>" for a begin,
// "F<index>:<args>" for a fragment, "E" appended when it ends the call.
std::vector<std::string> flat(const d::dsml_delta &dl) {
    std::vector<std::string> out;
    for (const auto &c : dl.call_deltas) {
        std::string s = c.begin ? "B" + std::to_string(c.index) + ":" + c.name + ":" + c.arguments
                                : "F" + std::to_string(c.index) + ":" + c.arguments;
        if (c.end) s += "E";
        out.push_back(s);
    }
    return out;
}

using strs = std::vector<std::string>;

}  // namespace

TEST(DsmlCallDeltas, TokenSplitHandWorked) {
    // Pieces as DS4's tokenizer would roughly produce them; next to each, what it makes certain.
    struct step {
        std::string piece, content;
        strs calls;
    };
    const std::vector<step> steps = {
        {"Let", "Let", {}},
        {" me check.", " me check.", {}},
        {"\n\n", "", {}},                       // may precede a block: held
        {"<｜DSML｜tool_calls>", "", {}},        // the block opens; the "\n\n" belongs to it
        {"\n", "", {}},
        {"<｜DSML｜invoke", "", {}},             // tag not complete yet
        {" name=\"get_weather\">", "", {"B0:get_weather:{"}},
        {"\n<｜DSML｜parameter name=\"city\"", "", {}},
        {" string=\"true\">", "", {"F0:\"city\": \""}},
        {"Par", "", {"F0:Par"}},
        {"is \"", "", {"F0:is \\\""}},           // a quote inside the value is escaped
        {"</｜DSML｜parameter>", "", {"F0:\""}},
        {"\n<｜DSML｜parameter name=\"days\" string=\"false\">", "", {"F0:, \"days\": "}},
        {"3", "", {}},                          // JSON values come whole, at their closing tag
        {"</｜DSML｜parameter>\n", "", {"F0:3"}},
        {"</｜DSML｜invoke>", "", {"F0:}E"}},
        {"\n</｜DSML｜tool_calls>", "", {}},
    };
    d::dsml_stream_parser p;
    std::string all;
    for (const auto &s : steps) {
        const d::dsml_delta dl = p.feed(s.piece);
        all += s.piece;
        EXPECT_EQ(dl.content, s.content) << "after " << all;
        EXPECT_EQ(flat(dl), s.calls) << "after " << all;
    }
    const d::dsml_delta last = p.finish();
    EXPECT_TRUE(last.call_deltas.empty());
    ASSERT_EQ(p.result().calls.size(), 1u);
    EXPECT_EQ(p.result().calls[0].arguments, R"({"city": "Paris \"", "days": 3})");
}

TEST(DsmlCallDeltas, PossibleClosingTagInAValueIsHeldBack) {
    d::dsml_stream_parser p;
    p.feed("<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"x\" string=\"true\">");
    EXPECT_EQ(flat(p.feed("a<")), strs({"F0:a"}));           // "<" may open the closing tag
    EXPECT_EQ(flat(p.feed("/｜DSM")), strs({}));               // still may
    EXPECT_EQ(flat(p.feed("x")), strs({"F0:</｜DSMx"}));       // no longer: released
    EXPECT_EQ(flat(p.feed("\xE2\x82")), strs({}));            // an incomplete UTF-8 character (€)
    // The rest of the value, its closing quote and the invoke's "}" in one delta (one feed).
    EXPECT_EQ(flat(p.feed("\xAC</parameter></invoke>")), strs({"F0:€\"}E"}));
    EXPECT_EQ(flat(p.feed("</tool_calls>")), strs({}));
    ASSERT_EQ(p.result().calls.size(), 1u);
    EXPECT_EQ(p.result().calls[0].arguments, R"({"x": "a</｜DSMx€"})");
}

TEST(DsmlCallDeltas, EverySplitConcatenatesToTheArguments) {
    const std::string text =
        "Two calls:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">\n"
        "<｜DSML｜parameter name=\"q\" string=\"true\">naïve \"quotes\" \\ and\nnewline <b></｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"opts\" string=\"false\">{\"n\": [1, 2.5], \"deep\": {\"x\": null}}</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"bad\" string=\"false\">not json</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n<invoke name=\"noargs\">\n</invoke>\n</｜DSML｜tool_calls> done";
    const d::dsml_result whole = d::dsml_parse(text);
    ASSERT_EQ(whole.calls.size(), 2u);
    ASSERT_TRUE(whole.error.empty()) << whole.error;
    EXPECT_EQ(whole.calls[1].arguments, "{}");
    auto check = [&](const std::vector<size_t> &cuts) {
        d::dsml_stream_parser p;
        std::vector<std::string> args, names;
        std::vector<int> ends;
        auto take = [&](const d::dsml_delta &dl) {
            for (const auto &c : dl.call_deltas) {
                if (c.begin) {
                    ASSERT_EQ(c.index, args.size());
                    args.emplace_back();
                    names.push_back(c.name);
                    ends.push_back(0);
                }
                ASSERT_LT(c.index, args.size());
                ASSERT_EQ(ends[c.index], 0) << "a delta after the call's end";
                args[c.index] += c.arguments;
                ends[c.index] += c.end;
            }
        };
        size_t prev = 0;
        for (size_t c : cuts) {
            take(p.feed(std::string_view(text).substr(prev, c - prev)));
            prev = c;
        }
        take(p.feed(std::string_view(text).substr(prev)));
        take(p.finish());
        ASSERT_EQ(args.size(), whole.calls.size());
        for (size_t i = 0; i < args.size(); ++i) {
            EXPECT_EQ(names[i], whole.calls[i].name);
            EXPECT_EQ(args[i], whole.calls[i].arguments);
            EXPECT_EQ(ends[i], 1);
        }
    };
    for (size_t cut = 0; cut <= text.size(); ++cut) check({cut});
    std::vector<size_t> every;
    for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
    check(every);
}

TEST(DsmlCallDeltas, MalformedBlockAfterAStartedCall) {
    // The invoke began (streamed); the block then breaks: no call in the result, the deltas stay sent.
    d::dsml_stream_parser p;
    EXPECT_EQ(flat(p.feed("<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">")), strs({"B0:f:{"}));
    EXPECT_EQ(flat(p.feed("oops")), strs({}));
    p.finish();
    EXPECT_FALSE(p.result().error.empty());
    EXPECT_TRUE(p.result().calls.empty());
}
