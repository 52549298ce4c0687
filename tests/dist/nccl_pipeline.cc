// DS4 layer pipeline over the NCCL transport, one process per rank (one GPU each), against the unsplit
// single-process forward. GPU only (needs 2 GPUs); built by tests/dist/tests.cmake with -DFATHOM_CUDA=ON,
// driven by scripts/device/run_x2.sh, results in docs/dist.md.
//
//   nccl_pipeline ref MODEL OUT              unsplit ds4::forward of MODEL's workload; logits -> OUT
//   nccl_pipeline rank R ID_FILE MODEL OUT   rank R of a 2-rank pipeline (blocks split evenly). Rank 0
//                                            drives the same workload, writes its logits to OUT, compares
//                                            them bit for bit with OUT's "ref" twin (OUT.ref) when present,
//                                            and, for the golden model, with the official golden logits.
//   ... ref MODEL OUT cuda / rank R ID_FILE MODEL OUT cuda
//                                            the same on CUDA: ref = the whole model on GPU 0
//                                            (ds4::cuda_sequence), rank R = a CUDA stage on GPU R; the
//                                            pipeline must equal the single-GPU run bit for bit.
//   nccl_pipeline loop R ID_FILE DIE_RANK DIE_S
//                                            failure test: rank 0 sends decode steps for up to 60 s; rank
//                                            DIE_RANK SIGKILLs itself DIE_S seconds after init. The
//                                            survivor must exit with a one-line error (rc 4) at once
//                                            (liveness side channel), not by a deadline and not hang --
//                                            rank 1 too, which idles in recv_idle between steps.
// MODEL: "synth" (reduced DS4 geometry, preset "tiny", seed 7: 6 blocks, ring wrap, both compressor
// kinds, indexer top-k) or "golden" (ds4-tiny-a.gguf and the 300-token strict case of cases.jsonl
// under FATHOM_SHARED_DIR/golden/ds4-tiny; the device script carries them).
// Workloads (logits of every token): synth = 70-token prefill + 5 decode steps, reset, then 75 tokens
// in chunks of 7; golden = the case's tokens as one prefill. Exit codes: 0 ok, 1 error/mismatch,
// 4 the expected failure in `loop` mode.
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <cuda_runtime.h>

#include "models/cuda/deepseek4_cuda.h"
#include "core/error.h"
#include "dist/nccl_transport.h"
#include "dist/pipeline.h"
#include "models/ds4/golden_util.h"
#include "models/deepseek4_synth.h"

using namespace fathom;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

