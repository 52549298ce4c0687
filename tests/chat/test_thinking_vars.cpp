// The engine's thinking mode as template variables (set_thinking_vars): on the Qwen3 template, off
// writes the empty thinking block into the generation prompt and on / template_default leave the
// block to the model (the template's own default is thinking); a template that knows no such
// variable renders the same in every mode. Expected strings follow from the template text.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "chat/chat_template.h"

namespace fathom {
namespace {

std::string read_template(const std::string &name) {
    std::ifstream f(std::string(FATHOM_SOURCE_DIR) + "/tests/chat/templates/" + name);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

std::string render(const std::string &src, chat_thinking t) {
    chat_template_inputs in;
    in.messages = nlohmann::ordered_json::parse(R"([{"role":"user","content":"Hi"}])");
    in.add_generation_prompt = true;
    set_thinking_vars(in, t);
    return chat_template(src).render(in);
}

}  // namespace

TEST(chat_thinking_vars, qwen3_enable_thinking) {
    const std::string src = read_template("qwen3.jinja");
    ASSERT_FALSE(src.empty());
    const std::string head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    EXPECT_EQ(render(src, chat_thinking::template_default), head);
    EXPECT_EQ(render(src, chat_thinking::on), head);
    EXPECT_EQ(render(src, chat_thinking::max), head);
    EXPECT_EQ(render(src, chat_thinking::off), head + "<think>\n\n</think>\n\n");
}

TEST(chat_thinking_vars, other_templates_ignore_it) {
    const std::string src = read_template("smollm2.jinja");
    ASSERT_FALSE(src.empty());
    const std::string base = render(src, chat_thinking::template_default);
    EXPECT_EQ(render(src, chat_thinking::on), base);
    EXPECT_EQ(render(src, chat_thinking::off), base);
    chat_template_inputs in;
    set_thinking_vars(in, chat_thinking::off);
    EXPECT_EQ(in.extra, nlohmann::ordered_json({{"enable_thinking", false}, {"thinking", false}}));
}

}  // namespace fathom
