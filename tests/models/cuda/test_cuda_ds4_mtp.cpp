// The DS4 MTP head on the device (ds4::cuda_upload_mtp, cuda_sequence::eval_mtp) against independent truth:
//  - ../shared/golden/ds4-tiny/mtp_cases.jsonl (the official f32 implementation's MTP logits): the target
//    evaluates each case's tokens on the device keeping every row's final HC state (eval_rows' hc_out),
//    then the head runs its rows (H_i, t_(i+1)) one per eval_mtp; both file layouts (llama.cpp's and
//    antirez/ds4's names). The wrong pairing (t_i instead of t_(i+1)) must fail the same comparison;
//  - the CPU head (ds4::mtp_forward) on a chained draft: rows fed with the head's own output state and
//    argmax token, rolled back and resumed; logits within the golden tier's tolerance of the CPU's, the
//    same argmax, and the output state close;
//  - bad input: eval_mtp on the target's weights, eval on the head's, wrong buffer sizes;
//  - a synthetic target carrying its MTP block (fathom-gguf synth --mtp: llama.cpp's layout in the model file
//    itself) uploads from the file's host model and follows the CPU head on rows of the target's own states:
//    f32 mix within 1e-4 and the same argmax; q2 mix (a Q8_0 eh_proj split at column D, rows 2D apart; the
//    device MoE's q8 activations) median relative L2 <= 0.1 (a wrong split or stride is ~1); a sparse file
//    (rows replicated on the device) drafts finite logits.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "backend/cuda/cuda_test_util.h"
#include "models/ds4/golden_util.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/deepseek4.h"
#include "models/deepseek4_mtp.h"
#include "models/deepseek4_synth.h"

