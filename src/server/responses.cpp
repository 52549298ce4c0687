// The OpenAI Responses API over HTTP: POST /v1/responses (JSON or an SSE event stream), GET and
// DELETE /v1/responses/{id}. The request becomes a chat request (responses_api.h) and runs through
// generate.cpp's pipeline (prepare_chat / submit_prepared / wait_event / parse_calls); this file owns
// the Response object, its output items and the streamed events, and the store that
// previous_response_id continues from (response_store.h). Wire format: docs/server.md "Responses API".
//
// One writer (response_writer) builds the output items for both modes: streaming sends each event as
// it happens; a JSON request feeds the whole reasoning and answer at the end and discards the events,
// so the two modes return the same Response object for the same generation.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <optional>

#include "chat/reasoning.h"
#include "server/responses_api.h"
#include "server/server_impl.h"

namespace fathom::server {

using json = nlohmann::json;

namespace {

bool all_space(std::string_view s) {
    return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; });
}

std::string trim_copy(const std::string &s) {
    size_t a = 0, b = s.size();
    while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
    return s.substr(a, b - a);
}

// The chat parser's and the prompt builder's errors name chat fields: rename them to the Responses
// fields they came from, in the param and where the message quotes them ('response_format.json_schema.name'
// -> 'text.format.name'). Longer names first: the first that matches a name's start applies.
[[noreturn]] void rethrow_renamed(const api_error &e) {
    static const std::pair<std::string, std::string> names[] = {
        {"response_format.json_schema", "text.format"}, {"response_format", "text.format"}, {"messages", "input"},
        {"prompt", "input"}, {"max_tokens", "max_output_tokens"}, {"reasoning_effort", "reasoning.effort"}};
    // name, then neither [a-z_] (a longer name) nor '[' (a chat message index, which is not the item's)
    auto starts_name = [](const std::string &s, size_t at, const std::string &name) {
        if (s.compare(at, name.size(), name) != 0) return false;
        const char next = at + name.size() < s.size() ? s[at + name.size()] : '\0';
        return !(std::islower(static_cast<unsigned char>(next)) || next == '_' || next == '[');
    };
    std::string param = e.param, msg = e.what();
    for (const auto &[from, to] : names)
        if (starts_name(param, 0, from)) {
            param = to + param.substr(from.size());
            break;
        }
    for (size_t q = msg.find('\''); q != std::string::npos; q = msg.find('\'', q + 1))
        for (const auto &[from, to] : names)
            if (starts_name(msg, q + 1, from)) {
                msg.replace(q + 1, from.size(), to);
                break;
            }
    throw api_error(e.status, e.type, msg, param, e.code);
}

// Reasoning tokens of a generation, counted per event: the tokens of events while the output is in
// (or opening, or just closing) its thinking block. Events carry the tokens whose text they release.
struct turn_splitter {
    std::optional<chat::reasoning_splitter> sp;
    std::string content;  // answer text so far (the forced call opening first)
    int64_t reasoning_tokens = 0;
    int64_t pending = 0;  // tokens of events while the output may still open a block

    explicit turn_splitter(const prepared &p) : content(p.forced) {
        if (p.reasoning) sp.emplace(p.in_reasoning);
    }
    chat::reasoning_delta push(const sched::event &ev) {
        if (!sp) {
            content += ev.text;
            return {{}, ev.text};
        }
        const bool was_in = sp->in_reasoning(), was_closed = sp->closed();
        chat::reasoning_delta d = sp->push(ev.text);
        if (ev.final) {
            chat::reasoning_delta f = sp->flush();
            d.reasoning += f.reasoning;
            d.content += f.content;
        }
        const int64_t n = int64_t(ev.tokens.size());
        if (was_in || sp->in_reasoning() || (sp->closed() && !was_closed)) {
            reasoning_tokens += pending + n;
            pending = 0;
        } else if (!sp->closed() && content.empty() && d.content.empty()) {
            pending += n;  // "<thi..." not yet decided
        } else {
            pending = 0;
        }
        content += d.content;
        return d;
    }
};

json usage_json(const sched::event &ev, int64_t reasoning_tokens) {
    return {{"input_tokens", ev.n_prompt},
            {"input_tokens_details", {{"cached_tokens", ev.n_reused}, {"cache_write_tokens", ev.n_prompt - ev.n_reused}}},
            {"output_tokens", ev.n_generated},
            {"output_tokens_details", {{"reasoning_tokens", reasoning_tokens}}},
            {"total_tokens", ev.n_prompt + ev.n_generated}};
}

