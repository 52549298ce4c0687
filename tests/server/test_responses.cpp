// The Responses API (docs/server.md "Responses API"): input items -> chat messages
// (responses_api.h), request validation, the response store's bounds (response_store.h), and the
// endpoint end to end with the fake engine (fake_engine.h: the chat template is "[role]content\n" per
// message plus "[assistant]\x02" (thinking: "[assistant]<think>\x02"); the model echoes the last user
// message byte by byte, then ends). Every expectation is written by hand from those rules and from
// the event sequence OpenAI documents for streamed responses.
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <thread>

#include "engine/fake_engine.h"
#include "fake_http.h"
#include "server/api.h"
#include "server/http_server.h"
#include "server/response_store.h"
#include "server/responses_api.h"

using namespace fathom;
using json = nlohmann::json;

namespace {

// The param of the 400 a request gets ("" when it is accepted).
std::string bad_param(const json &body) {
    try {
        server::parse_responses_request(body);
    } catch (const server::api_error &e) {
        EXPECT_EQ(e.status, 400);
        return e.param;
    }
    return "";
}

json items(const json &input) { return server::parse_responses_request({{"input", input}}).input_items; }

}  // namespace

// ---- input items -> chat messages ----

TEST(ResponsesItems, StringInputIsOneUserMessage) {
    const json msgs = server::items_to_messages(items("hello"), "");
    EXPECT_EQ(msgs, json::parse(R"([{"role": "user", "content": "hello"}])"));
}

TEST(ResponsesItems, InstructionsComeFirstAndPartsJoin) {
    const json in = json::parse(R"([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}, {"type": "refusal", "refusal": "d"}]},
        {"role": "system", "content": "S"}])");
    const json msgs = server::items_to_messages(items(in), "Instr");
    EXPECT_EQ(msgs, json::parse(R"([{"role": "system", "content": "Instr"}, {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}, {"role": "system", "content": "S"}])"));
}

// An output turn sent back: reasoning, message, two calls -> one assistant message with both calls;
// the outputs -> tool messages; a call with no assistant message before it gets one (content null).
TEST(ResponsesItems, CallsJoinTheirAssistantTurn) {
    const json in = json::parse(R"([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "tw"}, {"type": "input_text", "text": "o"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "three"}])");
    const json msgs = server::items_to_messages(items(in), "");
    EXPECT_EQ(msgs, json::parse(R"([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "three"}])"));
}

TEST(ResponsesItems, FlatToolsBecomeChatTools) {
    const auto r = server::parse_responses_request(json::parse(R"({"input": "x",
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}},
                  {"type": "function", "name": "now", "strict": true}],
        "tool_choice": {"type": "function", "name": "now"}, "reasoning": {"effort": "high"}, "max_output_tokens": 9})"));
    EXPECT_EQ(r.chat["tools"], json::parse(R"([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "now"}}])"));
    EXPECT_EQ(r.chat["tool_choice"], json::parse(R"({"type": "function", "function": {"name": "now"}})"));
    EXPECT_EQ(r.chat["reasoning_effort"], "high");
    EXPECT_EQ(r.chat["max_tokens"], 9);
    EXPECT_EQ(r.tools[1], json::parse(R"({"type": "function", "name": "now", "parameters": null, "strict": true})"));
}

TEST(ResponsesItems, CallOutputNeedsItsCall) {
    const json in = items(json::parse(R"([{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "ok"},
        {"type": "function_call_output", "call_id": "b", "output": "?"}])"));
    try {
        server::check_call_outputs(in, 0);
        FAIL() << "accepted an output without its call";
    } catch (const server::api_error &e) {
        EXPECT_EQ(e.param, "input[2].call_id");
    }
    // After a stored history of 2 items, the request's own items count from 0.
    json with_history = json::array({in[0], in[1], in[2]});
    try {
        server::check_call_outputs(with_history, 2);
        FAIL();
    } catch (const server::api_error &e) {
        EXPECT_EQ(e.param, "input[0].call_id");
    }
    EXPECT_NO_THROW(server::check_call_outputs(json::array({in[0], in[1]}), 0));
}

