// Quant kernel micro-benchmarks: gemm GFLOP/s and GB/s (weights + activations streamed once) for
// decode (M=1) and prefill (M=64) shapes of SmolLM2-135M, per weight type and ISA, plus a
// one-row-one-column vec_dot loop (the llama.cpp-style kernel shape) as the baseline the tile beats.
//   bench_quant --benchmark_min_time=0.2
// Shapes: 32-element types at K=576, N=1536 (attn/ffn_up); k-quants need K % 256 == 0, so they
// (and f16, for comparison) also run K=1536, N=576 (ffn_down).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "backend/cpu/quants.h"

using namespace fathom;
using namespace fathom::cpu;

namespace {

struct problem {
    std::vector<uint8_t> W, X;
    size_t w_stride, x_stride;
    std::vector<float> y;
};

problem make_problem(dtype t, int64_t K, int64_t N, int64_t M) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0, 1);
    problem p;
    const dtype at = vec_dot_type(t);
    p.w_stride = dtype_row_bytes(t, K);
    p.x_stride = dtype_row_bytes(at, K);
    p.W.resize(p.w_stride * N);
    p.X.resize(p.x_stride * M);
    std::vector<float> row(K);
    for (int64_t r = 0; r < N; ++r) {
        for (auto &v : row) v = nd(rng);
        quantize_row(t, row.data(), p.W.data() + r * p.w_stride, K);
    }
    for (int64_t m = 0; m < M; ++m) {
        for (auto &v : row) v = nd(rng);
        quantize_row(at, row.data(), p.X.data() + m * p.x_stride, K);
    }
    p.y.resize(N * M);
    return p;
}

void set_counters(benchmark::State &st, const problem &p, int64_t K, int64_t N, int64_t M) {
    const double flops = 2.0 * K * N * M, bytes = static_cast<double>(p.W.size() + p.X.size());
    st.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void bm_gemm(benchmark::State &st, dtype t, isa level, int64_t K, int64_t N) {
    const int64_t M = st.range(0);
    if (level > detected_isa()) return st.SkipWithError("ISA not available");
    force_isa(level);
    problem p = make_problem(t, K, N, M);
    for (auto _ : st) {
        gemm(t, K, p.W.data(), p.w_stride, 0, N, p.X.data(), p.x_stride, M, p.y.data(), N);
        benchmark::DoNotOptimize(p.y.data());
    }
    set_counters(st, p, K, N, M);
    force_isa(detected_isa());
}

void bm_dot_loop(benchmark::State &st, dtype t, int64_t K, int64_t N) {
    const int64_t M = st.range(0);
    problem p = make_problem(t, K, N, M);
    for (auto _ : st) {
        for (int64_t m = 0; m < M; ++m)
            for (int64_t r = 0; r < N; ++r)
                p.y[m * N + r] = vec_dot(t, K, p.W.data() + r * p.w_stride, p.X.data() + m * p.x_stride);
        benchmark::DoNotOptimize(p.y.data());
    }
    set_counters(st, p, K, N, M);
}

void register_all() {
    struct shape { int64_t K, N; };
    const dtype q32[] = {dtype::q4_0, dtype::q4_1, dtype::q5_0, dtype::q8_0, dtype::f16};
    const dtype kq[] = {dtype::q2_k, dtype::q4_k, dtype::q5_k, dtype::q6_k, dtype::f16};
    auto reg = [](dtype t, shape s) {
        const std::string base = std::string(dtype_name(t)) + "/K" + std::to_string(s.K) + "xN" + std::to_string(s.N);
        for (isa level : {isa::avx2, isa::scalar}) {
            if (level > detected_isa()) continue;
            auto *b = benchmark::RegisterBenchmark(("gemm/" + base + "/" + isa_name(level)).c_str(), bm_gemm, t, level, s.K, s.N);
            b->Arg(1);
            if (level != isa::scalar) b->Arg(64);
            b->Unit(benchmark::kMicrosecond);
        }
        benchmark::RegisterBenchmark(("dotloop/" + base).c_str(), bm_dot_loop, t, s.K, s.N)->Arg(1)->Unit(benchmark::kMicrosecond);
    };
    for (dtype t : q32) reg(t, {576, 1536});
    for (dtype t : kq) reg(t, {1536, 576});
}

const int registered = (register_all(), 0);

}  // namespace
