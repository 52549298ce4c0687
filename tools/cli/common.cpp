// Shared pieces of the `fathom` subcommands (see common.h): option groups, model resolution,
// engine loading with a progress bar, UTF-8 safe streaming and the generate loop.
#include "cli/common.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <system_error>
#include <thread>

#include "fathom/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"  // utf8_stream

namespace fs = std::filesystem;

namespace fathom::cli {

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

CLI::Validator at_least(long long min) {
    return CLI::Validator(
        [min](std::string &value) -> std::string {
            long long v = 0;
            const char *b = value.data(), *e = value.data() + value.size();
            const auto [ptr, ec] = std::from_chars(b, e, v);
            if (ec != std::errc() || ptr != e) return "expected an integer, got '" + value + "'";
            if (v < min) return "must be >= " + std::to_string(min) + ", got " + value;
            return "";
        },
        "INT>=" + std::to_string(min));
}

void add_model_file_options(CLI::App *cmd, std::string &model, std::string &models_dir, bool model_required) {
    const scoped_group g(cmd, group_model);
    auto *m = cmd->add_option("-m,--model", model,
                              "GGUF file path, or a short name (smollm2, gemma3) looked up in the models directory");
    if (model_required)
        m->required();
    else
        m->capture_default_str();
    cmd->add_option("--models-dir", models_dir,
                    "Directory searched for short model names (default: <exe_dir>/../models, "
                    "<exe_dir>/../../models, then ./models)");
}

namespace {

void add_engine_options(CLI::App *cmd, model_args &a) {
    const scoped_group g(cmd, group_engine);
    cmd->add_option("-t,--threads", a.threads, "CPU threads (0 = all online cores)")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_option("--ctx", a.ctx, "Context size in tokens (0 = min(training context, 8192))")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_option("-b,--batch", a.batch, "Prefill chunk in tokens (0 = default: 512; 4096 for DeepSeek V4 on CUDA)")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_option("--kv-type", a.kv_type, "KV cache precision: f16 or f32")
        ->capture_default_str()
        ->check(CLI::IsMember({"f16", "f32"}));
    cmd->add_flag("--exact", a.exact,
                  "Reference numerics: dequantised weights x f32 activations, f32 accumulation (slow); "
                  "same as --numerics exact");
    cmd->add_option("--numerics", a.numerics,
                    "invariant: a token's result never depends on its batch (prefill chunk, decode, cache "
                    "reuse, serving batch); llamacpp: llama.cpp CPU's order (differs for single tokens); "
                    "exact: f32 reference (slow)")
        ->capture_default_str()
        ->check(CLI::IsMember({"invariant", "llamacpp", "exact"}));
    cmd->add_option("--qat", a.qat,
                    "DeepSeek V4 only: simulated QAT round trips, full (trained), fp4only or off")
        ->capture_default_str()
        ->check(CLI::IsMember({"full", "fp4only", "off"}));
    cmd->add_option("--ds4-checkpoint-mib", a.ds4_checkpoint_mib,
                    "DeepSeek V4 on one CPU device: MiB of in-RAM prefix checkpoints of the sessions' states "
                    "(a regenerate or an edited turn resumes from the longest one instead of re-evaluating; "
                    "docs/ds4.md); 0 = off")
        ->capture_default_str();
    cmd->add_flag("--progress", a.progress, "Show progress bars on stderr even when it is not a terminal");
}

void add_device_options(CLI::App *cmd, model_args &a) {
    const scoped_group g(cmd, group_devices);
    auto *device = cmd->add_option("--device", a.device,
                    "Where the forward runs: cpu, cuda (= cuda:0), cuda:N, or auto (CUDA when a device is "
                    "present, else the CPU with a notice); a forced CUDA device that is missing is an error")
        ->capture_default_str()
        ->check([](const std::string &v) -> std::string {
            if (v == "cpu" || v == "auto" || v == "cuda") return "";
            if (v.size() > 5 && v.size() <= 8 && v.rfind("cuda:", 0) == 0 &&
                v.find_first_not_of("0123456789", 5) == std::string::npos)
                return "";
            return "expected cpu, cuda, cuda:N or auto, got '" + v + "'";
        });
    CLI::Option *devices = cmd->add_option("--devices", a.devices,
                    "DeepSeek V4: split the blocks over several devices of this process, e.g. cpu,cpu or "
                    "cuda:0,cuda:1 (one thread per device, each owning a contiguous block range; docs/dist.md)")
        ->excludes(device)
        ->check([](const std::string &v) -> std::string {
            // Syntax only; the engine checks the devices themselves (present, CUDA in this build).
            size_t pos = 0;
            for (;;) {
                const size_t comma = v.find(',', pos);
                const std::string d = v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
                const bool cuda_n = d.size() > 5 && d.size() <= 8 && d.rfind("cuda:", 0) == 0 &&
                                    d.find_first_not_of("0123456789", 5) == std::string::npos;
                if (d != "cpu" && d != "cuda" && !cuda_n)
                    return "expected a comma-separated list of cpu, cuda or cuda:N, got '" + v + "' (entry '" + d +
                           "')";
                if (comma == std::string::npos) return "";
                pos = comma + 1;
            }
        });
    cmd->add_option("--layout", a.layout,
                    "With --devices: pipeline (each device a contiguous block range) or tp (tensor + expert "
                    "parallel: every device runs every block on its share of heads and experts; CPU devices only "
                    "for now; docs/dist.md)")
        ->capture_default_str()
        ->needs(devices)
        ->check(CLI::IsMember({"pipeline", "tp"}));
    cmd->add_option("--micro-batch", a.micro_batch,
                    "With --devices and the pipeline layout: send prompt chunks longer than N tokens down the "
                    "pipeline as micro-batches of N, back to back, so the devices overlap (0 = off; same logits)")
        ->capture_default_str()
        ->check(at_least(0))
        ->needs(devices);
    CLI::Option *procs = cmd->add_flag("--procs", a.procs,
                  "With --devices: run ranks 1.. as child processes joined over TCP instead of threads (each "
                  "uploads its own CUDA blocks); a rank that dies ends the command with one line (docs/dist.md)")
        ->needs(devices);
    cmd->add_option("--procs-host", a.procs_host,
                    "With --procs: rank 0's listening address (loopback by default; for ranks on another host, "
                    "an address of this host they reach)")
        ->capture_default_str()
        ->needs(procs);
    cmd->add_option("--procs-local", a.procs_local,
                    "With --procs: spawn only ranks 1..N-1 here; the others are started by hand on another host "
                    "(the command is printed on stderr). 0 = spawn every rank")
        ->check(at_least(0))
        ->needs(procs);
    cmd->add_flag("--no-cuda-graph", a.no_cuda_graph,
                  "CUDA: launch every decode kernel eagerly instead of replaying a captured CUDA graph (for comparison)");
}

}  // namespace

void add_model_options(CLI::App *cmd, model_args &a, bool model_required) {
    add_model_file_options(cmd, a.model, a.models_dir, model_required);
    add_engine_options(cmd, a);
    add_device_options(cmd, a);
}

void add_sampling_options(CLI::App *cmd, sampling_params &p) {
    const scoped_group g(cmd, group_sampling);
    cmd->add_option("--temp", p.temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
    cmd->add_option("--top-k", p.top_k, "Keep the K most likely tokens (0 = off)")->capture_default_str();
    cmd->add_option("--top-p", p.top_p, "Nucleus sampling: smallest set with probability mass >= P (1 = off)")
        ->capture_default_str();
    cmd->add_option("--min-p", p.min_p, "Drop tokens less likely than P x the most likely one (0 = off)")
        ->capture_default_str();
    cmd->add_option("--repeat-penalty", p.repeat_penalty,
                    "Penalise tokens seen in the last --repeat-last-n tokens (1 = off)")
        ->capture_default_str();
    cmd->add_option("--repeat-last-n", p.repeat_last_n, "Penalty window in tokens (-1 = whole history, 0 = off)")
        ->capture_default_str();
    cmd->add_option("--frequency-penalty", p.frequency_penalty, "Subtract count x F from a seen token's logit")
        ->capture_default_str();
    cmd->add_option("--presence-penalty", p.presence_penalty, "Subtract P once from a seen token's logit")
        ->capture_default_str();
    cmd->add_option("--seed", p.seed, "Random seed (same seed, same output)")->capture_default_str();
}

// ---------------------------------------------------------------------------------------------
// Model resolution
// ---------------------------------------------------------------------------------------------

namespace {

fs::path executable_dir() {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    return ec ? fs::path() : exe.parent_path();
}

bool is_dir(const fs::path &p) {
    std::error_code ec;
    return fs::is_directory(p, ec);
}

bool is_file(const fs::path &p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec);
}

// Lower-case letters and digits only: "SmolLM2-135M" -> "smollm2135m", "gemma-3-270m" -> "gemma3270m".
std::string normalise_name(std::string_view s) {
    std::string out;
    for (char c : s)
        if (std::isalnum(static_cast<unsigned char>(c))) out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

}  // namespace

std::string default_models_dir() {
    std::vector<fs::path> candidates;
    const fs::path exe_dir = executable_dir();
    if (!exe_dir.empty()) {
        candidates.push_back(exe_dir / ".." / "models");        // <repo>/build/fathom
        candidates.push_back(exe_dir / ".." / ".." / "models");  // <repo>/build/<sub>/fathom
    }
    candidates.push_back(fs::path("models"));
    for (const auto &c : candidates)
        if (is_dir(c)) return fs::weakly_canonical(c).string();
    return "";
}

std::string resolve_model_path(const std::string &model, const std::string &models_dir_opt) {
    if (model.empty()) throw error("empty model name (-m)");
    if (is_file(model)) return model;
    const bool looks_like_path = model.find('/') != std::string::npos || model.ends_with(".gguf");
    if (looks_like_path) {
        std::error_code ec;
        if (fs::exists(model, ec)) throw error("model path is not a regular file: " + model);
        throw error("model file not found: " + model);
    }
    const std::string dir = models_dir_opt.empty() ? default_models_dir() : models_dir_opt;
    if (dir.empty())
        throw error("model '" + model + "' is not a file and no models directory was found "
                    "(looked in <exe_dir>/../models, <exe_dir>/../../models, ./models; use --models-dir)");
    if (!is_dir(dir)) throw error("models directory not found: " + dir);

    // Candidates: every .gguf up to two levels down whose file name, or whose parent directory's
    // name, starts with the short name once both are reduced to lower-case letters and digits.
    const std::string key = normalise_name(model);
    std::vector<fs::path> matches;
    std::error_code ec;
    fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
    for (; !ec && it != end; it.increment(ec)) {
        if (it.depth() > 1) it.disable_recursion_pending();
        const fs::path &p = it->path();
        if (p.extension() != ".gguf" || !is_file(p)) continue;
        const std::string file = normalise_name(p.stem().string());
        const std::string parent = it.depth() > 0 ? normalise_name(p.parent_path().filename().string()) : "";
        if (file.starts_with(key) || (!parent.empty() && parent.starts_with(key))) matches.push_back(p);
    }
    if (matches.empty())
        throw error("no model named '" + model + "' in " + dir + " (expected a .gguf file whose name starts with it)");
    std::sort(matches.begin(), matches.end());
    if (matches.size() > 1)
        std::fprintf(stderr, "note: '%s' matches %zu files in %s; using %s\n", model.c_str(), matches.size(),
                     dir.c_str(), matches.front().filename().c_str());
    return matches.front().string();
}

engine_options engine_options_of(const model_args &a) {
    engine_options o;
    o.model_path = resolve_model_path(a.model, a.models_dir);
    o.n_threads = a.threads;
    o.n_ctx = a.ctx;
    o.n_batch = a.batch;
    o.kv = a.kv_type == "f32" ? kv_precision::f32 : kv_precision::f16;
    o.exact = a.exact || a.numerics == "exact";
    o.batch_invariant = a.numerics != "llamacpp";
    o.ds4_qat = a.qat;
    o.ds4_draft = a.ds4_draft;
    o.ds4_draft_model = a.ds4_draft_model;
    o.ds4_checkpoint_mib = a.ds4_checkpoint_mib;
    o.device = a.device;
    o.cuda_graphs = !a.no_cuda_graph;
    o.dist.devices = a.devices;
    o.dist.devices_layout = a.layout;
    o.dist.micro_batch = a.micro_batch;
    o.dist.rank_procs = a.procs;
    o.dist.rank_procs_host = a.procs_host;
    o.dist.rank_procs_local = a.procs_local;
    if (a.procs) {
        std::error_code ec;
        const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
        const std::string self = ec ? std::string("/proc/self/exe") : exe.string();
        const std::string model = fs::absolute(o.model_path, ec).string();
        o.dist.rank_command = [a, self, model](int rank, int world, const std::string &id) {
            std::vector<std::string> v = {self, "rank", "--rank", std::to_string(rank), "--world",
                                          std::to_string(world), "--join", id, "-m", model,
                                          "--numerics", a.exact ? "exact" : a.numerics, "--qat", a.qat,
                                          "--kv-type", a.kv_type, "--devices", a.devices, "--layout", a.layout};
            // A spawned child dies with this process; a rank started by hand (another host) has another parent.
            if (a.procs_local == 0 || rank < a.procs_local)
                v.insert(v.end(), {"--parent-pid", std::to_string(static_cast<long>(::getpid()))});
            if (a.threads > 0) v.insert(v.end(), {"-t", std::to_string(a.threads)});
            if (a.no_cuda_graph) v.push_back("--no-cuda-graph");
            // The engine appends --rank-layers (its block ranges) and --ctx (its context) itself.
            return v;
        };
    }
    return o;
}

std::unique_ptr<engine> load_engine(const model_args &a, std::function<void(const std::string &line)> on_rank_failure) {
    engine_options o = engine_options_of(a);
    o.dist.on_rank_failure = std::move(on_rank_failure);
    progress_bar bar("loading", a.progress || stderr_is_tty());
    o.on_load_progress = [&bar](uint64_t done, uint64_t total) {
        bar.update(static_cast<int64_t>(done), static_cast<int64_t>(total));
    };
    auto eng = engine::load(o);
    bar.finish();
    if (a.device == "auto" && eng->info().device == "cpu")
        std::fprintf(stderr, "note: --device auto: no CUDA device present (or no CUDA backend in this build); running on the CPU\n");
    if (!a.devices.empty()) std::fprintf(stderr, "devices: %s\n", eng->info().device.c_str());
    return eng;
}

// ---------------------------------------------------------------------------------------------
// Terminal helpers
// ---------------------------------------------------------------------------------------------

bool stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }
bool stdin_is_tty() { return ::isatty(STDIN_FILENO) == 1; }

progress_bar::progress_bar(std::string label, bool active) : label_(std::move(label)), active_(active) {}

progress_bar::~progress_bar() { finish(); }

void progress_bar::update(int64_t done, int64_t total) {
    if (!active_ || total <= 0) return;
    done = std::clamp<int64_t>(done, 0, total);
    const int permille = static_cast<int>(done * 1000 / total);
    if (permille == last_permille_) return;  // redraw only when the bar visibly moves
    last_permille_ = permille;
    constexpr int width = 30;
    const int filled = permille * width / 1000;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(width - filled), '.');
    std::fprintf(stderr, "\r%s [%s] %3d%% (%lld/%lld)", label_.c_str(), bar.c_str(), permille / 10,
                 static_cast<long long>(done), static_cast<long long>(total));
    std::fflush(stderr);
    drawn_ = true;
}

