// Shared by tests/backend/cuda/test_cuda_ds4_gemv.cpp and bench/cuda/bench_ds4_gemv.cpp:
// the suite's fixture and the helpers it needs. Test-only: src/ never includes it.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_gemv_testing.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_quant.cuh"
#include "backend/cuda/ktrace.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace fathom::cuda_test::ds4_gemv_suite {

namespace cd = cuda::ds4;
using cuda_test::randn;
using cuda_test::rel_l2;
using cuda_test::time_graph;

// A weight in GGUF form on the host: rows of dtype_row_bytes(t, cols) bytes placed `stride` bytes
// apart (stride >= the row bytes; the gap bytes are random), and its dequantised values.
struct host_weight {
    dtype t;
    int64_t rows, cols;
    size_t stride;
    std::vector<uint8_t> bytes;
    std::vector<float> deq;  // [rows, cols]
};
inline host_weight make_weight(dtype t, int64_t rows, int64_t cols, size_t pad, std::mt19937 &rng) {
    host_weight w{t, rows, cols, dtype_row_bytes(t, cols) + pad, {}, {}};
    w.bytes.resize(w.stride * static_cast<size_t>(rows));
    for (auto &b : w.bytes) b = static_cast<uint8_t>(rng() >> 24);
    const auto f = randn(static_cast<size_t>(rows * cols), rng, 0.5f);
    w.deq.resize(f.size());
    for (int64_t r = 0; r < rows; ++r) {
        uint8_t *row = w.bytes.data() + w.stride * static_cast<size_t>(r);
        cpu::quantize_row(t, f.data() + r * cols, row, cols);
        cpu::dequantize_row(t, row, w.deq.data() + r * cols, cols);
    }
    return w;
}
// ref[r] = deq row r . x[r / rpg], in double.
inline std::vector<double> reference(const host_weight &w, const std::vector<float> &x, int64_t rpg) {
    std::vector<double> y(static_cast<size_t>(w.rows));
    for (int64_t r = 0; r < w.rows; ++r) {
        const float *a = w.deq.data() + r * w.cols, *b = x.data() + (r / rpg) * w.cols;
        double s = 0;
        for (int64_t k = 0; k < w.cols; ++k) s += static_cast<double>(a[k]) * b[k];
        y[static_cast<size_t>(r)] = s;
    }
    return y;
}

// The int8-activation result: x group by group in 32-element q8 blocks (ds4q::quantize_q8_block, the
// rounding the kernel and the MoE staging use), then deq_w . q_x * d_x per block in double (deq_w =
// d_w * q_w is exact in f32, so this is d_w * d_x * the integer sum, exactly). f16 / f32 weights keep
// f32 x (reference()).
inline std::vector<double> reference_q8x(const host_weight &w, const std::vector<float> &x, int64_t rpg) {
    if (w.t != dtype::q8_0) return reference(w, x, rpg);
    const int64_t nb = w.cols / 32, groups = static_cast<int64_t>(x.size()) / w.cols;
    std::vector<cuda::ds4q::q8_blk> xb(static_cast<size_t>(groups * nb));
    for (int64_t b = 0; b < groups * nb; ++b)
        cuda::ds4q::quantize_q8_block(x.data() + 32 * b, xb[static_cast<size_t>(b)]);
    std::vector<double> y(static_cast<size_t>(w.rows));
    for (int64_t r = 0; r < w.rows; ++r) {
        const float *a = w.deq.data() + r * w.cols;
        const cuda::ds4q::q8_blk *xg = xb.data() + (r / rpg) * nb;
        double s = 0;
        for (int64_t b = 0; b < nb; ++b) {
            double t = 0;
            for (int j = 0; j < 32; ++j)
                t += static_cast<double>(a[32 * b + j]) *
                     static_cast<int8_t>(static_cast<uint32_t>(xg[b].qs[j / 4]) >> (8 * (j % 4)));
            s += t * static_cast<double>(xg[b].d);
        }
        y[static_cast<size_t>(r)] = s;
    }
    return y;
}
// cuda_fixture's stream and buffers (16 spare bytes after every buffer; contents 0 unless uploaded).
class CudaDs4Gemv : public cuda_test::cuda_fixture {
  protected:
    // Uploads w's GGUF rows and prepares them (synchronised: see the PDL note in ds4_gemv.h).
    cd::gemv_weight prepare(const host_weight &w) {
        const void *src = up(w.bytes);
        const size_t n = cd::gemv_prepared_bytes(w.t, w.rows, w.cols);
        void *dst = n ? raw(n) : nullptr;
        const cd::gemv_weight g = cd::gemv_prepare(w.t, src, w.stride, w.rows, w.cols, dst, s_);
        EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        return g;
    }

    // The reference for a one-weight launch (rpg rows per x group): int8 activations when the launch
    // takes that kernel (under the current set_gemv_q8_activations switch).
    static std::vector<double> expected(const host_weight &w, const cd::gemv_weight &g,
                                        const std::vector<float> &x, int64_t rpg) {
        const cd::gemv_segment seg{g, nullptr};
        return cd::gemv_q8_activations_used(&seg, &rpg, 1) ? reference_q8x(w, x, rpg) : reference(w, x, rpg);
    }
    void TearDown() override {
        cd::set_gemv_q8_activations(true);
        cd::set_gemv_tensor_cores(true);
        cd::set_gemv_mma_slots(4);
        cuda_fixture::TearDown();
    }

    std::mt19937 rng_{20261129};
};

}  // namespace fathom::cuda_test::ds4_gemv_suite
