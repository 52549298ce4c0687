// DeepSeek V4 prompt rendering, following the official encoding_dsv4.py step by step:
// load messages -> attach request tools -> merge tool results into user turns -> sort results by
// call order -> drop old reasoning (thinking mode) -> render each message + its transition.
// Every rule is listed with its source in docs/ds4-chat-format.md.
#include "chat/ds4_chat.h"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace fathom::ds4chat {

using ojson = nlohmann::ordered_json;

const std::string_view k_think_max_prefix =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

namespace {

struct content_block {
    bool tool_result = false;
    std::string text;
    std::string tool_use_id;
};

struct call_in {
    std::string id;
    std::string name;
    std::string arguments;  // JSON text
};

struct message {
    std::string role;
    std::optional<std::string> content;
    bool has_blocks = false;  // user messages after merge: content lives in blocks
    std::vector<content_block> blocks;
    std::optional<std::string> reasoning;
    std::vector<call_in> calls;
    std::string tool_call_id;  // tool messages
    ojson tools;            // null or non-empty array
    ojson response_format;  // null or value
    bool wo_eos = false;
};

[[noreturn]] void bad(size_t i, const std::string &what) {
    throw error("ds4 chat: message " + std::to_string(i) + ": " + what);
}

// content: string, null or a list of text parts (joined by "\n\n").
std::optional<std::string> text_of(const ojson &c, size_t i) {
    if (c.is_null()) return std::nullopt;
    if (c.is_string()) return c.get<std::string>();
    if (!c.is_array()) bad(i, "content must be a string, null or a list of text parts");
    std::string out;
    bool first = true;
    for (const auto &part : c) {
        std::string t;
        if (part.is_string()) {
            t = part.get<std::string>();
        } else if (part.is_object() && part.contains("type") && part["type"] == "text") {
            const auto it = part.find("text");
            if (it != part.end() && !it->is_null()) {
                if (!it->is_string()) bad(i, "text part with a non-string text");
                t = it->get<std::string>();
            }
        } else {
            const bool named = part.is_object() && part.contains("type") && part["type"].is_string();
            const std::string type = named ? part["type"].get<std::string>() : "?";
            bad(i, "unsupported content part type '" + type + "' (text only)");
        }
        if (!first) out += "\n\n";
        first = false;
        out += t;
    }
    return out;
}

call_in load_call(const ojson &tc, size_t i) {
    if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object())
        bad(i, "tool call without a \"function\" object");
    const ojson &fn = tc["function"];
    call_in c;
    if (tc.contains("id") && tc["id"].is_string()) c.id = tc["id"].get<std::string>();
    else if (fn.contains("id") && fn["id"].is_string()) c.id = fn["id"].get<std::string>();
    if (!fn.contains("name") || !fn["name"].is_string()) bad(i, "tool call without a string name");
    c.name = fn["name"].get<std::string>();
    if (!fn.contains("arguments") || fn["arguments"].is_null()) bad(i, "tool call \"" + c.name + "\" without arguments");
    const ojson &a = fn["arguments"];
    c.arguments = a.is_string() ? a.get<std::string>() : py_json_dumps(a);
    return c;
}

message load_message(const ojson &m, size_t i) {
    if (!m.is_object()) bad(i, "not a JSON object");
    if (!m.contains("role") || !m["role"].is_string()) bad(i, "missing string \"role\"");
    message out;
    out.role = m["role"].get<std::string>();
    static const char *roles[] = {"system", "developer", "user", "assistant", "tool", "latest_reminder"};
    if (std::find(std::begin(roles), std::end(roles), out.role) == std::end(roles))
        bad(i, "unknown role '" + out.role + "'");
    if (m.contains("task") && !m["task"].is_null()) bad(i, "\"task\" (quick-instruction tasks) is not supported");
    if (m.contains("content")) out.content = text_of(m["content"], i);
    if (m.contains("reasoning_content") && !m["reasoning_content"].is_null()) {
        if (!m["reasoning_content"].is_string()) bad(i, "reasoning_content must be a string");
        out.reasoning = m["reasoning_content"].get<std::string>();
    }
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
        if (!m["tool_calls"].is_array()) bad(i, "tool_calls must be an array");
        if (out.role != "assistant") bad(i, "tool_calls on a non-assistant message");
        for (const auto &tc : m["tool_calls"]) out.calls.push_back(load_call(tc, i));
    }
    if (out.role == "tool") {
        const auto it = m.find("tool_call_id");
        if (it != m.end() && it->is_string()) out.tool_call_id = it->get<std::string>();
    }
    if (m.contains("tools") && !m["tools"].is_null()) {
        if (!m["tools"].is_array()) bad(i, "tools must be an array");
        if (!m["tools"].empty()) out.tools = m["tools"];
    }
    if (m.contains("response_format") && !m["response_format"].is_null()) out.response_format = m["response_format"];
    if (m.contains("wo_eos") && m["wo_eos"].is_boolean()) out.wo_eos = m["wo_eos"].get<bool>();
    return out;
}

