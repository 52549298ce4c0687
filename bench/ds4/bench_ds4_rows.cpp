// Also a DSpark drafter's block at that geometry (window 128, full-size stages of 16 experts): from the
// kept context (ds4::dspark_draft_at, what a session's drafter does) and with the window's rows recomputed
// from the features (ds4::dspark_draft, what it did before each position's rows were kept).
// Cost of a DS4 multi-row step on the CPU (ds4::step, src/models/deepseek4.h) relative to one row: a
// verification of R rows of one sequence (R = 1..5) and a batched decode of one row in each of R
// sequences (R = 1..16), every sequence at the same depth (one prefill, copied); each iteration is one step
// followed by the free rollback of its rows (ds4::truncate), so every step runs at the same depth.
// The model: a synthetic DS4 at the reduced Flash geometry (4 blocks at full width, 16 experts, the q2
// mix; written once to a temporary file), products quantised (the engine's default), all cores.
//   build: cmake -B build -DFATHOM_BENCH=ON && cmake --build build --target bench_ds4
//   run:   build/bench/bench_ds4 --benchmark_min_time=2
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>

#include "backend/cpu/thread_pool.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_synth.h"
#include "fathom/speculative.h"

namespace {

using namespace fathom;

constexpr int64_t kDepth = 512;

struct fixture {
    ds4::hparams hp;
    std::unique_ptr<ds4::model> m;
    std::unique_ptr<cpu::thread_pool> pool;
    std::vector<ds4::state> seqs;  // 16 sequences at kDepth
};

fixture &data() {
    static fixture f = [] {
        fixture x;
        ds4::hparams hp = ds4::synth_preset("flash");
        hp.n_layer = 4;
        hp.n_expert = 16;
        ds4::synth_fix_layers(hp, hp.clamp_exp.empty() ? 10.0f : hp.clamp_exp[0]);
        ds4::synth_options o;
        o.mix = "q2";
        const std::string path =
            (std::filesystem::temp_directory_path() / ("fathom_bench_ds4_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::synth_write(path, hp, o);
        x.hp = hp;
        x.m = ds4::load_model(path);
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
        ds4::forward(*x.m, st, toks, pos, {});
        x.seqs.assign(16, st);
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
// process keeps it; the rejected rows rolled back) against arg 0 = plain decoding, one row per step. Counter tok/s; drafting
// itself costs nothing here (the oracle is free), so this is the verification side of the ratio.
void BM_Ds4SpecControlled(benchmark::State &state) {
    fixture &f = data();
    const double a = static_cast<double>(state.range(0)) / 100.0;
    const size_t V = static_cast<size_t>(f.m->hp.n_vocab);
    constexpr int kTokens = 48;
    // The greedy continuation of sequence 0 (computed once, plain decoding).
    static std::vector<int32_t> cont = [&] {
        ds4::state st = f.seqs[0];
        std::vector<int32_t> out;
        std::vector<float> lg(V);
        int32_t t = 11;
        for (int i = 0; i <= kTokens + 16; ++i) {
            const int64_t p = st.n_past;
            ds4::forward(*f.m, st, std::span<const int32_t>(&t, 1), std::span<const int64_t>(&p, 1), {lg, {}});
            t = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
            out.push_back(t);
        }
        return out;
    }();
    std::mt19937 rng(3);
    int64_t steps = 0;
    spec::verify_cost cost;
    for (auto _ : state) {
        state.PauseTiming();
        ds4::state st = f.seqs[0];
        ds4::state *seq = &st;
        state.ResumeTiming();
        spec::draft_budget budget(8, true);
        int32_t pending = 11;
        size_t emitted = 0;  // cont[0 .. emitted) decoded
        while (emitted < static_cast<size_t>(kTokens)) {
            const int32_t k = a > 0 ? budget.next(&cost) : 0;
            std::vector<ds4::step_row> rows{{0, st.n_past, pending}};
            for (int32_t j = 0; j < k; ++j) {
                int32_t d = cont[emitted + static_cast<size_t>(j)];
                if (std::uniform_real_distribution<double>(0, 1)(rng) >= a) d = (d + 1) % static_cast<int32_t>(V);
                rows.push_back({0, st.n_past + 1 + j, d});
            }
            std::vector<int32_t> lr(rows.size());
            for (size_t r = 0; r < lr.size(); ++r) lr[r] = static_cast<int32_t>(r);
            std::vector<float> lg(rows.size() * V);
            const auto t0 = std::chrono::steady_clock::now();
            ds4::step(*f.m, std::span<ds4::state *const>(&seq, 1), rows, lr, lg);
            cost.observe(static_cast<int32_t>(rows.size()),
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            ++steps;
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
            ds4::truncate(st, rows[0].pos + 1 + static_cast<int64_t>(j));
            budget.update(rows.size() - 1, j);
        }
    }
    state.counters["tok/s"] = benchmark::Counter(kTokens, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["tokens/step"] = static_cast<double>(kTokens) * static_cast<double>(state.iterations()) /
                                    static_cast<double>(steps);
}
BENCHMARK(BM_Ds4SpecControlled)->Arg(0)->Arg(60)->Arg(80)->Arg(90)->Unit(benchmark::kMillisecond)->UseRealTime();

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
