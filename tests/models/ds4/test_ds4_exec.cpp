// DS4 product execution modes (ds4::exec_options, deepseek4_ops.cpp): the thread pool must not change
// a single bit of the reference path; the quantised path (activations quantised to
// cpu::vec_dot_type, cpu::gemm) must stay within the activation-rounding bound of a double-precision
// product of the dequantised weights, for full matrices and row sub-ranges; f32 weights never take it.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "backend/cpu/quants.h"
#include "backend/cpu/thread_pool.h"
#include "golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_ops.h"

namespace {

using namespace fathom;

struct test_matrix {
    std::vector<uint8_t> bytes;
    ds4::matrix m;
};

test_matrix random_matrix(dtype t, int64_t rows, int64_t cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    test_matrix tm;
    const size_t rb = dtype_row_bytes(t, cols);
    tm.bytes.resize(rb * static_cast<size_t>(rows));
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
        for (float &v : row) v = nd(rng);
        cpu::quantize_row(t, row.data(), tm.bytes.data() + static_cast<size_t>(r) * rb, cols);
    }
    tm.m = {t, tm.bytes.data(), rows, cols, rb};
    return tm;
}

// Double-precision W x and the bound on the error the activation rounding may add:
// sum_i |w_i| * max error of x_i in vec_dot_type (q8 types: block amax / 254 + 1 ulp slack; f16: 2^-11 |x_i|).
void reference(const ds4::matrix &w, const std::vector<float> &x, int64_t n, std::vector<double> &y,
               std::vector<double> &bound) {
    const int64_t k = w.cols;
    const dtype vt = cpu::vec_dot_type(w.type);
    const int64_t B = dtype_info(vt).block_size;
    std::vector<float> wr(static_cast<size_t>(k));
    std::vector<double> xerr(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b0 = 0; b0 < k; b0 += B) {
            double amax = 0;
            for (int64_t j = b0; j < b0 + B; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[i * k + j])));
            for (int64_t j = b0; j < b0 + B; ++j)
                xerr[i * k + j] = vt == dtype::f16 ? std::ldexp(std::fabs(x[i * k + j]), -11) : amax / 254.0 * 1.01;
        }
    y.assign(static_cast<size_t>(n * w.rows), 0.0);
    bound.assign(y.size(), 0.0);
    for (int64_t r = 0; r < w.rows; ++r) {
        cpu::dequantize_row(w.type, w.row(r), wr.data(), k);
        for (int64_t i = 0; i < n; ++i) {
            double acc = 0, err = 0, mag = 0;
            for (int64_t c = 0; c < k; ++c) {
                acc += static_cast<double>(wr[c]) * x[i * k + c];
                err += std::fabs(static_cast<double>(wr[c])) * xerr[i * k + c];
                mag += std::fabs(static_cast<double>(wr[c]) * x[i * k + c]);
            }
            y[i * w.rows + r] = acc;
            bound[i * w.rows + r] = err + 1e-5 * mag + 1e-6;  // + f32 accumulation slack
        }
    }
}

class ds4_exec_quantised : public ::testing::TestWithParam<dtype> {};

TEST_P(ds4_exec_quantised, within_activation_rounding_bound) {
    const dtype t = GetParam();
    const int64_t rows = 37, cols = 512, n = 3;
    const auto tm = random_matrix(t, rows, cols, 7);
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(n * cols));
    for (float &v : x) v = nd(rng);
    std::vector<double> yref, bound;
    reference(tm.m, x, n, yref, bound);

    cpu::thread_pool pool(2);
    const ds4::exec_options ex{&pool, true};
    const ds4::exec_scope scope(ex);
    std::vector<float> y(static_cast<size_t>(n * rows));
    ds4::matmul(tm.m, x.data(), n, y.data());
    for (size_t i = 0; i < y.size(); ++i) EXPECT_LE(std::fabs(y[i] - yref[i]), bound[i]) << dtype_name(t) << " " << i;
    // the activations really were quantised: some output differs from the f32-activation product
    double worst = 0;
    for (size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::fabs(y[i] - yref[i]));
    EXPECT_GT(worst, 1e-5);

    // row sub-range [5, 29): same values as the corresponding columns of the full product
    const int64_t r0 = 5, r1 = 29, nr = r1 - r0;
    std::vector<float> ys(static_cast<size_t>(n * nr));
    ds4::matmul_rows(tm.m, r0, r1, x.data(), n, ys.data());
    for (int64_t i = 0; i < n; ++i)
        for (int64_t r = r0; r < r1; ++r)
            EXPECT_NEAR(ys[i * nr + r - r0], yref[i * rows + r], bound[i * rows + r]) << "row " << r;
}