void progress_bar::finish() {
    if (!drawn_) return;
    std::fputs("\r\033[K", stderr);  // back to column 0 and clear the line
    std::fflush(stderr);
    drawn_ = false;
    last_permille_ = -1;
}

void activity_line::run(const std::function<void()> &fn) {
    if (!active_) return fn();
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    const auto t0 = clock::now();
    std::thread painter([&] {
        std::unique_lock<std::mutex> lk(mu);
        while (!cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return done; })) {
            std::fprintf(stderr, "\r%s ... %.1f s", label_.c_str(), seconds_since(t0));
            std::fflush(stderr);
        }
        std::fputs("\r\033[K", stderr);  // erase the line
        std::fflush(stderr);
    });
    auto stop = [&] {
        {
            std::lock_guard<std::mutex> lk(mu);
            done = true;
        }
        cv.notify_one();
        painter.join();
    };
    try {
        fn();
    } catch (...) {
        stop();
        throw;
    }
    stop();
}

void write_out(std::string_view text) {
    if (text.empty()) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------------------------

std::vector<int32_t> tokenize_prompt(const engine &eng, const std::string &text) {
    std::vector<int32_t> toks = eng.tokenize(text, /*add_special=*/true, /*parse_special=*/true);
    const int32_t bos = eng.bos_token();
    if (bos >= 0 && toks.size() >= 2 && toks[0] == bos && toks[1] == bos) toks.erase(toks.begin());
    return toks;
}

generation_stats generate(engine &eng, session &sess, sampler &smp, const std::vector<int32_t> &prompt,
                          int32_t max_tokens, bool show_progress,
                          const std::function<void(std::string_view)> &on_text, std::vector<int32_t> *out,
                          const spec_args *spec) {
    const int64_t n_ctx = eng.info().n_ctx;
    generation_stats st;
    st.n_prompt = static_cast<int64_t>(prompt.size());
    if (prompt.empty()) throw error("empty prompt");
    if (st.n_prompt >= n_ctx)
        throw error("prompt is " + std::to_string(st.n_prompt) + " tokens but the context holds " +
                    std::to_string(n_ctx) + " (leave room to generate, or raise --ctx)");

    if (spec && spec->enabled() && !sess.rolls_back())  // before the prefill, not after it
        throw error("--spec: this model's sessions cannot drop rejected positions (DeepSeek V4 rolls back on one "
                    "device, the CPU or one GPU, not across --devices); run without --spec");
    // Prefill: the session reuses what it already holds of the prompt (chat turns).
    const auto &held = sess.tokens();
    size_t common = 0;
    while (common < held.size() && common < prompt.size() && held[common] == prompt[common]) ++common;
    st.n_prefilled = st.n_prompt - static_cast<int64_t>(common);
    {
        progress_bar bar("prefill", show_progress);
        const auto t0 = clock::now();
        sess.sync(prompt, [&bar](int64_t done, int64_t total) { bar.update(done, total); });
        st.prefill_s = seconds_since(t0);
    }

    fathom::utf8_stream text;  // holds back a partial UTF-8 character between tokens
    const auto t1 = clock::now();
    if (spec && spec->enabled()) {
        // The loop below, with drafts: the callback is its body between the sample and the eval.
        st.speculative = true;
        const auto on_token = [&](int32_t tok) {
            if (eng.is_end_of_generation(tok)) {
                st.hit_eog = true;
                return spec::token_verdict::stop;
            }
            ++st.n_generated;
            if (out) out->push_back(tok);
            on_text(text.push(eng.token_to_piece(tok)));
            return max_tokens > 0 && st.n_generated >= max_tokens ? spec::token_verdict::keep_and_stop
                                                                  : spec::token_verdict::keep;
        };
        if (spec->mode == "mtp" || spec->mode == "dspark") {
            st.spec = spec::generate(sess, smp, n_ctx, spec->ngram,
                                     [&sess](std::span<const int32_t> h, int32_t max) { return sess.draft(h, max); },
                                     on_token);
        } else if (spec->mode == "draft") {
            if (!spec->drafter) throw error("--spec draft: no draft model prepared");
            spec::model_drafter &d = *spec->drafter;
            st.spec = spec::generate(sess, smp, n_ctx, spec->ngram,
                                     [&d](std::span<const int32_t> h, int32_t max) { return d(h, max); }, on_token);
        } else {
            st.spec = spec::generate_ngram(sess, smp, n_ctx, spec->ngram, on_token);
        }
        st.hit_ctx = st.spec.hit_ctx;
        on_text(text.flush());
        st.decode_s = seconds_since(t1);
        return st;
    }
    for (;;) {
        const sample_result r = sess.sample(smp, sess.tokens());
        if (eng.is_end_of_generation(r.token)) {
            st.hit_eog = true;
            break;
        }
        ++st.n_generated;
        if (out) out->push_back(r.token);
        on_text(text.push(eng.token_to_piece(r.token)));
        if (max_tokens > 0 && st.n_generated >= max_tokens) break;
        if (sess.n_past() >= n_ctx) {
            st.hit_ctx = true;
            break;
        }
        sess.eval(std::span<const int32_t>(&r.token, 1));
    }
    on_text(text.flush());
    st.decode_s = seconds_since(t1);
    return st;
}

void add_spec_options(CLI::App *cmd, spec_args &a) {
    const scoped_group g(cmd, group_spec);
    cmd->add_option("--spec", a.mode,
                    "Speculative decoding: none; ngram (drafts from n-grams already in the prompt and output); draft "
                    "(a smaller model with the same tokenizer drafts, --draft-model); mtp (DeepSeek V4's MTP head, "
                    "from the model file or --draft-model); dspark (a DeepSeek V4 DSpark drafter, --draft-model); "
                    "auto (the best the files offer: dspark / mtp for DeepSeek V4, draft with --draft-model, else "
                    "ngram). Same tokens, fewer forwards")
        ->check(CLI::IsMember({"none", "ngram", "draft", "mtp", "dspark", "auto"}))
        ->capture_default_str();
    cmd->add_option("--draft-model", a.draft_model,
                    "--spec draft: the drafting model (path or short name); --spec mtp: the MTP head's GGUF (default: "
                    "the model file); --spec dspark: the DSpark drafter's GGUF");
    cmd->add_option("--draft-max", a.ngram.draft_max, "--spec: most tokens drafted per step")
        ->check(CLI::Range(1, 64))
        ->capture_default_str();
    cmd->add_option("--draft-row-cost", a.ngram.row_cost,
                    "--spec: the verification cost of each drafted row relative to a one-row step, for the adaptive "
                    "width (which maximises expected tokens per second); < 0 measures it as it runs, >= 0 fixes it "
                    "(reproducible widths)")
        ->check(CLI::Range(-1.0, 64.0))
        ->capture_default_str();
    cmd->add_option("--ngram-min", a.ngram.ngram_min, "--spec ngram: shortest n-gram looked up")
        ->check(CLI::Range(1, 16))
        ->capture_default_str();
    cmd->add_option("--ngram-max", a.ngram.ngram_max, "--spec ngram: longest n-gram looked up")
        ->check(CLI::Range(1, 16))
        ->capture_default_str();
}

void resolve_spec_mode(spec_args &a, const model_args &m) {
    if (a.mode != "auto") return;
    a.from_auto = true;
    const std::string path = resolve_model_path(m.model, m.models_dir);
    const auto f = gguf::file::open(path);
    const std::string arch(f->get_string("general.architecture", ""));
    // DeepSeek V4's own drafters (the MTP head, DSpark) run on one device, the CPU or one GPU; elsewhere
    // n-grams (prepare_spec turns speculation off when the sessions cannot roll back at all: several
    // devices).
    if (arch == "deepseek4" && !m.devices.empty()) {
        a.mode = "ngram";
        return;
    }
    if (!a.draft_model.empty()) {
        if (arch != "deepseek4") {
            a.mode = "draft";
            return;
        }
        const auto d = gguf::file::open(resolve_model_path(a.draft_model, m.models_dir));
        const bool dspark = d->get_string("general.architecture", "") == "deepseek4-dflash-draft";
        a.mode = dspark ? "dspark" : "mtp";
        return;
    }
    a.mode = arch == "deepseek4" && f->get_int("deepseek4.nextn_predict_layers", 0) > 0 ? "mtp" : "ngram";
}

void apply_spec(model_args &m, spec_args &a) {
    resolve_spec_mode(a, m);
    if (a.mode != "mtp" && a.mode != "dspark") return;
    if (a.mode == "dspark" && a.draft_model.empty()) throw error("--spec dspark needs --draft-model (a DSpark drafter GGUF)");
    m.ds4_draft = a.mode;
    m.ds4_draft_model = a.draft_model.empty() ? "" : resolve_model_path(a.draft_model, m.models_dir);
}

void prepare_spec(spec_args &a, const model_args &m, engine &target) {
    if (a.from_auto && a.enabled() && !target.new_session()->rolls_back()) {
        std::fprintf(stderr, "note: --spec auto: this model's sessions cannot drop rejected positions here (DeepSeek V4 "
                             "rolls back on one device only, not across --devices); decoding without speculation\n");
        a.mode = "none";
        return;
    }
    if (a.mode == "mtp" || a.mode == "dspark") {  // loaded with the target (apply_spec)
        if (target.info().arch != "deepseek4")
            throw error("--spec " + a.mode + " is for DeepSeek V4 models; this one is " + target.info().arch);
        return;
    }
    if (a.mode != "draft") {
        if (!a.draft_model.empty()) throw error("--draft-model needs --spec draft, mtp or dspark");
        return;
    }
    if (a.draft_model.empty()) throw error("--spec draft needs --draft-model");
    model_args dm = m;
    dm.model = a.draft_model;
    dm.devices.clear();
    dm.procs = false;
    engine_options o = engine_options_of(dm);
    o.n_ctx = target.info().n_ctx;  // the drafts follow the target's whole history
    a.draft_engine = engine::load(o);
    a.drafter = std::make_shared<spec::model_drafter>(*a.draft_engine, target);
}

std::string format_stats(const generation_stats &s) {
    auto rate = [](int64_t n, double sec) { return sec > 0.0 ? static_cast<double>(n) / sec : 0.0; };
    char reused[64] = "";
    if (s.n_prompt > s.n_prefilled)
        std::snprintf(reused, sizeof reused, " (+%lld reused)", static_cast<long long>(s.n_prompt - s.n_prefilled));
    char buf[384];
    std::snprintf(buf, sizeof buf,
                  "prefill: %lld tokens%s in %.3f s (%.1f tok/s) | decode: %lld tokens in %.3f s (%.1f tok/s)",
                  static_cast<long long>(s.n_prefilled), reused, s.prefill_s, rate(s.n_prefilled, s.prefill_s),
                  static_cast<long long>(s.n_generated), s.decode_s, rate(s.n_generated, s.decode_s));
    std::string out = buf;
    if (s.speculative) {
        std::snprintf(buf, sizeof buf, " | spec: %lld forwards, %lld drafted, %lld accepted (%.1f%%)",
                      static_cast<long long>(s.spec.steps), static_cast<long long>(s.spec.drafted),
                      static_cast<long long>(s.spec.accepted),
                      s.spec.drafted > 0 ? 100.0 * static_cast<double>(s.spec.accepted) / static_cast<double>(s.spec.drafted) : 0.0);
        out += buf;
    }
    return out;
}

}  // namespace fathom::cli
