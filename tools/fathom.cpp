// The `fathom` command-line tool: parses the command line with CLI11 and dispatches to one of the
// subcommands in tools/cli/ (one file each). This file owns only error reporting and exit codes:
//   0  success (or --help)
//   1  a fathom::error or other runtime failure: "error: <msg>" on stderr, one line
//   2  a command-line usage error (unknown option, bad value): "error: <msg>" on stderr, one line
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <new>

#include "cli/commands.h"
#include "fathom/error.h"

int main(int argc, char **argv) {
    CLI::App app{"fathom — LLM inference engine (CPU reference backend)", "fathom"};
    try {
        // Building the command tree can throw too (CLI::ConstructionError for a bad option name).
        app.require_subcommand(1);
        app.set_version_flag("--version", "fathom 0.1.0");
        app.set_help_all_flag("--help-all", "Print the help of every subcommand and exit");
        fathom::cli::add_run_command(app);
        fathom::cli::add_chat_command(app);
        fathom::cli::add_tokenize_command(app);
        fathom::cli::add_detokenize_command(app);
        fathom::cli::add_logits_command(app);
        fathom::cli::add_bench_command(app);
        fathom::cli::add_serve_command(app);
        fathom::cli::add_daemon_command(app);
        fathom::cli::add_eval_command(app);
        fathom::cli::add_plan_command(app);
        fathom::cli::add_rank_command(app);
        app.parse(argc, argv);  // the selected subcommand's callback runs inside parse()
    } catch (const CLI::Success &e) {
        return app.exit(e);  // --help / --version
    } catch (const CLI::ParseError &e) {
        std::fprintf(stderr, "error: %s (see fathom --help)\n", e.what());
        return 2;
    } catch (const fathom::error &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    } catch (const std::bad_alloc &) {
        std::fprintf(stderr, "error: out of memory\n");
        return 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