namespace fathom {
namespace {

using CudaDs4Mtp = cuda_test::cuda_device_test;

struct tiny {
    std::unique_ptr<ds4::model> main;
    std::unique_ptr<ds4::mtp_weights> llama_names, ds4_names;
};
const tiny &data() {
    static tiny t = [] {
        tiny d;
        d.main = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
        d.llama_names = ds4::load_mtp(*d.main, ds4_test::golden_dir() + "/ds4-tiny-a-mtp.gguf");
        d.ds4_names = ds4::load_mtp(*d.main, ds4_test::golden_dir() + "/ds4-tiny-a-mtp-ds4c.gguf");
        return d;
    }();
    return t;
}

std::shared_ptr<const ds4::cuda_weights> upload(ds4::qat_mode q) {
    ds4::cuda_run_options o;
    o.qat = q;
    o.kv = kv_precision::f32;
    return ds4::cuda_upload(*data().main, o);
}

// The target's final HC state at every position of c's tokens on the device (one multi-row evaluation on
// w): the head's inputs.
std::vector<float> target_states(const std::shared_ptr<const ds4::cuda_weights> &w, const ds4_test::golden_case &c) {
    const ds4::hparams &hp = data().main->hp;
    const size_t n = c.tokens.size();
    ds4::cuda_sequence target(w, static_cast<int64_t>(n) + 1, true, 0);
    std::vector<float> hc(n * static_cast<size_t>(hp.n_hc * hp.n_embd));
    target.eval_rows(c.tokens, {}, hc);
    return hc;
}

// The head's logits for rows (hc[i], next[i]), i = 0.., one eval_mtp each.
std::vector<float> run_head(const std::shared_ptr<const ds4::cuda_weights> &hw, const std::vector<float> &hc,
                            const std::vector<int32_t> &next) {
    const ds4::hparams &hp = data().main->hp;
    const size_t V = static_cast<size_t>(hp.n_vocab), S = static_cast<size_t>(hp.n_hc * hp.n_embd), n = next.size();
    ds4::cuda_sequence head(hw, static_cast<int64_t>(n) + 1, true, 0);
    std::vector<float> logits(n * V, std::nanf(""));
    for (size_t i = 0; i < n; ++i) {
        const int32_t top = head.eval_mtp(next[i], std::span(hc).subspan(i * S, S), std::span(logits).subspan(i * V, V));
        const auto row = std::span(logits).subspan(i * V, V);
        EXPECT_EQ(top, static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
    }
    return logits;
}

TEST_F(CudaDs4Mtp, GoldenCasesBothLayouts) {
    const auto cases = ds4_test::load_cases("mtp_cases.jsonl");
    ASSERT_FALSE(cases.empty());
    const ds4::hparams &hp = data().main->hp;
    bool wrong_checked = false;
    for (const auto &c : cases) {
        const size_t n = c.tokens.size();
        ASSERT_EQ(c.mtp_tokens.size(), n);
        const auto w = upload(c.qat);
        const std::vector<float> hc = target_states(w, c);
        for (const ds4::mtp_weights *mw : {data().llama_names.get(), data().ds4_names.get()}) {
            const auto hw = ds4::cuda_upload_mtp(*data().main, *mw, w);
            const auto v = ds4_test::compare(c, run_head(hw, hc, c.mtp_tokens), hp.n_vocab);
            EXPECT_TRUE(v.ok) << c.name << (mw == data().ds4_names.get() ? " (ds4 names)" : " (llama.cpp names)") << ": "
                              << v.why;
            std::printf("  %-24s max e_p %.3g  median e_p %.3g\n", c.name.c_str(), v.max_e, v.median_e);
        }
        if (c.name == "mtp.len5.no_qat") {  // the antirez/ds4 pairing (state i with t_i) must not pass
            const auto hw = ds4::cuda_upload_mtp(*data().main, *data().llama_names, w);
            EXPECT_FALSE(ds4_test::compare(c, run_head(hw, hc, c.tokens), hp.n_vocab).ok);
            wrong_checked = true;
        }
    }
    EXPECT_TRUE(wrong_checked);
}

TEST_F(CudaDs4Mtp, ChainedDraftWithRollbackFollowsTheCpuHead) {
    const ds4::model &m = *data().main;
    const ds4::hparams &hp = m.hp;
    const size_t V = static_cast<size_t>(hp.n_vocab), S = static_cast<size_t>(hp.n_hc * hp.n_embd);
    const auto cases = ds4_test::load_cases("mtp_cases.jsonl");
    const auto &c = cases.back();
    const size_t n = c.tokens.size();
    // The target's HC states on the CPU (the reference head's inputs; the device head gets the same).
    ds4::state st = ds4::new_state(m, c.qat, kv_precision::f32);
    std::vector<float> hc(n * S);
    std::vector<int64_t> pos(n);
    for (size_t i = 0; i < n; ++i) pos[i] = static_cast<int64_t>(i);
    ds4::forward(m, st, c.tokens, pos, {{}, hc});
    const auto w = upload(c.qat);
    const auto hw = ds4::cuda_upload_mtp(m, *data().llama_names, w);
    ds4::cuda_sequence head(hw, static_cast<int64_t>(n) + 16, true, 0);
    ds4::mtp_state ref = ds4::new_mtp_state(m, *data().llama_names, c.qat, kv_precision::f32);
    const size_t half = n / 2;
    // true rows 0 .. half - 1
    std::vector<float> lg(V), lr(V), out(S), out_r(S);
    for (size_t i = 0; i < half; ++i) {
        head.eval_mtp(c.tokens[i + 1], std::span(hc).subspan(i * S, S));
        const int64_t p = static_cast<int64_t>(i);
        ds4::mtp_forward(m, *data().llama_names, ref, std::span(hc).subspan(i * S, S),
                         std::span(&c.tokens[i + 1], 1), std::span(&p, 1), {});
    }
    // a chain of 4 drafted rows from row `half`, twice: rolled back in between, the same drafts again
    for (int round = 0; round < 2; ++round) {
        std::vector<float> x(hc.begin() + static_cast<std::ptrdiff_t>(half * S),
                             hc.begin() + static_cast<std::ptrdiff_t>((half + 1) * S)),
            xr = x;
        int32_t tok = c.tokens[half + 1], tok_r = tok;
        for (int j = 0; j < 4; ++j) {
            const int64_t p = static_cast<int64_t>(half) + j;
            const int32_t top = head.eval_mtp(tok, x, lg, out);
            ds4::mtp_forward(m, *data().llama_names, ref, xr, std::span(&tok_r, 1), std::span(&p, 1), lr, out_r);
            const int32_t top_r = static_cast<int32_t>(std::max_element(lr.begin(), lr.end()) - lr.begin());
            EXPECT_EQ(top, top_r) << "round " << round << ", draft " << j;
            EXPECT_LT(cuda_test::rel_l2(lg.data(), lr.data(), V), 1e-4) << "round " << round << ", draft " << j;
            EXPECT_LT(cuda_test::rel_l2(out.data(), out_r.data(), S), 1e-4) << "round " << round << ", draft " << j;
            tok = top, tok_r = top_r;
            x = out, xr = out_r;
        }
        head.truncate(static_cast<int64_t>(half));
        ds4::mtp_truncate(ref, static_cast<int64_t>(half));
        EXPECT_EQ(head.n_past(), static_cast<int64_t>(half));
    }
}

// observe_mtp (the drafter's catch-up rows: the KV row only) leaves the head's state as eval_mtp does: the
// rows after it get the same logits and drafted tokens, bit for bit, in every golden case (QAT modes) and
// both layouts; and a head that skipped those rows drafts other logits (the check can fail).
TEST_F(CudaDs4Mtp, ObservedRowsLeaveTheStateOfEvaluatedRows) {
    const auto cases = ds4_test::load_cases("mtp_cases.jsonl");
    const ds4::hparams &hp = data().main->hp;
    const size_t V = static_cast<size_t>(hp.n_vocab), S = static_cast<size_t>(hp.n_hc * hp.n_embd);
    int checked = 0;
    for (const auto &c : cases) {
        const size_t n = c.tokens.size(), k = n / 2;
        if (k == 0) continue;
        const auto w = upload(c.qat);
        const std::vector<float> hc = target_states(w, c);
        for (const ds4::mtp_weights *mw : {data().llama_names.get(), data().ds4_names.get()}) {
            const auto hw = ds4::cuda_upload_mtp(*data().main, *mw, w);
            // mode 0: rows [0, k) evaluated, 1: observed, 2: skipped (the head starts at k)
            std::vector<float> lg[3];
            for (int mode = 0; mode < 3; ++mode) {
                ds4::cuda_sequence head(hw, static_cast<int64_t>(n) + 1, true, 0);
                if (mode == 2) head.restart_at(static_cast<int64_t>(k));
                if (mode == 0)
                    for (size_t i = 0; i < k; ++i) head.eval_mtp(c.mtp_tokens[i], std::span(hc).subspan(i * S, S));
                if (mode == 1)  // rows 0 and 1 alone, the rest in one call (queued back to back)
                    for (const auto &[b, e] : {std::pair<size_t, size_t>{0, std::min<size_t>(1, k)}, {std::min<size_t>(1, k), std::min<size_t>(2, k)}, {std::min<size_t>(2, k), k}})
                        head.observe_mtp(std::span(c.mtp_tokens).subspan(b, e - b), std::span(hc).subspan(b * S, (e - b) * S));
                ASSERT_EQ(head.n_past(), static_cast<int64_t>(k));
                lg[mode].assign((n - k) * V, 0.0f);
                for (size_t i = k; i < n; ++i)
                    head.eval_mtp(c.mtp_tokens[i], std::span(hc).subspan(i * S, S), std::span(lg[mode]).subspan((i - k) * V, V));
            }
            EXPECT_EQ(std::memcmp(lg[0].data(), lg[1].data(), lg[0].size() * sizeof(float)), 0) << c.name;
            EXPECT_NE(std::memcmp(lg[0].data(), lg[2].data(), lg[0].size() * sizeof(float)), 0) << c.name;
            ++checked;
        }
    }
    EXPECT_GT(checked, 4);
}

// eval()'s hc_tail (what the MTP head drafts from after a prompt): token-serial, the decode steps' states
// bit for bit (eval_rows' hc_out); through chunks of 5 tokens with the tail spanning three chunks, every row
// within bf16 error of its decode state (an off-by-one row would be a different position's state: far off).
TEST_F(CudaDs4Mtp, PromptTailStatesMatchTheDecodeStates) {
    const ds4::hparams &hp = data().main->hp;
    const size_t S = static_cast<size_t>(hp.n_hc * hp.n_embd);
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const auto &c = cases.back();
    const size_t n = c.tokens.size(), k = std::min<size_t>(12, n);
    const auto w = upload(c.qat);
    ds4::cuda_sequence rows(w, static_cast<int64_t>(n) + 1, true, 0), serial(w, static_cast<int64_t>(n) + 1, true, 0),
        chunked(w, static_cast<int64_t>(n) + 1, true, 5);
    std::vector<float> want(n * S), got(k * S), got_c(k * S);
    rows.eval_rows(c.tokens, {}, want);
    serial.eval(c.tokens, {}, got);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data() + (n - k) * S, k * S * sizeof(float)));
    chunked.eval(c.tokens, {}, got_c);
    for (size_t i = 0; i < k; ++i) {
        const double e = cuda_test::rel_l2(got_c.data() + i * S, want.data() + (n - k + i) * S, S);
        EXPECT_LT(e, 2e-2) << "tail row " << i;
        if (i > 0) {
            EXPECT_GT(cuda_test::rel_l2(got_c.data() + i * S, want.data() + (n - k + i - 1) * S, S), 5 * e);
        }
    }
    std::vector<float> too_many(2 * S);
    EXPECT_THROW(serial.eval(std::vector<int32_t>{1}, {}, too_many), error);
}

TEST_F(CudaDs4Mtp, BadInputIsRefused) {
    const ds4::hparams &hp = data().main->hp;
    const size_t S = static_cast<size_t>(hp.n_hc * hp.n_embd);
    const auto w = upload(ds4::qat_mode::full);
    const auto hw = ds4::cuda_upload_mtp(*data().main, *data().llama_names, w);
    ds4::cuda_sequence target(w, 8, true, 0), head(hw, 8, true, 0);
    const std::vector<float> hc(S, 0.5f), short_hc(S - 1, 0.5f);
    EXPECT_THROW(target.eval_mtp(1, hc), error);
    const std::vector<int32_t> one = {1}, bad_low = {-1};
    EXPECT_THROW(target.observe_mtp(one, hc), error);
    const std::vector<int32_t> toks = {1, 2};
    EXPECT_THROW(head.eval(toks, {}), error);
    EXPECT_THROW(head.eval_rows(toks, {}), error);
    EXPECT_THROW(head.eval_mtp(1, short_hc), error);
    EXPECT_THROW(head.eval_mtp(hp.n_vocab, hc), error);
    EXPECT_THROW(head.observe_mtp(one, short_hc), error);
    EXPECT_THROW(head.observe_mtp(bad_low, hc), error);
    EXPECT_THROW(head.observe_mtp(toks, hc), error);  // two tokens, one state
    EXPECT_EQ(head.n_past(), 0);
    EXPECT_GE(head.eval_mtp(1, hc), 0);
    EXPECT_EQ(head.n_past(), 1);
}

std::string synth_file(const std::string &tag, const std::string &mix, bool sparse) {
    ds4::hparams hp = ds4::synth_preset("tiny");
    ds4::synth_options o;
    o.seed = 3;
    o.mix = mix;
    o.mtp = true;
    if (sparse) {
        hp.n_expert = 64;  // expert banks larger than the pool: stored once, replicated on the device
        o.pool_rows = 16;
        o.sparse = true;
    }
    const std::string p = (std::filesystem::temp_directory_path() / ("cuda_ds4_synth_mtp_" + tag + ".gguf")).string();
    ds4::synth_write(p, hp, o);
    return p;
}

TEST_F(CudaDs4Mtp, SyntheticMtpFileFollowsTheCpuHead) {
    for (const std::string mix : {"f32", "q2"}) {
        const std::string path = synth_file(mix, mix, false);
        const auto m = ds4::load_model(path);
        const auto mw = ds4::load_mtp(*m, m->file);
        const ds4::hparams &hp = m->hp;
        const size_t V = static_cast<size_t>(hp.n_vocab), S = static_cast<size_t>(hp.n_hc * hp.n_embd), n = 24;
        std::vector<int32_t> toks(n + 1);
        for (size_t i = 0; i <= n; ++i) toks[i] = static_cast<int32_t>((i * 37 + 5) % V);
        // the target's states on the CPU (the reference head's inputs; the device head gets the same)
        ds4::state st = ds4::new_state(*m, ds4::qat_mode::full, kv_precision::f32);
        std::vector<float> hc(n * S);
        std::vector<int64_t> pos(n);
        for (size_t i = 0; i < n; ++i) pos[i] = static_cast<int64_t>(i);
        ds4::forward(*m, st, std::span(toks).first(n), pos, {{}, hc});
        ds4::cuda_run_options o;
        o.kv = kv_precision::f32;
        const auto w = ds4::cuda_upload(*m, o);
        const auto hw = ds4::cuda_upload_mtp(*m, *mw, w);
        ds4::cuda_sequence head(hw, static_cast<int64_t>(n) + 1, true, 0);
        ds4::mtp_state ref = ds4::new_mtp_state(*m, *mw, ds4::qat_mode::full, kv_precision::f32);
        std::vector<float> lg(V), lr(V);
        std::vector<double> errs;
        for (size_t i = 0; i < n; ++i) {
            const auto x = std::span<const float>(hc).subspan(i * S, S);
            const int32_t top = head.eval_mtp(toks[i + 1], x, lg);
            ds4::mtp_forward(*m, *mw, ref, x, std::span(&toks[i + 1], 1), std::span(&pos[i], 1), lr);
            ASSERT_TRUE(std::all_of(lg.begin(), lg.end(), [](float v) { return std::isfinite(v); })) << mix << " row " << i;
            errs.push_back(cuda_test::rel_l2(lg.data(), lr.data(), V));
            if (mix == "f32") {
                EXPECT_LT(errs.back(), 1e-4) << "row " << i;
                EXPECT_EQ(top, static_cast<int32_t>(std::max_element(lr.begin(), lr.end()) - lr.begin())) << "row " << i;
            }
        }
        std::sort(errs.begin(), errs.end());
        EXPECT_LT(errs[errs.size() / 2], 0.1) << mix << ": median relative L2 against the CPU head";
        std::printf("  synth --mtp %s: median rel L2 %.3g, max %.3g\n", mix.c_str(), errs[errs.size() / 2], errs.back());
        std::filesystem::remove(path);
    }
}

TEST_F(CudaDs4Mtp, SparseSyntheticMtpFileUploadsAndDrafts) {
    const std::string path = synth_file("sparse", "q2", true);
    const auto m = ds4::load_model(path);  // the host side of the CUDA loader (the CPU engine refuses the file)
    const auto mw = ds4::load_mtp(*m, m->file);
    const size_t V = static_cast<size_t>(m->hp.n_vocab), S = static_cast<size_t>(m->hp.n_hc * m->hp.n_embd), n = 12;
    ds4::cuda_run_options o;
    const auto w = ds4::cuda_upload(*m, o);
    const auto hw = ds4::cuda_upload_mtp(*m, *mw, w);
    std::vector<int32_t> toks(n + 1);
    for (size_t i = 0; i <= n; ++i) toks[i] = static_cast<int32_t>((i * 53 + 2) % V);
    ds4::cuda_sequence target(w, static_cast<int64_t>(n) + 1, true, 0), head(hw, static_cast<int64_t>(n) + 1, true, 0);
    std::vector<float> hc(n * S), lg(V);
    target.eval_rows(std::span(toks).first(n), {}, hc);
    for (size_t i = 0; i < n; ++i) {
        const int32_t top = head.eval_mtp(toks[i + 1], std::span<const float>(hc).subspan(i * S, S), lg);
        EXPECT_TRUE(std::all_of(lg.begin(), lg.end(), [](float v) { return std::isfinite(v); })) << "row " << i;
        EXPECT_EQ(top, static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin())) << "row " << i;
    }
    std::filesystem::remove(path);
}

}  // namespace
}  // namespace fathom
