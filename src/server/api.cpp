// Request parsing/validation for the OpenAI and Anthropic APIs (see api.h). Every accessor checks
// the JSON type and range and names the parameter in its error message.
#include "server/api.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "server/structured.h"

namespace fathom::server {

using json = nlohmann::json;

void bad_request(const std::string &msg, const std::string &param) {
    throw api_error(400, "invalid_request_error", msg, param);
}

json parse_body(const std::string &body) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) bad_request("the request body is not valid JSON");
    if (!j.is_object()) bad_request("the request body must be a JSON object");
    return j;
}

namespace {

// --- typed accessors: absent or null -> false; wrong type or range -> 400 naming the key ---

const json *field(const json &o, const char *key) {
    auto it = o.find(key);
    if (it == o.end() || it->is_null()) return nullptr;
    return &*it;
}

bool get_number(const json &o, const char *key, double lo, double hi, double &out) {
    const json *v = field(o, key);
    if (!v) return false;
    if (!v->is_number()) bad_request(std::string("'") + key + "' must be a number", key);
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < lo || d > hi)
        bad_request(std::string("'") + key + "' must be between " + json(lo).dump() + " and " + json(hi).dump() +
                        " (got " + v->dump() + ")", key);
    out = d;
    return true;
}

bool get_int(const json &o, const char *key, int64_t lo, int64_t hi, int64_t &out) {
    const json *v = field(o, key);
    if (!v) return false;
    if (!v->is_number_integer() && !(v->is_number_float() && std::floor(v->get<double>()) == v->get<double>()))
        bad_request(std::string("'") + key + "' must be an integer", key);
    const double d = v->get<double>();
    if (!(d >= double(lo) && d <= double(hi)))
        bad_request(std::string("'") + key + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) +
                        " (got " + v->dump() + ")", key);
    out = v->is_number_unsigned() ? int64_t(v->get<uint64_t>()) : v->is_number_integer() ? v->get<int64_t>() : int64_t(d);
    return true;
}

bool get_bool(const json &o, const char *key, bool &out) {
    const json *v = field(o, key);
    if (!v) return false;
    if (!v->is_boolean()) bad_request(std::string("'") + key + "' must be a boolean", key);
    out = v->get<bool>();
    return true;
}

bool get_string(const json &o, const char *key, std::string &out) {
    const json *v = field(o, key);
    if (!v) return false;
    if (!v->is_string()) bad_request(std::string("'") + key + "' must be a string", key);
    out = v->get<std::string>();
    return true;
}

// Fields shared by every generating endpoint.
void parse_sampling(const json &b, gen_request &r, bool openai) {
    sampling_params &p = r.sampling;
    double d;
    int64_t i;
    if (get_number(b, "temperature", 0.0, openai ? 2.0 : 1.0, d)) p.temperature = float(d);
    if (get_number(b, "top_p", 0.0, 1.0, d)) {
        if (d <= 0.0) bad_request("'top_p' must be > 0 (got " + json(d).dump() + ")", "top_p");
        p.top_p = float(d);
    }
    if (get_int(b, "top_k", 0, 1 << 20, i)) p.top_k = int32_t(i);
    if (get_number(b, "min_p", 0.0, 1.0, d)) p.min_p = float(d);
    if (get_number(b, "frequency_penalty", -2.0, 2.0, d)) p.frequency_penalty = float(d);
    if (get_number(b, "presence_penalty", -2.0, 2.0, d)) p.presence_penalty = float(d);
    if (get_number(b, "repetition_penalty", 0.0, 10.0, d)) {
        if (d <= 0.0) bad_request("'repetition_penalty' must be > 0", "repetition_penalty");
        p.repeat_penalty = float(d);
    }
    if (get_int(b, "repeat_last_n", -1, 1 << 20, i)) p.repeat_last_n = int32_t(i);
    if (get_int(b, "seed", INT64_MIN, INT64_MAX, i)) p.seed = uint64_t(i);
    else p.seed = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ std::random_device{}();
    // PFlash overrides (docs/server.md): validated here so a bad value is a 400 before any work.
    compression_request &c = r.compression;
    if (get_string(b, "prefill_compression", c.mode) && c.mode != "off" && c.mode != "auto" && c.mode != "always")
        bad_request("'prefill_compression' must be \"off\", \"auto\" or \"always\" (got \"" + c.mode + "\")",
                    "prefill_compression");
    if (get_number(b, "prefill_keep_ratio", 0.0, 1.0, d)) c.keep_ratio = d;
    if (get_int(b, "prefill_threshold", 1, INT32_MAX, i)) c.threshold = i;
    get_bool(b, "prefill_verbatim_system", c.verbatim_system);
    get_bool(b, "prefill_verbatim_last_user", c.verbatim_last_user);
    // Speculative decoding override (docs/server.md "Speculative decoding").
    if (const json *v = field(b, "speculative")) {
        if (v->is_boolean()) {
            r.draft_max = v->get<bool>() ? -1 : 0;
        } else if (v->is_object()) {
            for (const auto &[k, val] : v->items())
                if (k != "draft_max") bad_request("'speculative' takes only 'draft_max' (got '" + k + "')", "speculative");
            if (get_int(*v, "draft_max", 0, 64, i)) r.draft_max = int32_t(i);
        } else {
            bad_request("'speculative' must be a boolean or {\"draft_max\": N}", "speculative");
        }
    }
}

