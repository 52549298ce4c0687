// DS4 prompt rendering vectors. Every expected string is written out by hand from the rules of
// the official encoding_dsv4.py (render_message, merge_tool_messages,
// sort_tool_results_by_call_order, _drop_thinking_messages, TOOLS_TEMPLATE,
// REASONING_EFFORT_MAX); the comment on each test names the rules it exercises (numbers refer
// to the rule list in docs/ds4-chat-format.md). The special strings are typed again here, not
// taken from the code under test.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "chat/ds4_chat.h"
#include "core/error.h"

using ojson = nlohmann::ordered_json;
namespace d = fathom::ds4chat;

#define BOS "<｜begin▁of▁sentence｜>"
#define EOS "<｜end▁of▁sentence｜>"
#define USR "<｜User｜>"
#define AST "<｜Assistant｜>"

namespace {

// The official TOOLS_TEMPLATE, retyped, with the schema lines substituted.
std::string tools_section(const std::string &schemas) {
    return "## Tools\n\n"
           "You have access to a set of tools to help answer the user's question. You can invoke tools by writing "
           "a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
           "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
           "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
           "...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n"
           "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
           "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
           "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
           "<think>...</think> BEFORE any tool calls or final response.\n\n"
           "Otherwise, output directly after </think> with tool calls or final response.\n\n"
           "### Available Tool Schemas\n\n" +
           schemas + "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";
}

const char *k_weather_tools = R"([{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])";
// py json.dumps of the function object above, key order kept.
const std::string k_weather_schema =
    R"({"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})";

std::string render(const char *messages, bool thinking, const char *tools = "null", d::render_options o = {}) {
    o.thinking = thinking;
    return d::render_prompt(ojson::parse(messages), ojson::parse(tools), o);
}

}  // namespace

// Rules 1, 8, 9: BOS, user marker, generation prefix with <think>.
TEST(Ds4Render, SingleUserThinking) {
    EXPECT_EQ(render(R"([{"role":"user","content":"Hi"}])", true), BOS USR "Hi" AST "<think>");
}

// Rules 3, 9: system text verbatim before the first user; chat mode closes think at once.
TEST(Ds4Render, SystemAndUserChat) {
    EXPECT_EQ(render(R"([{"role":"system","content":"You are helpful."},{"role":"user","content":"Hi"}])", false),
              BOS "You are helpful." USR "Hi" AST "</think>");
}

// Rules 10, 11, 13: reasoning of a turn before the last user is dropped, and that turn's
// Assistant marker gets </think>; the final prefix opens <think>.
TEST(Ds4Render, MultiTurnThinkingDropsOldReasoning) {
    const char *m = R"([{"role":"user","content":"hello"},
        {"role":"assistant","content":"Hello! I am DeepSeek.","reasoning_content":"greet"},
        {"role":"user","content":"1+1=?"}])";
    EXPECT_EQ(render(m, true), BOS USR "hello" AST "</think>Hello! I am DeepSeek." EOS USR "1+1=?" AST "<think>");
    // drop_thinking=false keeps every turn's reasoning and opens <think> after every user.
    d::render_options keep;
    keep.drop_thinking = false;
    EXPECT_EQ(render(m, true, "null", keep),
              BOS USR "hello" AST "<think>greet</think>Hello! I am DeepSeek." EOS USR "1+1=?" AST "<think>");
}

// Rule 2: Think-Max paragraph right after BOS, thinking mode only.
TEST(Ds4Render, ThinkMaxPrefix) {
    const std::string max_text =
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
        "scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";
    d::render_options o;
    o.think_max = true;
    EXPECT_EQ(render(R"([{"role":"system","content":"S"},{"role":"user","content":"Q"}])", true, "null", o),
              BOS + max_text + "S" USR "Q" AST "<think>");
    EXPECT_EQ(render(R"([{"role":"user","content":"Q"}])", false, "null", o), BOS USR "Q" AST "</think>");
}

// Rules 4, 6, 12, 14, 15, 17: tools on the system message, tools keep all reasoning, DSML call
// block with "\n\n" before it, tool result as a user turn.
TEST(Ds4Render, ToolConversationThinking) {
    const char *m = R"([{"role":"system","content":"You are a bot."},
        {"role":"user","content":"Weather in Paris?"},
        {"role":"assistant","content":"","reasoning_content":"Need weather.","tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
        {"role":"tool","tool_call_id":"call_1","content":"Sunny, 20C"},
        {"role":"assistant","content":"It is sunny.","reasoning_content":"Got it."},
        {"role":"user","content":"Thanks"}])";
    const std::string want =
        BOS "You are a bot.\n\n" + tools_section(k_weather_schema) +
        USR "Weather in Paris?" AST "<think>Need weather.</think>"
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" EOS
        USR "<tool_result>Sunny, 20C</tool_result>" AST "<think>Got it.</think>It is sunny." EOS
        USR "Thanks" AST "<think>";
    EXPECT_EQ(render(m, true, k_weather_tools), want);
}

