// Whole-model checks of the CUDA engine path (engine_options::device = "cuda") against the CPU
// engine, for the three dense families, on synthetic models with the real per-layer geometries of
// SmolLM2-135M, Qwen3-0.6B and Gemma3-270M (dense_geometry.h), generated at test time, with fewer
// layers (llama 8, qwen3 4, gemma3 6 = 5 sliding + 1 global) and gemma3's window cut to 32 so the
// test's 40 positions exercise it; the suite must stay fast.
// References: the CPU engine in exact mode (f32 everywhere) and in its default fast mode. For each
// CUDA mode (one prefill call with all logits; chunked prefill in chunks of 13 and of 5 tokens, the
// GEMM and the GEMV paths; token-by-token decode, eager and CUDA-graph replay) the relative L2 error
// of the logits against CPU exact must not exceed the CPU fast mode's own error in the same kind of
// evaluation, graph replay must equal eager decode bit for bit, and greedy generation must produce
// the same tokens as CPU exact. Vocab files: $FATHOM_CUDA_VOCAB_DIR, else
// FATHOM_SHARED_DIR/tokenizer-tests. Skipped without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "cache/cache_test_util.h"
#include "core/error.h"
#include "fathom/engine.h"
#include "dense_geometry.h"

namespace fathom {
namespace {

namespace fs = std::filesystem;

using cuda_test::vocab_dir;

using cuda_test::family;

// Test sizes: fewer layers, gemma3's window 32.
struct test_family {
    const family *f;
    int32_t n_layer, window;
};
const test_family kTests[] = {
    {&cuda_test::kFamilies[0], 8, 0},
    {&cuda_test::kFamilies[1], 4, 0},
    {&cuda_test::kFamilies[2], 6, 32},
};

// Writes (once per process) the synthetic GGUF for a family; returns its path.
std::string model_path(const test_family &t) {
    static std::map<std::string, std::string> made;
    if (auto it = made.find(t.f->arch); it != made.end()) return it->second;
    const std::string out = (fs::temp_directory_path() / (std::string("fathom-cuda-model-") + t.f->arch + ".gguf")).string();
    cuda_test::write_family_model(*t.f, vocab_dir(), out, t.n_layer, t.window);
    made[t.f->arch] = out;
    return out;
}

std::unique_ptr<engine> load(const std::string &path, const std::string &device, bool exact, int n_batch = 512,
                             bool graphs = true) {
    engine_options o;
    o.model_path = path;
    o.device = device;
    o.exact = exact;
    o.n_ctx = 256;
    o.n_batch = n_batch;
    o.cuda_graphs = graphs;
    return engine::load(o);
}

double rel_l2(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
        const double d = static_cast<double>(a[i]) - ref[i];
        num += d * d;
        den += static_cast<double>(ref[i]) * ref[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

bool all_finite(const std::vector<float> &v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

std::vector<int32_t> prompt_tokens(int32_t n_vocab, int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    uint64_t s = 0x2545F4914F6CDD1DULL;
    for (auto &x : t) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        x = static_cast<int32_t>((s >> 33) % static_cast<uint64_t>(n_vocab));
    }
    return t;
}

// All logits of `toks` evaluated in one eval() call (the engine chunks by its n_batch).
std::vector<float> all_logits(engine &e, const std::vector<int32_t> &toks) {
    auto s = e.new_session();
    std::vector<float> out(toks.size() * static_cast<size_t>(e.info().n_vocab), NAN);
    s->eval(toks, out.data());
    return out;
}

// Prefill the first n_pre tokens, then one eval() per token; logits of every position from n_pre-1.
std::vector<float> decode_logits(engine &e, const std::vector<int32_t> &toks, size_t n_pre) {
    const size_t V = static_cast<size_t>(e.info().n_vocab);
    auto s = e.new_session();
    s->eval(std::span<const int32_t>(toks.data(), n_pre));
    std::vector<float> out;
    out.insert(out.end(), s->logits().begin(), s->logits().end());
    for (size_t i = n_pre; i < toks.size(); ++i) {
        s->eval(std::span<const int32_t>(&toks[i], 1));
        out.insert(out.end(), s->logits().begin(), s->logits().end());
    }
    EXPECT_EQ(out.size(), (toks.size() - n_pre + 1) * V);
    return out;
}

std::vector<int32_t> greedy(engine &e, const std::vector<int32_t> &prompt, int n) {
    auto s = e.new_session();
    s->eval(prompt);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
        const auto lg = s->logits();
        const int32_t t = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
        out.push_back(t);
        s->eval(std::span<const int32_t>(&t, 1));
    }
    return out;
}

class CudaModel : public ::testing::TestWithParam<test_family> {
protected:
    void SetUp() override {
        if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
        if (!fs::exists(vocab_dir() + "/" + GetParam().f->vocab)) GTEST_SKIP() << "vocab file missing in " << vocab_dir();
    }
};

TEST_P(CudaModel, LogitsMatchCpuInEveryMode) {
    const family &f = *GetParam().f;
    const std::string path = model_path(GetParam());
    auto exact = load(path, "cpu", true);
    auto fast = load(path, "cpu", false);
    const int32_t V = exact->info().n_vocab;
    const size_t Vs = static_cast<size_t>(V);
    const std::vector<int32_t> toks = prompt_tokens(V, 40);
    const size_t n_pre = 8;

    const std::vector<float> ref = all_logits(*exact, toks);
    const std::vector<float> ref_fast = all_logits(*fast, toks);
    const double err_fast = rel_l2(ref_fast.data(), ref.data(), ref.size());
    // Decode positions n_pre-1 .. end of the references.
    const float *ref_dec = ref.data() + (n_pre - 1) * Vs;
    const size_t n_dec = (toks.size() - n_pre + 1) * Vs;
    const std::vector<float> fast_dec = decode_logits(*fast, toks, n_pre);
    const double err_fast_dec = rel_l2(fast_dec.data(), ref_dec, n_dec);

    auto gpu = load(path, "cuda", false);
    EXPECT_EQ(gpu->info().device.rfind("cuda:0 (", 0), 0u) << gpu->info().device;
    const std::vector<float> pre = all_logits(*gpu, toks);
    auto gpu13 = load(path, "cuda", false, 13);  // chunks 13,13,13,1: GEMM + GEMV
    const std::vector<float> ch13 = all_logits(*gpu13, toks);
    auto gpu5 = load(path, "cuda", false, 5);    // chunks of 5: GEMV (M <= 8) prefill
    const std::vector<float> ch5 = all_logits(*gpu5, toks);
    const uint64_t g0 = cuda_graph_launch_count();
    const std::vector<float> dec_graph = decode_logits(*gpu, toks, n_pre);
    const uint64_t g1 = cuda_graph_launch_count();
    auto gpu_eager = load(path, "cuda", false, 512, /*graphs=*/false);
    const std::vector<float> dec_eager = decode_logits(*gpu_eager, toks, n_pre);
    // Every decode step but the session's first (eager: it sizes scratch) replays the graph.
    EXPECT_EQ(g1 - g0, toks.size() - n_pre - 1) << "decode did not replay CUDA graphs";
    EXPECT_EQ(cuda_graph_launch_count(), g1) << "cuda_graphs = false still replayed graphs";

    for (const auto *v : {&pre, &ch13, &ch5, &dec_graph, &dec_eager}) ASSERT_TRUE(all_finite(*v));
    const double e_pre = rel_l2(pre.data(), ref.data(), ref.size());
    const double e_13 = rel_l2(ch13.data(), ref.data(), ref.size());
    const double e_5 = rel_l2(ch5.data(), ref.data(), ref.size());
    const double e_dec = rel_l2(dec_graph.data(), ref_dec, n_dec);
    const double graph_vs_eager = rel_l2(dec_graph.data(), dec_eager.data(), n_dec);
    std::printf("[%s] rel L2 vs CPU exact: cpu-fast prefill %.3e, cpu-fast decode %.3e | cuda prefill %.3e, "
                "chunked/13 %.3e, chunked/5 %.3e, decode(graph) %.3e; graph vs eager %.3e\n",
                f.arch, err_fast, err_fast_dec, e_pre, e_13, e_5, e_dec, graph_vs_eager);
    EXPECT_LE(e_pre, err_fast);
    EXPECT_LE(e_13, err_fast);
    EXPECT_LE(e_5, err_fast);
    EXPECT_LE(e_dec, err_fast_dec);
    EXPECT_EQ(graph_vs_eager, 0.0) << "graph replay must equal eager decode";
    // Not trivially passing: the logits are far from zero and vary between positions.
    EXPECT_GT(rel_l2(ref.data(), ref.data() + Vs, Vs), 0.1);

    // Greedy choice at every position (teacher-forced on the prompt) equals CPU exact's in every
    // mode; the choices vary (random prompt ids), so this is not one repeated token.
    auto argmaxes = [&](const float *lg, size_t rows) {
        std::vector<int32_t> a(rows);
        for (size_t r = 0; r < rows; ++r)
            a[r] = static_cast<int32_t>(std::max_element(lg + r * Vs, lg + (r + 1) * Vs) - (lg + r * Vs));
        return a;
    };
    const size_t T = toks.size(), TD = T - n_pre + 1;
    const std::vector<int32_t> am_ref = argmaxes(ref.data(), T), am_ref_dec = argmaxes(ref_dec, TD);
    EXPECT_GE(std::set<int32_t>(am_ref.begin(), am_ref.end()).size(), 10u) << "greedy choices do not vary";
    EXPECT_EQ(argmaxes(pre.data(), T), am_ref) << "prefill greedy tokens";
    EXPECT_EQ(argmaxes(ch13.data(), T), am_ref) << "chunked/13 greedy tokens";
    EXPECT_EQ(argmaxes(ch5.data(), T), am_ref) << "chunked/5 greedy tokens";
    EXPECT_EQ(argmaxes(dec_graph.data(), TD), am_ref_dec) << "decode greedy tokens";
}

// Free-running greedy generation (random-weight models settle on a repeated token quickly, so the
// per-position check above is the stronger one; this one covers the sampling loop's path).
TEST_P(CudaModel, GreedyGenerationMatchesCpuExact) {
    const family &f = *GetParam().f;
    const std::string path = model_path(GetParam());
    auto exact = load(path, "cpu", true);
    auto gpu = load(path, "cuda", false);
    const std::vector<int32_t> prompt = prompt_tokens(exact->info().n_vocab, 12);
    const std::vector<int32_t> a = greedy(*exact, prompt, 24), b = greedy(*gpu, prompt, 24);
    std::string sa, sb;
    for (size_t i = 0; i < a.size(); ++i) sa += std::to_string(a[i]) + " ", sb += std::to_string(b[i]) + " ";
    std::printf("[%s] greedy cpu-exact: %s\n[%s] greedy cuda:      %s\n", f.arch, sa.c_str(), f.arch, sb.c_str());
    EXPECT_EQ(a, b);
}

INSTANTIATE_TEST_SUITE_P(Dense, CudaModel, ::testing::ValuesIn(kTests),
                         [](const ::testing::TestParamInfo<test_family> &i) { return std::string(i.param.f->arch); });

// Every matrix q8_0 (how Qwen3-0.6B is released; the mix above keeps most projections f32/f16): the decode
// step then runs the fused ops' fast paths in every layer (ds4_gemv's int8-activation GEMV with the
// attention / FFN norms folded in and the residual adds accumulated, qk_rope_store; docs/cuda.md "The
// dense decode step"). Its activations are quantised like the CPU fast path's, so the decode logits
// must be within twice the CPU fast decode error to CPU exact, graph replay must equal eager decode bit
// for bit, and the greedy choice may differ from CPU exact's at no more positions than CPU fast's does
// (plus one).
TEST(CudaModelQ8, Qwen3AllQ8DecodeMatchesCpu) {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    const test_family t = kTests[1];
    if (!fs::exists(vocab_dir() + "/" + t.f->vocab)) GTEST_SKIP() << "vocab file missing in " << vocab_dir();
    const std::string path = (fs::temp_directory_path() / "fathom-cuda-model-qwen3-q8.gguf").string();
    cuda_test::write_family_model(*t.f, vocab_dir(), path, t.n_layer, t.window, dtype::q8_0);
    auto exact = load(path, "cpu", true);
    auto fast = load(path, "cpu", false);
    const size_t V = static_cast<size_t>(exact->info().n_vocab);
    const std::vector<int32_t> toks = prompt_tokens(static_cast<int32_t>(V), 40);
    const size_t n_pre = 8, TD = toks.size() - n_pre + 1, n_dec = TD * V;
    const std::vector<float> ref = decode_logits(*exact, toks, n_pre);
    const std::vector<float> ref_fast = decode_logits(*fast, toks, n_pre);
    auto gpu = load(path, "cuda", false);
    auto gpu_eager = load(path, "cuda", false, 512, /*graphs=*/false);
    const uint64_t g0 = cuda_graph_launch_count();
    const std::vector<float> dec = decode_logits(*gpu, toks, n_pre);
    EXPECT_EQ(cuda_graph_launch_count() - g0, toks.size() - n_pre - 1) << "decode did not replay CUDA graphs";
    const std::vector<float> dec_eager = decode_logits(*gpu_eager, toks, n_pre);
    ASSERT_TRUE(all_finite(dec));
    const double err_fast = rel_l2(ref_fast.data(), ref.data(), n_dec), err = rel_l2(dec.data(), ref.data(), n_dec);
    std::printf("[qwen3 all-q8_0] decode rel L2 vs CPU exact: cpu-fast %.3e, cuda %.3e\n", err_fast, err);
    EXPECT_LE(err, 2 * err_fast);
    EXPECT_EQ(rel_l2(dec.data(), dec_eager.data(), n_dec), 0.0) << "graph replay must equal eager decode";
    auto mismatches = [&](const std::vector<float> &a) {
        int n = 0;
        for (size_t r = 0; r < TD; ++r) {
            const float *x = a.data() + r * V, *y = ref.data() + r * V;
            n += std::max_element(x, x + V) - x != std::max_element(y, y + V) - y;
        }
        return n;
    };
    EXPECT_LE(mismatches(dec), mismatches(ref_fast) + 1) << "decode greedy tokens";
    fs::remove(path);
}

TEST(CudaEngine, DeviceErrorsAreOneLine) {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    if (!fs::exists(vocab_dir() + "/" + kTests[0].f->vocab)) GTEST_SKIP() << "vocab file missing";
    const std::string path = model_path(kTests[0]);
    auto expect_error = [&](const engine_options &o, const std::string &needle) {
        try {
            engine::load(o);
            ADD_FAILURE() << "expected an error containing '" << needle << "'";
        } catch (const error &e) {
            const std::string m = e.what();
            EXPECT_NE(m.find(needle), std::string::npos) << m;
            EXPECT_EQ(m.find('\n'), std::string::npos) << m;
        }
    };
    engine_options o;
    o.model_path = path;
    o.device = "cuda:" + std::to_string(cuda_device_count());
    expect_error(o, "CUDA device(s) present");
    o.device = "cuda:x";
    expect_error(o, "expected cpu, cuda, cuda:N or auto");
    // A context whose KV cache cannot fit: refused before any weight is uploaded.
    o.device = "cuda";
    o.n_ctx = 1 << 30;
    const size_t free_before = cuda_query_memory(0).free_bytes;
    expect_error(o, "is free");
    const size_t free_after = cuda_query_memory(0).free_bytes;
    EXPECT_LT(free_before > free_after ? free_before - free_after : 0, size_t{64} << 20) << "memory leaked";
    // auto picks the device.
    o.device = "auto";
    o.n_ctx = 64;
    EXPECT_EQ(engine::load(o)->info().device.rfind("cuda:0", 0), 0u);
}

// Dense CUDA sessions save and load their device KV as the CPU sessions do (the DNS1 stream of
// docs/prompt-cache.md, copied through the host head by head), for the three families: a session
// loaded from another's state has its logits and continues bit for bit (eager steps, then graph
// replays); a prefix load (n_keep < n) continues exactly like a session that evaluated the whole
// prompt in one call and truncated it to the same prefix; a stream cut short is refused and leaves the session empty and usable; the identity
// names the backend (a CPU state is never offered to a CUDA engine, nor the reverse).
TEST(CudaEngine, DenseSessionsSaveAndLoadTheirState) {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    using cache_test::vector_reader;
    using cache_test::vector_writer;
    auto same = [](std::span<const float> x, std::span<const float> y) {
        return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
    };
    for (const test_family &t : kTests) {
        if (!fs::exists(vocab_dir() + "/" + t.f->vocab)) GTEST_SKIP() << "vocab file missing in " << vocab_dir();
        SCOPED_TRACE(t.f->arch);
        auto e = load(model_path(t), "cuda", false);
        const std::string id = e->state_identity();
        EXPECT_NE(id.find("backend=cuda"), std::string::npos) << id;
        EXPECT_NE(load(model_path(t), "cpu", false)->state_identity(), id);
        const auto toks = prompt_tokens(static_cast<int32_t>(e->info().n_vocab), 60);
        const std::span<const int32_t> prompt(toks.data(), 40);
        auto a = e->new_session();
        a->eval(prompt);
        vector_writer w;
        ASSERT_TRUE(a->save_state(w));
        EXPECT_TRUE(a->loads_state_prefix());
        auto b = e->new_session();
        vector_reader r(w.bytes);
        ASSERT_TRUE(b->load_state(r, prompt, 40));
        EXPECT_EQ(b->n_past(), 40);
        EXPECT_TRUE(same(a->logits(), b->logits())) << "logits after the load";
        for (size_t i = 40; i < toks.size(); ++i) {  // the first steps eager, then graph replays
            a->eval(std::span(&toks[i], 1));
            b->eval(std::span(&toks[i], 1));
            ASSERT_TRUE(same(a->logits(), b->logits())) << "diverged at position " << i;
        }
        // prefix: 25 of the 40 positions from the state, against a session that evaluated the 40 in one
        // call (as the saved one did: the CUDA GEMMs' bits depend on the chunk's row count) and kept 25
        auto c = e->new_session(), d = e->new_session();
        vector_reader r2(w.bytes);
        ASSERT_TRUE(c->load_state(r2, prompt, 25));
        EXPECT_EQ(c->n_past(), 25);
        d->eval(prompt);
        d->truncate(25);
        c->eval(std::span(toks.data() + 25, 15));
        d->eval(std::span(toks.data() + 25, 15));
        EXPECT_TRUE(same(c->logits(), d->logits())) << "after the prefix load and the rest of the prompt";
        for (size_t i = 40; i < 46; ++i) {
            c->eval(std::span(&toks[i], 1));
            d->eval(std::span(&toks[i], 1));
            ASSERT_TRUE(same(c->logits(), d->logits())) << "prefix load: diverged at position " << i;
        }
        // the layout is the CPU engine's: the same header, and the KV section (f16, [layer][K, V][head]
        // [pos][dim]) within the backends' difference (a swapped K / V or head order would be O(1) off)
        {
            auto cpu = load(model_path(t), "cpu", false);
            auto cs = cpu->new_session();
            cs->eval(prompt);
            vector_writer cw;
            ASSERT_TRUE(cs->save_state(cw));
            ASSERT_EQ(cw.bytes.size(), w.bytes.size());
            EXPECT_EQ(std::memcmp(cw.bytes.data(), w.bytes.data(), 64), 0) << "stream header";
            const size_t kv_bytes = w.bytes.size() - 64 - static_cast<size_t>(e->info().n_vocab) * sizeof(float);
            double num = 0, den = 0;
            for (size_t i = 64; i + 2 <= 64 + kv_bytes; i += 2) {
                uint16_t a16, c16;
                std::memcpy(&a16, w.bytes.data() + i, 2);
                std::memcpy(&c16, cw.bytes.data() + i, 2);
                const double va = cpu::f16_to_f32(a16), vc = cpu::f16_to_f32(c16);
                num += (va - vc) * (va - vc);
                den += vc * vc;
            }
            EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 0.02) << "KV rows differ from the CPU engine's";
        }
        // a stream cut in the middle of its KV rows: refused, the session empty and still usable
        const std::vector<uint8_t> cut(w.bytes.begin(), w.bytes.begin() + 64 + (w.bytes.size() - 64) / 2);
        auto f = e->new_session(), g = e->new_session();
        vector_reader r3(cut);
        EXPECT_THROW(f->load_state(r3, prompt, 40), error);
        EXPECT_EQ(f->n_past(), 0);
        f->eval(prompt);
        g->eval(prompt);
        EXPECT_TRUE(same(f->logits(), g->logits())) << "a session after a refused load";
    }
}

}  // namespace
}  // namespace fathom
