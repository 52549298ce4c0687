// Hand-worked unit tests for the Jinja interpreter: expected values below were derived by hand from
// Python / jinja2 semantics (not produced by the code under test), plus the error contract:
// raise_exception surfaces its exact message; unsupported constructs and unknown filters name
// themselves and the template line.
#include <gtest/gtest.h>

#include "chat/chat_template.h"
#include "chat/jinja_ast.h"
#include "chat/jinja_interp.h"
#include "chat/jinja_value.h"

namespace {

using fathom::jinja::value;
using ojson = nlohmann::ordered_json;

std::string render(const std::string &src, const ojson &vars = ojson::object()) {
    std::vector<std::pair<std::string, value>> v;
    for (auto it = vars.begin(); it != vars.end(); ++it) v.emplace_back(it.key(), value::from_json(it.value()));
    auto ast = fathom::jinja::jinja_parse(src, fathom::jinja::lexer_options{});
    return fathom::jinja::jinja_render(ast, v, fathom::jinja::render_options{});
}

std::string error_of(const std::string &src, const ojson &vars = ojson::object()) {
    try {
        render(src, vars);
    } catch (const fathom::error &e) {
        return e.what();
    }
    return "<no error>";
}

TEST(jinja_expr, arithmetic_follows_python) {
    EXPECT_EQ(render("{{ 1 + 2 * 3 }}"), "7");
    EXPECT_EQ(render("{{ 2 ** 10 }}"), "1024");
    EXPECT_EQ(render("{{ 7 / 2 }}"), "3.5");    // true division gives a float
    EXPECT_EQ(render("{{ 8 / 2 }}"), "4.0");
    EXPECT_EQ(render("{{ -7 // 2 }}"), "-4");   // floor, not truncation
    EXPECT_EQ(render("{{ -7 % 3 }}"), "2");     // sign of the divisor
    EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }}"), "a1None");
    EXPECT_EQ(render("{{ [1] + [2, 3] }}"), "[1, 2, 3]");
    EXPECT_EQ(render("{{ 1 == 1.0 and true == 1 }}"), "True");
    EXPECT_EQ(render("{{ 0 or 'x' }}|{{ 0 and 'x' }}"), "x|0");  // and/or return operands
}

TEST(jinja_expr, python_float_repr) {
    EXPECT_EQ(fathom::jinja::py_float_repr(0.1), "0.1");
    EXPECT_EQ(fathom::jinja::py_float_repr(2.0), "2.0");
    EXPECT_EQ(fathom::jinja::py_float_repr(1e16), "1e+16");
    EXPECT_EQ(fathom::jinja::py_float_repr(1e15), "1000000000000000.0");
    EXPECT_EQ(fathom::jinja::py_float_repr(0.0001), "0.0001");
    EXPECT_EQ(fathom::jinja::py_float_repr(0.00001), "1e-05");
    EXPECT_EQ(fathom::jinja::py_float_repr(-0.0), "-0.0");
    EXPECT_EQ(fathom::jinja::py_float_repr(1.0 / 3.0), "0.3333333333333333");
    EXPECT_EQ(fathom::jinja::py_float_repr(0.1 + 0.2), "0.30000000000000004");
}

TEST(jinja_expr, strings_index_by_code_point) {
    ojson v = {{"s", "h\xC3\xA9llo"}};  // "héllo": 5 code points, 6 bytes
    EXPECT_EQ(render("{{ s | length }}", v), "5");
    EXPECT_EQ(render("{{ s[1] }}", v), "\xC3\xA9");
    EXPECT_EQ(render("{{ s[::-1] }}", v), "oll\xC3\xA9h");
    EXPECT_EQ(render("{{ s[-2:] }}", v), "lo");
    EXPECT_EQ(render("{{ s.upper() }}", v), "H\xC3\x89LLO");  // U+00E9 -> U+00C9
    EXPECT_EQ(render("{{ '\xC3\x9F\xD0\xB6' | upper }}"), "SS\xD0\x96");  // German sharp s, Cyrillic zhe
}

TEST(jinja_expr, containers_print_like_python) {
    EXPECT_EQ(render("{{ [1, 'a', none, true, 1.5] }}"), "[1, 'a', None, True, 1.5]");
    EXPECT_EQ(render("{{ {'k': \"it's\"} }}"), "{'k': \"it's\"}");
    EXPECT_EQ(render("{{ (1,) }}|{{ () }}"), "(1,)|()");
}

