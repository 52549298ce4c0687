// Shared scaffolding of the DS4 CUDA suites (test_cuda_ds4*.cpp): the CK assertion macro, the fixture
// bases (skip without a device; stream + device buffers freed at the end of a test) and the free
// helpers randn (normal random vectors), rel_l2 (relative L2 error against a reference) and time_graph
// (median graph replay time).
// Suites derive their fixtures from these and keep only their own extras (error word, position, RNG).
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "backend/cuda/cuda_backend.h"
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

    cudaStream_t s_ = nullptr;
    std::vector<void *> bufs_;
};

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
