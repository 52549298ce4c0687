// The generating endpoints: request -> prompt tokens -> scheduler job -> response, for
// /v1/chat/completions, /v1/completions and /v1/messages, streamed (SSE) or not. The stream
// writers own each API's wire format; the driver owns hold-back of tool-call markup, logprobs
// forwarding and cancellation when the client goes away.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <functional>
#include <future>
#include <optional>

#include "chat/reasoning.h"
#include "server/server_impl.h"
#include "server/tool_stream.h"
#include "server/structured.h"

namespace fathom::server {

using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

bool all_space(std::string_view s) {
    return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; });
}

// The thinking mode of a request: its own, else the server's; DS4's Think-Max falls back to plain
// thinking below the 384K context the model card asks for (as antirez/ds4 does).
chat_thinking thinking_mode(const server_context &ctx, const gen_request &r) {
    chat_thinking t = r.thinking ? *r.thinking : ctx.opts.reasoning;
    if (t == chat_thinking::max && ctx.sch.n_ctx() < 384 * 1024) t = chat_thinking::on;
    return t;
}

// Chat request -> prompt tokens, with the thinking set-up. A rendered prompt that ends with an open
// "<think>" (DS4's thinking generation prefix "<｜Assistant｜><think>") is cut before it and the
// marker becomes the first generated token (think.open): the prompt then ends at "<｜Assistant｜>",
// which every later turn's prompt starts with, although that turn renders this one as
// "<｜Assistant｜></think>answer" (its reasoning dropped). So the state the scheduler saves for the
// prompt (the disk prompt cache keeps DS4 prompts alone) stays a prefix of the next turn's prompt.
// Only a "<think>" of the generation prompt counts (the part the rendering without it lacks), not
// one the messages hold.
void build_chat_prompt(server_context &ctx, prepared &p, bool count_only) {
    const chat_thinking mode = thinking_mode(ctx, p.r);
    std::string text = ctx.eng.apply_chat_template(p.r.messages, true, mode);
    const std::string base = ctx.eng.apply_chat_template(p.r.messages, false, mode);
    const size_t gen = static_cast<size_t>(std::mismatch(base.begin(), base.end(), text.begin(), text.end()).second - text.begin());
    const size_t open = text.rfind(chat::k_think_open), close = text.rfind(chat::k_think_close);
    p.in_reasoning = open != std::string::npos && open >= gen && (close == std::string::npos || close < open);
    p.reasoning = p.in_reasoning || mode == chat_thinking::on || mode == chat_thinking::max;
    if (p.in_reasoning && !count_only && all_space(std::string_view(text).substr(open + chat::k_think_open.size()))) {
        p.think.open = ctx.eng.tokenize(std::string_view(text).substr(open), false, true);
        text.resize(open);
        p.in_reasoning = false;  // the output opens the block itself (the forced marker)
    }
    p.prompt = ctx.eng.tokenize(text, true, true);
    const int32_t bos = ctx.eng.bos_token();  // a template that writes BOS itself: keep one
    if (bos >= 0 && p.prompt.size() >= 2 && p.prompt[0] == bos && p.prompt[1] == bos) p.prompt.erase(p.prompt.begin());
    if (count_only) return;
    const int64_t budget = p.r.think_budget > 0 ? p.r.think_budget : ctx.opts.reasoning_budget;
    if (p.r.think_budget > ctx.sch.n_ctx())
        bad_request("'thinking.budget_tokens' is " + std::to_string(p.r.think_budget) + " but the context is " +
                        std::to_string(ctx.sch.n_ctx()) + " tokens",
                    "thinking.budget_tokens");
    // Enforced where the prompt opens the block (DS4; templates ending in "<think>"): a model that
    // opens it itself (Qwen3) might not, and a forced "</think>" would then land in the answer.
    if (p.reasoning && budget > 0 && (p.in_reasoning || !p.think.open.empty())) {
        p.think.budget = int32_t(budget);
        p.think.close = ctx.eng.tokenize(chat::k_think_close, false, true);
    }
}

// An engine or loader message as a client may see it: every absolute path ('/a/b/file', also inside
// quotes) shortened to its last component, so errors never reveal where files lie on the server.
std::string client_text(const std::string &msg) {
    std::string out;
    for (size_t i = 0; i < msg.size();) {
        const bool starts = msg[i] == '/' && (i == 0 || msg[i - 1] == ' ' || msg[i - 1] == '\'' || msg[i - 1] == '"' ||
                                              msg[i - 1] == '(' || msg[i - 1] == '=');
        if (!starts) {
            out += msg[i++];
            continue;
        }
        size_t end = i;
        while (end < msg.size() && msg[end] != ' ' && msg[end] != '\'' && msg[end] != '"' && msg[end] != ')' &&
               msg[end] != ',' && msg[end] != ':')
            ++end;
        const std::string path = msg.substr(i, end - i);
        const size_t last = path.rfind('/');
        out += last == 0 ? path : path.substr(last + 1);  // '/x' (one component) is not a path we hide
        i = end;
    }
    return out;
}

