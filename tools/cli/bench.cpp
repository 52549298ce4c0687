// `fathom bench`: prefill throughput (one prompt of -p tokens through session::sync) and decode
// throughput (-n single-token eval() calls after it), best and median over --reps repetitions.
// The prompt is a fixed pseudo-random id sequence, so runs are comparable across builds.
// Like llama-bench, one untimed warm-up pass (the prompt, then up to 8 decode steps) runs first, so
// one-off costs (first touch of the mapped weights and of the KV cache, lazily built kernel
// layouts) are not charged to the first repetition; --no-warmup times them.
// DeepSeek V4 prefix checkpoints are off unless --ds4-checkpoint-mib asks for them (each rep would
// otherwise restore the warm-up's checkpoint of the same prompt instead of prefilling it).
// On a CUDA device (--device cuda) it also prints a roofline line: the weight bytes one decode step
// reads, the bandwidth the median decode rate implies, and that as a percentage of the device's
// copy bandwidth measured in the same run (1 GiB device-to-device copies, bytes read + written).
// --depths a,b,..: instead of -p, for each depth d (ascending) the session is reset and a prompt of d
// tokens prefilled in two timed parts, to the previous depth and then the interval up to d (the prompts
// are prefixes of one sequence; the interval's rate is its own time, not a difference of two runs,
// which timing noise could make negative at small depths), then -n tokens decoded at that depth:
// decode tok/s at context frontiers with the roofline line for each.
// --sessions S (S >= 2): S sessions at once, as the server's scheduler drives them: each rep resets them,
// prefills their prompts (-p tokens, a different pseudo-random sequence per session) in one
// engine::sync_step, then runs -n engine::decode_step rounds over all S (one greedy token per session per
// round). Reported: aggregate prefill and decode tok/s (S x tokens / wall time) and the mean round time;
// in-flight pipelines (--devices, pipeline layout) keep every stage busy with a different session.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"

