// Several sequences in flight through the DS4 layer pipeline (issue 8).
//
// local_pipeline::submit / collect (pipeline_rank::begin_forward / finish_forward): three pipelines
// over the synthetic tiny geometry, every round submitted together before any is collected, with and
// without micro-batches, give each sequence's unsplit ds4::forward logits bit for bit; one outstanding
// forward per pipeline is enforced without breaking it.
//
// The engine (src/engine/ds4_engine.cpp, ds4_engine::sync_step / decode_step over in-process
// pipelines): three sessions of ds4-tiny driven by scheduler-like steps (decodes, short chunks, long
// prompts, a truncation, a divergence, a no-op, a decode_step) give logits bit-identical to each
// session run alone on the one-device engine and to the same sessions synced one by one on the split
// engine; an item the engine must refuse fails alone and leaves the other sessions right and usable.
// Both also with ranks 1.. as `fathom rank` processes (--procs): the batch under one hold of their link.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/conversation_util.h"
#include "dist/dist_test_util.h"
#include "dist/pipeline.h"
#include "models/ds4/golden_util.h"
#include "fathom/engine.h"
#include "models/deepseek4_synth.h"

namespace {

using namespace fathom;
using dist::layer_range;
using dist_test::error_of;
using dist_test::poisoned;
using dist_test::same_bits;

// ---- local_pipeline::submit / collect -------------------------------------------------------------

// Synthetic tiny geometry (6 layers SWA,SWA,CSA,HCA,CSA,HCA; window 32; indexer top-k engaged from
// position 67), seeded weights; a per-process file (ctest runs tests in parallel), unlinked once mapped.
const ds4::model &synth_model() {
    static std::unique_ptr<ds4::model> m = dist_test::load_synth(ds4::synth_preset("tiny"), 11, "dist_inflight_synth");
    return *m;
}

// Sequence `seq`'s tokens: a different pattern per sequence (so swapped results cannot pass).
std::vector<int32_t> seq_tokens(size_t n, int vocab, size_t seq) {
    std::vector<int32_t> t(n);
    for (size_t i = 0; i < n; ++i)
        t[i] = static_cast<int32_t>((i * 37 + 11 + seq * 101 + (i * i * (seq + 1)) % 7) %
                                    static_cast<size_t>(vocab));
    return t;
}

// Three sequences, each in its own pipeline with its own chunk schedule (prompts, decode steps, a chunk
// crossing the window, the indexer's top-k engaged past position 67). Each round submits the next chunk
// of every unfinished sequence, then collects them in order; odd rounds ask for every token's logits,
// even rounds for the last token's. Reference: ds4::forward of each sequence alone over the same chunks.
TEST(dist_inflight, pipelines_in_flight_equal_each_sequence_alone) {
    const auto &m = synth_model();
    const size_t V = static_cast<size_t>(m.hp.n_vocab), n = 72;
    const std::vector<std::vector<size_t>> chunks = {
        {9, 1, 1, 13, 1, 30, 1, 5, 1}, {1, 20, 1, 1, 7, 40, 1}, {33, 1, 2, 1, 3, 1, 28, 1, 1}};
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<float>> want;  // [seq] every position's logits [n, V]
    for (size_t q = 0; q < 3; ++q) {
        tokens.push_back(seq_tokens(n, m.hp.n_vocab, q));
        want.push_back(dist_test::reference(m, tokens[q], chunks[q], ds4::qat_mode::full));
    }
    const std::vector<std::vector<layer_range>> splits = {
        {{0, 3}, {3, 6}}, {{0, 2}, {2, 4}, {4, 6}}, {{0, 6}}};
    for (const auto &split : splits) {
        for (int64_t mb : {0, 4}) {
            SCOPED_TRACE(std::to_string(split.size()) + " ranks, micro-batch " + std::to_string(mb));
            std::vector<std::unique_ptr<dist::local_pipeline>> pl;
            for (size_t q = 0; q < 3; ++q) {
                pl.push_back(
                    std::make_unique<dist::local_pipeline>(m, split, ds4::qat_mode::full, kv_precision::f32));
                pl[q]->set_micro_batch(mb);
            }
            std::vector<int64_t> pos(n);
            std::iota(pos.begin(), pos.end(), 0);
            std::vector<size_t> done(3, 0), next(3, 0);
            std::vector<std::vector<float>> out(3);  // [seq] this round's logits (poisoned before)
            for (int round = 0; done[0] < n || done[1] < n || done[2] < n; ++round) {
                const bool all = round % 2 == 1;
                std::vector<size_t> len(3, 0);
                for (size_t q = 0; q < 3; ++q) {
                    if (done[q] == n) continue;
                    len[q] = std::min(chunks[q][std::min(next[q]++, chunks[q].size() - 1)], n - done[q]);
                    out[q] = poisoned(all ? len[q] * V : V);
                    pl[q]->submit(std::span(tokens[q]).subspan(done[q], len[q]),
                                  std::span(pos).subspan(done[q], len[q]), out[q]);
                }
                for (size_t q = 0; q < 3; ++q) {
                    if (len[q] == 0) continue;
                    pl[q]->collect();
                    const size_t first = all ? done[q] : done[q] + len[q] - 1;  // first row of want compared
                    EXPECT_EQ(0,
                              std::memcmp(out[q].data(), &want[q][first * V], out[q].size() * sizeof(float)))
                        << "sequence " << q << ", round " << round << ", tokens [" << done[q] << ", "
                        << done[q] + len[q] << ")";
                    done[q] += len[q];
                    EXPECT_EQ(pl[q]->n_past(), static_cast<int64_t>(done[q]));
                }
            }
        }
    }
}

// One outstanding forward per pipeline: a second submit, a reset, or a collect with nothing
// outstanding throw and change nothing (the outstanding forward still completes right afterwards); a
// pipeline destroyed with a forward outstanding stops cleanly; forward() still works in between.
TEST(dist_inflight, one_outstanding_forward_per_pipeline) {
    const auto &m = synth_model();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    const auto tokens = seq_tokens(12, m.hp.n_vocab, 5);
    const auto want = dist_test::reference(m, tokens, {6, 1}, ds4::qat_mode::off);
    std::vector<int64_t> pos(12);
    std::iota(pos.begin(), pos.end(), 0);
    dist::local_pipeline pl(m, {{0, 2}, {2, 4}, {4, 6}}, ds4::qat_mode::off, kv_precision::f32);
    EXPECT_NE(error_of([&] { pl.collect(); }).find("no forward outstanding"), std::string::npos);
    std::vector<float> a = poisoned(V), b = poisoned(V);
    pl.submit(std::span(tokens).first(6), std::span(pos).first(6), a);
    EXPECT_NE(error_of([&] {
                  pl.submit(std::span(tokens).subspan(6, 1), std::span(pos).subspan(6, 1), b);
              }).find("already outstanding"),
              std::string::npos);
    EXPECT_NE(error_of([&] { pl.reset(); }).find("while a forward is outstanding"), std::string::npos);
    EXPECT_NE(error_of([&] {
                  pl.forward(std::span(tokens).subspan(6, 1), std::span(pos).subspan(6, 1), b);
              }).find("already outstanding"),
              std::string::npos);
    pl.collect();
    EXPECT_EQ(0, std::memcmp(a.data(), &want[5 * V], V * sizeof(float)));
    EXPECT_NE(error_of([&] { pl.collect(); }).find("no forward outstanding"), std::string::npos);
    pl.forward(std::span(tokens).subspan(6, 1), std::span(pos).subspan(6, 1), b);  // synchronous, as before
    EXPECT_EQ(0, std::memcmp(b.data(), &want[6 * V], V * sizeof(float)));
    pl.submit(std::span(tokens).subspan(7, 1), std::span(pos).subspan(7, 1), b);
    pl.collect();
    EXPECT_EQ(0, std::memcmp(b.data(), &want[7 * V], V * sizeof(float)));
    // No tokens: nothing sent, nothing to wait for, but still one outstanding forward to collect.
    pl.submit({}, {}, {});
    EXPECT_NE(error_of([&] { pl.submit({}, {}, {}); }).find("already outstanding"), std::string::npos);
    pl.collect();
    EXPECT_EQ(pl.n_past(), 8);
    // A position that does not continue the sequence is refused on rank 0 before anything is sent.
    EXPECT_NE(error_of([&] {
                  pl.submit(std::span(tokens).subspan(9, 1), std::span(pos).subspan(9, 1), b);
              }).find("expected 8"),
              std::string::npos);
    {
        dist::local_pipeline other(m, {{0, 3}, {3, 6}}, ds4::qat_mode::off, kv_precision::f32);
        other.submit(std::span(tokens).first(6), std::span(pos).first(6), a);
    }  // destroyed with the forward outstanding: stops and joins (a hang here fails the test's timeout)
}

// begin_forward returns without waiting for any later rank: here rank 1 is not even running. Two
// sequences' rank 0s begin on this thread, then their rank 1s (over their own hubs) are stepped by hand
// with serve_one, then both finish: the logits are each sequence's own.
TEST(dist_inflight, begin_forward_does_not_wait_for_the_later_ranks) {
    const auto &m = synth_model();
    const size_t V = static_cast<size_t>(m.hp.n_vocab);
    const std::vector<layer_range> split = {{0, 4}, {4, 6}};
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::unique_ptr<dist::inprocess_hub>> hubs;
    std::vector<std::unique_ptr<dist::transport>> t0, t1;
    std::vector<std::unique_ptr<dist::pipeline_rank>> r0, r1;
    for (size_t q = 0; q < 2; ++q) {
        tokens.push_back(seq_tokens(9, m.hp.n_vocab, q + 7));
        hubs.push_back(std::make_unique<dist::inprocess_hub>(2, std::chrono::milliseconds(20000)));
        t0.push_back(hubs[q]->endpoint(0));
        t1.push_back(hubs[q]->endpoint(1));
        r0.push_back(
            std::make_unique<dist::pipeline_rank>(m, split, *t0[q], ds4::qat_mode::full, kv_precision::f32));
        r1.push_back(
            std::make_unique<dist::pipeline_rank>(m, split, *t1[q], ds4::qat_mode::full, kv_precision::f32));
    }
    std::vector<int64_t> pos(9);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<std::vector<float>> out = {poisoned(V), poisoned(V)};
    for (size_t q = 0; q < 2; ++q) {
        r0[q]->begin_forward(tokens[q], pos, out[q]);
        EXPECT_TRUE(r0[q]->forward_outstanding());
        EXPECT_EQ(r0[q]->n_past(), 9);  // rank 0's blocks ran
        EXPECT_EQ(r1[q]->n_past(), 0);  // rank 1 has not started
    }
    for (size_t q = 0; q < 2; ++q) EXPECT_TRUE(r1[q]->serve_one());
    for (size_t q = 0; q < 2; ++q) {
        r0[q]->finish_forward();
        EXPECT_FALSE(r0[q]->forward_outstanding());
        const auto want = dist_test::reference(m, tokens[q], {9}, ds4::qat_mode::full);
        EXPECT_EQ(0, std::memcmp(out[q].data(), &want[8 * V], V * sizeof(float))) << "sequence " << q;
        r0[q]->stop();
        EXPECT_FALSE(r1[q]->serve_one());
    }
}

// ---- the engine: sync_step / decode_step over in-process pipelines --------------------------------

std::string tiny_path() {
    return ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
}

// procs: ranks 1.. as `fathom rank` child processes (the CLI's --procs; FATHOM_CLI is the built binary),
// with the options below as the CLI would pass them.
std::unique_ptr<engine> load(const std::string &devices, int64_t micro_batch, int n_ctx = 1024, bool procs = false) {
    engine_options o;
    o.model_path = tiny_path();
    o.n_threads = 2;
    o.n_ctx = n_ctx;
    o.n_batch = 16;  // chunks up to 16 tokens go in flight; longer prompts take session::sync
    o.ds4_qat = "full";
    o.dist.devices = devices;
    o.dist.micro_batch = micro_batch;
    if (procs) {
        o.dist.rank_procs = true;
        const std::string model = std::filesystem::absolute(o.model_path).string();
        o.dist.rank_command = [devices, model](int rank, int world, const std::string &id) {
            return std::vector<std::string>{FATHOM_CLI, "rank", "--rank", std::to_string(rank), "--world",
                                            std::to_string(world), "--join", id, "-m", model, "--numerics",
                                            "invariant", "--qat", "full", "--kv-type", "f16", "--devices", devices,
                                            "--layout", "pipeline", "--parent-pid",
                                            std::to_string(static_cast<long>(::getpid())), "-t", "2"};
        };
    }
    return engine::load(o);
}

// One scheduler step: items {session, prefix, want_logits}; via_decode_step: every item appends one
// token and the step goes through engine::decode_step instead of sync_step.
struct step_item {
    size_t sess;
    std::vector<int32_t> prefix;
    bool want_logits = true;
};
struct step {
    std::vector<step_item> items;
    bool via_decode_step = false;
};

std::vector<int32_t> head(const std::vector<int32_t> &t, size_t n) {
    return {t.begin(), t.begin() + n};
}
std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t> &b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// Steps over three sessions, n_batch 16: in-flight appends (chunks of 1..16 tokens, one wanting no
// logits), long prompts (> 16 tokens: sync in chunks), a truncation (a strict prefix of what is held), a
// divergence, an item already held (a no-op), and decode_step rounds; positions reach 60.
std::vector<step> script(int V) {
    const auto t0 = dist_test::stream(80, V, 11), t1 = dist_test::stream(80, V, 12),
               t2 = dist_test::stream(80, V, 13);
    const auto alt = dist_test::stream(20, V, 14);
    const auto s2 = cat(head(t2, 40), head(alt, 20));  // session 2 after its divergence
    std::vector<step> s;
    s.push_back({{{0, head(t0, 10)}, {1, head(t1, 16)}, {2, head(t2, 37)}}});  // fast, fast (= n_batch), slow
    s.push_back({{{0, head(t0, 11)}, {1, head(t1, 17)}, {2, head(t2, 38)}}});  // decodes
    s.push_back({{{0, head(t0, 20), false}, {1, head(t1, 18)}, {2, head(t2, 45)}}});
    s.push_back({{{0, head(t0, 21)}, {1, head(t1, 30)}, {2, head(t2, 46)}}});
    s.push_back({{{0, head(t0, 15)}, {1, head(t1, 31)}, {2, head(s2, 43)}}});  // truncation, divergence
    s.push_back({{{0, head(t0, 16)}, {1, head(t1, 31)}, {2, head(s2, 44)}}});  // session 1: held (no-op)
    s.push_back({{{2, s2}, {0, head(t0, 33)}}});  // a 16-token append (fast), a 17-token one (slow)
    for (size_t k = 0; k < 4; ++k)  // decode_step rounds (session 1 joins the last, items in another order)
        s.push_back({{{0, head(t0, 34 + k)}, {2, cat(s2, head(t1, k + 1))}}, true});
    s.back().items.push_back({1, head(t1, 32)});
    s.push_back({{{1, head(t1, 60)}, {0, head(t0, 40)}, {2, cat(cat(s2, head(t1, 4)), head(t0, 5))}}});
    return s;
}

// What each item's session held and its logits afterwards, in script order.
struct step_results {
    std::vector<std::vector<float>> logits;  // [item] logits() when wanted, else empty
    std::vector<int64_t> n_past;             // [item]
};

void record(step_results &r, const session &s, const step_item &it) {
    EXPECT_EQ(s.tokens(), it.prefix);
    r.n_past.push_back(s.n_past());
    if (!it.want_logits) {
        r.logits.emplace_back();
        return;
    }
    const auto l = s.logits();
    r.logits.emplace_back(l.begin(), l.end());
}

// The script through sync_step / decode_step batches on `e`.
step_results run_batched(engine &e, const std::vector<step> &steps) {
    std::vector<std::unique_ptr<session>> ss;
    for (int i = 0; i < 3; ++i) ss.push_back(e.new_session());
    step_results r;
    for (const step &st : steps) {
        if (st.via_decode_step) {
            std::vector<session *> sess;
            std::vector<int32_t> toks;
            for (const auto &it : st.items) {
                sess.push_back(ss[it.sess].get());
                toks.push_back(it.prefix.back());
            }
            e.decode_step(sess, toks);
        } else {
            std::vector<sync_item> items;
            for (const auto &it : st.items) items.push_back({ss[it.sess].get(), it.prefix, it.want_logits});
            e.sync_step(items);
        }
        for (const auto &it : st.items) record(r, *ss[it.sess], it);
    }
    return r;
}

// The script one item at a time with session::sync, in script order (the sequential path), or
// session by session (`alone`: all of session 0's items, then 1's, then 2's), results in script order.
step_results run_one_by_one(engine &e, const std::vector<step> &steps, bool alone) {
    std::vector<std::unique_ptr<session>> ss;
    for (int i = 0; i < 3; ++i) ss.push_back(e.new_session());
    std::vector<std::pair<size_t, const step_item *>> order;  // (index in script order, item)
    size_t idx = 0;
    for (const step &st : steps)
        for (const auto &it : st.items) order.push_back({idx++, &it});
    if (alone)
        std::stable_sort(order.begin(), order.end(),
                         [](auto &a, auto &b) { return a.second->sess < b.second->sess; });
    step_results tmp;
    std::vector<size_t> where(order.size());
    for (size_t k = 0; k < order.size(); ++k) {
        ss[order[k].second->sess]->sync(order[k].second->prefix);
        record(tmp, *ss[order[k].second->sess], *order[k].second);
        where[order[k].first] = k;
    }
    step_results r;
    for (size_t i = 0; i < order.size(); ++i) {
        r.logits.push_back(tmp.logits[where[i]]);
        r.n_past.push_back(tmp.n_past[where[i]]);
    }
    return r;
}

void expect_same(const step_results &want, const step_results &got, const std::string &what) {
    ASSERT_EQ(want.logits.size(), got.logits.size()) << what;
    EXPECT_EQ(want.n_past, got.n_past) << what;
    for (size_t i = 0; i < want.logits.size(); ++i)
        EXPECT_TRUE(same_bits(want.logits[i], got.logits[i])) << what << ": item " << i << " (script order)";
}

// (devices, micro-batch, ranks 1.. as processes)
class dist_inflight_engine : public ::testing::TestWithParam<std::tuple<std::string, int64_t, bool>> {};

// Batched steps on the split engine == each session alone on one device == one by one on the split engine.
// With rank processes the batch is one hold of the shared link (rank_procs::with_sessions): the children
// step the sessions in the order rank 0 begun them, and every answer reaches its own session.
TEST_P(dist_inflight_engine, batched_steps_equal_sessions_alone) {
    const auto &[devices, mb, procs] = GetParam();
    const int V = load("", 0)->info().n_vocab;
    const auto steps = script(V);
    const step_results alone = run_one_by_one(*load("", 0), steps, true);
    size_t wanted = 0;
    for (const auto &l : alone.logits) {
        if (l.empty()) continue;
        ++wanted;
        ASSERT_EQ(l.size(), static_cast<size_t>(V));
        for (float v : l) ASSERT_TRUE(std::isfinite(v));
    }
    EXPECT_GE(wanted, 30u);
    const std::string what = devices + ", micro-batch " + std::to_string(mb) + (procs ? ", processes" : "");
    expect_same(alone, run_one_by_one(*load(devices, mb, 1024, procs), steps, false), what + ", one by one");
    expect_same(alone, run_batched(*load(devices, mb, 1024, procs), steps), what + ", batched");
}

INSTANTIATE_TEST_SUITE_P(dist, dist_inflight_engine,
                         ::testing::Values(std::make_tuple("cpu,cpu", 0, false), std::make_tuple("cpu,cpu,cpu", 0, false),
                                           std::make_tuple("cpu,cpu", 3, false), std::make_tuple("cpu,cpu,cpu", 5, false),
                                           std::make_tuple("cpu", 0, false), std::make_tuple("cpu,cpu", 0, true),
                                           std::make_tuple("cpu,cpu,cpu", 5, true)));

// An item the engine must refuse (a token outside the vocabulary; a prompt past n_ctx) fails with its
// one-line error while the step's other items complete (the in-flight appends run before the refused
// item's sync reports it); the refused session keeps what it held; repeating the step with the good
// items is a no-op for them; all sessions go on to give the one-device logits.
class dist_inflight_refusal : public ::testing::TestWithParam<bool> {};  // ranks 1.. as processes

TEST_P(dist_inflight_refusal, refused_item_fails_alone) {
    auto split = load("cpu,cpu", 0, 64, GetParam());
    auto one = load("", 0, 64);
    const int V = split->info().n_vocab;
    const auto t0 = dist_test::stream(64, V, 21), t1 = dist_test::stream(64, V, 22),
               t2 = dist_test::stream(70, V, 23);
    std::vector<std::unique_ptr<session>> ss, rs;  // split sessions, one-device reference sessions
    for (int i = 0; i < 3; ++i) {
        ss.push_back(split->new_session());
        rs.push_back(one->new_session());
    }
    const auto check = [&](size_t i, const std::vector<int32_t> &prefix, const std::string &what) {
        rs[i]->sync(prefix);
        EXPECT_EQ(ss[i]->tokens(), prefix) << what;
        const auto a = ss[i]->logits(), b = rs[i]->logits();
        EXPECT_TRUE(same_bits({a.begin(), a.end()}, {b.begin(), b.end()})) << what << ", session " << i;
    };
    // (sync_item holds a span: every prefix is a named vector that outlives its step.)
    const std::vector<int32_t> p0 = head(t0, 8), p1 = head(t1, 12), p2 = head(t2, 5);
    std::vector<sync_item> items = {{ss[0].get(), p0}, {ss[1].get(), p1}, {ss[2].get(), p2}};
    split->sync_step(items);
    check(0, p0, "first step");
    check(1, p1, "first step");
    check(2, p2, "first step");

    const std::vector<int32_t> q0 = head(t0, 9), q1 = cat(p1, {5, V, 7}), q2 = head(t2, 14);
    items = {{ss[0].get(), q0}, {ss[1].get(), q1}, {ss[2].get(), q2}};
    const std::string e = error_of([&] { split->sync_step(items); });
    EXPECT_NE(e.find("token id " + std::to_string(V) + " outside the vocabulary"), std::string::npos) << e;
    EXPECT_EQ(ss[0]->n_past(), 9);  // the in-flight appends completed before the refusal
    EXPECT_EQ(ss[2]->n_past(), 14);
    EXPECT_EQ(ss[1]->tokens(), p1);  // the refused session keeps what it held (and its logits)
    check(1, p1, "after the refusal");
    split->sync_step(std::vector<sync_item>{items[0], items[2]});  // repeat: no-op for them
    check(0, q0, "after the repeat");
    check(2, q2, "after the repeat");

    const std::vector<int32_t> r0 = head(t0, 10), too_long = head(t2, 65);  // past n_ctx 64: sync's error
    items = {{ss[0].get(), r0}, {ss[2].get(), too_long}};
    const std::string e2 = error_of([&] { split->sync_step(items); });
    EXPECT_NE(e2.find("exceeds n_ctx 64"), std::string::npos) << e2;
    check(0, r0, "after the n_ctx refusal");
    EXPECT_EQ(ss[2]->tokens(), q2);
    // Everyone goes on: a decode, a chunk, and the refused session's valid append.
    const std::vector<int32_t> s0 = head(t0, 11), s1 = head(t1, 20), s2 = head(t2, 15);
    items = {{ss[1].get(), s1}, {ss[0].get(), s0}, {ss[2].get(), s2}};
    split->sync_step(items);
    check(0, s0, "last step");
    check(1, s1, "last step");
    check(2, s2, "last step");
    // Items that are not this engine's, repeated, or missing are refused before anything runs.
    auto foreign = one->new_session();
    EXPECT_NE(error_of([&] {
                  split->sync_step(std::vector<sync_item>{{foreign.get(), s0}});
              }).find("not created by this engine"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  split->sync_step(std::vector<sync_item>{{ss[0].get(), s0}, {ss[0].get(), s0}});
              }).find("appears twice"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                  split->sync_step(std::vector<sync_item>{{nullptr, s0}});
              }).find("has no session"),
              std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(dist, dist_inflight_refusal, ::testing::Values(false, true));

// A rank process killed between two steps: the next step's in-flight batch (several sessions begun on the
// shared link) fails with the group's one line, the killed rank's exit status -- not a socket's view of it
// ("peer rank 1 ... exited"), which a session's cleanup inside the batch (free_session) used to make the
// group's line -- and every later step fails with the same line.
TEST(dist_inflight_procs, killed_rank_fails_the_batch_with_its_status) {
    auto split = load("cpu,cpu,cpu", 0, 1024, true);
    const int V = split->info().n_vocab;
    const std::string dev = split->info().device;
    const size_t at = dev.find("rank 1 pid ");
    ASSERT_NE(at, std::string::npos) << dev;
    const long pid1 = std::stol(dev.substr(at + 11));
    std::vector<std::unique_ptr<session>> ss;
    std::vector<session *> sp;
    for (int i = 0; i < 3; ++i) {
        ss.push_back(split->new_session());
        sp.push_back(ss.back().get());
    }
    const std::vector<int32_t> p0 = dist_test::stream(8, V, 31), p1 = dist_test::stream(9, V, 32),
                               p2 = dist_test::stream(10, V, 33);
    split->sync_step(std::vector<sync_item>{{sp[0], p0}, {sp[1], p1}, {sp[2], p2}});
    const std::vector<int32_t> toks = {1, 2, 3};
    split->decode_step(sp, toks);
    ASSERT_EQ(::kill(static_cast<pid_t>(pid1), SIGKILL), 0);
    const std::string want = "dist: rank 1 (pid " + std::to_string(pid1) + ") exited: killed by signal 9 (Killed)";
    EXPECT_EQ(error_of([&] { split->decode_step(sp, toks); }), want);
    EXPECT_EQ(error_of([&] { split->decode_step(sp, toks); }), want);
    EXPECT_EQ(error_of([&] { ss[0]->eval(toks); }), want);
}

}  // namespace