bool call_forced(const gen_request &r) {
    return r.tools_active() && (r.choice.kind == tool_choice::required || r.choice.kind == tool_choice::function);
}

// tool_choice required / named function: the prompt ends inside the opening of a call (the
// format's forced_call_prefix), so the model can only continue the call.
void force_call(server_context &ctx, prepared &p) {
    p.forced = ctx.fmt->forced_call_prefix(p.r.choice);
    if (p.forced.empty())
        bad_request("tool_choice '" + std::string(p.r.choice.kind == tool_choice::required ? "required" : p.r.choice.name) +
                        "' cannot be enforced with the '" + ctx.fmt->name() + "' tool format",
                    "tool_choice");
    // Special markers parsed: the opening is what the model would have generated (DSML's "｜DSML｜" and
    // Qwen's <tool_call> are special tokens), like the rest of the rendered prompt.
    const std::vector<int32_t> extra = ctx.eng.tokenize(p.forced, false, true);
    p.prompt.insert(p.prompt.end(), extra.begin(), extra.end());
    // The rest of the call is constrained: its arguments follow the tool's schema (structured.h).
    if (auto g = forced_call_grammar(p.r.tools, p.r.choice, *ctx.fmt)) p.r.grammar = std::move(g);
}

// PFlash (when the request's settings compress this prompt), then the context check. Throws api_error.
void compress_prompt(server_context &ctx, prepared &p) {
    const int n_ctx = ctx.sch.n_ctx();
    try {
        p.compression = ctx.compressor->apply(ctx.eng, p.prompt, n_ctx, p.r.compression);
    } catch (const error &e) {
        throw api_error(500, "server_error", "prompt compression failed: " + client_text(e.what()));
    }
    if (int64_t(p.prompt.size()) >= n_ctx)
        throw api_error(400, "invalid_request_error",
                        "the prompt is " + std::to_string(p.prompt.size()) + " tokens but the context is " +
                            std::to_string(n_ctx) + " tokens (prompt plus at least one generated token)",
                        p.r.kind == api_kind::openai_completion ? "prompt" : "messages");
}

// Request body -> validated request and prompt tokens. Throws api_error.
prepared prepare(server_context &ctx, const std::string &body_text, api_kind kind, bool count_only) {
    prepared p;
    const json body = parse_body(body_text);
    if (kind == api_kind::openai_chat) p.r = parse_openai_chat(body, ctx.opts.defaults, *ctx.fmt);
    else if (kind == api_kind::openai_completion) p.r = parse_openai_completion(body, ctx.opts.defaults);
    else p.r = parse_anthropic(body, ctx.opts.defaults, *ctx.fmt, count_only);
    const auto &ids = ctx.opts.model_ids;
    if (!p.r.model.empty() && std::find(ids.begin(), ids.end(), p.r.model) == ids.end())
        throw api_error(404, "not_found_error", "the model '" + p.r.model + "' does not exist (this server serves '" +
                                                    ids.front() + "')", "model");
    p.model_id = p.r.model.empty() ? ids.front() : p.r.model;
    try {
        if (kind == api_kind::openai_completion) {
            p.prompt = p.r.prompt_is_tokens ? p.r.prompt_tokens : ctx.eng.tokenize(p.r.prompt_text, true, true);
        } else {
            build_chat_prompt(ctx, p, count_only);
            if (call_forced(p.r)) {
                // The call's opening ends the prompt: a thinking block the output would open first
                // (the forced "<think>") cannot come before it.
                if (!p.think.open.empty())
                    bad_request("tool_choice forcing a call cannot be combined with thinking mode (turn thinking off "
                                "for this request)",
                                "tool_choice");
                force_call(ctx, p);
            }
        }
    } catch (const error &e) {
        bad_request("cannot build the prompt: " + client_text(e.what()));
    }
    if (count_only) return p;
    if (p.prompt.empty()) bad_request("the prompt is empty", "prompt");
    try {
        ctx.compressor->check(p.r.compression);  // an override this server cannot honour: 400 before any work
        p.defer_compression =
            p.r.stream && ctx.compressor->would_compress(int64_t(p.prompt.size()), ctx.sch.n_ctx(), p.r.compression);
    } catch (const error &e) {
        bad_request(client_text(e.what()), "prefill_compression");
    }
    if (!p.defer_compression) compress_prompt(ctx, p);
    return p;
}