namespace fathom::cli {

namespace {

struct bench_args {
    model_args model;
    int32_t n_prompt = 512;
    int32_t n_gen = 128;
    int32_t reps = 3;
    bool json = false;
    bool no_warmup = false;
    std::vector<int64_t> depths;  // --depths: prefill + decode at each context depth
    int32_t sessions = 1;         // --sessions: concurrent sessions through sync_step / decode_step
};

struct rates {
    double best = 0.0;
    double median = 0.0;
};

rates summarise(std::vector<double> v) {
    rates r;
    if (v.empty()) return r;
    std::sort(v.begin(), v.end());
    r.best = v.back();
    const size_t m = v.size() / 2;
    r.median = v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
    return r;
}

int32_t argmax(std::span<const float> logits) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Greedy next token: on the device when the session samples there (no logits download), else the
// host argmax of logits().
int32_t greedy(session &s, sampler &smp) {
    return s.samples_on_device() ? s.sample(smp, {}).token : argmax(s.logits());
}

sampling_params greedy_params() {
    sampling_params p;
    p.temperature = 0.0f;
    return p;
}

// The benchmark prompt: n pseudo-random ids (fixed seed, so runs compare across builds), BOS first.
std::vector<int32_t> bench_prompt(const engine &eng, int64_t n, uint32_t seed = 12345) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> pick(0, eng.info().n_vocab - 1);
    std::vector<int32_t> prompt(static_cast<size_t>(n));
    for (auto &t : prompt) t = pick(rng);
    if (eng.bos_token() >= 0) prompt[0] = eng.bos_token();
    return prompt;
}

// --depths: one row per depth (see the banner).
void bench_depths(const bench_args &a, engine &eng, const std::vector<int32_t> &prompt) {
    const model_info &info = eng.info();
    auto sess = eng.new_session();
    sampler smp(greedy_params());
    const double copy_bw = info.device == "cpu" ? 0.0 : eng.measure_copy_bandwidth();
    const double wbytes = static_cast<double>(info.decode_weight_bytes);
    if (!a.no_warmup) {
        sess->sync(std::span(prompt).first(std::min<size_t>(prompt.size(), 64)));
        for (int i = 0; i < std::min(a.n_gen, 8); ++i) {
            const int32_t tok = greedy(*sess, smp);
            sess->eval(std::span<const int32_t>(&tok, 1));
        }
    }
    nlohmann::json rows = nlohmann::json::array();
    int64_t prev_d = 0;
    for (int64_t d : a.depths) {
        sess->reset();
        const auto t0 = clock::now();
        if (prev_d > 0) sess->sync(std::span(prompt).first(static_cast<size_t>(prev_d)));
        const double before_s = seconds_since(t0);
        const auto ti = clock::now();
        sess->sync(std::span(prompt).first(static_cast<size_t>(d)));  // keeps the first prev_d tokens
        const double interval_s = seconds_since(ti), ps = before_s + interval_s;
        double dec = 0.0;
        if (a.n_gen > 0) {
            const auto t1 = clock::now();
            for (int i = 0; i < a.n_gen; ++i) {
                const int32_t tok = greedy(*sess, smp);
                sess->eval(std::span<const int32_t>(&tok, 1));
            }
            dec = a.n_gen / seconds_since(t1);
        }
        const double interval = static_cast<double>(d - prev_d) / interval_s;
        const double pct = copy_bw > 0 ? 100.0 * wbytes * dec / copy_bw : 0.0;
        rows.push_back({{"depth", d}, {"prefill_tok_s", static_cast<double>(d) / ps},
                        {"interval", {prev_d, d}}, {"interval_tok_s", interval}, {"decode_tok_s", dec},
                        {"percent_of_copy", pct}});
        if (!a.json) {
            char line[320], roof[64] = "";
            if (copy_bw > 0) std::snprintf(roof, sizeof roof, " = %.1f%% of copy bandwidth", pct);
            std::snprintf(line, sizeof line,
                          "depth %7lld: prefill %.1f tok/s (interval %lld-%lld: %.1f tok/s); decode %d tokens %.1f tok/s%s\n",
                          static_cast<long long>(d), static_cast<double>(d) / ps, static_cast<long long>(prev_d),
                          static_cast<long long>(d), interval, a.n_gen, dec, roof);
            write_out(line);
        }
        prev_d = d;
    }
    if (a.json) {
        nlohmann::json j = {{"model", info.path}, {"arch", info.arch}, {"device", info.device},
                            {"decode_weight_bytes", info.decode_weight_bytes}, {"depths", rows}};
        if (copy_bw > 0) j["copy_bandwidth_bytes_s"] = copy_bw;
        write_out(j.dump() + "\n");
    } else if (copy_bw > 0) {
        char line[200];
        std::snprintf(line, sizeof line, "roofline (%s): %.1f MB of weights per decoded token, copy bandwidth %.0f GB/s\n",
                      info.device.c_str(), wbytes / 1e6, copy_bw / 1e9);
        write_out(line);
    }
}

// --sessions: S sessions stepped together (see the banner).
void bench_sessions(const bench_args &a, engine &eng) {
    const model_info &info = eng.info();
    const size_t S = static_cast<size_t>(a.sessions);
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::unique_ptr<session>> ss;
    std::vector<session *> sp;
    for (size_t i = 0; i < S; ++i) {
        prompts.push_back(bench_prompt(eng, a.n_prompt, 12345 + static_cast<uint32_t>(i)));
        ss.push_back(eng.new_session());
        sp.push_back(ss.back().get());
    }
    sampler smp(greedy_params());
    std::vector<int32_t> toks(S);
    // One rep: reset, prefill all (one sync_step), `n` decode rounds; returns {prefill s, decode s}.
    const auto rep = [&](int n) {
        for (auto &s : ss) s->reset();
        std::vector<sync_item> items;
        for (size_t i = 0; i < S; ++i) items.push_back({sp[i], prompts[i], true});
        const auto t0 = clock::now();
        eng.sync_step(items);
        const double pre = seconds_since(t0);
        const auto t1 = clock::now();
        for (int k = 0; k < n; ++k) {
            for (size_t i = 0; i < S; ++i) toks[i] = greedy(*sp[i], smp);
            eng.decode_step(sp, toks);
        }
        return std::pair<double, double>{pre, seconds_since(t1)};
    };
    if (!a.no_warmup) rep(std::min(a.n_gen, 8));
    std::vector<double> prefill, decode, round_ms;
    for (int r = 0; r < a.reps; ++r) {
        const auto [pre, dec] = rep(a.n_gen);
        prefill.push_back(static_cast<double>(S) * a.n_prompt / pre);
        if (a.n_gen > 0) {
            decode.push_back(static_cast<double>(S) * a.n_gen / dec);
            round_ms.push_back(1e3 * dec / a.n_gen);
        }
        if (!a.json) std::fprintf(stderr, "rep %d/%d done\n", r + 1, a.reps);
    }
    const rates p = summarise(prefill), d = summarise(decode), rm = summarise(round_ms);
    if (a.json) {
        nlohmann::json j = {
            {"model", info.path}, {"arch", info.arch}, {"device", info.device}, {"threads", a.model.threads},
            {"sessions", a.sessions}, {"reps", a.reps},
            {"prefill", {{"n_tokens_per_session", a.n_prompt}, {"best_tok_s", p.best}, {"median_tok_s", p.median}}},
            {"decode", {{"n_tokens_per_session", a.n_gen}, {"best_tok_s", d.best}, {"median_tok_s", d.median},
                        {"median_round_ms", rm.median}}},
        };
        write_out(j.dump() + "\n");
        return;
    }
    char line[256];
    std::snprintf(line, sizeof line,
                  "%d sessions, prefill %d tokens each: aggregate best %.1f tok/s, median %.1f tok/s (%d reps)\n",
                  a.sessions, a.n_prompt, p.best, p.median, a.reps);
    write_out(line);
    if (a.n_gen > 0)
        std::snprintf(line, sizeof line,
                      "%d sessions, decode %d tokens each: aggregate best %.1f tok/s, median %.1f tok/s; "
                      "median round %.2f ms (%d reps)\n",
                      a.sessions, a.n_gen, d.best, d.median, rm.median, a.reps);
    else
        std::snprintf(line, sizeof line, "decode: skipped (-n 0)\n");
    write_out(line);
}

void bench_main(const bench_args &a) {
    if (a.n_prompt < 1) throw error("bench: -p must be >= 1");
    if (a.reps < 1) throw error("bench: --reps must be >= 1");
    if (a.sessions > 1 && !a.depths.empty()) throw error("bench: --sessions and --depths cannot be combined");
    auto eng = load_engine(a.model);
    const model_info &info = eng->info();
    if (a.sessions > 1) {
        if (static_cast<int64_t>(a.n_prompt) + a.n_gen > info.n_ctx)
            throw error("bench: -p + -n = " + std::to_string(static_cast<int64_t>(a.n_prompt) + a.n_gen) +
                        " exceeds the context of " + std::to_string(info.n_ctx) + " (raise --ctx)");
        bench_sessions(a, *eng);
        return;
    }
    if (!a.depths.empty()) {
        std::vector<int64_t> d = a.depths;
        if (!std::is_sorted(d.begin(), d.end()) || d.front() < 1 || std::adjacent_find(d.begin(), d.end()) != d.end())
            throw error("bench: --depths must be ascending positive token counts");
        if (d.back() + a.n_gen > info.n_ctx)
            throw error("bench: the deepest depth + -n = " + std::to_string(d.back() + a.n_gen) +
                        " exceeds the context of " + std::to_string(info.n_ctx) + " (raise --ctx)");
        const std::vector<int32_t> prompt = bench_prompt(*eng, d.back());
        bench_depths(a, *eng, prompt);
        return;
    }
    if (static_cast<int64_t>(a.n_prompt) + a.n_gen > info.n_ctx)
        throw error("bench: -p + -n = " + std::to_string(static_cast<int64_t>(a.n_prompt) + a.n_gen) +
                    " exceeds the context of " + std::to_string(info.n_ctx) + " (raise --ctx)");

    const std::vector<int32_t> prompt = bench_prompt(*eng, a.n_prompt);

    auto sess = eng->new_session();
    sampler smp(greedy_params());
    if (!a.no_warmup) {
        sess->sync(prompt);
        for (int i = 0; i < std::min(a.n_gen, 8); ++i) {
            const int32_t tok = greedy(*sess, smp);
            sess->eval(std::span<const int32_t>(&tok, 1));
        }
    }
    std::vector<double> prefill, decode;
    for (int r = 0; r < a.reps; ++r) {
        sess->reset();
        const auto t0 = clock::now();
        sess->sync(prompt);
        prefill.push_back(a.n_prompt / seconds_since(t0));
        if (a.n_gen > 0) {
            // Greedy continuation: realistic token ids at a negligible sampling cost.
            const auto t1 = clock::now();
            for (int i = 0; i < a.n_gen; ++i) {
                const int32_t tok = greedy(*sess, smp);
                sess->eval(std::span<const int32_t>(&tok, 1));
            }
            decode.push_back(a.n_gen / seconds_since(t1));
        }
        if (!a.json) std::fprintf(stderr, "rep %d/%d done\n", r + 1, a.reps);
    }
    const rates p = summarise(prefill), d = summarise(decode);
    // Roofline (device only): decode is memory-bound, so weight bytes x tok/s against copy bandwidth.
    const double copy_bw = info.device == "cpu" ? 0.0 : eng->measure_copy_bandwidth();
    const double wbytes = static_cast<double>(info.decode_weight_bytes);
    const double dec_bw = wbytes * d.median;
    const double pct = copy_bw > 0 ? 100.0 * dec_bw / copy_bw : 0.0;
    if (a.json) {
        nlohmann::json j = {
            {"model", info.path}, {"arch", info.arch}, {"threads", a.model.threads}, {"reps", a.reps},
            {"exact", a.model.exact}, {"numerics", a.model.numerics}, {"kv_type", a.model.kv_type},
            {"prefill", {{"n_tokens", a.n_prompt}, {"best_tok_s", p.best}, {"median_tok_s", p.median}}},
            {"decode", {{"n_tokens", a.n_gen}, {"best_tok_s", d.best}, {"median_tok_s", d.median}}},
            {"device", info.device}, {"decode_weight_bytes", info.decode_weight_bytes},
        };
        if (copy_bw > 0)
            j["roofline"] = {{"copy_bandwidth_bytes_s", copy_bw}, {"decode_weight_bandwidth_bytes_s", dec_bw},
                             {"percent_of_copy", pct}};
        write_out(j.dump() + "\n");
    } else {
        char line[256];
        std::snprintf(line, sizeof line, "prefill %d tokens: best %.1f tok/s, median %.1f tok/s (%d reps)\n",
                      a.n_prompt, p.best, p.median, a.reps);
        write_out(line);
        if (a.n_gen > 0)
            std::snprintf(line, sizeof line, "decode %d tokens: best %.1f tok/s, median %.1f tok/s (%d reps)\n",
                          a.n_gen, d.best, d.median, a.reps);
        else
            std::snprintf(line, sizeof line, "decode: skipped (-n 0)\n");
        write_out(line);
        if (copy_bw > 0 && a.n_gen > 0) {
            std::snprintf(line, sizeof line,
                          "roofline (%s): %.1f MB of weights per decoded token; median decode reads %.1f GB/s = "
                          "%.1f%% of the measured device copy bandwidth %.0f GB/s (read + write)\n",
                          info.device.c_str(), wbytes / 1e6, dec_bw / 1e9, pct, copy_bw / 1e9);
            write_out(line);
        }
    }
}

}  // namespace

