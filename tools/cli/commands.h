// The subcommands of the `fathom` binary, one file each in tools/cli/. Each add_*_command adds
// its CLI11 subcommand (options documented for --help) and the callback that runs it; callbacks
// throw fathom::error on failure, which tools/fathom.cpp turns into "error: <msg>", exit 1.
#pragma once
#include <CLI/CLI.hpp>

namespace fathom::cli {

void add_run_command(CLI::App &app);       // run.cpp: one prompt, streamed completion
void add_chat_command(CLI::App &app);      // chat.cpp: REPL with the model's chat template
void add_tokenize_command(CLI::App &app);  // tokenize.cpp: stdin text -> token ids (tokenizer only)
void add_detokenize_command(CLI::App &app);  // tokenize.cpp: stdin token ids -> text (tokenizer only)
void add_logits_command(CLI::App &app);    // logits.cpp: token ids -> float32 logits file
void add_bench_command(CLI::App &app);     // bench.cpp: prefill / decode throughput
void add_serve_command(CLI::App &app);     // serve.cpp: HTTP API server (server engineer)
void add_daemon_command(CLI::App &app);    // daemon.cpp: stdin/stdout line protocol (server engineer)
void add_eval_command(CLI::App &app);      // eval.cpp: quality evaluations (`eval niah`, PFlash)
void add_plan_command(CLI::App &app);      // plan.cpp: multi-device placement of a DS4 model (src/dist)
void add_rank_command(CLI::App &app);      // rank.cpp: one rank process of --procs (hidden)

}  // namespace fathom::cli