void parse_stop(const json &b, const char *key, gen_request &r) {
    const json *v = field(b, key);
    if (!v) return;
    if (v->is_string()) {
        r.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
        if (v->size() > 16) bad_request(std::string("'") + key + "' holds at most 16 strings", key);
        for (const auto &s : *v) {
            if (!s.is_string()) bad_request(std::string("'") + key + "' must be a string or a list of strings", key);
            r.stop.push_back(s.get<std::string>());
        }
    } else {
        bad_request(std::string("'") + key + "' must be a string or a list of strings", key);
    }
    for (const auto &s : r.stop)
        if (s.empty()) bad_request(std::string("'") + key + "' must not contain empty strings", key);
}

void parse_max_tokens(const json &b, gen_request &r) {
    int64_t i;
    if (get_int(b, "max_completion_tokens", 1, INT32_MAX, i) || get_int(b, "max_tokens", 1, INT32_MAX, i))
        r.max_tokens = int32_t(i);
}

void parse_stream(const json &b, gen_request &r) {
    get_bool(b, "stream", r.stream);
    if (const json *so = field(b, "stream_options")) {
        if (!so->is_object()) bad_request("'stream_options' must be an object", "stream_options");
        if (!r.stream) bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
        get_bool(*so, "include_usage", r.include_usage);
    }
}

void check_n(const json &b) {
    int64_t n;
    if (get_int(b, "n", 1, 128, n) && n != 1) bad_request("'n' must be 1 (several choices are not supported)", "n");
}

void finish_sampling(gen_request &r) {
    r.sampling.n_logprobs = r.logprobs ? r.top_logprobs : 0;
    try {
        r.sampling.validate();
    } catch (const error &e) {
        bad_request(e.what());
    }
}

// OpenAI reasoning_effort (values as OpenAI documents them, plus DS4's "max"): "none" switches
// thinking off; minimal..high switch it on; xhigh and max ask for DS4's Think-Max.
void parse_reasoning_effort(const json &b, gen_request &r) {
    std::string e;
    if (!get_string(b, "reasoning_effort", e)) return;
    if (e == "none") r.thinking = chat_thinking::off;
    else if (e == "minimal" || e == "low" || e == "medium" || e == "high") r.thinking = chat_thinking::on;
    else if (e == "xhigh" || e == "max") r.thinking = chat_thinking::max;
    else
        bad_request("'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh, max (got \"" + e + "\")",
                    "reasoning_effort");
}

