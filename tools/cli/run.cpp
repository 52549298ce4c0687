// `fathom run`: one prompt in, the completion streamed to stdout, timings on stderr.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"

namespace fathom::cli {

namespace {

struct run_args {
    model_args model;
    sampling_params sampling;
    std::string prompt;
    std::string prompt_file;
    std::string system;
    int32_t n_predict = 256;
    bool no_chat = false;
};

std::string read_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw error("cannot open prompt file: " + path);
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

void run_main(const run_args &a) {
    a.sampling.validate();  // before the (slow) load, so a bad --temp fails at once
    const std::string prompt = a.prompt_file.empty() ? a.prompt : read_file(a.prompt_file);
    auto eng = load_engine(a.model);

    std::string text = prompt;
    // The engine renders with the file's template, or a built-in one for files without it.
    if (!a.no_chat) {
        std::vector<chat_message> msgs;
        if (!a.system.empty()) msgs.push_back({"system", a.system});
        msgs.push_back({"user", prompt});
        text = eng->apply_chat_template(msgs, /*add_generation_prompt=*/true);
    }
    const std::vector<int32_t> tokens = tokenize_prompt(*eng, text);

    auto sess = eng->new_session();
    sampler smp(a.sampling);
    const bool progress = a.model.progress || (stderr_is_tty() && tokens.size() > 512);
    const generation_stats st =
        generate(*eng, *sess, smp, tokens, a.n_predict, progress, [](std::string_view s) { write_out(s); });
    write_out("\n");
    if (st.hit_ctx) std::fprintf(stderr, "note: stopped at the end of the context (%d tokens)\n", eng->info().n_ctx);
    std::fprintf(stderr, "%s\n", format_stats(st).c_str());
}

}  // namespace

void add_run_command(CLI::App &app) {
    auto a = std::make_shared<run_args>();
    auto *cmd = app.add_subcommand("run", "Generate a completion for one prompt, streamed to stdout");
    add_model_options(cmd, a->model, /*model_required=*/false);
    auto *p = cmd->add_option("-p,--prompt", a->prompt, "Prompt text");
    auto *f = cmd->add_option("-f,--file", a->prompt_file, "Read the prompt from a file");
    p->excludes(f);
    cmd->add_option("-n,--n-predict", a->n_predict,
                    "Maximum tokens to generate (0 = until end of generation or a full context)")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_option("--system", a->system, "System message (chat mode only)");
    cmd->add_flag("--no-chat", a->no_chat,
                  "Feed the prompt as raw text instead of wrapping it in the model's chat template");
    add_sampling_options(cmd, a->sampling);
    cmd->callback([a, p, f]() {
        if (p->count() == 0 && f->count() == 0) throw error("run: a prompt is required (-p TEXT or -f FILE)");
        run_main(*a);
    });
}

}  // namespace fathom::cli