TEST(ResponsesItems, BadInputNamesTheField) {
    EXPECT_EQ(bad_param({{"input", json::array({{{"role", "user"}, {"content", "a"}}, {{"type", "item_reference"}, {"id", "x"}}})}}),
              "input[1].type");
    EXPECT_EQ(bad_param({{"input", json::array({{{"type", "function_call"}, {"name", "f"}, {"arguments", "{}"}}})}}),
              "input[0].call_id");
    EXPECT_EQ(bad_param({{"input", json::array({{{"type", "function_call"}, {"call_id", "c"}, {"name", "f"}, {"arguments", json::object()}}})}}),
              "input[0].arguments");
    EXPECT_EQ(bad_param({{"input", json::array({{{"type", "function_call_output"}, {"call_id", "c"}}})}}), "input[0].output");
    EXPECT_EQ(bad_param(json::parse(R"({"input": [{"type": "function_call_output", "call_id": "c",
                                                  "output": [{"type": "input_file", "file_id": "f"}]}]})")),
              "input[0].output[0].type");
    EXPECT_EQ(bad_param(json::parse(R"({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]})")),
              "input[0].content[0].type");
    EXPECT_EQ(bad_param(json::parse(R"({"input": [{"role": "tool", "content": "x"}]})")), "input[0].role");
    EXPECT_EQ(bad_param(json::parse(R"({"input": [{"role": "user"}]})")), "input[0].content");
    EXPECT_EQ(bad_param(json::parse(R"({"input": [{"type": "reasoning", "summary": "s"}]})")), "input[0].summary");
    EXPECT_EQ(bad_param(json::parse(R"({"input": [3]})")), "input[0]");
    EXPECT_EQ(bad_param(json::parse(R"({"input": 3})")), "input");
    EXPECT_EQ(bad_param(json::parse(R"({})")), "input");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "tools": [{"type": "web_search"}]})")), "tools[0].type");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "tools": [{"type": "function"}]})")), "tools[0].name");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 1}]})")),
              "tools[0].parameters");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "tool_choice": "sometimes"})")), "tool_choice");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "tool_choice": {"type": "allowed_tools"}})")), "tool_choice.type");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "reasoning": {"effort": "huge"}})")), "reasoning.effort");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "max_output_tokens": 0})")), "max_output_tokens");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "text": {"format": {"type": "yaml"}}})")), "text.format.type");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "metadata": {"k": 1}})")), "metadata");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "truncation": "auto"})")), "truncation");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "background": true})")), "background");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "previous_response_id": ""})")), "previous_response_id");
    EXPECT_EQ(bad_param(json::parse(R"({"input": "x", "stream": "yes"})")), "stream");
    EXPECT_EQ(bad_param(json::parse(R"({"previous_response_id": "resp_1"})")), "");  // input optional then
}

// Every field of a request and of each item kind set to values of every JSON type: the parser either
// accepts the body or throws api_error 400 (no other exception, no crash), and what it accepts converts.
TEST(ResponsesItems, OddValuesAreAcceptedOr400) {
    const json odd = json::parse(R"([null, 0, -1, 1.5, 18446744073709551615, "", "x", true, [], [1], [null], {},
        {"type": 1}, {"type": "function", "name": "f"}, [{"type": "input_text"}], [{"type": "input_text", "text": 1}],
        [{"role": "user", "content": "a"}]])");
    const json base = json::parse(R"({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
        {"type": "reasoning", "summary": [], "content": []}],
        "tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": "auto",
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}}, "metadata": {"k": "v"}})");
    size_t accepted = 0, refused = 0;
    auto run = [&](const json &body) {
        try {
            const auto r = server::parse_responses_request(body);
            server::check_call_outputs(r.input_items, 0);
            server::items_to_messages(r.input_items, r.instructions);
            ++accepted;
        } catch (const server::api_error &e) {
            EXPECT_EQ(e.status, 400) << body.dump();
            ++refused;
        } catch (const std::exception &e) {
            ADD_FAILURE() << e.what() << " for " << body.dump();
        }
    };
    for (const char *key : {"input", "instructions", "tools", "tool_choice", "reasoning", "text", "metadata",
                            "max_output_tokens", "previous_response_id", "stream", "store", "parallel_tool_calls",
                            "include", "truncation", "stream_options", "background"})
        for (const json &v : odd) {
            json b = base;
            b[key] = v;
            run(b);
        }
    for (size_t i = 0; i < base["input"].size(); ++i)
        for (const auto &[key, _] : base["input"][i].items())
            for (const json &v : odd) {
                json b = base;
                b["input"][i][key] = v;
                run(b);
            }
    for (const char *path : {"/tools/0/name", "/tools/0/parameters", "/reasoning/effort", "/text/format/type",
                             "/input/0/content/0/type", "/input/0/content/0/text"})
        for (const json &v : odd) {
            json b = base;
            b[json::json_pointer(path)] = v;
            run(b);
        }
    EXPECT_GT(accepted, 10u);
    EXPECT_GT(refused, 100u);
}

