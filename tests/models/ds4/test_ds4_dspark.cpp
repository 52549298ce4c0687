// ds4-tiny-a DSpark drafter against ../shared/golden/ds4-tiny-dspark/dspark_cases.jsonl (its README is
// normative): feature-fed (all 6 cases, the golden `main_hidden` as features, teacher-forced and
// greedy Markov chain) and end-to-end (strict cases: the target run here, its layer 3/4/5 stream means
// captured by ds4::dspark_capture in prefill, decode and chunks of 7). Controls that must fail (seed, Markov
// input, window, capture point and stream mean), and bad drafter files (geometry / vocabulary of another
// target, missing or transposed tensor, bad keys, truncated file).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>

#include "core/error.h"
#include "gguf/gguf.h"
#include "dspark_golden.h"
#include "golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_synth.h"
#include "rewrite_util.h"

namespace {

using namespace fathom;
using namespace ds4_test;

struct fixture_data {
    std::unique_ptr<ds4::model> target;
    std::unique_ptr<ds4::dspark_weights> drafter;
    std::vector<dspark_case> cases;
};

const fixture_data &data() {
    static fixture_data d = [] {
        fixture_data f;
        f.target = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
        f.drafter = ds4::load_dspark(*f.target, dspark_dir() + "/ds4-tiny-a-dspark.gguf");
        f.cases = load_dspark_cases();
        return f;
    }();
    return d;
}

ds4::dspark_block feature_fed(const dspark_case &c, int32_t seed, std::span<const int32_t> forced,
                              const ds4::dspark_weights *w = nullptr) {
    const fixture_data &d = data();
    return ds4::dspark_draft(*d.target, w ? *w : *d.drafter, c.qat, {}, c.main_hidden,
                             c.ctx_positions.front(), seed, forced);
}

// Target run over the case's tokens in chunks of `chunk` with `w`'s capture layers -> [S, F] features.
std::vector<float> capture(const dspark_case &c, size_t chunk, const ds4::dspark_weights &w) {
    const ds4::model &m = *data().target;
    ds4::state st = ds4::new_state(m, c.qat, kv_precision::f32);
    const size_t n = c.tokens.size(), F = static_cast<size_t>(w.feature_dim());
    std::vector<float> feat(n * F);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    for (size_t b = 0; b < n; b += chunk) {
        const size_t e = std::min(n, b + chunk);
        ds4::dspark_capture(m, w, st, std::span(c.tokens).subspan(b, e - b), std::span(pos).subspan(b, e - b),
                            std::span(feat).subspan(b * F, (e - b) * F));
    }
    return feat;
}

TEST(ds4_dspark, reads_config_from_metadata) {
    const ds4::dspark_config &c = data().drafter->cfg;
    EXPECT_EQ(c.n_stages, 3);
    EXPECT_EQ(c.block_size, 5);
    EXPECT_EQ(c.noise_token, 511);
    EXPECT_EQ(c.window, 32);
    EXPECT_EQ(c.markov_rank, 32);
    EXPECT_EQ(c.target_layers, (std::vector<int>{3, 4, 5}));
    EXPECT_EQ(data().drafter->feature_dim(), 384);
    EXPECT_FLOAT_EQ(data().drafter->stages[1].clamp, 1.5f);
    EXPECT_EQ(data().drafter->conf_bias, 0.0f);
}

TEST(ds4_dspark, golden_feature_fed) {
    const int V = data().target->hp.n_vocab;
    ASSERT_EQ(data().cases.size(), 6u);
    for (const auto &c : data().cases) {
        const auto forced = feature_fed(c, c.seed, c.markov_prev);
        EXPECT_EQ(forced.input_ids, c.block_input_ids) << c.name;
        EXPECT_EQ(forced.ctx_positions, c.ctx_positions) << c.name;
        EXPECT_EQ(forced.seed_pos, static_cast<int64_t>(c.tokens.size())) << c.name;
        const dspark_verdict v = compare(c, forced, V);
        EXPECT_TRUE(v.ok) << c.name << " (teacher-forced): " << v.why;
        const dspark_verdict g = compare(c, feature_fed(c, c.seed, {}), V);
        EXPECT_TRUE(g.ok) << c.name << " (greedy chain): " << g.why;
        std::printf("  %-22s feature-fed  max top-8 err %.3g  max conf-logit err %.3g\n", c.name.c_str(),
                    v.max_top8, v.max_conf);
    }
}

TEST(ds4_dspark, golden_end_to_end) {
    const fixture_data &d = data();
    const int V = d.target->hp.n_vocab;
    int n_strict = 0;
    for (const auto &c : d.cases) {
        if (!c.end_to_end) continue;
        ++n_strict;
        const size_t n = c.tokens.size();
        std::vector<float> first;  // the prefill's features: every chunking gives the same bits
        for (size_t chunk : {n, size_t{1}, size_t{7}}) {  // prefill, decode, chunks of 7
            const std::vector<float> feat = capture(c, chunk, *d.drafter);
            if (first.empty()) first = feat;
            EXPECT_EQ(feat, first) << c.name << " chunk " << chunk;
            // The captured features of the context positions against the golden main_hidden.
            const size_t F = 384, c0 = static_cast<size_t>(c.ctx_positions.front());
            double fe = 0;
            for (size_t i = 0; i < c.main_hidden.size(); ++i)
                fe = std::max(fe, std::fabs(static_cast<double>(feat[c0 * F + i]) - c.main_hidden[i]));
            const auto b = ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, feat, 0, c.seed);
            const dspark_verdict v = compare(c, b, V);
            // Only the window is read: its rows alone give the same block, bit for bit.
            const auto w =
                ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, std::span(feat).subspan(c0 * F),
                                  static_cast<int64_t>(c0), c.seed);
            EXPECT_EQ(w.corrected_logits, b.corrected_logits) << c.name;
            EXPECT_EQ(w.confidence_logit, b.confidence_logit) << c.name;
            EXPECT_TRUE(v.ok) << c.name << " chunk " << chunk << ": " << v.why;
            std::printf(
                "  %-22s end-to-end chunk %3zu  max feature err %.3g  max top-8 err %.3g  conf %.3g\n",
                c.name.c_str(), chunk, fe, v.max_top8, v.max_conf);
        }
    }
    EXPECT_EQ(n_strict, 4);
}

