// Request parsing and validation (OpenAI chat/completions, Anthropic messages): accepted shapes
// map to the right fields, and every malformed field is a 400 naming the parameter.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/api.h"
#include "server/structured.h"

using namespace fathom::server;
using json = nlohmann::json;

namespace {

fathom::sampling_params defaults() { return {}; }

gen_request chat(const json &b) {
    auto f = make_tool_format("hermes");
    return parse_openai_chat(b, defaults(), *f);
}
gen_request anth(const json &b) {
    auto f = make_tool_format("hermes");
    return parse_anthropic(b, defaults(), *f, false);
}

// Runs fn, expects an api_error with `status` whose param equals `param` and message contains `needle`.
template <class F>
void expect_error(F &&fn, int status, const std::string &param, const std::string &needle) {
    try {
        fn();
        ADD_FAILURE() << "no error (expected " << needle << ")";
    } catch (const api_error &e) {
        EXPECT_EQ(e.status, status);
        EXPECT_EQ(e.param, param) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

json user_msgs(const std::string &text) { return json::array({{{"role", "user"}, {"content", text}}}); }

}  // namespace

TEST(Api, MinimalChat) {
    auto r = chat({{"model", "m"}, {"messages", user_msgs("hi")}});
    ASSERT_EQ(r.messages.size(), 1u);
    EXPECT_EQ(r.messages[0].role, "user");
    EXPECT_EQ(r.messages[0].content, "hi");
    EXPECT_EQ(r.model, "m");
    EXPECT_FALSE(r.stream);
    EXPECT_EQ(r.max_tokens, -1);
    EXPECT_FLOAT_EQ(r.sampling.temperature, defaults().temperature);
}

TEST(Api, ContentPartsAndSampling) {
    json msgs = json::array({{{"role", "system"}, {"content", "be brief"}},
                             {{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "a"}},
                                                                         {{"type", "text"}, {"text", "b"}}})}}});
    auto r = chat({{"messages", msgs}, {"temperature", 0}, {"top_p", 0.5}, {"top_k", 7}, {"min_p", 0.1},
                   {"seed", 42}, {"frequency_penalty", 0.5}, {"presence_penalty", -0.5}, {"repetition_penalty", 1.1},
                   {"max_completion_tokens", 9}, {"max_tokens", 100}, {"stop", "END"}, {"stream", true},
                   {"stream_options", {{"include_usage", true}}}, {"logprobs", true}, {"top_logprobs", 3}});
    ASSERT_EQ(r.messages.size(), 2u);
    EXPECT_EQ(r.messages[1].content, "ab");
    EXPECT_EQ(r.sampling.temperature, 0.0f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.5f);
    EXPECT_EQ(r.sampling.top_k, 7);
    EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
    EXPECT_EQ(r.sampling.seed, 42u);
    EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, 0.5f);
    EXPECT_FLOAT_EQ(r.sampling.presence_penalty, -0.5f);
    EXPECT_FLOAT_EQ(r.sampling.repeat_penalty, 1.1f);
    EXPECT_EQ(r.max_tokens, 9);  // max_completion_tokens wins
    EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
    EXPECT_TRUE(r.stream);
    EXPECT_TRUE(r.include_usage);
    EXPECT_TRUE(r.logprobs);
    EXPECT_EQ(r.sampling.n_logprobs, 3);
}

TEST(Api, ChatValidationErrors) {
    expect_error([] { chat({{"messages", user_msgs("x")}, {"temperature", -1}}); }, 400, "temperature", "between");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"temperature", "hot"}}); }, 400, "temperature", "must be a number");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"top_p", 0}}); }, 400, "top_p", "> 0");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"n", 2}}); }, 400, "n", "must be 1");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"stop", 5}}); }, 400, "stop", "string or a list");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"stop", json::array({""})}}); }, 400, "stop", "empty");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"max_tokens", 0}}); }, 400, "max_tokens", "between");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"max_tokens", 1.5}}); }, 400, "max_tokens", "integer");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"top_logprobs", 2}}); }, 400, "top_logprobs", "requires");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"stream_options", {{"include_usage", true}}}}); }, 400,
                 "stream_options", "only allowed");
    expect_error([] { chat({{"model", "m"}}); }, 400, "messages", "required");
    expect_error([] { chat({{"messages", json::array()}}); }, 400, "messages", "non-empty");
    expect_error([] { chat({{"messages", json::array({{{"role", "wizard"}, {"content", "x"}}})}}); }, 400, "messages",
                 "'wizard'");
    expect_error(
        [] {
            chat({{"messages", json::array({{{"role", "user"},
                                             {"content", json::array({{{"type", "image_url"}, {"image_url", "u"}}})}}})}});
        },
        400, "messages", "image_url");
}

