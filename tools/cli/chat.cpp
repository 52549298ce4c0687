// `fathom chat`: a REPL over the model's chat template. The conversation is re-rendered each turn
// and handed to session::sync, which keeps the common prefix, so only the new turn is evaluated.
// Reads lines from stdin, so it also works piped (no prompt is printed then).
#include <cstdio>
#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"

namespace fathom::cli {

namespace {

struct chat_args {
    model_args model;
    sampling_params sampling;
    std::string system;
    int32_t n_predict = 1024;
    bool stats = false;
    spec_args spec;
};

void chat_main(const chat_args &a) {
    a.sampling.validate();
    a.spec.ngram.validate();
    model_args ma = a.model;
    spec_args spec = a.spec;
    apply_spec(ma, spec);  // --spec auto resolved; --spec mtp|dspark: the drafter loads with the model
    auto eng = load_engine(ma);
    prepare_spec(spec, a.model, *eng);
    auto sess = eng->new_session();
    sampler smp(a.sampling);
    const bool interactive = stdin_is_tty();

    std::vector<chat_message> history;
    auto reset = [&]() {
        history.clear();
        if (!a.system.empty()) history.push_back({"system", a.system});
    };
    reset();
    if (interactive) std::fprintf(stderr, "fathom chat: /reset clears the conversation, /quit exits\n");

    std::string line;
    for (;;) {
        if (interactive) {
            std::fputs("> ", stdout);
            std::fflush(stdout);
        }
        if (!std::getline(std::cin, line)) break;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty()) continue;
        if (line == "/quit" || line == "/exit") break;
        if (line == "/reset") {
            reset();
            sess->reset();
            smp.reset();
            if (interactive) std::fprintf(stderr, "(conversation cleared)\n");
            continue;
        }
        history.push_back({"user", line});
        const std::string text = eng->apply_chat_template(history, /*add_generation_prompt=*/true);
        const std::vector<int32_t> tokens = tokenize_prompt(*eng, text);
        std::string reply;
        generation_stats st;
        try {
            st = generate(*eng, *sess, smp, tokens, a.n_predict, a.model.progress || (stderr_is_tty() && tokens.size() > 512),
                          [&reply](std::string_view s) {
                              reply += s;
                              write_out(s);
                          },
                          nullptr, &spec);
        } catch (const error &e) {
            history.pop_back();  // keep the conversation as it was before the failed turn
            if (!interactive) throw;
            std::fprintf(stderr, "error: %s\n", e.what());
            continue;
        }
        write_out("\n");
        history.push_back({"assistant", reply});
        if (st.hit_ctx) std::fprintf(stderr, "note: the context is full; /reset to start over\n");
        if (a.stats) std::fprintf(stderr, "%s\n", format_stats(st).c_str());
    }
}

}  // namespace

void add_chat_command(CLI::App &app) {
    auto a = std::make_shared<chat_args>();
    auto *cmd = app.add_subcommand("chat",
                                   "Interactive chat using the model's chat template; reads one user turn per "
                                   "line on stdin (/reset clears the conversation, /quit exits)");
    add_model_options(cmd, a->model, /*model_required=*/false);
    set_group(cmd, "Chat");
    cmd->add_option("--system", a->system, "System message that starts the conversation");
    cmd->add_option("-n,--n-predict", a->n_predict, "Maximum tokens per reply (0 = until end of generation)")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_flag("--stats", a->stats, "Print prefill/decode speed after each reply (stderr)");
    add_sampling_options(cmd, a->sampling);
    add_spec_options(cmd, a->spec);
    cmd->callback([a]() { chat_main(*a); });
}

}  // namespace fathom::cli
