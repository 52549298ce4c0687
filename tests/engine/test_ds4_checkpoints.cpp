// DS4 prefix checkpoints (src/engine/ds4_checkpoints.h, docs/ds4.md "Prefix checkpoints"): a regenerate,
// an edited turn and a deep divergence in a prompt restore the longest checkpoint that is a prefix of the
// request and evaluate only the rest (sync's on_progress total), with logits bit-identical (memcmp) to a
// session of an engine without checkpoints; the fused step (sync_step) takes the same path; the store
// shares a timeline's rows between its checkpoints, keeps to its budget and thins grid checkpoints as
// they age; bad budgets fail the load. ds4-tiny (f32, reference products) and a synthetic DS4 (q8_0,
// quantised kernels, raw window 8).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "engine/ds4_checkpoints.h"
#include "fathom/engine.h"
#include "models/ds4/golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_synth.h"

namespace {

using namespace fathom;

std::string tiny_path() {
    return ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
}

// A synthetic DS4 of the tiny geometry with q8_0 matrices and a raw window of 8 (written once per
// process, removed when the process exits: ctest runs every test in a process of its own).
struct temp_file {
    std::string path;
    ~temp_file() {
        std::error_code ec;
        std::filesystem::remove(path, ec);
    }
};
std::string synth_path() {
    static const temp_file file{[] {
        ds4::hparams hp = ds4::synth_preset("tiny");
        hp.window = 8;
        ds4::synth_options o;
        o.mix = "q8_0";
        o.seed = 11;
        const std::string p = (std::filesystem::temp_directory_path() /
                               ("fathom_ds4_ckpt_" + std::to_string(::getpid()) + ".gguf"))
                                  .string();
        ds4::synth_write(p, hp, o);
        return p;
    }()};
    return file.path;
}

std::unique_ptr<engine> load(const std::string &path, int64_t mib, int n_batch = 16) {
    engine_options o;
    o.model_path = path;
    o.n_threads = 2;
    o.n_ctx = 1024;
    o.n_batch = n_batch;
    o.kv = kv_precision::f32;
    o.ds4_qat = "off";
    o.ds4_checkpoint_mib = mib;
    return engine::load(o);
}

std::vector<int32_t> toks(size_t n, int salt) {
    std::vector<int32_t> t;
    for (size_t i = 0; i < n; ++i) t.push_back(int32_t(2 + (i * 37 + size_t(salt) * 101 + i * i * 7) % 490));
    return t;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t> &b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// s's logits equal a fresh session's of `ref` (no checkpoints) synced to `prefix`, bit for bit.
void expect_fresh(engine &ref, session &s, std::span<const int32_t> prefix) {
    auto f = ref.new_session();
    f->sync(prefix);
    const auto a = s.logits(), b = f->logits();
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << prefix.size() << " tokens";
}

class ds4_checkpoints_models : public ::testing::TestWithParam<bool> {
  protected:
    std::string path() const { return GetParam() ? synth_path() : tiny_path(); }
};

// A conversation: a prompt, a 37-token reply decoded token by token, a second turn (the start checkpoint
// at 237, the end of the reply, off the n_batch grid), a regenerate of the first prompt (its end
// checkpoint has its logits: nothing is evaluated), another reply, then the second turn edited (restored
// at 237: only the turn is evaluated), decoding after it; another session restores the same checkpoints.
TEST_P(ds4_checkpoints_models, regenerate_and_edited_turn_evaluate_only_the_tail) {
    auto e = load(path(), 64), ref = load(path(), 0);
    auto s = e->new_session();
    int64_t total = -1;
    auto progress = [&](int64_t, int64_t t) { total = t; };
    const std::vector<int32_t> P = toks(200, 1), G = toks(37, 2), U = toks(30, 3);
    s->sync(P, progress);
    EXPECT_EQ(total, 200);
    std::vector<int32_t> h = P;
    for (int32_t g : G) {
        h.push_back(g);
        s->sync(h, progress);
        EXPECT_EQ(total, 1);
    }
    const std::vector<int32_t> Q = cat(cat(P, G), U);
    s->sync(Q, progress);  // the second turn: appended
    EXPECT_EQ(total, 30);
    expect_fresh(*ref, *s, Q);
    s->sync(P, progress);  // regenerate: 67 behind, beyond the rollback reach
    EXPECT_EQ(total, 0);
    EXPECT_EQ(s->n_past(), 200);
    expect_fresh(*ref, *s, P);
    std::vector<int32_t> h2 = P;
    for (int32_t g : toks(3, 9)) {  // another reply
        h2.push_back(g);
        s->sync(h2, progress);
        EXPECT_EQ(total, 1);
        expect_fresh(*ref, *s, h2);
    }
    std::vector<int32_t> U2 = U;
    U2[0] = (U2[0] + 5) % 500;
    std::vector<int32_t> Q2 = cat(cat(P, G), U2);
    s->sync(Q2, progress);  // the edited second turn: restored at 237
    EXPECT_EQ(total, 30);
    expect_fresh(*ref, *s, Q2);
    for (int32_t g : toks(5, 4)) {
        Q2.push_back(g);
        s->sync(Q2, progress);
        EXPECT_EQ(total, 1);
        expect_fresh(*ref, *s, Q2);
    }
    // Another session of the engine restores the same checkpoints.
    auto s2 = e->new_session();
    s2->sync(P, progress);
    EXPECT_EQ(total, 0);
    expect_fresh(*ref, *s2, P);
    s2->sync(Q, progress);
    EXPECT_EQ(total, 0);
    expect_fresh(*ref, *s2, Q);
}

// A divergence deep inside a 300-token prompt (n_batch 16): grid checkpoints were taken every 16
// positions and thinned by age; the newest one at or below 150 that survives is 128 (docs/ds4.md).
TEST_P(ds4_checkpoints_models, deep_divergence_restores_the_thinned_grid) {
    auto e = load(path(), 64), ref = load(path(), 0);
    auto s = e->new_session();
    int64_t total = -1;
    auto progress = [&](int64_t, int64_t t) { total = t; };
    const std::vector<int32_t> P = toks(300, 5);
    s->sync(P, progress);
    EXPECT_EQ(total, 300);
    std::vector<int32_t> P2(P.begin(), P.begin() + 150);
    P2 = cat(P2, toks(20, 6));
    s->sync(P2, progress);
    EXPECT_EQ(total, 170 - 128);
    expect_fresh(*ref, *s, P2);
    std::vector<int32_t> P3(P.begin(), P.begin() + 250);  // the grid at 240 is kept (age < 4)
    s->sync(P3, progress);
    EXPECT_EQ(total, 10);
    expect_fresh(*ref, *s, P3);
}

// Without checkpoints (0) the same deep divergence evaluates the whole prefix again.
TEST_P(ds4_checkpoints_models, off_rebuilds_the_whole_prefix) {
    auto e = load(path(), 0);
    auto s = e->new_session();
    int64_t total = -1;
    auto progress = [&](int64_t, int64_t t) { total = t; };
    const std::vector<int32_t> P = toks(120, 5);
    s->sync(P, progress);
    s->sync(std::span<const int32_t>(P.data(), 60), progress);
    EXPECT_EQ(total, 60);
}

// The engine's fused step (one CPU device, sync_step): an item diverging deep behind its session's
// state is restored from a checkpoint (sync), the other items run fused; all bit-identical.
TEST_P(ds4_checkpoints_models, fused_step_restores_checkpoints) {
    auto e = load(path(), 64), ref = load(path(), 0);
    auto a = e->new_session(), b = e->new_session();
    const std::vector<int32_t> P = toks(180, 7), R = toks(50, 8);
    const std::vector<int32_t> PR = cat(P, R), B = toks(40, 9);
    std::vector<sync_item> items{{a.get(), PR, true}, {b.get(), B, true}};
    e->sync_step(items);
    expect_fresh(*ref, *a, PR);
    std::vector<int32_t> P2 = P;
    P2.push_back(3);
    const std::vector<int32_t> B2 = cat(B, toks(20, 10));
    items = {{a.get(), P2, true}, {b.get(), B2, true}};
    e->sync_step(items);
    EXPECT_EQ(a->n_past(), 181);
    expect_fresh(*ref, *a, P2);
    expect_fresh(*ref, *b, B2);
    // A fresh session given a prompt another one evaluated: restored, then the tail.
    auto c = e->new_session();
    std::vector<sync_item> one{{c.get(), PR, true}};
    e->sync_step(one);
    expect_fresh(*ref, *c, PR);
}

INSTANTIATE_TEST_SUITE_P(ds4, ds4_checkpoints_models, ::testing::Values(false, true), [](const auto &info) {
    return std::string(info.param ? "synth_q8_0" : "tiny_f32");
});

// Drives a store directly with a state evaluated in chunks of 16 (as eval_chunks does), a prompt's end.
struct timeline {
    std::unique_ptr<ds4::model> m = ds4::load_model(tiny_path());
    ds4::state st = ds4::new_state(*m, ds4::qat_mode::off, kv_precision::f32);
    std::vector<int32_t> held;
    std::vector<float> logits = std::vector<float>(512);
    void prompt(ds4_checkpoints &ck, const std::vector<int32_t> &t) {
        ck.before_append(st, held, static_cast<int64_t>(t.size()));
        for (size_t d = 0; d < t.size(); d += 16) {
            const size_t n = std::min<size_t>(16, t.size() - d);
            std::vector<int64_t> pos(n);
            for (size_t i = 0; i < n; ++i) pos[i] = st.n_past + static_cast<int64_t>(i);
            ds4::forward(*m, st, std::span<const int32_t>(t.data() + d, n), pos, {logits, {}});
            held.insert(held.end(), t.begin() + static_cast<ptrdiff_t>(d),
                        t.begin() + static_cast<ptrdiff_t>(d + n));
            const bool last = d + n == t.size();
            ck.after_eval(st, held, static_cast<int64_t>(held.size() - n),
                          last ? std::span<const float>(logits) : std::span<const float>());
        }
    }
    uint64_t row_bytes() const {
        uint64_t b = 0;
        for (const auto &ls : st.layers) b += ls.comp_rows.bytes().size() + ls.idx_rows.bytes().size();
        return b;
    }
};

// One timeline's checkpoints share its rows: the store holds every checkpoint's fixed part and logits
// and the rows and tokens of the newest once. Geometric thinning leaves the grid set of the policy.
TEST(ds4_checkpoints_store, shares_rows_and_thins) {
    timeline t;
    ds4_checkpoints ck(uint64_t{1} << 30, 16);
    t.prompt(ck, toks(300, 5));
    const auto s = ck.get_stats();
    const uint64_t fixed = ds4_checkpoints::fixed_bytes(t.st);
    // grid 64, 128, 192, 224, 240, 256, 272, 288 and the prompt's end (300, with 512 logits)
    EXPECT_EQ(s.checkpoints, 9u);
    EXPECT_EQ(s.taken, 19u);
    EXPECT_EQ(s.thinned, 10u);
    EXPECT_EQ(s.bytes, 9 * fixed + 512 * 4 + t.row_bytes() + 300 * 4);
    EXPECT_GT(t.row_bytes(), 0u);
}

// Beyond the budget the least recently used checkpoints go; the store never holds more than it.
TEST(ds4_checkpoints_store, keeps_to_its_budget) {
    timeline t;
    ds4::state probe = t.st;
    const uint64_t fixed = ds4_checkpoints::fixed_bytes(probe);
    const uint64_t budget = 3 * fixed + 64 * 1024;
    ds4_checkpoints ck(budget, 16);
    t.prompt(ck, toks(300, 5));
    const auto s = ck.get_stats();
    EXPECT_LE(s.bytes, budget);
    EXPECT_GT(s.evicted, 0u);
    EXPECT_GE(s.checkpoints, 1u);
    // The newest (the prompt's end) is kept and restores bit for bit into a fresh state.
    ds4::state st = ds4::new_state(*t.m, ds4::qat_mode::off, kv_precision::f32);
    std::vector<int32_t> held;
    std::vector<float> logits(512);
    bool has = false;
    ASSERT_TRUE(ck.restore(t.held, 0, st, held, logits, has));
    EXPECT_TRUE(has);
    EXPECT_EQ(held, t.held);
    EXPECT_EQ(0, std::memcmp(logits.data(), t.logits.data(), logits.size() * sizeof(float)));
    for (size_t l = 0; l < st.layers.size(); ++l) {
        const auto a = st.layers[l].comp_rows.bytes(), b = t.st.layers[l].comp_rows.bytes();
        ASSERT_EQ(a.size(), b.size());
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size()));
        const auto c = st.layers[l].raw.bytes(), d = t.st.layers[l].raw.bytes();
        EXPECT_EQ(0, std::memcmp(c.data(), d.data(), c.size()));
    }
    // A budget below one checkpoint keeps nothing.
    timeline t2;
    ds4_checkpoints none(fixed / 2, 16);
    t2.prompt(none, toks(40, 5));
    EXPECT_EQ(none.get_stats().checkpoints, 0u);
    EXPECT_EQ(none.get_stats().bytes, 0u);
}

