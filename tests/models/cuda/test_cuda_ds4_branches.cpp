// The decode step's parallel attention branches (models/cuda/deepseek4_cuda.cpp enqueue_attention: KV row + compressor
// and indexer on side streams beside the query path, forked and joined with events, captured as
// parallel graph branches) against the serial step (deepseek4_cuda_testing.h:
// cuda_test_options::serial_step): the same kernels on the same inputs, so every logit must be
// BIT-identical; any difference is a missing or misplaced fork / join (a branch reading a buffer
// before it is written, or the next layer overwriting one a branch still reads).
//
// Each variant decodes the same tokens step by step, through the captured graph and eagerly; test
// variants pause the side streams (exposes a missing join: the attention or the next layer's
// projections would run before a branch finishes) or the query path (exposes the indexer branch
// reading the indexer query before the q_b GEMV wrote it) by tens of microseconds per layer.
// Depths: positions 0..299 of a 5-layer model with ratios 0, 0, 4, 128, 4 and a 32-row window (raw
// ring wraps, ratio-4 and ratio-128 rows emitted, more indexer rows than its top-k 16), and steps
// after fill_synthetic at 5116..5125 (ratio-4 rows at 5119 / 5123, a ratio-128 row at 5119, 1279
// indexer rows to score), the first of them through profile_step (always serial) on every variant.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_testing.h"
#include "models/deepseek4.h"
#include "backend/cuda/cuda_test_util.h"
#include "ds4_host_util.h"

namespace fathom {
namespace {

using cuda_test::tokens_of;

using CudaDs4Branches = cuda_test::cuda_device_test;

// The layout of test_cuda_ds4_model.cpp's quantised model (its own file: suites may run in parallel).
const std::string &branch_model_path() {
    static const std::string path = cuda_test::write_quant_tiny_model("fathom_cuda_ds4_branches_q2.gguf");
    return path;
}

struct variant {
    const char *name;
    bool serial, graph;
    int64_t delay_ns;  // cuda_testing::cuda_test_options::branch_delay_ns
};
// The first is the reference.
const variant variants[] = {
    {"serial, eager", true, false, 0},
    {"serial, graph", true, true, 0},
    {"branched, eager", false, false, 0},
    {"branched, graph", false, true, 0},
    {"branched, eager, side streams paused", false, false, 50'000},
    {"branched, eager, query path paused", false, false, -50'000},
    {"branched, graph, side streams paused", false, true, 50'000},
    {"branched, graph, query path paused", false, true, -50'000},
};

struct run_result {
    std::vector<float> logits;  // [steps, n_vocab], NaN where a step wrote nothing
    uint64_t replays = 0;
};

// Decodes toks one step at a time from depth (0: an empty sequence; otherwise fill_synthetic(depth)
// first, and the first token through profile_step), keeping every step's logits.
run_result decode(const ds4::model &m, ds4::cuda_run_options o, const variant &v, const std::vector<int32_t> &toks,
                  int64_t depth) {
    ds4::cuda_testing::cuda_test_options t;
    t.serial_step = v.serial;
    t.branch_delay_ns = v.delay_ns;
    auto w = ds4::cuda_testing::cuda_upload(m, o, t);
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    ds4::cuda_sequence seq(w, depth + static_cast<int64_t>(toks.size()) + 1, v.graph, 0);
    run_result r;
    r.logits.assign(toks.size() * V, std::nanf(""));
    size_t i = 0;
    if (depth > 0) {
        ds4::cuda_testing::fill_synthetic(seq, depth, 17);
        const auto phases = ds4::cuda_testing::profile_step(seq, toks[0]);
        float total = 0;
        bool topk = false;
        for (const auto &[name, ms] : phases) total += ms, topk = topk || name == "indexer top-k";
        EXPECT_TRUE(topk) << v.name << ": profile_step lost the indexer top-k phase";
        EXPECT_GT(total, 0.0f) << v.name;
        ++i;  // profile_step keeps no logits: step 0 stays NaN in every variant
    }
    for (; i < toks.size(); ++i) seq.eval(std::span(&toks[i], 1), std::span(r.logits).subspan(i * V, V));
    EXPECT_EQ(seq.n_past(), depth + static_cast<int64_t>(toks.size()));
    r.replays = ds4::cuda_testing::graph_replays(seq);
    return r;
}

// Every variant's logits equal the reference's bit for bit (NaN slots included: memcmp).
void expect_variants_identical(const ds4::model &m, const ds4::cuda_run_options &o, const std::vector<int32_t> &toks,
                               int64_t depth, const char *what) {
    const size_t V = static_cast<size_t>(m.hp.n_vocab), n = toks.size();
    const size_t first = depth > 0 ? 1 : 0;  // profile_step's token has no logits
    const run_result ref = decode(m, o, variants[0], toks, depth);
    size_t finite = 0;
    for (size_t k = first * V; k < n * V; ++k) finite += std::isfinite(ref.logits[k]);
    ASSERT_EQ(finite, (n - first) * V) << what << ": the reference has unwritten or non-finite logits";
    for (const variant &v : variants) {
        if (&v == &variants[0]) continue;
        const run_result got = decode(m, o, v, toks, depth);
        EXPECT_EQ(got.replays, v.graph ? n - first : 0u) << what << ", " << v.name;
        size_t bad_steps = 0, first_bad = n;
        for (size_t i = 0; i < n; ++i) {
            if (std::memcmp(&got.logits[i * V], &ref.logits[i * V], V * sizeof(float)) != 0) {
                ++bad_steps;
                if (first_bad == n) first_bad = i;
            }
        }
        EXPECT_EQ(bad_steps, 0u) << what << ", " << v.name << ": " << bad_steps << " steps differ from the serial step, first at position "
                                 << depth + static_cast<int64_t>(first_bad);
        std::printf("  %-10s %-40s %zu steps from position %lld: %s\n", what, v.name, n, static_cast<long long>(depth),
                    bad_steps == 0 ? "bitwise identical" : "DIFFERENT");
    }
}

TEST_F(CudaDs4Branches, BranchedDecodeMatchesSerialBitwiseFromPositionZero) {
    auto m = ds4::load_model(branch_model_path());
    const auto toks = tokens_of(300, m->hp.n_vocab, 3);
    ds4::cuda_run_options full;  // QAT full, f16 KV, tensor-core indexer
    expect_variants_identical(*m, full, toks, 0, "qat full");
    ds4::cuda_run_options off;
    off.qat = ds4::qat_mode::off;
    off.kv = kv_precision::f32;
    off.exact_indexer = true;
    expect_variants_identical(*m, off, toks, 0, "qat off");
}

TEST_F(CudaDs4Branches, BranchedDecodeMatchesSerialBitwiseDeep) {
    auto m = ds4::load_model(branch_model_path());
    const auto toks = tokens_of(10, m->hp.n_vocab, 9);
    expect_variants_identical(*m, ds4::cuda_run_options{}, toks, 5116, "deep");
}

}  // namespace
}  // namespace fathom
