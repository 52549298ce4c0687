// ds4-tiny-a MTP head against ../shared/golden/ds4-tiny/mtp_cases.jsonl: the main model prefills the
// tokens (f32 KV) keeping its final HC state per position, then the MTP block runs on rows
// (H_i, t_(i+1)) all at once, one by one and in chunks of 7, for both file layouts.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "core/error.h"
#include "golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_mtp.h"

namespace {

using namespace fathom;

struct fixture_data {
    std::unique_ptr<ds4::model> main;
    std::unique_ptr<ds4::mtp_weights> llama_names, ds4_names;
    std::vector<ds4_test::golden_case> cases;
};

const fixture_data &data() {
    static fixture_data d = [] {
        fixture_data f;
        f.main = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
        f.llama_names = ds4::load_mtp(*f.main, ds4_test::golden_dir() + "/ds4-tiny-a-mtp.gguf");
        f.ds4_names = ds4::load_mtp(*f.main, ds4_test::golden_dir() + "/ds4-tiny-a-mtp-ds4c.gguf");
        f.cases = ds4_test::load_cases("mtp_cases.jsonl");
        return f;
    }();
    return d;
}

// Positions 0 .. n - 1.
std::vector<int64_t> positions(size_t n) {
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    return pos;
}

// The main model's final HC state at every position of c's tokens (one prefill, f32 KV): the head's inputs.
std::vector<float> main_states(const ds4_test::golden_case &c) {
    const ds4::model &m = *data().main;
    ds4::state st = ds4::new_state(m, c.qat, kv_precision::f32);
    std::vector<float> hc(c.tokens.size() * static_cast<size_t>(m.hp.n_hc * m.hp.n_embd));
    ds4::forward(m, st, c.tokens, positions(c.tokens.size()), {{}, hc});
    return hc;
}

std::vector<float> run_mtp(const ds4::mtp_weights &w, const ds4_test::golden_case &c,
                           const std::vector<float> &hc, size_t chunk) {
    const ds4::model &m = *data().main;
    const size_t n = c.mtp_tokens.size(), V = static_cast<size_t>(m.hp.n_vocab);
    const size_t S = static_cast<size_t>(m.hp.n_hc * m.hp.n_embd);
    ds4::mtp_state st = ds4::new_mtp_state(m, w, c.qat, kv_precision::f32);
    std::vector<float> logits(n * V);
    const std::vector<int64_t> pos = positions(n);
    for (size_t b = 0; b < n; b += chunk) {
        const size_t e = std::min(n, b + chunk);
        ds4::mtp_forward(m, w, st, std::span(hc).subspan(b * S, (e - b) * S),
                         std::span(c.mtp_tokens).subspan(b, e - b), std::span(pos).subspan(b, e - b),
                         std::span(logits).subspan(b * V, (e - b) * V));
    }
    return logits;
}

TEST(ds4_mtp, golden_cases_both_layouts) {
    const ds4::model &m = *data().main;
    for (const auto &c : data().cases) {
        const size_t n = c.tokens.size();
        ASSERT_EQ(c.mtp_tokens.size(), n);
        const std::vector<float> hc = main_states(c);
        for (size_t chunk : {n, size_t{1}, size_t{7}}) {
            const auto v = ds4_test::compare(c, run_mtp(*data().llama_names, c, hc, chunk), m.hp.n_vocab);
            EXPECT_TRUE(v.ok) << c.name << " (llama.cpp names) chunk " << chunk << ": " << v.why;
            std::printf("  %-24s chunk %3zu  max e_p %.3g  median e_p %.3g\n", c.name.c_str(), chunk, v.max_e,
                        v.median_e);
        }
        const auto v = ds4_test::compare(c, run_mtp(*data().ds4_names, c, hc, n), m.hp.n_vocab);
        EXPECT_TRUE(v.ok) << c.name << " (ds4 names): " << v.why;
    }
}

// Wrong pairing (state of position i with the embedding of t_i, the antirez/ds4 convention) must fail:
// guards against a test that cannot tell the conventions apart.
TEST(ds4_mtp, same_token_pairing_fails) {
    const ds4::model &m = *data().main;
    const auto &c = data().cases[8];  // mtp.len5.no_qat
    ASSERT_EQ(c.name, "mtp.len5.no_qat");
    const std::vector<float> hc = main_states(c);
    ds4_test::golden_case wrong = c;
    wrong.mtp_tokens = c.tokens;
    EXPECT_FALSE(ds4_test::compare(c, run_mtp(*data().llama_names, wrong, hc, c.tokens.size()), m.hp.n_vocab).ok);
}

// mtp_observe (the drafter's catch-up rows: state only) leaves the head's state as mtp_forward does, bit
// for bit: the same ring bytes, and the rows after it get the same logits, for both layouts, every
// golden case (QAT modes, lengths), the reference and the quantised products.
TEST(ds4_mtp, observe_leaves_the_state_of_forward) {
    const ds4::model &m = *data().main;
    const size_t S = static_cast<size_t>(m.hp.n_hc * m.hp.n_embd), V = static_cast<size_t>(m.hp.n_vocab);
    int checked = 0;
    for (const ds4::mtp_weights *w : {data().llama_names.get(), data().ds4_names.get()})
        for (const auto &c : data().cases)
            for (bool quantised : {false, true}) {
                const size_t n = c.tokens.size(), k = n / 2;
                if (k == 0) continue;
                const std::vector<float> hc = main_states(c);
                const std::vector<int64_t> pos = positions(n);
                const std::span<const float> hs(hc);
                const std::span<const int32_t> ts(c.mtp_tokens);
                const std::span<const int64_t> ps(pos);
                // rows [0, k) by forward or by observe, then rows [k, n) by forward with their logits
                auto run = [&](bool observe, std::vector<float> &logits) {
                    ds4::mtp_state h = ds4::new_mtp_state(m, *w, c.qat, kv_precision::f32);
                    h.exec.quantised = quantised;
                    if (observe) ds4::mtp_observe(m, *w, h, hs.subspan(0, k * S), ts.subspan(0, k), ps.subspan(0, k));
                    else ds4::mtp_forward(m, *w, h, hs.subspan(0, k * S), ts.subspan(0, k), ps.subspan(0, k), {});
                    EXPECT_EQ(h.n_past, static_cast<int64_t>(k));
                    const auto ring = h.block.raw.bytes();
                    std::vector<uint8_t> bytes(ring.begin(), ring.end());
                    logits.assign((n - k) * V, 0.0f);
                    ds4::mtp_forward(m, *w, h, hs.subspan(k * S), ts.subspan(k), ps.subspan(k), logits);
                    return bytes;
                };
                std::vector<float> lf, lo;
                const auto rf = run(false, lf), ro = run(true, lo);
                ASSERT_EQ(rf.size(), ro.size());
                EXPECT_EQ(std::memcmp(rf.data(), ro.data(), rf.size()), 0) << c.name << ": the ring after " << k << " rows";
                EXPECT_EQ(std::memcmp(lf.data(), lo.data(), lf.size() * sizeof(float)), 0) << c.name << ": logits after";
                ++checked;
            }
    EXPECT_GT(checked, 8);
}

// A head that observes nothing of the rows before (a drafter that skipped its catch-up) drafts other
// logits: the observe test above could not pass by comparing two heads that never read those rows.
TEST(ds4_mtp, skipped_rows_change_the_logits) {
    const ds4::model &m = *data().main;
    const auto &c = data().cases.back();
    const size_t n = c.tokens.size(), S = static_cast<size_t>(m.hp.n_hc * m.hp.n_embd), V = static_cast<size_t>(m.hp.n_vocab);
    ASSERT_GE(n, 2u);
    const std::vector<float> hc = main_states(c);
    const std::vector<int64_t> pos = positions(n);
    const ds4::mtp_weights &w = *data().llama_names;
    std::vector<float> seen(V), fresh(V);
    ds4::mtp_state a = ds4::new_mtp_state(m, w, c.qat, kv_precision::f32);
    ds4::mtp_observe(m, w, a, std::span(hc).subspan(0, (n - 1) * S), std::span(c.mtp_tokens).subspan(0, n - 1),
                     std::span(pos).subspan(0, n - 1));
    ds4::mtp_forward(m, w, a, std::span(hc).subspan((n - 1) * S), std::span(c.mtp_tokens).subspan(n - 1),
                     std::span(pos).subspan(n - 1), seen);
    ds4::mtp_state b = ds4::new_mtp_state(m, w, c.qat, kv_precision::f32);
    b.n_past = b.reached = static_cast<int64_t>(n - 1);  // the same position, no history
    ds4::mtp_forward(m, w, b, std::span(hc).subspan((n - 1) * S), std::span(c.mtp_tokens).subspan(n - 1),
                     std::span(pos).subspan(n - 1), fresh);
    EXPECT_NE(std::memcmp(seen.data(), fresh.data(), V * sizeof(float)), 0);
}

}  // namespace

namespace {

TEST(ds4_mtp, rejects_non_mtp_file) {
    const auto &main = *data().main;
    try {
        fathom::ds4::load_mtp(main, ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
        ADD_FAILURE() << "main model accepted as MTP file";
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find("nextn_predict_layers"), std::string::npos) << e.what();
    }
}

}  // namespace