// Rules 6, 15, 16: consecutive tool results share one User marker joined by "\n\n"; empty
// arguments render an empty parameter list; non-string values are JSON with string="false".
TEST(Ds4Render, ConsecutiveToolResultsShareUserMarker) {
    const std::string want =
        BOS USR "Do both" AST "</think>"
        "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" EOS
        USR "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>" AST "</think>";
    const char *in_order = R"([{"role":"user","content":"Do both"},
        {"role":"assistant","content":null,"tool_calls":[
            {"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}},
            {"id":"c2","type":"function","function":{"name":"g","arguments":"{\"x\": 1}"}}]},
        {"role":"tool","tool_call_id":"c1","content":"A"},
        {"role":"tool","tool_call_id":"c2","content":"B"}])";
    EXPECT_EQ(render(in_order, false), want);
    // Rule 7: results arriving out of call order are sorted back by the call index.
    const char *swapped = R"([{"role":"user","content":"Do both"},
        {"role":"assistant","content":null,"tool_calls":[
            {"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}},
            {"id":"c2","type":"function","function":{"name":"g","arguments":"{\"x\": 1}"}}]},
        {"role":"tool","tool_call_id":"c2","content":"B"},
        {"role":"tool","tool_call_id":"c1","content":"A"}])";
    EXPECT_EQ(render(swapped, false), want);
}

// Rule 6: a user message after tool results joins the same User turn; consecutive user messages
// merge too.
TEST(Ds4Render, UserAfterToolResultAndConsecutiveUsersMerge) {
    const char *m = R"([{"role":"user","content":"q"},
        {"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1","content":"R"},
        {"role":"user","content":"thanks"}])";
    EXPECT_EQ(render(m, false),
              BOS USR "q" AST "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n"
                  "</｜DSML｜tool_calls>" EOS USR "<tool_result>R</tool_result>\n\nthanks" AST "</think>");
    EXPECT_EQ(render(R"([{"role":"user","content":"u1"},{"role":"user","content":"u2"}])", true),
              BOS USR "u1\n\nu2" AST "<think>");
}

// Rules 3, 11: developer renders as a User turn; in thinking mode with dropping, developer
// messages before the last user are removed entirely.
TEST(Ds4Render, DeveloperMessages) {
    const char *m = R"([{"role":"system","content":"S"},{"role":"developer","content":"Be brief."},
        {"role":"user","content":"u1"},{"role":"assistant","content":"a1","reasoning_content":"r1"},
        {"role":"user","content":"u2"}])";
    EXPECT_EQ(render(m, true), BOS "S" USR "u1" AST "</think>a1" EOS USR "u2" AST "<think>");
    EXPECT_EQ(render(m, false), BOS "S" USR "Be brief." USR "u1" AST "</think>a1" EOS USR "u2" AST "</think>");
    // A developer message as the last user-like turn gets the generation prefix.
    EXPECT_EQ(render(R"([{"role":"developer","content":"D"}])", true), BOS USR "D" AST "<think>");
}

// Rules 10, 13: an assistant turn after the last user keeps its reasoning; a trailing assistant
// gets no generation prefix; wo_eos leaves the turn open for continuation.
TEST(Ds4Render, TrailingAssistant) {
    EXPECT_EQ(render(R"([{"role":"user","content":"Q"},{"role":"assistant","content":"A","reasoning_content":"R"}])", true),
              BOS USR "Q" AST "<think>R</think>A" EOS);
    EXPECT_EQ(render(R"([{"role":"user","content":"Q"},{"role":"assistant","content":"A","reasoning_content":"R","wo_eos":true}])", true),
              BOS USR "Q" AST "<think>R</think>A");
}

// Rules 9, 13: chat mode ignores reasoning_content everywhere.
TEST(Ds4Render, ChatModeIgnoresReasoning) {
    const char *m = R"([{"role":"system","content":"S"},{"role":"user","content":"u1"},
        {"role":"assistant","content":"a1","reasoning_content":"r"},{"role":"user","content":"u2"}])";
    EXPECT_EQ(render(m, false), BOS "S" USR "u1" AST "</think>a1" EOS USR "u2" AST "</think>");
}

// Rules 4, 12: with tools present nothing is dropped: older turns keep <think>reasoning</think>.
// Without a system message an empty one carries the tools (the text starts with "\n\n").
TEST(Ds4Render, ToolsKeepHistoryReasoning) {
    const char *m = R"([{"role":"user","content":"u1"},{"role":"assistant","content":"a1","reasoning_content":"r1"},
        {"role":"user","content":"u2"}])";
    EXPECT_EQ(render(m, true, k_weather_tools),
              BOS "\n\n" + tools_section(k_weather_schema) +
                  USR "u1" AST "<think>r1</think>a1" EOS USR "u2" AST "<think>");
}

// Rule 4 (placements): first_message puts tools after the system text; new_system_message
// (vLLM) puts them before it.
TEST(Ds4Render, ToolsPlacement) {
    const char *m = R"([{"role":"system","content":"S"},{"role":"user","content":"Hi"}])";
    EXPECT_EQ(render(m, true, k_weather_tools), BOS "S\n\n" + tools_section(k_weather_schema) + USR "Hi" AST "<think>");
    d::render_options o;
    o.placement = d::tools_placement::new_system_message;
    EXPECT_EQ(render(m, true, k_weather_tools, o),
              BOS "\n\n" + tools_section(k_weather_schema) + "S" USR "Hi" AST "<think>");
}

