// Saved states of the CUDA DS4 sequence (ds4::cuda_sequence::save_state / load_state, the on-disk
// prompt cache's DS4 stream, docs/prompt-cache.md "DS4 state") on the quantised synthetic model with
// the ds4-tiny layout (ratios 0, 0, 4, 128, 4; a 32-row raw window):
//  - a prompt prefilled in chunks (raw ring wrapped, ratio-4 and ratio-128 rows emitted, compressor
//    frontiers part full), saved, loaded into a fresh sequence with its logits: the next decode
//    steps equal, bit for bit, those of the sequence that never went through the stream;
//  - the stream is the CPU's (ds4::read_state parses it, and the CPU continuing from the loaded
//    state stays within the CUDA-vs-CPU error of the CPU continuing from its own prompt);
//  - a short, a mislabelled (token count) or a foreign stream is refused and leaves the sequence
//    reset and usable;
//  - through the public engine API on one GPU (the DS4 session the server's prompt cache saves and
//    loads): a session loaded from another's state samples and continues bit for bit, and the
//    engine's state identity names the CUDA backend (CPU states never load there).
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "models/cuda/deepseek4_cuda.h"
#include "cache/cache_test_util.h"
#include "core/error.h"
#include "backend/cuda/cuda_test_util.h"
#include "models/ds4/golden_util.h"
#include "ds4_host_util.h"
#include "fathom/engine.h"
#include "models/deepseek4.h"

