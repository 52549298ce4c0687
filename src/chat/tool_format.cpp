// Tool-call formats (chat/tool_format.h): the factory, call ids, and the Hermes/Qwen format: tools
// listed as JSON inside <tools></tools> in the system message, calls written as
// <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results returned in
// <tool_response></tool_response>. The parser also accepts a bare JSON call as the whole output:
// {"name":..,"arguments":..} (or "parameters"), {"function":{...}}, {"tool_calls":[...]} or an array.
// DSML (DeepSeek V4) is in chat/dsml.cpp.
#include "chat/tool_format.h"

#include <algorithm>
#include <cctype>
#include <random>

#include "chat/dsml.h"  // make_dsml_tool_format
#include "core/error.h"

namespace fathom::toolcall {

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

    std::string forced_call_prefix(const tool_choice &choice) const override {
        // The form the system prompt asks for: <tool_call>\n{"name": <function-name>, "arguments": <args>}
        std::string s = std::string(k_open) + "\n{\"name\": ";
        if (choice.kind == tool_choice::required) return s + "\"";
        if (choice.kind == tool_choice::function) return s + json(choice.name).dump() + ", \"arguments\": ";
        return {};
    }
    std::optional<call_frame> forced_call_frame(const tool_choice &choice, const std::string &name) const override {
        // required: the prefix ends inside the name's string; named: right before the arguments.
        std::string before = choice.kind == tool_choice::required ? json(name).dump().substr(1) + ", \"arguments\": " : "";
        return call_frame{std::move(before), "}\n" + std::string(k_close)};
    }

    std::unique_ptr<call_decoder> decoder(const std::vector<std::string> &known) const override;

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

// Hermes calls while they are generated (call_decoder). States:
//   start  only whitespace so far: the output may still be a bare JSON call
//   bare   the output began with '{' or '[': held whole and parsed by parse() at the end
//   text   content; "<tool_call>" opens a call
//   head   inside <tool_call>, before the arguments: {"name": "N", "arguments": (or "parameters")
//   args   the arguments object, passed through as it arrives (nesting counted, strings skipped)
//   tail   after the arguments object: skipped up to "</tool_call>"
//   whole  a call in another shape (other key order, string arguments, an unknown name): held up to
//          "</tool_call>", then a call if parse() would take it, else text
// Content keeps trailing whitespace back until non-space text follows (whitespace before a call is
// not content, as the whole-output response trims it). The arguments text of a streamed call is the
// object as the model wrote it (parse() re-serialises it compactly).
class hermes_decoder : public call_decoder {
public:
    hermes_decoder(const hermes_format &f, std::vector<std::string> known) : fmt_(f), known_(std::move(known)) {}

    void push(std::string_view t, std::vector<call_event> &out) override {
        buf_.append(t);
        if (st_ == st::start || st_ == st::bare) all_.append(t);
        pump(out, false);
    }
    void finish(std::vector<call_event> &out) override {
        pump(out, true);
        if (n_begun_ == 0 && !ws_.empty()) out.push_back({call_event::content, ws_});
        ws_.clear();
    }

private:
    enum class st { start, bare, text, head, args, tail, whole };
    static constexpr size_t k_max_head = 4096;

