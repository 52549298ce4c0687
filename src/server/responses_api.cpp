// Responses API request validation and input-item conversion (responses_api.h). Every error is a
// 400 whose param names the offending field the way OpenAI does ("input[3].content[0].type").
#include "server/responses_api.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "server/api.h"
#include "server/tool_calls.h"  // random_id

namespace fathom::server {

using json = nlohmann::json;

namespace {

const json *field(const json &o, const char *key) {
    auto it = o.find(key);
    if (it == o.end() || it->is_null()) return nullptr;
    return &*it;
}

std::string need_string(const json &o, const char *key, const std::string &where, bool non_empty) {
    const json *v = field(o, key);
    const std::string param = where + "." + key;
    if (!v) bad_request("'" + param + "' is required", param);
    if (!v->is_string()) bad_request("'" + param + "' must be a string", param);
    if (non_empty && v->get_ref<const std::string &>().empty()) bad_request("'" + param + "' must not be empty", param);
    return v->get<std::string>();
}

// Message content (or a call output: key "output") -> [{"type": input_text|output_text, "text"}]. Text
// parts only: images, files and audio are refused (this server reads text).
json message_parts(const json &content, bool assistant, const std::string &where, const char *key = "content") {
    const char *text_type = assistant ? "output_text" : "input_text";
    if (content.is_string()) return json::array({{{"type", text_type}, {"text", content}}});
    const std::string kw = where + "." + key;
    if (!content.is_array()) bad_request("'" + kw + "' must be a string or an array of content parts", kw);
    json parts = json::array();
    for (size_t i = 0; i < content.size(); ++i) {
        const json &part = content[i];
        const std::string pw = kw + "[" + std::to_string(i) + "]";
        if (!part.is_object()) bad_request("'" + pw + "' must be an object", pw);
        const std::string type = need_string(part, "type", pw, true);
        if (type == "input_text" || type == "output_text") {
            parts.push_back({{"type", text_type}, {"text", need_string(part, "text", pw, false)}});
        } else if (type == "refusal" && assistant) {
            parts.push_back({{"type", text_type}, {"text", need_string(part, "refusal", pw, false)}});
        } else if (type == "input_image" || type == "input_file" || type == "input_audio") {
            bad_request("'" + pw + ".type' '" + type + "' is not supported (this server takes text only)", pw + ".type");
        } else {
            bad_request("'" + pw + ".type' must be input_text or output_text (got '" + type + "')", pw + ".type");
        }
    }
    return parts;
}

json normalise_message(const json &item, const std::string &where) {
    const std::string role = need_string(item, "role", where, true);
    if (role != "user" && role != "system" && role != "developer" && role != "assistant")
        bad_request("'" + where + ".role' must be user, system, developer or assistant (got '" + role + "')",
                    where + ".role");
    const json *c = field(item, "content");
    if (!c) bad_request("'" + where + ".content' is required", where + ".content");
    return {{"type", "message"}, {"role", role}, {"content", message_parts(*c, role == "assistant", where)}};
}

json normalise_function_call(const json &item, const std::string &where) {
    json out = {{"type", "function_call"},
                {"call_id", need_string(item, "call_id", where, true)},
                {"name", need_string(item, "name", where, true)},
                {"arguments", need_string(item, "arguments", where, false)}};
    return out;
}

json normalise_call_output(const json &item, const std::string &where) {
    const std::string call_id = need_string(item, "call_id", where, true);
    const json *o = field(item, "output");
    if (!o) bad_request("'" + where + ".output' is required", where + ".output");
    std::string text;
    if (o->is_string()) {
        text = o->get<std::string>();
    } else if (o->is_array()) {
        for (const json &part : message_parts(*o, false, where, "output"))
            text += part["text"].get<std::string>();
    } else {
        bad_request("'" + where + ".output' must be a string or an array of input_text parts", where + ".output");
    }
    return {{"type", "function_call_output"}, {"call_id", call_id}, {"output", text}};
}

// A reasoning item from an earlier turn: validated and kept in the history (the prompt drops it, as
// it drops chat reasoning_content; docs/server.md "Thinking").
json normalise_reasoning(const json &item, const std::string &where) {
    json out = {{"type", "reasoning"}, {"summary", json::array()}};
    for (const char *key : {"summary", "content"}) {
        if (const json *v = field(item, key)) {
            if (!v->is_array()) bad_request("'" + where + "." + key + "' must be an array", where + "." + key);
            out[key] = *v;
        }
    }
    return out;
}

// The item's id: the client's, else a fresh one (GET /v1/responses/{id}/input_items lists items by id).
json item_id(const json &item, const std::string &where, const char *prefix) {
    const json *id = field(item, "id");
    if (!id) return random_id(prefix);
    if (!id->is_string() || id->get_ref<const std::string &>().empty())
        bad_request("'" + where + ".id' must be a non-empty string", where + ".id");
    return *id;
}

json normalise_item(const json &item, const std::string &where) {
    if (!item.is_object()) bad_request("'" + where + "' must be an object", where);
    const json *t = field(item, "type");
    if (t && !t->is_string()) bad_request("'" + where + ".type' must be a string", where + ".type");
    const std::string type = t ? t->get<std::string>() : "message";  // no type: EasyInputMessage {role, content}
    json out;
    const char *prefix = "";
    if (type == "message") {
        out = normalise_message(item, where);
        prefix = "msg_";
    } else if (type == "function_call") {
        out = normalise_function_call(item, where);
        prefix = "fc_";
    } else if (type == "function_call_output") {
        out = normalise_call_output(item, where);
        prefix = "fco_";
    } else if (type == "reasoning") {
        out = normalise_reasoning(item, where);
        prefix = "rs_";
    } else {
        bad_request("'" + where + ".type' '" + type +
                        "' is not supported (input items: message, function_call, function_call_output, reasoning)",
                    where + ".type");
    }
    out["id"] = item_id(item, where, prefix);
    return out;
}

// Flat Responses function tools -> chat tools; other tool types are refused.
void parse_tools(const json &b, responses_request &r) {
    const json *t = field(b, "tools");
    if (!t) return;
    if (!t->is_array()) bad_request("'tools' must be an array", "tools");
    json chat_tools = json::array();
    for (size_t i = 0; i < t->size(); ++i) {
        const json &tool = (*t)[i];
        const std::string where = "tools[" + std::to_string(i) + "]";
        if (!tool.is_object()) bad_request("'" + where + "' must be an object", where);
        const std::string type = need_string(tool, "type", where, true);
        if (type != "function")
            bad_request("'" + where + ".type' '" + type + "' is not supported (only function tools)", where + ".type");
        json f = {{"name", need_string(tool, "name", where, true)}};
        json flat = {{"type", "function"}, {"name", f["name"]}};
        if (const json *d = field(tool, "description")) {
            if (!d->is_string()) bad_request("'" + where + ".description' must be a string", where + ".description");
            f["description"] = *d;
            flat["description"] = *d;
        }
        if (const json *p = field(tool, "parameters")) {
            if (!p->is_object()) bad_request("'" + where + ".parameters' must be an object", where + ".parameters");
            f["parameters"] = *p;
            flat["parameters"] = *p;
        } else {
            flat["parameters"] = nullptr;
        }
        bool strict = false;
        if (const json *s = field(tool, "strict")) {
            if (!s->is_boolean()) bad_request("'" + where + ".strict' must be a boolean", where + ".strict");
            strict = s->get<bool>();
        }
        flat["strict"] = strict;
        chat_tools.push_back({{"type", "function"}, {"function", f}});
        r.tools.push_back(flat);
    }
    r.chat["tools"] = chat_tools;
}

// tool_choice: none | auto | required | {"type": "function", "name"}.
void parse_tool_choice(const json &b, responses_request &r) {
    const json *c = field(b, "tool_choice");
    if (!c) return;
    if (c->is_string()) {
        const std::string s = c->get<std::string>();
        if (s != "none" && s != "auto" && s != "required")
            bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...} (got '" +
                            s + "')", "tool_choice");
        r.chat["tool_choice"] = s;
    } else if (c->is_object()) {
        const std::string type = need_string(*c, "type", "tool_choice", true);
        if (type != "function")
            bad_request("'tool_choice.type' '" + type + "' is not supported (only function)", "tool_choice.type");
        const std::string name = need_string(*c, "name", "tool_choice", true);
        r.chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", name}}}};
    } else {
        bad_request("'tool_choice' must be a string or an object", "tool_choice");
    }
    r.tool_choice = *c;
}

void parse_reasoning(const json &b, responses_request &r) {
    const json *v = field(b, "reasoning");
    if (!v) return;
    if (!v->is_object()) bad_request("'reasoning' must be an object", "reasoning");
    if (const json *e = field(*v, "effort")) {
        static const char *known[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
        const bool ok = e->is_string() && std::find(std::begin(known), std::end(known), e->get<std::string>()) != std::end(known);
        if (!ok)
            bad_request("'reasoning.effort' must be one of none, minimal, low, medium, high, xhigh, max (got " + e->dump() +
                            ")", "reasoning.effort");
        r.chat["reasoning_effort"] = *e;
        r.reasoning["effort"] = *e;
    }
    if (const json *s = field(*v, "summary")) {
        if (!s->is_string()) bad_request("'reasoning.summary' must be a string", "reasoning.summary");
        r.reasoning["summary"] = *s;
    }
}

// text.format -> chat response_format (the chat parser decides which formats are supported).
void parse_text(const json &b, responses_request &r) {
    const json *t = field(b, "text");
    if (!t) return;
    if (!t->is_object()) bad_request("'text' must be an object", "text");
    const json *f = field(*t, "format");
    if (!f) return;
    if (!f->is_object()) bad_request("'text.format' must be an object", "text.format");
    const std::string type = need_string(*f, "type", "text.format", true);
    if (type == "text" || type == "json_object") {
        r.chat["response_format"] = {{"type", type}};
    } else if (type == "json_schema") {
        json js = {{"name", need_string(*f, "name", "text.format", true)}};
        for (const char *k : {"schema", "strict", "description"})
            if (const json *v = field(*f, k)) js[k] = *v;
        r.chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
    } else {
        bad_request("'text.format.type' must be text, json_object or json_schema (got '" + type + "')",
                    "text.format.type");
    }
    r.text = {{"format", *f}};
}

void parse_metadata(const json &b, responses_request &r) {
    const json *m = field(b, "metadata");
    if (!m) return;
    if (!m->is_object()) bad_request("'metadata' must be an object of strings", "metadata");
    if (m->size() > 16) bad_request("'metadata' holds at most 16 keys", "metadata");
    for (const auto &[k, v] : m->items()) {
        if (k.size() > 64) bad_request("'metadata' keys are at most 64 characters", "metadata");
        if (!v.is_string() || v.get_ref<const std::string &>().size() > 512)
            bad_request("'metadata." + k + "' must be a string of at most 512 characters", "metadata");
    }
    r.metadata = *m;
}

bool get_flag(const json &b, const char *key, bool dflt) {
    const json *v = field(b, key);
    if (!v) return dflt;
    if (!v->is_boolean()) bad_request(std::string("'") + key + "' must be a boolean", key);
    return v->get<bool>();
}

// Fields this server does not implement: refused rather than silently ignored.
void refuse_unsupported(const json &b) {
    if (get_flag(b, "background", false)) bad_request("'background' responses are not supported", "background");
    for (const char *k : {"conversation", "prompt"})
        if (field(b, k)) bad_request(std::string("'") + k + "' is not supported", k);
    if (const json *t = field(b, "truncation")) {
        if (!t->is_string() || (*t != "disabled" && *t != "auto"))
            bad_request("'truncation' must be \"auto\" or \"disabled\"", "truncation");
        if (*t == "auto")
            bad_request("'truncation': \"auto\" is not supported (an input over the context is refused)", "truncation");
    }
    if (const json *inc = field(b, "include")) {
        if (!inc->is_array()) bad_request("'include' must be an array of strings", "include");
        for (const json &s : *inc)
            if (!s.is_string()) bad_request("'include' must be an array of strings", "include");
    }
}

}  // namespace

responses_request parse_responses_request(const json &b) {
    responses_request r;
    refuse_unsupported(b);
    if (const json *m = field(b, "model")) r.chat["model"] = *m;  // the chat parser checks the type
    // Sampling fields and this server's extensions pass through to the chat parser unchanged.
    for (const char *k : {"temperature", "top_p", "seed", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                          "repetition_penalty", "repeat_last_n", "stop", "thinking", "prefill_compression",
                          "prefill_keep_ratio", "prefill_threshold", "prefill_verbatim_system",
                          "prefill_verbatim_last_user"})
        if (const json *v = field(b, k)) r.chat[k] = *v;
    if (const json *v = field(b, "max_output_tokens")) {
        if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > INT32_MAX)
            bad_request("'max_output_tokens' must be an integer >= 1", "max_output_tokens");
        r.max_output_tokens = v->get<int64_t>();
        r.chat["max_tokens"] = r.max_output_tokens;
    }
    r.stream = get_flag(b, "stream", false);
    r.store = get_flag(b, "store", true);
    r.parallel_tool_calls = get_flag(b, "parallel_tool_calls", true);
    if (const json *s = field(b, "stream_options")) {
        if (!s->is_object()) bad_request("'stream_options' must be an object", "stream_options");
        if (!r.stream) bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
    }
    if (const json *v = field(b, "instructions")) {
        if (!v->is_string()) bad_request("'instructions' must be a string", "instructions");
        r.instructions = v->get<std::string>();
    }
    if (const json *v = field(b, "previous_response_id")) {
        if (!v->is_string() || v->get_ref<const std::string &>().empty())
            bad_request("'previous_response_id' must be a non-empty string", "previous_response_id");
        r.previous_response_id = v->get<std::string>();
    }
    parse_tools(b, r);
    parse_tool_choice(b, r);
    parse_reasoning(b, r);
    parse_text(b, r);
    parse_metadata(b, r);