namespace fathom {
namespace {

using cuda_test::tokens_of;

using CudaDs4State = cuda_test::cuda_device_test;
using cuda_test::rel_l2;

using cache_test::vector_reader;
using cache_test::vector_writer;

const std::string &model_path() {
    static const std::string path = cuda_test::write_quant_tiny_model("fathom_cuda_ds4_state_q2.gguf");
    return path;
}

using cuda_test::decode_each;

TEST_F(CudaDs4State, LoadedStateContinuesBitForBit) {
    auto m = ds4::load_model(model_path());
    const size_t n = 231, n_dec = 24, N = n + n_dec, V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = tokens_of(N, m->hp.n_vocab, 41);
    const std::span<const int32_t> prompt(toks.data(), n), tail(toks.data() + n, n_dec);
    for (const auto &[q, kv] : {std::pair{ds4::qat_mode::full, kv_precision::f16}, std::pair{ds4::qat_mode::off, kv_precision::f32}}) {
        SCOPED_TRACE(kv == kv_precision::f16 ? "qat full, f16 KV" : "qat off, f32 KV");
        ds4::cuda_run_options o;
        o.qat = q;
        o.kv = kv;
        auto w = ds4::cuda_upload(*m, o);
        // the reference: prompt, then decode, never saved
        ds4::cuda_sequence ref(w, static_cast<int64_t>(N) + 1, true, 37);
        ref.eval(prompt, {});
        const auto want = decode_each(ref, tail, V);
        // the same prompt, saved with its last logits
        vector_writer sw;
        std::vector<float> last(V);
        {
            ds4::cuda_sequence a(w, static_cast<int64_t>(N) + 1, true, 37);
            a.eval(prompt, {});
            a.save_state(sw);
            a.last_logits(last);
        }
        // loaded into a fresh sequence (another capacity: the stream does not depend on it)
        ds4::cuda_sequence b(w, static_cast<int64_t>(N) + 40, true, 64);
        vector_reader r(sw.bytes);
        b.load_state(r, static_cast<int64_t>(n));
        EXPECT_EQ(r.remaining(), 0u);
        EXPECT_EQ(b.n_past(), static_cast<int64_t>(n));
        b.restore_logits(last);
        std::vector<float> back(V);
        b.last_logits(back);
        EXPECT_EQ(std::memcmp(back.data(), last.data(), V * 4), 0);
        const auto got = decode_each(b, tail, V);
        size_t finite = 0;
        for (float v : want) finite += std::isfinite(v);
        ASSERT_EQ(finite, want.size());
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << "the loaded sequence diverged";

        // The stream is the CPU's format: read_state takes it, and the CPU continuing from it stays as
        // near the CPU continuing from its own prompt as the CUDA logits are.
        ds4::state cs = ds4::new_state(*m, q, kv);
        vector_reader cr(sw.bytes);
        ds4::read_state(*m, cs, cr, static_cast<int64_t>(n));
        EXPECT_EQ(cr.remaining(), 0u);
        ds4::state own = ds4::new_state(*m, q, kv);
        std::vector<int64_t> pos(N);
        std::iota(pos.begin(), pos.end(), 0);
        std::vector<float> own_logits(N * V), from_cuda(n_dec * V);
        ds4::forward(*m, own, toks, pos, {own_logits, {}});
        ds4::forward(*m, cs, tail, std::span<const int64_t>(pos).subspan(n), {from_cuda, {}});
        double worst_state = 0, worst_cuda = 0;
        for (size_t i = 0; i < n_dec; ++i) {
            worst_state = std::max(worst_state, rel_l2(&from_cuda[i * V], &own_logits[(n + i) * V], V));
            worst_cuda = std::max(worst_cuda, rel_l2(&want[i * V], &own_logits[(n + i) * V], V));
        }
        std::printf("  CPU from the CUDA state vs CPU: worst rel L2 %.3g; CUDA vs CPU %.3g\n", worst_state, worst_cuda);
        EXPECT_LE(worst_state, 2.0 * worst_cuda + 1e-4);
    }
}

TEST_F(CudaDs4State, DamagedStreamsAreRefusedAndTheSequenceSurvives) {
    auto m = ds4::load_model(model_path());
    const size_t n = 150, V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = tokens_of(n + 1, m->hp.n_vocab, 7);
    auto w = ds4::cuda_upload(*m, ds4::cuda_run_options{});
    ds4::cuda_sequence a(w, 400, true, 37);
    a.eval(std::span(toks).first(n), {});
    vector_writer sw;
    a.save_state(sw);
    ds4::cuda_sequence b(w, 400, true, 37);
    auto refused = [&](const std::vector<uint8_t> &bytes, int64_t n_past, const char *needle) {
        vector_reader r(bytes);
        try {
            b.load_state(r, n_past);
            ADD_FAILURE() << "accepted: " << needle;
        } catch (const error &e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
        EXPECT_EQ(b.n_past(), 0);
    };
    auto first = [&](size_t k) { return std::vector<uint8_t>(sw.bytes.begin(), sw.bytes.begin() + static_cast<std::ptrdiff_t>(k)); };
    refused(first(sw.bytes.size() / 2), static_cast<int64_t>(n), "ends early");
    refused(first(sw.bytes.size() - 1), static_cast<int64_t>(n), "ends early");
    refused(sw.bytes, static_cast<int64_t>(n) - 1, "token count");
    refused(sw.bytes, 401, "do not fit");
    std::vector<uint8_t> foreign = sw.bytes;
    foreign[0] ^= 0xff;
    refused(foreign, static_cast<int64_t>(n), "not a DeepSeek V4 state");
    // an f32-KV sequence refuses an f16 stream
    ds4::cuda_run_options o32;
    o32.kv = kv_precision::f32;
    ds4::cuda_sequence c(ds4::cuda_upload(*m, o32), 400, true, 37);
    vector_reader r(sw.bytes);
    EXPECT_THROW(c.load_state(r, static_cast<int64_t>(n)), error);
    // still usable: the whole stream loads, and evaluation goes on from it
    vector_reader ok(sw.bytes);
    b.load_state(ok, static_cast<int64_t>(n));
    std::vector<float> lg(V);
    b.eval(std::span(toks).subspan(n, 1), lg);
    EXPECT_EQ(b.n_past(), static_cast<int64_t>(n) + 1);
    EXPECT_TRUE(std::all_of(lg.begin(), lg.end(), [](float v) { return std::isfinite(v); }));
}

TEST_F(CudaDs4State, EngineSessionsOnOneGpuSaveAndLoad) {
    engine_options o;
    o.model_path = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
    o.n_ctx = 1024;
    o.device = "cuda";
    auto e = engine::load(o);
    const std::string id = e->state_identity();
    EXPECT_NE(id.find("backend=cuda"), std::string::npos) << id;
    const int vocab = static_cast<int>(e->info().n_vocab);
    const auto toks = tokens_of(301, vocab, 99);
    const std::span<const int32_t> prompt(toks.data(), 290);
    auto a = e->new_session();
    a->sync(prompt);
    vector_writer sw;
    ASSERT_TRUE(a->save_state(sw));
    auto b = e->new_session();
    vector_reader r(sw.bytes);
    ASSERT_TRUE(b->load_state(r, prompt, static_cast<int64_t>(prompt.size())));
    EXPECT_EQ(b->n_past(), a->n_past());
    const auto la = a->logits(), lb = b->logits();
    ASSERT_EQ(la.size(), lb.size());
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 4), 0);
    for (size_t i = prompt.size(); i < toks.size(); ++i) {
        a->eval(std::span(&toks[i], 1));
        b->eval(std::span(&toks[i], 1));
        const auto x = a->logits(), y = b->logits();
        ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << "diverged at position " << i;
    }
    // a CPU engine's identity differs: the server never offers a CPU state to this engine
    engine_options oc = o;
    oc.device = "cpu";
    EXPECT_NE(engine::load(oc)->state_identity(), id);
}

}  // namespace
}  // namespace fathom
