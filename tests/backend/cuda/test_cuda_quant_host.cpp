// The CUDA kernels' GGUF block decoding (cuda_quant.cuh, compiled here for the host) against the
// CPU backend's dequantize_row, for every type the CUDA backend supports. Runs without a GPU, so
// CI checks the device layouts too: every element of every 16-weight unit must land on the
// position and value the CPU reference gives.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_quant.cuh"

namespace fathom::cuda {
namespace {

template <dtype T>
void check_type(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)));
    std::mt19937 rng(static_cast<unsigned>(T) + 1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> f(static_cast<size_t>(K));
    for (auto &x : f) x = nd(rng);
    std::vector<uint8_t> q(dtype_row_bytes(T, K));
    cpu::quantize_row(T, f.data(), q.data(), K);
    std::vector<float> ref(static_cast<size_t>(K)), got(static_cast<size_t>(K), std::nanf(""));
    cpu::dequantize_row(T, q.data(), ref.data(), K);
    std::vector<int> hits(static_cast<size_t>(K), 0);
    for (int64_t u = 0; u < K / 16; ++u) {
        float w[16];
        int64_t s0, s1;
        decode_unit<T>(q.data(), u, w, s0, s1);
        ASSERT_TRUE(s0 >= 0 && s0 + 8 <= K && s1 >= 0 && s1 + 8 <= K);
        for (int i = 0; i < 8; ++i) {
            got[static_cast<size_t>(s0 + i)] = w[i];
            got[static_cast<size_t>(s1 + i)] = w[8 + i];
            ++hits[static_cast<size_t>(s0 + i)];
            ++hits[static_cast<size_t>(s1 + i)];
        }
    }
    for (int64_t i = 0; i < K; ++i) {
        ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "element " << i;
        ASSERT_EQ(got[static_cast<size_t>(i)], ref[static_cast<size_t>(i)]) << "element " << i;
    }
}

TEST(CudaQuantHost, UnitsCoverRowsAndMatchCpuDequantisation) {
    check_type<dtype::f32>(512);
    check_type<dtype::f16>(512);
    check_type<dtype::bf16>(512);
    check_type<dtype::q4_0>(512);
    check_type<dtype::q4_1>(512);
    check_type<dtype::q5_0>(512);
    check_type<dtype::q5_1>(512);
    check_type<dtype::q8_0>(512);
    check_type<dtype::q2_k>(512);
    check_type<dtype::q3_k>(512);
    check_type<dtype::q4_k>(512);
    check_type<dtype::q5_k>(512);
    check_type<dtype::q6_k>(512);
}

// Q2_K / Q3_K blocks of uniformly random bytes (every scale, min, hmask and code pattern; the f16
// block scales replaced by finite values of either sign): positions and values bit for bit.
template <dtype T>
void check_random_bytes(int64_t K) {
    SCOPED_TRACE(std::string(dtype_name(T)) + " random bytes");
    std::mt19937 rng(static_cast<unsigned>(T) + 77);
    std::vector<uint8_t> q(dtype_row_bytes(T, K));
    for (auto &b : q) b = static_cast<uint8_t>(rng() >> 24);
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    const size_t bs = dtype_info(T).type_size;
    for (size_t off = 0; off < q.size(); off += bs)
        for (size_t at : T == dtype::q2_k ? std::vector<size_t>{80, 82} : std::vector<size_t>{108}) {
            const uint16_t h = cpu::f32_to_f16(ud(rng) * 0.01f * ((rng() & 1) ? -1.0f : 1.0f));
            std::memcpy(&q[off + at], &h, 2);
        }
    std::vector<float> ref(static_cast<size_t>(K));
    cpu::dequantize_row(T, q.data(), ref.data(), K);
    std::vector<int> hits(static_cast<size_t>(K), 0);
    for (int64_t u = 0; u < K / 16; ++u) {
        float w[16];
        int64_t s0, s1;
        decode_unit<T>(q.data(), u, w, s0, s1);
        ASSERT_TRUE(s0 >= 0 && s0 + 8 <= K && s1 >= 0 && s1 + 8 <= K);
        for (int i = 0; i < 16; ++i) {
            const int64_t e = (i < 8 ? s0 : s1) + (i & 7);
            ++hits[static_cast<size_t>(e)];
            uint32_t a, b;
            std::memcpy(&a, &w[i], 4);
            std::memcpy(&b, &ref[static_cast<size_t>(e)], 4);
            ASSERT_EQ(a, b) << "element " << e << ": " << w[i] << " vs " << ref[static_cast<size_t>(e)];
        }
    }
    for (int64_t i = 0; i < K; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "element " << i;
}

TEST(CudaQuantHost, Q2kQ3kUnitsOfRandomBytesMatchCpuDequantisation) {
    check_random_bytes<dtype::q2_k>(1024);
    check_random_bytes<dtype::q3_k>(1024);
}

}  // namespace
}  // namespace fathom::cuda