// The capture must return forward()'s logits bit for bit (it composes the same pieces).
TEST(ds4_dspark, capture_keeps_forward_logits) {
    const fixture_data &d = data();
    const auto &c = d.cases[1];  // len67.no_qat
    const ds4::model &m = *d.target;
    const size_t n = c.tokens.size(), V = static_cast<size_t>(m.hp.n_vocab);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<float> a(n * V), b(n * V), feat(n * 384);
    ds4::state s1 = ds4::new_state(m, c.qat, kv_precision::f32), s2 = s1;
    ds4::forward(m, s1, c.tokens, pos, {a, {}});
    ds4::dspark_capture(m, *d.drafter, s2, c.tokens, pos, feat, b);
    EXPECT_EQ(a, b);
    EXPECT_EQ(s2.n_past, static_cast<int64_t>(n));
}

// ---- controls: wrong conventions must fail the comparison -----------------------------------------

TEST(ds4_dspark, wrong_conventions_fail) {
    const fixture_data &d = data();
    const int V = d.target->hp.n_vocab;
    for (const auto &c : d.cases) {
        // seed = the last prompt token instead of the next one
        EXPECT_FALSE(compare(c, feature_fed(c, c.tokens.back(), {}), V).ok) << c.name;
        // Markov bias from x_(j+1) instead of x_j (teacher-forced with the draft tokens)
        const dspark_verdict m = compare(c, feature_fed(c, c.seed, c.draft_tokens), V);
        EXPECT_FALSE(m.ok) << c.name;
        // context window of window-1 rows (only cases whose context is a full window)
        if (c.ctx_positions.size() == 32) {
            const auto tail = std::span(c.main_hidden).subspan(384);
            const auto b =
                ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, tail, c.ctx_positions[1], c.seed);
            EXPECT_FALSE(compare(c, b, V).ok) << c.name << " (window 31)";
        }
        // the other QAT mode's FP8 rule inside the drafter
        const ds4::qat_mode other = c.qat == ds4::qat_mode::full ? ds4::qat_mode::off : ds4::qat_mode::full;
        const auto q = ds4::dspark_draft(*d.target, *d.drafter, other, {}, c.main_hidden,
                                         c.ctx_positions.front(), c.seed);
        EXPECT_FALSE(compare(c, q, V).ok) << c.name << " (other QAT mode)";
    }
}

