// The decode sparse-attention benchmark's shapes and inputs, shared by CudaDs4AttnBench.SparseSinkAttention
// (bench_ds4_attn.cpp) and CudaDs4AttnMma.BenchOldVsNew (bench_ds4_attn_mma.cpp): 64 heads x 512,
// f16 rows, window 128; ratio 0 (128 rows), ratio 4 (128 + 512 selected of 2048), ratio 128 at 8K
// (128 + 64) and at 1M (128 + 8192; 16 buffer sets cycled, 136 MB: past the L2 as the layers' rows are
// in the model). Also the graph timing both use: `calls` launches captured into one graph, the median
// replay time. Only these two benchmarks include it.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/cuda_test_util.h"

namespace fathom::cuda_test {

constexpr int kAttnBenchHeads = 64, kAttnBenchDim = 512, kAttnBenchWindow = 128, kAttnBenchSel = 512;

struct attn_bench_case {
    const char *what;
    cuda::ds4::comp_mode mode;
    int ratio;
    int64_t n_comp_rows, max_comp, pos;  // compressed rows stored, the most a call may see, the position
    int sets;                            // buffer sets cycled over the calls
    double target_us;                    // the per-call goal printed beside the time
};
inline constexpr attn_bench_case kAttnBenchCases[] = {
    {"ratio 0: 128 rows", cuda::ds4::comp_mode::none, 0, 0, 0, 8191, 1, 10.0},
    {"ratio 4: 128 + 512 selected rows", cuda::ds4::comp_mode::list, 4, 2048, 512, 8191, 1, 10.0},
    {"ratio 128 at 8K: 128 + 64 rows", cuda::ds4::comp_mode::all, 128, 8192, 8192, 8191, 1, 10.0},
    {"ratio 128 at 1M: 128 + 8192 rows", cuda::ds4::comp_mode::all, 128, 8192, 8192, 1048575, 16, 15.0}};

// Compressed rows a call of case c reads (the selection, or every visible row up to max_comp).
inline int64_t attn_bench_comp_rows(const attn_bench_case &c) {
    if (c.mode == cuda::ds4::comp_mode::none) return 0;
    if (c.mode == cuda::ds4::comp_mode::list) return kAttnBenchSel;
    return std::min<int64_t>((c.pos + 1) / c.ratio, c.max_comp);
}

// Contiguous f16 rows (stride = 2 * width bytes) of v, as bytes.
inline std::vector<uint8_t> attn_bench_f16(const std::vector<float> &v) {
    std::vector<uint8_t> b(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
        const uint16_t h = cpu::f32_to_f16(v[i]);
        std::memcpy(b.data() + 2 * i, &h, 2);
    }
    return b;
}

// What every case shares: q [H, d], sinks [H] and o [H, d] on the device, the selection (512 sorted rows
// spread over 2048) and its count, and the ring rows [W, d] (host f16, uploaded once per buffer set).
struct attn_bench_inputs {
    const float *q = nullptr, *sinks = nullptr;
    float *o = nullptr;
    const int32_t *sel = nullptr, *n_sel = nullptr;
    std::vector<uint8_t> ring;
};
// Draws q, sinks, then the ring from rng (in that order).
inline attn_bench_inputs attn_bench_make_inputs(cuda_fixture &f, std::mt19937 &rng) {
    const int H = kAttnBenchHeads, d = kAttnBenchDim;
    attn_bench_inputs in;
    in.q = f.up(randn(static_cast<size_t>(H) * d, rng));
    in.sinks = f.up(randn(H, rng));
    in.o = f.dev<float>(static_cast<size_t>(H) * d);
    std::vector<int32_t> sel(kAttnBenchSel);
    for (int i = 0; i < kAttnBenchSel; ++i) sel[static_cast<size_t>(i)] = 4 * i + 1;  // sorted, over 2048 rows
    in.sel = f.up(sel);
    in.n_sel = f.up(std::vector<int32_t>{kAttnBenchSel});
    in.ring = attn_bench_f16(randn(static_cast<size_t>(kAttnBenchWindow) * d, rng));
    return in;
}

// Case c's c.sets argument sets (each with its own ring copy and, unless ratio 0, its own random
// compressed rows) and their partial buffers (attn_part_floats each, zeroed: the fused combine's
// counters start at zero). Paths default (tensor cores, two launches); the caller may change them.
struct attn_bench_sets {
    std::vector<cuda::ds4::sparse_attn_args> args;
    std::vector<float *> parts;
};
inline attn_bench_sets attn_bench_make_sets(cuda_fixture &f, std::mt19937 &rng, const attn_bench_case &c,
                                            const attn_bench_inputs &in, const cuda::ds4::rope_args &rope) {
    const int d = kAttnBenchDim;
    attn_bench_sets out;
    out.args.resize(static_cast<size_t>(c.sets));
    for (cuda::ds4::sparse_attn_args &a : out.args) {
        a.n_head = kAttnBenchHeads;
        a.d = d;
        a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
        a.sinks = in.sinks;
        a.ring = f.up(in.ring);
        a.ring_f16 = true;
        a.ring_stride = static_cast<size_t>(d) * 2;
        a.window = kAttnBenchWindow;
        a.mode = c.mode;
        if (c.mode != cuda::ds4::comp_mode::none) {
            a.comp = f.up(attn_bench_f16(randn(static_cast<size_t>(c.n_comp_rows) * d, rng)));
            a.comp_f16 = true;
            a.comp_stride = static_cast<size_t>(d) * 2;
            a.ratio = c.ratio;
            a.max_comp = c.max_comp;
            a.sel = in.sel;
            a.n_sel = in.n_sel;
        }
        a.rope = rope;
        out.parts.push_back(f.dev<float>(cuda::ds4::attn_part_floats(a)));
    }
    return out;
}

// Captures `calls` enqueue(i) (i = 0 .. calls - 1) on stream s into one graph and sets ms to the median
// of 21 replays of the whole graph, in milliseconds (a failed CUDA call: a fatal failure, ms left as it
// was).
template <class F>
void attn_bench_time(cudaStream_t s, int calls, F enqueue, float &ms) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamSynchronize(s));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) enqueue(i);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    ms = time_graph(exec, s, 21);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

}  // namespace fathom::cuda_test