// thinking: {"type": "enabled", "budget_tokens": N} | {"type": "disabled"} (Anthropic; DeepSeek's API
// takes the same object on chat completions). budget_tokens is required when enabled in Anthropic's
// API; here it is optional (absent: the server's --reasoning-budget) and must be >= 1.
void parse_thinking(const json &b, gen_request &r) {
    const json *t = field(b, "thinking");
    if (!t) return;
    if (r.thinking) bad_request("give either 'reasoning_effort' or 'thinking', not both", "thinking");
    if (!t->is_object()) bad_request("'thinking' must be an object {\"type\": \"enabled\" | \"disabled\"}", "thinking");
    std::string type;
    if (!get_string(*t, "type", type)) bad_request("'thinking.type' is required", "thinking.type");
    if (type == "disabled") {
        r.thinking = chat_thinking::off;
        return;
    }
    if (type != "enabled")
        bad_request("'thinking.type' must be \"enabled\" or \"disabled\" (got \"" + type + "\")", "thinking.type");
    r.thinking = chat_thinking::on;
    if (const json *bt = field(*t, "budget_tokens")) {
        if (!bt->is_number_integer())
            bad_request("'thinking.budget_tokens' must be an integer", "thinking.budget_tokens");
        const int64_t n = bt->is_number_unsigned() ? int64_t(std::min<uint64_t>(bt->get<uint64_t>(), INT64_MAX))
                                                   : bt->get<int64_t>();
        if (n <= 0)
            bad_request("'thinking.budget_tokens' must be >= 1 (got " + bt->dump() + ")", "thinking.budget_tokens");
        r.think_budget = n;
    }
}

// OpenAI message content: a string, or an array of parts of which only "text" parts are accepted.
std::string content_text(const json &c, const std::string &where) {
    if (c.is_null()) return {};
    if (c.is_string()) return c.get<std::string>();
    if (!c.is_array()) bad_request(where + ".content must be a string or an array of content parts", "messages");
    std::string out;
    for (const auto &part : c) {
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
            bad_request(where + ".content parts must be objects with a 'type'", "messages");
        const std::string type = part["type"].get<std::string>();
        if (type != "text")
            bad_request(where + ": content part type '" + type + "' is not supported (text only)", "messages");
        if (!part.contains("text") || !part["text"].is_string())
            bad_request(where + ": a text part needs a string 'text'", "messages");
        out += part["text"].get<std::string>();
    }
    return out;
}

// Validates OpenAI-form tools and fills names.
void parse_openai_tools(const json &b, gen_request &r) {
    if (const json *t = field(b, "tools")) {
        if (!t->is_array()) bad_request("'tools' must be an array", "tools");
        for (const auto &tool : *t) {
            if (!tool.is_object() || tool.value("type", "") != "function" || !tool.contains("function") ||
                !tool["function"].is_object())
                bad_request("each tool must be {\"type\": \"function\", \"function\": {...}}", "tools");
            const json &f = tool["function"];
            if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty())
                bad_request("each tool function needs a non-empty string 'name'", "tools");
            if (f.contains("parameters") && !f["parameters"].is_object())
                bad_request("tool '" + f["name"].get<std::string>() + "': 'parameters' must be an object", "tools");
            r.tool_names.push_back(f["name"].get<std::string>());
            r.tools.push_back(tool);
        }
    }
    if (const json *c = field(b, "tool_choice")) {
        if (c->is_string()) {
            const std::string s = c->get<std::string>();
            if (s == "none") r.choice.kind = tool_choice::none;
            else if (s == "auto") r.choice.kind = tool_choice::auto_;
            else if (s == "required") r.choice.kind = tool_choice::required;
            else bad_request("'tool_choice' must be none, auto, required or {\"type\":\"function\",...}", "tool_choice");
        } else if (c->is_object() && c->contains("function") && (*c)["function"].is_object() &&
                   (*c)["function"].contains("name") && (*c)["function"]["name"].is_string()) {
            r.choice.kind = tool_choice::function;
            r.choice.name = (*c)["function"]["name"].get<std::string>();
        } else {
            bad_request("'tool_choice' must be none, auto, required or {\"type\":\"function\",...}", "tool_choice");
        }
        if (r.choice.kind != tool_choice::none && r.choice.kind != tool_choice::auto_ && r.tool_names.empty())
            bad_request("'tool_choice' requires 'tools'", "tool_choice");
        if (r.choice.kind == tool_choice::function &&
            std::find(r.tool_names.begin(), r.tool_names.end(), r.choice.name) == r.tool_names.end())
            bad_request("'tool_choice' names unknown tool '" + r.choice.name + "'", "tool_choice");
    }
}