TEST(jinja_expr, undefined_semantics) {
    EXPECT_EQ(render("[{{ missing }}]"), "[]");
    EXPECT_EQ(render("{{ missing is defined }}|{{ missing | default('d') }}|{{ missing | length }}"), "False|d|0");
    EXPECT_EQ(render("{{ m.nokey is defined }}", {{"m", {{"a", 1}}}}), "False");
    EXPECT_EQ(render("{% for x in missing %}x{% else %}empty{% endfor %}"), "empty");
    EXPECT_NE(error_of("{{ missing.attr }}").find("'missing' is undefined"), std::string::npos);
}

TEST(jinja_expr, tojson_is_transformers_not_html_safe) {
    ojson v = {{"d", {{"b", "<\xC3\xA9&'>"}, {"a", {1, 2.5, nullptr}}}}};
    // jinja2's own tojson would print \u003c etc.; transformers' json.dumps(ensure_ascii=False) does not.
    EXPECT_EQ(render("{{ d | tojson }}", v), "{\"b\": \"<\xC3\xA9&'>\", \"a\": [1, 2.5, null]}");
    EXPECT_EQ(render("{{ d.a | tojson(indent=2) }}", v), "[\n  1,\n  2.5,\n  null\n]");
    EXPECT_EQ(render("{{ d | tojson(sort_keys=true, separators=(',', ':')) }}", v), "{\"a\":[1,2.5,null],\"b\":\"<\xC3\xA9&'>\"}");
}

TEST(jinja_whitespace, trim_and_lstrip_blocks) {
    // lstrip removes the indentation before {% %}; trim_blocks removes the newline after it.
    EXPECT_EQ(render("  {% if true %}\n    x\n  {% endif %}\nafter"), "    x\nafter");
    // {{ }} is not affected by either.
    EXPECT_EQ(render("  {{ 'v' }}\nz"), "  v\nz");
    // '-' strips all whitespace on its side, including newlines.
    EXPECT_EQ(render("a\n\n  {{- 'b' -}}  \n\nc"), "abc");
    // '+' disables lstrip / trim for that tag.
    EXPECT_EQ(render("  {%+ if true +%}\nx{% endif %}"), "  \nx");
    // One trailing newline of the template is dropped; \r\n becomes \n.
    EXPECT_EQ(render("a\r\nb\n"), "a\nb");
    EXPECT_EQ(render("{# note #}\nx"), "x");
}

TEST(jinja_stmt, scoping_namespace_and_loops) {
    EXPECT_EQ(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "1");
    EXPECT_EQ(render("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}"), "4");
    EXPECT_EQ(render("{% for i in [5, 6, 7] %}{{ loop.index }}{{ loop.revindex0 }}{{ loop.first }}|{% endfor %}"), "12True|21False|30False|");
    EXPECT_EQ(render("{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %}", {{"d", {{"z", 1}, {"a", 2}}}}), "z1a2");
    EXPECT_EQ(render("{% macro f(a, b=2) %}{{ a + b }}{% endmacro %}{{ f(1) }}{{ f(1, b=5) }}"), "36");
}

TEST(jinja_errors, raise_exception_message_is_exact) {
    try {
        render("line1\n{{ raise_exception('Only user and assistant roles are supported!') }}");
        FAIL() << "no exception";
    } catch (const fathom::jinja::template_exception &e) {
        EXPECT_STREQ(e.what(), "Only user and assistant roles are supported!");
    }
}

TEST(jinja_errors, gemma3_role_alternation) {
    ojson doc;
    std::string src =
        "{%- for message in messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
        "{{ message['content'] }}{%- endfor -%}";
    fathom::chat_template t(src);
    fathom::chat_template_inputs in;
    in.messages = ojson::parse(R"([{"role":"user","content":"a"},{"role":"user","content":"b"}])");
    try {
        t.render(in);
        FAIL() << "no exception";
    } catch (const fathom::jinja::template_exception &e) {
        EXPECT_STREQ(e.what(), "Conversation roles must alternate user/assistant/user/assistant/...");
    }
    in.messages = ojson::parse(R"([{"role":"user","content":"a"},{"role":"assistant","content":"b"}])");
    EXPECT_EQ(t.render(in), "ab");
}