    const json *in = field(b, "input");
    if (!in) {
        if (r.previous_response_id.empty()) bad_request("'input' is required", "input");
    } else if (in->is_string()) {
        r.input_items.push_back({{"type", "message"}, {"role", "user"}, {"id", random_id("msg_")},
                                 {"content", json::array({{{"type", "input_text"}, {"text", *in}}})}});
    } else if (in->is_array()) {
        for (size_t i = 0; i < in->size(); ++i)
            r.input_items.push_back(normalise_item((*in)[i], "input[" + std::to_string(i) + "]"));
    } else {
        bad_request("'input' must be a string or an array of input items", "input");
    }
    return r;
}

void check_call_outputs(const json &items, size_t first_input) {
    std::vector<std::string> calls;
    for (size_t k = 0; k < items.size(); ++k) {
        const json &it = items[k];
        if (it["type"] == "function_call") calls.push_back(it["call_id"].get<std::string>());
        if (it["type"] != "function_call_output") continue;
        const std::string id = it["call_id"].get<std::string>();
        if (std::find(calls.begin(), calls.end(), id) == calls.end()) {
            const std::string param = "input[" + std::to_string(k - std::min(k, first_input)) + "].call_id";
            bad_request("no function_call found for the function_call_output with call_id '" + id + "'", param);
        }
    }
}

