// libFuzzer target: the structured-output grammar (src/grammar/json_schema.h, json_matcher.h).
// Input: a JSON Schema, a NUL byte, then a candidate document (no NUL: the whole input is the schema and
// the document is empty; a schema that is not JSON is replaced by {} (any value)). The schema compiles or
// is refused with schema_error; the document's bytes are fed until one is refused. Oracles: no crash,
// leak or sanitizer report; a prefix the matcher calls complete is valid JSON (nlohmann's own parser
// decides), and feeding the accepted prefix again gives the same answers (the matcher is deterministic).
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "grammar/json_matcher.h"
#include "grammar/json_schema.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string in(reinterpret_cast<const char *>(data), size);
    const size_t cut = in.find('\0');
    const std::string schema_text = in.substr(0, cut), doc = cut == std::string::npos ? "" : in.substr(cut + 1);
    nlohmann::json schema = nlohmann::json::parse(schema_text, nullptr, false);
    if (schema.is_discarded()) schema = nlohmann::json::object();
    std::shared_ptr<const fathom::grammar::json_grammar> g;
    try {
        g = fathom::grammar::compile_schema(schema);
    } catch (const std::exception &) {
        return 0;  // refused: the server answers 400
    }
    fathom::grammar::json_matcher m(g);
    size_t accepted = 0;
    while (accepted < doc.size() && m.feed(static_cast<uint8_t>(doc[accepted]))) ++accepted;
    const bool complete = m.complete();
    if (complete && !nlohmann::json::accept(doc.substr(0, accepted))) __builtin_trap();  // accepted non-JSON
    fathom::grammar::json_matcher again(g);
    if (!again.feed(doc.substr(0, accepted)) || again.complete() != complete) __builtin_trap();
    return 0;
}
