// Also a DSpark drafter's block at that geometry (window 128, full-size stages of 16 experts): from the
// kept context (ds4::dspark_draft_at, what a session's drafter does) and with the window's rows recomputed
// from the features (ds4::dspark_draft, what it did before each position's rows were kept).
// Cost of a DS4 multi-row step on the CPU (ds4::step, src/models/deepseek4.h) relative to one row: a
// verification of R rows of one sequence (R = 1..5) and a batched decode of one row in each of R
// sequences (R = 1..16), every sequence at the same depth (one prefill, copied); each iteration is one step
// followed by the free rollback of its rows (ds4::truncate), so every step runs at the same depth.
// The model: a synthetic DS4 at the reduced Flash geometry (4 blocks at full width, 16 experts, the q2
// mix, and its MTP block: fathom-gguf synth --mtp, the main model's bytes unchanged by it; written once to a
// temporary file), products quantised (the engine's default), all cores.
//   build: cmake -B build -DFATHOM_BENCH=ON && cmake --build build --target bench_ds4
//   run:   build/bench/bench_ds4 --benchmark_min_time=2 [--ds4-layers=N]
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>

#include "backend/cpu/thread_pool.h"
#include "engine/ds4_drafter.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_mtp.h"
#include "models/deepseek4_synth.h"
#include "fathom/speculative.h"