// Puts the tool description into the (first) system message.
void inject_tools(gen_request &r, const tool_format &fmt) {
    if (!r.tools_active()) return;
    const std::string text = fmt.system_prompt(r.tools, r.choice);
    if (!r.messages.empty() && r.messages.front().role == "system") {
        r.messages.front().content += "\n\n" + text;
    } else {
        r.messages.insert(r.messages.begin(), chat_message{"system", text});
    }
}

// Describes a json_schema response format in the (first) system message, after the tools, in the
// formats that have a way to (DS4's encoder: "\n\n" + the section, on a new empty system message
// when there is none); others leave the prompt as it is.
void inject_response_format(gen_request &r, const tool_format &fmt) {
    if (r.response_schema.is_null()) return;
    const std::string text = fmt.response_format_prompt(r.response_schema);
    if (text.empty()) return;
    if (r.messages.empty() || r.messages.front().role != "system") r.messages.insert(r.messages.begin(), chat_message{"system", ""});
    r.messages.front().content += "\n\n" + text;
}

// Tool-call bookkeeping while a conversation is read: each call id's function name, the call ids of
// the latest assistant turn with calls (in order), and the results of the open result turn.
struct call_book {
    std::map<std::string, std::string> names;
    std::vector<std::string> order;
    std::vector<std::pair<size_t, std::string>> run;  // (position of its call in `order`, rendered result)
    void assistant_calls(const std::vector<tool_call> &calls) {
        order.clear();
        for (const auto &c : calls) {
            names[c.id] = c.name;
            order.push_back(c.id);
        }
    }
    std::string name_of(const std::string &id, const std::string &fallback) const {
        const auto it = names.find(id);
        return it == names.end() ? fallback : it->second;
    }
};

// Appends a tool result (of call `id`, rendered) to the conversation: consecutive results share one
// user turn, joined by the format's separator. A format whose results follow the call order (DSML, as
// the official encoder's sort_tool_results_by_call_order) gets them stably sorted by the position of
// their call in the latest assistant turn (an unknown id counts as 0).
void push_tool_result(std::vector<chat_message> &msgs, bool &last_was_result, call_book &book, const std::string &id,
                      const std::string &text, const tool_format &fmt) {
    if (!last_was_result || msgs.empty()) {
        book.run.clear();
        msgs.push_back(chat_message{"user", {}});
    }
    size_t pos = 0;
    const auto call = std::find(book.order.begin(), book.order.end(), id);
    if (fmt.results_in_call_order() && call != book.order.end()) pos = size_t(call - book.order.begin());
    const auto at = std::upper_bound(book.run.begin(), book.run.end(), pos,
                                     [](size_t p, const std::pair<size_t, std::string> &e) { return p < e.first; });
    book.run.insert(at, {pos, text});
    std::string &content = msgs.back().content;
    content.clear();
    for (size_t i = 0; i < book.run.size(); ++i) content += (i ? std::string(fmt.result_separator()) : "") + book.run[i].second;
    last_was_result = true;
}

}  // namespace

