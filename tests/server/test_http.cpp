// The HTTP server end to end with the fake engine (fake_engine.h): real sockets, cpp-httplib
// client. Expected texts follow from the fake's echo rule; token counts from its byte tokenizer.
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <thread>

#include "engine/fake_engine.h"
#include "fake_http.h"
#include "server/http_server.h"
#include "server/tool_calls.h"

using namespace fathom;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

struct live_server : test::fake_http {
    static sched::scheduler_options sopts(int slots) {
        sched::scheduler_options o;
        o.n_slots = slots;
        o.max_queue = 8;
        return o;
    }
    static server::server_options hopts(const std::string &key, size_t max_body) {
        server::server_options o;
        o.api_key = key;
        o.max_body_bytes = max_body;
        return o;
    }
    live_server(const std::string &key = "", int n_ctx = 4096, int delay_us = 0, int slots = 2, size_t max_body = 1 << 20)
        : fake_http(n_ctx, delay_us, sopts(slots), hopts(key, max_body)) {}
};

json post_json(const live_server &s, const std::string &path, const json &body, int expect_status,
               const httplib::Headers &h = {}) {
    auto c = s.client();
    auto res = c.Post(path.c_str(), h, body.dump(), "application/json");
    EXPECT_TRUE(res) << path;
    if (!res) return {};
    EXPECT_EQ(res->status, expect_status) << res->body;
    return json::parse(res->body, nullptr, false);
}

// SSE body -> list of (event name, data) in order.
std::vector<std::pair<std::string, std::string>> sse_frames(const std::string &body) {
    std::vector<std::pair<std::string, std::string>> out;
    size_t pos = 0;
    while (pos < body.size()) {
        size_t end = body.find("\n\n", pos);
        EXPECT_NE(end, std::string::npos) << "unterminated SSE frame";
        if (end == std::string::npos) break;
        std::string frame = body.substr(pos, end - pos), name, data;
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
        out.emplace_back(name, data);
        pos = end + 2;
    }
    return out;
}

std::string stream_body(const live_server &s, const std::string &path, const json &body) {
    auto c = s.client();
    auto res = c.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(res);
    if (!res) return {};
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
    return res->body;
}

json chat_body(const std::string &user, json extra = json::object()) {
    json b = {{"model", "fake-model"}, {"messages", json::array({{{"role", "user"}, {"content", user}}})},
              {"temperature", 0}};
    for (auto &[k, v] : extra.items()) b[k] = v;
    return b;
}

// Tokens of a one-user-message chat prompt under the fake template: BOS + bytes.
int64_t chat_prompt_tokens(const std::string &user) {
    return 1 + int64_t(std::string("[user]").size() + user.size() + 1 + std::string("[assistant]\x02").size());
}

