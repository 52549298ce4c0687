// DS4 with non-f32 weights: ds4-tiny-a rewritten with F16 (all tensors) or Q8_0 (every matrix and
// expert bank whose rows are a multiple of 32) must give exactly the logits of an f32 file holding
// the same dequantised values. This checks row strides, expert offsets and the dequantising paths
// of the loader and matmul, independent of the quantisation error itself.
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>

#include "backend/cpu/quants.h"
#include "golden_util.h"
#include "models/deepseek4.h"
#include "rewrite_util.h"

namespace {

using namespace fathom;

// Which tensors to re-type: never the I32 hash table; Q8_0 only where ne0 fits its 32-blocks and not
// for the small parameter tensors (vectors and APE tables, which the loader requires as f32/f16/bf16).
bool convert(const gguf::tensor_info &t, dtype to) {
    if (t.type != dtype::f32) return false;
    if (to == dtype::q8_0)  // compressor APE is a parameter table, not a matrix
        return t.n_dims >= 2 && t.ne[0] % 32 == 0 &&
               std::string_view(t.name).find("_ape.") == std::string_view::npos;
    return true;
}

// as_type = true: store in `to`; false: store f32 holding dequantise(quantise(x)).
ds4_test::tensor_out retype(const gguf::tensor_info &t, dtype to, bool as_type) {
    ds4_test::tensor_out o = ds4_test::copy_tensor(t);
    if (!convert(t, to)) return o;
    const int64_t row = t.ne[0], rows = t.nelements() / row;
    const size_t qrow = dtype_row_bytes(to, row);
    std::vector<uint8_t> q(qrow * static_cast<size_t>(rows));
    std::vector<float> src(static_cast<size_t>(t.nelements()));
    std::memcpy(src.data(), t.data, src.size() * sizeof(float));
    for (int64_t r = 0; r < rows; ++r)
        cpu::quantize_row(to, &src[static_cast<size_t>(r * row)], &q[static_cast<size_t>(r) * qrow], row);
    if (as_type) {
        o.type = to;
        o.bytes = std::move(q);
    } else {
        for (int64_t r = 0; r < rows; ++r)
            cpu::dequantize_row(to, &q[static_cast<size_t>(r) * qrow], &src[static_cast<size_t>(r * row)],
                                row);
        std::memcpy(o.bytes.data(), src.data(), o.bytes.size());
    }
    return o;
}

std::vector<float> eval(const std::string &path, const ds4_test::golden_case &c) {
    const auto m = ds4::load_model(path);
    ds4::state st = ds4::new_state(*m, c.qat, kv_precision::f32);
    std::vector<float> logits(c.tokens.size() * static_cast<size_t>(m->hp.n_vocab));
    std::vector<int64_t> pos(c.tokens.size());
    std::iota(pos.begin(), pos.end(), 0);
    ds4::forward(*m, st, c.tokens, pos, {logits, {}});
    return logits;
}

double max_abs_diff(const std::vector<float> &a, const std::vector<float> &b) {
    double d = 0;
    for (size_t i = 0; i < a.size(); ++i) d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
    return d;
}

class quantised : public ::testing::TestWithParam<dtype> {};

TEST_P(quantised, matches_f32_with_same_values) {
    const dtype to = GetParam();
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const auto &c = cases[9];  // len67.no_qat: ratio-4 rows and indexer active, window wrapped
    ASSERT_EQ(c.name, "len67.no_qat");
    const std::string name(dtype_name(to));
    const std::string qpath =
        ds4_test::rewrite_tiny(name + "_q", {}, [&](const auto &t) { return retype(t, to, true); });
    const std::string fpath =
        ds4_test::rewrite_tiny(name + "_f", {}, [&](const auto &t) { return retype(t, to, false); });
    const auto lq = eval(qpath, c), lf = eval(fpath, c);
    EXPECT_EQ(max_abs_diff(lq, lf), 0.0) << name;
    // the quantisation really happened (logits moved away from the f32 golden model's)
    EXPECT_GT(max_abs_diff(lq, eval(ds4_test::golden_dir() + "/ds4-tiny-a.gguf", c)), 1e-5) << name;
    std::filesystem::remove(qpath);
    std::filesystem::remove(fpath);
}

INSTANTIATE_TEST_SUITE_P(ds4, quantised, ::testing::Values(dtype::f16, dtype::q8_0),
                         [](const auto &info) { return std::string(dtype_name(info.param)); });

}  // namespace
