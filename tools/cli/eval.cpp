// `fathom eval niah`: PFlash's quality gate. Generates needle-in-a-haystack prompts (src/pflash/
// niah.h), answers each with a full prefill and with PFlash at several keep ratios (greedy decoding),
// and prints exact-match accuracy and time to first token side by side, as CSV rows per run and a
// summary table. TTFT of a PFlash run = the drafter's scoring of that haystack (measured once per
// trial, without cache) + span selection + the target's prefill of the kept tokens + the first token.
// `--plot out.svg` also draws the summary as an SVG chart (src/pflash/plot.h).
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"
#include "fathom/pflash.h"
#include "pflash/niah.h"
#include "pflash/plot.h"

namespace fathom::cli {

namespace {

struct niah_args {
    model_args model;
    std::string drafter = "smollm2";
    int64_t n_tokens = 4096;
    int32_t n_needles = 5;
    std::string filler = "mixed";
    int32_t trials = 3;
    std::string keep_ratios = "0.1,0.2,0.5";
    uint64_t seed = 1;
    int32_t max_tokens = 64;
    std::string csv_path;
    std::string plot_path;
    bool no_anchors = false;
    bool no_full = false;
};

std::vector<double> parse_ratios(const std::string &s) {
    std::vector<double> out;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, ',');) {
        size_t used = 0;
        double r = 0;
        try {
            r = std::stod(item, &used);
        } catch (const std::exception &) {
            throw error("--keep-ratios: '" + item + "' is not a number");
        }
        if (used != item.size()) throw error("--keep-ratios: '" + item + "' is not a number");
        pflash::validate_keep_ratio(r, "--keep-ratios");
        out.push_back(r);
    }
    if (out.empty()) throw error("--keep-ratios: at least one ratio is required");
    return out;
}

struct run_result {
    int32_t correct = 0;
    double prefill_s = 0, ttft_s = 0;
    double prefill_cpu_s = 0;  // process CPU seconds of the prefill (all threads; steadier under load)
    std::string text;
};

// CPU seconds used by this process so far (all threads).
double process_cpu_s() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Fresh prefill of `prompt` (no reuse), then greedy decoding until EOG, max_tokens or as many lines
// as there are needles.
run_result answer(engine &eng, session &sess, const std::vector<int32_t> &prompt, const pflash::niah_case &c,
                  int32_t max_tokens) {
    run_result r;
    sess.reset();
    const auto t0 = clock::now();
    const double c0 = process_cpu_s();
    sess.sync(prompt);
    r.prefill_s = seconds_since(t0);
    r.prefill_cpu_s = process_cpu_s() - c0;
    std::vector<int32_t> out;
    for (int32_t i = 0; i < max_tokens; ++i) {
        const auto lg = sess.logits();
        const int32_t tok = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
        if (i == 0) r.ttft_s = seconds_since(t0);
        if (eng.is_end_of_generation(tok)) break;
        out.push_back(tok);
        r.text = eng.detokenize(out);
        if (static_cast<int32_t>(std::count(r.text.begin(), r.text.end(), '\n')) >= static_cast<int32_t>(c.needles.size()))
            break;
        if (sess.n_past() >= eng.info().n_ctx) break;
        sess.eval(std::span<const int32_t>(&tok, 1));
    }
    r.correct = pflash::niah_score(c, r.text);
    return r;
}

std::string one_line(std::string s) {
    for (char &ch : s)
        if (ch == '\n') ch = '|';
        else if (ch == '"') ch = '\'';
    return s;
}