// The fixed part of one checkpoint at the full DS4-Flash geometry (docs/ds4.md): fresh layer states
// built by ds4::new_layer_state from the Flash preset, f16 and f32 KV.
TEST(ds4_checkpoints_store, flash_fixed_part_bytes) {
    const ds4::hparams hp = ds4::synth_preset("flash");
    for (const auto &[kv, want] : {std::pair{kv_precision::f16, uint64_t{23298048}},
                                   std::pair{kv_precision::f32, uint64_t{29638656}}}) {
        ds4::state st;
        for (int l = 0; l < hp.n_layer; ++l) {
            ds4::layer_weights lw;
            lw.ratio = hp.compress_ratio[static_cast<size_t>(l)];
            lw.comp.ratio = lw.ratio;
            lw.comp.dim = hp.head_dim;
            lw.idx_comp.ratio = lw.ratio == 4 ? 4 : 0;
            lw.idx_comp.dim = hp.idx_dim;
            st.layers.push_back(ds4::new_layer_state(hp, lw, kv));
        }
        EXPECT_EQ(ds4_checkpoints::fixed_bytes(st), want);
    }
}

// A negative or absurd budget fails the load with one line naming the option.
TEST(ds4_checkpoints_store, bad_budgets_fail_the_load) {
    for (int64_t mib : {int64_t{-1}, int64_t{1} << 40}) {
        try {
            load(tiny_path(), mib);
            ADD_FAILURE() << mib << " accepted";
        } catch (const std::exception &x) {
            EXPECT_NE(std::string(x.what()).find("ds4_checkpoint_mib"), std::string::npos) << x.what();
        }
    }
}

}  // namespace