// A float sampling parameter as the client wrote it (0.95f, not 0.949999988...).
double echo(float x) { return std::round(double(x) * 1e6) / 1e6; }

// The Response object's fields fixed by the request (status in_progress, no output yet).
json base_response(const responses_request &rr, const prepared &p, const std::string &id, int64_t created) {
    return {{"id", id},
            {"object", "response"},
            {"created_at", created},
            {"status", "in_progress"},
            {"background", false},
            {"error", nullptr},
            {"incomplete_details", nullptr},
            {"instructions", rr.instructions.empty() ? json() : json(rr.instructions)},
            {"max_output_tokens", rr.max_output_tokens > 0 ? json(rr.max_output_tokens) : json()},
            {"metadata", rr.metadata.is_null() ? json::object() : rr.metadata},
            {"model", p.model_id},
            {"output", json::array()},
            {"parallel_tool_calls", rr.parallel_tool_calls},
            {"previous_response_id", rr.previous_response_id.empty() ? json() : json(rr.previous_response_id)},
            {"reasoning", rr.reasoning},
            {"store", rr.store},
            {"temperature", echo(p.r.sampling.temperature)},
            {"text", rr.text},
            {"tool_choice", rr.tool_choice},
            {"tools", rr.tools},
            {"top_p", echo(p.r.sampling.top_p)},
            {"truncation", "disabled"},
            {"usage", nullptr}};
}

// Output items and events. Item order: reasoning (when the output thinks), message, function calls.
// A message whose text so far is only whitespace is not opened yet: with calls after it, it is dropped
// (as chat completions trim content beside tool calls); without, it is sent at the end.
class response_writer {
public:
    explicit response_writer(json base) : resp_(std::move(base)) {}

    std::string begin() {
        std::string out = ev("response.created", {{"response", resp_}});  // two statements: numbered in order
        return out + ev("response.in_progress", {{"response", resp_}});
    }
    std::string reasoning(const std::string &t) {
        if (t.empty()) return {};
        std::string out;
        if (!rs_open_) {
            rs_open_ = true;
            rs_id_ = random_id("rs_");
            out += ev("response.output_item.added", {{"output_index", index()}, {"item", reasoning_item("in_progress", false)}});
            out += ev("response.content_part.added", {{"item_id", rs_id_}, {"output_index", index()}, {"content_index", 0},
                                                      {"part", {{"type", "reasoning_text"}, {"text", ""}}}});
        }
        rs_text_ += t;
        return out + ev("response.reasoning_text.delta",
                        {{"item_id", rs_id_}, {"output_index", index()}, {"content_index", 0}, {"delta", t}});
    }
    std::string text(const std::string &t) {
        std::string out = close_reasoning("completed");
        if (!msg_open_) {
            pending_ += t;
            if (all_space(pending_)) return out;
            out += open_message();
        } else if (!t.empty()) {
            out += text_delta(t);
        }
        return out;
    }
    // The end of a generation: the rest of the answer, the calls, the final Response object.
    std::string finish(const std::string &rest, const std::vector<tool_call> &calls, const sched::event &e,
                       int64_t reasoning_tokens) {
        const bool incomplete = e.reason == sched::finish_reason::length;
        // Cut inside the thinking block (max_output_tokens): the reasoning item is incomplete and
        // there is no message. Otherwise a message comes even when empty (unless calls replace it).
        const bool answered = msg_open_ || !all_space(pending_ + rest) || !calls.empty();
        const bool cut_thinking = incomplete && !answered && !rs_id_.empty();
        std::string out = close_reasoning(cut_thinking ? "incomplete" : "completed");
        out += text(rest);
        if (!msg_open_ && calls.empty() && !cut_thinking) out += open_message();
        if (msg_open_) out += close_message(incomplete && calls.empty() ? "incomplete" : "completed");
        for (const tool_call &c : calls) {
            const std::string fc = random_id("fc_");
            json item = {{"id", fc}, {"type", "function_call"}, {"status", "in_progress"}, {"call_id", c.id},
                         {"name", c.name}, {"arguments", ""}};
            out += ev("response.output_item.added", {{"output_index", index()}, {"item", item}});
            out += ev("response.function_call_arguments.delta", {{"item_id", fc}, {"output_index", index()}, {"delta", c.arguments}});
            out += ev("response.function_call_arguments.done", {{"item_id", fc}, {"output_index", index()}, {"arguments", c.arguments}});
            item["status"] = "completed";
            item["arguments"] = c.arguments;
            out += ev("response.output_item.done", {{"output_index", index()}, {"item", item}});
            resp_["output"].push_back(item);
        }
        resp_["status"] = incomplete ? "incomplete" : "completed";
        if (incomplete) resp_["incomplete_details"] = {{"reason", "max_output_tokens"}};
        else resp_["completed_at"] = int64_t(std::time(nullptr));
        resp_["usage"] = usage_json(e, reasoning_tokens);
        return out + ev(incomplete ? "response.incomplete" : "response.completed", {{"response", resp_}});
    }
    std::string fail(const std::string &msg) {
        resp_["status"] = "failed";
        resp_["error"] = {{"code", "server_error"}, {"message", msg}};
        return ev("response.failed", {{"response", resp_}});
    }
    const json &response() const { return resp_; }

private:
    json resp_;                 // the Response object; output holds the finished items
    int64_t seq_ = 0;           // sequence_number of the next event
    bool rs_open_ = false, msg_open_ = false;
    std::string rs_id_, rs_text_, msg_id_, msg_text_, pending_;