gen_request parse_openai_chat(const json &b, const sampling_params &defaults, const tool_format &fmt) {
    gen_request r;
    r.kind = api_kind::openai_chat;
    r.sampling = defaults;
    get_string(b, "model", r.model);
    check_n(b);
    parse_sampling(b, r, true);
    parse_max_tokens(b, r);
    parse_stop(b, "stop", r);
    parse_stream(b, r);
    get_bool(b, "logprobs", r.logprobs);
    int64_t i;
    if (get_int(b, "top_logprobs", 0, 20, i)) {
        if (!r.logprobs) bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs");
        r.top_logprobs = int32_t(i);
    }
    if (const json *rf = field(b, "response_format")) {
        r.grammar = parse_response_format(*rf);
        if (r.grammar && rf->value("type", "") == "json_schema") r.response_schema = (*rf)["json_schema"].value("schema", json());
    }
    parse_openai_tools(b, r);
    get_bool(b, "parallel_tool_calls", r.parallel_calls);
    parse_reasoning_effort(b, r);
    parse_thinking(b, r);
    finish_sampling(r);

    const json *msgs = field(b, "messages");
    if (!msgs) bad_request("'messages' is required", "messages");
    if (!msgs->is_array() || msgs->empty()) bad_request("'messages' must be a non-empty array", "messages");
    call_book book;
    bool last_was_result = false;
    for (size_t k = 0; k < msgs->size(); ++k) {
        const json &m = (*msgs)[k];
        const std::string where = "messages[" + std::to_string(k) + "]";
        if (!m.is_object()) bad_request(where + " must be an object", "messages");
        if (!m.contains("role") || !m["role"].is_string()) bad_request(where + ".role must be a string", "messages");
        const std::string role = m["role"].get<std::string>();
        const std::string text = content_text(m.contains("content") ? m["content"] : json(), where);
        if (role == "system" || role == "developer") {
            r.messages.push_back({"system", text});
            last_was_result = false;
        } else if (role == "user") {
            r.messages.push_back({"user", text});
            last_was_result = false;
        } else if (role == "assistant") {
            std::string content = text;
            if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
                if (!m["tool_calls"].is_array()) bad_request(where + ".tool_calls must be an array", "messages");
                std::vector<tool_call> calls;
                for (const auto &tc : m["tool_calls"]) {
                    if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object() ||
                        !tc["function"].contains("name") || !tc["function"]["name"].is_string())
                        bad_request(where + ".tool_calls entries need function.name", "messages");
                    tool_call c;
                    c.id = tc.value("id", "");
                    c.name = tc["function"]["name"].get<std::string>();
                    const json &args = tc["function"].value("arguments", json("{}"));
                    c.arguments = args.is_string() ? args.get<std::string>() : args.dump();
                    calls.push_back(std::move(c));
                }
                book.assistant_calls(calls);
                content = fmt.render_assistant(content, calls);  // the generated bytes when kept
            }
            r.messages.push_back({"assistant", content});
            last_was_result = false;
        } else if (role == "tool") {
            const std::string id = m.value("tool_call_id", "");
            const std::string name = book.name_of(id, m.value("name", ""));
            push_tool_result(r.messages, last_was_result, book, id, fmt.render_result(name, text), fmt);
        } else {
            bad_request(where + ".role '" + role + "' is not one of system, developer, user, assistant, tool", "messages");
        }
    }
    inject_tools(r, fmt);
    inject_response_format(r, fmt);
    return r;
}

gen_request parse_openai_completion(const json &b, const sampling_params &defaults) {
    gen_request r;
    r.kind = api_kind::openai_completion;
    r.sampling = defaults;
    get_string(b, "model", r.model);
    check_n(b);
    parse_sampling(b, r, true);
    parse_max_tokens(b, r);
    if (r.max_tokens < 0) r.max_tokens = 16;  // the completions API's documented default
    parse_stop(b, "stop", r);
    parse_stream(b, r);
    int64_t i;
    if (get_int(b, "logprobs", 0, 20, i)) {
        r.logprobs = true;
        r.top_logprobs = int32_t(i);
    }
    bool echo = false;
    if (get_bool(b, "echo", echo) && echo) bad_request("'echo' is not supported", "echo");
    if (field(b, "suffix")) bad_request("'suffix' is not supported", "suffix");
    finish_sampling(r);

    const json *p = field(b, "prompt");
    if (!p) bad_request("'prompt' is required", "prompt");
    const json *one = p;
    if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
        if (p->size() != 1) bad_request("'prompt' must hold exactly one prompt (batches are not supported)", "prompt");
        one = &p->front();
    }
    if (one->is_string()) {
        r.prompt_text = one->get<std::string>();
    } else if (one->is_array()) {
        for (const auto &t : *one) {
            if (!t.is_number_integer()) bad_request("'prompt' token arrays must hold integers", "prompt");
            const int64_t v = t.get<int64_t>();
            if (v < 0 || v > INT32_MAX) bad_request("'prompt' token id " + std::to_string(v) + " is out of range", "prompt");
            r.prompt_tokens.push_back(int32_t(v));
        }
        r.prompt_is_tokens = true;
    } else {
        bad_request("'prompt' must be a string, a list of token ids, or a list holding one of those", "prompt");
    }
    return r;
}

