// DSML, DeepSeek V4's tool-call markup: rendering calls the way the official encoder
// (encoding_dsv4.py) writes them, parsing model output back into calls (whole text or streamed
// token pieces), and the exact-replay map that keeps the sampled DSML bytes per call id.
//
// What a tool-call block looks like (official form, "｜" is U+FF5C):
//
//   \n\n<｜DSML｜tool_calls>
//   <｜DSML｜invoke name="get_weather">
//   <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
//   <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
//   </｜DSML｜invoke>
//   </｜DSML｜tool_calls>
//
// string="true": the value is the raw string; string="false": the value is JSON text.
// The parser also accepts the degraded tag prefixes the model sometimes samples: "DSML｜"
// (short), "|DSML|" (ASCII bars) and none at all (bare <tool_calls>, <invoke>, <parameter>).
// Rules, sources and the error policy are written down in docs/ds4-chat-format.md.
#pragma once
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace fathom::ds4chat {

// ---- special strings of the DS4 vocabulary (UTF-8) ----
inline constexpr std::string_view k_bos = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view k_eos = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view k_user = "<｜User｜>";
inline constexpr std::string_view k_assistant = "<｜Assistant｜>";
inline constexpr std::string_view k_latest_reminder = "<｜latest_reminder｜>";
inline constexpr std::string_view k_think_open = "<think>";
inline constexpr std::string_view k_think_close = "</think>";
inline constexpr std::string_view k_dsml = "｜DSML｜";

// json.dumps(value, ensure_ascii=False) of CPython: ", " and ": " separators, keys in the order
// the ordered_json holds them, non-ASCII written raw, control characters as \u00xx, floats as
// repr() writes them. Throws fathom::error on binary values or nesting deeper than 512.
std::string py_json_dumps(const nlohmann::ordered_json &value);

// One tool call. `arguments` is JSON object text (the OpenAI "function.arguments" string).
struct dsml_call {
    std::string name;
    std::string arguments;
    bool operator==(const dsml_call &) const = default;
};

// The parameters of one call, official encode_arguments_to_dsml(): `arguments` text is parsed as
// JSON; if that fails the whole text becomes one string parameter named "arguments". Parameters
// are joined by "\n", in the object's key order. Throws fathom::error if the JSON is not an object.
std::string dsml_render_parameters(std::string_view arguments);

// The whole block of an assistant turn, leading "\n\n" included (the official tool_calls_template
// prefixed by "\n\n"). Empty string for no calls.
std::string dsml_render_tool_calls(const std::vector<dsml_call> &calls);

// The "## Tools" system-prompt section (official TOOLS_TEMPLATE): the DSML grammar, then each
// tool's schema as one py_json_dumps line. `tools` is a JSON array whose entries are either
// OpenAI-form {"type":"function","function":{...}} (the "function" object is used) or the
// function object itself. Ends with "...to invoke tool calls.\n". Throws fathom::error if `tools`
// is not an array.
std::string dsml_render_tools_section(const nlohmann::ordered_json &tools);

// ---- parsing ----

struct dsml_parser_options {
    // The prompt ended with "<think>": output starts as reasoning and switches to content at
    // "</think>".
    bool thinking = false;
    // Malformed or unterminated DSML: false (default) reports it in dsml_result::error and keeps
    // its bytes out of the content (they are in error_text); true appends them to the content.
    bool malformed_as_text = false;
};

// A call as it decodes, for streaming it (OpenAI delta.tool_calls, Anthropic input_json_delta).
// An invoke's opening tag starts call `index` (begin, name set, arguments "{"); its arguments text
// then grows fragment by fragment: '"key": ' (', "key": ' after the first parameter) at each
// parameter tag, plus '"' and then a string value's JSON-escaped bytes as they arrive (held back: a
// possible start of the closing tag and an incomplete UTF-8 tail), the closing '"' at its closing
// tag; a string="false" value whole at its closing tag (JSON text verbatim, or quoted when it is not
// JSON); "}" when the invoke closes (end). The concatenated fragments of a call that ended equal its
// dsml_call::arguments. Unlike dsml_delta::calls these come before the block closes, so a block
// that later proves malformed has already yielded them.
struct dsml_call_delta {
    size_t index = 0;        // 0-based over the whole output (every invoke opened, in order)
    bool begin = false;      // first delta of the call: `name` is set
    bool end = false;        // the invoke closed: the arguments are complete
    std::string name;
    std::string arguments;   // the fragment
    size_t content_pos = 0;  // bytes of dsml_delta::content that came before this delta (their order)
};

// What one feed() made certain. Calls are reported when their whole tool_calls block has closed,
// so a block that later proves malformed never yields calls; call_deltas report them as they decode.
struct dsml_delta {
    std::string reasoning;
    std::string content;
    std::vector<dsml_call> calls;
    std::vector<dsml_call_delta> call_deltas;
    bool empty() const { return reasoning.empty() && content.empty() && calls.empty() && call_deltas.empty(); }
};

struct dsml_result {
    std::string reasoning;        // text before "</think>" (thinking mode)
    std::string content;          // visible text, DSML markup removed
    std::vector<dsml_call> calls;
    std::string raw_dsml;         // sampled bytes of the tool-call block(s): whitespace before the
                                  // opening tag, the tags, whitespace after the closing tag
    bool replay_exact = false;    // content + raw_dsml == the content part of the output (no text
                                  // came between or after blocks): raw_dsml may be replayed
    bool reasoning_closed = false;
    bool saw_eos = false;         // "<｜end▁of▁sentence｜>" appeared as text; the rest was ignored
    std::string error;            // empty when well formed; one line otherwise
    std::string error_text;       // bytes of the malformed block and everything after it
};

// Incremental parser: feed it the detokenized pieces in order, then finish(). It never emits a
// byte of content that could still turn out to be DSML, holds back whitespace that may precede a
// block and an incomplete UTF-8 tail, and gives the same result for any split of the same text.
class dsml_stream_parser {
public:
    explicit dsml_stream_parser(dsml_parser_options opts = {});
    dsml_delta feed(std::string_view piece);
    dsml_delta finish();  // end of output: flushes held bytes, reports unterminated blocks
    const dsml_result &result() const { return res_; }
    // Bytes of content emitted before the first tool_calls block started (all content if none).
    size_t content_before_first_block() const;

private:
    enum class state { reasoning, content, block, failed, done };
    enum class block_state { top, invoke, value };
    void pump(dsml_delta &d, bool at_end);
    bool step_reasoning(dsml_delta &d, bool at_end);
    bool step_content(dsml_delta &d, bool at_end);
    bool step_block(dsml_delta &d, bool at_end);
    bool block_tag(std::string_view tag, dsml_delta &d);
    void close_block(size_t end, dsml_delta &d);
    void fail(std::string message, dsml_delta &d);
    void emit_content(std::string_view s, dsml_delta &d);
    void call_fragment(dsml_delta &d, std::string text, bool end);  // extends the open call's arguments
    void stream_value(dsml_delta &d, size_t upto);                  // string value bytes [vsent_, upto)

    dsml_parser_options opts_;
    dsml_result res_;
    state st_;
    std::string pend_;          // unconsumed bytes (reasoning/content states)
    std::string seg_;           // raw bytes of the open block up to blk_ (whitespace + opening tag)
    std::string blk_;           // bytes after the opening tag of the open block
    size_t cur_ = 0;            // parse position in blk_
    size_t scan_ = 0;           // value scan restart position in blk_
    block_state bst_ = block_state::top;
    std::vector<dsml_call> block_calls_;
    std::string call_name_;
    std::vector<std::pair<std::string, std::string>> call_args_;  // name -> JSON value text
    std::string param_name_;
    bool param_is_string_ = true;
    bool after_block_ = false;          // a block closed and no content came since
    bool any_block_ = false;
    size_t content_before_block_ = 0;
    size_t n_invokes_ = 0;              // invokes opened so far (call_deltas index)
    size_t vsent_ = 0;                  // bytes of the open string value already streamed
};

// Whole-output parse (feed + finish).
dsml_result dsml_parse(std::string_view text, dsml_parser_options opts = {});

// Length of the prefix of `text` (generated so far, content mode) that is certainly visible
// content whatever comes next.
size_t dsml_safe_content_prefix(std::string_view text);

// ---- exact replay ----

// Keeps the sampled DSML bytes of assistant turns keyed by tool-call id, so that when the client
// sends the turn back (with those ids) the prompt re-renders byte-identically to what the model
// produced, and the KV prefix stays reusable. One record holds a whole block and the ordered ids
// of its calls; lookup succeeds only for exactly that id list. At most `max_ids` ids are kept;
// the oldest are evicted first. Thread-safe.
class dsml_replay_map {
public:
    explicit dsml_replay_map(size_t max_ids = 100000);
    // Stores `raw` under each id (ids must be non-empty and unique). Re-storing an id replaces it.
    void remember(const std::vector<std::string> &ids, std::string raw);
    std::optional<std::string> lookup(const std::vector<std::string> &ids) const;
    size_t size() const;
    size_t max_ids() const { return max_ids_; }

private:
    struct record {
        std::vector<std::string> ids;
        std::string raw;
    };
    struct slot {
        std::shared_ptr<const record> rec;
        uint64_t seq;
    };
    void evict_locked();
    size_t max_ids_;
    mutable std::mutex mu_;
    std::unordered_map<std::string, slot> by_id_;
    std::deque<std::pair<std::string, uint64_t>> order_;  // insertion order, (id, seq)
    uint64_t next_seq_ = 0;
};

}  // namespace fathom::ds4chat

// The toolcall::tool_format speaking DSML (defined in dsml.cpp): make_tool_format("dsml"), the format the
// DeepSeek V4 engine names (model_info::tool_format).
namespace fathom::toolcall {
class tool_format;
std::unique_ptr<tool_format> make_dsml_tool_format();
}  // namespace fathom::toolcall