// Structured output fields (docs/server.md "Structured output"); the grammars themselves are test_grammar's.
TEST(Api, ResponseFormat) {
    EXPECT_EQ(chat({{"messages", user_msgs("x")}, {"response_format", {{"type", "text"}}}}).grammar, nullptr);
    EXPECT_NE(chat({{"messages", user_msgs("x")}, {"response_format", {{"type", "json_object"}}}}).grammar, nullptr);
    const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}};
    auto r = chat({{"messages", user_msgs("x")},
                   {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "s_1-x"}, {"schema", schema}, {"strict", true}}}}}});
    ASSERT_NE(r.grammar, nullptr);
    auto rf = [](json f) { return [f] { chat({{"messages", user_msgs("x")}, {"response_format", f}}); }; };
    expect_error(rf({{"type", "xml"}}), 400, "response_format.type", "xml");
    expect_error(rf("json"), 400, "response_format", "object");
    expect_error(rf({{"type", "json_schema"}}), 400, "response_format.json_schema", "json_schema");
    expect_error(rf({{"type", "json_schema"}, {"json_schema", {{"schema", schema}}}}), 400, "response_format.json_schema.name",
                 "required");
    expect_error(rf({{"type", "json_schema"}, {"json_schema", {{"name", "a b"}, {"schema", schema}}}}), 400,
                 "response_format.json_schema.name", "a b");
    expect_error(rf({{"type", "json_schema"}, {"json_schema", {{"name", "n"}, {"schema", schema}, {"strict", "yes"}}}}), 400,
                 "response_format.json_schema.strict", "boolean");
    expect_error(rf({{"type", "json_schema"}, {"json_schema", {{"name", "n"}, {"schema", {{"type", "string"}, {"pattern", "a"}}}}}}),
                 400, "response_format.json_schema.schema", "'pattern'");
    expect_error(rf({{"type", "json_schema"},
                     {"json_schema", {{"name", "n"}, {"schema", {{"properties", {{"x", {{"type", "number"}, {"maximum", 3}}}}}}}}}}),
                 400, "response_format.json_schema.schema", "/properties/x");
    // Anthropic output_format.
    EXPECT_NE(anth({{"model", "m"}, {"max_tokens", 5}, {"messages", user_msgs("x")},
                    {"output_format", {{"type", "json_schema"}, {"schema", schema}}}})
                  .grammar,
              nullptr);
    expect_error([] { anth({{"model", "m"}, {"max_tokens", 5}, {"messages", user_msgs("x")}, {"output_format", {{"type", "json"}}}}); },
                 400, "output_format", "json_schema");
    expect_error([] { anth({{"model", "m"}, {"max_tokens", 5}, {"messages", user_msgs("x")},
                             {"output_format", {{"type", "json_schema"}, {"schema", {{"type", "number"}, {"multipleOf", 2}}}}}}); },
                 400, "output_format.schema", "multipleOf");
}

// DS4's encoder describes a json_schema response format in the system message (docs/ds4-chat-format.md
// item 5): "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" +
// json.dumps(schema); the Hermes format (dense models) leaves the prompt alone.
TEST(Api, ResponseFormatInTheDs4Prompt) {
    const json body = {{"messages", json::array({{{"role", "system"}, {"content", "S"}}, {{"role", "user"}, {"content", "x"}}})},
                       {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "n"}, {"schema", {{"type", "object"},
                        {"properties", {{"b", {{"type", "string"}}}, {"a", {{"enum", {1, "é"}}}}}}}}}}}}};
    auto ds4 = make_tool_format("dsml");
    auto r = parse_openai_chat(body, defaults(), *ds4);
    ASSERT_EQ(r.messages.size(), 2u);
    EXPECT_EQ(r.messages[0].content,
              "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
              "{\"properties\": {\"a\": {\"enum\": [1, \"é\"]}, \"b\": {\"type\": \"string\"}}, \"type\": \"object\"}");
    json no_system = body;
    no_system["messages"].erase(0);
    r = parse_openai_chat(no_system, defaults(), *ds4);
    ASSERT_EQ(r.messages.size(), 2u);
    EXPECT_EQ(r.messages[0].role, "system");
    EXPECT_EQ(r.messages[0].content.rfind("\n\n## Response Format:", 0), 0u);  // as the encoder's new system message
    EXPECT_EQ(chat(body).messages[0].content, "S");
}

