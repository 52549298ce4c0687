// Shared pieces of the `fathom` subcommands: model/engine options and loading, model-name
// resolution, sampling options, the stderr progress bar, and the generate loop used by `run` and
// `chat`. Subcommands see only the public API (fathom/engine.h, fathom/sampling.h); common.cpp
// also uses the tokenizer's utf8_stream so streamed text never splits a character.
#pragma once
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fathom/engine.h"
#include "fathom/speculative.h"
#include "fathom/sampling.h"

namespace fathom::cli {

// ---------------------------------------------------------------------------------------------
// Option groups
// ---------------------------------------------------------------------------------------------

// Each subcommand shows only the options it uses, under headings (CLI11 help groups). The add_*_options
// helpers below put their options in their own group; a command's own options go in the group it names
// with set_group. Group names:
inline constexpr const char *group_model = "Model";      // -m, --models-dir
inline constexpr const char *group_engine = "Engine";    // threads, context, batch, KV, numerics, QAT
inline constexpr const char *group_devices = "Devices";  // --device, --devices and the multi-device layout
inline constexpr const char *group_sampling = "Sampling";
inline constexpr const char *group_spec = "Speculative decoding";

// Options added to `cmd` from now on go under the --help heading `name`.
inline void set_group(CLI::App *cmd, const std::string &name) { cmd->option_defaults()->group(name); }

// Sets the group for the options added while it lives, then restores the previous one (used inside the
// add_*_options helpers so that the caller's group carries on after them).
class scoped_group {
public:
    scoped_group(CLI::App *cmd, const std::string &name) : cmd_(cmd), prev_(cmd->option_defaults()->get_group()) {
        set_group(cmd, name);
    }
    ~scoped_group() { set_group(cmd_, prev_); }
    scoped_group(const scoped_group &) = delete;
    scoped_group &operator=(const scoped_group &) = delete;

private:
    CLI::App *cmd_;
    std::string prev_;
};

// ---------------------------------------------------------------------------------------------
// Engine options
// ---------------------------------------------------------------------------------------------

struct model_args {
    std::string model = "smollm2";  // path, or short name resolved in models_dir
    std::string models_dir;         // "" = <exe_dir>/../models, <exe_dir>/../../models, ./models
    int threads = 0;                // 0 = all online cores
    int ctx = 0;                    // 0 = engine default
    int batch = 0;                  // prefill chunk, 0 = engine default (engine_options::n_batch)
    std::string kv_type = "f16";
    bool exact = false;
    std::string numerics = "invariant";  // invariant | llamacpp | exact (--exact = exact)
    std::string qat = "full";       // DeepSeek V4 QAT round trips: full | fp4only | off
    int64_t ds4_checkpoint_mib = 4096;  // DeepSeek V4 on one CPU: prefix checkpoint budget (engine_options)
    bool progress = false;          // force progress bars even when stderr is not a TTY
    std::string device = "cpu";     // cpu | cuda | cuda:N | auto (engine_options::device)
    bool no_cuda_graph = false;     // engine_options::cuda_graphs = false
    std::string devices;            // "" or "cpu,cpu" / "cuda:0,cuda:1" (dist_options::devices; DS4 only)
    std::string layout = "pipeline";  // with --devices: pipeline | tp (dist_options::devices_layout)
    int64_t micro_batch = 0;           // with --devices: dist_options::micro_batch (0 = off)
    bool procs = false;                // with --devices: ranks 1.. as processes (dist_options::rank_procs)
    std::string procs_host = "127.0.0.1";  // dist_options::rank_procs_host
    int procs_local = 0;                   // dist_options::rank_procs_local (0 = spawn every rank)
    // Not options of their own: --spec mtp|dspark and --draft-model (apply_spec) set them.
    std::string ds4_draft, ds4_draft_model;  // engine_options::ds4_draft / ds4_draft_model
};

// Group "Model": -m/--model and --models-dir (what a tokenizer-only command needs).
// `model_required`: -m must be given (no default model).
void add_model_file_options(CLI::App *cmd, std::string &model, std::string &models_dir, bool model_required);

// add_model_file_options, then group "Engine": -t/--threads, --ctx, -b/--batch, --kv-type, --exact, --numerics,
// --qat, --progress; and group "Devices": --device, --no-cuda-graph, --devices (excludes --device), --layout,
// --micro-batch, --procs, --procs-host, --procs-local (need --devices).
void add_model_options(CLI::App *cmd, model_args &a, bool model_required);

// The models directory used when --models-dir is not given (first existing candidate).
std::string default_models_dir();

// `model` is an existing file -> that path. Otherwise a short name ("smollm2", "gemma3") matched
// against the .gguf files of the models directory. Throws fathom::error naming what was tried.
std::string resolve_model_path(const std::string &model, const std::string &models_dir);

// Resolves the model, builds engine_options and loads, with a progress bar when enabled. With
// --device auto on a machine (or build) without CUDA, prints a one-line notice and uses the CPU.
// With --devices, prints the layout (each device's block range) on stderr.
// on_rank_failure: dist_options::on_rank_failure (with --procs: a rank process died).
std::unique_ptr<engine> load_engine(const model_args &a,
                                    std::function<void(const std::string &line)> on_rank_failure = {});

// The engine_options of `a` (model path resolved; no progress callback). With --procs, rank_command gives
// `<this executable> rank --rank R --world P --join ID --parent-pid <this pid> <a's options>` (the engine
// appends `--rank-layers` and `--ctx`).
engine_options engine_options_of(const model_args &a);

// Integer-range checks whose error reads "--opt: must be >= 0, got -3".
CLI::Validator at_least(long long min);

// ---------------------------------------------------------------------------------------------
// Sampling options
// ---------------------------------------------------------------------------------------------

// Adds --temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, --frequency-penalty,
// --presence-penalty, --seed. Values are checked later by sampling_params::validate().
void add_sampling_options(CLI::App *cmd, sampling_params &p);

// Speculative decoding (include/fathom/speculative.h): --spec none|ngram|draft|mtp|dspark|auto, --draft-max,
// --draft-row-cost, --ngram-min, --ngram-max, --draft-model. spec_args::enabled() when --spec is not none; with --spec draft,
// prepare_spec loads the draft model (after the target) and makes the drafter; --spec mtp|dspark are
// DeepSeek V4's own drafters, loaded with the target (apply_spec sets the engine options first) and run
// by its sessions (session::draft).
struct spec_args {
    std::string mode = "none";
    spec::ngram_options ngram;
    std::string draft_model;  // --spec draft: path or short name
    std::shared_ptr<engine> draft_engine;
    std::shared_ptr<spec::model_drafter> drafter;
    bool from_auto = false;  // mode was chosen by --spec auto (apply_spec)
    bool enabled() const { return mode != "none"; }
};
void add_spec_options(CLI::App *cmd, spec_args &a);
// Before loading the target: --spec auto becomes the best drafter the files offer (resolve_spec_mode),
// then --spec mtp|dspark become engine options (the drafter file resolved).
void apply_spec(model_args &m, spec_args &a);
// --spec auto: DeepSeek V4 with --draft-model: dspark when that file is a DSpark drafter, else mtp (an
// MTP file); DeepSeek V4 whose own file holds the MTP layer: mtp; another model with --draft-model: draft;
// otherwise ngram. Reads only the GGUF headers. Other modes are left as they are.
void resolve_spec_mode(spec_args &a, const model_args &m);
// After loading the target: --spec draft loads the draft model. A mode chosen by --spec auto on a model
// whose sessions cannot roll back becomes none (with a note), where an explicit --spec is an error later.
void prepare_spec(spec_args &a, const model_args &m, engine &target);

// ---------------------------------------------------------------------------------------------
// Terminal helpers
// ---------------------------------------------------------------------------------------------

bool stderr_is_tty();
bool stdin_is_tty();

// A one-line bar on stderr: "label [#####.....]  45% (done/total)". Inactive bars do nothing.
class progress_bar {
public:
    progress_bar(std::string label, bool active);
    ~progress_bar();
    void update(int64_t done, int64_t total);
    void finish();  // erase the line
private:
    std::string label_;
    bool active_;
    bool drawn_ = false;
    int last_permille_ = -1;
};

// A step whose progress is unknown (PFlash scoring a prompt): while run() executes `fn`, a helper thread
// redraws "label ... 3.2 s" on stderr every 200 ms; the line is erased when it returns. Inactive: just
// runs fn.
class activity_line {
public:
    activity_line(std::string label, bool active) : label_(std::move(label)), active_(active) {}
    void run(const std::function<void()> &fn);
private:
    std::string label_;
    bool active_;
};

// Writes and flushes stdout.
void write_out(std::string_view text);

using clock = std::chrono::steady_clock;
inline double seconds_since(clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
}

// ---------------------------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------------------------

struct generation_stats {
    int64_t n_prompt = 0;     // tokens of the prompt prefix
    int64_t n_prefilled = 0;  // of those, evaluated (the rest was reused by the session)
    double prefill_s = 0.0;
    int64_t n_generated = 0;  // sampled tokens, end-of-generation excluded
    double decode_s = 0.0;
    bool hit_eog = false;
    bool hit_ctx = false;
    bool speculative = false;  // decoded with n-gram drafts (the counts below)
    spec::spec_stats spec;
};

// Syncs the session to `prompt` (prefill), then samples up to max_tokens (0 = until EOG or the
// context is full), streaming text through on_text. Returns the generated token ids in `out`.
// Throws fathom::error if the prompt does not fit the context.
// With `spec` (enabled), the decode loop drafts with n-grams (spec::generate_ngram): the same tokens
// (CPU default numerics), fewer forwards.
generation_stats generate(engine &eng, session &sess, sampler &smp, const std::vector<int32_t> &prompt,
                          int32_t max_tokens, bool show_progress,
                          const std::function<void(std::string_view)> &on_text,
                          std::vector<int32_t> *out = nullptr, const spec_args *spec = nullptr);

// "prefill: 12 tokens (+30 reused) in 0.050 s (240.0 tok/s) | decode: 64 tokens in 1.200 s (53.3 tok/s)"
// ("(+N reused)" only when the session already held part of the prompt.)
std::string format_stats(const generation_stats &s);

// Tokenizes a rendered chat prompt (special tokens parsed, BOS per metadata, a doubled BOS from
// a template that writes it itself collapsed to one).
std::vector<int32_t> tokenize_prompt(const engine &eng, const std::string &text);

}  // namespace fathom::cli