TEST(ds4_dspark, wrong_capture_point_fails_end_to_end) {
    const fixture_data &d = data();
    const auto &c = d.cases[0];  // len5.no_qat
    ASSERT_TRUE(c.end_to_end);
    // Features = the *input* of layers 3, 4, 5 (the output of 2, 3, 4: the V4.1 convention).
    ds4::dspark_weights shifted = *d.drafter;
    shifted.cfg.target_layers = {2, 3, 4};
    const auto b =
        ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, capture(c, c.tokens.size(), shifted), 0, c.seed);
    EXPECT_FALSE(compare(c, b, d.target->hp.n_vocab).ok);
}

// ---- bad drafter files --------------------------------------------------------------------------

using key_edits = ds4_test::key_edits;

// A copy of the golden drafter with edited keys (null fn: drop) and tensors.
std::string rewrite_drafter(const std::string &name, const key_edits &keys,
                            const ds4_test::tensor_fn &tensors) {
    const auto src = gguf::file::open(dspark_dir() + "/ds4-tiny-a-dspark.gguf");
    const std::string path =
        (std::filesystem::temp_directory_path() / ("ds4_dspark_" + name + ".gguf")).string();
    gguf::writer w(path);
    for (const auto &kv : src->metadata()) {
        const std::string k(kv.key);
        if (auto it = keys.find(k); it != keys.end()) {
            if (it->second) it->second(w);
        } else {
            ds4_test::copy_value(w, k, kv.val);
        }
    }
    std::vector<ds4_test::tensor_out> outs;
    for (const auto &t : src->tensors()) {
        ds4_test::tensor_out o = tensors ? tensors(t) : ds4_test::copy_tensor(t);
        if (o.drop) continue;
        w.add_tensor(std::string(t.name), o.type, o.ne);
        outs.push_back(std::move(o));
    }
    w.write_header();
    for (auto &o : outs) w.write_tensor_data(o.bytes.data(), o.bytes.size());
    w.finish();
    return path;
}

// load_dspark(target, path) must throw a message containing `needle`.
void expect_load_error(const ds4::model &target, const std::string &path, const std::string &needle) {
    try {
        ds4::load_dspark(target, path);
        ADD_FAILURE() << path << " loaded; expected an error naming " << needle;
    } catch (const fathom::error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << "multi-line: " << msg;
    }
}

const std::string P = "deepseek4-dflash-draft.";

TEST(ds4_dspark, rewritten_copy_loads) {  // control: the rewrite itself is faithful
    const std::string p = rewrite_drafter("copy", {}, {});
    const auto w = ds4::load_dspark(*data().target, p);
    const auto &c = data().cases[0];
    EXPECT_TRUE(compare(c, ds4::dspark_draft(*data().target, *w, c.qat, {}, c.main_hidden, 0, c.seed),
                        data().target->hp.n_vocab)
                    .ok);
    std::filesystem::remove(p);
}

