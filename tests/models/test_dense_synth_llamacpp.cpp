// Qwen3 and Gemma 3 forward vs llama.cpp on synthetic random-weight GGUFs.
//
// No real Qwen3 checkpoint is installable, so src/models/dense_synth.h writes small models with
// the real Qwen2 tokenizer (../shared/tokenizer-tests/ggml-vocab-qwen2.gguf) and seeded random
// weights. qwen3: 4 layers, E 64, GQA 4/2, head_dim 64 != E/n_head, per-head q/k norms, NeoX RoPE
// base 1e6, untied output. gemma3: 6 layers (5 sliding-window layers with window 32 < the 229
// positions, 1 global), GQA 4/1, post-norms, GeGLU, sqrt(E) embedding scale, tied output. Each
// test regenerates its file (same bytes on every machine), checks the SHA-256 recorded with the
// golden, runs a 229-token real text (tokenized by llama.cpp; our tokenizer must agree) in one
// batch and compares every position's logits with llama.cpp's
// (tests/models/data/<arch>_synth[_float]_llamacpp.{json,f32}, written by
// scripts/goldens/gen_qwen3_goldens.py with llama-cpp-python 0.3.36: 2 threads, no flash
// attention, f16 KV cache).
//
// Mode: DEFAULT (fast) numerics with an f16 KV cache, which mirrors llama.cpp: activations are
// converted to each weight's vec_dot_type exactly as ggml does (f16 for f16, q8_0 for q8_0/q4_0,
// q8_K for q4_k, none for f32) and K/V are stored as f16. Two weight mixes:
//  * "float" files (f32/f16 matrices only, q4_0 embedding rows are looked up exactly): no
//    quantised activations, the two engines agree to < 1e-3 relative L2 at every position
//    (measured worst: qwen3 8e-8 default / 6e-4 exact, gemma3 3e-4 / 3e-4; exact mode keeps q
//    and the attention weights in f32 where llama.cpp rounds them to f16);
//  * "quant" files (f32, f16, q8_0, q4_k matrices, q4_0/q8_0 embeddings and output): ggml rounds
//    activations to 8 bits before those matmuls, a discontinuous step, so last-ulp differences
//    (summation order, llama.cpp's f16 rounding of q and of the softmax inside attention) flip
//    single q8 values, each worth ~1e-3 of a logit row. Many positions still match bit for bit;
//    the bounds are that noise level (llama.cpp itself is ~8e-3 from a float64 forward, which our
//    exact mode matches to 4e-7), far below what a wrong RoPE mode/base or missing q/k norm gives
//    (0.1-0.5, measured by perturbing the hyperparameters).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "fathom/engine.h"
#include "models/dense_synth.h"

using namespace fathom;

