// `fathom-gguf synth` logic (src/models/deepseek4_synth.*): the loader accepts the files, the forward
// gives finite logits, a seed fixes the bytes, the q2 mix really stores IQ2_XXS / Q2_K / Q8_0 / F16
// (and the K-quant mixes their K-quants),
// the values follow the documented distributions, and the quantised engine path on a q2 file stays
// close to the reference (exact) path on the same file.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <algorithm>
#include <set>

#include <sys/stat.h>

#include "backend/cpu/quants.h"
#include "fathom/engine.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"
#include "models/deepseek4_synth.h"

namespace {

using namespace fathom;

std::string tmp(const std::string &name) {
    return (std::filesystem::temp_directory_path() / ("ds4_synth_" + name + ".gguf")).string();
}

std::string slurp(const std::string &p) {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
}

std::vector<float> run(const std::string &path, const std::vector<int32_t> &toks) {
    const auto m = ds4::load_model(path);
    ds4::state st = ds4::new_state(*m, ds4::qat_mode::full, kv_precision::f16);
    std::vector<int64_t> pos(toks.size());
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<float> l(toks.size() * static_cast<size_t>(m->hp.n_vocab));
    ds4::forward(*m, st, toks, pos, {l, {}});
    return l;
}

// A geometry where every block size fits: D 256, expert width 256, 2 x 128 heads.
ds4::hparams small_geometry() {
    ds4::hparams hp = ds4::synth_preset("tiny");
    hp.n_embd = 256;
    hp.n_ff_exp = 256;
    hp.n_vocab = 300;
    hp.n_layer = 4;
    ds4::synth_fix_layers(hp, 1.5f);
    return hp;
}

TEST(ds4_synth, tiny_loads_runs_and_is_deterministic) {
    const ds4::hparams hp = ds4::synth_preset("tiny");
    ds4::synth_options o;
    o.seed = 5;
    const std::string a = tmp("a"), b = tmp("b"), c = tmp("c");
    ds4::synth_write(a, hp, o);
    ds4::synth_write(b, hp, o);
    o.seed = 6;
    ds4::synth_write(c, hp, o);
    EXPECT_EQ(slurp(a), slurp(b));
    const std::vector<int32_t> toks = {0, 17, 300, 5, 42, 42, 511, 2, 9, 100, 101, 102, 7, 7, 8, 1};
    const auto la = run(a, toks), lc = run(c, toks);
    for (float x : la) ASSERT_TRUE(std::isfinite(x));
    EXPECT_NE(la, lc);  // the seed matters
    const auto m = ds4::load_model(a);
    EXPECT_EQ(m->hp.n_layer, 6);
    EXPECT_EQ(m->hp.compress_ratio, (std::vector<int>{0, 0, 4, 128, 4, 128}));
    EXPECT_EQ(m->hp.n_hash_layer, 3);
    for (const auto &p : {a, b, c}) std::filesystem::remove(p);
}

TEST(ds4_synth, q2_mix_types_and_distributions) {
    const std::string p = tmp("q2");
    ds4::synth_options o;
    o.pool_rows = 1000;  // the embedding's 300 rows drawn fresh: the statistics below see i.i.d. values
    ds4::synth_write(p, small_geometry(), o);
    const auto f = gguf::file::open(p);
    EXPECT_EQ(f->tensor("blk.3.ffn_gate_exps.weight").type, dtype::iq2_xxs);
    EXPECT_EQ(f->tensor("blk.3.ffn_up_exps.weight").type, dtype::iq2_xxs);
    EXPECT_EQ(f->tensor("blk.3.ffn_down_exps.weight").type, dtype::q2_k);
    EXPECT_EQ(f->tensor("blk.3.attn_q_b.weight").type, dtype::q8_0);
    EXPECT_EQ(f->tensor("output.weight").type, dtype::q8_0);
    EXPECT_EQ(f->tensor("token_embd.weight").type, dtype::f16);
    EXPECT_EQ(f->tensor("blk.2.indexer.proj.weight").type, dtype::f16);
    EXPECT_EQ(f->tensor("blk.2.attn_compressor_ape.weight").type, dtype::f32);
    // embedding N(0, 1): over 300 x 256 values mean ~ 0 (sd 0.004), variance ~ 1
    const auto &e = f->tensor("token_embd.weight");
    std::vector<float> v(static_cast<size_t>(e.nelements()));
    cpu::dequantize_row(dtype::f16, e.data, v.data(), e.nelements());
    double s = 0, ss = 0;
    for (float x : v) s += x, ss += double(x) * x;
    const double mean = s / v.size(), var = ss / v.size() - mean * mean;
    EXPECT_NEAR(mean, 0.0, 0.02);
    EXPECT_NEAR(var, 1.0, 0.03);
    // norms 1 + U(-0.1, 0.1)
    const auto &n = f->tensor("blk.0.attn_norm.weight");
    const float *nv = reinterpret_cast<const float *>(n.data);
    for (int64_t i = 0; i < n.nelements(); ++i) EXPECT_TRUE(nv[i] >= 0.9f && nv[i] <= 1.1f) << nv[i];
    // hash table: distinct experts per token
    const auto &h = f->tensor("blk.0.ffn_gate_tid2eid.weight");
    const int32_t *hv = reinterpret_cast<const int32_t *>(h.data);
    for (int64_t t = 0; t < h.ne[1]; ++t) {
        std::set<int32_t> u(hv + t * h.ne[0], hv + (t + 1) * h.ne[0]);
        EXPECT_EQ(static_cast<int64_t>(u.size()), h.ne[0]) << "token " << t;
    }
    std::filesystem::remove(p);
}

// The quantised engine path on a q2 file against the exact path on the same file: quantising the
// activations to Q8_0 / Q8_K adds about 0.5% relative error per product.
TEST(ds4_synth, quantised_engine_close_to_exact) {
    const std::string p = tmp("eng");
    ds4::synth_write(p, small_geometry(), {});
    std::vector<int32_t> toks(40);
    for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>((i * 37 + 11) % 300);
    std::vector<float> l[2];
    for (int exact = 0; exact < 2; ++exact) {
        engine_options o;
        o.model_path = p;
        o.n_threads = 2;
        o.exact = exact == 1;
        o.ds4_qat = "off";  // QAT roundings would turn tiny differences into FP8-step ones
        auto e = engine::load(o);
        EXPECT_EQ(e->bos_token(), 0);
        EXPECT_EQ(e->tokenize("hi", false, false).size(), 2u);  // byte tokens, no merges
        auto s = e->new_session();
        l[exact].resize(toks.size() * 300);
        s->eval(toks, l[exact].data());
    }
    // Per position: relative L2 distance and argmax agreement. A discrete choice (router or indexer
    // top-k) flipped by the rounding may move a single position far, so the median is bounded.
    std::vector<double> rel;
    int same_top1 = 0;
    for (size_t i = 0; i < toks.size(); ++i) {
        const float *a = &l[0][i * 300], *b = &l[1][i * 300];
        double num = 0, den = 0;
        for (int j = 0; j < 300; ++j) {
            ASSERT_TRUE(std::isfinite(a[j]));
            num += double(a[j] - b[j]) * (a[j] - b[j]);
            den += double(b[j]) * b[j];
        }
        rel.push_back(std::sqrt(num / den));
        same_top1 += std::max_element(a, a + 300) - a == std::max_element(b, b + 300) - b;
    }
    std::sort(rel.begin(), rel.end());
    EXPECT_LT(rel[rel.size() / 2], 0.04);  // measured ~0.018
    EXPECT_GT(rel[0], 0.0);                // the quantised path was taken
    EXPECT_GE(same_top1, 32);              // of 40
    std::filesystem::remove(p);
}

// The K-quant mixes (the q4 / Q4_K_M-style files the CUDA K-quant kernels are tested on): each
// class of tensor stores the documented type (rows that are not whole 256-blocks fall back to Q8_0),
// and the CPU engine's quantised path (Q8_K activations) stays close to its exact path on them.
TEST(ds4_synth, kquant_mix_types_and_engine) {
    struct mix_t {
        const char *name;
        dtype gu, dn, dense;
    };
    for (const mix_t mx : {mix_t{"q4k", dtype::q4_k, dtype::q6_k, dtype::q4_k},
                           mix_t{"q3k", dtype::q3_k, dtype::q5_k, dtype::q3_k}}) {
        SCOPED_TRACE(mx.name);
        const std::string p = tmp(mx.name);
        ds4::synth_options o;
        o.mix = mx.name;
        ds4::synth_write(p, small_geometry(), o);
        {
            const auto f = gguf::file::open(p);
            EXPECT_EQ(f->tensor("blk.3.ffn_gate_exps.weight").type, mx.gu);
            EXPECT_EQ(f->tensor("blk.3.ffn_up_exps.weight").type, mx.gu);
            EXPECT_EQ(f->tensor("blk.3.ffn_down_exps.weight").type, mx.dn);
            EXPECT_EQ(f->tensor("blk.3.ffn_gate_shexp.weight").type, mx.dense);
            EXPECT_EQ(f->tensor("blk.3.attn_q_a.weight").type, mx.dense);  // rows of 256
            EXPECT_EQ(f->tensor("blk.3.attn_q_b.weight").type, dtype::q8_0);  // rows of q_lora = 64
            EXPECT_EQ(f->tensor("token_embd.weight").type, mx.dense);
            EXPECT_EQ(f->tensor("output.weight").type, dtype::q6_k);
            EXPECT_EQ(f->tensor("blk.2.indexer.proj.weight").type, dtype::f16);
        }
        std::vector<int32_t> toks(24);
        for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>((i * 37 + 11) % 300);
        std::vector<float> l[2];
        for (int exact = 0; exact < 2; ++exact) {
            engine_options eo;
            eo.model_path = p;
            eo.n_threads = 2;
            eo.exact = exact == 1;
            eo.ds4_qat = "off";
            auto e = engine::load(eo);
            auto s = e->new_session();
            l[exact].resize(toks.size() * 300);
            s->eval(toks, l[exact].data());
        }
        std::vector<double> rel;
        for (size_t i = 0; i < toks.size(); ++i) {
            const float *a = &l[0][i * 300], *b = &l[1][i * 300];
            double num = 0, den = 0;
            for (int j = 0; j < 300; ++j) {
                ASSERT_TRUE(std::isfinite(a[j]) && std::isfinite(b[j]));
                num += double(a[j] - b[j]) * (a[j] - b[j]);
                den += double(b[j]) * b[j];
            }
            rel.push_back(std::sqrt(num / den));
        }
        std::sort(rel.begin(), rel.end());
        EXPECT_LT(rel[rel.size() / 2], 0.04);  // the q2 mix's bound (Q8_K activations)
        EXPECT_GT(rel[0], 0.0);                // the quantised path was taken
        std::filesystem::remove(p);
    }
}

TEST(ds4_synth, presets_and_errors) {
    const ds4::hparams f = ds4::synth_preset("flash");
    EXPECT_EQ(f.n_layer, 43);
    EXPECT_EQ(f.n_embd, 4096);
    EXPECT_EQ(f.n_expert, 256);
    EXPECT_EQ(f.n_vocab, 129280);
    EXPECT_EQ(f.compress_ratio[2], 4);
    EXPECT_EQ(f.compress_ratio[41], 128);
    EXPECT_EQ(f.compress_ratio[42], 4);
    EXPECT_NO_THROW(ds4::synth_check(f));
    EXPECT_THROW(ds4::synth_preset("pro"), error);
    ds4::hparams hp = ds4::synth_preset("tiny");
    hp.n_vocab = 100;
    EXPECT_THROW(ds4::synth_write(tmp("bad"), hp, {}), error);
    ds4::synth_options o;
    o.mix = "q3";
    EXPECT_THROW(ds4::synth_write(tmp("bad"), ds4::synth_preset("tiny"), o), error);
    std::filesystem::remove(tmp("bad"));
}

}  // namespace