const json k_weather_tool = json::array(
    {{{"type", "function"},
      {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
const std::string k_call_text = R"(<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>)";

double metric_value(const live_server &s, const std::string &name) {
    auto c = s.client();
    auto res = c.Get("/metrics");
    if (!res) return -1;
    const std::string &b = res->body;
    size_t p = 0;
    while ((p = b.find(name + " ", p)) != std::string::npos) {
        if (p == 0 || b[p - 1] == '\n') return std::stod(b.substr(p + name.size() + 1));
        p += name.size();
    }
    return -1;
}

}  // namespace

TEST(Http, HealthModelsPropsAndPage) {
    live_server s;
    auto c = s.client();
    auto h = c.Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 200);
    EXPECT_EQ(json::parse(h->body)["status"], "ok");
    auto m = json::parse(c.Get("/v1/models")->body);
    EXPECT_EQ(m["object"], "list");
    EXPECT_EQ(m["data"][0]["id"], "fake-model");
    auto p = json::parse(c.Get("/props")->body);
    EXPECT_EQ(p["n_ctx"], 4096);
    EXPECT_EQ(p["parallel"], 2);
    auto page = c.Get("/");
    EXPECT_NE(page->body.find("<!doctype html>"), std::string::npos);
    EXPECT_NE(page->body.find("/v1/chat/completions"), std::string::npos);
}

TEST(Http, ChatCompletion) {
    live_server s;
    json r = post_json(s, "/v1/chat/completions", chat_body("Hello there"), 200);
    EXPECT_EQ(r["object"], "chat.completion");
    EXPECT_EQ(r["model"], "fake-model");
    EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
    EXPECT_EQ(r["choices"][0]["message"]["content"], "Hello there");
    EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(r["usage"]["prompt_tokens"], chat_prompt_tokens("Hello there"));
    EXPECT_EQ(r["usage"]["completion_tokens"], 11);
    EXPECT_EQ(r["usage"]["total_tokens"], chat_prompt_tokens("Hello there") + 11);
    r = post_json(s, "/v1/chat/completions", chat_body("Hello there", {{"max_tokens", 3}}), 200);
    EXPECT_EQ(r["choices"][0]["message"]["content"], "Hel");
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
}

TEST(Http, ChatStreamFraming) {
    live_server s;
    const auto frames = sse_frames(stream_body(
        s, "/v1/chat/completions", chat_body("Hi you", {{"stream", true}, {"stream_options", {{"include_usage", true}}}})));
    ASSERT_GE(frames.size(), 4u);
    EXPECT_EQ(frames.back().second, "[DONE]");
    std::string text, finish;
    json usage;
    for (size_t i = 0; i + 1 < frames.size(); ++i) {
        json j = json::parse(frames[i].second);
        EXPECT_EQ(j["object"], "chat.completion.chunk");
        if (i == 0) {
            EXPECT_EQ(j["choices"][0]["delta"]["role"], "assistant");
        }
        if (j.contains("usage") && !j["usage"].is_null()) {
            usage = j["usage"];
            EXPECT_TRUE(j["choices"].empty());
            continue;
        }
        const auto &ch = j["choices"][0];
        if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
        if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
    EXPECT_EQ(text, "Hi you");
    EXPECT_EQ(finish, "stop");
    EXPECT_EQ(usage["completion_tokens"], 6);
    EXPECT_EQ(usage["prompt_tokens"], chat_prompt_tokens("Hi you"));
}

TEST(Http, StopStringNeverLeaksIntoStream) {
    live_server s;
    const auto frames = sse_frames(
        stream_body(s, "/v1/chat/completions", chat_body("abc STOP def", {{"stream", true}, {"stop", json::array({"STOP"})}})));
    std::string text;
    for (const auto &[name, data] : frames) {
        if (data == "[DONE]") continue;
        json j = json::parse(data);
        const auto &d = j["choices"][0]["delta"];
        if (d.contains("content")) text += d["content"].get<std::string>();
    }
    EXPECT_EQ(text, "abc ");
    json r = post_json(s, "/v1/chat/completions", chat_body("abc STOP def", {{"stop", "STOP"}}), 200);
    EXPECT_EQ(r["choices"][0]["message"]["content"], "abc ");
    EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
}

TEST(Http, Logprobs) {
    live_server s;
    json r = post_json(s, "/v1/chat/completions", chat_body("abc", {{"logprobs", true}, {"top_logprobs", 2}}), 200);
    const auto &content = r["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 3u);
    // The fake's logits: 10 for the chosen token, 0 for the other 257 -> log-softmax by hand.
    const double lp = 10.0 - std::log(std::exp(10.0) + 257.0);
    const double alt = 0.0 - std::log(std::exp(10.0) + 257.0);
    for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(content[i]["token"], std::string(1, "abc"[i]));
        EXPECT_NEAR(content[i]["logprob"].get<double>(), lp, 1e-4);
        EXPECT_EQ(content[i]["bytes"], json::array({int("abc"[i])}));
        ASSERT_EQ(content[i]["top_logprobs"].size(), 2u);
        EXPECT_NEAR(content[i]["top_logprobs"][0]["logprob"].get<double>(), lp, 1e-4);
        EXPECT_NEAR(content[i]["top_logprobs"][1]["logprob"].get<double>(), alt, 1e-4);
    }
}

// A tool-call turn sent back under the ids the server gave it is written into the next prompt as the
// generated text (exact replay), so the whole turn's KV is reused: cached_tokens covers turn 1's prompt and
// every generated byte, where the canonical re-rendering would differ right after "<tool_call>".
TEST(Http, ReturnedToolTurnReusesItsKv) {
    live_server s;
    json r1 = post_json(s, "/v1/chat/completions", chat_body(k_call_text, {{"tools", k_weather_tool}}), 200);
    const json calls = r1["choices"][0]["message"]["tool_calls"];
    ASSERT_EQ(calls.size(), 1u);
    const std::string canonical = fathom::server::make_tool_format("hermes")->render_calls(
        {{calls[0]["id"], "get_weather", calls[0]["function"]["arguments"].get<std::string>()}});
    ASSERT_NE(canonical, k_call_text);  // else exact replay could not be told from re-rendering
    const int64_t p1 = r1["usage"]["prompt_tokens"].get<int64_t>();
    auto history = [&](const json &id) {
        json tc = calls;
        tc[0]["id"] = id;
        json msgs = json::array({{{"role", "user"}, {"content", k_call_text}},
                                 {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", tc}},
                                 {{"role", "tool"}, {"tool_call_id", id}, {"content", "sunny"}}});
        return json{{"model", "fake-model"}, {"messages", msgs}, {"temperature", 0}, {"tools", k_weather_tool}};
    };
    auto cached = [](const json &r) { return r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(); };
    // The ids it gave: the generated bytes, reuse past the whole call (re-rendered, the prompt would
    // part from the session's tokens right after "<tool_call>": 614 < 681 cached tokens here).
    EXPECT_GE(cached(post_json(s, "/v1/chat/completions", history(calls[0]["id"]), 200)),
              p1 + int64_t(k_call_text.size()));
    // Then an id this server never gave out: rendered canonically, so it parts from both sessions so far
    // (the fake server's one slot now holds the previous request) inside the call.
    EXPECT_LT(cached(post_json(s, "/v1/chat/completions", history("call_elsewhere"), 200)),
              p1 + int64_t(k_call_text.size()));
}

TEST(Http, ToolCallParsedFromOutput) {
    live_server s;
    json r = post_json(s, "/v1/chat/completions", chat_body(k_call_text, {{"tools", k_weather_tool}}), 200);
    const auto &msg = r["choices"][0]["message"];
    EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
    EXPECT_TRUE(msg["content"].is_null());
    ASSERT_EQ(msg["tool_calls"].size(), 1u);
    EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
    EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
    EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
    // Without tools the same output is plain text.
    r = post_json(s, "/v1/chat/completions", chat_body(k_call_text), 200);
    EXPECT_EQ(r["choices"][0]["message"]["content"], k_call_text);
    // Streamed: no markup leaks into content deltas (the space before the call is not content either,
    // as in the whole response); the call arrives as tool_calls deltas: the first with index, id, type
    // and name, the arguments in fragments (the object as the model wrote it, byte by byte here).
    const auto frames = sse_frames(
        stream_body(s, "/v1/chat/completions", chat_body("Sure. " + k_call_text, {{"tools", k_weather_tool}, {"stream", true}})));
    std::string text, finish, args;
    std::vector<json> calls;
    for (const auto &[name, data] : frames) {
        if (data == "[DONE]") continue;
        const json j = json::parse(data);
        const auto &ch = j["choices"][0];
        if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
        if (ch["delta"].contains("tool_calls")) {
            ASSERT_EQ(ch["delta"]["tool_calls"].size(), 1u);
            calls.push_back(ch["delta"]["tool_calls"][0]);
            args += calls.back()["function"]["arguments"].get<std::string>();
        }
        if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
    EXPECT_EQ(text, "Sure.");
    EXPECT_EQ(finish, "tool_calls");
    ASSERT_EQ(calls.size(), std::string(R"({"city": "Paris"})").size() + 1);  // the header, then one per byte
    EXPECT_EQ(calls[0]["index"], 0);
    EXPECT_EQ(calls[0]["type"], "function");
    EXPECT_EQ(calls[0]["id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
    EXPECT_EQ(calls[0]["function"]["arguments"], "");
    for (size_t i = 1; i < calls.size(); ++i) {
        EXPECT_EQ(calls[i]["index"], 0);
        EXPECT_FALSE(calls[i].contains("id"));
        EXPECT_FALSE(calls[i]["function"].contains("name"));
    }
    EXPECT_EQ(args, R"({"city": "Paris"})");
}

TEST(Http, Completions) {
    live_server s;
    // Completion rule of the fake: 'a' + (tokens held % 26); "Hi" + BOS = 3 tokens -> "defg".
    json r = post_json(s, "/v1/completions", {{"model", "fake-model"}, {"prompt", "Hi"}, {"max_tokens", 4}, {"temperature", 0}}, 200);
    EXPECT_EQ(r["object"], "text_completion");
    EXPECT_EQ(r["choices"][0]["text"], "defg");
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(r["usage"]["prompt_tokens"], 3);
    r = post_json(s, "/v1/completions", {{"prompt", json::array({257, 'H', 'i'})}, {"max_tokens", 2}, {"temperature", 0}, {"logprobs", 1}}, 200);
    EXPECT_EQ(r["choices"][0]["text"], "de");
    EXPECT_EQ(r["choices"][0]["logprobs"]["tokens"], json::array({"d", "e"}));
    EXPECT_EQ(r["choices"][0]["logprobs"]["text_offset"], json::array({0, 1}));
    const auto frames = sse_frames(stream_body(s, "/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 3}, {"temperature", 0}, {"stream", true}}));
    std::string text;
    for (const auto &[n, d] : frames)
        if (d != "[DONE]") text += json::parse(d)["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(text, "def");
    EXPECT_EQ(frames.back().second, "[DONE]");
}

TEST(Http, AnthropicMessages) {
    live_server s;
    json body = {{"model", "fake-model"}, {"max_tokens", 50}, {"temperature", 0},
                 {"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})}};
    json r = post_json(s, "/v1/messages", body, 200);
    EXPECT_EQ(r["type"], "message");
    EXPECT_EQ(r["role"], "assistant");
    EXPECT_EQ(r["content"][0]["type"], "text");
    EXPECT_EQ(r["content"][0]["text"], "Hi");
    EXPECT_EQ(r["stop_reason"], "end_turn");
    EXPECT_EQ(r["usage"]["input_tokens"], chat_prompt_tokens("Hi"));
    EXPECT_EQ(r["usage"]["output_tokens"], 2);
    body["stream"] = true;
    const auto frames = sse_frames(stream_body(s, "/v1/messages", body));
    std::vector<std::string> names;
    std::string text;
    for (const auto &[n, d] : frames) {
        names.push_back(n);
        json j = json::parse(d);
        EXPECT_EQ(j["type"], n);  // the data's type repeats the event name
        if (n == "content_block_delta") text += j["delta"]["text"].get<std::string>();
        if (n == "message_delta") {
            EXPECT_EQ(j["delta"]["stop_reason"], "end_turn");
        }
    }
    EXPECT_EQ(text, "Hi");
    const std::vector<std::string> expect = {"message_start", "ping", "content_block_start", "content_block_delta",
                                             "content_block_delta", "content_block_stop", "message_delta", "message_stop"};
    EXPECT_EQ(names, expect);
    // Stop sequence and tool use.
    json st = body;
    st.erase("stream");
    st["messages"][0]["content"] = "one ## two";
    st["stop_sequences"] = json::array({"##"});
    r = post_json(s, "/v1/messages", st, 200);
    EXPECT_EQ(r["content"][0]["text"], "one ");
    EXPECT_EQ(r["stop_reason"], "stop_sequence");
    EXPECT_EQ(r["stop_sequence"], "##");
    json tb = st;
    tb.erase("stop_sequences");
    tb["max_tokens"] = 200;
    tb["messages"][0]["content"] = k_call_text;
    tb["tools"] = json::array({{{"name", "get_weather"}, {"input_schema", {{"type", "object"}}}}});
    r = post_json(s, "/v1/messages", tb, 200);
    EXPECT_EQ(r["stop_reason"], "tool_use");
    ASSERT_EQ(r["content"].size(), 1u);
    EXPECT_EQ(r["content"][0]["type"], "tool_use");
    EXPECT_EQ(r["content"][0]["name"], "get_weather");
    EXPECT_EQ(r["content"][0]["input"], json({{"city", "Paris"}}));
    EXPECT_EQ(r["content"][0]["id"].get<std::string>().rfind("toolu_", 0), 0u);
    r = post_json(s, "/v1/messages/count_tokens", {{"model", "fake-model"}, {"messages", body["messages"]}}, 200);
    EXPECT_EQ(r["input_tokens"], chat_prompt_tokens("Hi"));
}

TEST(Http, ErrorsUseEachApisSchemaAndServerKeepsServing) {
    live_server s("", 256, 0, 1, 4096);
    auto c = s.client();
    auto res = c.Post("/v1/chat/completions", "{not json", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400);
    json e = json::parse(res->body);
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
    EXPECT_NE(e["error"]["message"].get<std::string>().find("not valid JSON"), std::string::npos);
    res = c.Post("/v1/messages", "{not json", "application/json");
    e = json::parse(res->body);
    EXPECT_EQ(res->status, 400);
    EXPECT_EQ(e["type"], "error");
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");

    e = post_json(s, "/v1/chat/completions", chat_body("x", {{"model", "gpt-4"}}), 404);
    EXPECT_EQ(e["error"]["code"], "model_not_found");
    e = post_json(s, "/v1/chat/completions", chat_body("x", {{"temperature", -0.5}}), 400);
    EXPECT_EQ(e["error"]["param"], "temperature");
    e = post_json(s, "/v1/chat/completions", chat_body(std::string(300, 'y')), 400);  // > 256-token context
    EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
    e = post_json(s, "/v1/messages", {{"model", "fake-model"}, {"messages", json::array()}}, 400);
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");

    res = c.Post("/v1/chat/completions", std::string(10000, ' '), "application/json");  // > 4096-byte limit
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 413);
    res = c.Get("/v1/nothing");
    EXPECT_EQ(res->status, 404);
    EXPECT_TRUE(json::parse(res->body).contains("error"));

    json ok = post_json(s, "/v1/chat/completions", chat_body("still here"), 200);
    EXPECT_EQ(ok["choices"][0]["message"]["content"], "still here");
}

TEST(Http, ApiKey) {
    live_server s("sekret");
    auto c = s.client();
    auto res = c.Get("/v1/models");
    EXPECT_EQ(res->status, 401);
    EXPECT_EQ(json::parse(res->body)["error"]["type"], "authentication_error");
    res = c.Get("/v1/models", {{"Authorization", "Bearer wrong"}});
    EXPECT_EQ(res->status, 401);
    res = c.Get("/v1/models", {{"Authorization", "Bearer sekret"}});
    EXPECT_EQ(res->status, 200);
    res = c.Get("/metrics", {{"x-api-key", "sekret"}});
    EXPECT_EQ(res->status, 200);
    res = c.Get("/health");
    EXPECT_EQ(res->status, 200);
    res = c.Post("/v1/messages", "{}", "application/json");
    EXPECT_EQ(res->status, 401);
    EXPECT_EQ(json::parse(res->body)["error"]["type"], "authentication_error");
}

TEST(Http, MetricsCountRequests) {
    live_server s;
    post_json(s, "/v1/chat/completions", chat_body("abc"), 200);
    post_json(s, "/v1/chat/completions", chat_body("de"), 200);
    EXPECT_EQ(metric_value(s, "fathom_requests_finished_total"), 2);
    EXPECT_EQ(metric_value(s, "fathom_generated_tokens_total"), 5);
    EXPECT_EQ(metric_value(s, "fathom_time_to_first_token_seconds_count"), 2);
    EXPECT_EQ(metric_value(s, "fathom_slots_total"), 2);
    EXPECT_EQ(metric_value(s, "fathom_queue_depth"), 0);
    // KV pool: default size = 2 slots x 4096 / 16 positions; idle, so every used block is a cached prefix.
    EXPECT_EQ(metric_value(s, "fathom_kv_blocks_total"), 512);
    EXPECT_EQ(metric_value(s, "fathom_kv_block_tokens"), 16);
    EXPECT_GT(metric_value(s, "fathom_kv_blocks_used"), 0);
    EXPECT_EQ(metric_value(s, "fathom_kv_blocks_used"), metric_value(s, "fathom_kv_blocks_cached"));
    auto props = json::parse(s.client().Get("/props")->body);
    EXPECT_EQ(props["kv_pool"]["blocks_total"], 512);
    auto body = s.client().Get("/metrics")->body;
    EXPECT_NE(body.find("fathom_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"), std::string::npos);
    EXPECT_NE(body.find("# TYPE fathom_token_latency_seconds histogram"), std::string::npos);
}

namespace {
// Sends a raw HTTP request, reads `read_bytes` of the answer (0 = none), then closes the socket.
void request_then_hang_up(int port, const std::string &body, size_t read_bytes, std::chrono::milliseconds wait) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)), 0);
    const std::string req = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    ASSERT_EQ(send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
    size_t got = 0;
    char buf[256];
    while (got < read_bytes) {
        const ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) break;
        got += size_t(n);
    }
    std::this_thread::sleep_for(wait);
    close(fd);
}

bool wait_for(const live_server &s, const std::string &metric, double value) {
    for (int i = 0; i < 100; ++i) {
        if (metric_value(s, metric) == value) return true;
        std::this_thread::sleep_for(50ms);
    }
    return false;
}
}  // namespace

TEST(Http, DisconnectCancelsAndFreesSlot) {
    live_server s("", 4096, 1000, 2);
    // Streaming: read the first bytes, hang up.
    request_then_hang_up(s.port, chat_body("LOOP", {{"stream", true}}).dump(), 200, 0ms);
    EXPECT_TRUE(wait_for(s, "fathom_requests_cancelled_total", 1));
    // Non-streaming: hang up while it generates.
    request_then_hang_up(s.port, chat_body("LOOP").dump(), 0, 200ms);
    EXPECT_TRUE(wait_for(s, "fathom_requests_cancelled_total", 2));
    EXPECT_TRUE(wait_for(s, "fathom_slots_busy", 0));
    json ok = post_json(s, "/v1/chat/completions", chat_body("next"), 200);
    EXPECT_EQ(ok["choices"][0]["message"]["content"], "next");
}

TEST(Http, ConcurrentRequests) {
    live_server s("", 4096, 200, 3);
    std::vector<std::thread> th;
    std::vector<std::string> got(10);
    for (size_t i = 0; i < got.size(); ++i)
        th.emplace_back([&, i] {
            json r = post_json(s, "/v1/chat/completions", chat_body("req " + std::to_string(i)), 200);
            got[i] = r["choices"][0]["message"]["content"].get<std::string>();
        });
    for (auto &t : th) t.join();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], "req " + std::to_string(i));
}