namespace {

const std::string kVocab = std::string(FATHOM_SHARED_DIR) + "/tokenizer-tests/ggml-vocab-qwen2.gguf";

struct golden {
    nlohmann::json j;
    std::vector<float> stored;  // [n_pos x (n_top + n_sample)], then the last full row
    int64_t n_vocab = 0, n_top = 0, n_sample = 0;
    std::vector<int32_t> tokens;
};

golden read_golden(const std::string &prefix) {
    golden g;
    const std::string dir = std::string(FATHOM_SOURCE_DIR) + "/tests/models/data/";
    std::ifstream in(dir + prefix + ".json");
    if (!in.good()) throw error("cannot open " + prefix + ".json");
    g.j = nlohmann::json::parse(in);
    g.n_vocab = g.j["n_vocab"].get<int64_t>();
    g.n_top = g.j["n_top"].get<int64_t>();
    g.n_sample = static_cast<int64_t>(g.j["sample_ids"].size());
    g.tokens = g.j["tokens"].get<std::vector<int32_t>>();
    const size_t n = g.tokens.size() * static_cast<size_t>(g.n_top + g.n_sample) + static_cast<size_t>(g.n_vocab);
    g.stored.resize(n);
    std::ifstream lf(dir + g.j["logits_file"].get<std::string>(), std::ios::binary);
    if (!lf.read(reinterpret_cast<char *>(g.stored.data()), static_cast<std::streamsize>(n * 4)).good())
        throw error("short logits file for " + prefix);
    return g;
}

// Regenerate the synthetic GGUF the golden was computed on; fails if the bytes differ.
std::string regenerate(const golden &g) {
    const auto &gen = g.j["generator"];
    const std::string arch = gen["arch"].get<std::string>();
    dense_synth_options o = dense_synth_preset(arch, kVocab, gen["seed"].get<uint64_t>());
    o.float_weights = gen["float_weights"].get<bool>();
    const std::string path =
        ::testing::TempDir() + "/fathom_synth_" + arch + (o.float_weights ? "_float" : "") + ".gguf";
    dense_synth_write(o, path);
    EXPECT_EQ(dense_synth_sha256(path), g.j["gguf_sha256"].get<std::string>())
        << "regenerated " << arch << " GGUF differs from the one llama.cpp evaluated";
    return path;
}

struct compare_result {
    double worst = 0, mean = 0, last_full = 0, worst_norm = 0;
    int64_t worst_pos = -1, argmax_misses = 0;
};

// Per position: relative L2 over the stored entries (top-32 ids + 512 fixed sample ids), full-row
// norm ratio, and the argmax (ours must be a reference top-32 id within a near-tie of the max);
// plus the relative L2 of the complete last row.
compare_result compare(const golden &g, const std::vector<float> &lg) {
    compare_result r;
    const auto &pos = g.j["positions"];
    const auto sample = g.j["sample_ids"].get<std::vector<int64_t>>();
    const int64_t nv = g.n_vocab, stride = g.n_top + g.n_sample;
    for (size_t p = 0; p < g.tokens.size(); ++p) {
        const float *row = &lg[p * nv];
        const float *ref = &g.stored[p * stride];
        const auto top = pos[p]["top_ids"].get<std::vector<int64_t>>();
        double e = 0, n = 0;
        for (int64_t k = 0; k < stride; ++k) {
            const int64_t id = k < g.n_top ? top[k] : sample[k - g.n_top];
            e += (double(row[id]) - ref[k]) * (double(row[id]) - ref[k]);
            n += double(ref[k]) * ref[k];
        }
        const double rel = std::sqrt(e / n);
        if (rel > r.worst) r.worst = rel, r.worst_pos = int64_t(p);
        r.mean += rel / double(g.tokens.size());
        double sq = 0;
        int64_t am = 0;
        for (int64_t i = 0; i < nv; ++i) {
            sq += double(row[i]) * row[i];
            if (row[i] > row[am]) am = i;
        }
        const double ref_norm = pos[p]["norm"].get<double>();
        r.worst_norm = std::max(r.worst_norm, std::abs(std::sqrt(sq) / ref_norm - 1));
        // Near tie: within 1e-3 of the row's RMS of llama.cpp's maximum.
        const double tie = 1e-3 * ref_norm / std::sqrt(double(nv));
        bool ok = false;
        for (int64_t k = 0; k < g.n_top; ++k)
            ok |= top[k] == am && ref[k] >= pos[p]["max"].get<double>() - tie;
        r.argmax_misses += !ok;
    }
    const float *last = &lg[(g.tokens.size() - 1) * nv];
    const float *ref_last = &g.stored[g.tokens.size() * stride];
    double e = 0, n = 0;
    for (int64_t i = 0; i < nv; ++i) {
        e += (double(last[i]) - ref_last[i]) * (double(last[i]) - ref_last[i]);
        n += double(ref_last[i]) * ref_last[i];
    }
    r.last_full = std::sqrt(e / n);
    return r;
}

compare_result evaluate(const golden &g, const std::string &path, bool exact, const std::string &what) {
    engine_options o;
    o.model_path = path;
    o.exact = exact;
    o.batch_invariant = false;  // llama.cpp's own (batch-dependent) summation order
    o.kv = kv_precision::f16;
    o.n_ctx = 512;
    o.n_batch = 512;  // one batched evaluation, as llama.cpp's
    o.n_threads = 2;
    auto e = engine::load(o);
    EXPECT_EQ(e->info().n_vocab, g.n_vocab);
    // Our tokenizer on the same text must give llama.cpp's ids (llama.cpp's tokenize(add_bos=True):
    // the qwen2 vocab adds no BOS).
    EXPECT_EQ(e->tokenize(g.j["text"].get<std::string>(), true, false), g.tokens);
    std::vector<float> lg(g.tokens.size() * static_cast<size_t>(g.n_vocab));
    e->new_session()->eval(g.tokens, lg.data());
    const compare_result r = compare(g, lg);
    std::printf("%s (%s mode): %zu positions, rel L2 worst %.2e (pos %lld) mean %.2e, last full row %.2e, "
                "norm ratio off by <= %.2e, argmax misses %lld\n",
                what.c_str(), exact ? "exact" : "default", g.tokens.size(), r.worst, (long long)r.worst_pos, r.mean,
                r.last_full, r.worst_norm, (long long)r.argmax_misses);
    return r;
}

// f32/f16 weights: both modes within 1e-3 of llama.cpp at every position, same argmax.
void check_float(const std::string &prefix) {
    if (!std::ifstream(kVocab).good()) GTEST_SKIP() << kVocab << " missing";
    const golden g = read_golden(prefix);
    const std::string path = regenerate(g);
    if (::testing::Test::HasFailure()) return;  // not the file llama.cpp saw: comparing is meaningless
    for (bool exact : {false, true}) {
        const compare_result r = evaluate(g, path, exact, prefix);
        EXPECT_LT(r.worst, 1e-3) << prefix << (exact ? " exact" : " default") << ", worst position " << r.worst_pos;
        EXPECT_LT(r.last_full, 1e-3) << prefix;
        EXPECT_LT(r.worst_norm, 1e-3) << prefix;
        EXPECT_EQ(r.argmax_misses, 0) << prefix;
    }
    std::remove(path.c_str());
}

// Quantised weights, default mode: q8 activation-rounding noise only (see the banner).
void check_quant(const std::string &prefix) {
    if (!std::ifstream(kVocab).good()) GTEST_SKIP() << kVocab << " missing";
    const golden g = read_golden(prefix);
    const std::string path = regenerate(g);
    if (::testing::Test::HasFailure()) return;  // not the file llama.cpp saw: comparing is meaningless
    const compare_result r = evaluate(g, path, false, prefix);
    EXPECT_LT(r.worst, 1.5e-2) << prefix << ", worst position " << r.worst_pos;
    EXPECT_LT(r.mean, 4e-3) << prefix;
    EXPECT_LT(r.last_full, 1.5e-2) << prefix;
    EXPECT_LT(r.worst_norm, 1e-2) << prefix;
    EXPECT_LE(r.argmax_misses, int64_t(g.tokens.size() / 50)) << prefix;
    std::remove(path.c_str());
}

std::string write_bytes(const std::string &name, const std::string &bytes) {
    const std::string path = ::testing::TempDir() + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
}

}  // namespace

