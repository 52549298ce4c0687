// Thinking mode: the reasoning/content split of generated text (chat/reasoning.h), the thinking
// budget's forced tokens (think_control in fathom/sampling.h), and the server end to end with the
// fake engine (fake_engine.h: with thinking on its generation prompt is "[assistant]<think>\x02",
// so the echoed user text is reasoning up to a "</think>" in it; "LOOP" emits 'x' forever).
// Expected values are worked out by hand from the rules in reasoning.h, sampling.h and
// docs/server.md "Thinking"; the streamed event sequences are the ones OpenAI and Anthropic document.
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <thread>

#include "chat/reasoning.h"
#include "engine/fake_engine.h"
#include "fake_http.h"
#include "fathom/sampling.h"
#include "server/http_server.h"

using namespace fathom;
using json = nlohmann::json;

namespace {

chat::reasoning_delta split_pieces(const std::vector<std::string> &pieces, bool in_reasoning) {
    chat::reasoning_splitter sp(in_reasoning);
    chat::reasoning_delta all;
    for (const auto &p : pieces) {
        const auto d = sp.push(p);
        all.reasoning += d.reasoning;
        all.content += d.content;
    }
    const auto d = sp.flush();
    return {all.reasoning + d.reasoning, all.content + d.content};
}

}  // namespace

TEST(Reasoning, SplitsAtCloseMarker) {
    const auto d = chat::split_reasoning("Let me see.</think>The answer.", true);
    EXPECT_EQ(d.reasoning, "Let me see.");
    EXPECT_EQ(d.content, "The answer.");
}

// The marker arrives in pieces (a tokenizer without a "</think>" token, or a split release): nothing
// of it is emitted on either side, and the reasoning before it is released at once.
TEST(Reasoning, MarkerSplitAcrossTokens) {
    chat::reasoning_splitter sp(true);
    auto d = sp.push("abc</th");
    EXPECT_EQ(d.reasoning, "abc");
    EXPECT_EQ(d.content, "");
    d = sp.push("ink");
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "");
    d = sp.push(">de");
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "de");
    EXPECT_TRUE(sp.closed());
    d = sp.push("f</think>");  // a second marker is content
    EXPECT_EQ(d.content, "f</think>");
    // A partial marker that turns out not to be one goes back to the reasoning.
    chat::reasoning_splitter sp2(true);
    EXPECT_EQ(sp2.push("x</thin").reasoning, "x");
    d = sp2.push("g");
    EXPECT_EQ(d.reasoning, "</thing");
}

// Every split of the text into two pieces, and byte by byte, gives the whole-text result.
TEST(Reasoning, SplitInvariance) {
    const std::string texts[] = {"R1 </think>C1", "\n<think>abc</think>\n\ndef", "no think here", "<think>never closed </th"};
    for (const std::string &t : texts)
        for (bool in : {true, false}) {
            const auto whole = chat::split_reasoning(t, in);
            for (size_t k = 0; k <= t.size(); ++k) {
                const auto d = split_pieces({t.substr(0, k), t.substr(k)}, in);
                EXPECT_EQ(d.reasoning, whole.reasoning) << t << " @" << k;
                EXPECT_EQ(d.content, whole.content) << t << " @" << k;
            }
            std::vector<std::string> bytes;
            for (char c : t) bytes.emplace_back(1, c);
            const auto d = split_pieces(bytes, in);
            EXPECT_EQ(d.reasoning, whole.reasoning) << t;
            EXPECT_EQ(d.content, whole.content) << t;
        }
}

// A stream that never closes the block is all reasoning, the held partial marker included.
TEST(Reasoning, NeverClosedIsAllReasoning) {
    chat::reasoning_splitter sp(true);
    EXPECT_EQ(sp.push("thinking on and on </thi").reasoning, "thinking on and on ");
    const auto d = sp.flush();
    EXPECT_EQ(d.reasoning, "</thi");
    EXPECT_EQ(d.content, "");
    EXPECT_FALSE(sp.closed());
}

// Outside a block: leading whitespace then "<think>" opens one (Qwen3-style models, and DS4 with
// the marker forced as the first generated token); anything else is content from the first byte.
TEST(Reasoning, OpeningDetection) {
    auto d = chat::split_reasoning("\n<think>\nplan\n</think>\n\nanswer", false);
    EXPECT_EQ(d.reasoning, "\nplan\n");
    EXPECT_EQ(d.content, "\n\nanswer");
    d = chat::split_reasoning("Hello <think>x</think>", false);
    EXPECT_EQ(d.reasoning, "");
    EXPECT_EQ(d.content, "Hello <think>x</think>");
    d = chat::split_reasoning("<thi", false);  // ends while it could still open
    EXPECT_EQ(d.content, "<thi");
    chat::reasoning_splitter sp(false);
    EXPECT_EQ(sp.push("  <th").content, "");  // held: could open
    EXPECT_FALSE(sp.in_reasoning());
    d = sp.push("ink>r");
    EXPECT_EQ(d.reasoning, "r");
    EXPECT_TRUE(sp.in_reasoning());
}

