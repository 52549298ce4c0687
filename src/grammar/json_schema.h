// Structured output, part 1: a JSON Schema (subset) compiled to a grammar graph that the matcher
// (json_matcher.h) runs as a character-level pushdown automaton.
//
// The graph is a vector of nodes addressed by index; a node describes the bytes of one JSON value:
//
//   any      — any JSON value (json_object mode's values, additionalProperties: true, schema {} / true)
//   object   — '{' properties '}': keys from `props` (each at most once), values by their node; keys not
//              listed only when `additional` >= 0 (their values follow that node); '}' only once every
//              required property was given
//   array    — '[' items (min_items..max_items) ']'
//   string   — a JSON string of min_len..max_len code points (an escape counts as one)
//   number / integer
//   literals — one of `lits` exactly (enum, const, true/false/null), the bytes of each value's
//              compact serialisation; sorted, so the candidates matching a prefix are a range
//   any_of   — one of `branches`, chosen by the value's first byte (`by_first_byte`): branches must
//              start with different bytes (a string and a null, an object and an array, ...)
//   sequence — `parts` one after the other, no whitespace between (tool-call text around a value)
//   choice   — one of `lits`, then the value of node conts[i] (forced tool calls: a name, then its
//              arguments); `lits` is prefix-free
//
// What is generated is a subset of what the schema accepts, never more: no whitespace after the
// last byte of the document, at most kMaxWhitespace whitespace bytes in a row between tokens,
// numbers with at most 15 digits before and after the point and a two-digit exponent, no \u escape
// of a UTF-16 surrogate, object keys outside `props` without escapes, and properties the schema does
// not list only when additionalProperties says so (absent: none when the schema lists properties, any
// when it lists none). docs/server.md
// "Structured output" lists the keywords; compile_schema throws schema_error for the rest.
#pragma once
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fathom::grammar {

// An unsupported or invalid schema: `keyword` is the offending keyword ("" when the problem is the
// schema's shape), `path` a JSON pointer to the schema object holding it ("" = the root).
class schema_error : public std::runtime_error {
public:
    schema_error(const std::string &msg, std::string keyword, std::string path)
        : std::runtime_error(msg), keyword(std::move(keyword)), path(std::move(path)) {}
    std::string keyword;
    std::string path;
};

enum class node_kind : uint8_t { any, object, array, string, number, integer, literals, any_of, sequence, choice };

inline constexpr int kMaxWhitespace = 24;   // whitespace bytes in a row between tokens
inline constexpr int kMaxDepth = 64;        // frames of the automaton: nesting limit of a document
inline constexpr int kMaxNumberDigits = 15;  // integer part, and fraction part, of a number
inline constexpr int kMaxProperties = 64;   // properties of one object schema (a bit mask tracks them)
inline constexpr int kMaxSchemaDepth = 256; // schemas nested in a schema (and $refs followed in a chain)

struct property {
    std::string key;       // the name as a JSON string, quotes included: "\"city\""
    int32_t node = -1;     // its value
    bool required = false;
};

struct node {
    node_kind kind = node_kind::any;
    // object: props sorted by key bytes
    std::vector<property> props;
    int32_t additional = -1;      // node of values of unlisted keys; -1 = no unlisted keys
    bool key_escapes = false;     // unlisted keys may hold escapes (json_object mode)
    uint64_t required_mask = 0;   // bit i: props[i] is required
    // array
    int32_t items = -1;
    int64_t min_items = 0, max_items = -1;  // -1 = unbounded
    // string
    int64_t min_len = 0, max_len = -1;
    // literals / choice: sorted byte strings; choice: conts[i] follows lits[i]
    std::vector<std::string> lits;
    std::vector<int32_t> conts;
    // any_of
    std::vector<int32_t> branches;
    std::array<int16_t, 256> by_first_byte{};  // branch index, -1 = none
    // sequence
    std::vector<int32_t> parts;
};

// A compiled grammar. Nodes 0..3 are built in: any value, its object, array and string.
struct json_grammar {
    std::vector<node> nodes;
    int32_t root = 0;
    static constexpr int32_t k_any = 0, k_any_object = 1, k_any_array = 2, k_any_string = 3, k_any_number = 4,
                             k_any_literal = 5;
};

// json_object mode: any JSON object.
std::shared_ptr<const json_grammar> grammar_json_object();

// A schema (the JSON Schema subset of docs/server.md) -> its grammar. Throws schema_error.
std::shared_ptr<const json_grammar> compile_schema(const nlohmann::json &schema);

// A forced tool call (tool_calls.h): the generated text is before[i] + a value of schemas[i] +
// after, for one i; with a single tool and an empty before[0], just the value then `after`.
// Throws schema_error (path prefixed by the tool's index: "/0/properties/x").
std::shared_ptr<const json_grammar> compile_tool_call(const std::vector<std::string> &before,
                                                      const std::vector<nlohmann::json> &schemas,
                                                      const std::string &after);

}  // namespace fathom::grammar