void niah_main(const niah_args &a) {
    const std::vector<double> ratios = parse_ratios(a.keep_ratios);
    const pflash::niah_filler filler = pflash::parse_niah_filler(a.filler);
    if (a.trials < 1) throw error("--trials: must be >= 1");
    if (!a.plot_path.empty()) pflash::check_plot_path(a.plot_path);  // fail before the long runs
    model_args ma = a.model;
    if (ma.ctx == 0) ma.ctx = static_cast<int>(a.n_tokens + a.max_tokens + 256);
    auto eng = load_engine(ma);
    pflash::options po;
    po.drafter_path = resolve_model_path(a.drafter, a.model.models_dir);
    po.residency = pflash::drafter_residency::keep;
    po.verbatim_last_user = false;  // raw completion prompts: the haystack is the text to compress
    po.n_threads = a.model.threads;
    if (a.no_anchors) po.anchor_ngram = 0;
    auto comp = pflash::compressor::create(po);
    auto sess = eng->new_session();

    std::ofstream csv_file;
    if (!a.csv_path.empty()) {
        csv_file.open(a.csv_path);
        if (!csv_file) throw error("cannot write " + a.csv_path);
    }
    auto emit = [&](const std::string &line) {
        write_out(line + "\n");
        if (csv_file) csv_file << line << "\n";
    };
    emit("mode,keep_ratio,trial,n_prompt,n_effective,correct,needles,drafter_s,prefill_s,ttft_s,drafter_cpu_s,"
         "prefill_cpu_s,anchor_chunks,answer");
    struct agg {
        int64_t correct = 0, total = 0, n_eff = 0, n_runs = 0;
        double ttft = 0, drafter = 0;  // drafter = the drafter scoring + selection part of ttft
    };
    std::map<double, agg> sums;  // keep ratio -> totals; -1 = full prefill
    for (int32_t trial = 0; trial < a.trials; ++trial) {
        pflash::niah_options no;
        no.n_tokens = a.n_tokens;
        no.n_needles = a.n_needles;
        no.filler = filler;
        no.seed = a.seed + static_cast<uint64_t>(trial);
        const pflash::niah_case c = pflash::niah_generate(
            no, [&](std::string_view s) { return static_cast<int64_t>(eng->tokenize(s, false, false).size()); });
        const std::vector<int32_t> full = tokenize_prompt(*eng, c.prompt);
        char buf[1024];
        if (!a.no_full) {
            const run_result r = answer(*eng, *sess, full, c, a.max_tokens);
            std::snprintf(buf, sizeof buf, "full,1,%d,%zu,%zu,%d,%zu,0,%.3f,%.3f,0,%.3f,0,\"%s\"", trial, full.size(),
                          full.size(), r.correct, c.needles.size(), r.prefill_s, r.ttft_s, r.prefill_cpu_s,
                          one_line(r.text).c_str());
            emit(buf);
            agg &s = sums[-1.0];
            s.correct += r.correct, s.total += static_cast<int64_t>(c.needles.size()), s.ttft += r.ttft_s;
            s.n_eff += static_cast<int64_t>(full.size()), ++s.n_runs;
        }
        comp->clear_score_cache();
        double score_s = -1, score_cpu_s = 0;  // the uncached drafter scoring of this haystack
        for (double ratio : ratios) {
            comp->set_keep_ratio(ratio);
            const double c0 = process_cpu_s();
            const pflash::result pr = comp->compress(*eng, full);
            if (score_s < 0) score_s = pr.score_s, score_cpu_s = process_cpu_s() - c0;
            const run_result r = answer(*eng, *sess, pr.tokens, c, a.max_tokens);
            const double ttft = score_s + pr.select_s + r.ttft_s;
            std::snprintf(buf, sizeof buf, "pflash,%.3f,%d,%zu,%lld,%d,%zu,%.3f,%.3f,%.3f,%.3f,%.3f,%lld,\"%s\"", ratio,
                          trial, full.size(), static_cast<long long>(pr.n_effective), r.correct, c.needles.size(),
                          score_s, r.prefill_s, ttft, score_cpu_s, r.prefill_cpu_s,
                          static_cast<long long>(pr.n_anchor_chunks), one_line(r.text).c_str());
            emit(buf);
            agg &s = sums[ratio];
            s.correct += r.correct, s.total += static_cast<int64_t>(c.needles.size()), s.ttft += ttft;
            s.drafter += score_s + pr.select_s;
            s.n_eff += pr.n_effective, ++s.n_runs;
        }
    }
    std::fprintf(stderr, "\n%-14s %10s %12s %10s\n", "mode", "accuracy", "eff.tokens", "ttft_s");
    for (const auto &[ratio, s] : sums) {
        char mode[32];
        if (ratio < 0) std::snprintf(mode, sizeof mode, "full");
        else std::snprintf(mode, sizeof mode, "pflash %.3f", ratio);
        std::fprintf(stderr, "%-14s %9.1f%% %12.0f %10.3f\n", mode, 100.0 * static_cast<double>(s.correct) / static_cast<double>(s.total),
                     static_cast<double>(s.n_eff) / static_cast<double>(s.n_runs), s.ttft / static_cast<double>(s.n_runs));
    }
    if (!a.plot_path.empty()) {
        pflash::niah_plot_summary ps{a.n_tokens, a.n_needles, a.trials, a.filler, {}};
        for (const auto &[ratio, s] : sums) {
            char mode[32];
            if (ratio < 0) std::snprintf(mode, sizeof mode, "full");
            else std::snprintf(mode, sizeof mode, "keep %g", ratio);
            const double runs = static_cast<double>(s.n_runs);
            ps.rows.push_back({mode, 100.0 * static_cast<double>(s.correct) / static_cast<double>(s.total),
                               s.ttft / runs, s.drafter / runs});
        }
        pflash::write_niah_plot(ps, a.plot_path);
        std::fprintf(stderr, "plot: %s\n", a.plot_path.c_str());
    }
}

}  // namespace

void add_eval_command(CLI::App &app) {
    auto *cmd = app.add_subcommand("eval", "Quality evaluations (PFlash needle-in-a-haystack)");
    cmd->require_subcommand(1);
    auto a = std::make_shared<niah_args>();
    a->model.model = "gemma3";
    auto *niah = cmd->add_subcommand("niah", "Needle retrieval: full prefill vs PFlash at several keep ratios (CSV)");
    add_model_options(niah, a->model, /*model_required=*/false);
    set_group(niah, "NIAH");
    niah->add_option("--drafter", a->drafter, "PFlash drafter model (path or short name)")->capture_default_str();
    niah->add_option("--tokens", a->n_tokens, "Approximate prompt length in target tokens")->capture_default_str()->check(at_least(256));
    niah->add_option("--needles", a->n_needles, "Key/value needles per haystack")->capture_default_str()->check(CLI::Range(1, 16));
    niah->add_option("--filler", a->filler, "Haystack filler: prose | code | json | mixed")->capture_default_str();
    niah->add_option("--trials", a->trials, "Haystacks (different seeds)")->capture_default_str()->check(at_least(1));
    niah->add_option("--keep-ratios", a->keep_ratios, "Comma-separated PFlash keep ratios, each in [0, 1]")->capture_default_str();
    niah->add_option("--seed", a->seed, "Seed of the first haystack")->capture_default_str();
    niah->add_option("--max-tokens", a->max_tokens, "Generation limit per answer")->capture_default_str()->check(at_least(1));
    niah->add_option("--csv", a->csv_path, "Also write the CSV rows to this file");
    niah->add_option("--plot", a->plot_path, "Also draw the summary (accuracy and TTFT per mode) as an SVG chart");
    niah->add_flag("--no-anchors", a->no_anchors, "Disable PFlash's n-gram anchor rule (scores alone choose spans)");
    niah->add_flag("--no-full", a->no_full, "Skip the full-prefill runs (PFlash rows only)");
    niah->callback([a]() { niah_main(*a); });
}

}  // namespace fathom::cli