TEST(ds4_dspark, rejects_bad_files) {
    const ds4::model &t = *data().target;
    struct bad {
        std::string name;
        key_edits keys;
        ds4_test::tensor_fn tensors;
        std::string needle;
    };
    auto drop = [](const std::string &victim) {
        return [victim](const gguf::tensor_info &ti) {
            ds4_test::tensor_out o = ds4_test::copy_tensor(ti);
            o.drop = std::string(ti.name) == victim;
            return o;
        };
    };
    auto transpose = [](const std::string &victim) {  // same bytes, ne swapped: {r, V} -> {V, r}
        return [victim](const gguf::tensor_info &ti) {
            ds4_test::tensor_out o = ds4_test::copy_tensor(ti);
            if (std::string(ti.name) == victim) std::swap(o.ne[0], o.ne[1]);
            return o;
        };
    };
    auto u32 = [](const std::string &k, uint32_t v) { return [k, v](gguf::writer &w) { w.set_u32(k, v); }; };
    const std::vector<bad> cases = {
        {"dim", {{P + "embedding_length", u32(P + "embedding_length", 256)}}, {}, "embedding_length"},
        {"vocab", {{P + "vocab_size", u32(P + "vocab_size", 513)}}, {}, "vocab_size"},
        {"noise",
         {{P + "dflash.mask_token_id", u32(P + "dflash.mask_token_id", 512)}},
         {},
         "dflash.mask_token_id"},
        {"rank", {{P + "dflash.dspark.markov_rank", nullptr}}, {}, "dflash.dspark.markov_rank"},
        {"layers",
         {{P + "dflash.capture_layer_ids",
           [](gguf::writer &w) {
               w.set_arr_i32(P + "dflash.capture_layer_ids", {3, 4, 6});
           }}},
         {},
         "dflash.capture_layer_ids"},
        {"ratios",
         {{P + "attention.compress_ratios",
           [](gguf::writer &w) {
               w.set_arr_i32(P + "attention.compress_ratios", {0, 4, 0});
           }}},
         {},
         "attention.compress_ratios"},
        {"clamp", {{P + "swiglu_clamp_exp", nullptr}}, {}, "swiglu_clamp_exp"},
        {"arch",
         {{"general.architecture",
           [](gguf::writer &w) { w.set_string("general.architecture", "deepseek4"); }}},
         {},
         "general.architecture"},
        {"missing_w2", {}, drop("dflash.dspark.markov.w2"), "dflash.dspark.markov.w2"},
        {"missing_stage", {}, drop("blk.2.attn_kv.weight"), "blk.2.attn_kv.weight"},
        {"missing_fc", {}, drop("dflash.fc.weight"), "dflash.fc.weight"},
        {"transposed_w1", {}, transpose("dflash.dspark.markov.w1"), "dflash.dspark.markov.w1"},
    };
    for (const auto &b : cases) {
        const std::string p = rewrite_drafter(b.name, b.keys, b.tensors);
        expect_load_error(t, p, b.needle);
        std::filesystem::remove(p);
    }
    // The target file itself is not a drafter.
    expect_load_error(t, ds4_test::golden_dir() + "/ds4-tiny-a.gguf", "deepseek4-dflash-draft");
}

TEST(ds4_dspark, rejects_truncated_file) {
    const std::string src = dspark_dir() + "/ds4-tiny-a-dspark.gguf";
    const std::string p = (std::filesystem::temp_directory_path() / "ds4_dspark_truncated.gguf").string();
    std::filesystem::copy_file(src, p, std::filesystem::copy_options::overwrite_existing);
    std::filesystem::resize_file(p, std::filesystem::file_size(src) - 4096);  // tensor data cut short
    EXPECT_THROW(ds4::load_dspark(*data().target, p), fathom::error);
    std::filesystem::remove(p);
}

// A real target of another geometry: the golden drafter does not fit it.
TEST(ds4_dspark, rejects_other_targets) {
    const std::string dir = std::filesystem::temp_directory_path().string();
    auto target_with = [&](const std::string &name, auto edit) {
        ds4::hparams hp = ds4::synth_preset("tiny");
        edit(hp);
        const std::string p = dir + "/ds4_dspark_target_" + name + ".gguf";
        ds4::synth_options o;
        o.mix = "f32";
        ds4::synth_write(p, hp, o);
        auto m = ds4::load_model(p);
        std::filesystem::remove(p);
        return m;
    };
    const auto vocab = target_with("vocab", [](ds4::hparams &hp) { hp.n_vocab = 300; });
    expect_load_error(*vocab, dspark_dir() + "/ds4-tiny-a-dspark.gguf", "vocab_size");
    const auto dim = target_with("dim", [](ds4::hparams &hp) { hp.n_embd = 256; });
    expect_load_error(*dim, dspark_dir() + "/ds4-tiny-a-dspark.gguf", "embedding_length");
    const auto shallow = target_with("layers", [](ds4::hparams &hp) {
        hp.n_layer = 4;
        ds4::synth_fix_layers(hp, 1.5f);
    });
    expect_load_error(*shallow, dspark_dir() + "/ds4-tiny-a-dspark.gguf", "dflash.capture_layer_ids");
}