std::shared_ptr<sched::job> submit(server_context &ctx, prepared &p) {
    sched::request sr;
    sr.prompt = p.prompt;
    sr.sampling = p.r.sampling;
    const int32_t room = int32_t(ctx.sch.n_ctx() - int64_t(p.prompt.size()));
    sr.max_tokens = p.r.max_tokens < 0 ? room : p.r.max_tokens;
    sr.stop = p.r.stop;
    sr.want_logprobs = p.r.logprobs;
    sr.thinking = p.think;
    sr.draft_max = p.r.draft_max;
    sr.grammar = p.r.grammar;
    // With the output opening a thinking block, the document starts after its end marker.
    if (sr.grammar && p.reasoning && (p.in_reasoning || !p.think.open.empty())) sr.grammar_after = chat::k_think_close;
    try {
        return ctx.sch.submit(std::move(sr));
    } catch (const sched::queue_full &e) {
        // the slots and the queue are full: a client may retry once a request has finished
        api_error busy(503, "overloaded_error", e.what());
        busy.retry_after_s = 1;
        throw busy;
    } catch (const error &e) {
        bad_request(e.what());
    }
}

json token_bytes(const std::string &piece) {
    json b = json::array();
    for (unsigned char c : piece) b.push_back(int(c));
    return b;
}