namespace {

struct workload {
    std::unique_ptr<ds4::model> m;
    ds4::qat_mode qat = ds4::qat_mode::full;
    std::vector<int32_t> tokens;
    std::vector<std::vector<size_t>> rounds;  // chunk schedules (last size repeats); reset between rounds
    bool golden = false;
    ds4_test::golden_case gcase;
};

workload make_workload(const std::string &name) {
    workload w;
    if (name == "synth") {
        const std::string path = (std::filesystem::temp_directory_path() /
                                  ("x2_synth_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::synth_options o;
        o.seed = 7;
        ds4::synth_write(path, ds4::synth_preset("tiny"), o);
        w.m = ds4::load_model(path);
        std::filesystem::remove(path);
        w.tokens.resize(75);
        for (size_t i = 0; i < w.tokens.size(); ++i)
            w.tokens[i] = static_cast<int32_t>((i * 37 + 11) % static_cast<size_t>(w.m->hp.n_vocab));
        w.rounds = {{70, 1}, {7}};
    } else if (name == "golden") {
        w.m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
        for (auto &c : ds4_test::load_cases("cases.jsonl"))
            if (c.tokens.size() == 300 && c.tol["tier"] == "strict") w.gcase = std::move(c);
        if (w.gcase.tokens.empty()) throw error("nccl_pipeline: no 300-token strict case in cases.jsonl");
        w.qat = w.gcase.qat;
        w.tokens = w.gcase.tokens;
        w.rounds = {{w.tokens.size()}};
        w.golden = true;
    } else {
        throw error("nccl_pipeline: unknown model '" + name + "' (synth | golden)");
    }
    return w;
}

// Run every round of `w` through fwd(tokens, positions, logits) with reset() between rounds; the
// logits of all rounds, concatenated ([rounds * n, V]).
template <class F, class R>
std::vector<float> run_workload(const workload &w, F &&fwd, R &&reset) {
    const size_t n = w.tokens.size(), V = static_cast<size_t>(w.m->hp.n_vocab);
    std::vector<float> out(w.rounds.size() * n * V);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    for (size_t r = 0; r < w.rounds.size(); ++r) {
        if (r > 0) reset();
        const auto &chunks = w.rounds[r];
        size_t b = 0, k = 0;
        while (b < n) {
            const size_t len = std::min(n - b, chunks[std::min(k++, chunks.size() - 1)]);
            fwd(std::span(w.tokens).subspan(b, len), std::span(pos).subspan(b, len),
                std::span(out).subspan((r * n + b) * V, len * V));
            b += len;
        }
    }
    return out;
}

void write_floats(const std::string &path, const std::vector<float> &v) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char *>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    if (!f) throw error("nccl_pipeline: cannot write " + path);
}

bool read_floats(const std::string &path, std::vector<float> &v) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) return false;
    v.resize(static_cast<size_t>(f.tellg()) / sizeof(float));
    f.seekg(0);
    f.read(reinterpret_cast<char *>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    return static_cast<bool>(f);
}

// Rank 0 makes the rendezvous (NCCL id + liveness listener on 127.0.0.1) and publishes its id,
// "<256 hex>@127.0.0.1:port", in `path` (written whole, then renamed); rank 1 polls for it.
std::unique_ptr<dist::transport> join(int rank, const std::string &id_path) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 2)
        throw error("nccl_pipeline: needs 2 visible GPUs, found " + std::to_string(n_dev));
    dist::nccl_options o;
    o.device = rank;
    o.timeout = 5s;
    if (rank == 0) {
        dist::nccl_root root(o);
        std::ofstream(id_path + ".tmp") << root.id();
        std::rename((id_path + ".tmp").c_str(), id_path.c_str());
        return dist::make_nccl_transport(std::move(root), 2, o);
    }
    for (int i = 0; i < 600; ++i) {  // 30 s
        std::ifstream in(id_path);
        std::string s;
        if (in >> s && s.size() > 256) return dist::make_nccl_transport(rank, 2, s, o);
        std::this_thread::sleep_for(50ms);
    }
    throw error("nccl_pipeline: no NCCL id in " + id_path);
}

double since(clk::time_point t0) {
    return std::chrono::duration<double>(clk::now() - t0).count();
}

int mode_ref(const std::string &model, const std::string &out, bool cuda) {
    const auto w = make_workload(model);
    std::vector<float> logits;
    if (cuda) {
        ds4::cuda_run_options o;
        o.qat = w.qat;
        o.kv = kv_precision::f32;
        ds4::cuda_sequence seq(ds4::cuda_upload(*w.m, o), static_cast<int64_t>(w.tokens.size()) + 8);
        logits = run_workload(w, [&](auto t, auto, auto l) { seq.eval(t, l); }, [&] { seq.reset(); });
    } else {
        ds4::state st = ds4::new_state(*w.m, w.qat, kv_precision::f32);
        logits = run_workload(
            w, [&](auto t, auto p, auto l) { ds4::forward(*w.m, st, t, p, {l, {}}); },
            [&] { st = ds4::new_state(*w.m, w.qat, kv_precision::f32); });
    }
    write_floats(out, logits);
    std::printf("ref %s: %zu logits written\n", model.c_str(), logits.size());
    return 0;
}

