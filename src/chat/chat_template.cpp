// Chat template rendering API: builds the variables transformers passes to the template
// (messages, tools, documents, add_generation_prompt, bos/eos tokens, extra kwargs) and runs the
// Jinja interpreter. See chat_template.h.
#include "chat/chat_template.h"

#include "chat/jinja_ast.h"
#include "chat/jinja_interp.h"

namespace fathom {

chat_template::chat_template(const std::string &source)
    : source_(source), ast_(std::make_unique<jinja::template_ast>(jinja::jinja_parse(source, jinja::lexer_options{}))) {}

chat_template::~chat_template() = default;
chat_template::chat_template(chat_template &&) noexcept = default;
chat_template &chat_template::operator=(chat_template &&) noexcept = default;

std::string chat_template::render(const chat_template_inputs &in) const {
    if (!in.messages.is_array()) throw fathom::error("chat template: messages must be a JSON array");
    if (!in.tools.is_null() && !in.tools.is_array()) throw fathom::error("chat template: tools must be a JSON array or null");
    if (!in.extra.is_object()) throw fathom::error("chat template: extra variables must be a JSON object");
    std::vector<std::pair<std::string, jinja::value>> vars;
    // transformers: render(messages=..., tools=..., documents=..., add_generation_prompt=...,
    // **special_tokens_map, **kwargs). tools/documents are None when absent, so `is defined` holds.
    vars.emplace_back("messages", jinja::value::from_json(in.messages));
    vars.emplace_back("tools", jinja::value::from_json(in.tools));
    vars.emplace_back("documents", jinja::value::none());
    vars.emplace_back("add_generation_prompt", jinja::value::boolean(in.add_generation_prompt));
    vars.emplace_back("bos_token", jinja::value::string(in.bos_token));
    vars.emplace_back("eos_token", jinja::value::string(in.eos_token));
    for (auto it = in.extra.begin(); it != in.extra.end(); ++it) {
        jinja::value v = jinja::value::from_json(it.value());
        bool replaced = false;
        for (auto &[k, old] : vars)
            if (k == it.key()) {
                old = v;
                replaced = true;
            }
        if (!replaced) vars.emplace_back(it.key(), v);
    }
    jinja::render_options opt;
    opt.now = in.now;
    opt.max_steps = in.max_steps;
    return jinja::jinja_render(*ast_, vars, opt);
}

void set_thinking_vars(chat_template_inputs &in, chat_thinking t) {
    if (t == chat_thinking::template_default) return;
    const bool on = t != chat_thinking::off;
    in.extra["enable_thinking"] = on;
    in.extra["thinking"] = on;
}

std::string chat_template_render(const std::string &source, const chat_template_inputs &in) {
    return chat_template(source).render(in);
}

}  // namespace fathom
