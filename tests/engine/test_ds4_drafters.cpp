// DS4 sessions' own drafters (engine_options::ds4_draft, src/engine/ds4_drafter.h) through the public
// session API, against independent truth:
//  * MTP: the first draft after every prefix of the golden sequences equals the golden MTP head's top-1
//    (../shared/golden/ds4-tiny/mtp_cases.jsonl, the official code in f32) wherever the golden gap is
//    clear, while the session evaluates its tokens the way speculation does (the true token plus wrong
//    or right drafts in one step, rejected ones rolled back), so the head's history follows the target
//    through acceptance and rollback;
//  * DSpark: the draft block after the golden sequences equals the golden draft tokens
//    (../shared/golden/ds4-tiny-dspark, end-to-end strict cases), reached the same way;
//  * speculative decoding with either drafter gives plain decoding's tokens (greedy and sampled);
//  * bad options: one clear error at load.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "server/daemon.h"
#include "fathom/engine.h"
#include "fathom/speculative.h"
#include "engine/ds4_spec_util.h"
#include "models/ds4/golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"

namespace {

using namespace fathom;

const std::string kTarget = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
const std::string kMtp = ds4_test::golden_dir() + "/ds4-tiny-a-mtp.gguf";
const std::string kDspark = std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny-dspark/ds4-tiny-a-dspark.gguf";

std::unique_ptr<engine> load(const std::string &draft, const std::string &draft_model, const std::string &qat,
                             int n_ctx = 1024) {
    engine_options o;
    o.model_path = kTarget;
    o.n_threads = 2;
    o.n_ctx = n_ctx;
    o.kv = kv_precision::f32;
    o.ds4_qat = qat;
    o.ds4_draft = draft;
    o.ds4_draft_model = draft_model;
    return engine::load(o);
}

std::string qat_name(const ds4_test::golden_case &c) {
    return c.qat == ds4::qat_mode::full ? "full" : c.qat == ds4::qat_mode::fp4only ? "fp4only" : "off";
}

// Brings `s` from what it holds to `want` (a longer prefix) the way speculation does: each step appends
// the next true token plus a few drafts, some right and then wrong ones, and rolls the wrong ones back.
void advance_like_speculation(session &s, const std::vector<int32_t> &want, std::mt19937 &rng) {
    while (s.tokens().size() < want.size()) {
        const size_t p = s.tokens().size(), left = want.size() - p;
        const size_t right = std::min<size_t>(rng() % 4, left - 1), wrong = rng() % 4;
        std::vector<int32_t> batch(want.begin() + static_cast<std::ptrdiff_t>(p),
                                   want.begin() + static_cast<std::ptrdiff_t>(p + 1 + right));
        for (size_t j = 0; j < wrong; ++j) batch.push_back(static_cast<int32_t>((want[p] + 7 + j) % 512));
        s.eval(batch);
        s.truncate(static_cast<int64_t>(p + 1 + right));
    }
}

TEST(ds4_drafters, mtp_first_draft_is_the_golden_mtp_top1) {
    int checked = 0;
    for (const auto &c : ds4_test::load_cases("mtp_cases.jsonl")) {
        if (c.tol["tier"] != "strict" || c.tokens.size() < 60) continue;  // long no_qat cases
        auto e = load("mtp", kMtp, qat_name(c));
        auto s = e->new_session();
        EXPECT_TRUE(s->has_drafter());
        std::mt19937 rng(3);
        const double gap_min = c.tol["top1_must_match_if_gap_gt"];
        s->sync(std::span<const int32_t>(c.tokens).first(7));  // a prefill first: the head follows its rows
        for (size_t n = 7; n <= c.tokens.size(); n = std::min(c.tokens.size() + 1, n + 1 + rng() % 5)) {
            // a jump of 1..5 tokens: steps keep some right drafts, so rows the head ran while following
            // the target stay in its history
            advance_like_speculation(*s, std::vector<int32_t>(c.tokens.begin(), c.tokens.begin() + static_cast<std::ptrdiff_t>(n)), rng);
            // Row n - 1 of the golden: the head's output for (state at n - 1, token n = mtp_tokens[n - 1]).
            std::vector<int32_t> h = s->tokens();
            h.push_back(c.mtp_tokens[n - 1]);
            const std::vector<int32_t> d = s->draft(h, 4);
            ASSERT_EQ(d.size(), 4u);
            if (c.top2_gap[n - 1] > gap_min) {
                EXPECT_EQ(d[0], c.top8[n - 1][0].first) << c.name << " position " << n - 1;
                ++checked;
            }
        }
    }
    EXPECT_GT(checked, 100);
}

struct dspark_case {
    std::string name, qat;
    std::vector<int32_t> tokens, drafts;
    int32_t seed = 0;
};

std::vector<dspark_case> dspark_cases() {
    std::ifstream in(std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny-dspark/dspark_cases.jsonl");
    std::vector<dspark_case> out;
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        const auto j = nlohmann::json::parse(line);
        if (j["end_to_end_tier"] != "strict") continue;
        dspark_case c;
        c.name = j["name"];
        c.qat = j["qat"]["kv_fp8_e4m3"] ? "full" : j["qat"]["indexer_fp4_e2m1"] ? "fp4only" : "off";
        c.tokens = j["tokens"].get<std::vector<int32_t>>();
        c.drafts = j["draft_tokens"].get<std::vector<int32_t>>();
        c.seed = j["seed_token"];
        out.push_back(std::move(c));
    }
    return out;
}

TEST(ds4_drafters, dspark_block_is_the_golden_draft) {
    const auto cases = dspark_cases();
    ASSERT_EQ(cases.size(), 4u);
    for (const auto &c : cases) {
        auto e = load("dspark", kDspark, c.qat);
        for (int way = 0; way < 2; ++way) {  // one prefill; speculation-like steps with rollbacks
            auto s = e->new_session();
            std::mt19937 rng(5);
            if (way == 0)
                s->sync(c.tokens);
            else
                advance_like_speculation(*s, c.tokens, rng);
            std::vector<int32_t> h = c.tokens;
            h.push_back(c.seed);
            EXPECT_EQ(s->draft(h, 5), c.drafts) << c.name << (way ? " (speculation-like)" : " (prefill)");
            EXPECT_EQ(s->draft(h, 3), std::vector<int32_t>(c.drafts.begin(), c.drafts.begin() + 3)) << c.name;
        }
    }
}

// At every position of a 300-token walk the session's draft block equals the one computed from scratch
// by the golden-tested pieces (dspark_capture over the whole prefix, then dspark_draft), whatever
// speculation-like steps and rollbacks the session went through.
TEST(ds4_drafters, dspark_block_equals_a_fresh_computation_everywhere) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const ds4_test::golden_case *c = nullptr;
    for (const auto &x : cases)
        if (x.tokens.size() == 300 && x.qat == ds4::qat_mode::full) c = &x;
    ASSERT_NE(c, nullptr);
    const auto target = ds4::load_model(kTarget);
    const auto w = ds4::load_dspark(*target, kDspark);
    ds4::state st = ds4::new_state(*target, ds4::qat_mode::full, kv_precision::f32);
    const size_t n = c->tokens.size(), F = static_cast<size_t>(w->feature_dim());
    std::vector<float> feats(n * F);
    std::vector<int64_t> pos(n);
    for (size_t i = 0; i < n; ++i) pos[i] = static_cast<int64_t>(i);
    ds4::dspark_capture(*target, *w, st, c->tokens, pos, feats);
    auto e = load("dspark", kDspark, "full");
    auto s = e->new_session();
    std::mt19937 rng(9);
    int checked = 0;
    for (size_t S = 1; S < n; S = S + 1 + rng() % 4) {
        advance_like_speculation(*s, std::vector<int32_t>(c->tokens.begin(), c->tokens.begin() + static_cast<std::ptrdiff_t>(S)), rng);
        const ds4::dspark_block b = ds4::dspark_draft(*target, *w, ds4::qat_mode::full, {},
                                                      std::span<const float>(feats).first(S * F), 0, c->tokens[S]);
        std::vector<int32_t> h(c->tokens.begin(), c->tokens.begin() + static_cast<std::ptrdiff_t>(S + 1));
        EXPECT_EQ(s->draft(h, 5), b.draft_tokens) << "position " << S;
        ++checked;
    }
    EXPECT_GT(checked, 80);
}