// OpenAI chat logprobs entries for tokens.
json chat_logprobs(const engine &eng, const std::vector<sched::token_info> &toks) {
    json content = json::array();
    for (const auto &t : toks) {
        const std::string piece = eng.token_to_piece(t.id);
        json top = json::array();
        for (const auto &alt : t.top) {
            const std::string ap = eng.token_to_piece(alt.token);
            top.push_back({{"token", ap}, {"logprob", alt.logprob}, {"bytes", token_bytes(ap)}});
        }
        content.push_back({{"token", piece}, {"logprob", t.logprob}, {"bytes", token_bytes(piece)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
}

// Legacy completions logprobs; text_offset counts bytes from `offset` (text already sent).
json completion_logprobs(const engine &eng, const std::vector<sched::token_info> &toks, size_t &offset) {
    json tokens = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
    for (const auto &t : toks) {
        const std::string piece = eng.token_to_piece(t.id);
        tokens.push_back(piece);
        lps.push_back(t.logprob);
        json top = json::object();
        for (const auto &alt : t.top) top[eng.token_to_piece(alt.token)] = alt.logprob;
        tops.push_back(top);
        offs.push_back(offset);
        offset += piece.size();
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

const char *openai_finish(const sched::event &ev, bool calls) {
    if (calls) return "tool_calls";
    return ev.reason == sched::finish_reason::length ? "length" : "stop";
}

const char *anthropic_stop(const sched::event &ev, bool calls) {
    if (calls) return "tool_use";
    if (ev.reason == sched::finish_reason::length) return "max_tokens";
    if (ev.reason == sched::finish_reason::stop_string) return "stop_sequence";
    return "end_turn";
}

// PFlash's report in `usage` (present only when the prompt was compressed): prompt_tokens counts
// the effective (kept) tokens, the tokens actually in the context.
void add_compression(json &usage, const compression_outcome &c) {
    if (!c.applied) return;
    usage["prefill_compression"] = {{"original_prompt_tokens", c.n_original},
                                    {"effective_prompt_tokens", c.n_effective},
                                    {"keep_ratio", c.keep_ratio},
                                    {"seconds", c.seconds}};
}

json openai_usage(const sched::event &ev, const prepared &p) {
    json u = {{"prompt_tokens", ev.n_prompt},
              {"completion_tokens", ev.n_generated},
              {"total_tokens", ev.n_prompt + ev.n_generated},
              {"prompt_tokens_details", {{"cached_tokens", ev.n_reused}}}};
    // Speculative decoding, in OpenAI's Predicted Outputs fields: drafts kept and drafts rejected.
    if (ev.n_drafted > 0)
        u["completion_tokens_details"] = {{"accepted_prediction_tokens", ev.n_accepted},
                                          {"rejected_prediction_tokens", ev.n_drafted - ev.n_accepted}};
    add_compression(u, p.compression);
    return u;
}

json anthropic_usage(int64_t input, int64_t output, const prepared &p) {
    json u = {{"input_tokens", input}, {"output_tokens", output}};
    add_compression(u, p.compression);
    return u;
}

json openai_tool_calls(const std::vector<tool_call> &calls, bool with_index) {
    json arr = json::array();
    for (size_t i = 0; i < calls.size(); ++i) {
        json c = {{"id", calls[i].id}, {"type", "function"},
                  {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
        if (with_index) c["index"] = i;
        arr.push_back(c);
    }
    return arr;
}

std::string trim_copy(const std::string &s) {
    size_t a = 0, b = s.size();
    while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    return s.substr(a, b - a);
}

// ---------------------------------------------------------------------------------------------
// Stream writers: each turns driver callbacks into the API's SSE frames.
// ---------------------------------------------------------------------------------------------

struct stream_writer {
    virtual ~stream_writer() = default;
    virtual std::string begin() = 0;
    virtual std::string delta(const std::string &text, const std::vector<sched::token_info> &lps) = 0;
    // Reasoning text (before any content delta; docs/server.md "Thinking").
    virtual std::string reasoning(const std::string &text, const std::vector<sched::token_info> &lps) = 0;
    // A streamed tool call's event (call_stream: begin with id and name, argument fragments, end).
    virtual std::string call(const call_event &e) = 0;
    // The end of the turn: the content not yet sent, then the finish frames; `called`: the turn ends
    // in tool calls (finish_reason tool_calls / stop_reason tool_use).
    virtual std::string finish(const std::string &rest, const std::vector<sched::token_info> &lps, bool called,
                               const sched::event &ev) = 0;
    virtual std::string fail(const std::string &msg) = 0;
};

struct openai_writer : stream_writer {
    const engine &eng;
    const prepared &p;
    bool chat;
    std::string id;
    int64_t created = int64_t(std::time(nullptr));
    size_t offset = 0;  // completions text_offset
    openai_writer(const engine &e, const prepared &pp, bool c)
        : eng(e), p(pp), chat(c), id(random_id(c ? "chatcmpl-" : "cmpl-")) {}

    json chunk(json choice) const {
        choice["index"] = 0;
        return {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
                {"model", p.model_id}, {"choices", json::array({choice})}};
    }
    json lp(const std::vector<sched::token_info> &lps) {
        if (!p.r.logprobs) return nullptr;
        return chat ? chat_logprobs(eng, lps) : completion_logprobs(eng, lps, offset);
    }
    std::string text_chunk(const std::string &text, const std::vector<sched::token_info> &lps) {
        json c = chat ? json{{"delta", {{"content", text}}}} : json{{"text", text}};
        c["logprobs"] = lp(lps);
        c["finish_reason"] = nullptr;
        return sse_data(dump_json(chunk(c)));
    }
    std::string begin() override {
        if (!chat) return {};
        return sse_data(dump_json(chunk({{"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                                         {"finish_reason", nullptr}})));
    }
    std::string delta(const std::string &text, const std::vector<sched::token_info> &lps) override {
        return text_chunk(text, lps);
    }
    std::string reasoning(const std::string &text, const std::vector<sched::token_info> &lps) override {
        return sse_data(dump_json(chunk({{"delta", {{"reasoning_content", text}}}, {"logprobs", lp(lps)},
                                         {"finish_reason", nullptr}})));
    }
    // delta.tool_calls as OpenAI streams them: the first chunk of a call carries index, id, type,
    // function.name and the arguments so far (often ""), later chunks index and an arguments fragment.
    std::string call(const call_event &e) override {
        json tc = {{"index", e.index}};
        if (e.begin) {
            tc["id"] = e.id;
            tc["type"] = "function";
            tc["function"] = {{"name", e.name}, {"arguments", e.text}};
        } else {
            if (e.text.empty()) return {};  // the end of a call adds nothing OpenAI would send
            tc["function"] = {{"arguments", e.text}};
        }
        return sse_data(dump_json(chunk({{"delta", {{"tool_calls", json::array({tc})}}}, {"logprobs", nullptr},
                                         {"finish_reason", nullptr}})));
    }
    std::string finish(const std::string &rest, const std::vector<sched::token_info> &lps, bool called,
                       const sched::event &ev) override {
        std::string out;
        if (!rest.empty() || !lps.empty()) out += text_chunk(rest, lps);
        json last = chat ? json{{"delta", json::object()}} : json{{"text", ""}};
        last["logprobs"] = nullptr;
        last["finish_reason"] = openai_finish(ev, called);
        out += sse_data(dump_json(chunk(last)));
        if (p.r.include_usage) {
            json u = chunk({});
            u["choices"] = json::array();
            u["usage"] = openai_usage(ev, p);
            out += sse_data(dump_json(u));
        }
        return out + "data: [DONE]\n\n";
    }
    std::string fail(const std::string &msg) override {
        json e = {{"error", {{"message", msg}, {"type", "server_error"}, {"param", nullptr}, {"code", nullptr}}}};
        return sse_data(dump_json(e)) + "data: [DONE]\n\n";
    }
};

struct anthropic_writer : stream_writer {
    const prepared &p;
    std::string id = random_id("msg_");
    int index = 0;
    bool text_open = false;
    bool thinking_open = false;
    bool tool_open = false;
    explicit anthropic_writer(const prepared &pp) : p(pp) {}

    std::string ev(const std::string &name, json data) {
        data["type"] = name;
        return sse_event(name, dump_json(data));
    }
    std::string begin() override {
        json msg = {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", p.model_id},
                    {"content", json::array()}, {"stop_reason", nullptr}, {"stop_sequence", nullptr},
                    {"usage", anthropic_usage(int64_t(p.prompt.size()), 0, p)}};
        return ev("message_start", {{"message", msg}}) + ev("ping", json::object());
    }
    // A thinking block: content_block_start, thinking_delta events, then (close_thinking) a
    // signature_delta and content_block_stop, as Anthropic streams it. The signature is empty: this
    // server does not sign reasoning (and ignores signatures sent back).
    std::string reasoning(const std::string &t, const std::vector<sched::token_info> &) override {
        if (t.empty()) return {};
        std::string out;
        if (!thinking_open) {
            out += ev("content_block_start",
                      {{"index", index}, {"content_block", {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}}});
            thinking_open = true;
        }
        return out + ev("content_block_delta", {{"index", index}, {"delta", {{"type", "thinking_delta"}, {"thinking", t}}}});
    }
    std::string close_thinking() {
        if (!thinking_open) return {};
        thinking_open = false;
        std::string out = ev("content_block_delta", {{"index", index}, {"delta", {{"type", "signature_delta"}, {"signature", ""}}}});
        out += ev("content_block_stop", {{"index", index}});
        ++index;
        return out;
    }
    std::string close_text() {
        if (!text_open) return {};
        text_open = false;
        return ev("content_block_stop", {{"index", index++}});
    }
    std::string close_tool() {
        if (!tool_open) return {};
        tool_open = false;
        return ev("content_block_stop", {{"index", index++}});
    }
    std::string text(const std::string &t) {
        if (t.empty()) return {};
        std::string out = close_thinking() + close_tool();
        if (!text_open) {
            out += ev("content_block_start", {{"index", index}, {"content_block", {{"type", "text"}, {"text", ""}}}});
            text_open = true;
        }
        return out + ev("content_block_delta", {{"index", index}, {"delta", {{"type", "text_delta"}, {"text", t}}}});
    }
    std::string delta(const std::string &t, const std::vector<sched::token_info> &) override { return text(t); }
    // A tool_use block as Anthropic streams it: content_block_start {type tool_use, id, name, input {}},
    // content_block_delta input_json_delta events whose partial_json fragments concatenate to the
    // input's JSON text, content_block_stop when the call is complete.
    std::string call(const call_event &e) override {
        std::string out;
        if (e.begin) {
            out += close_thinking() + close_text() + close_tool();
            out += ev("content_block_start", {{"index", index},
                                              {"content_block", {{"type", "tool_use"}, {"id", e.id}, {"name", e.name},
                                                                 {"input", json::object()}}}});
            tool_open = true;
        }
        if (!e.text.empty())
            out += ev("content_block_delta",
                      {{"index", index}, {"delta", {{"type", "input_json_delta"}, {"partial_json", e.text}}}});
        if (e.end) out += close_tool();
        return out;
    }
    std::string finish(const std::string &rest, const std::vector<sched::token_info> &, bool called,
                       const sched::event &e) override {
        std::string out = text(rest) + close_thinking() + close_text() + close_tool();
        json d = {{"stop_reason", anthropic_stop(e, called)},
                  {"stop_sequence", e.reason == sched::finish_reason::stop_string ? json(e.stop_string) : json()}};
        out += ev("message_delta", {{"delta", d}, {"usage", {{"output_tokens", e.n_generated}}}});
        return out + ev("message_stop", json::object());
    }
    std::string fail(const std::string &msg) override {
        return ev("error", {{"error", {{"type", "api_error"}, {"message", msg}}}});
    }
};

// Parses calls out of the whole output (when tools are active), renaming ids for Anthropic. A
// forced call (tool_choice required / named) that did not come out whole is an error: the API
// promises a call, and the model's text is not one.
parsed_output split_calls(server_context &ctx, const prepared &p, const std::string &text) {
    if (!p.r.tools_active()) return {text, {}};
    const bool named = p.r.choice.kind == tool_choice::function;
    parsed_output out = ctx.fmt->parse(text, named ? std::vector<std::string>{p.r.choice.name} : p.r.tool_names);
    if (call_forced(p.r) && out.calls.empty())
        throw api_error(500, "api_error",
                        "the model did not complete a valid call to " + (named ? "'" + p.r.choice.name + "'" : std::string("a tool")) +
                            " (tool_choice requires one; " + std::to_string(text.size()) + " bytes generated)");
    if (p.r.kind == api_kind::anthropic_messages)
        for (auto &c : out.calls) c.id = random_id("toolu_");
    ctx.fmt->remember_turn(out, text);  // exact replay when the client sends the turn back
    return out;
}

// The token counts of a finished request, for the access log.
void note_tokens(const sched::event &ev) {
    if (connection *c = connection_manager::current()) {
        c->n_prompt = ev.n_prompt;
        c->n_generated = ev.n_generated;
    }
}

// Waits for the job's next event, cancelling it if the client disconnected. false = client gone.
// The connection is checked at least every 100 ms, also while events keep arriving; `idle` (if
// given) runs on every 100 ms without an event and returns false when the client is gone.
bool next_event(sched::job &j, connection_probe &probe, sched::event &ev, const std::function<bool()> &idle = {}) {
    for (;;) {
        const bool got = j.next(ev, 100ms);
        if (probe.due() && !probe.alive()) {
            j.cancel();
            return false;
        }
        if (got) return true;
        if (idle && !idle()) {
            j.cancel();
            return false;
        }
    }
}

// The names whose calls count: the named function for a named tool_choice, else every tool.
std::vector<std::string> call_names(const prepared &p) {
    if (p.r.choice.kind == tool_choice::function) return {p.r.choice.name};
    return p.r.tool_names;
}

std::optional<call_stream> make_call_stream(const server_context &ctx, const prepared &p) {
    if (!p.r.tools_active()) return std::nullopt;
    return std::make_optional<call_stream>(*ctx.fmt, call_names(p),
                                           p.r.kind == api_kind::anthropic_messages ? "toolu_" : "call_",
                                           p.r.parallel_calls);
}

// The turn ends in tool calls (finish_reason tool_calls) unless none is complete, or one was cut off
// by max_tokens / the context (then it is length, as OpenAI reports a truncated call).
bool ends_in_calls(const call_stream &cs, const sched::event &ev) {
    return cs.n_complete() > 0 && !(cs.call_open() && ev.reason == sched::finish_reason::length);
}

// parallel_tool_calls false and the first call complete: the job is cancelled and its remaining
// events drained (the final one carries the usage). false = the client went away.
bool stop_after_first_call(sched::job &j, connection_probe &probe, sched::event &ev) {
    j.cancel();
    while (!ev.final)
        if (!next_event(j, probe, ev)) return false;
    return true;
}

// One streamed response (the content provider's whole run): headers are already out when it starts.
// Long waits — PFlash compressing the prompt, a queued or long prefill — are covered by SSE comment
// frames at least every k_keepalive (docs/server.md "Keepalive and progress"), which every SSE client
// (the official SDKs included) ignores.
class stream_run {
public:
    static constexpr auto k_keepalive = 1s;
    stream_run(server_context &ctx, std::shared_ptr<prepared> p, std::shared_ptr<sched::job> job,
               std::shared_ptr<connection_probe> probe, httplib::DataSink &sink)
        : ctx_(ctx), p_(std::move(p)), job_(std::move(job)), probe_(std::move(probe)), sink_(sink) {
        if (p_->r.kind == api_kind::anthropic_messages) w_ = std::make_unique<anthropic_writer>(*p_);
        else w_ = std::make_unique<openai_writer>(ctx.eng, *p_, p_->r.kind == api_kind::openai_chat);
    }
    // false: the connection is lost.
    bool run() {
        if (!write(w_->begin())) return false;
        if (!job_ && !compress_and_submit()) return sink_ok_;
        return generate();
    }

private:
    bool write(const std::string &s) {
        if (s.empty()) return true;
        last_write_ = std::chrono::steady_clock::now();
        if (sink_.write(s.data(), s.size())) return true;
        if (job_) job_->cancel();
        return sink_ok_ = false;
    }
    // An SSE comment when nothing was written for k_keepalive: "prefill D/T" while the prompt is being
    // evaluated (D prompt tokens in the KV so far, of T), "prefill_compression" while PFlash runs,
    // "keepalive" otherwise.
    bool keepalive(const char *what) {
        if (std::chrono::steady_clock::now() - last_write_ < k_keepalive) return true;
        std::string c = ": ";
        if (!what && job_ && job_->n_prefilled() < int64_t(p_->prompt.size()))
            c += "prefill " + std::to_string(job_->n_prefilled()) + "/" + std::to_string(p_->prompt.size());
        else c += what ? what : "keepalive";
        return write(c + "\n\n");
    }
    bool fail(const std::string &msg) {
        if (!write(w_->fail(msg))) return false;
        sink_.done();
        return true;
    }
    // PFlash deferred past the headers (prepared::defer_compression): compress on a helper thread while
    // keepalives go out, then check the length and submit. Errors become an error frame.
    bool compress_and_submit() {
        auto task = std::async(std::launch::async, [this] { compress_prompt(ctx_, *p_); });
        while (task.wait_for(100ms) != std::future_status::ready) {
            if (!keepalive("prefill_compression")) return false;
            if (probe_->due() && !probe_->alive()) return sink_ok_ = false;  // the task finishes on its own
        }
        try {
            task.get();
            job_ = submit(ctx_, *p_);
        } catch (const api_error &e) {
            fail(e.what());
            return false;  // run() then returns sink_ok_: true when the error frame went out
        }
        return true;
    }
    bool generate();
    bool finish(const std::string &acc, size_t emitted, std::vector<sched::token_info> &lps,
                const std::optional<call_stream> &cs, const sched::event &ev);

    server_context &ctx_;
    std::shared_ptr<prepared> p_;
    std::shared_ptr<sched::job> job_;
    std::shared_ptr<connection_probe> probe_;
    httplib::DataSink &sink_;
    std::unique_ptr<stream_writer> w_;
    std::chrono::steady_clock::time_point last_write_ = std::chrono::steady_clock::now();
    bool sink_ok_ = true;
};

// The event loop: reasoning first, then content; with tools the content goes through call_stream
// (calls streamed as they decode, markup never in the content), else it is sent as it comes.
bool stream_run::generate() {
    std::string acc = p_->forced;  // the forced call opening is part of the turn's text
    size_t emitted = 0;
    std::vector<sched::token_info> lps;
    std::optional<call_stream> cs = make_call_stream(ctx_, *p_);
    std::optional<chat::reasoning_splitter> sp;  // reasoning first, then content (acc)
    if (p_->reasoning) sp.emplace(p_->in_reasoning);
    auto send_calls = [&](std::vector<call_event> &evs) {
        for (const call_event &e : evs) {
            if (!write(e.kind == call_event::call ? w_->call(e) : w_->delta(e.text, lps))) return false;
            if (e.kind == call_event::content) lps.clear();
        }
        return true;
    };
    std::vector<call_event> evs;
    if (cs) cs->push(p_->forced, evs);
    if (!send_calls(evs)) return false;
    const std::function<bool()> idle = [this] { return keepalive(nullptr); };
    sched::event ev;
    for (;;) {
        if (!next_event(*job_, *probe_, ev, idle)) return false;
        if (p_->r.logprobs) lps.insert(lps.end(), ev.tokens.begin(), ev.tokens.end());
        chat::reasoning_delta d = sp ? sp->push(ev.text) : chat::reasoning_delta{{}, ev.text};
        if (sp && ev.final) {
            chat::reasoning_delta f = sp->flush();
            d.reasoning += f.reasoning;
            d.content += f.content;
        }
        if (!d.reasoning.empty()) {
            if (!write(w_->reasoning(d.reasoning, lps))) return false;
            lps.clear();
        }
        acc += d.content;
        if (cs) {
            evs.clear();
            cs->push(d.content, evs);
            if (ev.final) cs->finish(evs);
            if (!send_calls(evs)) return false;
            if (cs->stopped() && !ev.final && !stop_after_first_call(*job_, *probe_, ev)) return false;
        } else if (!ev.final && (!d.content.empty() || !lps.empty())) {
            if (!write(w_->delta(acc.substr(emitted), lps))) return false;
            emitted = acc.size();
            lps.clear();
        }
        if (ev.final) break;
    }
    return finish(acc, emitted, lps, cs, ev);
}

bool stream_run::finish(const std::string &acc, size_t emitted, std::vector<sched::token_info> &lps,
                        const std::optional<call_stream> &cs, const sched::event &ev) {
    note_tokens(ev);
    const bool stopped = cs && cs->stopped();
    if (ev.reason == sched::finish_reason::error) return fail("generation failed: " + client_text(ev.error));
    if (ev.reason == sched::finish_reason::cancelled && !stopped)
        return fail("generation cancelled: the server is shutting down");
    if (cs) {
        if (call_forced(p_->r) && cs->n_complete() == 0)
            return fail("the model did not complete a valid call to " +
                        (p_->r.choice.kind == tool_choice::function ? "'" + p_->r.choice.name + "'" : std::string("a tool")) +
                        " (tool_choice requires one; " + std::to_string(acc.size()) + " bytes generated)");
        // Exact replay keeps the generated text; after a parallel_tool_calls stop it holds more than the
        // turn the client gets, so that turn is not kept.
        if (!stopped) ctx_.fmt->remember_turn(cs->output(), acc);
    }
    const std::string rest = emitted < acc.size() && !cs ? acc.substr(emitted) : std::string();
    if (!write(w_->finish(rest, lps, cs && ends_in_calls(*cs, ev), ev))) return false;
    sink_.done();
    return true;
}

void run_stream(server_context &ctx, httplib::Response &res, std::shared_ptr<prepared> p,
                std::shared_ptr<sched::job> job, std::shared_ptr<connection_probe> probe) {
    server_context *c = &ctx;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [c, p, job, probe](size_t, httplib::DataSink &sink) {
        return stream_run(*c, p, job, probe, sink).run();
    });
}

// out: the reasoning and the whole content; po: the content without call markup and the calls.
json openai_response(server_context &ctx, const prepared &p, const chat::reasoning_delta &out, const parsed_output &po,
                     const std::vector<sched::token_info> &lps, const sched::event &ev) {
    const bool chat = p.r.kind == api_kind::openai_chat;
    json choice = {{"index", 0}, {"finish_reason", openai_finish(ev, !po.calls.empty())}};
    size_t offset = 0;
    choice["logprobs"] = !p.r.logprobs ? json() : chat ? chat_logprobs(ctx.eng, lps) : completion_logprobs(ctx.eng, lps, offset);
    if (chat) {
        json msg = {{"role", "assistant"}};
        if (po.calls.empty()) msg["content"] = po.content;
        else {
            const std::string c = trim_copy(po.content);
            msg["content"] = c.empty() ? json() : json(c);
            msg["tool_calls"] = openai_tool_calls(po.calls, false);
        }
        if (p.reasoning) msg["reasoning_content"] = out.reasoning;
        choice["message"] = msg;
    } else {
        choice["text"] = po.content;
    }
    return {{"id", random_id(chat ? "chatcmpl-" : "cmpl-")}, {"object", chat ? "chat.completion" : "text_completion"},
            {"created", int64_t(std::time(nullptr))}, {"model", p.model_id}, {"choices", json::array({choice})},
            {"usage", openai_usage(ev, p)}};
}

json anthropic_response(const prepared &p, const chat::reasoning_delta &out, const parsed_output &po,
                        const sched::event &ev) {
    json content = json::array();
    if (!out.reasoning.empty())  // unsigned (see anthropic_writer::reasoning)
        content.push_back({{"type", "thinking"}, {"thinking", out.reasoning}, {"signature", ""}});
    const std::string t = po.calls.empty() ? po.content : trim_copy(po.content);
    if (!t.empty()) content.push_back({{"type", "text"}, {"text", t}});
    for (const auto &c : po.calls) {
        json input = json::parse(c.arguments, nullptr, false);
        content.push_back({{"type", "tool_use"}, {"id", c.id}, {"name", c.name},
                           {"input", input.is_discarded() ? json::object() : input}});
    }
    return {{"id", random_id("msg_")}, {"type", "message"}, {"role", "assistant"}, {"model", p.model_id},
            {"content", content}, {"stop_reason", anthropic_stop(ev, !po.calls.empty())},
            {"stop_sequence", ev.reason == sched::finish_reason::stop_string ? json(ev.stop_string) : json()},
            {"usage", anthropic_usage(ev.n_prompt, ev.n_generated, p)}};
}

}  // namespace

void handle_generate(server_context &ctx, const httplib::Request &req, const std::string &body, httplib::Response &res,
                     api_kind kind) {
    auto probe = std::make_shared<connection_probe>(req);
    auto p = std::make_shared<prepared>(prepare(ctx, body, kind, false));
    // A stream whose prompt PFlash compresses submits after its headers (stream_run).
    auto job = p->defer_compression ? nullptr : submit(ctx, *p);
    if (p->r.stream) {
        run_stream(ctx, res, p, job, probe);
        return;
    }
    std::string text = p->forced;
    std::vector<sched::token_info> lps;
    // parallel_tool_calls false: the calls are decoded as they come to stop after the first one.
    std::optional<call_stream> cs = p->r.parallel_calls ? std::nullopt : make_call_stream(ctx, *p);
    std::optional<chat::reasoning_splitter> sp;
    if (cs && p->reasoning) sp.emplace(p->in_reasoning);
    std::vector<call_event> scratch;
    if (cs) cs->push(p->forced, scratch);
    sched::event ev;
    for (;;) {
        if (!next_event(*job, *probe, ev)) {
            res.status = 499;  // nobody reads it: the client closed the connection
            return;
        }
        text += ev.text;
        if (p->r.logprobs) lps.insert(lps.end(), ev.tokens.begin(), ev.tokens.end());
        if (cs) cs->push(sp ? sp->push(ev.text).content : ev.text, scratch);
        if (cs && cs->stopped() && !ev.final && !stop_after_first_call(*job, *probe, ev)) {
            res.status = 499;
            return;
        }
        if (ev.final) break;
    }
    note_tokens(ev);
    const bool stopped = cs && cs->stopped();
    if (ev.reason == sched::finish_reason::error)
        throw api_error(500, "api_error", "generation failed: " + client_text(ev.error));
    if (ev.reason == sched::finish_reason::cancelled && !stopped)
        throw api_error(503, "overloaded_error", "generation cancelled: the server is shutting down");
    const chat::reasoning_delta parts =
        p->reasoning ? chat::split_reasoning(text, p->in_reasoning) : chat::reasoning_delta{{}, text};
    parsed_output po = stopped ? cs->output() : split_calls(ctx, *p, parts.content);
    if (!p->r.parallel_calls && po.calls.size() > 1) po.calls.resize(1);
    const json out = kind == api_kind::anthropic_messages ? anthropic_response(*p, parts, po, ev)
                                                          : openai_response(ctx, *p, parts, po, lps, ev);
    res.set_content(dump_json(out), "application/json");
}

void handle_count_tokens(server_context &ctx, const httplib::Request &, const std::string &body,
                         httplib::Response &res) {
    const prepared p = prepare(ctx, body, api_kind::anthropic_messages, true);
    res.set_content(dump_json({{"input_tokens", p.prompt.size()}}), "application/json");
}

// ---------------------------------------------------------------------------------------------
// Shared with the Responses endpoint (responses.cpp; declared in server_impl.h).
// ---------------------------------------------------------------------------------------------

prepared prepare_chat(server_context &ctx, const nlohmann::json &chat_body, bool count_only) {
    return prepare(ctx, dump_json(chat_body), api_kind::openai_chat, count_only);
}
std::shared_ptr<sched::job> submit_prepared(server_context &ctx, prepared &p) { return submit(ctx, p); }
bool wait_event(sched::job &j, connection_probe &probe, sched::event &ev) { return next_event(j, probe, ev); }
parsed_output parse_calls(server_context &ctx, const prepared &p, const std::string &text) { return split_calls(ctx, p, text); }
std::string client_message(const std::string &msg) { return client_text(msg); }
void record_tokens(const sched::event &ev) { note_tokens(ev); }

}  // namespace fathom::server