// Rule 5: response_format section.
TEST(Ds4Render, ResponseFormat) {
    d::render_input in;
    in.messages = ojson::parse(R"([{"role":"user","content":"Give JSON"}])");
    in.response_format = ojson::parse(R"({"type":"object","properties":{"a":{"type":"integer"}}})");
    d::render_options o;
    o.thinking = false;
    EXPECT_EQ(d::render_prompt(in, o),
              BOS "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                  "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}" USR "Give JSON" AST "</think>");
}

// Rule 18: latest_reminder is a marker of its own; the user before it still gets the prefix.
TEST(Ds4Render, LatestReminder) {
    EXPECT_EQ(render(R"([{"role":"user","content":"u"},{"role":"latest_reminder","content":"rem"}])", true),
              BOS USR "u" AST "<think><｜latest_reminder｜>rem");
}

// Rule 16: parameter values: strings raw (no escaping), everything else Python json.dumps.
TEST(Ds4Render, ArgumentValueTypes) {
    const char *m = R"([{"role":"user","content":"x"},{"role":"assistant","content":"ok","tool_calls":[{"id":"c","type":"function",
        "function":{"name":"t","arguments":"{\"s\": \"h\u00e9llo \\\"q\\\"\", \"n\": 1.5, \"b\": true, \"arr\": [1, \"x\"], \"o\": {\"k\": null}, \"big\": 1e16, \"u\": \"\u65e5\u672c\"}"}}]}])";
    const std::string want =
        BOS USR "x" AST "</think>ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"t\">\n"
        "<｜DSML｜parameter name=\"s\" string=\"true\">héllo \"q\"</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"n\" string=\"false\">1.5</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"b\" string=\"false\">true</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"arr\" string=\"false\">[1, \"x\"]</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": null}</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"big\" string=\"false\">1e+16</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"u\" string=\"true\">日本</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" EOS;
    EXPECT_EQ(render(m, false), want);
    // Arguments that are not JSON become one string parameter named "arguments".
    EXPECT_EQ(render(R"([{"role":"user","content":"x"},{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function",
        "function":{"name":"t","arguments":"not json"}}]}])", false),
              BOS USR "x" AST "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"t\">\n"
                  "<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>\n"
                  "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" EOS);
}

TEST(Ds4Render, ContentPartsAndNullContent) {
    EXPECT_EQ(render(R"([{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}])", false),
              BOS USR "a\n\nb" AST "</think>");
    EXPECT_EQ(render(R"([{"role":"system","content":null},{"role":"user","content":"q"}])", false),
              BOS USR "q" AST "</think>");
}

TEST(Ds4Render, NlohmannJsonOverloadSortsKeys) {
    const auto m = nlohmann::json::parse(R"([{"role":"user","content":"Hi"}])");
    const auto t = nlohmann::json::parse(R"([{"type":"function","function":{"name":"f","description":"d"}}])");
    d::render_options o;
    o.thinking = false;
    EXPECT_EQ(d::render_prompt(m, t, o),
              BOS "\n\n" + tools_section(R"({"description": "d", "name": "f"})") + USR "Hi" AST "</think>");
}

TEST(Ds4Render, InvalidInputsThrowOneLineErrors) {
    auto bad = [](const char *m) { return render(m, true); };
    EXPECT_THROW(bad(R"([{"role":"robot","content":"x"}])"), fathom::error);
    EXPECT_THROW(bad(R"([{"content":"x"}])"), fathom::error);
    EXPECT_THROW(bad(R"([{"role":"developer","content":""}])"), fathom::error);
    EXPECT_THROW(bad(R"([{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}])"), fathom::error);
    EXPECT_THROW(bad(R"([{"role":"user","content":"x","task":"title"}])"), fathom::error);
    EXPECT_THROW(bad(R"([{"role":"assistant","content":"","tool_calls":[{"id":"c","function":{"name":"f","arguments":"[1]"}}]}])"),
                 fathom::error);
    EXPECT_THROW(bad(R"([{"role":"assistant","content":"","tool_calls":[{"id":"c","function":{"arguments":"{}"}}]}])"),
                 fathom::error);
    EXPECT_THROW(bad(R"({"role":"user"})"), fathom::error);
    EXPECT_THROW(bad(R"([{"role":"user","content":[{"type":5}]}])"), fathom::error);
    EXPECT_THROW(bad(R"([{"role":"system","content":"s","tools":{}}])"), fathom::error);
    try {
        bad(R"([{"role":"user","content":"ok"},{"role":"robot"}])");
        FAIL();
    } catch (const fathom::error &e) {
        EXPECT_EQ(std::string(e.what()), "ds4 chat: message 1: unknown role 'robot'");
    }
}

TEST(Ds4Render, GenerationPrefix) {
    EXPECT_EQ(d::generation_prefix(true), AST "<think>");
    EXPECT_EQ(d::generation_prefix(false), AST "</think>");
}
