// DS4 multi-row steps and rollback (deepseek4.h: step, truncate; deepseek4_exec.h), on the CPU:
//  * the ds4-tiny goldens (../shared/golden/ds4-tiny, the official model.py in f32) through ds4::step
//    with every sequence evaluated 1, 2, 3 and 5 rows at a time, and all sequences of a QAT mode
//    interleaved in the same steps: each passes its tier, and each row's logits are bit-identical to
//    the sequence evaluated alone, one token per forward (batch invariance);
//  * rollback: random walks that evaluate a true token plus up to max_rollback wrong drafts, drop the
//    drafts with ds4::truncate and go on, across raw-ring wraps and ratio-4 / ratio-128 block ends: the
//    logits of every kept row equal plain decoding bit for bit, and the saved state equals plain
//    decoding's byte for byte (the independent truth being plain decoding, itself checked against the
//    goldens); on ds4-tiny (f32 reference products) and a synthetic q8_0 file with a window of 8 rows
//    (quantised products, threads);
//  * bad steps and truncations: one clear error, no state touched.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>

#include "backend/cpu/thread_pool.h"
#include "core/error.h"
#include "core/state_io.h"
#include "golden_util.h"
#include "models/deepseek4.h"
#include "models/deepseek4_synth.h"

namespace {

using namespace fathom;

const ds4::model &tiny() {
    static std::unique_ptr<ds4::model> m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    return *m;
}

const std::vector<ds4_test::golden_case> &cases() {
    static std::vector<ds4_test::golden_case> c = ds4_test::load_cases("cases.jsonl");
    return c;
}

// A synthetic DS4 (tiny geometry, q8_0 matrices, raw window 8: the ring wraps every 8 positions).
const ds4::model &small_ring() {
    static std::unique_ptr<ds4::model> m = [] {
        ds4::hparams hp = ds4::synth_preset("tiny");
        hp.window = 8;
        ds4::synth_options o;
        o.mix = "q8_0";
        o.seed = 7;
        const std::string path =
            (std::filesystem::temp_directory_path() / ("fathom_ds4_rows_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::synth_write(path, hp, o);
        auto r = ds4::load_model(path);  // the mapping stays valid after the unlink
        std::filesystem::remove(path);
        return r;
    }();
    return *m;
}

// Bytes of a state as session saves write them.
struct byte_writer final : state_writer {
    std::vector<uint8_t> b;
    void write(const void *p, size_t n) override {
        b.insert(b.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
    }
};
std::vector<uint8_t> saved(const ds4::model &m, const ds4::state &st) {
    byte_writer w;
    ds4::write_state(m, st, w);
    return w.b;
}

// Plain decoding: one token per forward, every position's logits [n, V].
std::vector<float> plain(const ds4::model &m, ds4::state &st, std::span<const int32_t> toks) {
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    std::vector<float> out(toks.size() * V);
    for (size_t i = 0; i < toks.size(); ++i) {
        const int64_t p = st.n_past;
        ds4::forward(m, st, toks.subspan(i, 1), std::span<const int64_t>(&p, 1),
                     {std::span<float>(out).subspan(i * V, V), {}});
    }
    return out;
}

bool same_bits(const float *a, const float *b, size_t n) {
    return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// ---- goldens through multi-row steps -------------------------------------------------------------

// Every case of one QAT mode evaluated in the same steps: each step takes the next `rows` tokens of
// every unfinished sequence, rows of the sequences interleaved (sequence 0 row 0, sequence 1 row 0, ...).
void golden_interleaved(ds4::qat_mode qat, size_t rows_per_seq) {
    const ds4::model &m = tiny();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    std::vector<const ds4_test::golden_case *> cs;
    for (const auto &c : cases())
        if (c.qat == qat) cs.push_back(&c);
    ASSERT_EQ(cs.size(), 4u);
    std::vector<ds4::state> st;
    for (size_t k = 0; k < cs.size(); ++k) st.push_back(ds4::new_state(m, qat, kv_precision::f32));
    std::vector<ds4::state *> seqs;
    for (auto &s : st) seqs.push_back(&s);
    std::vector<std::vector<float>> got(cs.size());
    for (size_t k = 0; k < cs.size(); ++k) got[k].resize(cs[k]->tokens.size() * V);
    for (size_t done = 0;; done += rows_per_seq) {
        std::vector<ds4::step_row> rows;
        std::vector<int32_t> logit_rows;
        std::vector<std::pair<size_t, size_t>> dest;  // (sequence, position) of each logit row
        for (size_t j = 0; j < rows_per_seq; ++j)
            for (size_t k = 0; k < cs.size(); ++k) {
                const size_t p = done + j;
                if (p >= cs[k]->tokens.size()) continue;
                logit_rows.push_back(static_cast<int32_t>(rows.size()));
                dest.emplace_back(k, p);
                rows.push_back({static_cast<int32_t>(k), static_cast<int64_t>(p), cs[k]->tokens[p]});
            }
        if (rows.empty()) break;
        std::vector<float> lg(logit_rows.size() * V);
        ds4::step(m, seqs, rows, logit_rows, lg);
        for (size_t r = 0; r < dest.size(); ++r)
            std::memcpy(&got[dest[r].first][dest[r].second * V], &lg[r * V], V * sizeof(float));
    }
    for (size_t k = 0; k < cs.size(); ++k) {
        const auto v = ds4_test::compare(*cs[k], got[k], m.hp.n_vocab);
        EXPECT_TRUE(v.ok) << cs[k]->name << " rows " << rows_per_seq << ": " << v.why;
        ds4::state alone = ds4::new_state(m, qat, kv_precision::f32);
        const std::vector<float> ref = plain(m, alone, cs[k]->tokens);
        EXPECT_TRUE(same_bits(ref.data(), got[k].data(), ref.size()))
            << cs[k]->name << ": rows " << rows_per_seq << " interleaved differ from the sequence alone";
        EXPECT_EQ(saved(m, alone), saved(m, st[k])) << cs[k]->name;
    }
}

TEST(ds4_rows, goldens_interleaved_1_2_3_5_rows_per_sequence) {
    for (ds4::qat_mode q : {ds4::qat_mode::full, ds4::qat_mode::fp4only, ds4::qat_mode::off})
        for (size_t r : {1, 2, 3, 5}) golden_interleaved(q, r);
}

// One sequence alone in steps of 1, 2, 3, 5 rows (a verification's shape): the goldens' tiers.
TEST(ds4_rows, goldens_one_sequence_in_steps) {
    const ds4::model &m = tiny();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    for (const auto &c : cases()) {
        for (size_t r : {2, 3, 5}) {
            ds4::state st = ds4::new_state(m, c.qat, kv_precision::f32);
            ds4::state *seq = &st;
            std::vector<float> got(c.tokens.size() * V);
            for (size_t p = 0; p < c.tokens.size(); p += r) {
                const size_t n = std::min(r, c.tokens.size() - p);
                std::vector<ds4::step_row> rows;
                std::vector<int32_t> lr;
                for (size_t j = 0; j < n; ++j) {
                    rows.push_back({0, static_cast<int64_t>(p + j), c.tokens[p + j]});
                    lr.push_back(static_cast<int32_t>(j));
                }
                ds4::step(m, std::span<ds4::state *const>(&seq, 1), rows, lr, std::span(got).subspan(p * V, n * V));
            }
            const auto v = ds4_test::compare(c, got, m.hp.n_vocab);
            EXPECT_TRUE(v.ok) << c.name << " steps of " << r << ": " << v.why;
        }
    }
}

// ---- rollback ------------------------------------------------------------------------------------

// Random walks of S sequences in the same steps, each like a speculative decoder: at position p a
// sequence evaluates its true token plus k drafts (k <= max_rollback), the first `good` of them right,
// then keeps p + 1 + good positions (ds4::truncate; now and then in two truncations). The positions
// cross ring wraps and compressor block ends at every phase. Every row fed only true tokens must have
// plain decoding's logits bit for bit, and each final state must save to plain decoding's bytes.
int rollback_walk(const ds4::model &m, ds4::qat_mode qat, const ds4::exec_options &exec,
                  const std::vector<std::vector<int32_t>> &toks, uint32_t seed) {
    const size_t V = static_cast<size_t>(m.hp.n_vocab), S = toks.size();
    std::vector<std::vector<float>> want(S);
    std::vector<ds4::state> ref, st;
    for (size_t k = 0; k < S; ++k) {
        ref.push_back(ds4::new_state(m, qat, kv_precision::f32));
        ref.back().exec = exec;
        want[k] = plain(m, ref.back(), toks[k]);
        st.push_back(ds4::new_state(m, qat, kv_precision::f32));
        st.back().exec = exec;
    }
    std::vector<ds4::state *> seqs;
    for (auto &x : st) seqs.push_back(&x);
    // `follow[k]`: plain decoding of sequence k kept level with st[k] after each truncation, so that the
    // saved bytes (every raw row and frontier slot plain decoding holds, read ones and stale ones) are
    // compared right where a rollback happened.
    std::vector<ds4::state> follow;
    for (size_t k = 0; k < S; ++k) {
        follow.push_back(ds4::new_state(m, qat, kv_precision::f32));
        follow.back().exec = exec;
    }
    std::mt19937 rng(seed);
    int truncations = 0, mismatches = 0, state_mismatches = 0;
    for (;;) {
        std::vector<ds4::step_row> rows;
        std::vector<int32_t> lr;
        std::vector<std::pair<size_t, size_t>> check;  // (sequence, position) of rows fed true tokens only
        std::vector<size_t> keep(S, 0);
        for (size_t k = 0; k < S; ++k) {
            const size_t p = static_cast<size_t>(st[k].n_past), n = toks[k].size();
            if (p >= n) continue;
            // The deepest rollback (max_rollback drafts, none right) a third of the time: the rings'
            // sizes are exact for it.
            const bool deepest = rng() % 3 == 0;
            const size_t kd = std::min<size_t>(deepest ? ds4::max_rollback : rng() % (ds4::max_rollback + 1), n - 1 - p);
            const size_t good = deepest ? 0 : rng() % (kd + 1);
            for (size_t j = 0; j <= kd; ++j) {
                int32_t t = toks[k][p + j];
                if (j > good) t = (t + 1 + static_cast<int32_t>(rng() % (V - 1))) % static_cast<int32_t>(V);  // wrong
                if (j <= good) {
                    lr.push_back(static_cast<int32_t>(rows.size()));
                    check.emplace_back(k, p + j);
                }
                rows.push_back({static_cast<int32_t>(k), static_cast<int64_t>(p + j), t});
            }
            keep[k] = p + 1 + good;
        }
        if (rows.empty()) break;
        {  // sequences interleaved at random, each sequence's rows still in position order
            std::vector<std::vector<ds4::step_row>> q(S);
            for (const auto &r : rows) q[static_cast<size_t>(r.seq)].push_back(r);
            std::vector<size_t> at(S, 0);
            rows.clear();
            for (size_t left = 0; [&] { left = 0; for (size_t k = 0; k < S; ++k) left += q[k].size() - at[k]; return left; }() > 0;) {
                size_t k = rng() % S;
                while (at[k] == q[k].size()) k = (k + 1) % S;
                rows.push_back(q[k][at[k]++]);
            }
        }
        // the logit rows follow their (sequence, position) to wherever the shuffle put them
        lr.clear();
        for (const auto &[k, p] : check)
            for (size_t r = 0; r < rows.size(); ++r)
                if (rows[r].seq == static_cast<int32_t>(k) && rows[r].pos == static_cast<int64_t>(p))
                    lr.push_back(static_cast<int32_t>(r));
        std::vector<float> lg(lr.size() * V);
        ds4::step(m, seqs, rows, lr, lg);
        for (size_t c = 0; c < check.size(); ++c)
            if (!same_bits(&lg[c * V], &want[check[c].first][check[c].second * V], V)) ++mismatches;
        for (size_t k = 0; k < S; ++k) {
            if (keep[k] == 0 || static_cast<int64_t>(keep[k]) == st[k].n_past) continue;
            if (rng() % 4 == 0 && st[k].n_past - static_cast<int64_t>(keep[k]) >= 2)
                ds4::truncate(st[k], static_cast<int64_t>(keep[k]) + (st[k].n_past - static_cast<int64_t>(keep[k])) / 2);
            ds4::truncate(st[k], static_cast<int64_t>(keep[k]));
            ++truncations;
            plain(m, follow[k], std::span(toks[k]).subspan(static_cast<size_t>(follow[k].n_past),
                                                           keep[k] - static_cast<size_t>(follow[k].n_past)));
            if (saved(m, follow[k]) != saved(m, st[k])) ++state_mismatches;
        }
    }
    EXPECT_EQ(mismatches, 0) << "rows whose logits differ from plain decoding after rollbacks";
    EXPECT_EQ(state_mismatches, 0) << "rolled-back states that save other bytes than plain decoding's";
    for (size_t k = 0; k < S; ++k) EXPECT_EQ(saved(m, ref[k]), saved(m, st[k])) << "sequence " << k;
    return truncations;
}

std::vector<int32_t> random_tokens(size_t n, int32_t V, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> t(n);
    for (auto &x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
    t[0] = 0;  // BOS
    return t;
}

TEST(ds4_rows, rollback_equals_plain_decoding_tiny) {
    const ds4::model &m = tiny();
    const auto &c = cases();
    std::vector<int32_t> longest;
    for (const auto &x : c)
        if (x.tokens.size() > longest.size()) longest = x.tokens;
    ASSERT_GE(longest.size(), 520u);  // ratio-128 blocks end at 127, 255, 383, 511
    for (ds4::qat_mode q : {ds4::qat_mode::full, ds4::qat_mode::off}) {
        const int n = rollback_walk(m, q, {}, {longest}, 11);
        EXPECT_GT(n, 50);
    }
}

TEST(ds4_rows, rollback_of_interleaved_sequences_tiny) {
    const ds4::model &m = tiny();
    const std::vector<std::vector<int32_t>> toks = {random_tokens(300, m.hp.n_vocab, 1), random_tokens(170, m.hp.n_vocab, 2),
                                                    random_tokens(260, m.hp.n_vocab, 3)};
    EXPECT_GT(rollback_walk(m, ds4::qat_mode::full, {}, toks, 5), 50);
}

TEST(ds4_rows, rollback_small_ring_quantised_threads) {
    const ds4::model &m = small_ring();
    cpu::thread_pool pool(2);
    ds4::exec_options ex;
    ex.pool = &pool;
    ex.quantised = true;
    const std::vector<std::vector<int32_t>> toks = {random_tokens(280, m.hp.n_vocab, 4), random_tokens(150, m.hp.n_vocab, 6)};
    EXPECT_GT(rollback_walk(m, ds4::qat_mode::full, ex, toks, 9), 30);
}

// A step whose rows share it with other sequences gives each row its lone logits bit for bit, on the
// quantised path with threads (rows of a prompt chunk beside decodes of other sequences).
TEST(ds4_rows, batch_invariant_quantised) {
    const ds4::model &m = small_ring();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    cpu::thread_pool pool(2);
    ds4::exec_options ex;
    ex.pool = &pool;
    ex.quantised = true;
    const auto a = random_tokens(40, m.hp.n_vocab, 21), b = random_tokens(40, m.hp.n_vocab, 22);
    ds4::state ra = ds4::new_state(m, ds4::qat_mode::full, kv_precision::f16), rb = ra;
    ra.exec = rb.exec = ex;
    const auto wa = plain(m, ra, a), wb = plain(m, rb, b);
    ds4::state sa = ds4::new_state(m, ds4::qat_mode::full, kv_precision::f16), sb = sa;
    sa.exec = sb.exec = ex;
    ds4::state *seqs[2] = {&sa, &sb};
    // a: a 30-token chunk then decodes; b: decodes one at a time throughout, rows interleaved with a's.
    size_t pa = 0, pb = 0;
    while (pa < a.size() || pb < b.size()) {
        std::vector<ds4::step_row> rows;
        std::vector<int32_t> lr;
        std::vector<std::pair<int, size_t>> dst;
        if (pb < b.size()) {
            lr.push_back(static_cast<int32_t>(rows.size()));
            dst.emplace_back(1, pb);
            rows.push_back({1, static_cast<int64_t>(pb), b[pb]});
            ++pb;
        }
        const size_t na = pa == 0 ? 30 : 1;
        for (size_t j = 0; j < na && pa < a.size(); ++j, ++pa) {
            lr.push_back(static_cast<int32_t>(rows.size()));
            dst.emplace_back(0, pa);
            rows.push_back({0, static_cast<int64_t>(pa), a[pa]});
        }
        std::vector<float> lg(lr.size() * V);
        ds4::step(m, seqs, rows, lr, lg);
        for (size_t r = 0; r < dst.size(); ++r) {
            const auto &w = dst[r].first == 0 ? wa : wb;
            ASSERT_TRUE(same_bits(&lg[r * V], &w[dst[r].second * V], V))
                << "sequence " << dst[r].first << " position " << dst[r].second;
        }
    }
}

// ---- bad input -----------------------------------------------------------------------------------

TEST(ds4_rows, bad_steps_change_nothing) {
    const ds4::model &m = tiny();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    ds4::state a = ds4::new_state(m, ds4::qat_mode::off, kv_precision::f32), b = a;
    const auto ta = random_tokens(40, m.hp.n_vocab, 31);
    plain(m, a, ta);
    plain(m, b, std::span(ta).first(10));
    const auto ba = saved(m, a), bb = saved(m, b);
    ds4::state *seqs[2] = {&a, &b};
    const std::vector<int32_t> lr2 = {0, 1};
    auto bad = [&](std::vector<ds4::step_row> rows, std::vector<int32_t> lr, const std::string &what, size_t n_seq = 2) {
        std::vector<float> out(lr.size() * V);
        try {
            ds4::step(m, std::span<ds4::state *const>(seqs, n_seq), rows, lr, out);
            ADD_FAILURE() << "accepted: " << what;
        } catch (const error &e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
        EXPECT_EQ(saved(m, a), ba) << what;
        EXPECT_EQ(saved(m, b), bb) << what;
        EXPECT_EQ(a.n_past, 40);
        EXPECT_EQ(b.n_past, 10);
    };
    bad({{0, 40, 5}, {2, 10, 5}}, lr2, "names sequence 2");
    bad({{0, 40, 5}, {1, 11, 5}}, lr2, "position 11 of sequence 1, expected 10");        // skips
    bad({{0, 40, 5}, {0, 40, 6}}, lr2, "position 40 of sequence 0, expected 41");        // repeats
    bad({{0, 41, 5}}, {0}, "position 41 of sequence 0, expected 40");                    // skips
    bad({{1, 10, 5}, {0, 40, static_cast<int32_t>(V)}}, lr2, "outside");                  // bad token
    bad({{0, 40, 5}, {1, 10, 5}}, {0, 2}, "logits asked of row 2");
    {
        const std::vector<ds4::step_row> rows = {{0, 40, 5}};
        const std::vector<int32_t> lr = {0};
        std::vector<float> small(V - 1);
        EXPECT_THROW(ds4::step(m, seqs, rows, lr, small), error);
        EXPECT_EQ(saved(m, a), ba);
    }
    seqs[1] = &a;
    bad({{0, 40, 5}}, {0}, "is sequence 0 again");
    seqs[1] = &b;
    // truncation outside [rollback_floor, n_past]
    EXPECT_EQ(ds4::rollback_floor(a), 40 - ds4::max_rollback);
    EXPECT_THROW(ds4::truncate(a, 40 - ds4::max_rollback - 1), error);
    EXPECT_THROW(ds4::truncate(a, 41), error);
    EXPECT_EQ(saved(m, a), ba);
    EXPECT_NO_THROW(ds4::truncate(a, 40 - ds4::max_rollback));
    EXPECT_EQ(ds4::rollback_floor(a), 40 - ds4::max_rollback);  // a second truncation reaches no further back
    EXPECT_THROW(ds4::truncate(a, 40 - ds4::max_rollback - 1), error);
}

// A loaded state cannot be rolled back below its length (the stream holds no older rows); it rolls
// back over what it evaluated after the load like any other.
TEST(ds4_rows, loaded_state_rolls_back_only_what_it_evaluated) {
    const ds4::model &m = tiny();
    const auto t = random_tokens(200, m.hp.n_vocab, 41);
    ds4::state a = ds4::new_state(m, ds4::qat_mode::full, kv_precision::f32);
    plain(m, a, std::span(t).first(150));
    struct reader final : state_reader {
        std::vector<uint8_t> b;
        size_t at = 0;
        void read(void *p, size_t n) override {
            if (n > b.size() - at) throw error("short");
            std::memcpy(p, b.data() + at, n);
            at += n;
        }
        uint64_t remaining() const override { return b.size() - at; }
    } r;
    r.b = saved(m, a);
    ds4::state l = ds4::new_state(m, ds4::qat_mode::full, kv_precision::f32);
    ds4::read_state(m, l, r, 150);
    EXPECT_EQ(ds4::rollback_floor(l), 150);
    EXPECT_THROW(ds4::truncate(l, 149), error);
    ds4::state ref = a;
    const auto want = plain(m, ref, std::span(t).subspan(150));
    const auto got1 = plain(m, l, std::span(t).subspan(150, 20));
    ds4::truncate(l, 160);
    const auto got2 = plain(m, l, std::span(t).subspan(160));
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    EXPECT_TRUE(same_bits(got1.data(), want.data(), 20 * V));
    EXPECT_TRUE(same_bits(got2.data(), want.data() + 10 * V, 40 * V));
    EXPECT_EQ(saved(m, l), saved(m, ref));
}

}  // namespace
