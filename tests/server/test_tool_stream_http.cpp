// Streamed tool calls and long-prefill keepalives through the real HTTP server, with the fake engine
// (fake_engine.h) posing as DS4 (architecture "deepseek4": DSML tool format) or a dense model (Hermes).
// The fake echoes the last user message byte by byte, so a test writes the model's output as that
// message and knows every token; expected frames are worked out by hand from the DSML rules
// (docs/ds4-chat-format.md) and the OpenAI / Anthropic streaming formats (docs/server.md).
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "chat/ds4_chat.h"
#include "engine/fake_engine.h"
#include "fake_http.h"
#include "server/api.h"
#include "server/http_server.h"

using namespace fathom;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using namespace std::chrono_literals;

namespace {

struct fake_server : test::fake_http {
    static sched::scheduler_options sopts(int chunk) {
        sched::scheduler_options o;
        o.n_slots = 1;
        o.prefill_chunk = chunk;
        o.step_token_budget = chunk;
        return o;
    }
    explicit fake_server(const std::string &arch, int delay_us = 0, int chunk = 512,
                         server::server_options ho = server::server_options{})
        : fake_http(4096, delay_us, sopts(chunk), std::move(ho), arch) {}
    httplib::Client client() const { return fake_http::client(30); }
    httplib::Result post(const std::string &path, const json &body) const {
        return client().Post(path.c_str(), body.dump(), "application/json");
    }
};

// SSE body -> (event name, data) frames; comment lines (": ...") are collected apart.
struct sse {
    std::vector<std::pair<std::string, std::string>> frames;
    std::vector<std::string> comments;
};
sse parse_sse(const std::string &body) {
    sse out;
    size_t pos = 0;
    while (pos < body.size()) {
        const size_t end = body.find("\n\n", pos);
        EXPECT_NE(end, std::string::npos) << "unterminated SSE frame";
        if (end == std::string::npos) break;
        const std::string frame = body.substr(pos, end - pos);
        pos = end + 2;
        if (frame.rfind(":", 0) == 0) {
            out.comments.push_back(frame.substr(1));
            continue;
        }
        std::string name, data;
        size_t lp = 0;
        while (lp <= frame.size()) {
            size_t le = frame.find('\n', lp);
            if (le == std::string::npos) le = frame.size();
            const std::string line = frame.substr(lp, le - lp);
            if (line.rfind("event: ", 0) == 0) name = line.substr(7);
            else if (line.rfind("data: ", 0) == 0) data = line.substr(6);
            else ADD_FAILURE() << "unexpected SSE line: " << line;
            lp = le + 1;
        }
        out.frames.emplace_back(name, data);
    }
    return out;
}

const json k_tools = json::array(
    {{{"type", "function"},
      {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}},
     {{"type", "function"},
      {"function", {{"name", "search"}, {"parameters", {{"type", "object"}, {"properties", {{"q", {{"type", "string"}}}}}}}}}}});

json anthropic_tools() {
    json out = json::array();
    for (const auto &t : k_tools)
        out.push_back({{"name", t["function"]["name"]}, {"input_schema", t["function"]["parameters"]}});
    return out;
}

json chat(const std::string &user, json extra = json::object()) {
    json b = {{"model", "fake-model"}, {"messages", json::array({{{"role", "user"}, {"content", user}}})},
              {"temperature", 0}, {"tools", k_tools}};
    for (auto &[k, v] : extra.items()) b[k] = v;
    return b;
}

json messages(const std::string &user, json extra = json::object()) {
    json b = {{"model", "fake-model"}, {"max_tokens", 1000}, {"temperature", 0},
              {"messages", json::array({{{"role", "user"}, {"content", user}}})}, {"tools", anthropic_tools()}};
    for (auto &[k, v] : extra.items()) b[k] = v;
    return b;
}

// One-line DSML (the fake echoes a user message up to its first newline; DSML allows no whitespace
// between tags).
std::string dsml_invoke(const std::string &name, const std::string &param, const std::string &value) {
    return "<｜DSML｜invoke name=\"" + name + "\"><｜DSML｜parameter name=\"" + param + "\" string=\"true\">" + value +
           "</｜DSML｜parameter></｜DSML｜invoke>";
}
std::string dsml_block(const std::string &invokes) {
    return "<｜DSML｜tool_calls>" + invokes + "</｜DSML｜tool_calls>";
}

// An OpenAI chat stream: content, each tool_calls delta in order, the finish reason.
struct openai_stream {
    std::string content, finish;
    std::vector<json> calls;  // the tool_calls entries of the deltas, in order
    json usage;
};
openai_stream read_openai(const std::string &body) {
    openai_stream out;
    const sse s = parse_sse(body);
    EXPECT_FALSE(s.frames.empty());
    if (s.frames.empty()) return out;
    EXPECT_EQ(s.frames.back().second, "[DONE]");
    for (const auto &[name, data] : s.frames) {
        if (data == "[DONE]") continue;
        const json j = json::parse(data);
        if (j.contains("usage") && !j["usage"].is_null()) out.usage = j["usage"];
        if (j["choices"].empty()) continue;
        const json &ch = j["choices"][0];
        if (ch["delta"].contains("content")) out.content += ch["delta"]["content"].get<std::string>();
        if (ch["delta"].contains("tool_calls")) {
            EXPECT_EQ(ch["delta"]["tool_calls"].size(), 1u);
            for (const auto &c : ch["delta"]["tool_calls"]) out.calls.push_back(c);
        }
        if (!ch["finish_reason"].is_null()) out.finish = ch["finish_reason"];
    }
    return out;
}

// The argument fragments of call `index`, in order (the first from its opening chunk).
std::vector<std::string> fragments(const openai_stream &s, int index) {
    std::vector<std::string> out;
    for (const auto &c : s.calls)
        if (c["index"] == index) out.push_back(c["function"]["arguments"]);
    return out;
}

using strs = std::vector<std::string>;

}  // namespace