// Hand-worked: open = [7], close = [1, 2] (a two-token "</think>"), budget 3.
TEST(ThinkControl, BudgetForcesClose) {
    think_control c;
    c.open = {7};
    c.close = {1, 2};
    c.budget = 3;
    using v = std::vector<int32_t>;
    EXPECT_EQ(c.forced(v{}), 7);                         // the open marker comes first
    EXPECT_EQ(c.forced(v{7}), -1);                       // thinking: sampled
    EXPECT_EQ(c.forced(v{7, 40, 41}), -1);               // 2 of 3 spent
    EXPECT_EQ(c.forced(v{7, 40, 41, 42}), 1);            // 3 spent: close, first token
    EXPECT_EQ(c.forced(v{7, 40, 41, 42, 1}), 2);         // its second token
    EXPECT_EQ(c.forced(v{7, 40, 41, 42, 1, 2}), -1);     // closed: the answer is sampled
    EXPECT_EQ(c.forced(v{7, 40, 41, 42, 1, 2, 50, 51, 52}), -1);
    EXPECT_EQ(c.forced(v{7, 40, 41, 1}), 2);             // the model began the close itself at the limit
    EXPECT_EQ(c.forced(v{7, 1, 2, 40, 41, 42, 43}), -1); // closed early by the model
    c.budget = 0;
    EXPECT_EQ(c.forced(v{7}), 1);  // no thinking at all
    c.budget = -1;
    EXPECT_EQ(c.forced(v{7, 40, 41, 42, 43, 44}), -1);  // no budget
    think_control none;
    EXPECT_EQ(none.forced(v{}), -1);
}

namespace {

struct thinking_server : test::fake_http {
    static sched::scheduler_options sopts() {
        sched::scheduler_options o;
        o.n_slots = 2;
        return o;
    }
    static server::server_options hopts(chat_thinking reasoning, int64_t budget) {
        server::server_options o;
        o.reasoning = reasoning;
        o.reasoning_budget = budget;
        return o;
    }
    explicit thinking_server(chat_thinking reasoning = chat_thinking::template_default, int64_t budget = -1)
        : fake_http(4096, 0, sopts(), hopts(reasoning, budget)) {}
    httplib::Result post(const std::string &path, const json &body) const {
        return client().Post(path.c_str(), body.dump(), "application/json");
    }
    json ok(const std::string &path, const json &body) const {
        auto r = post(path, body);
        EXPECT_TRUE(r);
        if (!r) return {};
        EXPECT_EQ(r->status, 200) << r->body;
        return json::parse(r->body, nullptr, false);
    }
};

// SSE body -> (event name, data JSON) frames; OpenAI's "[DONE]" becomes data "DONE".
std::vector<std::pair<std::string, json>> frames(const std::string &body) {
    std::vector<std::pair<std::string, json>> out;
    for (size_t pos = 0; pos < body.size();) {
        const size_t end = body.find("\n\n", pos);
        if (end == std::string::npos) break;
        const std::string f = body.substr(pos, end - pos);
        pos = end + 2;
        std::string name;
        json data;
        for (size_t lp = 0; lp < f.size();) {
            size_t le = f.find('\n', lp);
            if (le == std::string::npos) le = f.size();
            const std::string line = f.substr(lp, le - lp);
            if (line.rfind("event: ", 0) == 0) name = line.substr(7);
            if (line.rfind("data: ", 0) == 0)
                data = line == "data: [DONE]" ? json("DONE") : json::parse(line.substr(6), nullptr, false);
            lp = le + 1;
        }
        out.emplace_back(name, data);
    }
    return out;
}

json chat_req(const std::string &user, json extra) {
    json b = {{"model", "fake-model"}, {"messages", json::array({{{"role", "user"}, {"content", user}}})},
              {"temperature", 0}};
    for (auto &[k, v] : extra.items()) b[k] = v;
    return b;
}

json messages(const std::string &user, json extra) {
    json b = chat_req(user, std::move(extra));
    if (!b.contains("max_tokens")) b["max_tokens"] = 100;
    return b;
}

}  // namespace