// The Responses API's text.format (flattened json_schema fields), for POST /v1/responses.
TEST(Api, ResponsesTextFormat) {
    const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
    EXPECT_EQ(parse_text_format({{"type", "text"}}), nullptr);
    EXPECT_NE(parse_text_format({{"type", "json_object"}}), nullptr);
    EXPECT_NE(parse_text_format({{"type", "json_schema"}, {"name", "n"}, {"schema", schema}, {"strict", true}}), nullptr);
    expect_error([] { parse_text_format({{"type", "yaml"}}); }, 400, "text.format.type", "yaml");
    expect_error([&] { parse_text_format({{"type", "json_schema"}, {"schema", schema}}); }, 400, "text.format.name", "text.format.name");
    expect_error([] { parse_text_format({{"type", "json_schema"}, {"name", "n"}, {"schema", {{"type", "string"}, {"pattern", "x"}}}}); },
                 400, "text.format.schema", "'pattern'");
}

TEST(Api, ForcedCallGrammar) {
    auto fmt = make_tool_format("hermes");  // Hermes: JSON arguments
    const json tools = json::array(
        {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", {{"type", "object"}, {"properties", {{"x", {{"type", "integer"}}}}}}}}}},
         {{"type", "function"}, {"function", {{"name", "g"}}}}});
    tool_choice named{tool_choice::function, "f"}, required{tool_choice::required, ""};
    EXPECT_NE(forced_call_grammar(tools, named, *fmt), nullptr);
    EXPECT_NE(forced_call_grammar(tools, required, *fmt), nullptr);
    json bad = tools;
    bad[1]["function"]["parameters"] = {{"type", "object"}, {"properties", {{"s", {{"type", "string"}, {"pattern", "a"}}}}}};
    expect_error([&] { forced_call_grammar(bad, required, *fmt); }, 400, "tools", "tool 'g'");
    EXPECT_NE(forced_call_grammar(bad, named, *fmt), nullptr);  // only the named tool's schema counts
    auto dsml = make_tool_format("dsml");  // arguments as DSML parameters: not constrained
    EXPECT_EQ(forced_call_grammar(tools, named, *dsml), nullptr);
}

// "speculative": false / true / {"draft_max": N} (docs/server.md "Speculative decoding").
TEST(Api, SpeculativeOverride) {
    EXPECT_EQ(chat({{"messages", user_msgs("x")}}).draft_max, -1);
    EXPECT_EQ(chat({{"messages", user_msgs("x")}, {"speculative", false}}).draft_max, 0);
    EXPECT_EQ(chat({{"messages", user_msgs("x")}, {"speculative", true}}).draft_max, -1);
    EXPECT_EQ(chat({{"messages", user_msgs("x")}, {"speculative", {{"draft_max", 3}}}}).draft_max, 3);
    EXPECT_EQ(chat({{"messages", user_msgs("x")}, {"speculative", {{"draft_max", 0}}}}).draft_max, 0);
    expect_error([] { chat({{"messages", user_msgs("x")}, {"speculative", {{"draft_max", 65}}}}); }, 400, "draft_max",
                 "between");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"speculative", {{"width", 2}}}}); }, 400, "speculative",
                 "only 'draft_max'");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"speculative", "yes"}}); }, 400, "speculative",
                 "boolean");
}

TEST(Api, BodyMustBeJsonObject) {
    expect_error([] { parse_body("not json"); }, 400, "", "not valid JSON");
    expect_error([] { parse_body("[1,2]"); }, 400, "", "JSON object");
    EXPECT_TRUE(parse_body("{\"a\":1}").is_object());
}

