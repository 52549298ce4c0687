// Shared scaffolding of the CUDA suites (test_cuda_ds4*.cpp and the backend-level ones): the CK
// assertion macro, the fixture bases (skip without a device; stream + device buffers freed at the end of
// a test; CUDA backend vs CPU backend tensor pairs), DS4 expert banks and a random DS4-Flash-shaped MoE
// layer on the device, and the free helpers randn (normal random vectors), rel_l2 (relative L2 error
// against a reference) and time_graph (median graph replay time).
// Suites derive their fixtures from these and keep only their own extras (error word, position, RNG).
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"

// ASSERT that a CUDA runtime call returned cudaSuccess, naming the call and the error.
#define CK(x)                                                               \
    do {                                                                    \
        const cudaError_t e_ = (x);                                         \
        ASSERT_EQ(e_, cudaSuccess) << #x << ": " << cudaGetErrorString(e_); \
    } while (0)

namespace fathom::cuda_test {

// Skips the test without a CUDA device; owns nothing (suites that go through the model or engine API).
class cuda_device_test : public ::testing::Test {
  protected:
    void SetUp() override {
        if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    }
};

// A stream s_ and device buffers freed at the end of a test. Every allocation carries 16 spare bytes
// (the block decoders' funnel-shift loads may read up to 4 bytes past a tensor); contents are zero
// unless uploaded. A derived SetUp calls cuda_fixture::SetUp() first and returns when IsSkipped() or
// HasFatalFailure(). Members are public: free helper functions of the suites drive them.
class cuda_fixture : public cuda_device_test {
  public:
    void SetUp() override {
        cuda_device_test::SetUp();
        if (IsSkipped()) return;
        ASSERT_EQ(cudaStreamCreate(&s_), cudaSuccess);
    }
    void TearDown() override {
        for (void *p : bufs_) cudaFree(p);
        if (s_) cudaStreamDestroy(s_);
    }
    void *raw(size_t bytes) {
        void *p = nullptr;
        if (cudaMalloc(&p, bytes + 16) != cudaSuccess) throw error("test: cudaMalloc failed");
        cudaMemset(p, 0, bytes + 16);
        bufs_.push_back(p);
        return p;
    }
    template <class T>
    T *dev(size_t n) {
        return static_cast<T *>(raw(n * sizeof(T)));
    }
    template <class T>
    T *up(const std::vector<T> &v) {
        T *p = dev<T>(v.size());
        cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
        return p;
    }
    template <class T>
    void put(T *p, const std::vector<T> &v) {
        cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    }
    // A new buffer of n NaNs / n NaNs written over p: an element a kernel fails to write stays NaN.
    float *poisoned(size_t n) { return up(std::vector<float>(n, std::nanf(""))); }
    void poison(float *p, size_t n) { put(p, std::vector<float>(n, std::nanf(""))); }
    // Synchronises s_, then copies n elements back.
    template <class T>
    std::vector<T> down(const T *p, size_t n) {
        std::vector<T> v(n);
        EXPECT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
        return v;
    }
    // A DS4 expert bank of n experts of rows x cols of type t (packed rows, experts back to back)
    // uploaded from the host bytes b.
    cuda::ds4::expert_bank dev_bank(dtype t, const std::vector<uint8_t> &b, int64_t rows, int64_t cols, int64_t n) {
        cuda::ds4::expert_bank e;
        e.type = t;
        e.data = up(b);
        e.row_bytes = dtype_row_bytes(t, cols);
        e.expert_bytes = e.row_bytes * static_cast<size_t>(rows);
        e.n_expert = n;
        e.rows = rows;
        e.cols = cols;
        return e;
    }
    // The same shape over fresh device bytes of random words (launch_fill_random on s_ with seed, the
    // size rounded up to 8 bytes): timing only, block scales may be NaN or Inf.
    cuda::ds4::expert_bank random_bank(dtype t, int64_t rows, int64_t cols, int64_t n, uint64_t seed) {
        cuda::ds4::expert_bank b;
        b.type = t;
        b.row_bytes = dtype_row_bytes(t, cols);
        b.expert_bytes = b.row_bytes * static_cast<size_t>(rows);
        b.n_expert = n;
        b.rows = rows;
        b.cols = cols;
        const size_t bytes = (b.expert_bytes * static_cast<size_t>(n) + 7) / 8 * 8;
        void *p = raw(bytes);
        cuda::ds4::launch_fill_random(p, bytes, seed, s_);
        b.data = p;
        return b;
    }
    // launch_moe_ffn's scratch for E experts of F rows, k used (zeroed device buffers).
    cuda::ds4::moe_scratch dev_moe_scratch(int E, int k, int64_t F) {
        cuda::ds4::moe_scratch sc;
        sc.logits = dev<float>(static_cast<size_t>(E));
        sc.ids = dev<int32_t>(static_cast<size_t>(k));
        sc.weights = dev<float>(static_cast<size_t>(k));
        sc.h = dev<float>(static_cast<size_t>((k + 1) * F));
        return sc;
    }