TEST(ToolStreamHttp, Ds4CallStreamsAsItDecodes) {
    fake_server s("deepseek4");
    const std::string out = "Checking." + dsml_block(dsml_invoke("get_weather", "city", "Paris"));
    auto r = s.post("/v1/chat/completions", chat(out, {{"stream", true}}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const openai_stream st = read_openai(r->body);
    EXPECT_EQ(st.content, "Checking.");
    EXPECT_EQ(st.finish, "tool_calls");
    ASSERT_FALSE(st.calls.empty());
    // The opening chunk: index, id, type, name and the arguments so far ("{" once the invoke tag is read).
    const json &first = st.calls[0];
    EXPECT_EQ(first["index"], 0);
    EXPECT_EQ(first["type"], "function");
    EXPECT_EQ(first["id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(first["function"]["name"], "get_weather");
    // One token (byte) at a time: the parameter's key at its tag, the value's characters as they come,
    // the closing quote at the closing tag, "}" at the invoke's end.
    EXPECT_EQ(fragments(st, 0), strs({"{", "\"city\": \"", "P", "a", "r", "i", "s", "\"", "}"}));
    for (size_t i = 1; i < st.calls.size(); ++i) {
        EXPECT_FALSE(st.calls[i].contains("id"));
        EXPECT_FALSE(st.calls[i]["function"].contains("name"));
    }
    // The whole response: the same call.
    r = s.post("/v1/chat/completions", chat(out));
    ASSERT_TRUE(r);
    const json msg = json::parse(r->body)["choices"][0]["message"];
    EXPECT_EQ(msg["content"], "Checking.");
    ASSERT_EQ(msg["tool_calls"].size(), 1u);
    EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\"}");
}

TEST(ToolStreamHttp, Ds4AnthropicEventSequence) {
    fake_server s("deepseek4");
    const std::string out = "Hi." + dsml_block(dsml_invoke("search", "q", "x y"));
    auto r = s.post("/v1/messages", messages(out, {{"stream", true}}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const sse st = parse_sse(r->body);
    // Anthropic's documented order, runs of deltas collapsed to one entry.
    strs seq;
    std::string text, partial, tool_id;
    for (const auto &[name, data] : st.frames) {
        const json j = json::parse(data);
        EXPECT_EQ(j["type"], name);
        std::string e = name;
        if (name == "content_block_start") e += "/" + j["content_block"]["type"].get<std::string>() + "/" + std::to_string(j["index"].get<int>());
        if (name == "content_block_delta") e += "/" + j["delta"]["type"].get<std::string>() + "/" + std::to_string(j["index"].get<int>());
        if (name == "content_block_stop") e += "/" + std::to_string(j["index"].get<int>());
        if (name == "message_delta") e += "/" + j["delta"]["stop_reason"].get<std::string>();
        if (name == "content_block_start" && j["content_block"]["type"] == "tool_use") {
            EXPECT_EQ(j["content_block"]["name"], "search");
            EXPECT_EQ(j["content_block"]["input"], json::object());
            tool_id = j["content_block"]["id"];
        }
        if (name == "content_block_delta" && j["delta"]["type"] == "text_delta") text += j["delta"]["text"].get<std::string>();
        if (name == "content_block_delta" && j["delta"]["type"] == "input_json_delta")
            partial += j["delta"]["partial_json"].get<std::string>();
        if (seq.empty() || seq.back() != e) seq.push_back(e);
    }
    EXPECT_EQ(seq, strs({"message_start", "ping", "content_block_start/text/0", "content_block_delta/text_delta/0",
                         "content_block_stop/0", "content_block_start/tool_use/1", "content_block_delta/input_json_delta/1",
                         "content_block_stop/1", "message_delta/tool_use", "message_stop"}));
    EXPECT_EQ(text, "Hi.");
    EXPECT_EQ(partial, "{\"q\": \"x y\"}");
    EXPECT_EQ(tool_id.rfind("toolu_", 0), 0u);
}

TEST(ToolStreamHttp, ThinkingThenTextThenCall) {
    // Thinking on: the fake's generation prompt opens the block, so the echo up to "</think>" is reasoning;
    // calls are decoded from the answer only.
    fake_server s("deepseek4");
    const std::string out = "plan <b>it</think>Ok." + dsml_block(dsml_invoke("search", "q", "z"));
    auto r = s.post("/v1/messages", messages(out, {{"stream", true}, {"thinking", {{"type", "enabled"}}}}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    strs seq;
    std::string thinking, text, partial;
    for (const auto &[name, data] : parse_sse(r->body).frames) {
        const json j = json::parse(data);
        std::string e = name;
        if (name == "content_block_start") e += "/" + j["content_block"]["type"].get<std::string>();
        if (name == "content_block_delta") {
            const std::string t = j["delta"]["type"];
            e += "/" + t;
            if (t == "thinking_delta") thinking += j["delta"]["thinking"].get<std::string>();
            if (t == "text_delta") text += j["delta"]["text"].get<std::string>();
            if (t == "input_json_delta") partial += j["delta"]["partial_json"].get<std::string>();
        }
        if (seq.empty() || seq.back() != e) seq.push_back(e);
    }
    EXPECT_EQ(seq, strs({"message_start", "ping", "content_block_start/thinking", "content_block_delta/thinking_delta",
                         "content_block_delta/signature_delta", "content_block_stop", "content_block_start/text",
                         "content_block_delta/text_delta", "content_block_stop", "content_block_start/tool_use",
                         "content_block_delta/input_json_delta", "content_block_stop", "message_delta", "message_stop"}));
    EXPECT_EQ(thinking, "plan <b>it");
    EXPECT_EQ(text, "Ok.");
    EXPECT_EQ(partial, "{\"q\": \"z\"}");
}

TEST(ToolStreamHttp, ParallelToolCallsFalseStopsAfterTheFirstCall) {
    fake_server s("deepseek4", 2000);  // 2 ms a step: the server reads events as they come
    const std::string out = dsml_block(dsml_invoke("get_weather", "city", "Paris") + dsml_invoke("search", "q", "news")) +
                            "and a long tail of text after the calls";
    // Default (parallel): both calls, indices 0 and 1.
    auto r = s.post("/v1/chat/completions", chat(out, {{"stream", true}}));
    ASSERT_TRUE(r);
    openai_stream st = read_openai(r->body);
    ASSERT_FALSE(fragments(st, 1).empty());
    EXPECT_EQ(st.calls.back()["index"], 1);
    // parallel_tool_calls false: the first call only, and generation stopped there (fewer tokens
    // than the output up to the end of the first invoke's closing tag, plus a few in flight).
    const size_t first_end = out.find("</｜DSML｜invoke>") + std::string("</｜DSML｜invoke>").size();
    r = s.post("/v1/chat/completions", chat(out, {{"stream", true}, {"parallel_tool_calls", false},
                                                  {"stream_options", {{"include_usage", true}}}}));
    ASSERT_TRUE(r);
    st = read_openai(r->body);
    EXPECT_TRUE(fragments(st, 1).empty());
    EXPECT_EQ(st.finish, "tool_calls");
    EXPECT_EQ(st.content, "");
    std::string args;
    for (const auto &f : fragments(st, 0)) args += f;
    EXPECT_EQ(args, "{\"city\": \"Paris\"}");
    EXPECT_LT(st.usage["completion_tokens"].get<int64_t>(), int64_t(first_end + 8));
    // Whole response, OpenAI and Anthropic (tool_choice.disable_parallel_tool_use).
    r = s.post("/v1/chat/completions", chat(out, {{"parallel_tool_calls", false}}));
    ASSERT_TRUE(r);
    json j = json::parse(r->body);
    ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u);
    EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
    r = s.post("/v1/messages", messages(out, {{"tool_choice", {{"type", "auto"}, {"disable_parallel_tool_use", true}}}}));
    ASSERT_TRUE(r);
    j = json::parse(r->body);
    ASSERT_EQ(j["content"].size(), 1u) << j.dump();
    EXPECT_EQ(j["content"][0]["type"], "tool_use");
    EXPECT_EQ(j["content"][0]["input"], json({{"city", "Paris"}}));
    EXPECT_EQ(j["stop_reason"], "tool_use");
}

TEST(ToolStreamHttp, Ds4ForcedCallsStream) {
    fake_server s("deepseek4");
    // The prompt ends with the forced opening; the fake echoes the user message from the position after
    // it, so the message starts with as many filler bytes as the opening has.
    const std::string named_open = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n";
    const std::string rest = "<｜DSML｜parameter name=\"city\" string=\"true\">Oslo</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>";
    const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
    auto r = s.post("/v1/chat/completions",
                    chat(std::string(named_open.size(), '.') + rest, {{"stream", true}, {"tool_choice", named}}));
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    openai_stream st = read_openai(r->body);
    ASSERT_FALSE(st.calls.empty());
    EXPECT_EQ(st.calls[0]["function"]["name"], "get_weather");
    EXPECT_EQ(fragments(st, 0), strs({"{", "\"city\": \"", "O", "s", "l", "o", "\"", "}"}));
    EXPECT_EQ(st.content, "");
    EXPECT_EQ(st.finish, "tool_calls");
    // required: the model writes the name.
    const std::string req_open = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"";
    r = s.post("/v1/chat/completions",
               chat(std::string(req_open.size(), '.') + "search\">" + rest, {{"stream", true}, {"tool_choice", "required"}}));
    ASSERT_TRUE(r);
    st = read_openai(r->body);
    ASSERT_FALSE(st.calls.empty());
    EXPECT_EQ(st.calls[0]["function"]["name"], "search");
    EXPECT_EQ(st.calls[0]["function"]["arguments"], "{");
    // A named call the model does not complete: the stream ends with an error frame, no finish chunk.
    r = s.post("/v1/chat/completions", chat(std::string(named_open.size(), '.') + "junk", {{"stream", true}, {"tool_choice", named}}));
    ASSERT_TRUE(r);
    EXPECT_NE(r->body.find("did not complete a valid call to 'get_weather'"), std::string::npos) << r->body;
}

TEST(ToolStreamHttp, ToolChoiceNoneLeavesMarkupAsContent) {
    fake_server s("deepseek4");
    const std::string out = dsml_block(dsml_invoke("search", "q", "x"));
    auto r = s.post("/v1/chat/completions", chat(out, {{"stream", true}, {"tool_choice", "none"}}));
    ASSERT_TRUE(r);
    const openai_stream st = read_openai(r->body);
    EXPECT_TRUE(st.calls.empty());
    EXPECT_EQ(st.content, out);
    EXPECT_EQ(st.finish, "stop");
}

TEST(ToolStreamHttp, HermesCallStreams) {
    fake_server s("llama");
    const std::string out = "Ok <tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"a}\"}}</tool_call>";
    auto r = s.post("/v1/chat/completions", chat(out, {{"stream", true}}));
    ASSERT_TRUE(r);
    const openai_stream st = read_openai(r->body);
    EXPECT_EQ(st.content, "Ok");
    ASSERT_FALSE(st.calls.empty());
    EXPECT_EQ(st.calls[0]["function"]["name"], "search");
    EXPECT_EQ(st.calls[0]["function"]["arguments"], "");
    // Byte by byte: the object as the model writes it (the "}" inside the string does not end it).
    strs expect;
    for (char c : std::string("{\"q\": \"a}\"}")) expect.push_back(std::string(1, c));
    const strs got = fragments(st, 0);
    EXPECT_EQ(strs(got.begin() + 1, got.end()), expect);
    EXPECT_EQ(st.finish, "tool_calls");
}

TEST(ToolStreamHttp, HermesForcedCallsStream) {
    fake_server s("llama");
    // Named: the prompt ends with '<tool_call>\n{"name": "search", "arguments": '; the fake echoes from after it.
    const std::string named_open = "<tool_call>\n{\"name\": \"search\", \"arguments\": ";
    const json named = {{"type", "function"}, {"function", {{"name", "search"}}}};
    auto r = s.post("/v1/chat/completions", chat(std::string(named_open.size(), '.') + "{\"q\": \"w\"}}</tool_call>",
                                                 {{"stream", true}, {"tool_choice", named}}));
    ASSERT_TRUE(r);
    openai_stream st = read_openai(r->body);
    ASSERT_FALSE(st.calls.empty());
    EXPECT_EQ(st.calls[0]["function"]["name"], "search");
    EXPECT_EQ(fragments(st, 0), strs({"", "{", "\"", "q", "\"", ":", " ", "\"", "w", "\"", "}"}));
    EXPECT_EQ(st.finish, "tool_calls");
    // Required (Anthropic "any"): the model writes the name.
    const std::string req_open = "<tool_call>\n{\"name\": \"";
    r = s.post("/v1/messages", messages(std::string(req_open.size(), '.') + "get_weather\", \"arguments\": {}}</tool_call>",
                                        {{"stream", true}, {"tool_choice", {{"type", "any"}}}}));
    ASSERT_TRUE(r);
    std::string partial, name;
    for (const auto &[ev, data] : parse_sse(r->body).frames) {
        const json j = json::parse(data);
        if (ev == "content_block_start" && j["content_block"]["type"] == "tool_use") name = j["content_block"]["name"];
        if (ev == "content_block_delta" && j["delta"]["type"] == "input_json_delta")
            partial += j["delta"]["partial_json"].get<std::string>();
    }
    EXPECT_EQ(name, "get_weather");
    EXPECT_EQ(partial, "{}");
}

// ---- DS4 tool turns in the next request ----

TEST(Ds4ToolTurns, HistoryRendersAsTheOfficialEncoder) {
    auto fmt = server::make_tool_format("dsml");
    // Keys in sorted order (the server's tools JSON sorts them; the encoder keeps the given order).
    const std::string tools_text =
        R"([{"function": {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}, "type": "function"},
            {"function": {"name": "search", "parameters": {"properties": {"q": {"type": "string"}}, "type": "object"}}, "type": "function"}])";
    // Results sent in the opposite order of the calls: the encoder sorts them by call order.
    const std::string msgs_text = R"([
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "b", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "r2"},
        {"role": "tool", "tool_call_id": "a", "content": "r1"},
        {"role": "user", "content": "thanks"}])";
    ds4chat::render_options o;
    o.thinking = false;  // chat mode, as the server renders DS4 by default
    const std::string official = ds4chat::render_prompt(ojson::parse(msgs_text), ojson::parse(tools_text), o);
    auto server_prompt = [&](const server::gen_request &r) {  // what the DS4 engine renders (render_deepseek)
        ojson j = ojson::array();
        for (const auto &m : r.messages) j.push_back({{"role", m.role}, {"content", m.content}});
        return ds4chat::render_prompt(j, ojson(), o);
    };
    const json body = {{"messages", json::parse(msgs_text)}, {"tools", json::parse(tools_text)}};
    EXPECT_EQ(server_prompt(server::parse_openai_chat(body, {}, *fmt)), official);
    // By hand (docs/ds4-chat-format.md rules 6, 7, 13, 15, 16): the turn and its results.
    const std::string tail =
        "<｜Assistant｜></think>Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"q\" string=\"true\">x</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>r1</tool_result>\n\n"
        "<tool_result>r2</tool_result>\n\nthanks<｜Assistant｜></think>";
    ASSERT_GE(official.size(), tail.size());
    EXPECT_EQ(official.substr(official.size() - tail.size()), tail);
    // The same conversation through the Anthropic API.
    const json amsgs = json::parse(R"([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "a", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "b", "name": "search", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "r2"},
            {"type": "tool_result", "tool_use_id": "a", "content": "r1"}, {"type": "text", "text": "thanks"}]}])");
    json atools = json::array();
    for (const auto &t : json::parse(tools_text))
        atools.push_back({{"name", t["function"]["name"]}, {"input_schema", t["function"]["parameters"]}});
    const json abody = {{"model", "m"}, {"max_tokens", 5}, {"system", "S"}, {"messages", amsgs}, {"tools", atools}};
    EXPECT_EQ(server_prompt(server::parse_anthropic(abody, {}, *fmt, false)), official);
}

