// The JSON automaton (src/grammar/json_matcher.h) on hand-written schemas and documents: each case
// states, worked out by hand from the JSON grammar (RFC 8259) and the schema, whether the bytes are
// a complete document, a valid prefix of one, or refused at a given byte.
#include <gtest/gtest.h>

#include "grammar/json_matcher.h"

using namespace fathom::grammar;
using nlohmann::json;

namespace {

enum class verdict { complete, prefix, refused };

// Feeds s byte by byte; refused_at receives the index of the first refused byte (or -1).
verdict run(const std::shared_ptr<const json_grammar> &g, const std::string &s, int *refused_at = nullptr) {
    json_matcher m(g);
    for (size_t i = 0; i < s.size(); ++i)
        if (!m.feed(uint8_t(s[i]))) {
            if (refused_at) *refused_at = int(i);
            return verdict::refused;
        }
    if (refused_at) *refused_at = -1;
    return m.complete() ? verdict::complete : verdict::prefix;
}

std::shared_ptr<const json_grammar> S(const char *schema) { return compile_schema(json::parse(schema)); }

int refused_at(const std::shared_ptr<const json_grammar> &g, const std::string &s) {
    int at = -2;
    run(g, s, &at);
    return at;
}

}  // namespace

TEST(JsonMatcher, JsonObjectMode) {
    auto g = grammar_json_object();
    EXPECT_EQ(run(g, "{}"), verdict::complete);
    EXPECT_EQ(run(g, "{\"a\": [1, -2.5e+10, true, null, {\"b\": \"x\\u00e9\\n\"}]}"), verdict::complete);
    EXPECT_EQ(run(g, "{ \"k\" : \"v\" , \"k\": 1 }"), verdict::complete);  // duplicate keys are JSON
    EXPECT_EQ(run(g, "{\"a\": [1, 2"), verdict::prefix);
    EXPECT_EQ(refused_at(g, "[1]"), 0);          // json_object: the root is an object
    EXPECT_EQ(refused_at(g, " {}"), 0);          // no whitespace before the root
    EXPECT_EQ(refused_at(g, "{} "), 2);          // nor after it
    EXPECT_EQ(refused_at(g, "{\"a\":01}"), 6);   // leading zero
    EXPECT_EQ(refused_at(g, "{\"a\":1.}"), 7);   // a point needs a digit
    EXPECT_EQ(refused_at(g, "{\"a\":-}"), 6);
    EXPECT_EQ(refused_at(g, "{\"a\":tru}"), 8);
    EXPECT_EQ(refused_at(g, "{\"a\":\"\\x\"}"), 7);  // unknown escape
    EXPECT_EQ(refused_at(g, "{\"a\":\"\\ud800\"}"), 9);  // a surrogate escape
    EXPECT_EQ(refused_at(g, "{\"a\":\"\x01\"}"), 6);  // a raw control byte
    EXPECT_EQ(refused_at(g, "{\"a\":1,}"), 7);   // trailing comma
    EXPECT_EQ(refused_at(g, "{\"a\" 1}"), 5);
    EXPECT_EQ(refused_at(g, "{\"a\":[1 2]}"), 8);
}

TEST(JsonMatcher, Utf8InStrings) {
    auto g = S(R"({"type": "string"})");
    EXPECT_EQ(run(g, "\"h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80\""), verdict::complete);  // é € 😀
    EXPECT_EQ(refused_at(g, "\"\xC0\xAF\""), 1);          // overlong lead
    EXPECT_EQ(refused_at(g, "\"\xE0\x80\x80\""), 2);      // overlong 3-byte form
    EXPECT_EQ(refused_at(g, "\"\xED\xA0\x80\""), 2);      // UTF-16 surrogate in UTF-8
    EXPECT_EQ(refused_at(g, "\"\xF4\x90\x80\x80\""), 2);  // above U+10FFFF
    EXPECT_EQ(refused_at(g, "\"\xC3\""), 2);              // a lead byte, then the quote
    EXPECT_EQ(run(g, "\"\xE2\x82"), verdict::prefix);
}

