// Hermes/Qwen tool-call format: parsing finished outputs, the streaming-safe prefix, and that
// rendered calls parse back. Expected values are written out by hand.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/tool_calls.h"

using namespace fathom::server;
using json = nlohmann::json;

namespace {
const std::vector<std::string> k_known = {"get_weather", "add"};
auto fmt() { return make_tool_format("llama"); }
}  // namespace

TEST(ToolCalls, TaggedCall) {
    auto f = fmt();
    auto p = f->parse("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", k_known);
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(p.calls[0].name, "get_weather");
    EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"city", "Paris"}}));
    EXPECT_EQ(p.calls[0].id.rfind("call_", 0), 0u);
    EXPECT_EQ(p.content, "");
}

TEST(ToolCalls, TextBeforeAndTwoCalls) {
    auto f = fmt();
    auto p = f->parse("Let me check. <tool_call>{\"name\":\"add\",\"arguments\":{\"a\":1,\"b\":2}}</tool_call>\n"
                      "<tool_call>{\"name\":\"get_weather\",\"arguments\":{}}</tool_call>", k_known);
    ASSERT_EQ(p.calls.size(), 2u);
    EXPECT_EQ(p.calls[0].name, "add");
    EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"a", 1}, {"b", 2}}));
    EXPECT_EQ(p.calls[1].name, "get_weather");
    EXPECT_EQ(p.content, "Let me check. \n");
    EXPECT_NE(p.calls[0].id, p.calls[1].id);
}

TEST(ToolCalls, UnknownNameOrBadJsonStaysText) {
    auto f = fmt();
    const std::string a = "<tool_call>{\"name\":\"rm_rf\",\"arguments\":{}}</tool_call>";
    auto p = f->parse(a, k_known);
    EXPECT_TRUE(p.calls.empty());
    EXPECT_EQ(p.content, a);
    const std::string b = "x <tool_call>{not json</tool_call> y";
    p = f->parse(b, k_known);
    EXPECT_TRUE(p.calls.empty());
    EXPECT_EQ(p.content, b);
}

TEST(ToolCalls, UnclosedTagAtEnd) {
    auto p = fmt()->parse("<tool_call>{\"name\":\"add\",\"arguments\":{\"a\":3}}", k_known);
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"a", 3}}));
}

TEST(ToolCalls, BareJsonShapes) {
    auto f = fmt();
    auto p = f->parse("  {\"name\":\"add\",\"parameters\":{\"a\":1}} ", k_known);
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"a", 1}}));
    p = f->parse("{\"function\":{\"name\":\"add\",\"arguments\":\"{\\\"a\\\": 2}\"}}", k_known);
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(json::parse(p.calls[0].arguments), json({{"a", 2}}));
    p = f->parse("[{\"name\":\"add\",\"arguments\":{}},{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}]", k_known);
    ASSERT_EQ(p.calls.size(), 2u);
    EXPECT_EQ(p.calls[1].name, "get_weather");
    p = f->parse("{\"a\": 1}", k_known);  // JSON, but not a call
    EXPECT_TRUE(p.calls.empty());
    EXPECT_EQ(p.content, "{\"a\": 1}");
}

TEST(ToolCalls, SafeContentPrefix) {
    auto f = fmt();
    EXPECT_EQ(f->safe_content_prefix("Hello"), 5u);
    EXPECT_EQ(f->safe_content_prefix("Hello <tool"), 6u);
    EXPECT_EQ(f->safe_content_prefix("Hello <tool_call>{\"na"), 6u);
    EXPECT_EQ(f->safe_content_prefix("Hello <b>"), 9u);
    EXPECT_EQ(f->safe_content_prefix("  {\"na"), 0u);  // may be a bare JSON call
    EXPECT_EQ(f->safe_content_prefix(""), 0u);
    EXPECT_EQ(f->safe_content_prefix("<"), 0u);
}

TEST(ToolCalls, RenderedCallsParseBack) {
    auto f = fmt();
    std::vector<tool_call> calls = {{"call_1", "add", R"({"a":1,"b":[2,3]})"}, {"call_2", "get_weather", "{}"}};
    const std::string text = f->render_calls(calls);
    EXPECT_NE(text.find("<tool_call>"), std::string::npos);
    auto p = f->parse(text, k_known);
    ASSERT_EQ(p.calls.size(), 2u);
    EXPECT_EQ(json::parse(p.calls[0].arguments), json::parse(R"({"a":1,"b":[2,3]})"));
    EXPECT_EQ(p.calls[1].name, "get_weather");
}

TEST(ToolCalls, SystemPromptListsToolsAndChoice) {
    auto f = fmt();
    json tools = json::array({{{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", json::object()}}}}});
    tool_choice c;
    c.kind = tool_choice::function;
    c.name = "get_weather";
    const std::string s = f->system_prompt(tools, c);
    EXPECT_NE(s.find("\"get_weather\""), std::string::npos);
    EXPECT_NE(s.find("<tools>"), std::string::npos);
    EXPECT_NE(s.find("You must call the function \"get_weather\""), std::string::npos);
}