// ---- long prefills ----

namespace {
// A raw HTTP exchange with arrival times: the time of the first byte and the whole answer.
struct timed_answer {
    double first_byte_s = -1, total_s = 0;
    std::string text;
};
timed_answer timed_post(int port, const std::string &path, const std::string &body) {
    timed_answer out;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)), 0);
    const std::string req = "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
    char buf[4096];
    for (;;) {
        const ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) break;
        if (out.first_byte_s < 0) out.first_byte_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        out.text.append(buf, size_t(n));
    }
    out.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    close(fd);
    return out;
}

// The body of a chunked HTTP/1.1 answer.
std::string dechunk(const std::string &answer) {
    std::string out;
    size_t pos = answer.find("\r\n\r\n");
    if (pos == std::string::npos) return out;
    pos += 4;
    for (;;) {
        const size_t eol = answer.find("\r\n", pos);
        if (eol == std::string::npos) break;
        const size_t n = std::stoul(answer.substr(pos, eol - pos), nullptr, 16);
        if (n == 0) break;
        out += answer.substr(eol + 2, n);
        pos = eol + 2 + n + 2;
    }
    return out;
}
}  // namespace

TEST(LongPrefill, HeadersAtOnceThenProgressComments) {
    // 6 prefill chunks of 256 tokens, each engine step taking 400 ms: the prefill takes about 2.4 s.
    fake_server s("llama", 400000, 256);
    const int64_t n_prompt = 1 + 6 + 1500 + 1 + 12;  // BOS "[user]" text "\n" "[assistant]\x02"
    for (const std::string path : {"/v1/chat/completions", "/v1/messages"}) {
        // Another text each time, so nothing of the prompt is reused from the slot.
        const std::string user(1500, path == "/v1/messages" ? 'm' : 'c');
        const json body = {{"model", "fake-model"}, {"messages", json::array({{{"role", "user"}, {"content", user}}})},
                           {"max_tokens", 1}, {"stream", true}, {"temperature", 0}};
        const timed_answer t = timed_post(s.port, path, body.dump());
        EXPECT_LT(t.first_byte_s, 1.0) << path;  // headers (and the stream's opening frame) right away
        EXPECT_GT(t.total_s, 2.0) << path;
        ASSERT_NE(t.text.find("HTTP/1.1 200"), std::string::npos) << t.text.substr(0, 200);
        const sse st = parse_sse(dechunk(t.text));
        // At least one comment per second of prefill; each "prefill D/T", D at a chunk boundary (or the
        // prefix the slot reused from the previous request), rising.
        ASSERT_GE(st.comments.size(), 2u) << path;
        int64_t last = -1;
        for (const std::string &c : st.comments) {
            int64_t d = -1, total = -1;
            ASSERT_EQ(std::sscanf(c.c_str(), " prefill %ld/%ld", &d, &total), 2) << c;
            EXPECT_EQ(total, n_prompt);
            EXPECT_TRUE(d % 256 == 0 || d == 7) << c;  // a chunk boundary, or what the slot reused (BOS "[user]")
            EXPECT_LT(d, n_prompt);
            EXPECT_GE(d, last);
            last = d;
        }
        EXPECT_GT(last, 0);  // progress was seen
        // The stream itself is intact: it ends as the API says.
        ASSERT_FALSE(st.frames.empty());
        if (path == "/v1/chat/completions") EXPECT_EQ(st.frames.back().second, "[DONE]");
        else EXPECT_EQ(st.frames.back().first, "message_stop");
    }
}