void add_bench_command(CLI::App &app) {
    auto a = std::make_shared<bench_args>();
    // No DeepSeek V4 prefix checkpoints by default: the warm-up's prompt would leave one at the prompt's
    // end, and every timed rep would restore it instead of prefilling (like llama-bench, no prompt cache).
    a->model.ds4_checkpoint_mib = 0;
    auto *cmd = app.add_subcommand("bench", "Measure prefill and decode throughput (tokens/s)");
    add_model_options(cmd, a->model, /*model_required=*/false);
    set_group(cmd, "Bench");
    cmd->add_option("-p,--n-prompt", a->n_prompt, "Prompt tokens for the prefill measurement")
        ->capture_default_str()
        ->check(at_least(1));
    cmd->add_option("-n,--n-gen", a->n_gen, "Tokens for the decode measurement (0 = skip)")
        ->capture_default_str()
        ->check(at_least(0));
    cmd->add_flag("--no-warmup", a->no_warmup, "Skip the untimed warm-up pass (prompt + up to 8 decode steps)");
    cmd->add_option("--reps", a->reps, "Repetitions; best and median are reported")
        ->capture_default_str()
        ->check(at_least(1));
    cmd->add_flag("--json", a->json, "Print one JSON object instead of two text lines");
    cmd->add_option("--depths", a->depths,
                    "Comma-separated context depths: prefill a prompt to each (interval rates) and decode -n tokens there")
        ->delimiter(',');
    cmd->add_option("--sessions", a->sessions,
                    "Concurrent sessions stepped together as the server does (engine sync_step / decode_step); "
                    "aggregate tok/s over all of them")
        ->capture_default_str()
        ->check(CLI::Range(1, 1024));
    cmd->callback([a]() { bench_main(*a); });
}

}  // namespace fathom::cli
