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
    };
    auto a = std::make_shared<daemon_args>();
    auto *cmd = app.add_subcommand("daemon", "Drive the engine with newline-delimited commands on stdin "
                                             "(see docs/daemon-protocol.md)");
    add_model_options(cmd, a->model, /*model_required=*/false);
    cmd->add_option("--root", a->root, "Directory that every file argument is confined to")->required();
    cmd->add_option("--drafter", a->drafter,
                    "PFlash drafter used by 'compress ... default' (path or short name; other drafters must lie in --root)");
    cmd->callback([a]() {
        const std::string drafter = a->drafter.empty() ? "" : resolve_model_path(a->drafter, a->model.models_dir);
        server::daemon d([a] { return load_engine(a->model); }, a->root, drafter);
        std::cout << "ok ready" << std::endl;
        d.run(std::cin, std::cout);
    });
}

}  // namespace fathom::cli