TEST(LongPrefill, StreamedCompressionRunsAfterTheHeaders) {
    // A drafter that fails to load: a streamed request that PFlash compresses has its headers and opening
    // frame out before compression starts, so the failure arrives as the stream's error frame; the whole
    // response is still a 500. The server keeps serving.
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() / ("fathom_ts_drafter_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    { std::ofstream(dir / "drafter.gguf") << "not a gguf file"; }
    server::server_options o;
    o.compression.drafter_path = (dir / "drafter.gguf").string();
    {
        fake_server s("llama", 0, 512, o);
        json body = {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                     {"prefill_compression", "always"}, {"max_tokens", 2}, {"stream", true}};
        auto r = s.post("/v1/chat/completions", body);
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 200);
        const sse st = parse_sse(r->body);
        ASSERT_EQ(st.frames.size(), 3u) << r->body;
        EXPECT_EQ(json::parse(st.frames[0].second)["choices"][0]["delta"]["role"], "assistant");
        const json err = json::parse(st.frames[1].second);
        EXPECT_EQ(err["error"]["message"].get<std::string>().rfind("prompt compression failed: ", 0), 0u) << err;
        EXPECT_EQ(st.frames[2].second, "[DONE]");
        body.erase("stream");
        r = s.post("/v1/chat/completions", body);
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 500);
        body["prefill_compression"] = "off";
        r = s.post("/v1/chat/completions", body);
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 200);
        EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], "hi");
    }
    std::filesystem::remove_all(dir);
}

TEST(LongPrefill, UnhonourableCompressionIsStillA400BeforeTheHeaders) {
    fake_server s("llama");  // no drafter
    for (bool stream : {false, true}) {
        auto r = s.post("/v1/chat/completions",
                        {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                         {"prefill_compression", "always"}, {"stream", stream}});
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << r->body;
        EXPECT_EQ(json::parse(r->body)["error"]["param"], "prefill_compression");
    }
}

TEST(ToolStreamHttp, BadParallelFieldsAre400s) {
    fake_server s("deepseek4");
    auto r = s.post("/v1/chat/completions", chat("x", {{"parallel_tool_calls", "no"}}));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400);
    EXPECT_EQ(json::parse(r->body)["error"]["param"], "parallel_tool_calls");
    r = s.post("/v1/messages", messages("x", {{"tool_choice", {{"type", "auto"}, {"disable_parallel_tool_use", 1}}}}));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400);
    EXPECT_NE(r->body.find("disable_parallel_tool_use"), std::string::npos) << r->body;
    r = s.post("/v1/chat/completions", chat("still serving"));  // and the server keeps serving
    ASSERT_TRUE(r);
    EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], "still serving");
}