namespace {

// Anthropic text: a string or an array of {type:"text", text} blocks.
std::string anthropic_text(const json &c, const std::string &where) {
    if (c.is_string()) return c.get<std::string>();
    if (!c.is_array()) bad_request(where + " must be a string or an array of content blocks", "messages");
    std::string out;
    for (const auto &blk : c) {
        if (!blk.is_object() || blk.value("type", "") != "text" || !blk.contains("text") || !blk["text"].is_string())
            bad_request(where + ": only text blocks are allowed here", "messages");
        out += blk["text"].get<std::string>();
    }
    return out;
}

void parse_anthropic_tools(const json &b, gen_request &r) {
    if (const json *t = field(b, "tools")) {
        if (!t->is_array()) bad_request("'tools' must be an array", "tools");
        for (const auto &tool : *t) {
            if (!tool.is_object() || !tool.contains("name") || !tool["name"].is_string() ||
                tool["name"].get<std::string>().empty())
                bad_request("each tool needs a non-empty string 'name'", "tools");
            if (tool.contains("input_schema") && !tool["input_schema"].is_object())
                bad_request("tool '" + tool["name"].get<std::string>() + "': 'input_schema' must be an object", "tools");
            json f = {{"name", tool["name"]}};
            if (tool.contains("description")) f["description"] = tool["description"];
            f["parameters"] = tool.value("input_schema", json::object());
            r.tools.push_back({{"type", "function"}, {"function", f}});
            r.tool_names.push_back(tool["name"].get<std::string>());
        }
    }
    if (const json *c = field(b, "tool_choice")) {
        if (!c->is_object() || !c->contains("type") || !(*c)["type"].is_string())
            bad_request("'tool_choice' must be an object with a 'type'", "tool_choice");
        const std::string type = (*c)["type"].get<std::string>();
        if (type == "auto") r.choice.kind = tool_choice::auto_;
        else if (type == "any") r.choice.kind = tool_choice::required;
        else if (type == "none") r.choice.kind = tool_choice::none;
        else if (type == "tool") {
            if (!c->contains("name") || !(*c)["name"].is_string()) bad_request("tool_choice 'tool' needs a 'name'", "tool_choice");
            r.choice.kind = tool_choice::function;
            r.choice.name = (*c)["name"].get<std::string>();
            if (std::find(r.tool_names.begin(), r.tool_names.end(), r.choice.name) == r.tool_names.end())
                bad_request("'tool_choice' names unknown tool '" + r.choice.name + "'", "tool_choice");
        } else {
            bad_request("'tool_choice.type' must be auto, any, tool or none", "tool_choice");
        }
        bool disable = false;
        if (get_bool(*c, "disable_parallel_tool_use", disable)) r.parallel_calls = !disable;
    }
}

// One Anthropic message (content string or blocks) appended to r.messages.
void anthropic_message(const json &m, size_t k, const tool_format &fmt, call_book &book, bool &last_was_result,
                       gen_request &r) {
    const std::string where = "messages[" + std::to_string(k) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
        bad_request(where + " must be an object with a string 'role'", "messages");
    const std::string role = m["role"].get<std::string>();
    if (role != "user" && role != "assistant") bad_request(where + ".role must be user or assistant", "messages");
    if (!m.contains("content")) bad_request(where + ".content is required", "messages");
    const json &c = m["content"];
    if (c.is_string()) {
        r.messages.push_back({role, c.get<std::string>()});
        last_was_result = false;
        return;
    }
    if (!c.is_array()) bad_request(where + ".content must be a string or an array of blocks", "messages");
    std::string text;
    std::vector<tool_call> calls;
    for (const auto &blk : c) {
        if (!blk.is_object() || !blk.contains("type") || !blk["type"].is_string())
            bad_request(where + ": content blocks must be objects with a 'type'", "messages");
        const std::string type = blk["type"].get<std::string>();
        if (type == "text") {
            if (!blk.contains("text") || !blk["text"].is_string()) bad_request(where + ": text block needs 'text'", "messages");
            text += blk["text"].get<std::string>();
        } else if ((type == "thinking" || type == "redacted_thinking") && role == "assistant") {
            // an earlier turn's reasoning: dropped from the prompt (docs/server.md "Thinking")
        } else if (type == "tool_use" && role == "assistant") {
            if (!blk.contains("name") || !blk["name"].is_string()) bad_request(where + ": tool_use needs 'name'", "messages");
            tool_call tc;
            tc.id = blk.value("id", "");
            tc.name = blk["name"].get<std::string>();
            tc.arguments = blk.value("input", json::object()).dump();
            calls.push_back(std::move(tc));
        } else if (type == "tool_result" && role == "user") {
            const std::string id = blk.value("tool_use_id", "");
            std::string body = blk.contains("content") ? anthropic_text(blk["content"], where + ".tool_result") : "";
            if (blk.value("is_error", false)) body = "Error: " + body;
            if (!text.empty()) {  // text before a result goes in its own turn, keeping order
                r.messages.push_back({"user", text});
                text.clear();
                last_was_result = false;
            }
            push_tool_result(r.messages, last_was_result, book, id, fmt.render_result(book.name_of(id, ""), body), fmt);
        } else {
            bad_request(where + ": content block type '" + type + "' is not supported in a " + role + " message",
                        "messages");
        }
    }
    if (!calls.empty()) book.assistant_calls(calls);
    text = fmt.render_assistant(text, calls);  // the generated bytes when kept (assistant turns only)
    if (!text.empty() || (calls.empty() && !last_was_result)) {
        r.messages.push_back({role, text});
        last_was_result = false;
    }
}

}  // namespace