TEST(ThinkingHttp, OpenAIReasoningContent) {
    thinking_server s;
    json r = s.ok("/v1/chat/completions", chat_req("plan A</think>Answer", {{"reasoning_effort", "high"}}));
    EXPECT_EQ(r["choices"][0]["message"]["reasoning_content"], "plan A");
    EXPECT_EQ(r["choices"][0]["message"]["content"], "Answer");
    // reasoning_effort none (and no field: the fake's default) render without thinking: no split.
    r = s.ok("/v1/chat/completions", chat_req("plan A</think>Answer", {{"reasoning_effort", "none"}}));
    EXPECT_FALSE(r["choices"][0]["message"].contains("reasoning_content"));
    EXPECT_EQ(r["choices"][0]["message"]["content"], "plan A</think>Answer");
    // The earlier turn's reasoning sent back is accepted and dropped.
    json b = chat_req("q2", {{"reasoning_effort", "low"}});
    b["messages"] = json::array({{{"role", "user"}, {"content", "q1"}},
                                 {{"role", "assistant"}, {"content", "a1"}, {"reasoning_content", "r1"}},
                                 {{"role", "user"}, {"content", "R</think>C"}}});
    r = s.ok("/v1/chat/completions", b);
    EXPECT_EQ(r["choices"][0]["message"]["reasoning_content"], "R");
    EXPECT_EQ(r["choices"][0]["message"]["content"], "C");
}

// A "<think>" the messages hold (not the generation prompt's) opens nothing: no split.
TEST(ThinkingHttp, ThinkMarkerInMessagesIsText) {
    thinking_server s;
    const json r = s.ok("/v1/chat/completions", chat_req("<think>abc", json::object()));
    EXPECT_FALSE(r["choices"][0]["message"].contains("reasoning_content"));
    EXPECT_EQ(r["choices"][0]["message"]["content"], "<think>abc");
}

// Stream: role chunk, reasoning_content deltas, content deltas, finish chunk, [DONE].
TEST(ThinkingHttp, OpenAIStream) {
    thinking_server s;
    auto res = s.post("/v1/chat/completions", chat_req("ab</think>cd", {{"reasoning_effort", "medium"}, {"stream", true}}));
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200);
    const auto fs = frames(res->body);
    ASSERT_GE(fs.size(), 4u);
    EXPECT_EQ(fs.front().second["choices"][0]["delta"]["role"], "assistant");
    EXPECT_EQ(fs.back().second, "DONE");
    std::string reasoning, content, order;
    for (size_t i = 1; i + 1 < fs.size(); ++i) {
        const json &d = fs[i].second["choices"][0]["delta"];
        if (d.contains("reasoning_content")) {
            reasoning += d["reasoning_content"].get<std::string>();
            order += 'r';
        }
        if (d.contains("content") && !d["content"].get<std::string>().empty()) {
            content += d["content"].get<std::string>();
            order += 'c';
        }
    }
    EXPECT_EQ(reasoning, "ab");
    EXPECT_EQ(content, "cd");
    EXPECT_EQ(order.find("cr"), std::string::npos) << order;  // no reasoning after content
    EXPECT_EQ(fs[fs.size() - 2].second["choices"][0]["finish_reason"], "stop");
}

// Anthropic: a thinking block (start, thinking_delta..., signature_delta, stop), then the text block.
TEST(ThinkingHttp, AnthropicThinkingBlocks) {
    thinking_server s;
    const json th = {{"type", "enabled"}, {"budget_tokens", 1000}};
    json r = s.ok("/v1/messages", messages("why</think>because", {{"thinking", th}}));
    ASSERT_EQ(r["content"].size(), 2u);
    EXPECT_EQ(r["content"][0]["type"], "thinking");
    EXPECT_EQ(r["content"][0]["thinking"], "why");
    EXPECT_TRUE(r["content"][0].contains("signature"));
    EXPECT_EQ(r["content"][1], json({{"type", "text"}, {"text", "because"}}));
    auto res = s.post("/v1/messages", messages("why</think>because", {{"thinking", th}, {"stream", true}}));
    ASSERT_TRUE(res);
    std::vector<std::string> seq;
    std::string thinking, text;
    for (const auto &[name, d] : frames(res->body)) {
        EXPECT_EQ(d["type"], name);
        std::string e = name;
        if (name == "content_block_start") e += ":" + d["content_block"]["type"].get<std::string>() + ":" + d["index"].dump();
        if (name == "content_block_delta") {
            const std::string t = d["delta"]["type"];
            if (t == "thinking_delta") thinking += d["delta"]["thinking"].get<std::string>();
            if (t == "text_delta") text += d["delta"]["text"].get<std::string>();
            e = t + ":" + d["index"].dump();
        }
        if (name == "content_block_stop") e += ":" + d["index"].dump();
        if (seq.empty() || seq.back() != e) seq.push_back(e);  // runs of deltas collapse
    }
    const std::vector<std::string> expect = {
        "message_start", "ping", "content_block_start:thinking:0", "thinking_delta:0", "signature_delta:0",
        "content_block_stop:0", "content_block_start:text:1", "text_delta:1", "content_block_stop:1",
        "message_delta", "message_stop"};
    EXPECT_EQ(seq, expect);
    EXPECT_EQ(thinking, "why");
    EXPECT_EQ(text, "because");
    // Earlier thinking blocks in the history are accepted (and dropped from the prompt).
    json b = messages("x", {{"thinking", th}});
    b["messages"] = json::array(
        {{{"role", "user"}, {"content", "q"}},
         {{"role", "assistant"}, {"content", json::array({{{"type", "thinking"}, {"thinking", "t"}, {"signature", ""}},
                                                         {{"type", "text"}, {"text", "a"}}})}},
         {{"role", "user"}, {"content", "y</think>z"}}});
    r = s.ok("/v1/messages", b);
    EXPECT_EQ(r["content"][0]["thinking"], "y");
}

