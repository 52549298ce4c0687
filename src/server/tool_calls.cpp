// Hermes/Qwen tool-call format: tools listed as JSON inside <tools></tools> in the system message,
// calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results returned in
// <tool_response></tool_response>. The parser also accepts a bare JSON call as the whole output:
// {"name":..,"arguments":..} (or "parameters"), {"function":{...}}, {"tool_calls":[...]} or an array.
#include "server/tool_calls.h"

#include "chat/dsml.h"  // make_dsml_tool_format

#include <algorithm>
#include <random>

namespace fathom::server {

using json = nlohmann::json;

std::string random_id(std::string_view prefix) {
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    thread_local std::mt19937_64 rng{std::random_device{}()};
    std::string out(prefix);
    for (int i = 0; i < 24; ++i) out += alphabet[rng() % (sizeof(alphabet) - 1)];
    return out;
}

static std::string_view trim(std::string_view s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
    return s;
}

namespace {

constexpr std::string_view k_open = "<tool_call>";
constexpr std::string_view k_close = "</tool_call>";

// One call object in any of the accepted shapes -> tool_call (false if it is not one).
bool json_to_call(const json &j, const std::vector<std::string> &known, tool_call &out) {
    if (!j.is_object()) return false;
    const json *obj = &j;
    if (j.contains("function") && j["function"].is_object()) obj = &j["function"];
    if (!obj->contains("name") || !(*obj)["name"].is_string()) return false;
    const std::string name = (*obj)["name"].get<std::string>();
    if (std::find(known.begin(), known.end(), name) == known.end()) return false;
    json args = json::object();
    for (const char *key : {"arguments", "parameters"}) {
        if (!obj->contains(key)) continue;
        const json &a = (*obj)[key];
        if (a.is_string()) {  // arguments given as JSON text
            json parsed = json::parse(a.get<std::string>(), nullptr, false);
            if (parsed.is_discarded() || !parsed.is_object()) return false;
            args = parsed;
        } else if (a.is_object()) {
            args = a;
        } else {
            return false;
        }
        break;
    }
    out.id = random_id("call_");
    out.name = name;
    out.arguments = args.dump(-1, ' ', false, json::error_handler_t::replace);
    return true;
}

bool bare_json_calls(std::string_view text, const std::vector<std::string> &known, std::vector<tool_call> &out) {
    json j = json::parse(text, nullptr, false);
    if (j.is_discarded()) return false;
    std::vector<json> items;
    if (j.is_array()) items.assign(j.begin(), j.end());
    else if (j.is_object() && j.contains("tool_calls") && j["tool_calls"].is_array())
        items.assign(j["tool_calls"].begin(), j["tool_calls"].end());
    else items.push_back(j);
    if (items.empty()) return false;
    std::vector<tool_call> calls;
    for (const auto &it : items) {
        tool_call c;
        if (!json_to_call(it, known, c)) return false;
        calls.push_back(std::move(c));
    }
    out = std::move(calls);
    return true;
}

class hermes_format : public tool_format {
public:
    std::string name() const override { return "hermes"; }

    std::string system_prompt(const json &tools, const tool_choice &choice) const override {
        std::string s =
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
        for (const auto &t : tools) {
            s += '\n';
            s += t.dump(-1, ' ', false, json::error_handler_t::replace);
        }
        s += "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
             "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
             "\"arguments\": <args-json-object>}\n</tool_call>";
        if (choice.kind == tool_choice::required) s += "\n\nYou must call at least one function.";
        if (choice.kind == tool_choice::function) {
            s += "\n\nYou must call the function \"";
            s += choice.name;
            s += "\".";
        }
        return s;
    }

    std::string render_calls(const std::vector<tool_call> &calls) const override {
        std::string s;
        for (const auto &c : calls) {
            json args = json::parse(c.arguments, nullptr, false);
            if (args.is_discarded()) args = c.arguments;  // keep malformed arguments verbatim as a string
            json call = {{"name", c.name}, {"arguments", args}};
            if (!s.empty()) s += "\n";
            s += std::string(k_open) + "\n" + call.dump(-1, ' ', false, json::error_handler_t::replace) + "\n" +
                 std::string(k_close);
        }
        return s;
    }

    std::string render_result(std::string_view, std::string_view content) const override {
        return "<tool_response>\n" + std::string(content) + "\n</tool_response>";
    }