json items_to_messages(const json &items, const std::string &instructions) {
    json msgs = json::array();
    if (!instructions.empty()) msgs.push_back({{"role", "system"}, {"content", instructions}});
    long open = -1;  // index in msgs of the assistant message function_call items attach to
    for (const json &it : items) {
        const std::string type = it["type"].get<std::string>();
        if (type == "message") {
            std::string text;
            for (const json &p : it["content"]) text += p["text"].get<std::string>();
            const std::string role = it["role"].get<std::string>();
            msgs.push_back({{"role", role}, {"content", text}});
            open = role == "assistant" ? long(msgs.size()) - 1 : -1;
        } else if (type == "function_call") {
            if (open < 0) {
                msgs.push_back({{"role", "assistant"}, {"content", nullptr}});
                open = long(msgs.size()) - 1;
            }
            json &m = msgs[size_t(open)];
            if (!m.contains("tool_calls")) m["tool_calls"] = json::array();
            m["tool_calls"].push_back({{"id", it["call_id"]}, {"type", "function"},
                                       {"function", {{"name", it["name"]}, {"arguments", it["arguments"]}}}});
        } else if (type == "function_call_output") {
            msgs.push_back({{"role", "tool"}, {"tool_call_id", it["call_id"]}, {"content", it["output"]}});
            open = -1;
        }
        // reasoning: dropped (an earlier turn's reasoning is not part of the prompt)
    }
    return msgs;
}

}  // namespace fathom::server