    int64_t index() const { return int64_t(resp_["output"].size()); }  // output_index of the open item
    std::string ev(const std::string &name, json data) {
        data["type"] = name;
        data["sequence_number"] = seq_++;
        return sse_event(name, dump_json(data));
    }
    json reasoning_item(const std::string &status, bool with_text) const {
        json content = json::array();
        if (with_text) content.push_back({{"type", "reasoning_text"}, {"text", rs_text_}});
        return {{"id", rs_id_}, {"type", "reasoning"}, {"status", status}, {"summary", json::array()}, {"content", content}};
    }
    json message_item(const std::string &status, bool with_text) const {
        json content = json::array();
        if (with_text) content.push_back(text_part(msg_text_));
        return {{"id", msg_id_}, {"type", "message"}, {"status", status}, {"role", "assistant"}, {"content", content}};
    }
    static json text_part(const std::string &t) {
        return {{"type", "output_text"}, {"text", t}, {"annotations", json::array()}, {"logprobs", json::array()}};
    }
    std::string close_reasoning(const std::string &status) {
        if (!rs_open_) return {};
        rs_open_ = false;
        std::string out = ev("response.reasoning_text.done",
                             {{"item_id", rs_id_}, {"output_index", index()}, {"content_index", 0}, {"text", rs_text_}});
        out += ev("response.content_part.done", {{"item_id", rs_id_}, {"output_index", index()}, {"content_index", 0},
                                                 {"part", {{"type", "reasoning_text"}, {"text", rs_text_}}}});
        const json item = reasoning_item(status, true);
        out += ev("response.output_item.done", {{"output_index", index()}, {"item", item}});
        resp_["output"].push_back(item);
        return out;
    }
    std::string open_message() {
        msg_open_ = true;
        msg_id_ = random_id("msg_");
        std::string out = ev("response.output_item.added", {{"output_index", index()}, {"item", message_item("in_progress", false)}});
        out += ev("response.content_part.added",
                  {{"item_id", msg_id_}, {"output_index", index()}, {"content_index", 0}, {"part", text_part("")}});
        const std::string t = std::move(pending_);
        pending_.clear();
        return t.empty() ? out : out + text_delta(t);
    }
    std::string text_delta(const std::string &t) {
        msg_text_ += t;
        return ev("response.output_text.delta", {{"item_id", msg_id_}, {"output_index", index()}, {"content_index", 0},
                                                 {"delta", t}, {"logprobs", json::array()}});
    }
    std::string close_message(const std::string &status) {
        msg_open_ = false;
        std::string out = ev("response.output_text.done", {{"item_id", msg_id_}, {"output_index", index()}, {"content_index", 0},
                                                           {"text", msg_text_}, {"logprobs", json::array()}});
        out += ev("response.content_part.done",
                  {{"item_id", msg_id_}, {"output_index", index()}, {"content_index", 0}, {"part", text_part(msg_text_)}});
        const json item = message_item(status, true);
        out += ev("response.output_item.done", {{"output_index", index()}, {"item", item}});
        resp_["output"].push_back(item);
        return out;
    }
};

// One /v1/responses request from validation to its prepared chat request.
struct responses_job {
    responses_request rr;
    json history;  // the conversation this response continues: stored history + this input
    prepared p;
    std::string id = random_id("resp_");
    int64_t created = int64_t(std::time(nullptr));
};