int mode_rank(int rank, const std::string &id_path, const std::string &model, const std::string &out, bool cuda) {
    const auto w = make_workload(model);
    const auto t0 = clk::now();
    auto t = join(rank, id_path);
    std::printf("rank %d: joined in %.2f s%s\n", rank, since(t0), cuda ? " (CUDA stage)" : "");
    dist::stage_device dev;
    if (cuda) dev = {rank, static_cast<int64_t>(w.tokens.size()) + 8};
    dist::pipeline_rank pr(*w.m, dist::even_ranges(w.m->hp.n_layer, 2), *t, w.qat, kv_precision::f32, {}, dev);
    if (rank != 0) {
        pr.serve();
        std::printf("rank %d: blocks [%d, %d) served, stopped\n", rank, pr.range().first, pr.range().last);
        return 0;
    }
    const auto t1 = clk::now();
    const auto got = run_workload(
        w, [&](auto tk, auto p, auto l) { pr.forward(tk, p, l); }, [&] { pr.reset(); });
    pr.stop();
    std::printf("rank 0: blocks [%d, %d), %s workload in %.2f s, %zu logits\n", pr.range().first, pr.range().last,
                model.c_str(), since(t1), got.size());
    write_floats(out, got);
    bool ok = true;
    std::vector<float> ref;
    if (read_floats(out + ".ref", ref)) {
        const bool same = ref.size() == got.size() && std::memcmp(ref.data(), got.data(), got.size() * 4) == 0;
        size_t diff = 0;
        for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i)
            diff += std::memcmp(&ref[i], &got[i], 4) != 0;
        std::printf("rank 0: vs unsplit single-process run: %s (%zu of %zu floats differ)\n",
                    same ? "BIT-IDENTICAL" : "DIFFERENT", diff, got.size());
        ok &= same;
    } else {
        std::printf("rank 0: no %s.ref to compare with\n", out.c_str());
        ok = false;
    }
    if (w.golden) {
        const auto v = ds4_test::compare(w.gcase, got, w.m->hp.n_vocab);
        std::printf("rank 0: vs official golden '%s': %s (max e_p %.3g, median %.3g)%s%s\n", w.gcase.name.c_str(),
                    v.ok ? "ok" : "FAIL", v.max_e, v.median_e, v.ok ? "" : ": ", v.why.c_str());
        ok &= v.ok;
    }
    return ok ? 0 : 1;
}

// Failure test: one rank kills itself mid-run (no abort, no goodbye); the other must fail with a
// one-line error naming the dead peer (liveness side channel). rc 4 = failed as expected.
int mode_loop(int rank, const std::string &id_path, int die_rank, double die_s) {
    const auto w = make_workload("synth");
    auto t = join(rank, id_path);
    dist::pipeline_rank pr(*w.m, dist::even_ranges(w.m->hp.n_layer, 2), *t, w.qat, kv_precision::f32);
    if (rank == die_rank)
        std::thread([die_s, rank] {
            std::this_thread::sleep_for(std::chrono::duration<double>(die_s));
            std::printf("rank %d: SIGKILL self\n", rank);
            std::fflush(stdout);
            ::kill(::getpid(), SIGKILL);
        }).detach();
    const auto t0 = clk::now();
    int64_t steps = 0;
    try {
        if (rank == 0) {
            const size_t V = static_cast<size_t>(w.m->hp.n_vocab);
            std::vector<float> logits(V);
            int32_t tok = 1;
            while (since(t0) < 60) {
                const int64_t p = pr.n_past();
                pr.forward(std::span(&tok, 1), std::span(&p, 1), logits);
                tok = static_cast<int32_t>((tok * 37 + 11) % w.m->hp.n_vocab);
                ++steps;
            }
            pr.stop();
        } else {
            pr.serve();
        }
    } catch (const std::exception &e) {
        std::printf("rank %d: failed after %.2f s (%lld steps done): %s\n", rank, since(t0),
                    static_cast<long long>(steps), e.what());
        return 4;
    }
    std::printf("rank %d: ran %.2f s (%lld steps) without noticing its peer's death\n", rank, since(t0),
                static_cast<long long>(steps));
    return 1;
}

}  // namespace

int main(int argc, char **argv) {
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    try {
        const std::string mode = argc > 1 ? argv[1] : "";
        const bool cuda = std::string(argv[argc - 1]) == "cuda";
        if (mode == "ref" && argc == 4 + cuda) return mode_ref(argv[2], argv[3], cuda);
        if (mode == "rank" && argc == 6 + cuda) return mode_rank(std::atoi(argv[2]), argv[3], argv[4], argv[5], cuda);
        if (mode == "loop" && argc == 6)
            return mode_loop(std::atoi(argv[2]), argv[3], std::atoi(argv[4]), std::atof(argv[5]));
        std::fprintf(stderr,
                     "usage: nccl_pipeline ref MODEL OUT [cuda] | rank R ID_FILE MODEL OUT [cuda] | loop R ID_FILE DIE_RANK DIE_S\n");
        return 2;
    } catch (const std::exception &e) {
        std::printf("error: %s\n", e.what());
        return 1;
    }
}
