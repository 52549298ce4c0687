// `fathom-gguf synth --mtp` (ds4::synth_options::mtp): a synthetic target with one MTP (nextn) block in
// llama.cpp's layout, against independent truth:
//  * layout: the keys and the MTP tensors' names and shapes are those of the golden llama.cpp MTP file
//    (../shared/golden/ds4-tiny/ds4-tiny-a-mtp.gguf, written by llama.cpp's converter layout) at the same
//    geometry; the MTP tensors' values follow the documented init distributions (deepseek4_synth.cpp banner);
//  * the main model of an --mtp file is the file without it: the same logits, bit for bit;
//  * the head (ds4::load_mtp from the same file) binds the file's tensors, and its forward gives finite logits
//    that depend on its inputs (not the main model's logits), the same for all rows at once as one by one;
//  * `--spec mtp` with the head picked from the model file: speculative decoding gives the tokens of plain
//    decoding on an engine without a drafter (greedy and sampled; fixed width, so every step drafts);
//  * without --mtp: no head, and --spec mtp fails with the engine's clear error; --mtp does not apply to a
//    DSpark drafter; a sparse --mtp file loads through ds4::load_model + ds4::load_mtp (the CUDA bench's host
//    path; the CPU engine refuses sparse files, tests/models/ds4/test_ds4_synth.cpp).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "engine/ds4_spec_util.h"
#include "fathom/engine.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"
#include "models/deepseek4_mtp.h"
#include "models/deepseek4_synth.h"
#include "models/ds4/golden_util.h"