std::shared_ptr<responses_job> prepare_responses(server_context &ctx, const std::string &body_text, bool count_only) {
    auto j = std::make_shared<responses_job>();
    j->rr = parse_responses_request(parse_body(body_text));
    j->history = json::array();
    if (!j->rr.previous_response_id.empty()) {
        const auto prev = ctx.responses->get(j->rr.previous_response_id);
        if (!prev)
            throw api_error(400, "invalid_request_error",
                            "Previous response with id '" + j->rr.previous_response_id + "' not found.",
                            "previous_response_id", "previous_response_not_found");
        j->history = prev->history;
    }
    const size_t first_input = j->history.size();
    for (const json &it : j->rr.input_items) j->history.push_back(it);
    check_call_outputs(j->history, first_input);
    json chat = j->rr.chat;
    chat["messages"] = items_to_messages(j->history, j->rr.instructions);
    if (chat["messages"].empty()) bad_request("'input' holds no message (and there is no previous response)", "input");
    try {
        j->p = prepare_chat(ctx, chat, count_only);
    } catch (const api_error &e) {
        rethrow_renamed(e);
    }
    return j;
}

// The answer's calls; parallel_tool_calls false keeps the first.
std::vector<tool_call> answer_calls(server_context &ctx, const responses_job &j, const std::string &content,
                                    std::string &text) {
    parsed_output po = parse_calls(ctx, j.p, content);
    if (!j.rr.parallel_tool_calls && po.calls.size() > 1) po.calls.resize(1);
    text = po.content;
    return po.calls;
}

// Stores a finished response (store: true) with its conversation. The output is kept as the client
// received it: invalid UTF-8 (a generation cut inside a character, random weights) as U+FFFD, so
// continuing with previous_response_id renders the same prompt as sending the output items back.
void keep(server_context &ctx, const responses_job &j, const json &response) {
    if (!j.rr.store) return;
    stored_response s{json::parse(dump_json(response)), j.history};
    for (const json &item : s.response["output"]) s.history.push_back(item);  // output items are valid input items
    ctx.responses->put(j.id, std::move(s));
}

void run_responses_stream(server_context &ctx, httplib::Response &res, std::shared_ptr<responses_job> j,
                          std::shared_ptr<sched::job> job, std::shared_ptr<connection_probe> probe) {
    auto w = std::make_shared<response_writer>(base_response(j->rr, j->p, j->id, j->created));
    server_context *c = &ctx;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [c, j, job, probe, w](size_t, httplib::DataSink &sink) {
        auto write = [&](const std::string &s) {
            if (s.empty() || sink.write(s.data(), s.size())) return true;
            job->cancel();
            return false;
        };
        if (!write(w->begin())) return false;
        turn_splitter ts(j->p);
        const bool tools = j->p.r.tools_active();
        size_t emitted = 0;  // bytes of ts.content sent as text
        sched::event ev;
        for (;;) {
            if (!wait_event(*job, *probe, ev)) return false;
            const chat::reasoning_delta d = ts.push(ev);
            if (!write(w->reasoning(d.reasoning))) return false;
            if (ev.final) break;
            const size_t safe = tools ? c->fmt->safe_content_prefix(ts.content) : ts.content.size();
            if (safe > emitted) {
                if (!write(w->text(ts.content.substr(emitted, safe - emitted)))) return false;
                emitted = safe;
            }
        }
        record_tokens(ev);
        if (ev.reason == sched::finish_reason::error || ev.reason == sched::finish_reason::cancelled) {
            write(w->fail(ev.reason == sched::finish_reason::error ? "generation failed: " + client_message(ev.error)
                                                                   : "generation cancelled: the server is shutting down"));
        } else {
            std::string text;
            std::vector<tool_call> calls;
            try {
                calls = answer_calls(*c, *j, ts.content, text);
            } catch (const api_error &e) {
                write(w->fail(e.what()));
                sink.done();
                return true;
            }
            const std::string rest = emitted < text.size() ? text.substr(emitted) : std::string();
            const std::string out = w->finish(rest, calls, ev, ts.reasoning_tokens);
            keep(*c, *j, w->response());  // before the client sees it complete: a follow-up finds it
            if (!write(out)) return false;
        }
        sink.done();
        return true;
    });
}

}  // namespace