INSTANTIATE_TEST_SUITE_P(ds4, ds4_exec_quantised,
                         ::testing::Values(dtype::q8_0, dtype::q2_k, dtype::iq2_xxs, dtype::q4_k, dtype::f16),
                         [](const auto &info) { return std::string(dtype_name(info.param)); });

TEST(ds4_exec, f32_weights_keep_reference_bits) {
    const auto tm = random_matrix(dtype::f32, 19, 96, 3);
    std::vector<float> x(2 * 96);
    std::iota(x.begin(), x.end(), -50.0f);
    std::vector<float> a(2 * 19), b(2 * 19);
    ds4::matmul(tm.m, x.data(), 2, a.data());
    cpu::thread_pool pool(2);
    const ds4::exec_options ex{&pool, true};
    const ds4::exec_scope scope(ex);
    ds4::matmul(tm.m, x.data(), 2, b.data());
    EXPECT_EQ(a, b);
}

// The pool splits rows only: a whole forward with 2 threads gives the exact bits of the serial one,
// and still meets the golden.
TEST(ds4_exec, threaded_forward_is_bit_identical) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const auto &c = cases[9];
    ASSERT_EQ(c.name, "len67.no_qat");
    const auto m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    std::vector<int64_t> pos(c.tokens.size());
    std::iota(pos.begin(), pos.end(), 0);
    const size_t V = static_cast<size_t>(m->hp.n_vocab);
    std::vector<float> serial(c.tokens.size() * V), threaded(serial.size());
    ds4::state s1 = ds4::new_state(*m, c.qat, kv_precision::f32);
    ds4::forward(*m, s1, c.tokens, pos, {serial, {}});
    cpu::thread_pool pool(2);
    ds4::state s2 = ds4::new_state(*m, c.qat, kv_precision::f32);
    s2.exec = {&pool, true};  // quantised too: the tiny weights are f32, so it must not apply
    ds4::forward(*m, s2, c.tokens, pos, {threaded, {}});
    EXPECT_EQ(serial, threaded);
    EXPECT_TRUE(ds4_test::compare(c, threaded, static_cast<int>(V)).ok);
}

// Expert-batched MoE over a chunk gives every token the bits of the lone-token evaluation
// (hash-routed layer 0 and learned-routing layer 4 of ds4-tiny-a; several tokens share experts).
TEST(ds4_exec, batched_moe_matches_per_token_bits) {
    const auto m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    const int64_t D = m->hp.n_embd, n = 23;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> xn(static_cast<size_t>(n * D));
    for (float &v : xn) v = nd(rng);
    std::vector<int32_t> toks(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) toks[static_cast<size_t>(i)] = static_cast<int32_t>((i * 97 + 3) % 512);
    for (int layer : {0, 4}) {
        const auto &l = m->layers[static_cast<size_t>(layer)];
        std::vector<float> batched(xn.size()), single(xn.size());
        ds4::moe_forward_batch(m->hp, l, xn.data(), toks, batched.data());
        for (int64_t i = 0; i < n; ++i)
            ds4::moe_forward(m->hp, l, &xn[static_cast<size_t>(i * D)], toks[static_cast<size_t>(i)],
                             &single[static_cast<size_t>(i * D)]);
        EXPECT_EQ(batched, single) << "layer " << layer;
        EXPECT_NE(batched, std::vector<float>(xn.size(), 0.0f));
    }
}

}  // namespace
