// DS4 split over CUDA stages through the public engine API (dist_options::devices;
// src/engine/ds4_engine.cpp over dist::local_pipeline with stage_device): on the ds4-tiny golden
// model,
//  - "cuda:0,cuda:0" and "cuda:0,cuda:0,cuda:0" (stages on one GPU) and, with two GPUs,
//    "cuda:0,cuda:1" give the one-GPU engine's logits bit for bit over a whole conversation
//    (tests/dist/conversation_util.h: prefill, decode, prefix reuse, truncation, reset, all-token
//    logits), since the HC state crosses stages as host f32;
//  - a split CUDA engine and a mixed "cpu,cuda:0" engine meet the official golden logits (each range
//    with its own device's numerics, so the golden tier rather than bits);
//  - the layout names the devices;
//  - session::sample on one GPU (the device logits summary, sampler::sample_top) draws what the host
//    sampler draws from the downloaded logits, penalties and logprobs included.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "dist/conversation_util.h"
#include "models/ds4/golden_util.h"
#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "backend/cuda/cuda_test_util.h"

namespace fathom {
namespace {

using dist_test::conversation;
using dist_test::poisoned;
using dist_test::same_bits;

using CudaDs4Devices = cuda_test::cuda_device_test;

std::unique_ptr<engine> load(const std::string &device, const std::string &devices, const std::string &qat,
                             kv_precision kv) {
    engine_options o;
    o.model_path = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
    o.n_threads = 4;
    o.n_ctx = 1024;
    o.kv = kv;
    o.ds4_qat = qat;
    o.device = device;
    o.dist.devices = devices;
    return engine::load(o);
}

TEST_F(CudaDs4Devices, StagesEqualOneGpuBitForBit) {
    std::vector<std::string> lists = {"cuda:0,cuda:0", "cuda:0,cuda:0,cuda:0"};
    if (cuda_device_count() >= 2) lists.push_back("cuda:0,cuda:1");
    for (kv_precision kv : {kv_precision::f16, kv_precision::f32}) {
        const auto want = conversation(*load("cuda:0", "", "full", kv));
        for (const auto &devices : lists) {
            auto e = load("cpu", devices, "full", kv);
            EXPECT_EQ(e->info().device.rfind("pipeline: cuda:0 (", 0), 0u) << e->info().device;
            const auto got = conversation(*e);
            EXPECT_TRUE(same_bits(want, got)) << devices << (kv == kv_precision::f32 ? " f32" : " f16") << " KV";
        }
    }
}

TEST_F(CudaDs4Devices, SplitAndMixedMeetTheGolden) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const ds4_test::golden_case *c = nullptr;
    for (const auto &k : cases)
        if (k.name == "len67.no_qat") c = &k;
    ASSERT_NE(c, nullptr);
    for (const std::string devices : {"cuda:0,cuda:0", "cpu,cuda:0", "cuda:0,cpu"}) {
        auto e = load("cpu", devices, "off", kv_precision::f32);
        const size_t V = static_cast<size_t>(e->info().n_vocab);
        auto s = e->new_session();
        std::vector<float> logits = poisoned(c->tokens.size() * V);
        s->eval(c->tokens, logits.data());
        const auto v = ds4_test::compare(*c, logits, static_cast<int>(V));
        EXPECT_TRUE(v.ok) << devices << ": " << v.why;
        std::printf("  %-14s %s: max e_p %.3g  median e_p %.3g\n", devices.c_str(), e->info().device.c_str(), v.max_e,
                    v.median_e);
    }
}

TEST_F(CudaDs4Devices, DeviceSamplingEqualsHostSampling) {
    auto e = load("cuda:0", "", "full", kv_precision::f16);
    auto a = e->new_session(), b = e->new_session();
    EXPECT_TRUE(a->samples_on_device());
    std::vector<int32_t> prompt;
    for (int i = 0; i < 90; ++i) prompt.push_back((i * 37 + 11) % e->info().n_vocab);
    for (const float temp : {0.0f, 0.9f}) {
        sampling_params p;
        p.temperature = temp;
        p.top_k = 30;
        p.repeat_penalty = 1.2f;
        p.frequency_penalty = 0.1f;
        p.n_logprobs = 3;
        p.seed = 5;
        sampler sa(p), sb(p);
        a->sync(prompt);
        b->sync(prompt);
        std::vector<int32_t> hist = prompt;
        for (int step = 0; step < 40; ++step) {
            const sample_result ra = a->sample(sa, hist);  // device summary
            const sample_result rb = sb.sample(b->logits(), hist);  // host, every logit
            ASSERT_EQ(ra.token, rb.token) << "temperature " << temp << " step " << step;
            EXPECT_NEAR(ra.logprob, rb.logprob, 1e-5);
            ASSERT_EQ(ra.top.size(), rb.top.size());
            for (size_t i = 0; i < rb.top.size(); ++i) EXPECT_EQ(ra.top[i].token, rb.top[i].token);
            a->eval(std::span<const int32_t>(&ra.token, 1));
            b->eval(std::span<const int32_t>(&rb.token, 1));
            hist.push_back(ra.token);
        }
    }
}

}  // namespace
}  // namespace fathom