// ---- the store ----

namespace {
// An entry whose size is easy to count: the response is a string of n 'x' (n + 2 JSON bytes), the
// history an empty array (2 bytes): id bytes + n + 4 in all.
server::stored_response entry(size_t n) { return {json(std::string(n, 'x')), json::array()}; }
}  // namespace

TEST(ResponseStore, CountBoundEvictsLeastRecentlyUsed) {
    server::response_store st(2, 1 << 20);
    EXPECT_TRUE(st.put("a", entry(1)));
    EXPECT_TRUE(st.put("b", entry(1)));
    ASSERT_TRUE(st.get("a"));  // a is now more recent than b
    EXPECT_TRUE(st.put("c", entry(1)));
    EXPECT_TRUE(st.get("a"));
    EXPECT_FALSE(st.get("b"));
    EXPECT_TRUE(st.get("c"));
    EXPECT_EQ(st.size(), 2u);
    EXPECT_EQ(st.evictions(), 1u);
}

TEST(ResponseStore, ByteBound) {
    // 1-byte ids: entry(n) costs n + 5 bytes. Bound 30: 10 + 10 fit (15 + 15), a third evicts the oldest.
    server::response_store st(100, 30);
    EXPECT_TRUE(st.put("a", entry(10)));
    EXPECT_TRUE(st.put("b", entry(10)));
    EXPECT_EQ(st.bytes(), 30u);
    EXPECT_TRUE(st.put("c", entry(0)));  // 5 bytes: a (oldest) goes
    EXPECT_FALSE(st.get("a"));
    EXPECT_EQ(st.bytes(), 20u);
    EXPECT_TRUE(st.put("d", entry(21)));  // 26 bytes: b goes (5 + 26 > 30 still), then c
    EXPECT_EQ(st.size(), 1u);
    EXPECT_EQ(st.bytes(), 26u);
    EXPECT_FALSE(st.put("e", entry(26)));  // 31 > 30: never kept, nothing evicted for it
    EXPECT_TRUE(st.get("d"));
    EXPECT_FALSE(st.get("e"));
    // Replacing an id frees its old bytes first.
    EXPECT_TRUE(st.put("d", entry(1)));
    EXPECT_EQ(st.bytes(), 6u);
    EXPECT_TRUE(st.erase("d"));
    EXPECT_FALSE(st.erase("d"));
    EXPECT_EQ(st.bytes(), 0u);
    server::response_store none(0, 30);
    EXPECT_FALSE(none.put("a", entry(1)));
}

// ---- the endpoint, with the fake engine ----