namespace {

using namespace fathom;

std::string tmp(const std::string &name) {
    return (std::filesystem::temp_directory_path() /
            ("ds4_synth_mtp_" + std::to_string(::getpid()) + "_" + name + ".gguf"))
        .string();
}

// The tiny preset (ds4-tiny-a's geometry) written with and without the MTP block, seed 5, once per run.
struct files {
    std::string with, without;
    files() : with(tmp("with")), without(tmp("without")) {
        ds4::synth_options o;
        o.seed = 5;
        ds4::synth_write(without, ds4::synth_preset("tiny"), o);
        o.mtp = true;
        ds4::synth_write(with, ds4::synth_preset("tiny"), o);
    }
    ~files() {
        std::filesystem::remove(with);
        std::filesystem::remove(without);
    }
};
const files &tiny() {
    static files f;
    return f;
}

const std::vector<int32_t> kPrompt = {0, 17, 300, 5, 42, 42, 511, 2, 9, 100, 101, 102, 7, 7, 8, 1, 64, 65, 66, 3};

std::map<std::string, std::vector<int64_t>> shapes(const gguf::file &f, const std::string &prefix) {
    std::map<std::string, std::vector<int64_t>> out;
    for (const auto &t : f.tensors())
        if (std::string(t.name).rfind(prefix, 0) == 0) out[std::string(t.name)] = std::vector<int64_t>(t.ne, t.ne + t.n_dims);
    return out;
}

std::vector<float> values(const gguf::tensor_info &t) {
    std::vector<float> v(static_cast<size_t>(t.nelements()));
    const int64_t row = t.ne[0], rows = t.nelements() / row;
    const size_t rb = dtype_row_bytes(t.type, row);
    for (int64_t r = 0; r < rows; ++r) cpu::dequantize_row(t.type, t.data + r * rb, &v[static_cast<size_t>(r * row)], row);
    return v;
}

TEST(ds4_synth_mtp, layout_is_llama_cpp_mtp_layout) {
    const auto f = gguf::file::open(tiny().with);
    const auto g = gguf::file::open(ds4_test::golden_dir() + "/ds4-tiny-a-mtp.gguf");
    for (const char *k : {"deepseek4.block_count", "deepseek4.nextn_predict_layers"})
        EXPECT_EQ(f->get_int(k), g->get_int(k)) << k;
    EXPECT_EQ(f->get_int("deepseek4.block_count"), 7);
    const auto ratios = f->get_int_array("deepseek4.attention.compress_ratios");
    ASSERT_EQ(ratios.size(), 7u);
    EXPECT_EQ(ratios.back(), 0);
    EXPECT_EQ(f->get_float_array("deepseek4.swiglu_clamp_exp"), g->get_float_array("deepseek4.swiglu_clamp_exp"));
    EXPECT_EQ(f->get_float_array("deepseek4.swiglu_clamp_shexp"), g->get_float_array("deepseek4.swiglu_clamp_shexp"));
    // every MTP tensor of the golden file, by name and shape, and no other blk.6 tensor
    EXPECT_EQ(shapes(*f, "blk.6."), shapes(*g, "blk.6."));
    EXPECT_EQ(shapes(*f, "output_hc_"), shapes(*g, "output_hc_"));
    // the file without --mtp has none of it
    const auto w = gguf::file::open(tiny().without);
    EXPECT_FALSE(w->has("deepseek4.nextn_predict_layers"));
    EXPECT_EQ(w->get_int("deepseek4.block_count"), 6);
    EXPECT_TRUE(shapes(*w, "blk.6.").empty());
}

TEST(ds4_synth_mtp, values_follow_the_documented_distributions_and_seed) {
    const auto f = gguf::file::open(tiny().with);
    const auto eh = values(f->tensor("blk.6.nextn.eh_proj.weight"));  // linear: N(0, 1 / fan_in), fan_in 2D = 256
    double s = 0, ss = 0;
    for (float x : eh) s += x, ss += static_cast<double>(x) * x;
    const double n = static_cast<double>(eh.size()), mean = s / n, var = ss / n - mean * mean;
    EXPECT_NEAR(mean, 0.0, 0.003);
    EXPECT_NEAR(var * 256.0, 1.0, 0.1);
    for (const char *norm : {"blk.6.nextn.enorm.weight", "blk.6.nextn.hnorm.weight", "blk.6.nextn.shared_head_norm.weight",
                             "blk.6.attn_norm.weight"}) {  // 1 + U(-0.1, 0.1)
        const auto v = values(f->tensor(norm));
        EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x >= 0.9f && x <= 1.1f; })) << norm;
        EXPECT_GT(*std::max_element(v.begin(), v.end()) - *std::min_element(v.begin(), v.end()), 0.1f) << norm;
    }
    const auto b = values(f->tensor("blk.6.exp_probs_b.bias"));  // router bias 0.1 U(-1, 1)
    EXPECT_TRUE(std::all_of(b.begin(), b.end(), [](float x) { return std::fabs(x) <= 0.1f; }));
    EXPECT_GT(*std::max_element(b.begin(), b.end()) - *std::min_element(b.begin(), b.end()), 0.02f);
    // the seed decides the MTP block too; the same seed, the same bytes
    ds4::synth_options o;
    o.seed = 5;
    o.mtp = true;
    const std::string again = tmp("again"), other = tmp("other");
    ds4::synth_write(again, ds4::synth_preset("tiny"), o);
    o.seed = 6;
    ds4::synth_write(other, ds4::synth_preset("tiny"), o);
    const auto a = gguf::file::open(again), c = gguf::file::open(other);
    const auto &t5 = f->tensor("blk.6.nextn.eh_proj.weight");
    EXPECT_EQ(std::memcmp(a->tensor("blk.6.nextn.eh_proj.weight").data, t5.data, t5.nbytes), 0);
    EXPECT_NE(std::memcmp(c->tensor("blk.6.nextn.eh_proj.weight").data, t5.data, t5.nbytes), 0);
    std::filesystem::remove(again);
    std::filesystem::remove(other);
}