    void pump(std::vector<call_event> &out, bool at_end) {
        for (;;) {
            const st before = st_;
            switch (st_) {
                case st::start: step_start(at_end); break;
                case st::bare: step_bare(out, at_end); break;
                case st::text: step_text(out, at_end); break;
                case st::head: step_head(out, at_end); break;
                case st::args: step_args(out, at_end); break;
                case st::tail: step_tail(at_end); break;
                case st::whole: step_whole(out, at_end); break;
            }
            if (st_ == before) return;
        }
    }
    void step_start(bool at_end) {
        const std::string_view t = trim(buf_);
        if (t.empty()) {
            if (at_end) st_ = st::text;
            return;
        }
        st_ = t.front() == '{' || t.front() == '[' ? st::bare : st::text;
        if (st_ == st::text) all_.clear();
    }
    void step_bare(std::vector<call_event> &out, bool at_end) {
        if (!at_end) return;
        const parsed_output po = fmt_.parse(all_, known_);
        if (!po.content.empty()) out.push_back({call_event::content, po.content});
        for (const auto &c : po.calls) emit_whole_call(out, c);
        buf_.clear();
        st_ = st::text;
    }
    void emit_text(std::vector<call_event> &out, std::string_view s) {
        std::string t = ws_ + std::string(s);
        size_t k = t.size();
        while (k > 0 && std::isspace(static_cast<unsigned char>(t[k - 1]))) --k;
        ws_ = t.substr(k);
        if (k > 0) out.push_back({call_event::content, t.substr(0, k)});
    }
    void step_text(std::vector<call_event> &out, bool at_end) {
        const size_t open = buf_.find(k_open);
        if (open != std::string::npos) {
            emit_text(out, std::string_view(buf_).substr(0, open));
            buf_.erase(0, open + k_open.size());
            st_ = st::head;
            return;
        }
        size_t hold = 0;
        if (!at_end)
            for (size_t k = std::min(buf_.size(), k_open.size() - 1); k > 0; --k)
                if (std::string_view(buf_).substr(buf_.size() - k) == k_open.substr(0, k)) {
                    hold = k;
                    break;
                }
        emit_text(out, std::string_view(buf_).substr(0, buf_.size() - hold));
        buf_.erase(0, buf_.size() - hold);
    }
    // A JSON string at b[i]: 1 = read (value in out, i past it), 0 = incomplete, -1 = not one.
    static int read_string(std::string_view b, size_t &i, std::string &out) {
        if (i >= b.size()) return 0;
        if (b[i] != '"') return -1;
        for (size_t j = i + 1; j < b.size(); ++j) {
            if (b[j] == '\\') {
                ++j;
                continue;
            }
            if (b[j] != '"') continue;
            const json v = json::parse(b.substr(i, j + 1 - i), nullptr, false);
            if (v.is_discarded() || !v.is_string()) return -1;
            out = v.get<std::string>();
            i = j + 1;
            return 1;
        }
        return 0;
    }
    // The head {"name": "N", "arguments": up to the arguments' first byte: 1 = matched (name, at =
    // offset of the value), 0 = incomplete, -1 = another shape.
    static int match_head(std::string_view b, std::string &name, size_t &at) {
        size_t i = 0;
        auto ws = [&] {
            while (i < b.size() && std::isspace(static_cast<unsigned char>(b[i]))) ++i;
            return i < b.size();
        };
        auto lit = [&](char c) { return !ws() ? 0 : b[i] == c ? (++i, 1) : -1; };
        std::string key;
        int r;
        if ((r = lit('{')) != 1) return r;
        if (!ws()) return 0;
        if ((r = read_string(b, i, key)) != 1) return r;
        if (key != "name") return -1;
        if ((r = lit(':')) != 1) return r;
        if (!ws()) return 0;
        if ((r = read_string(b, i, name)) != 1) return r;
        if ((r = lit(',')) != 1) return r;
        if (!ws()) return 0;
        if ((r = read_string(b, i, key)) != 1) return r;
        if (key != "arguments" && key != "parameters") return -1;
        if ((r = lit(':')) != 1) return r;
        if (!ws()) return 0;
        if (b[i] != '{') return -1;  // string arguments (JSON text) are taken whole
        at = i;
        return 1;
    }
    void step_head(std::vector<call_event> &out, bool at_end) {
        std::string name;
        size_t at = 0;
        const int r = match_head(buf_, name, at);
        const bool known = std::find(known_.begin(), known_.end(), name) != known_.end();
        if (r == 1 && known) {
            ws_.clear();
            out.push_back({call_event::call, "", n_begun_++, true, false, name});
            buf_.erase(0, at);
            depth_ = 0;
            in_str_ = esc_ = false;
            st_ = st::args;
        } else if (r == -1 || r == 1 || at_end || buf_.size() > k_max_head) {
            st_ = st::whole;
        }
    }
    void step_args(std::vector<call_event> &out, bool at_end) {
        size_t i = 0;
        bool done = false, closed = false;  // closed: "</tool_call>" came before the object ended
        for (; i < buf_.size() && !done; ++i) {
            const char c = buf_[i];
            if (in_str_) {
                if (esc_) esc_ = false;
                else if (c == '\\') esc_ = true;
                else if (c == '"') in_str_ = false;
            } else if (c == '"') {
                in_str_ = true;
            } else if (c == '{' || c == '[') {
                ++depth_;
            } else if (c == '}' || c == ']') {
                done = --depth_ == 0;
            } else if (c == '<') {
                const std::string_view rest = std::string_view(buf_).substr(i);
                if (rest.substr(0, k_close.size()) == k_close) {
                    done = closed = true;
                    break;
                }
                if (!at_end && rest.size() < k_close.size() && k_close.substr(0, rest.size()) == rest) break;
            }
        }
        const std::string frag = buf_.substr(0, i);
        buf_.erase(0, closed ? i + k_close.size() : i);
        if (done || !frag.empty()) out.push_back({call_event::call, frag, n_begun_ - 1, false, done});
        if (done) st_ = closed ? st::text : st::tail;
    }
    void step_tail(bool at_end) {
        const size_t close = buf_.find(k_close);
        if (close != std::string::npos) {
            buf_.erase(0, close + k_close.size());
            st_ = st::text;
        } else if (at_end) {
            buf_.clear();
        } else if (buf_.size() >= k_close.size()) {
            buf_.erase(0, buf_.size() - (k_close.size() - 1));
        }
    }
    void step_whole(std::vector<call_event> &out, bool at_end) {
        const size_t close = buf_.find(k_close);
        if (close == std::string::npos && !at_end) return;
        const size_t body_end = close == std::string::npos ? buf_.size() : close;
        const size_t next = close == std::string::npos ? buf_.size() : close + k_close.size();
        const json j = json::parse(trim(std::string_view(buf_).substr(0, body_end)), nullptr, false);
        tool_call c;
        if (!j.is_discarded() && json_to_call(j, known_, c)) {
            ws_.clear();
            emit_whole_call(out, c);
        } else {
            emit_text(out, std::string(k_open) + buf_.substr(0, next));  // not a call: text, as parse() keeps it
        }
        buf_.erase(0, next);
        st_ = st::text;
    }
    void emit_whole_call(std::vector<call_event> &out, const tool_call &c) {
        out.push_back({call_event::call, c.arguments, n_begun_++, true, true, c.name});
    }

    const hermes_format &fmt_;
    std::vector<std::string> known_;
    st st_ = st::start;
    std::string buf_;   // unconsumed text of the current state
    std::string all_;   // the whole output while it may be a bare JSON call
    std::string ws_;    // trailing whitespace of the content, held back
    size_t n_begun_ = 0;
    int depth_ = 0;
    bool in_str_ = false, esc_ = false;
};

std::unique_ptr<call_decoder> hermes_format::decoder(const std::vector<std::string> &known) const {
    return std::make_unique<hermes_decoder>(*this, known);
}

}  // namespace

std::unique_ptr<tool_format> make_tool_format(std::string_view name) {
    if (name == "hermes") return std::make_unique<hermes_format>();
    if (name == "dsml") return make_dsml_tool_format();
    throw error("unknown tool-call format '" + std::string(name) + "' (hermes, dsml)");
}

}  // namespace fathom::toolcall