namespace {

struct responses_server : test::fake_http {
    static sched::scheduler_options sopts() {
        sched::scheduler_options o;
        o.n_slots = 1;
        return o;
    }
    static server::server_options hopts(size_t max_entries) {
        server::server_options o;
        o.responses_max_entries = max_entries;
        return o;
    }
    explicit responses_server(size_t max_entries = 16) : fake_http(4096, 0, sopts(), hopts(max_entries)) {}
    httplib::Result post(const json &body) const {
        return client().Post("/v1/responses", body.dump(), "application/json");
    }
    json ok(const json &body) const {
        auto r = post(body);
        EXPECT_TRUE(r);
        if (!r) return {};
        EXPECT_EQ(r->status, 200) << r->body;
        return json::parse(r->body, nullptr, false);
    }
    json fails(const json &body, int status) const {
        auto r = post(body);
        EXPECT_TRUE(r);
        if (!r) return {};
        EXPECT_EQ(r->status, status) << r->body;
        return json::parse(r->body, nullptr, false)["error"];
    }
};

// SSE body -> (event name, data) frames.
std::vector<std::pair<std::string, json>> frames(const std::string &body) {
    std::vector<std::pair<std::string, json>> out;
    for (size_t pos = 0; pos < body.size();) {
        const size_t end = body.find("\n\n", pos);
        if (end == std::string::npos) break;
        const std::string f = body.substr(pos, end - pos);
        pos = end + 2;
        const size_t nl = f.find('\n');
        EXPECT_EQ(f.rfind("event: ", 0), 0u) << f;
        EXPECT_EQ(f.compare(nl + 1, 6, "data: "), 0) << f;
        out.emplace_back(f.substr(7, nl - 7), json::parse(f.substr(nl + 7)));
    }
    return out;
}

}  // namespace