std::vector<float> main_logits(const ds4::model &m, const std::vector<int32_t> &toks, std::vector<float> *hc = nullptr) {
    ds4::state st = ds4::new_state(m, ds4::qat_mode::full, kv_precision::f32);
    std::vector<int64_t> pos(toks.size());
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<float> l(toks.size() * static_cast<size_t>(m.hp.n_vocab));
    if (hc) hc->resize(toks.size() * static_cast<size_t>(m.hp.n_hc * m.hp.n_embd));
    ds4::forward(m, st, toks, pos, {l, hc ? std::span<float>(*hc) : std::span<float>()});
    return l;
}

TEST(ds4_synth_mtp, main_model_is_the_file_without_mtp) {
    const auto a = ds4::load_model(tiny().with), b = ds4::load_model(tiny().without);
    EXPECT_EQ(a->hp.n_layer, 6);
    EXPECT_EQ(a->hp.n_nextn, 1);
    EXPECT_EQ(b->hp.n_nextn, 0);
    const auto la = main_logits(*a, kPrompt), lb = main_logits(*b, kPrompt);
    EXPECT_EQ(la, lb);
    for (float x : la) ASSERT_TRUE(std::isfinite(x));
}

TEST(ds4_synth_mtp, head_loads_from_the_same_file_and_runs) {
    const auto m = ds4::load_model(tiny().with);
    const auto w = ds4::load_mtp(*m, m->file);
    const gguf::file &f = *m->file;
    const int64_t D = m->hp.n_embd, S = m->hp.n_hc * D, V = m->hp.n_vocab;
    // the head binds the file's tensors (llama.cpp names): eh_proj split at column D, the shared HC collapse
    const auto &eh = f.tensor("blk.6.nextn.eh_proj.weight");
    EXPECT_EQ(w->e_proj.data, eh.data);
    EXPECT_EQ(w->h_proj.data, eh.data + dtype_row_bytes(eh.type, D));
    EXPECT_EQ(w->hc_head.fn.data, f.tensor("output_hc_fn.weight").data);
    EXPECT_EQ(w->block.ratio, 0);
    EXPECT_FALSE(w->block.hash);
    EXPECT_EQ(w->block.exp_bias, values(f.tensor("blk.6.exp_probs_b.bias")));
    EXPECT_EQ(w->block.gate_exps.first.data, f.tensor("blk.6.ffn_gate_exps.weight").data);
    // rows (H_i, t_(i+1)) of the prompt: all at once and one by one
    std::vector<float> hc;
    const auto main_l = main_logits(*m, kPrompt, &hc);
    const size_t n = kPrompt.size();
    std::vector<int32_t> next(kPrompt.begin() + 1, kPrompt.end());
    next.push_back(77);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<float> all(n * static_cast<size_t>(V)), one(static_cast<size_t>(V));
    ds4::mtp_state st = ds4::new_mtp_state(*m, *w, ds4::qat_mode::full, kv_precision::f32);
    ds4::mtp_forward(*m, *w, st, hc, next, pos, all);
    ds4::mtp_state st1 = ds4::new_mtp_state(*m, *w, ds4::qat_mode::full, kv_precision::f32);
    for (size_t i = 0; i < n; ++i) {
        const auto row = std::span<const float>(all).subspan(i * static_cast<size_t>(V), static_cast<size_t>(V));
        for (float x : row) ASSERT_TRUE(std::isfinite(x)) << "row " << i;
        ds4::mtp_forward(*m, *w, st1, std::span<const float>(hc).subspan(i * static_cast<size_t>(S), static_cast<size_t>(S)),
                         std::span<const int32_t>(&next[i], 1), std::span<const int64_t>(&pos[i], 1), one);
        double d = 0, mag = 0, dmain = 0, dprev = 0;
        for (int64_t v = 0; v < V; ++v) {
            const size_t k = i * static_cast<size_t>(V) + static_cast<size_t>(v);
            d = std::max(d, static_cast<double>(std::fabs(one[static_cast<size_t>(v)] - all[k])));
            mag = std::max(mag, static_cast<double>(std::fabs(all[k])));
            dmain = std::max(dmain, static_cast<double>(std::fabs(main_l[k] - all[k])));
            if (i > 0) dprev = std::max(dprev, static_cast<double>(std::fabs(all[k - static_cast<size_t>(V)] - all[k])));
        }
        EXPECT_GT(mag, 1e-2) << "row " << i;            // not a collapsed head
        EXPECT_LE(d, 1e-4 * mag) << "row " << i;         // one by one = all at once
        EXPECT_GT(dmain, 1e-2 * mag) << "row " << i;     // its own module, not the main model's logits
        if (i > 0) {
            EXPECT_GT(dprev, 1e-3 * mag) << "row " << i;  // each row from its own inputs
        }
    }
}