TEST(jinja_errors, unknown_filter_and_tags_are_named_with_line) {
    std::string e = error_of("ok\n{{ x | frobnicate }}");
    EXPECT_NE(e.find("frobnicate"), std::string::npos) << e;
    EXPECT_NE(e.find("line 2"), std::string::npos) << e;
    e = error_of("{% if x is shiny %}{% endif %}");
    EXPECT_NE(e.find("No test named 'shiny'"), std::string::npos) << e;
    e = error_of("\n\n{% do x %}");
    EXPECT_NE(e.find("unknown tag 'do'"), std::string::npos) << e;
    EXPECT_NE(e.find("line 3"), std::string::npos) << e;
    e = error_of("{% include 'other.jinja' %}");
    EXPECT_NE(e.find("'include'"), std::string::npos) << e;
    e = error_of("{% if true %}unclosed");
    EXPECT_NE(e.find("endif"), std::string::npos) << e;
    e = error_of("{% for x in [1] %}{% endif %}");
    EXPECT_NE(e.find("endif"), std::string::npos) << e;
}

TEST(jinja_errors, runtime_errors_carry_line) {
    std::string e = error_of("a\nb\n{{ 'x' + 1 }}");
    EXPECT_NE(e.find("line 3"), std::string::npos) << e;
    EXPECT_NE(e.find("can only concatenate str"), std::string::npos) << e;
    e = error_of("{{ [1].append(2) }}");
    EXPECT_NE(e.find("unsafe"), std::string::npos) << e;
    e = error_of("{{ 1 // 0 }}");
    EXPECT_NE(e.find("division"), std::string::npos) << e;
    e = error_of("{{ x.y.z }}", {{"x", ojson::object()}});
    EXPECT_NE(e.find("'dict object' has no attribute 'y'"), std::string::npos) << e;
    e = error_of("{{ 9223372036854775807 + 1 }}");
    EXPECT_NE(e.find("overflow"), std::string::npos) << e;
}

TEST(chat_template_api, variables_transformers_passes) {
    fathom::chat_template t(
        "{{ bos_token }}{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}|"
        "{{ strftime_now('%d %b %Y') }}{{ eos_token }}");
    fathom::chat_template_inputs in;
    in.bos_token = "<s>";
    in.eos_token = "</s>";
    in.add_generation_prompt = true;
    in.extra = {{"enable_thinking", false}};
    std::tm tm{};
    tm.tm_year = 124;  // 2024
    tm.tm_mon = 6;     // July
    tm.tm_mday = 26;
    in.now = tm;
    EXPECT_EQ(t.render(in), "<s>True|True|True|False|26 Jul 2024</s>");
    in.messages = ojson::object();
    EXPECT_THROW(t.render(in), fathom::error);
}

}  // namespace

// The sandbox's limits (jinja_value.h): a hostile template from a model file gets one error naming the
// limit instead of a hang or an exhausted server, and a long real conversation stays far inside them.
TEST(jinja_sandbox, runaway_templates_stop_with_an_error) {
    const std::string steps = "statements and loop iterations: the chat template sandbox's limit";
    const std::string size = "result too large (over 64 MiB): the chat template sandbox's limit";
    auto stops = [](const std::string &src, const std::string &why) {
        EXPECT_NE(error_of(src).find(why), std::string::npos) << src;
    };
    // 10^10 iterations of nested loops (each range alone is within jinja2's MAX_RANGE)
    stops("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", steps);
    // a filtered loop's probes count too
    stops("{% for a in range(99999) %}{% for b in range(99999) if b < 0 %}{% endfor %}{% endfor %}", steps);
    // a macro calling itself twice per level: 2^100 calls within the depth limit
    stops("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(99) }}", steps);
    // strings and lists doubling through a namespace (2^41 bytes / elements)
    stops("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", size);
    stops("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", size);
    stops("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", size);
    // a list of big strings repeated: few elements, many bytes
    stops("{{ ['x' * 1000000] * 100 }}", size);
    // filters that multiply their input
    stops("{{ ('x' * 10000) | replace('x', 'y' * 10000) }}", size);
    stops("{{ range(10000) | join('z' * 10000) }}", size);
    // output written piece by piece
    stops("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", size);
    // the error names the template line like any other
    EXPECT_EQ(error_of("\n\n{{ 'ab' * 40000000 }}"), "chat template line 3: " + size);
}

TEST(jinja_sandbox, long_conversation_renders_within_the_limits) {
    // 20,000 messages of 200 bytes (4 MB of prompt) through a loop with per-message statements
    ojson msgs = ojson::array();
    for (int i = 0; i < 20000; ++i) msgs.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", std::string(200, 'a')}});
    const std::string out = render(
        "{% for m in messages %}{% if m.role == 'user' %}U: {% else %}A: {% endif %}{{ m.content | trim }}\n{% endfor %}",
        {{"messages", msgs}});
    EXPECT_EQ(out.size(), 20000u * (3 + 200 + 1));
}