namespace {

using namespace fathom;

constexpr int64_t kDepth = 512;
int g_layers = 4;  // --ds4-layers=N (main below): the fixture's blocks

struct fixture {
    ds4::hparams hp;
    std::unique_ptr<ds4::model> m;
    std::shared_ptr<const ds4::mtp_weights> mtp;  // the file's MTP head (ds4::load_mtp)
    std::unique_ptr<cpu::thread_pool> pool;
    std::vector<ds4::state> seqs;  // 16 sequences at kDepth
    std::vector<int32_t> prompt;   // [kDepth] the tokens sequence 0 holds
    int64_t tail_p0 = 0;           // the first of the prompt's last rows whose final HC states are kept
    std::vector<float> tail_hc;    // [kDepth - tail_p0, n_hc * D] (an MTP drafter's view of the prefill)
};

fixture &data() {
    static fixture f = [] {
        fixture x;
        ds4::hparams hp = ds4::synth_preset("flash");
        hp.n_layer = g_layers;
        hp.n_expert = 16;
        ds4::synth_fix_layers(hp, hp.clamp_exp.empty() ? 10.0f : hp.clamp_exp[0]);
        ds4::synth_options o;
        o.mix = "q2";
        o.mtp = true;
        const std::string path =
            (std::filesystem::temp_directory_path() / ("fathom_bench_ds4_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::synth_write(path, hp, o);
        x.hp = hp;
        x.m = ds4::load_model(path);
        x.mtp = ds4::load_mtp(*x.m, x.m->file);
        std::filesystem::remove(path);  // the mapping stays valid
        x.pool = std::make_unique<cpu::thread_pool>(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
        std::mt19937 rng(1);
        // One prefill; the other sequences are copies of its state (the same work per step).
        ds4::state st = ds4::new_state(*x.m, ds4::qat_mode::full, kv_precision::f16);
        st.exec.pool = x.pool.get();
        st.exec.quantised = true;
        std::vector<int32_t> toks(kDepth);
        std::vector<int64_t> pos(kDepth);
        for (int64_t i = 0; i < kDepth; ++i) {
            toks[static_cast<size_t>(i)] = static_cast<int32_t>(rng() % static_cast<uint32_t>(hp.n_vocab));
            pos[static_cast<size_t>(i)] = i;
        }
        const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd);
        std::vector<float> hc(static_cast<size_t>(kDepth) * S);
        ds4::forward(*x.m, st, toks, pos, {{}, hc});
        x.seqs.assign(16, st);
        x.prompt = toks;
        // the rows an MTP drafter keeps after a long prompt: its window, and the state it drafts from
        x.tail_p0 = kDepth - (hp.window + 2);
        x.tail_hc.assign(hc.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(x.tail_p0) * S), hc.end());
        return x;
    }();
    return f;
}

// One step of `rows`, the logits of every row, then the rows rolled back.
void run_step(benchmark::State &state, int n_seq, int rows_per_seq) {
    fixture &f = data();
    std::vector<ds4::state *> seqs;
    for (int s = 0; s < n_seq; ++s) seqs.push_back(&f.seqs[static_cast<size_t>(s)]);
    std::vector<ds4::step_row> rows;
    std::vector<int32_t> lr;
    for (int j = 0; j < rows_per_seq; ++j)
        for (int s = 0; s < n_seq; ++s) {
            lr.push_back(static_cast<int32_t>(rows.size()));
            rows.push_back({s, kDepth + j, 7 + j + s});
        }
    std::vector<float> logits(lr.size() * static_cast<size_t>(f.m->hp.n_vocab));
    for (auto _ : state) {
        ds4::step(*f.m, seqs, rows, lr, logits);
        for (ds4::state *st : seqs) ds4::truncate(*st, kDepth);
    }
    state.counters["rows"] = static_cast<double>(rows.size());
    state.counters["rows/s"] = benchmark::Counter(static_cast<double>(rows.size()), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Ds4VerifyRows(benchmark::State &state) {
    run_step(state, 1, static_cast<int>(state.range(0)));
}
BENCHMARK(BM_Ds4VerifyRows)->DenseRange(1, 5)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Ds4BatchedDecode(benchmark::State &state) {
    run_step(state, static_cast<int>(state.range(0)), 1);
}
BENCHMARK(BM_Ds4BatchedDecode)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Arg(16)->Unit(benchmark::kMillisecond)->UseRealTime();

// Speculative decoding at controlled acceptance (the drafts are the target's own greedy continuation,
// each corrupted with probability 1 - a; synthetic weights make a real drafter's acceptance meaningless):
// 48 tokens decoded from depth kDepth with drafts (adaptive width up to 8, spec::draft_budget with the
// verification cost curve spec::verify_cost timed from the steps, kept across iterations as a serving
// process keeps it; the rejected rows rolled back) against arg 0 = plain decoding, one row per step. Counter
// tok/s.
//   BM_Ds4SpecControlled: drafting costs nothing (the oracle is free): the verification side of the ratio.
//   BM_Ds4SpecControlledMtp ("MTP paid"): every step that drafts k tokens pays the file's real MTP head as a
//     session's drafter runs it (engine/ds4_drafter.h make_mtp_drafter: draft() chains the head k rows from
//     the target's final HC state and rolls them back; its tokens are then replaced by the oracle's), its time
//     joining the cost model as spec::generate adds it (observe_draft: the width pays for it); after each
//     verification the drafter is handed the verified rows' states (observe, inside the step's timed cost as
//     in session::eval_verify; the head runs them lazily, at its next draft) and follows the rollback
//     (truncate). Its history starts as a session's does after the prompt (the prompt's last context_rows()
//     rows, outside the timing). Extra counters: draft_ms (one draft
//     call), draft_tok_steps (its time per drafted token in plain decoding steps, timed by the oracle's plain
//     run), head_rows_ms (the head's rows per step), drafts/step.
struct spec_run {
    int64_t steps = 0, drafts = 0, drafted = 0;
    double draft_s = 0, head_rows_s = 0;
};

// The greedy continuation of sequence 0 after token 11 (plain decoding), and the seconds of one plain step.
const std::vector<int32_t> &oracle(fixture &f, double *step_s) {
    static double plain_step_s = 0;
    static std::vector<int32_t> cont = [&] {
        const size_t V = static_cast<size_t>(f.m->hp.n_vocab);
        ds4::state st = f.seqs[0];
        std::vector<int32_t> out;
        std::vector<float> lg(V);
        int32_t t = 11;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 64 + 16; ++i) {
            const int64_t p = st.n_past;
            ds4::forward(*f.m, st, std::span<const int32_t>(&t, 1), std::span<const int64_t>(&p, 1), {lg, {}});
            t = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
            out.push_back(t);
        }
        plain_step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 80.0;
        return out;
    }();
    if (step_s) *step_s = plain_step_s;
    return cont;
}

// One run of kTokens from sequence 0's state; drafter: null (free drafts) or the MTP drafter to pay.
void spec_decode(fixture &f, ds4::state &st, ds4_drafter *drafter, double a, int kTokens, spec::verify_cost &cost,
                 std::mt19937 &rng, spec_run &r) {
    const size_t V = static_cast<size_t>(f.m->hp.n_vocab), S = static_cast<size_t>(f.hp.n_hc * f.hp.n_embd);
    const std::vector<int32_t> &cont = oracle(f, nullptr);
    ds4::state *seq = &st;
    std::vector<int32_t> held = f.prompt;  // what the session holds (the drafter reads it)
    spec::draft_budget budget(8, true);
    int32_t pending = 11;
    size_t emitted = 0;  // cont[0 .. emitted) decoded
    while (emitted < static_cast<size_t>(kTokens)) {
        const int32_t k = a > 0 ? budget.next(&cost) : 0;
        if (drafter && k > 0) {  // the head's drafts, paid; the oracle's tokens verified instead
            const auto d0 = std::chrono::steady_clock::now();
            const std::vector<int32_t> d = drafter->draft(held, pending, k, nullptr);
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - d0).count();
            cost.observe_draft(k, dt);
            r.draft_s += dt;
            ++r.drafts;
            benchmark::DoNotOptimize(d.data());
        }
        std::vector<ds4::step_row> rows{{0, st.n_past, pending}};
        for (int32_t j = 0; j < k; ++j) {
            int32_t d = cont[emitted + static_cast<size_t>(j)];
            if (std::uniform_real_distribution<double>(0, 1)(rng) >= a) d = (d + 1) % static_cast<int32_t>(V);
            rows.push_back({0, st.n_past + 1 + j, d});
        }
        std::vector<int32_t> lr(rows.size());
        for (size_t i = 0; i < lr.size(); ++i) lr[i] = static_cast<int32_t>(i);
        std::vector<float> lg(rows.size() * V), hc(drafter ? rows.size() * S : 0);
        const int64_t base = st.n_past;
        const auto t0 = std::chrono::steady_clock::now();
        ds4::step(*f.m, std::span<ds4::state *const>(&seq, 1), rows, lr, lg, {hc, {}, {}});
        if (drafter) {  // the head's rows over the verified ones (the session's observe after its forward)
            const auto h0 = std::chrono::steady_clock::now();
            for (const auto &row : rows) held.push_back(row.token);
            drafter->observe(held, base, hc, {});
            r.head_rows_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count();
        }
        cost.observe(static_cast<int32_t>(rows.size()),
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        ++r.steps;
        // Row j's argmax is the next true token; drafts kept while they equal it.
        size_t j = 0;
        for (;; ++j) {
            const float *row = &lg[j * V];
            const int32_t y = static_cast<int32_t>(std::max_element(row, row + V) - row);
            ++emitted;
            if (j + 1 < rows.size() && rows[j + 1].token == y && emitted < static_cast<size_t>(kTokens)) continue;
            pending = y;
            break;
        }
        const int64_t keep = base + 1 + static_cast<int64_t>(j);
        ds4::truncate(st, keep);
        if (drafter) {
            held.resize(static_cast<size_t>(keep));
            drafter->truncate(keep);
        }
        budget.update(rows.size() - 1, j);
        r.drafted += static_cast<int64_t>(rows.size()) - 1;
    }
}

void spec_controlled(benchmark::State &state, bool mtp_paid) {
    fixture &f = data();
    const double a = static_cast<double>(state.range(0)) / 100.0;
    constexpr int kTokens = 48;
    double plain_step_s = 0;
    oracle(f, &plain_step_s);
    std::mt19937 rng(3);
    spec_run r;
    spec::verify_cost cost;
    ds4::exec_options ex;
    ex.pool = f.pool.get();
    ex.quantised = true;
    for (auto _ : state) {
        state.PauseTiming();
        ds4::state st = f.seqs[0];
        std::unique_ptr<ds4_drafter> drafter;
        if (mtp_paid) {  // a session's MTP drafter after the prompt: the head's rows over its last window
            drafter = make_mtp_drafter(*f.m, f.mtp, ds4::qat_mode::full, kv_precision::f16, ex);
            drafter->observe(f.prompt, f.tail_p0, f.tail_hc, {});
        }
        state.ResumeTiming();
        spec_decode(f, st, drafter.get(), a, kTokens, cost, rng, r);
    }
    state.counters["tok/s"] = benchmark::Counter(kTokens, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["tokens/step"] = static_cast<double>(kTokens) * static_cast<double>(state.iterations()) /
                                    static_cast<double>(r.steps);
    if (!mtp_paid) return;
    const double n_steps = static_cast<double>(std::max<int64_t>(1, r.steps));
    state.counters["drafts/step"] = static_cast<double>(r.drafts) / n_steps;
    state.counters["draft_ms"] = r.drafts ? r.draft_s * 1e3 / static_cast<double>(r.drafts) : 0.0;
    state.counters["draft_tok_steps"] =
        r.drafted ? r.draft_s / static_cast<double>(r.drafted) / plain_step_s : 0.0;
    state.counters["head_rows_ms"] = r.head_rows_s * 1e3 / n_steps;
}

void BM_Ds4SpecControlled(benchmark::State &state) {
    spec_controlled(state, false);
}
BENCHMARK(BM_Ds4SpecControlled)->Arg(0)->Arg(60)->Arg(80)->Arg(90)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Ds4SpecControlledMtp(benchmark::State &state) {
    spec_controlled(state, true);
}
BENCHMARK(BM_Ds4SpecControlledMtp)->Arg(60)->Arg(80)->Arg(90)->Arg(100)->Unit(benchmark::kMillisecond)->UseRealTime();

// One DSpark block (B = 5) after kDepth positions whose window of 128 rows was observed: arg 0 from the kept
// context (dspark_draft_at), arg 1 recomputing the window's main_x and every stage's K/V rows (dspark_draft).
void BM_Ds4DsparkDraft(benchmark::State &state) {
    fixture &f = data();
    static std::unique_ptr<ds4::dspark_weights> w = [&] {
        ds4::synth_options o;
        o.mix = "q2";
        const std::string path = (std::filesystem::temp_directory_path() /
                                  ("fathom_bench_ds4_dspark_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::synth_write_dspark(path, f.hp, ds4::synth_dspark_preset("flash", f.hp), o);
        auto d = ds4::load_dspark(*f.m, path);
        std::filesystem::remove(path);
        return d;
    }();
    ds4::exec_options ex;
    ex.pool = f.pool.get();
    ex.quantised = true;
    const int64_t W = w->cfg.window, F = w->feature_dim();
    std::vector<float> feat(static_cast<size_t>(W * F));
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float &v : feat) v = nd(rng);
    ds4::dspark_context ctx = ds4::new_dspark_context(*w);
    ds4::dspark_observe(*w, ds4::qat_mode::full, ex, ctx, kDepth - W, feat);
    for (auto _ : state) {
        const ds4::dspark_block b =
            state.range(0) == 0 ? ds4::dspark_draft_at(*f.m, *w, ds4::qat_mode::full, ex, ctx, kDepth, 11)
                                : ds4::dspark_draft(*f.m, *w, ds4::qat_mode::full, ex, feat, kDepth - W, 11);
        benchmark::DoNotOptimize(b.draft_tokens.data());
    }
}
BENCHMARK(BM_Ds4DsparkDraft)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

// Google Benchmark's main, plus --ds4-layers=N (default 4): the synthetic model's blocks. The 4-block file
// reads its 563 MB q8_0 head with every token as well as the blocks, so an MTP draft (its block and the same
// head) costs ~0.7 of a plain step there, against ~0.15 in the 43-block model; more blocks bring the ratios
// nearer the real model's (each block ~0.2 GB of a token's reads, ~0.5 GB of the file).
int main(int argc, char **argv) {
    int n = 0;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if (a.rfind("--ds4-layers=", 0) == 0) {
            g_layers = std::max(1, std::atoi(a.c_str() + 13));
            continue;
        }
        argv[n++] = argv[i];
    }
    argc = n;
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