    cudaStream_t s_ = nullptr;
    std::vector<void *> bufs_;
};

// A host tensor and its CUDA twin holding the same bytes.
struct tensor_pair {
    std::vector<uint8_t> host;
    tensor h, d;
};

// CUDA backend (gpu_) against the CPU backend in exact mode (exact_) on tensors made in pairs; the
// device buffers are released at the end of a test.
class cuda_backend_pair_test : public cuda_device_test {
  protected:
    void SetUp() override {
        cuda_device_test::SetUp();
        if (IsSkipped()) return;
        exact_ = make_cpu_backend({.n_threads = 2, .exact = true});
        gpu_ = make_cuda_backend({});
    }
    void TearDown() override {
        if (gpu_)
            for (void *p : dev_) gpu_->release(p);
    }
    // A tensor of `type` [rows x cols] holding the given raw bytes on both backends.
    tensor_pair make(dtype type, int64_t cols, int64_t rows, const void *bytes) {
        tensor_pair p;
        const size_t nb = dtype_row_bytes(type, cols) * static_cast<size_t>(rows);
        p.host.assign(static_cast<const uint8_t *>(bytes), static_cast<const uint8_t *>(bytes) + nb);
        p.h = make_tensor(type, cols, rows, p.host.data());
        void *dp = gpu_->alloc(nb);
        dev_.push_back(dp);
        p.d = make_tensor(type, cols, rows, dp);
        if (nb) gpu_->upload(p.d, bytes);
        return p;
    }
    tensor_pair make_f32(int64_t cols, int64_t rows, const std::vector<float> &v) {
        return make(dtype::f32, cols, rows, v.data());
    }
    // A NaN-poisoned f32 output pair: an element a kernel fails to write stays NaN.
    tensor_pair out_f32(int64_t cols, int64_t rows) {
        return make_f32(cols, rows, std::vector<float>(static_cast<size_t>(cols * rows), std::nanf("")));
    }
    // The device tensor's f32 contents.
    std::vector<float> down(const tensor &d) {
        std::vector<float> v(static_cast<size_t>(d.ne[0] * d.ne[1]));
        gpu_->download(d, v.data());
        return v;
    }
    // The host tensor's f32 contents.
    static std::vector<float> hostv(const tensor_pair &p) {
        const float *f = reinterpret_cast<const float *>(p.host.data());
        return std::vector<float>(f, f + p.h.ne[0] * p.h.ne[1]);
    }