TEST(JsonMatcher, ObjectPropertiesRequiredAdditional) {
    auto g = S(R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                   "required": ["name"], "additionalProperties": false})");
    EXPECT_EQ(run(g, "{\"name\": \"Ann\"}"), verdict::complete);
    EXPECT_EQ(run(g, "{\"age\": 3, \"name\": \"Ann\"}"), verdict::complete);  // any order
    EXPECT_EQ(refused_at(g, "{}"), 1);                       // name is required
    EXPECT_EQ(refused_at(g, "{\"age\": 3}"), 9);             // '}' before name
    EXPECT_EQ(refused_at(g, "{\"nick\": 1}"), 3);            // "n" could start "name"; "ni" cannot
    EXPECT_EQ(refused_at(g, "{\"name\": 1}"), 9);            // name is a string
    EXPECT_EQ(refused_at(g, "{\"age\": 1.5, \"name\": \"A\"}"), 9);  // age is an integer
    // Given twice: no key left unused starts with 'n' (unlisted keys are not allowed here).
    EXPECT_EQ(refused_at(g, "{\"name\": \"A\", \"name\": \"B\"}"), 15);
    EXPECT_EQ(refused_at(g, "{\"name\": \"A\", \"age\": 1,"), 22);  // nothing left to add
}

TEST(JsonMatcher, AdditionalPropertiesAllowed) {
    auto g = S(R"({"type": "object", "properties": {"a": {"type": "boolean"}}, "additionalProperties": {"type": "integer"}})");
    EXPECT_EQ(run(g, "{\"a\": true, \"b\": 2, \"ab\": 3}"), verdict::complete);
    EXPECT_EQ(refused_at(g, "{\"b\": true}"), 6);            // unlisted keys take integers
    EXPECT_EQ(refused_at(g, "{\"a\": 1}"), 6);               // a is a boolean
    EXPECT_EQ(refused_at(g, "{\"a\": true, \"a\": false}"), 14);  // a twice
    EXPECT_EQ(refused_at(g, "{\"x\\n\": 1}"), 3);            // unlisted keys: no escapes
    auto open = S(R"({"type": "object", "additionalProperties": true})");
    EXPECT_EQ(run(open, "{\"x\": [1, {\"y\": null}]}"), verdict::complete);
    // additionalProperties absent: no unlisted keys when the schema lists properties, any when it lists none.
    auto closed = S(R"({"type": "object", "properties": {"a": {"type": "null"}}})");
    EXPECT_EQ(refused_at(closed, "{\"b\""), 2);
    auto bare = S(R"({"type": "object"})");
    EXPECT_EQ(run(bare, "{\"b\": [1, {}]}"), verdict::complete);
}

TEST(JsonMatcher, ArraysAndCounts) {
    auto g = S(R"({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3})");
    EXPECT_EQ(run(g, "[1]"), verdict::complete);
    EXPECT_EQ(run(g, "[1, 2, 3]"), verdict::complete);
    EXPECT_EQ(refused_at(g, "[]"), 1);
    EXPECT_EQ(refused_at(g, "[1,2,3,"), 6);
    EXPECT_EQ(refused_at(g, "[1, \"x\"]"), 4);
    EXPECT_EQ(run(g, "[12"), verdict::prefix);
    auto zero = S(R"({"type": "array", "maxItems": 0})");
    EXPECT_EQ(run(zero, "[]"), verdict::complete);
    EXPECT_EQ(refused_at(zero, "[1]"), 1);
}

TEST(JsonMatcher, StringLengths) {
    auto g = S(R"({"type": "string", "minLength": 2, "maxLength": 3})");
    EXPECT_EQ(run(g, "\"ab\""), verdict::complete);
    EXPECT_EQ(run(g, "\"\\n\xC3\xA9x\""), verdict::complete);  // an escape and é count one each
    EXPECT_EQ(refused_at(g, "\"a\""), 2);
    EXPECT_EQ(refused_at(g, "\"abcd\""), 4);
}