TEST(ds4_dspark, rejects_bad_draft_inputs) {
    const fixture_data &d = data();
    const auto &c = d.cases[0];
    const std::vector<float> partial(100);
    EXPECT_THROW(ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, partial, 0, c.seed), fathom::error);
    EXPECT_THROW(ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, c.main_hidden, 0, 512), fathom::error);
    const std::vector<int32_t> three = {1, 2, 3};
    EXPECT_THROW(ds4::dspark_draft(*d.target, *d.drafter, c.qat, {}, c.main_hidden, 0, c.seed, three),
                 fathom::error);
}

// ---- fathom-gguf synth --dspark -----------------------------------------------------------------

// The synthesised tiny drafter loads against the synthesised tiny target (and the golden target: same
// geometry) and drafts finite blocks; same seed = same bytes.
TEST(ds4_dspark, synth_tiny_drafter_loads_against_its_target) {
    const std::string dir = std::filesystem::temp_directory_path().string();
    const std::string tp = dir + "/ds4_dspark_synth_target.gguf", dp = dir + "/ds4_dspark_synth_draft.gguf",
                      dp2 = dir + "/ds4_dspark_synth_draft2.gguf";
    const ds4::hparams hp = ds4::synth_preset("tiny");
    const ds4::dspark_synth ds = ds4::synth_dspark_preset("tiny", hp);
    ds4::synth_options o;
    o.seed = 3;
    ds4::synth_write(tp, hp, o);
    ds4::synth_write_dspark(dp, hp, ds, o);
    ds4::synth_write_dspark(dp2, hp, ds, o);
    std::ifstream a(dp, std::ios::binary), b(dp2, std::ios::binary);
    EXPECT_TRUE(std::equal(std::istreambuf_iterator<char>(a), {}, std::istreambuf_iterator<char>(b), {}));
    const auto target = ds4::load_model(tp);
    const auto w = ds4::load_dspark(*target, dp);
    EXPECT_EQ(w->cfg.target_layers, (std::vector<int>{3, 4, 5}));
    EXPECT_EQ(w->cfg.noise_token, 511);
    EXPECT_EQ(w->cfg.markov_rank, 32);
    EXPECT_EQ(w->cfg.window, 32);
    EXPECT_EQ(w->cfg.block_size, 5);
    EXPECT_NO_THROW(ds4::load_dspark(*data().target, dp));
    const std::vector<int32_t> toks = {0, 17, 300, 5, 42, 42, 7, 9};
    std::vector<int64_t> pos(toks.size());
    std::iota(pos.begin(), pos.end(), 0);
    ds4::state st = ds4::new_state(*target, ds4::qat_mode::full, kv_precision::f32);
    std::vector<float> feat(toks.size() * static_cast<size_t>(w->feature_dim()));
    ds4::dspark_capture(*target, *w, st, toks, pos, feat);
    const auto blk = ds4::dspark_draft(*target, *w, ds4::qat_mode::full, {}, feat, 0, 11);
    for (float x : blk.corrected_logits) ASSERT_TRUE(std::isfinite(x));
    for (float c : blk.confidence) EXPECT_TRUE(c > 0 && c < 1);
    EXPECT_EQ(blk.draft_tokens.size(), 5u);
    for (const auto &p : {tp, dp, dp2}) std::filesystem::remove(p);
}

TEST(ds4_dspark, synth_presets) {
    const ds4::hparams flash = ds4::synth_preset("flash");
    const ds4::dspark_synth f = ds4::synth_dspark_preset("flash", flash);
    EXPECT_EQ(f.capture_layers, (std::vector<int>{40, 41, 42}));
    EXPECT_EQ(f.noise_token, 128799);
    EXPECT_EQ(f.markov_rank, 256);
    EXPECT_EQ(f.window, 128);
    EXPECT_EQ(f.n_stages, 3);
    EXPECT_EQ(f.block_size, 5);
    EXPECT_THROW(ds4::synth_dspark_preset("huge", flash), fathom::error);
}

}  // namespace