TEST(ds4_drafters, speculation_with_either_drafter_is_plain_decoding) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const std::vector<int32_t> prompt(cases.at(0).tokens.begin(), cases.at(0).tokens.end());
    for (const auto &[kind, file] : {std::pair{"mtp", kMtp}, std::pair{"dspark", kDspark}}) {
        auto e = load(kind, file, "full", 512);
        for (int k = 0; k < 2; ++k) {
            const sampling_params p = ds4_test::greedy_or_sampled(k == 1);
            const auto plain = ds4_test::generate(*e, prompt, p, 150, false);
            spec::spec_stats st;
            EXPECT_EQ(ds4_test::generate(*e, prompt, p, 150, true, &st), plain) << kind << (k ? " sampled" : " greedy");
            EXPECT_GT(st.drafted, 100) << kind;
        }
    }
}

// The daemon's generate with the session's drafter (fathom daemon --spec mtp|dspark): the plain daemon's
// reply (greedy ids) with drafts evaluated and kept.
TEST(ds4_drafters, daemon_generate_with_either_drafter_replies_as_plain) {
    const auto cases = ds4_test::load_cases("cases.jsonl");
    const std::filesystem::path root =
        std::filesystem::path(::testing::TempDir()) / ("fathom_ds4_daemon_" + std::to_string(::getpid()));
    std::filesystem::create_directories(root);
    {
        std::ofstream o(root / "p.bin", std::ios::binary);
        for (int32_t t : cases.at(0).tokens) o.write(reinterpret_cast<const char *>(&t), 4);  // int32 LE (x86)
    }
    server::daemon plain([] { return load("", "", "full", 512); }, root);
    const std::string want = plain.handle("generate p.bin 120");
    ASSERT_EQ(want.rfind("ok ", 0), 0u) << want;
    for (const auto &[kind, file] : {std::pair{"mtp", kMtp}, std::pair{"dspark", kDspark}}) {
        server::daemon_spec sp;
        sp.mode = "session";
        // Deterministic widths (rows priced free, the drafter's time not counted): the measured costs of a
        // random-weight drafter on this box would pause it for most of 120 tokens, and what is checked here is
        // the daemon's plumbing, not the width (tests/spec/test_spec_width.cpp).
        sp.ngram.row_cost = 0;
        server::daemon d([kind, file] { return load(kind, file, "full", 512); }, root, {}, {}, sp);
        EXPECT_EQ(d.handle("generate p.bin 120"), want) << kind;
        unsigned long steps = 0, drafted = 0, accepted = 0;
        EXPECT_EQ(std::sscanf(d.handle("stats").c_str(), "ok spec_steps %lu drafted %lu accepted %lu", &steps, &drafted,
                              &accepted),
                  3);
        EXPECT_GT(drafted, 0u) << kind;
    }
    std::filesystem::remove_all(root);
}

