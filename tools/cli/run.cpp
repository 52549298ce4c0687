// `fathom run`: one prompt in, the completion streamed to stdout, timings on stderr.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"
#include "fathom/pflash.h"

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
    // PFlash prompt compression (docs/pflash.md).
    bool pflash = false;
    double keep_ratio = 0.2;
    std::string drafter = "smollm2";
    std::string drafter_residency = "auto";
    std::string drafter_device = "cpu";
    bool pflash_verbatim_user = false;
    int32_t drafter_window = 512;
    spec_args spec;
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
    a.spec.ngram.validate();
    pflash::validate_keep_ratio(a.keep_ratio, "--keep-ratio");
    const pflash::drafter_residency residency = pflash::parse_residency(a.drafter_residency);
    const std::string prompt = a.prompt_file.empty() ? a.prompt : read_file(a.prompt_file);
    model_args ma = a.model;
    spec_args spec = a.spec;
    apply_spec(ma, spec);  // --spec auto resolved; --spec mtp|dspark: the drafter loads with the model
    auto eng = load_engine(ma);

    std::string text = prompt;
    // The engine renders with the file's template, or a built-in one for files without it.
    if (!a.no_chat) {
        std::vector<chat_message> msgs;
        if (!a.system.empty()) msgs.push_back({"system", a.system});
        msgs.push_back({"user", prompt});
        text = eng->apply_chat_template(msgs, /*add_generation_prompt=*/true);
    }
    std::vector<int32_t> tokens = tokenize_prompt(*eng, text);
    if (a.pflash) {
        pflash::options po;
        po.drafter_path = resolve_model_path(a.drafter, a.model.models_dir);
        po.keep_ratio = a.keep_ratio;
        po.residency = residency;
        po.drafter_window = a.drafter_window;
        po.drafter_device = a.drafter_device;
        po.n_threads = a.model.threads;
        // `run` has one user message: by default it is the text to compress (its question sits in the
        // always-kept tail chunks); --pflash-verbatim-user keeps it whole instead.
        po.verbatim_last_user = a.pflash_verbatim_user;
        pflash::result r;
        activity_line line("pflash: compressing " + std::to_string(tokens.size()) + " tokens",
                           a.model.progress || (stderr_is_tty() && tokens.size() > 512));
        line.run([&] { r = pflash::compressor::create(po)->compress(*eng, tokens); });
        std::fprintf(stderr, "pflash: prompt %lld -> %lld tokens (keep %.3f, %lld/%lld chunks) in %.3f s\n",
                     static_cast<long long>(r.n_original), static_cast<long long>(r.n_effective), a.keep_ratio,
                     static_cast<long long>(r.n_kept_chunks), static_cast<long long>(r.n_chunks), r.total_s);
        std::fprintf(stderr, "pflash: drafter %lld tokens: load %.3f s, prefill %.3f s, queries %.3f s, scoring %.3f s\n",
                     static_cast<long long>(r.n_drafter_tokens), r.load_s, r.drafter_prefill_s, r.drafter_query_s,
                     r.drafter_attend_s);
        tokens = r.tokens;
    }

    prepare_spec(spec, a.model, *eng);
    auto sess = eng->new_session();
    sampler smp(a.sampling);
    const bool progress = a.model.progress || (stderr_is_tty() && tokens.size() > 512);
    const generation_stats st =
        generate(*eng, *sess, smp, tokens, a.n_predict, progress, [](std::string_view s) { write_out(s); }, nullptr,
                 &spec);
    write_out("\n");
    if (st.hit_ctx) std::fprintf(stderr, "note: stopped at the end of the context (%d tokens)\n", eng->info().n_ctx);
    std::fprintf(stderr, "%s\n", format_stats(st).c_str());
}

}  // namespace

void add_run_command(CLI::App &app) {
    auto a = std::make_shared<run_args>();
    auto *cmd = app.add_subcommand("run", "Generate a completion for one prompt, streamed to stdout");
    add_model_options(cmd, a->model, /*model_required=*/false);
    set_group(cmd, "Prompt");
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
    add_spec_options(cmd, a->spec);
    set_group(cmd, "PFlash");
    cmd->add_flag("--pflash", a->pflash, "Compress the prompt with PFlash before prefill (docs/pflash.md)");
    cmd->add_option("--keep-ratio", a->keep_ratio, "PFlash: fraction of prompt chunks kept, in [0, 1]")
        ->capture_default_str();
    cmd->add_option("--drafter", a->drafter, "PFlash: drafter model (path or short name)")->capture_default_str();
    cmd->add_option("--drafter-residency", a->drafter_residency,
                    "PFlash: keep | release-after-use | auto (drafter memory after use)")
        ->capture_default_str();
    cmd->add_option("--drafter-device", a->drafter_device, "PFlash: where the drafter runs: cpu | cuda | cuda:N")
        ->capture_default_str();
    cmd->add_option("--drafter-window", a->drafter_window,
                    "PFlash: sliding attention window of the drafter's prefill (0 = full attention)")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_flag("--pflash-verbatim-user", a->pflash_verbatim_user,
                  "PFlash: never compress the (last) user message, only what surrounds it");
    add_sampling_options(cmd, a->sampling);
    cmd->callback([a, p, f]() {
        if (p->count() == 0 && f->count() == 0) throw error("run: a prompt is required (-p TEXT or -f FILE)");
        run_main(*a);
    });
}

}  // namespace fathom::cli