// Official merge_tool_messages: a tool message becomes a tool_result block of a user message;
// user messages become text blocks; both are appended to the previous message when it is a user
// message with blocks, so one <｜User｜> marker covers the run.
std::vector<message> merge_tool_messages(std::vector<message> msgs) {
    std::vector<message> out;
    for (auto &m : msgs) {
        const bool prev_user = !out.empty() && out.back().role == "user" && out.back().has_blocks;
        if (m.role == "tool") {
            content_block b{true, m.content.value_or(""), m.tool_call_id};
            if (prev_user) {
                out.back().blocks.push_back(std::move(b));
            } else {
                message u;
                u.role = "user";
                u.has_blocks = true;
                u.blocks.push_back(std::move(b));
                out.push_back(std::move(u));
            }
        } else if (m.role == "user") {
            content_block b{false, m.content.value_or(""), ""};
            if (prev_user) {
                out.back().blocks.push_back(std::move(b));
            } else {
                m.has_blocks = true;
                m.blocks = {std::move(b)};
                out.push_back(std::move(m));
            }
        } else {
            out.push_back(std::move(m));
        }
    }
    return out;
}

// Official sort_tool_results_by_call_order: inside a user message, tool_result blocks are
// stably reordered by the index of their id among the latest assistant tool calls (unknown ids
// count as 0); text blocks keep their places.
void sort_tool_results(std::vector<message> &msgs) {
    std::unordered_map<std::string, size_t> order;
    for (auto &m : msgs) {
        if (m.role == "assistant" && !m.calls.empty()) {
            order.clear();
            for (size_t k = 0; k < m.calls.size(); ++k)
                if (!m.calls[k].id.empty()) order[m.calls[k].id] = k;
        } else if (m.role == "user" && m.has_blocks && !order.empty()) {
            std::vector<size_t> slots;
            std::vector<content_block> results;
            for (size_t k = 0; k < m.blocks.size(); ++k)
                if (m.blocks[k].tool_result) {
                    slots.push_back(k);
                    results.push_back(m.blocks[k]);
                }
            if (results.size() < 2) continue;
            auto key = [&](const content_block &b) {
                const auto it = order.find(b.tool_use_id);
                return it == order.end() ? size_t{0} : it->second;
            };
            std::stable_sort(results.begin(), results.end(),
                             [&](const content_block &a, const content_block &b) { return key(a) < key(b); });
            for (size_t k = 0; k < slots.size(); ++k) m.blocks[slots[k]] = std::move(results[k]);
        }
    }
}

int last_user_index(const std::vector<message> &msgs) {
    for (size_t k = msgs.size(); k-- > 0;)
        if (msgs[k].role == "user" || msgs[k].role == "developer") return static_cast<int>(k);
    return -1;
}

// Official _drop_thinking_messages: before the last user/developer message, assistant turns lose
// their reasoning and developer messages are dropped entirely.
std::vector<message> drop_thinking_messages(std::vector<message> msgs) {
    const int last = last_user_index(msgs);
    std::vector<message> out;
    for (size_t k = 0; k < msgs.size(); ++k) {
        auto &m = msgs[k];
        const bool keep_role = m.role == "user" || m.role == "system" || m.role == "tool" || m.role == "latest_reminder";
        if (keep_role || static_cast<int>(k) >= last) {
            out.push_back(std::move(m));
        } else if (m.role == "assistant") {
            m.reasoning.reset();
            out.push_back(std::move(m));
        }
    }
    return out;
}

std::string system_extras(const message &m) {
    std::string s;
    if (!m.tools.is_null()) s += "\n\n" + dsml_render_tools_section(m.tools);
    if (!m.response_format.is_null())
        s += "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" +
             py_json_dumps(m.response_format);
    return s;
}

std::string render_assistant(const message &m, bool thinking_part_kept, const render_options &o) {
    std::string tc;
    if (!m.calls.empty()) {
        std::optional<std::string> raw;
        if (o.replay) {
            std::vector<std::string> ids;
            for (const auto &c : m.calls) ids.push_back(c.id);
            if (std::none_of(ids.begin(), ids.end(), [](const std::string &s) { return s.empty(); }))
                raw = o.replay->lookup(ids);
        }
        if (raw) {
            tc = std::move(*raw);
        } else {
            std::vector<dsml_call> calls;
            for (const auto &c : m.calls) calls.push_back({c.name, c.arguments});
            tc = dsml_render_tool_calls(calls);
        }
    }
    std::string s;
    if (thinking_part_kept) s += m.reasoning.value_or("") + std::string(k_think_close);
    s += m.content.value_or("");
    s += tc;
    if (!m.wo_eos) s += k_eos;
    return s;
}

