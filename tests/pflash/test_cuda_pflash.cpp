// The PFlash drafter on a GPU (src/pflash/drafter.cpp with device "cuda") against the same drafter on
// the CPU, the reference (tests/pflash check it against hand-worked scores and llama.cpp-exact
// forwards): per-token importance scores over a 1500-token prompt with a sliding window of 256, on a
// synthetic Qwen3-geometry model (4 layers, Qwen2 vocabulary). The GPU's prefill products are bf16
// tensor-core GEMMs (the CPU's are its quantised path), so scores agree to a few percent, and the
// chunks PFlash would keep (the top tenth) agree; a second call reusing the held prefix equals a
// fresh one; backend::attention_prob_max on the device equals the host loop on the same inputs.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_test_util.h"
#include "models/cuda/dense_geometry.h"
#include "pflash/drafter.h"

namespace fathom {
namespace {

namespace fs = std::filesystem;

using cuda_test::vocab_dir;

const std::string &drafter_model() {
    static const std::string path = [] {
        const std::string out = (fs::temp_directory_path() / "fathom-cuda-pflash-qwen3.gguf").string();
        cuda_test::write_family_model(*cuda_test::find_family("qwen3"), vocab_dir(), out, 4, 0);
        return out;
    }();
    return path;
}

using CudaPflash = cuda_test::cuda_fixture;

std::vector<int32_t> ids_for(int64_t n, int32_t vocab, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto &x : v) x = static_cast<int32_t>(100 + rng() % static_cast<uint32_t>(std::min(vocab - 100, 30000)));
    return v;
}

// Indices of the k largest values.
std::set<size_t> top_of(const std::vector<float> &v, size_t k) {
    std::vector<size_t> idx(v.size());
    std::iota(idx.begin(), idx.end(), size_t{0});
    std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                      [&](size_t a, size_t b) { return v[a] > v[b]; });
    return {idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k)};
}

TEST_F(CudaPflash, GpuDrafterScoresMatchCpuDrafter) {
    if (!fs::exists(vocab_dir() + "/ggml-vocab-qwen2.gguf")) GTEST_SKIP() << "vocab file missing";
    auto cpu = pflash::drafter::load(drafter_model(), 4, 512, "cpu");
    auto gpu = pflash::drafter::load(drafter_model(), 4, 512, "cuda");
    const auto ids = ids_for(1500, cpu->n_vocab(), 3);
    pflash::drafter_score_params p;
    p.query_tokens = 8;
    p.window = 256;
    pflash::drafter_stats sc, sg;
    const auto a = cpu->score(ids, p, sc), b = gpu->score(ids, p, sg);
    ASSERT_EQ(a.size(), b.size());
    for (float x : b) ASSERT_TRUE(std::isfinite(x) && x >= 0.0f);
    const double e = cuda_test::rel_l2(b, a);
    const auto ta = top_of(a, 150), tb = top_of(b, 150);
    std::vector<size_t> common;
    std::set_intersection(ta.begin(), ta.end(), tb.begin(), tb.end(), std::back_inserter(common));
    std::printf("  drafter scores GPU vs CPU: rel L2 %.3g, top-150 overlap %zu; GPU prefill %.3f s, queries %.3f s, "
                "scoring %.3f s\n",
                e, common.size(), sg.prefill_s, sg.query_s, sg.score_s);
    EXPECT_LE(e, 5e-2);
    EXPECT_GE(common.size(), 135u);
    // The held prefix: a longer prompt re-evaluates only its new tokens and scores as a fresh drafter.
    auto ids2 = ids;
    const auto more = ids_for(300, cpu->n_vocab(), 4);
    ids2.insert(ids2.end(), more.begin(), more.end());
    pflash::drafter_stats s2, s3;
    const auto c = gpu->score(ids2, p, s2);
    auto fresh = pflash::drafter::load(drafter_model(), 4, 512, "cuda");
    const auto d = fresh->score(ids2, p, s3);
    EXPECT_LT(s2.n_evaluated, s3.n_evaluated);
    EXPECT_LE(cuda_test::rel_l2(c, d), 1e-3);  // (batch boundaries differ: bf16 GEMM rows may round differently)
}

// backend::attention_prob_max: the CUDA kernel against the host loop (the CPU backend's default) on the
// same queries and f16 keys, GQA and softcap included.
TEST_F(CudaPflash, AttentionProbMaxMatchesHost) {
    auto cpu = make_cpu_backend(cpu_options{});
    auto gpu = make_cuda_backend(cuda_options{});
    std::mt19937 rng(5);
    const int32_t H = 8, Hkv = 2, hd = 64;
    const int64_t n_ctx = 700, first = 600, n_q = 5;
    const auto qv = cuda_test::randn(static_cast<size_t>(n_q * H * hd), rng);
    const auto kf = cuda_test::randn(static_cast<size_t>(Hkv * n_ctx * hd), rng);
    std::vector<uint16_t> kh(kf.size());
    for (size_t i = 0; i < kf.size(); ++i) kh[i] = cpu::f32_to_f16(kf[i]);
    for (const float cap : {0.0f, 30.0f}) {
        std::vector<float> agg_init(static_cast<size_t>(n_q * n_ctx));
        for (auto &x : agg_init) x = (rng() % 4 == 0) ? 0.001f : 0.0f;  // existing maxima must survive
        std::vector<float> want(agg_init.size()), got(agg_init.size());
        for (backend *be : {static_cast<backend *>(cpu.get()), static_cast<backend *>(gpu.get())}) {
            void *mq = be->alloc(qv.size() * 4), *mk = be->alloc(kh.size() * 2), *ma = be->alloc(agg_init.size() * 4);
            const tensor q = make_tensor(dtype::f32, int64_t{H} * hd, n_q, mq), k = make_tensor(dtype::f16, hd, Hkv * n_ctx, mk),
                         agg = make_tensor(dtype::f32, n_ctx, n_q, ma);
            be->upload(q, qv.data());
            be->upload(k, kh.data());
            be->upload(agg, agg_init.data());
            be->attention_prob_max(q, k, H, Hkv, n_ctx, 0.125f, cap, first, agg);
            be->download(agg, (be == cpu.get() ? want : got).data());
            be->synchronize();
            be->release(mq);
            be->release(mk);
            be->release(ma);
        }
        EXPECT_LE(cuda_test::rel_l2(got, want), 1e-5) << "softcap " << cap;
        for (int64_t t = 0; t < n_q; ++t)  // columns past each query's position keep their initial values
            for (int64_t j = first + t + 1; j < n_ctx; ++j)
                ASSERT_EQ(got[static_cast<size_t>(t * n_ctx + j)], agg_init[static_cast<size_t>(t * n_ctx + j)]);
    }
}

}  // namespace
}  // namespace fathom
