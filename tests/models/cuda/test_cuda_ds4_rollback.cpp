// Rollback of the CUDA DS4 sequence (ds4::cuda_sequence::truncate), its multi-row step (eval_rows: up to
// 16 rows of one sequence in one forward, dense weights read once) and speculation on one GPU, against
// plain decoding on the same device (one decode step per token, a fresh sequence that never evaluated a
// rejected row), bit for bit (batch invariance and exact rollback):
//  - the quantised synthetic model with the ds4-tiny layout (ratios 0, 0, 4, 128, 4, 128; a 32-row raw
//    window) over 300 positions: random verification-like steps (accepted rows, then rejected ones, up
//    to ds4::max_rollback rows in all) rolled back to the last accepted row; the accepted rows' logits
//    and every later one must equal plain decoding's (memcmp). Steps are forced across raw-ring wraps,
//    ratio-4 block ends and both ratio-128 block ends (positions 127 and 255), where a rejected row
//    overwrote a ring row and emitted a compressed row the rolled-back state must not see;
//  - after a chunked prefill (ring filled by ring_store_tail, frontiers by the chunk state kernel):
//    rejected rows rolled back, then decoding equals the never-rolled-back sequence's;
//  - the floor: truncating below max_rollback behind the furthest position or past n_past throws and
//    changes nothing;
//  - through the engine API on one GPU: ds4-tiny with drafts from the plain output (some wrong) and the
//    n-gram drafter gives plain decoding's tokens, greedy and sampled.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "models/cuda/deepseek4_cuda.h"
#include "core/error.h"
#include "backend/cuda/cuda_test_util.h"
#include "models/ds4/dspark_golden.h"
#include "models/ds4/golden_util.h"
#include "ds4_host_util.h"
#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "fathom/speculative.h"
#include "models/deepseek4.h"