    std::unique_ptr<backend> exact_;
    std::unique_ptr<cuda_backend_api> gpu_;
    std::vector<void *> dev_;
};

// The attention parameters of a dense attention test case c (fields n_head, n_head_kv, hd, n_ctx,
// n_past, softcap, window), scale 1 / sqrt(hd).
template <class Case>
attn_params attn_params_of(const Case &c) {
    attn_params p;
    p.n_head = c.n_head;
    p.n_head_kv = c.n_head_kv;
    p.head_dim = c.hd;
    p.n_ctx = c.n_ctx;
    p.n_past = c.n_past;
    p.scale = 1.0f / std::sqrt(static_cast<float>(c.hd));
    p.softcap = c.softcap;
    p.window = c.window;
    return p;
}

// n draws of N(mean, sd^2) from rng.
inline std::vector<float> randn(size_t n, std::mt19937 &rng, float sd = 1.0f, float mean = 0.0f) {
    std::normal_distribution<float> nd(mean, sd);
    std::vector<float> v(n);
    for (auto &x : v) x = nd(rng);
    return v;
}

// ||a - b|| / ||b|| over n elements, in double (NaN in a gives NaN: fails any <= bound).
inline double rel_l2(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
        const double d = static_cast<double>(a[i]) - b[i];
        num += d * d;
        den += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}
// The same over two vectors, which must have equal sizes (checked; the shorter length is compared).
inline double rel_l2(const std::vector<float> &a, const std::vector<float> &b) {
    EXPECT_EQ(a.size(), b.size());
    return rel_l2(a.data(), b.data(), std::min(a.size(), b.size()));
}
// f32 results against a double reference: the first ref.size() elements of got.
inline double rel_l2(const std::vector<float> &got, const std::vector<double> &ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double d = static_cast<double>(got[i]) - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

// A DS4-Flash-shaped MoE layer for timing on f's device: f16 router [E, D] (N(0, 0.03^2)) and expert
// biases (N(0, 0.1^2)) drawn from rng, k of E experts used, weights scale 1.5, clamps 10, and the q2
// mix of random banks (random_bank: iq2_xxs gate / up [F, D], q2_k down [D, F], q8_0 shared expert)
// from seeds seed + 1 .. seed + 6.
inline cuda::ds4::moe_layer random_q2_moe_layer(cuda_fixture &f, std::mt19937 &rng, int64_t D, int64_t F, int E, int k,
                                                uint64_t seed) {
    cuda::ds4::moe_layer l;
    std::vector<uint16_t> router(static_cast<size_t>(E * D));
    for (auto &v : router) v = cpu::f32_to_f16(std::normal_distribution<float>(0.0f, 0.03f)(rng));
    l.gate_inp_type = dtype::f16;
    l.gate_inp = f.up(router);
    l.gate_inp_row_bytes = static_cast<size_t>(D) * 2;
    l.exp_bias = f.up(randn(static_cast<size_t>(E), rng, 0.1f));
    l.n_expert = E;
    l.n_used = k;
    l.weights_scale = 1.5f;
    l.clamp = 10.0f;
    l.clamp_sh = 10.0f;
    l.gate = f.random_bank(dtype::iq2_xxs, F, D, E, seed + 1);
    l.up = f.random_bank(dtype::iq2_xxs, F, D, E, seed + 2);
    l.down = f.random_bank(dtype::q2_k, D, F, E, seed + 3);
    l.gate_sh = f.random_bank(dtype::q8_0, F, D, 1, seed + 4);
    l.up_sh = f.random_bank(dtype::q8_0, F, D, 1, seed + 5);
    l.down_sh = f.random_bank(dtype::q8_0, D, F, 1, seed + 6);
    return l;
}

// Median of `reps` replays of graph g on stream s (after two warm-up replays), in milliseconds.
inline float time_graph(cudaGraphExec_t g, cudaStream_t s, int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ms;
    cudaGraphLaunch(g, s);
    cudaGraphLaunch(g, s);
    for (int i = 0; i < reps; ++i) {
        cudaEventRecord(a, s);
        cudaGraphLaunch(g, s);
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float t = 0;
        cudaEventElapsedTime(&t, a, b);
        ms.push_back(t);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

}  // namespace fathom::cuda_test