TEST(JsonMatcher, EnumConstAndLazyLiterals) {
    auto g = S(R"({"enum": ["red", "green", 1, 12, null]})");
    EXPECT_EQ(run(g, "\"red\""), verdict::complete);
    EXPECT_EQ(run(g, "1"), verdict::complete);   // 1, or the start of 12
    EXPECT_EQ(run(g, "12"), verdict::complete);
    EXPECT_EQ(run(g, "null"), verdict::complete);
    EXPECT_EQ(refused_at(g, "\"blue\""), 1);
    EXPECT_EQ(refused_at(g, "13"), 1);
    EXPECT_EQ(refused_at(g, "\"red\" "), 5);
    auto arr = S(R"({"type": "array", "items": {"enum": [1, 12]}})");
    EXPECT_EQ(run(arr, "[1,12,1]"), verdict::complete);  // "1" ends at ','
    EXPECT_EQ(refused_at(arr, "[123]"), 3);
    auto c = S(R"({"const": {"k": [true]}})");
    EXPECT_EQ(run(c, "{\"k\":[true]}"), verdict::complete);  // the compact serialisation
    EXPECT_EQ(refused_at(c, "{\"k\": [true]}"), 5);
    auto typed = S(R"({"type": "string", "enum": ["a", 2]})");  // 2 is not a string: left out
    EXPECT_EQ(refused_at(typed, "2"), 0);
}

TEST(JsonMatcher, NumbersAndIntegers) {
    auto n = S(R"({"type": "number"})");
    for (const char *ok : {"0", "-0", "3.25", "-1e5", "2E-07", "0.5e+1", "123456789012345"})
        EXPECT_EQ(run(n, ok), verdict::complete) << ok;
    EXPECT_EQ(refused_at(n, "1234567890123456"), 15);  // 15 digits at most
    EXPECT_EQ(refused_at(n, "1e123"), 4);              // two exponent digits
    EXPECT_EQ(run(n, "1e"), verdict::prefix);
    auto i = S(R"({"type": "integer"})");
    EXPECT_EQ(run(i, "-42"), verdict::complete);
    EXPECT_EQ(refused_at(i, "4.2"), 1);
    EXPECT_EQ(refused_at(i, "4e2"), 1);
}

TEST(JsonMatcher, AnyOfAndNullableTypes) {
    auto g = S(R"({"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {"type": "boolean"}}]})");
    EXPECT_EQ(run(g, "\"x\""), verdict::complete);
    EXPECT_EQ(run(g, "null"), verdict::complete);
    EXPECT_EQ(run(g, "[true,false]"), verdict::complete);
    EXPECT_EQ(refused_at(g, "1"), 0);
    auto t = S(R"({"type": ["integer", "null"]})");
    EXPECT_EQ(run(t, "7"), verdict::complete);
    EXPECT_EQ(run(t, "null"), verdict::complete);
    EXPECT_EQ(refused_at(t, "\"7\""), 0);
}

TEST(JsonMatcher, RefsAndRecursion) {
    auto g = S(R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                   "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"],
                   "additionalProperties": false}}, "$ref": "#/$defs/node"})");
    EXPECT_EQ(run(g, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[]}]}"), verdict::complete);
    EXPECT_EQ(refused_at(g, "{\"v\":1,\"kids\":[{}]}"), 16);
}

TEST(JsonMatcher, NestingDepthIsBounded) {
    auto g = grammar_json_object();
    std::string s = "{\"a\":";
    int refused = -1;
    json_matcher m(g);
    for (char ch : s) ASSERT_TRUE(m.feed(uint8_t(ch)));
    for (int k = 0; k < 200 && refused < 0; ++k)
        if (!m.feed(uint8_t('['))) refused = k;
    EXPECT_GT(refused, 0);
    EXPECT_LT(refused, kMaxDepth);
}