namespace {

// --sparse: pooled tensors keep their pool rows (the same P rows the dense file draws from), the rest
// is a file hole (zeros when read), the key tells the CUDA loader to replicate, the file takes far
// less disk than its size, and the CPU engine refuses it with a clear message.
TEST(ds4_synth, sparse_file_holes_and_cpu_refusal) {
    ds4::hparams hp = small_geometry();
    hp.n_expert = 64;  // expert banks of 64 x 256 rows: far more than the pool
    ds4::synth_options o;
    o.seed = 3;
    o.pool_rows = 16;
    o.sparse = true;
    const std::string p = tmp("sparse");
    ds4::synth_write(p, hp, o);
    const auto f = gguf::file::open(p);
    EXPECT_EQ(f->get_int("fathom.synth.replicate_rows"), 16);
    const gguf::tensor_info *t = nullptr;
    for (const auto &ti : f->tensors())
        if (ti.name == "blk.3.ffn_gate_exps.weight") t = &ti;
    ASSERT_NE(t, nullptr);
    const size_t rb = dtype_row_bytes(t->type, t->ne[0]);
    const size_t rows = static_cast<size_t>(t->ne[1] * t->ne[2]);
    ASSERT_GT(rows, 16u);
    // rows 0..15 hold quantised random values, every later byte is zero
    EXPECT_TRUE(std::any_of(t->data, t->data + 16 * rb, [](uint8_t b) { return b != 0; }));
    EXPECT_TRUE(std::all_of(t->data + 16 * rb, t->data + rows * rb, [](uint8_t b) { return b == 0; }));
    // blocks actually allocated on disk: well under the apparent size (holes)
    struct stat sb{};
    ASSERT_EQ(stat(p.c_str(), &sb), 0);
    EXPECT_LT(static_cast<uint64_t>(sb.st_blocks) * 512, static_cast<uint64_t>(sb.st_size) / 2)
        << "apparent " << sb.st_size << " bytes";
    engine_options eo;
    eo.model_path = p;
    try {
        (void)engine::load(eo);
        FAIL() << "the CPU engine accepted a sparse synthetic file";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("sparse synthetic"), std::string::npos) << e.what();
    }
    ds4::synth_options bad = o;
    bad.pool_rows = 0;
    EXPECT_THROW(ds4::synth_write(tmp("sparse_bad"), hp, bad), error);
    std::filesystem::remove(p);
}

}  // namespace
