// `fathom daemon`: the stdin/stdout line protocol (src/server/daemon.h, docs/daemon-protocol.md).
#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "cli/common.h"
#include "server/daemon.h"

namespace fathom::cli {

void add_daemon_command(CLI::App &app) {
    struct daemon_args {
        model_args model;
        std::string root;
        std::string drafter;  // PFlash drafter for `compress ... default`
        std::string prompt_cache;  // disk prompt cache directory ("" = none)
        double prompt_cache_max_gib = 8;
        int64_t prompt_cache_min_tokens = 32;
        spec_args spec;
    };
    auto a = std::make_shared<daemon_args>();
    auto *cmd = app.add_subcommand("daemon", "Drive the engine with newline-delimited commands on stdin "
                                             "(see docs/daemon-protocol.md)");
    add_model_options(cmd, a->model, /*model_required=*/false);
    set_group(cmd, "Daemon");
    cmd->add_option("--root", a->root, "Directory that every file argument is confined to")->required();
    cmd->add_option("--drafter", a->drafter,
                    "PFlash drafter used by 'compress ... default' (path or short name; other drafters must lie in --root)");
    cmd->add_option(
        "--prompt-cache", a->prompt_cache,
        "Disk prompt cache directory: 'generate' loads the saved state sharing the longest prefix with "
        "its prompt and saves the working session after it (docs/prompt-cache.md; the CPU or one GPU)");
    cmd->add_option("--prompt-cache-max-gib", a->prompt_cache_max_gib,
                    "Cap on the prompt cache directory's size")
        ->capture_default_str()
        ->check(CLI::Range(1e-6, 1e6));
    cmd->add_option("--prompt-cache-min-tokens", a->prompt_cache_min_tokens,
                    "Shortest token sequence saved, and the least gain over the working session for a load")
        ->capture_default_str()
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
    add_spec_options(cmd, a->spec);
    cmd->callback([a]() {
        const std::string drafter = a->drafter.empty() ? "" : resolve_model_path(a->drafter, a->model.models_dir);
        cache::options pc;
        pc.dir = a->prompt_cache;
        pc.max_bytes = uint64_t(a->prompt_cache_max_gib * 1073741824.0);
        pc.min_tokens = a->prompt_cache_min_tokens;
        a->spec.ngram.validate();
        model_args ma = a->model;
        spec_args sa = a->spec;
        resolve_spec_mode(sa, ma);  // --spec auto
        if (sa.mode == "draft")
            throw error("--spec draft: the daemon drafts with n-grams or DeepSeek V4's own heads (--spec ngram|mtp|dspark|auto)");
        apply_spec(ma, sa);  // mtp|dspark: the drafter loads with the model (and again on unpark)
        server::daemon_spec ds;
        ds.mode = sa.mode == "none" ? "none" : (sa.mode == "mtp" || sa.mode == "dspark") ? "session" : "ngram";
        ds.ngram = sa.ngram;
        server::daemon d([ma] { return load_engine(ma); }, a->root, drafter, pc, ds);
        std::cout << "ok ready" << std::endl;
        d.run(std::cin, std::cout);
    });
}

}  // namespace fathom::cli