TEST(Api, ToolConversationIsRendered) {
    json tools = json::array({{{"type", "function"},
                               {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}});
    json msgs = json::array(
        {{{"role", "system"}, {"content", "sys"}},
         {{"role", "user"}, {"content", "weather?"}},
         {{"role", "assistant"}, {"content", nullptr},
          {"tool_calls", json::array({{{"id", "call_9"}, {"type", "function"},
                                       {"function", {{"name", "get_weather"}, {"arguments", "{\"city\":\"Paris\"}"}}}}})}},
         {{"role", "tool"}, {"tool_call_id", "call_9"}, {"content", "sunny"}},
         {{"role", "tool"}, {"tool_call_id", "call_9"}, {"content", "warm"}}});
    auto r = chat({{"messages", msgs}, {"tools", tools}});
    ASSERT_EQ(r.messages.size(), 4u);  // the two results share one user turn
    EXPECT_EQ(r.messages[0].role, "system");
    EXPECT_EQ(r.messages[0].content.rfind("sys\n\n# Tools", 0), 0u);
    EXPECT_NE(r.messages[0].content.find("get_weather"), std::string::npos);
    EXPECT_EQ(r.messages[2].role, "assistant");
    EXPECT_NE(r.messages[2].content.find("<tool_call>"), std::string::npos);
    EXPECT_NE(r.messages[2].content.find("\"city\":\"Paris\""), std::string::npos);
    EXPECT_EQ(r.messages[3].role, "user");
    EXPECT_EQ(r.messages[3].content, "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>");
    EXPECT_TRUE(r.tools_active());

    auto none = chat({{"messages", user_msgs("x")}, {"tools", tools}, {"tool_choice", "none"}});
    EXPECT_FALSE(none.tools_active());
    ASSERT_EQ(none.messages.size(), 1u);  // no tool prompt injected
    expect_error([&] { chat({{"messages", user_msgs("x")}, {"tools", tools},
                             {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}); },
                 400, "tool_choice", "unknown tool");
    expect_error([] { chat({{"messages", user_msgs("x")}, {"tools", json::array({{{"type", "function"}}})}}); }, 400,
                 "tools", "function");
}

TEST(Api, Completion) {
    auto r = parse_openai_completion({{"prompt", "Once"}, {"logprobs", 2}}, defaults());
    EXPECT_EQ(r.prompt_text, "Once");
    EXPECT_FALSE(r.prompt_is_tokens);
    EXPECT_EQ(r.max_tokens, 16);  // the completions API's default
    EXPECT_TRUE(r.logprobs);
    EXPECT_EQ(r.sampling.n_logprobs, 2);
    r = parse_openai_completion({{"prompt", json::array({json::array({1, 2, 3})})}}, defaults());
    EXPECT_TRUE(r.prompt_is_tokens);
    EXPECT_EQ(r.prompt_tokens, (std::vector<int32_t>{1, 2, 3}));
    expect_error([] { parse_openai_completion({{"prompt", json::array({"a", "b"})}}, defaults()); }, 400, "prompt", "exactly one");
    expect_error([] { parse_openai_completion({{"prompt", "a"}, {"echo", true}}, defaults()); }, 400, "echo", "not supported");
    expect_error([] { parse_openai_completion({{"prompt", json::array({-1})}}, defaults()); }, 400, "prompt", "out of range");
    expect_error([] { parse_openai_completion(json::object(), defaults()); }, 400, "prompt", "required");
}

TEST(Api, Anthropic) {
    json msgs = json::array(
        {{{"role", "user"}, {"content", "weather?"}},
         {{"role", "assistant"},
          {"content", json::array({{{"type", "text"}, {"text", "Checking."}},
                                   {{"type", "tool_use"}, {"id", "toolu_1"}, {"name", "get_weather"},
                                    {"input", {{"city", "Oslo"}}}}})}},
         {{"role", "user"},
          {"content", json::array({{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}, {"content", "cold"}}})}}});
    json tools = json::array({{{"name", "get_weather"}, {"input_schema", {{"type", "object"}}}}});
    auto r = anth({{"model", "m"}, {"max_tokens", 20}, {"system", json::array({{{"type", "text"}, {"text", "S"}}})},
                   {"messages", msgs}, {"tools", tools}, {"tool_choice", {{"type", "any"}}},
                   {"stop_sequences", json::array({"##"})}, {"temperature", 0.5}});
    EXPECT_EQ(r.max_tokens, 20);
    EXPECT_EQ(r.choice.kind, tool_choice::required);
    EXPECT_EQ(r.stop, std::vector<std::string>{"##"});
    ASSERT_EQ(r.messages.size(), 4u);
    EXPECT_EQ(r.messages[0].content.rfind("S\n\n# Tools", 0), 0u);
    EXPECT_NE(r.messages[0].content.find("You must call at least one function"), std::string::npos);
    EXPECT_EQ(r.messages[2].role, "assistant");
    EXPECT_EQ(r.messages[2].content.rfind("Checking.\n<tool_call>", 0), 0u);
    EXPECT_EQ(r.messages[3].content, "<tool_response>\ncold\n</tool_response>");

    expect_error([] { anth({{"model", "m"}, {"messages", user_msgs("x")}}); }, 400, "max_tokens", "required");
    expect_error([] { anth({{"max_tokens", 5}, {"messages", user_msgs("x")}}); }, 400, "model", "required");
    expect_error([] { anth({{"model", "m"}, {"max_tokens", 5}, {"messages", user_msgs("x")}, {"temperature", 1.5}}); }, 400,
                 "temperature", "between");
    expect_error([] { anth({{"model", "m"}, {"max_tokens", 5}, {"messages", json::array({{{"role", "system"}, {"content", "x"}}})}}); },
                 400, "messages", "user or assistant");
    // count_tokens needs no max_tokens
    auto f = make_tool_format("hermes");
    EXPECT_NO_THROW(parse_anthropic({{"model", "m"}, {"messages", user_msgs("x")}}, defaults(), *f, true));
}

// A turn the server generated and parsed comes back in the next request's history as its generated
// bytes (exact replay), in both APIs; a turn the server did not generate is rendered canonically.
TEST(Api, GeneratedToolTurnIsReplayedExactly) {
    auto f = make_tool_format("hermes");
    const std::vector<std::string> known = {"get_weather"};
    const std::string gen = "On it.\n\n<tool_call>\n{\"name\": \"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>";
    const auto p = f->parse(gen, known);
    ASSERT_EQ(p.calls.size(), 1u);
    f->remember_turn(p, gen);
    json tools = json::array({{{"type", "function"}, {"function", {{"name", "get_weather"}}}}});
    auto history = [&](const std::string &id) {
        return json::array({{{"role", "user"}, {"content", "weather?"}},
                            {{"role", "assistant"}, {"content", "On it."},
                             {"tool_calls", json::array({{{"id", id}, {"type", "function"},
                                                          {"function", {{"name", "get_weather"},
                                                                        {"arguments", p.calls[0].arguments}}}}})}},
                            {{"role", "tool"}, {"tool_call_id", id}, {"content", "sunny"}}});
    };
    auto r = parse_openai_chat({{"messages", history(p.calls[0].id)}, {"tools", tools}}, defaults(), *f);
    ASSERT_GE(r.messages.size(), 3u);
    EXPECT_EQ(r.messages[r.messages.size() - 2].content, gen);
    r = parse_openai_chat({{"messages", history("call_unknown")}, {"tools", tools}}, defaults(), *f);
    EXPECT_EQ(r.messages[r.messages.size() - 2].content, "On it.\n" + f->render_calls(p.calls));

    // Anthropic: ids are renamed (toolu_) before they are remembered, as the server does
    auto pa = f->parse(gen, known);
    pa.calls[0].id = "toolu_abc";
    f->remember_turn(pa, gen);
    json am = json::array(
        {{{"role", "user"}, {"content", "weather?"}},
         {{"role", "assistant"},
          {"content", json::array({{{"type", "text"}, {"text", "On it."}},
                                   {{"type", "tool_use"}, {"id", "toolu_abc"}, {"name", "get_weather"},
                                    {"input", {{"city", "Paris"}}}}})}},
         {{"role", "user"}, {"content", json::array({{{"type", "tool_result"}, {"tool_use_id", "toolu_abc"}, {"content", "sunny"}}})}}});
    auto ra = parse_anthropic({{"model", "m"}, {"max_tokens", 8}, {"messages", am}, {"tools", json::array({{{"name", "get_weather"}, {"input_schema", {{"type", "object"}}}}})}}, defaults(), *f, false);
    ASSERT_GE(ra.messages.size(), 3u);
    EXPECT_EQ(ra.messages[ra.messages.size() - 2].content, gen);
}
