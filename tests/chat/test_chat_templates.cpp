// Chat template golden tests: every case in tests/chat/data/<template>.json was rendered by Python
// jinja2 in transformers' environment (scripts/gen_template_refs.py); Fathom must reproduce each
// output byte for byte, and fail exactly where jinja2 failed (raise_exception with the same message).
#include <gtest/gtest.h>

#include <ctime>
#include <fstream>
#include <sstream>

#include "chat/chat_template.h"
#include "chat/jinja_ast.h"
#include "chat/jinja_interp.h"

namespace {

using ojson = nlohmann::ordered_json;

ojson load_json(const std::string &name) {
    std::string path = std::string(FATHOM_SOURCE_DIR) + "/tests/chat/data/" + name;
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ojson::parse(ss.str());
}

// "YYYY-MM-DDTHH:MM:SS" -> std::tm with weekday / year-day filled in (as Python's datetime has them).
std::tm parse_now(const std::string &s) {
    std::tm tm{};
    if (std::sscanf(s.c_str(), "%d-%d-%dT%d:%d:%d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec) != 6)
        throw std::runtime_error("bad now: " + s);
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    std::time_t t = timegm(&tm);
    gmtime_r(&t, &tm);
    return tm;
}

// Shows where two renderings first differ, with some context.
std::string first_diff(const std::string &want, const std::string &got) {
    size_t i = 0;
    while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
    size_t from = i > 40 ? i - 40 : 0;
    return "first difference at byte " + std::to_string(i) + "\n want: " + ojson(want.substr(from, 100)).dump() +
           "\n  got: " + ojson(got.substr(from, 100)).dump();
}

void run_template_file(const std::string &name) {
    ojson doc = load_json(name + ".json");
    fathom::chat_template tmpl(doc["template"].get<std::string>());
    std::tm now = parse_now(doc["now"].get<std::string>());
    int checked = 0;
    for (const auto &c : doc["cases"]) {
        SCOPED_TRACE(name + " case " + c["name"].get<std::string>());
        fathom::chat_template_inputs in;
        in.messages = c["messages"];
        in.tools = c["tools"];
        in.add_generation_prompt = c["add_generation_prompt"].get<bool>();
        in.bos_token = c["bos_token"].get<std::string>();
        in.eos_token = c["eos_token"].get<std::string>();
        in.extra = c["extra"];
        in.now = now;
        if (c.contains("expected")) {
            std::string want = c["expected"].get<std::string>();
            std::string got;
            try {
                got = tmpl.render(in);
            } catch (const std::exception &e) {
                ADD_FAILURE() << "unexpected error: " << e.what();
                continue;
            }
            EXPECT_TRUE(got == want) << first_diff(want, got);
        } else if (c["error_kind"] == "raise") {
            try {
                tmpl.render(in);
                ADD_FAILURE() << "expected raise_exception: " << c["error"];
            } catch (const fathom::jinja::template_exception &e) {
                EXPECT_EQ(std::string(e.what()), c["error"].get<std::string>());
            } catch (const std::exception &e) {
                ADD_FAILURE() << "expected raise_exception, got: " << e.what();
            }
        } else {
            // jinja2 failed with a Python error (TypeError, UndefinedError, ...): Fathom must fail too.
            EXPECT_THROW(tmpl.render(in), fathom::error) << "jinja2 failed with " << c["error_kind"] << ": " << c["error"];
        }
        ++checked;
    }
    EXPECT_GE(checked, 40);
}

TEST(chat_templates, smollm2_from_gguf) { run_template_file("smollm2"); }
TEST(chat_templates, gemma3) { run_template_file("gemma3"); }
TEST(chat_templates, qwen3) { run_template_file("qwen3"); }
TEST(chat_templates, llama3_tools) { run_template_file("llama3"); }
TEST(chat_templates, deepseek) { run_template_file("deepseek"); }
TEST(chat_templates, features) { run_template_file("features"); }

TEST(chat_templates, snippets) {
    ojson doc = load_json("snippets.json");
    std::vector<std::pair<std::string, fathom::jinja::value>> vars;
    for (auto it = doc["vars"].begin(); it != doc["vars"].end(); ++it)
        vars.emplace_back(it.key(), fathom::jinja::value::from_json(it.value()));
    fathom::jinja::render_options opt;
    opt.now = parse_now(doc["now"].get<std::string>());
    for (const auto &c : doc["cases"]) {
        std::string src = c["template"].get<std::string>();
        SCOPED_TRACE("snippet " + ojson(src).dump());
        try {
            auto ast = fathom::jinja::jinja_parse(src, fathom::jinja::lexer_options{});
            std::string got = fathom::jinja::jinja_render(ast, vars, opt);
            if (c.contains("expected")) {
                std::string want = c["expected"].get<std::string>();
                EXPECT_TRUE(got == want) << first_diff(want, got);
            } else {
                ADD_FAILURE() << "expected error " << c["error"] << ", got " << ojson(got).dump();
            }
        } catch (const fathom::error &e) {
            if (c.contains("expected")) ADD_FAILURE() << "unexpected error: " << e.what();
        }
    }
}

}  // namespace