// Budget 5 on an endless thinker ("LOOP": 'x' forever): 5 reasoning tokens, then the 8 tokens of
// "</think>" forced (the fake's tokens are bytes), then the answer until max_tokens (20): 7 'x'.
TEST(ThinkingHttp, BudgetForcesEndOfThinking) {
    thinking_server s;
    json r = s.ok("/v1/messages", messages("LOOP", {{"thinking", {{"type", "enabled"}, {"budget_tokens", 5}}}, {"max_tokens", 20}}));
    ASSERT_EQ(r["content"].size(), 2u);
    EXPECT_EQ(r["content"][0]["thinking"], "xxxxx");
    EXPECT_EQ(r["content"][1]["text"], "xxxxxxx");
    EXPECT_EQ(r["usage"]["output_tokens"], 20);
    // The server default (--reasoning on --reasoning-budget 3) applies to requests that set nothing.
    thinking_server d(chat_thinking::on, 3);
    r = d.ok("/v1/chat/completions", chat_req("LOOP", {{"max_tokens", 15}}));
    EXPECT_EQ(r["choices"][0]["message"]["reasoning_content"], "xxx");
    EXPECT_EQ(r["choices"][0]["message"]["content"], "xxxx");
    // A stream that never closes the block (budget larger than max_tokens): all reasoning.
    r = s.ok("/v1/chat/completions", chat_req("LOOP", {{"max_tokens", 6}, {"reasoning_effort", "high"}}));
    EXPECT_EQ(r["choices"][0]["message"]["reasoning_content"], "xxxxxx");
    EXPECT_EQ(r["choices"][0]["message"]["content"], "");
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
}

// Bad thinking fields: 400 naming the field, nothing generated, the server keeps serving.
TEST(ThinkingHttp, BadInputIs400) {
    thinking_server s;
    auto bad = [&](const std::string &path, const json &body, const std::string &param) {
        auto r = s.post(path, body);
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << r->body;
        const json j = json::parse(r->body, nullptr, false);
        const std::string msg = j["error"]["message"];
        EXPECT_NE(msg.find(param.substr(0, param.find('.'))), std::string::npos) << msg;
        if (path == "/v1/chat/completions") {
            EXPECT_EQ(j["error"]["param"], param);
        }
    };
    bad("/v1/chat/completions", chat_req("hi", {{"reasoning_effort", "extreme"}}), "reasoning_effort");
    bad("/v1/chat/completions", chat_req("hi", {{"reasoning_effort", 3}}), "reasoning_effort");
    bad("/v1/messages", messages("hi", {{"thinking", {{"type", "enabled"}, {"budget_tokens", 0}}}}), "thinking.budget_tokens");
    bad("/v1/messages", messages("hi", {{"thinking", {{"type", "enabled"}, {"budget_tokens", -5}}}}), "thinking.budget_tokens");
    bad("/v1/messages", messages("hi", {{"thinking", {{"type", "enabled"}, {"budget_tokens", 5000}}}}),
        "thinking.budget_tokens");  // the context is 4096
    bad("/v1/messages", messages("hi", {{"thinking", {{"type", "sometimes"}}}}), "thinking.type");
    bad("/v1/messages", messages("hi", {{"thinking", "yes"}}), "thinking");
    bad("/v1/chat/completions", chat_req("hi", {{"reasoning_effort", "low"}, {"thinking", {{"type", "enabled"}}}}), "thinking");
    EXPECT_EQ(s.sch.stats().generated_tokens, 0u);
    const json r = s.ok("/v1/chat/completions", chat_req("fine", json::object()));
    EXPECT_EQ(r["choices"][0]["message"]["content"], "fine");
}