namespace fathom {
namespace {

using cuda_test::tokens_of;
using CudaDs4Rollback = cuda_test::cuda_device_test;

const std::string &model_path() {
    static const std::string path = cuda_test::write_quant_tiny_model("fathom_cuda_ds4_rollback_q2.gguf");
    return path;
}

using cuda_test::decode_each;

bool same_bits(const float *a, const float *b, size_t n) {
    return std::memcmp(a, b, n * sizeof(float)) == 0;
}

TEST_F(CudaDs4Rollback, RolledBackStepsEqualPlainDecodingBitForBit) {
    auto m = ds4::load_model(model_path());
    const size_t N = 300, V = static_cast<size_t>(m->hp.n_vocab);
    ASSERT_EQ(m->hp.window, 32);
    const auto toks = tokens_of(N, m->hp.n_vocab, 7);
    struct mode {
        ds4::qat_mode qat;
        kv_precision kv;
        bool graph;  // the multi-row steps replayed from graphs, or launched eagerly
    };
    for (const mode md : {mode{ds4::qat_mode::full, kv_precision::f16, true}, mode{ds4::qat_mode::off, kv_precision::f32, true},
                          mode{ds4::qat_mode::full, kv_precision::f16, false}}) {
        SCOPED_TRACE(std::string(md.kv == kv_precision::f16 ? "qat full, f16 KV" : "qat off, f32 KV") +
                     (md.graph ? ", graphs" : ", eager"));
        ds4::cuda_run_options o;
        o.qat = md.qat;
        o.kv = md.kv;
        const auto w = ds4::cuda_upload(*m, o);
        ds4::cuda_sequence ref_seq(w, static_cast<int64_t>(N) + 16, true, 0);
        const auto ref = decode_each(ref_seq, toks, V);
        ds4::cuda_sequence seq(w, static_cast<int64_t>(N) + 16, md.graph, 0);
        std::mt19937 rng(11);
        // Steps forced to start just before these positions (block ends 127 and 255 of the ratio-128
        // layers, ring wraps at multiples of 32) with a full 16-row rejected tail.
        const std::vector<size_t> forced = {20, 60, 120, 125, 250, 254};
        size_t n = 0, steps = 0, rolled = 0;
        while (n < N) {
            size_t acc = 1 + rng() % 4, rej = rng() % 13;
            for (size_t f : forced)
                if (n <= f && f < n + 4) acc = f - n + 1, rej = ds4::max_rollback - acc;
            acc = std::min(acc, N - n);
            rej = std::min<size_t>(rej, ds4::max_rollback - acc);
            std::vector<int32_t> rows(toks.begin() + static_cast<std::ptrdiff_t>(n),
                                      toks.begin() + static_cast<std::ptrdiff_t>(n + acc));
            for (size_t j = 0; j < rej; ++j) rows.push_back(static_cast<int32_t>((toks[(n + 37 * j) % N] + 1 + j) % V));
            std::vector<float> lg(rows.size() * V, std::nanf(""));
            seq.eval_rows(rows, lg);
            if (rows.size() > 1) {  // the multi-row step keeps the last row's logits as the sequence's
                std::vector<float> last(V);
                seq.last_logits(last);
                ASSERT_TRUE(same_bits(last.data(), &lg[(rows.size() - 1) * V], V));
            }
            ASSERT_EQ(seq.n_past(), static_cast<int64_t>(n + rows.size()));
            for (size_t j = 0; j < acc; ++j)
                ASSERT_TRUE(same_bits(&lg[j * V], &ref[(n + j) * V], V))
                    << "position " << n + j << " (row " << j << " of a step from " << n << ", " << rej << " rejected)";
            seq.truncate(static_cast<int64_t>(n + acc));
            ASSERT_EQ(seq.n_past(), static_cast<int64_t>(n + acc));
            n += acc;
            ++steps;
            rolled += rej;
        }
        EXPECT_GT(rolled, 300u) << "the schedule rolled back too little to test anything";
        std::printf("  %zu steps, %zu rejected rows rolled back\n", steps, rolled);
    }
}

TEST_F(CudaDs4Rollback, RollbackAfterChunkedPrefillAndTheFloor) {
    auto m = ds4::load_model(model_path());
    const size_t P = 150, D = 40, V = static_cast<size_t>(m->hp.n_vocab);
    const auto toks = tokens_of(P + D, m->hp.n_vocab, 21);
    const auto w = ds4::cuda_upload(*m, {});
    ds4::cuda_sequence ref(w, 256, true, 37), seq(w, 256, true, 37);
    const std::span<const int32_t> prompt(toks.data(), P), tail(toks.data() + P, D);
    ref.eval(prompt, {});
    seq.eval(prompt, {});
    const auto want = decode_each(ref, tail, V);
    // 16 rejected rows right after the chunk (the ring's rows of positions 118..149 and the frontiers came
    // from the chunk kernels), rolled back; the floor is then 150.
    std::vector<int32_t> junk(ds4::max_rollback);
    for (size_t j = 0; j < junk.size(); ++j) junk[j] = static_cast<int32_t>((7 * j + 3) % V);
    seq.eval_rows(junk, {});
    EXPECT_EQ(seq.rollback_floor(), static_cast<int64_t>(P));
    EXPECT_THROW(seq.truncate(static_cast<int64_t>(P) - 1), error);           // below the floor
    EXPECT_THROW(seq.truncate(static_cast<int64_t>(P + junk.size()) + 1), error);  // past n_past
    EXPECT_EQ(seq.n_past(), static_cast<int64_t>(P + junk.size()));            // unchanged by the refusals
    seq.truncate(static_cast<int64_t>(P));
    const auto got = decode_each(seq, tail, V);
    for (size_t i = 0; i < D; ++i)
        ASSERT_TRUE(same_bits(&got[i * V], &want[i * V], V)) << "decode step " << i << " after the rollback";
    // a rollback inside the chunk: at most max_rollback behind the furthest position, and n_past follows
    ds4::cuda_sequence c(w, 256, true, 37);
    c.eval(prompt, {});
    EXPECT_EQ(c.rollback_floor(), static_cast<int64_t>(P) - ds4::max_rollback);
    c.truncate(static_cast<int64_t>(P) - 5);
    EXPECT_EQ(c.n_past(), static_cast<int64_t>(P) - 5);
    std::vector<float> lg(V);
    EXPECT_THROW(c.last_logits(lg), error);  // the last logits went with the rolled-back rows
    c.reset();
    EXPECT_EQ(c.rollback_floor(), 0);
}

// Several sequences in one multi-row step (cuda_sequence::step_batch: batched decode, and verifications
// side by side with their rollbacks): every row bit-identical to its sequence's twin decoding alone; each
// sequence's last logits are its own last row's; bad batches are refused with nothing evaluated.
TEST_F(CudaDs4Rollback, BatchedSequencesEqualEachAlone) {
    auto m = ds4::load_model(model_path());
    const size_t V = static_cast<size_t>(m->hp.n_vocab);
    const auto w = ds4::cuda_upload(*m, {});
    const std::vector<size_t> prompt_len = {40, 77, 130, 255};
    const size_t S = prompt_len.size(), steps = 24;
    std::vector<std::unique_ptr<ds4::cuda_sequence>> seq, twin;
    std::vector<std::vector<int32_t>> toks;
    for (size_t i = 0; i < S; ++i) {
        toks.push_back(tokens_of(prompt_len[i] + 4 * steps, m->hp.n_vocab, 100 + static_cast<uint32_t>(i)));
        seq.push_back(std::make_unique<ds4::cuda_sequence>(w, 400, true, 0));
        twin.push_back(std::make_unique<ds4::cuda_sequence>(w, 400, true, 0));
        const std::span<const int32_t> prompt(toks[i].data(), prompt_len[i]);
        decode_each(*seq[i], prompt, V);
        decode_each(*twin[i], prompt, V);
    }
    std::vector<ds4::cuda_sequence *> ptrs;
    for (auto &q : seq) ptrs.push_back(q.get());
    std::vector<size_t> at(prompt_len);
    for (size_t k = 0; k < steps; ++k) {
        // odd steps: verification-like (1..3 rows each, the last one rejected and rolled back); even: one row each
        std::vector<int> counts(S, 1);
        if (k % 2) counts = {3, 1, 2, 3};
        std::vector<int32_t> rows;
        for (size_t i = 0; i < S; ++i)
            for (int j = 0; j < counts[i]; ++j) rows.push_back(toks[i][at[i] + static_cast<size_t>(j)]);
        std::vector<float> lg(rows.size() * V, std::nanf(""));
        ds4::cuda_sequence::step_batch(ptrs, counts, rows, lg);
        size_t r = 0;
        for (size_t i = 0; i < S; ++i) {
            const auto want = decode_each(*twin[i], std::span(toks[i]).subspan(at[i], static_cast<size_t>(counts[i])), V);
            for (int j = 0; j < counts[i]; ++j, ++r)
                ASSERT_TRUE(same_bits(&lg[r * V], &want[static_cast<size_t>(j) * V], V))
                    << "step " << k << " sequence " << i << " row " << j;
            std::vector<float> last(V);
            seq[i]->last_logits(last);
            ASSERT_TRUE(same_bits(last.data(), &lg[(r - 1) * V], V)) << "sequence " << i << "'s last logits";
            const size_t keep = counts[i] > 1 ? static_cast<size_t>(counts[i] - 1) : 1;
            if (counts[i] > 1) {
                seq[i]->truncate(static_cast<int64_t>(at[i] + keep));
                twin[i]->truncate(static_cast<int64_t>(at[i] + keep));
            }
            at[i] += keep;
            ASSERT_EQ(seq[i]->n_past(), static_cast<int64_t>(at[i]));
        }
    }
    // refused, nothing evaluated
    const std::vector<int64_t> before = {seq[0]->n_past(), seq[1]->n_past()};
    std::vector<ds4::cuda_sequence *> twice = {seq[0].get(), seq[0].get()};
    EXPECT_THROW(ds4::cuda_sequence::step_batch(twice, std::vector<int>{1, 1}, std::vector<int32_t>{1, 2}, {}), error);
    std::vector<ds4::cuda_sequence *> two = {seq[0].get(), seq[1].get()};
    EXPECT_THROW(ds4::cuda_sequence::step_batch(two, std::vector<int>{9, 8}, std::vector<int32_t>(17, 1), {}), error);
    EXPECT_THROW(ds4::cuda_sequence::step_batch(two, std::vector<int>{1, 1}, std::vector<int32_t>{1, m->hp.n_vocab}, {}), error);
    EXPECT_THROW(ds4::cuda_sequence::step_batch(two, std::vector<int>{1, 0}, std::vector<int32_t>{1}, {}), error);
    EXPECT_EQ(seq[0]->n_past(), before[0]);
    EXPECT_EQ(seq[1]->n_past(), before[1]);
}

// ---- through the engine on one GPU -------------------------------------------------------------------

struct outcome {
    std::vector<int32_t> tokens, held;
    spec::spec_stats st;
};

outcome plain(engine &e, const std::vector<int32_t> &prompt, const sampling_params &p, int max_tokens) {
    auto s = e.new_session();
    s->sync(prompt);
    sampler smp(p);
    outcome o;
    while (static_cast<int>(o.tokens.size()) < max_tokens) {
        const int32_t t = s->sample(smp, s->tokens()).token;
        if (e.is_end_of_generation(t)) break;
        o.tokens.push_back(t);
        if (static_cast<int>(o.tokens.size()) >= max_tokens) break;
        s->eval(std::span<const int32_t>(&t, 1));
    }
    o.held = s->tokens();
    return o;
}

// d: the drafter; null: n-grams; own_draft_max > 0: the session's own drafter (session::draft), that wide.
outcome speculative(engine &e, const std::vector<int32_t> &prompt, const sampling_params &p, int max_tokens,
                    const spec::drafter *d, int own_draft_max = 0) {
    auto s = e.new_session();
    s->sync(prompt);
    session &sr = *s;
    const spec::drafter own = [&sr](std::span<const int32_t> h, int32_t max) { return sr.draft(h, max); };
    if (own_draft_max > 0) d = &own;
    EXPECT_TRUE(s->rolls_back());
    sampler smp(p);
    outcome o;
    auto on_token = [&](int32_t t) {
        if (e.is_end_of_generation(t)) return spec::token_verdict::stop;
        o.tokens.push_back(t);
        return static_cast<int>(o.tokens.size()) >= max_tokens ? spec::token_verdict::keep_and_stop : spec::token_verdict::keep;
    };
    if (d) {
        spec::width_options w;
        w.draft_max = own_draft_max > 0 ? own_draft_max : 16;
        w.adaptive = false;
        o.st = spec::generate(*s, smp, e.info().n_ctx, w, *d, on_token);
    } else {
        spec::ngram_options so;
        so.ngram_min = 1;
        so.adaptive = false;
        o.st = spec::generate_ngram(*s, smp, e.info().n_ctx, so, on_token);
    }
    o.held = s->tokens();
    return o;
}

// ds4-tiny on one GPU, a 512-token context.
std::unique_ptr<engine> tiny_cuda_engine() {
    engine_options eo;
    eo.model_path = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
    eo.n_ctx = 512;
    eo.device = "cuda";
    return engine::load(eo);
}

// The scheduler's steps on one GPU (engine::decode_step / sync_step): the decodes of several sessions
// and verification rows (after a free rollback) run as rows of one multi-row step; every session's logits
// equal, bit for bit, a twin session's decoding alone one token at a time.
TEST_F(CudaDs4Rollback, EngineStepsBatchSessionsLikeEachAlone) {
    auto e = tiny_cuda_engine();
    const int V = static_cast<int>(e->info().n_vocab);
    const size_t S = 5;
    std::vector<std::unique_ptr<session>> a, b;
    for (size_t i = 0; i < S; ++i) {
        const auto prompt = tokens_of(20 + 31 * i, V, 300 + static_cast<uint32_t>(i));
        a.push_back(e->new_session());
        b.push_back(e->new_session());
        a.back()->sync(prompt);
        b.back()->sync(prompt);
    }
    auto argmax = [](std::span<const float> l) {
        return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    };
    for (int step = 0; step < 12; ++step) {
        std::vector<session *> ss;
        std::vector<int32_t> next;
        for (size_t i = 0; i < S; ++i) {
            ss.push_back(a[i].get());
            next.push_back(argmax(a[i]->logits()));
        }
        if (step % 3 != 2) {
            e->decode_step(ss, next);
        } else {  // verifications: the pending token + 2 drafts (the second one wrong), then the rollback
            std::vector<std::vector<int32_t>> prefix(S);
            std::vector<std::vector<float>> rows(S, std::vector<float>(3 * static_cast<size_t>(V)));
            std::vector<sync_item> items(S);
            for (size_t i = 0; i < S; ++i) {
                prefix[i] = a[i]->tokens();
                prefix[i].insert(prefix[i].end(), {next[i], (next[i] + 7) % V, (next[i] + 11) % V});
                items[i] = {a[i].get(), prefix[i], true, 3, rows[i].data(), i % 2 == 1};  // odd: rows kept on the device
            }
            e->sync_step(items);
            for (size_t i = 0; i < S; ++i) {
                const auto want_rows = [&] {
                    std::vector<float> all(3 * static_cast<size_t>(V));
                    for (int k = 0; k < 3; ++k) {
                        b[i]->eval(std::span<const int32_t>(&prefix[i][prefix[i].size() - 3 + static_cast<size_t>(k)], 1));
                        const auto l = b[i]->logits();
                        std::copy(l.begin(), l.end(), all.begin() + k * V);
                    }
                    return all;
                }();
                if (i % 2 == 0) {
                    ASSERT_EQ(std::memcmp(rows[i].data(), want_rows.data(), want_rows.size() * 4), 0) << "session " << i;
                } else {  // held on the device: each row's greedy sample is its argmax
                    ASSERT_EQ(a[i]->verify_rows_held(), 3u) << "session " << i;
                    sampling_params gp;
                    gp.temperature = 0.0f;
                    sampler g(gp);
                    for (size_t k = 0; k < 3; ++k)
                        EXPECT_EQ(a[i]->sample_row(k, g, prefix[i]).token,
                                  argmax(std::span<const float>(want_rows).subspan(k * static_cast<size_t>(V), static_cast<size_t>(V))))
                            << "session " << i << " row " << k;
                }
                a[i]->truncate(a[i]->n_past() - 2);  // keep the pending token only
                b[i]->truncate(b[i]->n_past() - 2);
                b[i]->sync(b[i]->tokens());  // its logits again (plain decoding would have them)
                a[i]->sync(a[i]->tokens());
            }
            continue;
        }
        for (size_t i = 0; i < S; ++i) {
            b[i]->eval(std::span<const int32_t>(&next[i], 1));
            const auto x = a[i]->logits(), y = b[i]->logits();
            ASSERT_EQ(a[i]->tokens(), b[i]->tokens());
            ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0) << "step " << step << " session " << i;
        }
    }
}

// The engine's state pool in the scheduler's terms (kv_pool / kv_blocks): the sessions' mapped positions
// in blocks of block_tokens, each session's rounded up, whatever the 2 MiB blocks behind its rows (a tiny
// model's rows of 70 tokens take 3 of those: counted in them, used exceeded total in /metrics).
TEST_F(CudaDs4Rollback, EnginePoolCountsMappedPositionsInTheSchedulersBlocks) {
    auto e = tiny_cuda_engine();
    const int V = static_cast<int>(e->info().n_vocab);
    ASSERT_TRUE(e->kv_pool_configure(16, 64));
    EXPECT_EQ(e->kv_pool().block_tokens, 16);
    EXPECT_GE(e->kv_pool().max_blocks, 64);
    EXPECT_EQ(e->kv_pool().n_used, 0);
    {
        auto s = e->new_session();
        s->sync(tokens_of(70, V, 41));
        EXPECT_EQ(s->kv_blocks(), 5);  // ceil(70 / 16)
        EXPECT_EQ(e->kv_pool().n_used, 5);
        EXPECT_TRUE(s->kv_reserve(100));
        EXPECT_EQ(s->kv_blocks(), 7);
        EXPECT_EQ(e->kv_pool().n_used, 7);
        EXPECT_TRUE(s->kv_reserve(0));  // back to what it holds
        EXPECT_EQ(s->kv_blocks(), 5);
        auto t = e->new_session();
        t->sync(tokens_of(33, V, 42));
        EXPECT_EQ(t->kv_blocks(), 3);
        EXPECT_EQ(e->kv_pool().n_used, 8);
        t->reset();
        EXPECT_EQ(t->kv_blocks(), 0);
        EXPECT_EQ(e->kv_pool().n_used, 5);
    }
    EXPECT_EQ(e->kv_pool().n_used, 0);  // destroyed sessions give their blocks back
}

// The first 100 tokens of the first golden case that long; greedy and sampled (temperature 0.8) sampling.
std::vector<int32_t> golden_prompt() {
    for (const auto &c : ds4_test::load_cases("cases.jsonl"))
        if (c.tokens.size() >= 100) return {c.tokens.begin(), c.tokens.begin() + 100};
    return {};
}
sampling_params greedy_params() {
    sampling_params p;
    p.temperature = 0.0f;
    return p;
}
sampling_params sampled_params() {
    sampling_params p;
    p.temperature = 0.8f;
    return p;
}

TEST_F(CudaDs4Rollback, SpeculationOnOneGpuGivesPlainDecodingsTokens) {
    auto e = tiny_cuda_engine();
    const int V = static_cast<int>(e->info().n_vocab);
    const std::vector<int32_t> prompt = golden_prompt();
    ASSERT_EQ(prompt.size(), 100u);
    sampling_params greedy = greedy_params(), sampled = sampled_params();
    sampled.seed = 3;
    for (const sampling_params &p : {greedy, sampled}) {
        const std::string what = p.temperature == 0 ? "greedy" : "sampled";
        const outcome ref = plain(*e, prompt, p, 60);
        ASSERT_GT(ref.tokens.size(), 40u) << what;
        for (int wrong : {0, 3}) {  // drafts from the plain output, every 3rd one wrong
            int count = 0;
            const spec::drafter d = [&](std::span<const int32_t> h, int32_t max) {
                std::vector<int32_t> out;
                for (size_t i = h.size() - prompt.size(); i < ref.tokens.size() && static_cast<int32_t>(out.size()) < max; ++i)
                    out.push_back(wrong > 0 && ++count % wrong == 0 ? (ref.tokens[i] + 1) % V : ref.tokens[i]);
                return out;
            };
            const outcome got = speculative(*e, prompt, p, 60, &d);
            EXPECT_EQ(got.tokens, ref.tokens) << what << ", wrong every " << wrong;
            EXPECT_EQ(got.held, ref.held) << what << ", wrong every " << wrong;
            EXPECT_GT(got.st.accepted, 0) << what;
        }
        const outcome ng = speculative(*e, prompt, p, 60, nullptr);
        EXPECT_EQ(ng.tokens, ref.tokens) << what << ", n-gram";
    }
}

// A verification on one GPU leaves its rows on the device (session::eval_verify returns false) and
// sample_row(j) gives, for each row, exactly what the host sampler gives on that row's logits evaluated by
// a twin session into host rows (eval with every row's logits): greedy, and sampled with penalties and the
// same seed (the same RNG draws). Rows past the verification, and rows after a truncate, are refused.
TEST_F(CudaDs4Rollback, VerificationRowsAreSampledOnTheDevice) {
    auto e = tiny_cuda_engine();
    const size_t V = static_cast<size_t>(e->info().n_vocab);
    const std::vector<int32_t> prompt = golden_prompt();
    ASSERT_EQ(prompt.size(), 100u);
    sampling_params pen = sampled_params();
    pen.seed = 9;
    pen.repeat_penalty = 1.3f;
    pen.frequency_penalty = 0.2f;
    pen.presence_penalty = 0.1f;
    pen.top_k = 0;  // the summary may not decide: then the row is downloaded (the fallback)
    sampling_params topk = pen;
    topk.top_k = 20;
    for (const sampling_params &p : {greedy_params(), pen, topk}) {
        auto a = e->new_session(), b = e->new_session();
        a->sync(prompt);
        b->sync(prompt);
        const std::vector<int32_t> batch = {prompt[3], prompt[9], prompt[27], prompt[4], prompt[77]};
        std::vector<float> host(batch.size() * V), unused(batch.size() * V);
        ASSERT_FALSE(a->eval_verify(batch, unused.data()));
        b->eval(batch, host.data());
        sampler sa(p), sb(p);
        std::vector<int32_t> hist = prompt;
        for (size_t j = 0; j < batch.size(); ++j) {
            hist.push_back(batch[j]);
            const sample_result x = a->sample_row(j, sa, hist);
            const sample_result y = sb.sample(std::span<const float>(host).subspan(j * V, V), hist);
            EXPECT_EQ(x.token, y.token) << "row " << j << ", temperature " << p.temperature << ", top_k " << p.top_k;
            EXPECT_NEAR(x.logprob, y.logprob, 1e-4) << "row " << j;
        }
        EXPECT_THROW(a->sample_row(batch.size(), sa, hist), error);
        a->truncate(a->n_past() - 2);
        EXPECT_THROW(a->sample_row(0, sa, hist), error);
    }
    // Wider than one step of rows (the device's 16) or than the rollback reach: the host rows, as eval.
    auto c = e->new_session();
    c->sync(prompt);
    std::vector<float> all(17 * V);
    EXPECT_TRUE(c->eval_verify(std::vector<int32_t>(17, prompt[5]), all.data()));
}

// The MTP head on one GPU as the session's drafter (engine_options::ds4_draft = "mtp", --device cuda):
//  - its first draft is the golden MTP top-1 (../shared/golden/ds4-tiny/mtp_cases.jsonl) after a prefill and
//    speculation-like steps (a true token plus right and wrong drafts, the wrong ones rolled back), wherever
//    the golden's top-2 gap exceeds its tolerance; n_batch 1, so every row takes the decode step's numerics;
//  - speculation with it gives plain decoding's tokens, greedy and sampled, and keeps some drafts.
// ds4-tiny on one GPU with its own drafter (ds4_draft "mtp" or "dspark", from draft_model).
std::unique_ptr<engine> drafting_engine(const std::string &draft, const std::string &draft_model, ds4::qat_mode qat,
                                        int64_t n_batch) {
    engine_options eo;
    eo.model_path = ds4_test::golden_dir() + "/ds4-tiny-a.gguf";
    eo.n_ctx = 1024;  // the longest golden case and its drafts
    eo.n_batch = n_batch;
    eo.device = "cuda";
    eo.kv = kv_precision::f32;
    eo.ds4_qat = qat == ds4::qat_mode::full ? "full" : qat == ds4::qat_mode::fp4only ? "fp4only" : "off";
    eo.ds4_draft = draft;
    eo.ds4_draft_model = draft_model;
    return engine::load(eo);
}
std::unique_ptr<engine> mtp_engine(ds4::qat_mode qat, int64_t n_batch = 0) {
    return drafting_engine("mtp", ds4_test::golden_dir() + "/ds4-tiny-a-mtp.gguf", qat, n_batch);
}

// Brings the session (holding a prefix of `tokens`) to n tokens as speculation does: the true token, some
// right drafts and some wrong ones, the wrong ones rolled back.
void advance_with_rollbacks(session &s, const std::vector<int32_t> &tokens, size_t n, std::mt19937 &rng) {
    while (s.tokens().size() < n) {
        const size_t p = s.tokens().size(), left = n - p;
        const size_t right = std::min<size_t>(rng() % 4, left - 1), wrong = rng() % 4;
        std::vector<int32_t> batch(tokens.begin() + static_cast<std::ptrdiff_t>(p),
                                   tokens.begin() + static_cast<std::ptrdiff_t>(p + 1 + right));
        for (size_t j = 0; j < wrong; ++j) batch.push_back(static_cast<int32_t>((tokens[p] + 7 + j) % 512));
        s.eval(batch);
        s.truncate(static_cast<int64_t>(p + 1 + right));
    }
}

// Speculation with the sessions' own drafts (width 4) gives plain decoding's tokens, greedy and sampled
// (sampler seed `seed`), and drafts something.
void expect_own_drafts_give_plain_decoding(engine &e, uint64_t seed) {
    const std::vector<int32_t> prompt = golden_prompt();
    ASSERT_EQ(prompt.size(), 100u);
    sampling_params greedy = greedy_params(), sampled = sampled_params();
    sampled.seed = seed;
    for (const sampling_params &p : {greedy, sampled}) {
        const std::string what = p.temperature == 0 ? "greedy" : "sampled";
        const outcome ref = plain(e, prompt, p, 80);
        const outcome got = speculative(e, prompt, p, 80, nullptr, 4);
        EXPECT_EQ(got.tokens, ref.tokens) << what;
        EXPECT_EQ(got.held, ref.held) << what;
        EXPECT_GT(got.st.drafted, 0) << what;
        std::printf("  %s: %lld drafted, %lld kept\n", what.c_str(), static_cast<long long>(got.st.drafted),
                    static_cast<long long>(got.st.accepted));
    }
}

TEST_F(CudaDs4Rollback, MtpDrafterOnOneGpuDraftsTheGoldenTop1) {
    int checked = 0;
    for (const auto &c : ds4_test::load_cases("mtp_cases.jsonl")) {
        if (c.tol["tier"] != "strict" || c.tokens.size() < 60) continue;  // long no_qat cases
        auto e = mtp_engine(c.qat, 1);
        auto s = e->new_session();
        ASSERT_TRUE(s->has_drafter());
        std::mt19937 rng(3);
        const double gap_min = c.tol["top1_must_match_if_gap_gt"];
        s->sync(std::span<const int32_t>(c.tokens).first(7));
        for (size_t n = 7; n <= c.tokens.size(); n = std::min(c.tokens.size() + 1, n + 1 + rng() % 5)) {
            advance_with_rollbacks(*s, c.tokens, n, rng);
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

TEST_F(CudaDs4Rollback, MtpSpeculationOnOneGpuGivesPlainDecodingsTokens) {
    auto e = mtp_engine(ds4::qat_mode::full);
    expect_own_drafts_give_plain_decoding(*e, 5);
}

// The DSpark drafter on the device (engine_options::ds4_draft "dspark"): the session's cuda_sequence captures
// the features, its ds4::cuda_dspark drafts.
std::unique_ptr<engine> dspark_engine(ds4::qat_mode qat, int64_t n_batch = 0) {
    return drafting_engine("dspark", ds4_test::dspark_dir() + "/ds4-tiny-a-dspark.gguf", qat, n_batch);
}

// Through a session that verified and rolled back rows on its way (prefill pieces, rows of several tokens,
// wrong rows dropped), the block drafted after each strict case's tokens is the golden one: every drafted
// token up to the first row whose golden top-2 gap is within the tolerance (after it the chain may follow
// the other token).
TEST_F(CudaDs4Rollback, DsparkDrafterOnOneGpuDraftsTheGoldenBlock) {
    int checked = 0;
    for (const auto &c : ds4_test::load_dspark_cases()) {
        if (!c.end_to_end) continue;
        for (int64_t n_batch : {int64_t{0}, int64_t{1}}) {  // chunked prefill, token by token
            auto e = dspark_engine(c.qat, n_batch);
            auto s = e->new_session();
            ASSERT_TRUE(s->has_drafter());
            std::mt19937 rng(5);
            const size_t n = c.tokens.size(), first = std::min<size_t>(n, 3 + n / 2);
            s->sync(std::span<const int32_t>(c.tokens).first(first));
            advance_with_rollbacks(*s, c.tokens, n, rng);
            std::vector<int32_t> h = s->tokens();
            h.push_back(c.seed);
            const std::vector<int32_t> d = s->draft(h, 5);
            ASSERT_EQ(d.size(), 5u) << c.name;
            const double gap_min = c.tol["top1_must_match_if_gap_gt"];
            for (size_t j = 0; j < d.size() && c.corrected_gap[j] > gap_min; ++j, ++checked)
                EXPECT_EQ(d[j], c.draft_tokens[j]) << c.name << " n_batch " << n_batch << " row " << j;
        }
    }
    EXPECT_GT(checked, 8);
}

TEST_F(CudaDs4Rollback, DsparkSpeculationOnOneGpuGivesPlainDecodingsTokens) {
    auto e = dspark_engine(ds4::qat_mode::full);
    expect_own_drafts_give_plain_decoding(*e, 7);
}

}  // namespace
}  // namespace fathom