void handle_responses_create(server_context &ctx, const httplib::Request &req, const std::string &body,
                             httplib::Response &res) {
    auto probe = std::make_shared<connection_probe>(req);
    auto j = prepare_responses(ctx, body, false);
    auto job = submit_prepared(ctx, j->p);
    if (j->rr.stream) {
        run_responses_stream(ctx, res, j, job, probe);
        return;
    }
    turn_splitter ts(j->p);
    std::string reasoning;
    sched::event ev;
    for (;;) {
        if (!wait_event(*job, *probe, ev)) {
            res.status = 499;  // nobody reads it: the client closed the connection
            return;
        }
        reasoning += ts.push(ev).reasoning;
        if (ev.final) break;
    }
    record_tokens(ev);
    if (ev.reason == sched::finish_reason::error)
        throw api_error(500, "api_error", "generation failed: " + client_message(ev.error));
    if (ev.reason == sched::finish_reason::cancelled)
        throw api_error(503, "overloaded_error", "generation cancelled: the server is shutting down");
    std::string text;
    const std::vector<tool_call> calls = answer_calls(ctx, *j, ts.content, text);
    response_writer w(base_response(j->rr, j->p, j->id, j->created));
    w.reasoning(reasoning);
    w.finish(calls.empty() ? text : trim_copy(text), calls, ev, ts.reasoning_tokens);
    keep(ctx, *j, w.response());
    res.set_content(dump_json(w.response()), "application/json");
}

// The token count of a request's rendered prompt (input, instructions, tools, previous_response_id),
// generating nothing; counted as /v1/messages/count_tokens counts (in thinking mode the generation
// prompt's opening marker is included, which a response counts as generated).
void handle_responses_input_tokens(server_context &ctx, const std::string &body, httplib::Response &res) {
    const auto j = prepare_responses(ctx, body, true);
    res.set_content(dump_json({{"object", "response.input_tokens"}, {"input_tokens", j->p.prompt.size()}}),
                    "application/json");
}

void handle_responses_get(server_context &ctx, const std::string &id, httplib::Response &res) {
    const auto s = ctx.responses->get(id);
    if (!s) throw api_error(404, "not_found_error", "Response with id '" + id + "' not found.", "response_id");
    res.set_content(dump_json(s->response), "application/json");
}

// An item of a stored conversation in the shapes the list endpoint returns (OpenAI's ResponseItem):
// status "completed" where the item has none, assistant text parts with their (empty) annotations.
static json listed_item(json item) {
    if (!item.contains("status")) item["status"] = "completed";
    if (item["type"] == "message" && item["role"] == "assistant")
        for (json &part : item["content"])
            if (!part.contains("annotations")) part["annotations"] = json::array();
    return item;
}

void handle_responses_input_items(server_context &ctx, const std::string &id, const httplib::Request &req,
                                  httplib::Response &res) {
    const auto s = ctx.responses->get(id);
    if (!s) throw api_error(404, "not_found_error", "Response with id '" + id + "' not found.", "response_id");
    // The input items: the whole conversation before this response's output (stored history included).
    const size_t n = s->history.size() - s->response["output"].size();
    int64_t limit = 20;
    if (req.has_param("limit")) {
        const std::string v = req.get_param_value("limit");
        const bool digits = !v.empty() && v.size() <= 3 && std::all_of(v.begin(), v.end(), ::isdigit);
        limit = digits ? std::stoll(v) : 0;
        if (limit < 1 || limit > 100) bad_request("'limit' must be an integer from 1 to 100", "limit");
    }
    const std::string order = req.has_param("order") ? req.get_param_value("order") : "desc";
    if (order != "asc" && order != "desc") bad_request("'order' must be asc or desc", "order");
    std::vector<size_t> idx(n);
    for (size_t k = 0; k < n; ++k) idx[k] = order == "asc" ? k : n - 1 - k;
    size_t start = 0;
    if (req.has_param("after")) {
        const std::string after = req.get_param_value("after");
        const auto it = std::find_if(idx.begin(), idx.end(), [&](size_t k) { return s->history[k].value("id", "") == after; });
        if (it == idx.end()) bad_request("'after' names no input item of this response ('" + after + "')", "after");
        start = size_t(it - idx.begin()) + 1;
    }
    json data = json::array();
    for (size_t k = start; k < n && data.size() < size_t(limit); ++k) data.push_back(listed_item(s->history[idx[k]]));
    const bool more = start + data.size() < n;
    res.set_content(dump_json({{"object", "list"}, {"data", data},
                               {"first_id", data.empty() ? json() : data.front()["id"]},
                               {"last_id", data.empty() ? json() : data.back()["id"]}, {"has_more", more}}),
                    "application/json");
}

void handle_responses_delete(server_context &ctx, const std::string &id, httplib::Response &res) {
    if (!ctx.responses->erase(id))
        throw api_error(404, "not_found_error", "Response with id '" + id + "' not found.", "response_id");
    res.set_content(dump_json({{"id", id}, {"object", "response"}, {"deleted", true}}), "application/json");
}

}  // namespace fathom::server