TEST(ds4_drafters, bad_options_fail_at_load) {
    auto fails = [](const std::function<void()> &f, const std::string &what) {
        try {
            f();
            ADD_FAILURE() << "accepted: " << what;
        } catch (const error &e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    fails([] { load("mtp", "", "full"); }, "no usable MTP head");  // ds4-tiny-a.gguf has no MTP block
    fails([] { load("dspark", "", "full"); }, "needs --draft-model");
    fails([] { load("eagle", "", "full"); }, "expected mtp or dspark");
    fails([] { load("dspark", kMtp, "full"); }, kMtp);  // an MTP file is no DSpark drafter
    fails(
        [] {
            engine_options o;
            o.model_path = kTarget;
            o.dist.devices = "cpu,cpu";
            o.ds4_draft = "mtp";
            o.ds4_draft_model = kMtp;
            engine::load(o);
        },
        "not with --devices");
    // A session without a drafter drafts nothing; a history that does not extend the held tokens throws.
    auto e = load("mtp", kMtp, "full");
    auto s = e->new_session();
    s->sync(std::vector<int32_t>{0, 5, 6});
    EXPECT_THROW(s->draft(std::vector<int32_t>{0, 5, 7, 8}, 2), error);
    EXPECT_THROW(s->draft(std::vector<int32_t>{0, 5}, 2), error);
}

}  // namespace