TEST(JsonMatcher, WhitespaceRunsAreBounded) {
    auto g = grammar_json_object();
    json_matcher m(g);
    ASSERT_TRUE(m.feed(uint8_t('{')));
    int n = 0;
    while (n < 100 && m.feed(uint8_t(' '))) ++n;
    EXPECT_EQ(n, kMaxWhitespace);
    EXPECT_TRUE(m.feed(uint8_t('}')));
    EXPECT_TRUE(m.done());
}

TEST(JsonMatcher, MarkUndoRestoresState) {
    auto g = S(R"({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}}}, "required": ["a"]})");
    json_matcher m(g);
    for (char ch : std::string("{\"a\": [1")) ASSERT_TRUE(m.feed(uint8_t(ch)));
    const auto mk = m.mark();
    for (char ch : std::string("2, 3]}")) ASSERT_TRUE(m.feed(uint8_t(ch)));
    EXPECT_TRUE(m.complete());
    m.undo(mk);
    EXPECT_FALSE(m.complete());
    for (char ch : std::string(".5]}")) ASSERT_TRUE(m.feed(uint8_t(ch)));
    EXPECT_TRUE(m.done());
}

TEST(JsonMatcher, ToolCallChoice) {
    // Forced call in the Hermes form: the prompt ends at {"name": "  — name, arguments, close.
    auto g = compile_tool_call({"get_weather\", \"arguments\": ", "get_time\", \"arguments\": "},
                               {json::parse(R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})"),
                                json::parse(R"({"type":"object","additionalProperties":false})")},
                               "}\n</tool_call>");
    EXPECT_EQ(run(g, "get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"), verdict::complete);
    EXPECT_EQ(run(g, "get_time\", \"arguments\": {}}\n</tool_call>"), verdict::complete);
    EXPECT_EQ(refused_at(g, "get_time\", \"arguments\": {\"city\""), 25);
    EXPECT_EQ(refused_at(g, "get_weather\", \"arguments\": {}"), 28);  // city is required
    EXPECT_EQ(refused_at(g, "get_x"), 4);
}

TEST(JsonSchemaCompile, UnsupportedKeywordsAreNamed) {
    auto keyword_of = [](const char *schema) -> std::string {
        try {
            compile_schema(json::parse(schema));
        } catch (const schema_error &e) {
            return e.keyword + "@" + e.path;
        }
        return "accepted";
    };
    EXPECT_EQ(keyword_of(R"({"type": "string", "pattern": "^a"})"), "pattern@");
    EXPECT_EQ(keyword_of(R"({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}})"), "minimum@/properties/n");
    EXPECT_EQ(keyword_of(R"({"type": "objekt"})"), "type@");
    EXPECT_EQ(keyword_of(R"({"anyOf": [{"type": "object"}, {"type": "object", "properties": {}}]})"), "anyOf@/anyOf");
    EXPECT_EQ(keyword_of(R"({"$ref": "#/$defs/missing"})"), "$ref@");
    EXPECT_EQ(keyword_of(R"({"$ref": "http://x/y.json"})"), "$ref@");
    EXPECT_EQ(keyword_of(R"({"type": "array", "minItems": 3, "maxItems": 2})"), "minItems@");
    EXPECT_EQ(keyword_of(R"({"type": "object", "required": ["x"], "additionalProperties": false})"), "required@");
    EXPECT_EQ(keyword_of(R"({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"})"), "$ref@/$defs/a");
    EXPECT_EQ(keyword_of(R"({"enum": []})"), "enum@");
    EXPECT_EQ(keyword_of(R"({"type": "string", "format": "date", "title": "t", "description": "d"})"), "accepted");
    std::string deep = "{\"type\": \"string\"}";
    for (int i = 0; i < 300; ++i) deep = "{\"type\": \"array\", \"items\": " + deep + "}";
    EXPECT_EQ(keyword_of(deep.c_str()).substr(0, 1), "@");  // nested too deep: refused, not a stack overflow
}