gen_request parse_anthropic(const json &b, const sampling_params &defaults, const tool_format &fmt, bool count_only) {
    gen_request r;
    r.kind = api_kind::anthropic_messages;
    r.sampling = defaults;
    if (!get_string(b, "model", r.model)) bad_request("'model' is required", "model");
    if (!count_only) {
        int64_t i;
        if (!get_int(b, "max_tokens", 1, INT32_MAX, i)) bad_request("'max_tokens' is required", "max_tokens");
        r.max_tokens = int32_t(i);
        parse_sampling(b, r, false);
        parse_stop(b, "stop_sequences", r);
        get_bool(b, "stream", r.stream);
    }
    parse_anthropic_tools(b, r);
    if (const json *of = field(b, "output_format")) {
        r.grammar = parse_output_format(*of);
        r.response_schema = (*of)["schema"];
    }
    parse_thinking(b, r);
    finish_sampling(r);
    if (const json *s = field(b, "system")) r.messages.push_back({"system", anthropic_text(*s, "system")});
    const json *msgs = field(b, "messages");
    if (!msgs) bad_request("'messages' is required", "messages");
    if (!msgs->is_array() || msgs->empty()) bad_request("'messages' must be a non-empty array", "messages");
    call_book book;
    bool last_was_result = false;
    for (size_t k = 0; k < msgs->size(); ++k) anthropic_message((*msgs)[k], k, fmt, book, last_was_result, r);
    inject_tools(r, fmt);
    inject_response_format(r, fmt);
    return r;
}

}  // namespace fathom::server
