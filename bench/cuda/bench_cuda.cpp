// Decode GEMV bandwidth on the CUDA backend for SmolLM2-135M (and two Gemma3-270M) shapes, against the device's measured
// copy bandwidth. Each weight is replicated until the copies span 256 MiB (several times the L2),
// and a CUDA graph of one GEMV per copy is replayed, so every GEMV streams its weight from HBM and
// launch overhead is amortised. Prints one line per (shape, type). Usage: bench_cuda [reps]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"

using namespace fathom;

namespace {

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));             \
            std::exit(1);                                                              \
        }                                                                              \
    } while (0)

// Milliseconds taken by fn() on the backend stream, measured with events.
template <class F>
float time_ms(cuda_backend_api &b, F &&fn) {
    auto s = static_cast<cudaStream_t>(b.stream());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, s));
    fn();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms;
}

double copy_bandwidth(cuda_backend_api &b) {
    const size_t n = size_t{1} << 30;
    void *src = b.alloc(n), *dst = b.alloc(n);
    auto s = static_cast<cudaStream_t>(b.stream());
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s));
    const int reps = 10;
    const float ms = time_ms(b, [&] {
        for (int i = 0; i < reps; ++i) CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s));
    });
    b.release(src);
    b.release(dst);
    return 2.0 * static_cast<double>(n) * reps / (ms * 1e-3) / 1e9;  // bytes read + written
}

}  // namespace

int main(int argc, char **argv) {
    if (!cuda_device_available()) {
        std::printf("bench_cuda: no CUDA device\n");
        return 0;
    }
    const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
    auto gpu = make_cuda_backend({});
    const double copy_gbs = copy_bandwidth(*gpu);
    std::printf("device copy bandwidth (read+write): %.0f GB/s\n", copy_gbs);

    struct shape {
        const char *name;
        int64_t n, k;
    };
    const shape shapes[] = {{"attn_q/o 576x576", 576, 576}, {"attn_k/v 192x576", 192, 576},
                            {"ffn_gate/up 1536x576", 1536, 576}, {"ffn_down 576x1536", 576, 1536},
                            {"lm_head 49152x576", 49152, 576},
                            // Gemma3-270M: the K = 2048 down projection admits k-quants.
                            {"g3 ffn_down 640x2048", 640, 2048}, {"g3 lm_head 262144x640", 262144, 640}};
    const dtype types[] = {dtype::q4_1, dtype::q8_0, dtype::q5_0, dtype::q4_k, dtype::q6_k, dtype::f16};
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    float *x = static_cast<float *>(gpu->alloc(2048 * 4 * 8));
    float *y = static_cast<float *>(gpu->alloc(262144 * 4 * 8));
    std::printf("%-22s %-5s %2s %10s %9s %9s %7s\n", "shape", "type", "M", "bytes", "us/gemv", "GB/s", "%copy");
    for (const shape &sh : shapes) {
        for (dtype t : types) {
            if (sh.k % dtype_info(t).block_size != 0) continue;
            std::vector<float> f(static_cast<size_t>(sh.k));
            const size_t rb = dtype_row_bytes(t, sh.k), bytes = rb * static_cast<size_t>(sh.n);
            std::vector<uint8_t> host(bytes);
            for (int64_t r = 0; r < sh.n; ++r) {
                for (auto &v : f) v = nd(rng);
                cpu::quantize_row(t, f.data(), host.data() + rb * r, sh.k);
            }
            const size_t copies = std::min<size_t>(2048, ((size_t{256} << 20) + bytes - 1) / bytes);
            std::vector<tensor> ws;
            for (size_t c = 0; c < copies; ++c) {
                ws.push_back(make_tensor(t, sh.k, sh.n, gpu->alloc(bytes)));
                gpu->upload(ws.back(), host.data());
            }
            for (int64_t M : {1, 4}) {
                const tensor xt = make_tensor(dtype::f32, sh.k, M, x), yt = make_tensor(dtype::f32, sh.n, M, y);
                const tensor *o[] = {&yt};
                auto all = [&] {
                    for (const tensor &w : ws) {
                        const tensor *wp[] = {&w};
                        gpu->mul_mat(xt, 1, wp, o);
                    }
                };
                all();  // warm-up, eager
                gpu->synchronize();
                const float eager_ms = time_ms(*gpu, all);
                gpu->capture_begin();
                all();
                const int g = gpu->capture_end();
                gpu->graph_launch(g);
                const float ms = time_ms(*gpu, [&] {
                    for (int r = 0; r < reps; ++r) gpu->graph_launch(g);
                });
                const double us = ms * 1e3 / (reps * static_cast<double>(copies));
                const double gbs = static_cast<double>(bytes) / (us * 1e-6) / 1e9;
                std::printf("%-22s %-5s %2lld %10zu %9.2f %9.0f %6.0f%%   (eager %.2f us)\n", sh.name,
                            std::string(dtype_name(t)).c_str(), static_cast<long long>(M), bytes, us, gbs,
                            100.0 * gbs / copy_gbs, eager_ms * 1e3 / static_cast<double>(copies));
            }
            gpu->synchronize();
            for (const tensor &w : ws) gpu->release(w.data);
        }
    }
    return 0;
}