    parsed_output parse(std::string_view text, const std::vector<std::string> &known) const override {
        parsed_output out;
        std::vector<tool_call> bare;
        if (bare_json_calls(trim(text), known, bare)) {
            out.calls = std::move(bare);
            return out;
        }
        size_t pos = 0;
        while (pos < text.size()) {
            const size_t open = text.find(k_open, pos);
            if (open == std::string_view::npos) {
                out.content.append(text.substr(pos));
                break;
            }
            size_t close = text.find(k_close, open + k_open.size());
            const size_t body_end = close == std::string_view::npos ? text.size() : close;
            const size_t next = close == std::string_view::npos ? text.size() : close + k_close.size();
            json j = json::parse(trim(text.substr(open + k_open.size(), body_end - open - k_open.size())), nullptr, false);
            tool_call c;
            if (!j.is_discarded() && json_to_call(j, known, c)) {
                out.content.append(text.substr(pos, open - pos));
                out.calls.push_back(std::move(c));
            } else {
                out.content.append(text.substr(pos, next - pos));  // not a valid call: keep it as text
            }
            pos = next;
        }
        return out;
    }

    size_t safe_content_prefix(std::string_view text) const override {
        // A bare JSON call can only be the whole output: hold while the output may be one.
        const std::string_view t = trim(text);
        if (t.empty() || t.front() == '{' || t.front() == '[') return 0;
        const size_t open = text.find(k_open);
        if (open != std::string_view::npos) return open;
        size_t hold = 0;
        for (size_t k = std::min(text.size(), k_open.size() - 1); k > 0; --k)
            if (text.substr(text.size() - k) == k_open.substr(0, k)) {
                hold = k;
                break;
            }
        return text.size() - hold;
    }
};

}  // namespace

// ---- exact replay -----------------------------------------------------------------------------------

call_replay::call_replay(size_t max_entries, size_t max_bytes) : max_entries_(max_entries), max_bytes_(max_bytes) {}

std::string call_replay::key_of(const std::vector<tool_call> &calls) {
    std::string k;  // length-prefixed ids: no two id lists share a key whatever bytes an id holds
    for (const auto &c : calls) {
        if (c.id.empty()) return {};
        k += std::to_string(c.id.size());
        k += ':';
        k += c.id;
    }
    return k;
}

size_t call_replay::bytes_of(const std::string &key, const entry &e) {
    return key.size() + e.content.size() + e.generated.size();
}

void call_replay::remember(const std::vector<tool_call> &calls, std::string_view content, std::string generated) {
    std::string key = key_of(calls);
    if (key.empty()) return;
    entry e{std::string(trim(content)), std::move(generated)};
    const size_t sz = bytes_of(key, e);
    if (sz > max_bytes_) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto drop = [this](std::map<std::string, entry>::iterator it) {
        bytes_ -= bytes_of(it->first, it->second);
        by_key_.erase(it);
    };
    if (auto it = by_key_.find(key); it != by_key_.end()) {  // a repeated id list: the newest turn wins
        drop(it);
        order_.erase(std::find(order_.begin(), order_.end(), key));
    }
    while (!order_.empty() && (by_key_.size() + 1 > max_entries_ || bytes_ + sz > max_bytes_)) {
        drop(by_key_.find(order_.front()));
        order_.pop_front();
    }
    bytes_ += sz;
    order_.push_back(key);
    by_key_.emplace(std::move(key), std::move(e));
}

std::optional<std::string> call_replay::lookup(const std::vector<tool_call> &calls, std::string_view content) const {
    const std::string key = key_of(calls);
    if (key.empty()) return std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = by_key_.find(key);
    if (it == by_key_.end() || it->second.content != trim(content)) return std::nullopt;
    return it->second.generated;
}

size_t call_replay::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return by_key_.size();
}

std::string tool_format::render_assistant(const std::string &content, const std::vector<tool_call> &calls) const {
    if (calls.empty()) return content;
    if (auto g = replay_.lookup(calls, content)) return *g;
    return content + (content.empty() ? "" : "\n") + render_calls(calls);
}

void tool_format::remember_turn(const parsed_output &out, std::string generated) const {
    replay_.remember(out.calls, out.content, std::move(generated));
}

std::unique_ptr<tool_format> make_tool_format(std::string_view arch) {
    if (arch == "deepseek4") return make_dsml_tool_format();  // DSML, defined in chat/dsml.cpp
    return std::make_unique<hermes_format>();
}

}  // namespace fathom::server