// One message plus the transition after it (official render_message).
std::string render_message(const std::vector<message> &msgs, size_t i, bool drop, const render_options &o) {
    const message &m = msgs[i];
    const int last_user = last_user_index(msgs);
    const int idx = static_cast<int>(i);
    std::string s;
    if (i == 0 && o.thinking && o.think_max) s += k_think_max_prefix;
    if (m.role == "system") {
        s += m.content.value_or("") + system_extras(m);
    } else if (m.role == "developer") {
        if (!m.content || m.content->empty()) bad(i, "developer message needs non-empty content");
        s += std::string(k_user) + *m.content + system_extras(m);
    } else if (m.role == "user") {
        s += k_user;
        for (size_t k = 0; k < m.blocks.size(); ++k) {
            if (k) s += "\n\n";
            const auto &b = m.blocks[k];
            s += b.tool_result ? "<tool_result>" + b.text + "</tool_result>" : b.text;
        }
    } else if (m.role == "latest_reminder") {
        s += std::string(k_latest_reminder) + m.content.value_or("");
    } else {  // assistant
        s += render_assistant(m, o.thinking && (!drop || idx > last_user), o);
    }
    if (i + 1 < msgs.size() && msgs[i + 1].role != "assistant" && msgs[i + 1].role != "latest_reminder") return s;
    if (m.role == "user" || m.role == "developer") {
        s += k_assistant;
        s += o.thinking && (!drop || idx >= last_user) ? k_think_open : k_think_close;
    }
    return s;
}

void attach_request_tools(std::vector<message> &msgs, const render_input &in, tools_placement placement) {
    const bool has_tools = in.tools.is_array() && !in.tools.empty();
    if (!in.tools.is_null() && !in.tools.is_array()) throw error("ds4 chat: tools must be an array");
    if (!has_tools && in.response_format.is_null()) return;
    const bool reuse = placement == tools_placement::first_message && !msgs.empty() &&
                       (msgs[0].role == "system" || msgs[0].role == "developer");
    if (!reuse) {
        message sys;
        sys.role = "system";
        if (placement == tools_placement::first_message) sys.content = "";
        msgs.insert(msgs.begin(), std::move(sys));
    }
    message &target = msgs[0];
    if (has_tools) {
        if (!target.tools.is_null()) throw error("ds4 chat: tools given both in the request and on message 0");
        target.tools = in.tools;
    }
    if (!in.response_format.is_null()) {
        if (!target.response_format.is_null())
            throw error("ds4 chat: response_format given both in the request and on message 0");
        target.response_format = in.response_format;
    }
}

}  // namespace

std::string render_prompt(const render_input &in, const render_options &opts) {
    if (!in.messages.is_array()) throw error("ds4 chat: messages must be a JSON array");
    std::vector<message> msgs;
    for (size_t i = 0; i < in.messages.size(); ++i) msgs.push_back(load_message(in.messages[i], i));
    attach_request_tools(msgs, in, opts.placement);
    msgs = merge_tool_messages(std::move(msgs));
    sort_tool_results(msgs);
    // Official: any tools in the conversation keep every turn's reasoning.
    const bool any_tools = std::any_of(msgs.begin(), msgs.end(), [](const message &m) { return !m.tools.is_null(); });
    const bool drop = opts.drop_thinking && !any_tools;
    if (opts.thinking && drop) msgs = drop_thinking_messages(std::move(msgs));
    std::string out = opts.add_bos ? std::string(k_bos) : std::string();
    for (size_t i = 0; i < msgs.size(); ++i) out += render_message(msgs, i, drop, opts);
    return out;
}

std::string render_prompt(const ojson &messages, const ojson &tools, const render_options &opts) {
    render_input in;
    in.messages = messages;
    in.tools = tools;
    return render_prompt(in, opts);
}

std::string render_prompt(const nlohmann::json &messages, const nlohmann::json &tools, const render_options &opts) {
    return render_prompt(ojson::parse(messages.dump()), ojson::parse(tools.dump()), opts);
}

std::string generation_prefix(bool thinking) {
    return std::string(k_assistant) + std::string(thinking ? k_think_open : k_think_close);
}

}  // namespace fathom::ds4chat