// "hello" echoed: one message item; usage counted by hand: the prompt is BOS + "[user]hello\n[assistant]\x02"
// = 1 + 12 + 12 = 25 tokens, the output 5 tokens (the end-of-generation token is not counted).
TEST(ResponsesHttp, MessageOutputAndUsage) {
    responses_server s;
    const json r = s.ok({{"input", "hello"}, {"temperature", 0}, {"metadata", {{"k", "v"}}}});
    EXPECT_EQ(r["object"], "response");
    EXPECT_EQ(r["id"].get<std::string>().rfind("resp_", 0), 0u);
    EXPECT_EQ(r["status"], "completed");
    EXPECT_EQ(r["model"], "fake-model");
    EXPECT_EQ(r["metadata"], json({{"k", "v"}}));
    ASSERT_EQ(r["output"].size(), 1u);
    const json &m = r["output"][0];
    EXPECT_EQ(m["type"], "message");
    EXPECT_EQ(m["role"], "assistant");
    EXPECT_EQ(m["status"], "completed");
    EXPECT_EQ(m["content"], json::parse(R"([{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}])"));
    EXPECT_EQ(r["usage"]["input_tokens"], 25);
    EXPECT_EQ(r["usage"]["output_tokens"], 5);
    EXPECT_EQ(r["usage"]["total_tokens"], 30);
    EXPECT_EQ(r["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
    // The count endpoint: the same 25 tokens, nothing generated.
    const int64_t before = s.eng.evaluated;
    httplib::Client c("127.0.0.1", s.port);
    auto n = c.Post("/v1/responses/input_tokens", json({{"input", "hello"}}).dump(), "application/json");
    ASSERT_TRUE(n);
    EXPECT_EQ(json::parse(n->body), json({{"object", "response.input_tokens"}, {"input_tokens", 25}}));
    EXPECT_EQ(s.eng.evaluated, before);
    n = c.Post("/v1/responses/input_tokens", json({{"input", json::array({{{"type", "x"}}})}}).dump(), "application/json");
    EXPECT_EQ(n->status, 400);
}

// max_output_tokens 3 of "hello": status incomplete, the message "hel" incomplete.
TEST(ResponsesHttp, MaxOutputTokensIsIncomplete) {
    responses_server s;
    const json r = s.ok({{"input", "hello"}, {"max_output_tokens", 3}});
    EXPECT_EQ(r["status"], "incomplete");
    EXPECT_EQ(r["incomplete_details"], json({{"reason", "max_output_tokens"}}));
    EXPECT_EQ(r["output"][0]["status"], "incomplete");
    EXPECT_EQ(r["output"][0]["content"][0]["text"], "hel");
}

// Thinking on: "ab</think>cd" echoed after "[assistant]<think>\x02" is reasoning "ab", answer "cd".
// The stream is the documented sequence, sequence numbers 0, 1, 2, ...
TEST(ResponsesHttp, ReasoningStream) {
    responses_server s;
    auto res = s.post({{"input", "ab</think>cd"}, {"reasoning", {{"effort", "low"}}}, {"stream", true}});
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200);
    const auto fs = frames(res->body);
    std::vector<std::string> names;
    std::string reasoning, text;
    for (size_t i = 0; i < fs.size(); ++i) {
        EXPECT_EQ(fs[i].second["sequence_number"], i);
        EXPECT_EQ(fs[i].second["type"], fs[i].first);
        if (names.empty() || names.back() != fs[i].first) names.push_back(fs[i].first);  // runs of deltas once
        if (fs[i].first == "response.reasoning_text.delta") reasoning += fs[i].second["delta"].get<std::string>();
        if (fs[i].first == "response.output_text.delta") text += fs[i].second["delta"].get<std::string>();
    }
    const std::vector<std::string> expected = {
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"};
    EXPECT_EQ(names, expected);
    EXPECT_EQ(reasoning, "ab");
    EXPECT_EQ(text, "cd");
    const json &done = fs.back().second["response"];
    EXPECT_EQ(done["status"], "completed");
    ASSERT_EQ(done["output"].size(), 2u);
    EXPECT_EQ(done["output"][0]["type"], "reasoning");
    EXPECT_EQ(done["output"][0]["content"], json::parse(R"([{"type": "reasoning_text", "text": "ab"}])"));
    EXPECT_EQ(done["output"][1]["content"][0]["text"], "cd");
    EXPECT_EQ(fs[2].second["output_index"], 0);
    EXPECT_EQ(fs[2].second["item"]["id"], done["output"][0]["id"]);
    // Reasoning tokens: "<think>" is in the prompt here, so the reasoning is "ab</think>": 10 tokens.
    EXPECT_EQ(done["usage"]["output_tokens_details"]["reasoning_tokens"], 10);
    EXPECT_EQ(done["usage"]["output_tokens"], 12);
    // The JSON form of the same request is the same object (but for ids and times).
    const json r = s.ok({{"input", "ab</think>cd"}, {"reasoning", {{"effort", "low"}}}});
    EXPECT_EQ(r["output"][0]["content"], done["output"][0]["content"]);
    EXPECT_EQ(r["output"][1]["content"], done["output"][1]["content"]);
    EXPECT_EQ(r["usage"]["output_tokens_details"], done["usage"]["output_tokens_details"]);
}

// A call in the Hermes format echoed back is a function_call item; the stream carries its arguments.
TEST(ResponsesHttp, FunctionCallItem) {
    responses_server s;
    const std::string call = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";  // echoed up to a newline
    const json tools = json::parse(R"([{"type": "function", "name": "f", "parameters": {"type": "object"}}])");
    const json r = s.ok({{"input", call}, {"tools", tools}});
    ASSERT_EQ(r["output"].size(), 1u) << r.dump();
    const json &fc = r["output"][0];
    EXPECT_EQ(fc["type"], "function_call");
    EXPECT_EQ(fc["name"], "f");
    EXPECT_EQ(fc["arguments"], "{\"a\":1}");
    EXPECT_EQ(fc["status"], "completed");
    EXPECT_EQ(fc["call_id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(fc["id"].get<std::string>().rfind("fc_", 0), 0u);
    EXPECT_EQ(r["tools"][0]["name"], "f");

    auto res = s.post({{"input", call}, {"tools", tools}, {"stream", true}});
    ASSERT_TRUE(res);
    const auto fs = frames(res->body);
    std::vector<std::string> names;
    for (const auto &f : fs) names.push_back(f.first);
    const std::vector<std::string> expected = {"response.created", "response.in_progress", "response.output_item.added",
                                               "response.function_call_arguments.delta",
                                               "response.function_call_arguments.done", "response.output_item.done",
                                               "response.completed"};
    EXPECT_EQ(names, expected);
    EXPECT_EQ(fs[3].second["delta"], "{\"a\":1}");
    EXPECT_EQ(fs[4].second["arguments"], "{\"a\":1}");
    EXPECT_EQ(fs[2].second["item"]["arguments"], "");
    EXPECT_EQ(fs[5].second["item"]["call_id"], fs[2].second["item"]["call_id"]);
}

// Several calls: all kept, or only the first with parallel_tool_calls false. Whitespace before a call
// opens no message item (streamed or not); text beside calls is a message item before them.
TEST(ResponsesHttp, ParallelCallsAndText) {
    responses_server s;
    const std::string two = " <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
                            "<tool_call>{\"name\": \"g\", \"arguments\": {\"b\": 2}}</tool_call>";
    const json tools = json::parse(R"([{"type": "function", "name": "f"}, {"type": "function", "name": "g"}])");
    json r = s.ok({{"input", two}, {"tools", tools}});
    ASSERT_EQ(r["output"].size(), 2u) << r.dump();
    EXPECT_EQ(r["output"][0]["name"], "f");
    EXPECT_EQ(r["output"][1]["name"], "g");
    EXPECT_EQ(r["output"][1]["arguments"], "{\"b\":2}");
    EXPECT_NE(r["output"][0]["call_id"], r["output"][1]["call_id"]);
    r = s.ok({{"input", two}, {"tools", tools}, {"parallel_tool_calls", false}});
    ASSERT_EQ(r["output"].size(), 1u);
    EXPECT_EQ(r["output"][0]["name"], "f");
    EXPECT_EQ(r["parallel_tool_calls"], false);
    auto res = s.post({{"input", two}, {"tools", tools}, {"stream", true}});
    ASSERT_TRUE(res);
    const auto fs = frames(res->body);
    const json &done = fs.back().second["response"];
    ASSERT_EQ(done["output"].size(), 2u);
    EXPECT_EQ(done["output"][0]["type"], "function_call");
    // Text and a call: the message (trimmed) comes first.
    r = s.ok({{"input", "Sure. <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"}, {"tools", tools}});
    ASSERT_EQ(r["output"].size(), 2u);
    EXPECT_EQ(r["output"][0]["content"][0]["text"], "Sure.");
    EXPECT_EQ(r["output"][1]["type"], "function_call");
}

// max_output_tokens inside the thinking block: only the reasoning item, incomplete.
TEST(ResponsesHttp, CutWhileThinking) {
    responses_server s;
    const json r = s.ok({{"input", "abcdef"}, {"reasoning", {{"effort", "high"}}}, {"max_output_tokens", 3}});
    EXPECT_EQ(r["status"], "incomplete");
    ASSERT_EQ(r["output"].size(), 1u) << r.dump();
    EXPECT_EQ(r["output"][0]["type"], "reasoning");
    EXPECT_EQ(r["output"][0]["status"], "incomplete");
    EXPECT_EQ(r["output"][0]["content"][0]["text"], "abc");
    EXPECT_EQ(r["usage"]["output_tokens_details"]["reasoning_tokens"], 3);
}

// A forced call the model does not complete (its arguments are grammar-constrained, so only the token
// limit can cut it): 500 as JSON, response.failed when streaming (after the created / in_progress
// events), and nothing stored.
TEST(ResponsesHttp, FailedForcedCall) {
    responses_server s;
    const json tools = json::parse(R"([{"type": "function", "name": "f"}])");
    const json body = {{"input", "no call here"}, {"tools", tools}, {"tool_choice", "required"}, {"max_output_tokens", 3}};
    const json e = s.fails(body, 500);
    EXPECT_EQ(e["type"], "server_error");
    json sb = body;
    sb["stream"] = true;
    auto res = s.post(sb);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    const auto fs = frames(res->body);
    ASSERT_GE(fs.size(), 3u);
    EXPECT_EQ(fs.front().first, "response.created");
    EXPECT_EQ(fs.back().first, "response.failed");
    EXPECT_EQ(fs.back().second["response"]["status"], "failed");
    EXPECT_EQ(fs.back().second["response"]["error"]["code"], "server_error");
    const std::string id = fs.back().second["response"]["id"];
    httplib::Client c("127.0.0.1", s.port);
    EXPECT_EQ(c.Get(("/v1/responses/" + id).c_str())->status, 404);
}

// previous_response_id: the second prompt is the first conversation plus the new input, and reuses
// it. Turn 1: BOS "[user]q1\n[assistant]\x02" (1 + 9 + 12 = 22 tokens) -> "q1". Turn 2 renders
// "[user]q1\n[assistant]\x02q1\n[user]q2\n[assistant]\x02": 1 + 9 + 12 + 3 + 9 + 12 = 46 tokens, of which
// the session holds BOS through "\x02q1" (24 tokens) from turn 1.
TEST(ResponsesHttp, PreviousResponseContinues) {
    responses_server s;
    const json r1 = s.ok({{"input", "q1"}});
    EXPECT_EQ(r1["usage"]["input_tokens"], 22);
    const json r2 = s.ok({{"input", "q2"}, {"previous_response_id", r1["id"]}});
    EXPECT_EQ(r2["usage"]["input_tokens"], 46);
    EXPECT_EQ(r2["usage"]["input_tokens_details"]["cached_tokens"], 24);
    EXPECT_EQ(r2["previous_response_id"], r1["id"]);
    EXPECT_EQ(r2["output"][0]["content"][0]["text"], "q2");
    // Instructions are not carried over: "[system]S\n" (10 tokens) only where given.
    const json r3 = s.ok({{"input", "q3"}, {"instructions", "S"}, {"previous_response_id", r2["id"]}});
    EXPECT_EQ(r3["usage"]["input_tokens"], 46 + 3 + 9 + 12 + 10);
    const json r4 = s.ok({{"input", "q4"}, {"previous_response_id", r3["id"]}});
    EXPECT_EQ(r4["usage"]["input_tokens"], 46 + 3 + 9 + 12 + 3 + 9 + 12);
    httplib::Client c("127.0.0.1", s.port);
    // The input items of turn 2: its whole conversation before its output, newest first by default.
    const std::string items2 = "/v1/responses/" + r2["id"].get<std::string>() + "/input_items";
    auto li = c.Get(items2.c_str());
    ASSERT_TRUE(li);
    ASSERT_EQ(li->status, 200) << li->body;
    json l = json::parse(li->body);
    ASSERT_EQ(l["data"].size(), 3u);
    EXPECT_EQ(l["object"], "list");
    EXPECT_EQ(l["has_more"], false);
    EXPECT_EQ(l["data"][0]["content"], json::parse(R"([{"type": "input_text", "text": "q2"}])"));
    EXPECT_EQ(l["data"][1], r1["output"][0]);  // turn 1's message item, as returned
    EXPECT_EQ(l["data"][2]["role"], "user");
    EXPECT_EQ(l["data"][2]["status"], "completed");
    EXPECT_EQ(l["first_id"], l["data"][0]["id"]);
    EXPECT_EQ(l["last_id"], l["data"][2]["id"]);
    // Ascending, two at a time.
    l = json::parse(c.Get((items2 + "?order=asc&limit=2").c_str())->body);
    ASSERT_EQ(l["data"].size(), 2u);
    EXPECT_EQ(l["data"][0]["content"][0]["text"], "q1");
    EXPECT_EQ(l["has_more"], true);
    l = json::parse(c.Get((items2 + "?order=asc&limit=2&after=" + l["last_id"].get<std::string>()).c_str())->body);
    ASSERT_EQ(l["data"].size(), 1u);
    EXPECT_EQ(l["data"][0]["content"][0]["text"], "q2");
    EXPECT_EQ(l["has_more"], false);
    EXPECT_EQ(c.Get((items2 + "?limit=0").c_str())->status, 400);
    EXPECT_EQ(c.Get((items2 + "?order=up").c_str())->status, 400);
    EXPECT_EQ(c.Get((items2 + "?after=nope").c_str())->status, 400);
    EXPECT_EQ(c.Get("/v1/responses/resp_unknown/input_items")->status, 404);
    // A client's own item ids are kept.
    const json r6 = s.ok({{"input", json::array({{{"role", "user"}, {"content", "x"}, {"id", "msg_mine"}}})}});
    l = json::parse(c.Get(("/v1/responses/" + r6["id"].get<std::string>() + "/input_items").c_str())->body);
    EXPECT_EQ(l["data"][0]["id"], "msg_mine");
    // GET returns the stored object; DELETE removes it; then it is unknown everywhere.
    auto g = c.Get(("/v1/responses/" + r1["id"].get<std::string>()).c_str());
    ASSERT_TRUE(g);
    EXPECT_EQ(g->status, 200);
    EXPECT_EQ(json::parse(g->body), r1);
    auto d = c.Delete(("/v1/responses/" + r1["id"].get<std::string>()).c_str());
    ASSERT_TRUE(d);
    EXPECT_EQ(d->status, 200);
    EXPECT_EQ(json::parse(d->body), json({{"id", r1["id"]}, {"object", "response"}, {"deleted", true}}));
    g = c.Get(("/v1/responses/" + r1["id"].get<std::string>()).c_str());
    EXPECT_EQ(g->status, 404);
    const json e = s.fails({{"input", "q"}, {"previous_response_id", r1["id"]}}, 400);
    EXPECT_EQ(e["code"], "previous_response_not_found");
    EXPECT_EQ(e["param"], "previous_response_id");
    EXPECT_EQ(e["type"], "invalid_request_error");
    // store: false keeps nothing.
    const json r5 = s.ok({{"input", "q5"}, {"store", false}});
    EXPECT_EQ(s.fails({{"input", "q"}, {"previous_response_id", r5["id"]}}, 400)["code"], "previous_response_not_found");
}

// The store's count bound over HTTP: with room for 2, the first of three responses is evicted.
TEST(ResponsesHttp, EvictedIdIsNotFound) {
    responses_server s(2);
    const json a = s.ok({{"input", "a"}}), b = s.ok({{"input", "b"}}), c = s.ok({{"input", "c"}});
    EXPECT_EQ(s.fails({{"input", "x"}, {"previous_response_id", a["id"]}}, 400)["code"], "previous_response_not_found");
    s.ok({{"input", "x"}, {"previous_response_id", c["id"]}});
}

// Bad input: 400 naming the field, nothing generated, the server keeps serving.
TEST(ResponsesHttp, BadInputIs400) {
    responses_server s;
    const int64_t before = s.eng.evaluated;
    EXPECT_EQ(s.fails({{"input", json::array({{{"type", "computer_call"}}})}}, 400)["param"], "input[0].type");
    const json tools = json::parse(R"([{"type": "function", "name": "f"}])");
    EXPECT_EQ(s.fails({{"input", "x"}, {"tools", tools}, {"tool_choice", {{"type", "function"}, {"name", "g"}}}}, 400)["param"],
              "tool_choice");
    EXPECT_EQ(s.fails({{"input", json::array({{{"type", "function_call_output"}, {"call_id", "nope"}, {"output", "x"}}})}}, 400)["param"],
              "input[0].call_id");
    EXPECT_EQ(s.fails({{"input", "x"}, {"model", "other"}}, 404)["param"], "model");
    EXPECT_EQ(s.fails({{"input", json::array()}}, 400)["param"], "input");
    // An error of the chat parser names the Responses field (a schema that is no object: refused with or
    // without structured output support).
    const json e = s.fails({{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}, {"name", "n"}, {"schema", 5}}}}}}, 400);
    EXPECT_EQ(e["param"].get<std::string>().rfind("text.format", 0), 0u) << e.dump();
    EXPECT_EQ(e["message"].get<std::string>().find("response_format"), std::string::npos) << e.dump();
    EXPECT_EQ(s.eng.evaluated, before);
    httplib::Client c("127.0.0.1", s.port);
    EXPECT_EQ(c.Get("/v1/responses/resp_unknown")->status, 404);
    EXPECT_EQ(c.Delete("/v1/responses/resp_unknown")->status, 404);
    s.ok({{"input", "still serving"}});
}