engine_options opts(const std::string &model, const std::string &draft) {
    engine_options o;
    o.model_path = model;
    o.n_threads = 2;
    o.n_ctx = 512;
    o.kv = kv_precision::f32;
    o.ds4_draft = draft;
    return o;
}

TEST(ds4_synth_mtp, speculation_with_the_files_own_head_is_plain_decoding) {
    auto plain_e = engine::load(opts(tiny().with, ""));
    auto spec_e = engine::load(opts(tiny().with, "mtp"));  // no ds4_draft_model: the head from the model file
    EXPECT_FALSE(plain_e->new_session()->has_drafter());
    for (int k = 0; k < 2; ++k) {
        const sampling_params p = ds4_test::greedy_or_sampled(k == 1);
        const auto plain = ds4_test::generate(*plain_e, kPrompt, p, 120, false);
        spec::spec_stats st;
        EXPECT_EQ(ds4_test::generate(*spec_e, kPrompt, p, 120, true, &st), plain) << (k ? "sampled" : "greedy");
        EXPECT_GT(st.drafted, 80) << (k ? "sampled" : "greedy");  // width 4: every step drafted
    }
}

TEST(ds4_synth_mtp, without_mtp_there_is_no_head) {
    const auto m = ds4::load_model(tiny().without);
    EXPECT_THROW(ds4::load_mtp(*m, m->file), error);
    try {
        (void)engine::load(opts(tiny().without, "mtp"));
        FAIL() << "--spec mtp accepted a file without an MTP head";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("no usable MTP head"), std::string::npos) << e.what();
    }
    ds4::synth_options o;
    o.mtp = true;
    const ds4::hparams hp = ds4::synth_preset("tiny");
    EXPECT_THROW(ds4::synth_write_dspark(tmp("dspark"), hp, ds4::synth_dspark_preset("tiny", hp), o), error);
    ds4::hparams counted = hp;
    counted.n_nextn = 1;  // a geometry that counts MTP blocks is not a synth geometry (the option adds one)
    EXPECT_THROW(ds4::synth_write(tmp("counted"), counted, o), error);
}

TEST(ds4_synth_mtp, sparse_file_with_head_loads_on_the_host) {
    ds4::hparams hp = ds4::synth_preset("tiny");
    hp.n_expert = 64;  // expert banks of 64 x 48 rows: pooled and sparse
    ds4::synth_fix_layers(hp, 1.5f);
    ds4::synth_options o;
    o.pool_rows = 16;
    o.sparse = true;
    o.mtp = true;
    const std::string p = tmp("sparse");
    ds4::synth_write(p, hp, o);
    const auto m = ds4::load_model(p);
    const auto w = ds4::load_mtp(*m, m->file);
    EXPECT_EQ(m->file->get_int("fathom.synth.replicate_rows"), 16);
    // the MTP experts are stored like the main blocks': the pool rows, then a hole
    const ds4::expert_bank &g = w->block.gate_exps;
    const size_t pool = 16 * g.first.row_bytes, all = g.expert_bytes * static_cast<size_t>(g.n);
    EXPECT_TRUE(std::any_of(g.first.data, g.first.data + pool, [](uint8_t x) { return x != 0; }));
    EXPECT_TRUE(std::all_of(g.first.data + pool, g.first.data + all, [](uint8_t x) { return x == 0; }));
    std::filesystem::remove(p);
}

}  // namespace