// FIPS 180-4 example vectors (one block, two blocks, empty message).
TEST(DenseSynth, Sha256KnownVectors) {
    EXPECT_EQ(dense_synth_sha256(write_bytes("sha_abc", "abc")),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    EXPECT_EQ(dense_synth_sha256(write_bytes("sha_2blk", "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    EXPECT_EQ(dense_synth_sha256(write_bytes("sha_empty", "")),
              "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(DenseSynth, RejectsBadOptions) {
    dense_synth_options o = dense_synth_preset("qwen3", kVocab, 1);
    o.n_head_kv = 3;
    EXPECT_THROW(dense_synth_write(o, ::testing::TempDir() + "/bad.gguf"), error);
    o = dense_synth_preset("qwen3", kVocab, 1);
    o.n_ff = 100;  // ffn_down's q8_0 rows need a multiple of 32
    EXPECT_THROW(dense_synth_write(o, ::testing::TempDir() + "/bad.gguf"), error);
    EXPECT_THROW(dense_synth_preset("mamba", kVocab, 1), error);
}

TEST(Qwen3, SyntheticFloatMatchesLlamaCpp) { check_float("qwen3_synth_float_llamacpp"); }
TEST(Qwen3, SyntheticQuantMatchesLlamaCpp) { check_quant("qwen3_synth_llamacpp"); }
TEST(Gemma3, SyntheticFloatMatchesLlamaCpp) { check_float("gemma3_synth_float_llamacpp"); }
TEST(Gemma3, SyntheticQuantMatchesLlamaCpp) { check_quant("gemma3_synth_llamacpp"); }
