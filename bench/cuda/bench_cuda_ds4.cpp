// DS4 decode on one CUDA device at context frontiers (not a ctest; run on the device):
//   bench_cuda_ds4 MODEL.gguf [--depths 2048,8192,32768,131072] [--n 64] [--kv f16|f32] [--eager]
//                  [--prefill 2048,8192,32768] [--chunk 2048] [--serial-step]
//                  [--state-file PATH] [--gemv-trace FILE] [--ktrace FILE] [--rows 2,3,4,5]
// For each depth N the sequence is made N tokens deep with cuda_testing::fill_synthetic (seeded
// KV, compressed and indexer rows: the next step scores, selects and attends exactly the rows a real
// step at position N would), then N_gen greedy steps are timed (graph replay, device argmax, one
// 4-byte download per token). Also: an end-to-end prefill + decode from position 0 through eval()
// (logits downloaded every token), the weight bytes a step reads, and the device copy bandwidth
// measured in the same run, so every rate is also a fraction of the roofline.
// --prefill a,b,c: a real prompt from position 0 through chunked prefill (eval of each interval
// [0, a), [a, b), [b, c) as one call, last-token logits), the tok/s of every interval (an empty list
// skips it); --chunk sets the chunk size (0: token-serial). --serial-step: the decode step on one
// stream (cuda_testing::cuda_test_options::serial_step; default: the attention's parallel branches).
// --state-file PATH: after the chunked prefill, the sequence's saved state (save_state, the disk prompt
// cache's DS4 stream) written to PATH (fsync'd) and loaded into a second sequence, both timed; the
// next decode step of both must agree bit for bit.
// --gemv-trace FILE (a FATHOM_Q8X_TRACE build): the per-block timeline of every q8x GEMV launch in the
// captured decode step (ds4_gemv.h set_gemv_trace), from the last timed replay at the first depth, as
// CSV lines "launch,block,start,waited,x_ready,end,sm" (ns); scripts/device/gemv_trace.py reads it.
// --ktrace FILE (a FATHOM_KTRACE build, backend/cuda/ktrace.h): every instrumented kernel's blocks in one
// replayed step after the first depth's timed steps, as CSV lines "kernel,block,start,end,sm,grid" (ns;
// grid: the launch's %gridid, low 32 bits);
// scripts/device/ktrace.py turns them into launches and the step's timeline.
// --rows a,b,..: at each depth, the time of a verification of R rows of one sequence (eval_rows: one
// decode step per row, plain decoding's numerics) then its rollback (truncate), relative to a one-row
// step: the cost a speculative step pays per row.
// --seqs a,b,..: at each depth, S sequences (each made that deep) decoding together, one row each per
// multi-row step (cuda_sequence::step_batch, the server's batched decode): ms per step, relative to a
// one-row step, and the aggregate tok/s.
// --paged: every sequence's compressed and indexer rows in blocks of one state pool (cuda_make_state_pool,
// the engine's layout on one GPU) instead of allocated whole for its context.
// --capacity a,b,..: before anything else, for each context length, paged sequences made that deep
// (fill_synthetic) are created until the device has no room for another (the pool exhausted or a
// sequence's own allocation refused): how many fit, and the device bytes each takes; then all are freed.
// --dspark FILE: a DSpark drafter for MODEL (fathom-gguf synth --dspark), uploaded beside it: at each depth,
// the decode step's time with the drafter's feature capture on (cuda_sequence::set_feature_layers), and the
// time of one draft block (cuda_dspark::draft after `window` context rows observed), relative to a one-row
// step; then its block over the features of the real sequence at that depth is not checked (synthetic).
// --spec-accept a,b,.. (percent; 0 = drafts always wrong) [--spec-tokens 64] [--draft-max 4]: at each depth,
// speculative decoding at controlled acceptance (spec_controlled below: the target's own greedy continuation
// as drafts, each corrupted with probability 1 - a, adaptive width, rows sampled on the device, the rejected
// rows rolled back; drafts free, then with --dspark the drafter's cost paid as the engine pays it, then, when
// MODEL holds an MTP head (fathom-gguf synth --mtp; llama.cpp's nextn layout), the head's cost paid: k chained
// eval_mtp rows per drafting step and its rows over every verification): tok/s against plain decoding and
// tokens per step, and each drafter's cost in one-row steps.
// --spec-seqs a,b,.. (with --spec-accept): the same inside a batch of a, b, .. sequences (spec_batched below:
// each sequence's own adaptive width, forwards of at most 16 rows as the engine packs them): aggregate tok/s
// against plain batched decoding of as many sequences, drafts free and (an MTP head in MODEL) each head paid.
// --mma-slots S: units per block-wide meeting of the multi-row tensor-core GEMV (1..4, default 4;
// ds4_gemv_testing.h set_gemv_mma_slots): the A/B of the batched meetings in one build.
// --profile decode|rows|seqs: what the profiler's capture range holds (cudaProfilerStart/Stop; Nsight
// with --profile-from-start off, scripts/device/ncu_step.sh): the timed decode replays (default), the
// last timed step of the largest --rows, or the last timed step of the most --seqs.
#include <cuda_profiler_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_vmm.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_gemv_testing.h"
#include "backend/cuda/ktrace.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_dspark.h"
#include "models/cuda/deepseek4_cuda_testing.h"
#include "models/deepseek4_dspark.h"
#include "bench_util.h"
#include "core/error.h"
#include "engine/ds4_drafter.h"
#include "fathom/speculative.h"
#include "models/deepseek4.h"

using namespace fathom;

using bench_util::now_s;
using bench_util::parse_list;

namespace {

// A state stream to / from a file descriptor (the bench's stand-in for the prompt cache's entry file,
// which adds a header and checksums).
struct fd_writer final : state_writer {
    int fd;
    uint64_t n = 0;
    void write(const void *data, size_t k) override {
        const auto *p = static_cast<const char *>(data);
        while (k > 0) {
            const ssize_t r = ::write(fd, p, k);
            if (r <= 0) throw error("state file: write failed");
            p += r, k -= static_cast<size_t>(r), n += static_cast<uint64_t>(r);
        }
    }
};
struct fd_reader final : state_reader {
    int fd;
    uint64_t left;
    void read(void *data, size_t k) override {
        if (k > left) throw error("state file: ends early");
        auto *p = static_cast<char *>(data);
        while (k > 0) {
            const ssize_t r = ::read(fd, p, k);
            if (r <= 0) throw error("state file: read failed");
            p += r, k -= static_cast<size_t>(r), left -= static_cast<uint64_t>(r);
        }
    }
    uint64_t remaining() const override { return left; }
};

// Saves seq's state to path (fsync'd), loads it into a second sequence, and checks that the next
// greedy step of both gives the same logits: the time a prompt-cache hit costs instead of the prefill.
void state_round_trip(ds4::cuda_sequence &seq, const std::shared_ptr<const ds4::cuda_weights> &w,
                      const std::string &path, const std::vector<int32_t> &prompt, double t_prefill) {
    const size_t V = static_cast<size_t>(seq.hp().n_vocab);
    std::vector<float> lg(V);
    seq.last_logits(lg);
    double t0 = now_s();
    fd_writer fw;
    fw.fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (fw.fd < 0) throw error("cannot create " + path);
    seq.save_state(fw);
    fw.write(lg.data(), V * sizeof(float));
    ::fsync(fw.fd);
    ::close(fw.fd);
    const double t_save = now_s() - t0;
    ds4::cuda_sequence b(w, seq.n_ctx(), true, ds4::default_prefill_chunk);
    t0 = now_s();
    fd_reader fr;
    fr.fd = ::open(path.c_str(), O_RDONLY);
    if (fr.fd < 0) throw error("cannot open " + path);
    fr.left = fw.n;
    b.load_state(fr, seq.n_past());
    std::vector<float> lb(V);
    fr.read(lb.data(), V * sizeof(float));
    b.restore_logits(lb);
    ::close(fr.fd);
    const double t_load = now_s() - t0;  // from the page cache (just written)
    const int32_t t = static_cast<int32_t>((prompt.back() + 1) % static_cast<int32_t>(V));
    std::vector<float> la(V), l2(V);
    seq.eval(std::span(&t, 1), la);
    b.eval(std::span(&t, 1), l2);
    const bool same = std::memcmp(la.data(), l2.data(), V * sizeof(float)) == 0;
    std::printf(
        "saved state after %lld tokens: %.1f MB; save + fsync %.3f s (%.2f GB/s), load %.3f s (%.2f GB/s) "
        "vs prefill %.3f s; next step after the load: %s\n",
        static_cast<long long>(seq.n_past() - 1), static_cast<double>(fw.n) / 1e6, t_save,
        static_cast<double>(fw.n) / t_save / 1e9, t_load, static_cast<double>(fw.n) / t_load / 1e9, t_prefill,
        same ? "bitwise identical" : "DIFFERENT");
    if (!same) throw error("the loaded state diverged");
    ::unlink(path.c_str());
}

// Deterministic pseudo-random DSpark features (xorshift, values in [-1, 1)).
std::vector<float> pseudo_features(int64_t n) {
    std::vector<float> feat(static_cast<size_t>(n));
    uint64_t x = 88172645463325252ull;
    for (float &f : feat) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        f = static_cast<float>(static_cast<double>(x >> 11) / 4503599627370496.0 - 1.0);
    }
    return feat;
}


// --dspark: the decode step with the drafter's capture on, and one draft block after `window` observed rows
// (deterministic pseudo-random features), relative to the one-row step (dt seconds).
void dspark_costs(const ds4::dspark_weights &dw, const std::shared_ptr<const ds4::cuda_weights> &dev,
                  ds4::cuda_sequence &seq, int32_t t, int n_gen, double dt) {
    seq.set_feature_layers(dw.cfg.target_layers, dw.cfg.window);
    for (int i = 0; i < 3; ++i) t = ds4::cuda_testing::step_greedy(seq, t);
    const double c0 = now_s();
    for (int i = 0; i < n_gen; ++i) t = ds4::cuda_testing::step_greedy(seq, t);
    const double dc = (now_s() - c0) / n_gen;
    seq.set_feature_layers({}, 0);
    ds4::cuda_dspark d(dev, ds4::qat_mode::full);
    const int64_t W = dw.cfg.window, F = d.feature_dim(), S = seq.n_past();
    std::vector<float> feat = pseudo_features(W * F);
    const double o0 = now_s();
    d.observe(S - W, feat);
    const double dobs = now_s() - o0;
    for (int i = 0; i < 3; ++i) d.draft(S, t);  // warm-up (graph capture)
    const int reps = std::max(8, n_gen);
    const double d0 = now_s();
    for (int i = 0; i < reps; ++i) d.draft(S, t);
    const double dd = (now_s() - d0) / reps;
    const double o1 = now_s();
    d.observe(S, std::span(feat).first(static_cast<size_t>(F)));
    const double dobs1 = now_s() - o1;
    std::printf("%10s dspark: decode step with the feature capture %.3f ms (%.3fx); draft block %.3f ms = %.2fx a one-row step; "
                "observe %lld rows %.3f ms, 1 row %.3f ms\n",
                "", dc * 1e3, dc / dt, dd * 1e3, dd / dt, static_cast<long long>(W), dobs * 1e3, dobs1 * 1e3);
}

// --spec-accept: speculative decoding at controlled acceptance (issue 26). Synthetic weights make a real
// drafter's acceptance meaningless, so the drafts are the target's own greedy continuation (computed
// beforehand by plain decoding from the same state), each corrupted with probability 1 - a; the width is
// spec::draft_budget's adaptive one (up to draft_max) with the verification and drafter cost curves learnt
// from the timed steps (spec::verify_cost, as the engine does). Each verification is one eval_rows of 1 + k
// rows whose logits stay on the device, each row's token taken from its device summary (row_top, what the
// engine's eval_verify / sample_row do for a greedy sampler), the rejected rows rolled back (truncate). Each
// acceptance runs with drafts free (the oracle alone: the verification's own speed), then with each drafter
// the run has (paid_drafter below: a DSpark drafter, the model file's MTP head) paying its cost as the
// engine's drafter does, its drafts replaced by the oracle's. Plain decoding for the ratio: eval of one token,
// its token from the device summary (the engine's plain step). Each run starts from a fresh sequence made
// `depth` deep with the same seed, so every run decodes the same tokens.
constexpr int32_t kFirst = 11;  // the token decoding starts from

// A drafter whose cost spec_controlled pays: draft() is timed as the drafter's cost (spec::generate's
// observe_draft), verify() as the verification (eval_rows with what the drafter reads, and what the engine's
// session does with it inside eval_verify), rollback() follows the target's truncate.
class paid_drafter {
  public:
    virtual ~paid_drafter() = default;
    virtual const char *name() const = 0;
    virtual void draft(int64_t base, int32_t pending, int32_t k) = 0;
    virtual void verify(ds4::cuda_sequence &s, std::span<const int32_t> rows) = 0;
    virtual void rollback(int64_t base, int64_t kept) = 0;  // the target keeps rows [base, base + kept)
    double verify_side_s = 0;  // the drafter's part of verify()
};

// DSpark (dw, dev): the feature capture in every verification, and in each step that asks for drafts one
// observe() of the kept rows' features since the last draft (at most a window of them) and one draft block.
class dspark_paid final : public paid_drafter {
  public:
    dspark_paid(ds4::cuda_sequence &s, const ds4::dspark_weights &dw, const std::shared_ptr<const ds4::cuda_weights> &dev,
                int64_t depth)
        : d_(dev, ds4::qat_mode::full), W_(dw.cfg.window), F_(d_.feature_dim()) {
        s.set_feature_layers(dw.cfg.target_layers, dw.cfg.window);
        d_.observe(depth - W_, pseudo_features(W_ * F_));
        for (int i = 0; i < 2; ++i) d_.draft(depth, kFirst);  // graph capture outside the timing
    }
    const char *name() const override { return "DSpark paid"; }
    void draft(int64_t base, int32_t pending, int32_t) override {
        if (!pend_.empty()) {  // the newest window of the features waiting since the last draft
            const int64_t skip = std::max<int64_t>(0, static_cast<int64_t>(pend_.size()) / F_ - W_);
            d_.observe(pend_p0_ + skip, std::span<const float>(pend_).subspan(static_cast<size_t>(skip * F_)));
            pend_.clear();
        }
        d_.draft(base, pending);
    }
    void verify(ds4::cuda_sequence &s, std::span<const int32_t> rows) override {
        feats_.resize(rows.size() * static_cast<size_t>(F_));
        s.eval_rows(rows, {}, {}, feats_);
    }
    void rollback(int64_t base, int64_t kept) override {  // the kept rows' features wait for the next draft
        d_.truncate(base);
        if (pend_.empty()) pend_p0_ = base;
        pend_.insert(pend_.end(), feats_.begin(), feats_.begin() + static_cast<std::ptrdiff_t>(kept * F_));
        const int64_t over = static_cast<int64_t>(pend_.size()) / F_ - W_;
        if (over >= W_) {  // trimmed once a window's worth is stale (not every step)
            pend_.erase(pend_.begin(), pend_.begin() + static_cast<std::ptrdiff_t>(over * F_));
            pend_p0_ += over;
        }
    }

  private:
    ds4::cuda_dspark d_;
    int64_t W_, F_;
    std::vector<float> feats_, pend_;  // pend_: features of positions pend_p0_.. not yet observed
    int64_t pend_p0_ = 0;
};

// The MTP head (mtp_dev: cuda_upload_mtp of the model file's head) as a session's drafter on one GPU (the
// engine's own make_mtp_drafter over make_cuda_mtp_head): each step that asks for k drafts chains the head
// k rows (one eval_mtp each, a replayed graph) from the target's final HC state and rolls them back; every
// verification hands the verified rows' final HC states over (eval_rows' hc_out) and the head runs its rows
// over them (observe: part of the verification, as in the session's eval_verify); rollback truncates it. The
// head's history starts as after a prompt: its last window of rows, from deterministic pseudo-random states
// (the sequence's synthetic depth has no real ones).
class mtp_paid final : public paid_drafter {
  public:
    mtp_paid(const std::shared_ptr<const ds4::cuda_weights> &mtp_dev, const ds4::hparams &hp, int64_t depth, int64_t n_ctx)
        : S_(static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd)),
          d_(make_mtp_drafter(make_cuda_mtp_head(mtp_dev, n_ctx + ds4::max_rollback), S_)) {
        held_.resize(static_cast<size_t>(depth));
        for (size_t i = 0; i < held_.size(); ++i) held_[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(hp.n_vocab));
        const int64_t rows = std::min<int64_t>(depth, d_->context_rows());
        d_->observe(held_, depth - rows, pseudo_features(rows * static_cast<int64_t>(S_)), {});
        for (int i = 0; i < 2; ++i) d_->draft(held_, kFirst, 2, nullptr);  // graph capture outside the timing
    }
    const char *name() const override { return "MTP paid"; }
    void draft(int64_t base, int32_t pending, int32_t k) override {
        if (static_cast<int64_t>(held_.size()) != base) throw error("mtp_paid: the held tokens do not match the target");
        d_->draft(held_, pending, k, nullptr);
    }
    void verify(ds4::cuda_sequence &s, std::span<const int32_t> rows) override {
        hc_.resize(rows.size() * S_);
        const int64_t base = s.n_past();
        s.eval_rows(rows, {}, hc_);
        verified(base, rows, hc_);
    }
    // The rows [base, base + rows) just evaluated with their final HC states hc [rows, S] (eval_rows or
    // a batched step's hc_out): the head observes them, as the session does inside eval_verify.
    void verified(int64_t base, std::span<const int32_t> rows, std::span<const float> hc) {
        const double h0 = now_s();
        held_.insert(held_.end(), rows.begin(), rows.end());
        d_->observe(held_, base, hc, {});
        verify_side_s += now_s() - h0;
    }
    size_t state_floats() const { return S_; }
    void rollback(int64_t base, int64_t kept) override {
        held_.resize(static_cast<size_t>(base + kept));
        d_->truncate(base + kept);
    }

  private:
    size_t S_;
    std::unique_ptr<ds4_drafter> d_;
    std::vector<int32_t> held_;  // the tokens the target holds (the drafter reads them)
    std::vector<float> hc_;      // [rows, S_] the verified rows' final HC states
};

struct spec_result {
    int64_t steps = 0, drafted = 0, kept = 0, drafts = 0;
    double seconds = 0, draft_s = 0;
};

// Row j's greedy token: its one-candidate summary on the device (ties: the lower id).
int32_t greedy_row(ds4::cuda_sequence &s, int j) {
    return s.row_top(j, 1, {}, 1.0f, 0.0f, 0.0f).ids.at(0);
}

// After a verification of `rows` (the pending token, then the drafts) on s: row j's greedy token is the next
// true token, and the drafts are kept while they equal it (and the n_tok tokens are not all out). Counts the
// emitted tokens, sets the next pending token, returns the drafts kept; the caller truncates s to its base +
// 1 + that.
size_t accept_greedy(ds4::cuda_sequence &s, std::span<const int32_t> rows, size_t &emitted, int n_tok, int32_t &pending) {
    size_t j = 0;
    for (;; ++j) {
        const int32_t y = greedy_row(s, static_cast<int>(j));
        ++emitted;
        if (j + 1 < rows.size() && rows[j + 1] == y && emitted < static_cast<size_t>(n_tok)) continue;
        pending = y;
        return j;
    }
}

// n_tok tokens from s (made depth deep) with drafts from cont (the greedy continuation), each kept with
// probability a, the width adaptive up to draft_max; d (or null: drafts free) pays its cost.
spec_result spec_run(ds4::cuda_sequence &s, paid_drafter *d, const std::vector<int32_t> &cont, double a, int n_tok,
                     int draft_max, spec::verify_cost &cost, std::mt19937 &rng, size_t V) {
    spec::draft_budget budget(draft_max, true);
    int32_t pending = kFirst;
    size_t emitted = 0;
    spec_result r;
    const double t0 = now_s();
    while (emitted < static_cast<size_t>(n_tok)) {
        const int64_t base = s.n_past();
        const int32_t k = budget.next(&cost);
        if (d && k > 0) {  // the drafter's cost; its tokens are replaced by the oracle's
            const double d0 = now_s();
            d->draft(base, pending, k);
            const double dt = now_s() - d0;
            cost.observe_draft(k, dt);
            r.draft_s += dt;
            ++r.drafts;
        }
        std::vector<int32_t> rows{pending};
        for (int32_t j = 0; j < k; ++j) {
            int32_t x = cont[emitted + static_cast<size_t>(j)];
            if (std::uniform_real_distribution<double>(0, 1)(rng) >= a) x = (x + 1) % static_cast<int32_t>(V);
            rows.push_back(x);
        }
        const double s0 = now_s();
        if (d)
            d->verify(s, rows);
        else
            s.eval_rows(rows, {});
        cost.observe(static_cast<int32_t>(rows.size()), now_s() - s0);
        ++r.steps;
        const size_t j = accept_greedy(s, rows, emitted, n_tok, pending);
        s.truncate(base + 1 + static_cast<int64_t>(j));
        if (d) d->rollback(base, 1 + static_cast<int64_t>(j));
        budget.update(rows.size() - 1, j);
        r.drafted += static_cast<int64_t>(rows.size()) - 1;
        r.kept += static_cast<int64_t>(j);
    }
    r.seconds = now_s() - t0;
    return r;
}

void spec_controlled(const std::shared_ptr<const ds4::cuda_weights> &w, const std::shared_ptr<cuda::block_pool> &pool,
                     int64_t depth, size_t V, const std::vector<int64_t> &accepts, int n_tok, int draft_max,
                     const ds4::dspark_weights *dw, const std::shared_ptr<const ds4::cuda_weights> &dev,
                     const std::shared_ptr<const ds4::cuda_weights> &mtp_dev) {
    const int64_t n_ctx = depth + n_tok + 64;
    auto fresh = [&] {
        auto s = std::make_unique<ds4::cuda_sequence>(w, n_ctx, true, 0, nullptr, pool);
        ds4::cuda_testing::fill_synthetic(*s, depth, 7);
        return s;
    };
    std::vector<int32_t> cont;  // cont[i]: the greedy token after kFirst, cont[0..i)
    double plain_s = 0;
    {
        auto s = fresh();
        int32_t t = kFirst;
        for (int i = 0; i < 3; ++i) s->eval(std::span(&t, 1), {}), s->truncate(depth);  // warm-up (graph capture)
        const double t0 = now_s();
        for (int i = 0; i < n_tok + draft_max + 1; ++i) {
            s->eval(std::span(&t, 1), {});
            t = s->logits_top(1, {}, 1.0f, 0.0f, 0.0f).ids.at(0);
            cont.push_back(t);
            if (i + 1 == n_tok) plain_s = now_s() - t0;
        }
    }
    const double plain = n_tok / plain_s, step_s = plain_s / n_tok;
    std::printf("speculation at controlled acceptance from depth %lld, %d tokens, width <= %d (adaptive; drafter and rows "
                "costed): plain decoding %.1f tok/s (eval of one token, its token from the device summary)\n",
                static_cast<long long>(depth), n_tok, draft_max, plain);
    std::mt19937 rng(3);
    for (int mode = 0; mode < 3; ++mode) {  // drafts free, DSpark paid, MTP paid
        if ((mode == 1 && !dw) || (mode == 2 && !mtp_dev)) continue;
        spec::verify_cost cost;  // kept across the acceptances, as a serving process keeps it
        for (int64_t ap : accepts) {
            const double a = static_cast<double>(ap) / 100.0;
            auto s = fresh();
            std::unique_ptr<paid_drafter> d;
            if (mode == 1) d = std::make_unique<dspark_paid>(*s, *dw, dev, depth);
            if (mode == 2) d = std::make_unique<mtp_paid>(mtp_dev, s->hp(), depth, n_ctx);
            // Every row count's graph captured before the timing (a serving process has them).
            for (int r = 1; r <= draft_max + 1; ++r) {
                std::vector<int32_t> toks(static_cast<size_t>(r), kFirst);
                for (int i = 0; i < 2; ++i) s->eval_rows(toks, {}), s->truncate(depth);
            }
            const spec_result r = spec_run(*s, d.get(), cont, a, n_tok, draft_max, cost, rng, V);
            const double tps = n_tok / r.seconds;
            std::printf("%10s %s a = %.2f: %.1f tok/s = %.2fx plain; %.2f tokens per step, %lld drafted, %lld kept; "
                        "verify cost 2..%d rows / 1 row:",
                        "", d ? d->name() : "drafts free", a, tps, tps / plain,
                        static_cast<double>(n_tok) / static_cast<double>(r.steps), static_cast<long long>(r.drafted),
                        static_cast<long long>(r.kept), draft_max + 1);
            for (int q = 2; q <= draft_max + 1; ++q) std::printf(" %.2f", cost.ratio(q));
            const double each = r.drafts ? r.draft_s / static_cast<double>(r.drafts) : 0.0;
            if (mode == 1)
                std::printf("; %lld draft blocks, %.3f ms each = %.2f steps", static_cast<long long>(r.drafts), each * 1e3,
                            cost.draft_ratio(1));
            if (mode == 2)  // a draft chains k head rows: its cost per drafted token, in plain decoding steps
                std::printf("; %lld MTP drafts of %.2f tokens, %.3f ms each = %.2f steps, %.2f steps a drafted token; "
                            "head rows over the verified ones %.3f ms a step",
                            static_cast<long long>(r.drafts),
                            r.drafts ? static_cast<double>(r.drafted) / static_cast<double>(r.drafts) : 0.0, each * 1e3,
                            each / step_s, r.drafted ? r.draft_s / static_cast<double>(r.drafted) / step_s : 0.0,
                            d->verify_side_s * 1e3 / static_cast<double>(std::max<int64_t>(1, r.steps)));
            std::printf("\n");
        }
    }
}

// --spec-seqs: speculation inside a batch (issue 26: it composes with continuous batching). S sequences, each
// made `depth` deep with its own seed, decode n_tok tokens each. Every step, each sequence still generating
// asks its own draft_budget for a width as the scheduler's plan_drafts does (other_rows: the other
// sequences' rows of the step; one verify_cost for all, fed with every forward), its rows (the pending token,
// then drafts from its own greedy continuation, each corrupted with probability 1 - a) join the step, and the
// step runs as the engine's GPU step does (ds4_engine.cpp sync_step): forwards of at most kStepRows rows, the
// sequences packed in order, none split; a composition new to the graph cache runs eagerly (step_batch). Each
// sequence's rows are sampled greedily on the device (row_top), the rejected ones rolled back. Plain = the
// same sequences decoding one row each per step, packed the same way. Drafts free, then (an MTP head in the
// file) every sequence's own head paid: its draft timed, its observe of the verified rows after each forward.
constexpr int kStepRows = 16;  // cuda::ds4::gemv_max_rows: the rows of one GPU forward (ds4_gpu::max_step_rows)

struct batch_seq {
    std::unique_ptr<ds4::cuda_sequence> s;
    std::unique_ptr<mtp_paid> d;  // null: drafts free
    std::unique_ptr<spec::draft_budget> budget;
    int32_t pending = kFirst;
    size_t emitted = 0;
    std::vector<int32_t> rows;  // this step's rows
    int64_t base = 0;
};

// One step over the sequences' rows: forwards of at most kStepRows rows (whole sequences, in order), each
// timed into `cost` (when given); hc_out of every row when a sequence pays an MTP head.
void batch_forwards(std::vector<batch_seq *> &act, spec::verify_cost *cost, int64_t &forwards) {
    for (size_t b0 = 0; b0 < act.size();) {
        std::vector<ds4::cuda_sequence *> ptrs;
        std::vector<int> counts;
        std::vector<int32_t> toks;
        size_t b1 = b0;
        bool hc_wanted = false;
        for (; b1 < act.size() && toks.size() + act[b1]->rows.size() <= static_cast<size_t>(kStepRows); ++b1) {
            ptrs.push_back(act[b1]->s.get());
            counts.push_back(static_cast<int>(act[b1]->rows.size()));
            toks.insert(toks.end(), act[b1]->rows.begin(), act[b1]->rows.end());
            hc_wanted = hc_wanted || act[b1]->d;
        }
        if (b1 == b0) throw error("--spec-seqs: a sequence's rows exceed one forward");
        const size_t S = hc_wanted ? act[b0]->d->state_floats() : 0;
        std::vector<float> hc(toks.size() * S);
        const double t0 = now_s();
        ds4::cuda_sequence::step_batch(ptrs, counts, toks, {}, hc);
        if (cost) cost->observe(static_cast<int32_t>(toks.size()), now_s() - t0);
        ++forwards;
        size_t r0 = 0;
        for (size_t k = b0; k < b1; ++k) {
            batch_seq &q = *act[k];
            if (q.d) q.d->verified(q.base, q.rows, std::span<const float>(hc).subspan(r0 * S, q.rows.size() * S));
            r0 += q.rows.size();
        }
        b0 = b1;
    }
}

void spec_batched(const std::shared_ptr<const ds4::cuda_weights> &w, const std::shared_ptr<cuda::block_pool> &pool,
                  int64_t depth, size_t V, const std::vector<int64_t> &accepts, int n_tok, int draft_max, int64_t n_seqs,
                  const std::shared_ptr<const ds4::cuda_weights> &mtp_dev) {
    if (n_seqs < 1 || n_seqs > kStepRows) throw error("--spec-seqs: 1.." + std::to_string(kStepRows) + " sequences");
    const int64_t n_ctx = depth + n_tok + 64;
    auto fresh = [&](std::vector<batch_seq> &v, bool paid) {
        v.clear();
        v.resize(static_cast<size_t>(n_seqs));
        for (int64_t i = 0; i < n_seqs; ++i) {
            batch_seq &q = v[static_cast<size_t>(i)];
            q.s = std::make_unique<ds4::cuda_sequence>(w, n_ctx, true, 0, nullptr, pool);
            ds4::cuda_testing::fill_synthetic(*q.s, depth, static_cast<uint64_t>(2 + i));
            q.budget = std::make_unique<spec::draft_budget>(draft_max, true);
            if (paid) q.d = std::make_unique<mtp_paid>(mtp_dev, q.s->hp(), depth, n_ctx);
        }
    };
    // Plain batched decoding: each sequence's greedy continuation (the oracle's drafts) and the step time.
    std::vector<batch_seq> seqs;
    fresh(seqs, false);
    std::vector<std::vector<int32_t>> cont(static_cast<size_t>(n_seqs));
    std::vector<batch_seq *> all;
    for (batch_seq &q : seqs) all.push_back(&q);
    int64_t forwards = 0;
    for (int i = 0; i < 2; ++i) {  // the one-row composition captured before the timing
        for (batch_seq &q : seqs) q.rows = {kFirst}, q.base = q.s->n_past();
        batch_forwards(all, nullptr, forwards);
        for (batch_seq &q : seqs) q.s->truncate(depth);
    }
    double plain_s = 0;
    const double p0 = now_s();
    for (int i = 0; i < n_tok + draft_max + 1; ++i) {
        for (batch_seq &q : seqs) q.rows = {q.pending}, q.base = q.s->n_past();
        batch_forwards(all, nullptr, forwards);
        for (size_t k = 0; k < seqs.size(); ++k) {
            seqs[k].pending = greedy_row(*seqs[k].s, 0);
            cont[k].push_back(seqs[k].pending);
        }
        if (i + 1 == n_tok) plain_s = now_s() - p0;
    }
    const double plain = static_cast<double>(n_seqs) * n_tok / plain_s;
    std::printf("speculation inside a batch of %lld sequences from depth %lld, %d tokens each, width <= %d each "
                "(adaptive, one cost curve), forwards of <= %d rows: plain batched decoding %.1f tok/s in all\n",
                static_cast<long long>(n_seqs), static_cast<long long>(depth), n_tok, draft_max, kStepRows, plain);
    std::mt19937 rng(5);
    for (int mode = 0; mode < 2; ++mode) {  // drafts free, MTP paid
        if (mode == 1 && !mtp_dev) continue;
        spec::verify_cost cost;
        for (int64_t ap : accepts) {
            const double a = static_cast<double>(ap) / 100.0;
            fresh(seqs, mode == 1);
            int64_t steps = 0, drafted = 0, kept = 0, rows_total = 0;
            forwards = 0;
            double draft_s = 0;
            const double t0 = now_s();
            for (;;) {
                std::vector<batch_seq *> act;
                for (batch_seq &q : seqs)
                    if (q.emitted < static_cast<size_t>(n_tok)) act.push_back(&q);
                if (act.empty()) break;
                for (batch_seq *q : act) {  // widths as plan_drafts: the other sequences' rows are paid anyway
                    const int32_t left = n_tok - static_cast<int32_t>(q->emitted) - 1;
                    const int32_t k = std::min(q->budget->next(&cost, static_cast<int32_t>(act.size()) - 1), std::max(left, 0));
                    q->base = q->s->n_past();
                    if (q->d && k > 0) {
                        const double d0 = now_s();
                        q->d->draft(q->base, q->pending, k);
                        const double dt = now_s() - d0;
                        cost.observe_draft(k, dt);
                        draft_s += dt;
                    }
                    const size_t idx = static_cast<size_t>(q - seqs.data());
                    q->rows = {q->pending};
                    for (int32_t j = 0; j < k; ++j) {
                        int32_t x = cont[idx][q->emitted + static_cast<size_t>(j)];
                        if (std::uniform_real_distribution<double>(0, 1)(rng) >= a) x = (x + 1) % static_cast<int32_t>(V);
                        q->rows.push_back(x);
                    }
                    rows_total += static_cast<int64_t>(q->rows.size());
                }
                batch_forwards(act, &cost, forwards);
                ++steps;
                for (batch_seq *q : act) {
                    const size_t j = accept_greedy(*q->s, q->rows, q->emitted, n_tok, q->pending);
                    q->s->truncate(q->base + 1 + static_cast<int64_t>(j));
                    if (q->d) q->d->rollback(q->base, 1 + static_cast<int64_t>(j));
                    q->budget->update(q->rows.size() - 1, j);
                    drafted += static_cast<int64_t>(q->rows.size()) - 1;
                    kept += static_cast<int64_t>(j);
                }
            }
            const double tps = static_cast<double>(n_seqs) * n_tok / (now_s() - t0);
            std::printf("%10s %s a = %.2f: %.1f tok/s in all = %.2fx plain batched; %lld steps, %lld forwards, %.1f rows a "
                        "step, %lld drafted, %lld kept",
                        "", mode == 1 ? "MTP paid" : "drafts free", a, tps, tps / plain, static_cast<long long>(steps),
                        static_cast<long long>(forwards), static_cast<double>(rows_total) / static_cast<double>(steps),
                        static_cast<long long>(drafted), static_cast<long long>(kept));
            if (mode == 1) std::printf("; drafting %.3f ms a step", draft_s * 1e3 / static_cast<double>(std::max<int64_t>(1, steps)));
            std::printf("\n");
        }
    }
}

// The model file's MTP head (llama.cpp's layout: fathom-gguf synth --mtp), for --spec-accept's "MTP paid" runs:
// read from the same host model and uploaded beside the target as the engine's --spec mtp does
// (cuda_upload_mtp; a sparse file's pooled rows replicated on the device like the target's). Null without one.
std::shared_ptr<const ds4::cuda_weights> upload_mtp_head(const ds4::model &m, const std::shared_ptr<const ds4::cuda_weights> &w) {
    if (m.hp.n_nextn < 1) return nullptr;
    auto dev = ds4::cuda_upload_mtp(m, *ds4::load_mtp(m, m.file), w);
    std::printf("mtp head (blk.%d of the model file): %.2f GB on the device\n", m.hp.n_layer,
                static_cast<double>(ds4::cuda_weight_bytes(*dev)) / 1e9);
    return dev;
}

}  // namespace

int main(int argc, char **argv) try {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines out as they come (a pipe to tee; a crash loses nothing)
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [--depths a,b,..] [--n N] [--kv f16|f32] [--eager]\n",
                     argv[0]);
        return 2;
    }
    std::string path = argv[1], kv = "f16", state_file, trace_file, ktrace_file, profile = "decode", dspark_file;
    std::vector<int64_t> depths = {2048, 8192, 32768, 131072};
    int n_gen = 64;
    bool eager = false, serial_step = false, paged = false;
    std::vector<int64_t> prefill = {2048, 8192, 32768}, rows, seqs_list, capacity, spec_accepts, spec_seqs;
    int spec_tokens = 64, draft_max = 4;
    int64_t chunk = ds4::default_prefill_chunk;
    for (int i = 2; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--depths" && i + 1 < argc)
            depths = parse_list(argv[++i]);
        else if (a == "--n" && i + 1 < argc)
            n_gen = std::atoi(argv[++i]);
        else if (a == "--kv" && i + 1 < argc)
            kv = argv[++i];
        else if (a == "--eager")
            eager = true;
        else if (a == "--serial-step")
            serial_step = true;
        else if (a == "--state-file" && i + 1 < argc)
            state_file = argv[++i];
        else if (a == "--gemv-trace" && i + 1 < argc)
            trace_file = argv[++i];
        else if (a == "--ktrace" && i + 1 < argc)
            ktrace_file = argv[++i];
        else if (a == "--prefill" && i + 1 < argc)
            prefill = parse_list(argv[++i]);
        else if (a == "--chunk" && i + 1 < argc)
            chunk = std::atoll(argv[++i]);
        else if (a == "--rows" && i + 1 < argc)
            rows = parse_list(argv[++i]);
        else if (a == "--seqs" && i + 1 < argc)
            seqs_list = parse_list(argv[++i]);
        else if (a == "--paged")
            paged = true;
        else if (a == "--profile" && i + 1 < argc)
            profile = argv[++i];
        else if (a == "--capacity" && i + 1 < argc)
            capacity = parse_list(argv[++i]);
        else if (a == "--dspark" && i + 1 < argc)
            dspark_file = argv[++i];
        else if (a == "--spec-accept" && i + 1 < argc)
            spec_accepts = parse_list(argv[++i]);
        else if (a == "--spec-seqs" && i + 1 < argc)
            spec_seqs = parse_list(argv[++i]);
        else if (a == "--spec-tokens" && i + 1 < argc)
            spec_tokens = std::atoi(argv[++i]);
        else if (a == "--draft-max" && i + 1 < argc)
            draft_max = std::atoi(argv[++i]);
        else if (a == "--mma-slots" && i + 1 < argc)
            cuda::ds4::set_gemv_mma_slots(std::atoi(argv[++i]));
        else
            throw error("unknown argument " + a);
    }
    if (profile != "decode" && profile != "rows" && profile != "seqs") throw error("--profile: decode, rows or seqs");
    for (int64_t a : spec_accepts)
        if (a < 0 || a > 100) throw error("--spec-accept: percentages 0..100");
    if (spec_tokens < 1 || draft_max < 1 || draft_max + 1 > ds4::max_rollback || draft_max + 1 > 16)
        throw error("--spec-tokens >= 1, --draft-max 1.." + std::to_string(std::min<int64_t>(ds4::max_rollback, 16) - 1));
    const double t_load = now_s();
    auto m = ds4::load_model(path);
    ds4::cuda_run_options o;
    o.kv = kv == "f32" ? kv_precision::f32 : kv_precision::f16;
    ds4::cuda_testing::cuda_test_options test_opts;
    test_opts.serial_step = serial_step;
    auto w = ds4::cuda_testing::cuda_upload(*m, o, test_opts);
    const double bytes = ds4::cuda_bytes_per_token(*w);
    std::printf(
        "model %s: %d layers, D %d, %d experts (%d used), vocab %d; %.2f GB on the device, uploaded in %.1f "
        "s\n",
        path.c_str(), m->hp.n_layer, m->hp.n_embd, m->hp.n_expert, m->hp.n_expert_used, m->hp.n_vocab,
        static_cast<double>(ds4::cuda_weight_bytes(*w)) / 1e9, now_s() - t_load);
    const double copy_bw = cuda_measure_copy_bandwidth(o.device);
    std::printf(
        "weights read per decoded token: %.3f GB; device copy bandwidth (1 GiB D2D, read + write): %.1f "
        "GB/s; "
        "roofline %.1f tok/s\n",
        bytes / 1e9, copy_bw / 1e9, copy_bw / bytes);
    int64_t max_depth = depths.empty() ? 0 : *std::max_element(depths.begin(), depths.end());
    if (!prefill.empty()) max_depth = std::max(max_depth, *std::max_element(prefill.begin(), prefill.end()));
    // Concurrent sequences per context length on this device (paged state, a shared prefill scratch).
    for (int64_t ctx : capacity) {
        auto pf = ds4::cuda_make_prefill_pool();
        size_t free0 = 0, total = 0;
        cudaMemGetInfo(&free0, &total);
        std::shared_ptr<cuda::block_pool> pool = ds4::cuda_make_state_pool(*w, 0);
        std::vector<std::unique_ptr<ds4::cuda_sequence>> held;
        std::string stop;
        const double t0 = now_s();
        while (held.size() < 4096) {
            try {
                auto s = std::make_unique<ds4::cuda_sequence>(w, ctx, true, chunk, pf, pool);
                ds4::cuda_testing::fill_synthetic(*s, ctx - 1, held.size() + 1);
                held.push_back(std::move(s));
            } catch (const std::exception &e) {
                stop = e.what();
                break;
            }
        }
        size_t free1 = 0;
        cudaMemGetInfo(&free1, &total);
        const double per = held.empty() ? 0 : static_cast<double>(free0 - free1) / static_cast<double>(held.size());
        std::printf("capacity at %lld tokens: %zu sequences fit (%.1f MB of device memory each, %.2f KB per token; "
                    "rows %.1f MB in %lld blocks of the pool's %lld; %.1f s); stopped by: %s\n",
                    static_cast<long long>(ctx), held.size(), per / 1e6, per / static_cast<double>(ctx) / 1e3,
                    held.empty() ? 0.0 : static_cast<double>(held.back()->row_bytes()) / 1e6,
                    static_cast<long long>(pool->used()), static_cast<long long>(pool->capacity()), now_s() - t0,
                    stop.c_str());
        held.clear();
        pool.reset();
    }
    std::shared_ptr<cuda::block_pool> state_pool = paged ? ds4::cuda_make_state_pool(*w, 0) : nullptr;
    // room for the timed steps, the DSpark capture steps (3 + n_gen) and the rows probes past the deepest depth
    ds4::cuda_sequence seq(w, max_depth + 3 * n_gen + 64, !eager, chunk, {}, state_pool);
    std::vector<int> trace_launches;
    uint64_t *trace_buf = nullptr;
    // The DSpark drafter reads the target's geometry from the host model: loaded before the mapping goes.
    std::unique_ptr<ds4::dspark_weights> dspark_w;
    std::shared_ptr<const ds4::cuda_weights> dspark_dev;
    if (!dspark_file.empty()) {
        dspark_w = ds4::load_dspark(*m, dspark_file);
        dspark_dev = ds4::cuda_upload_dspark(*m, *dspark_w, w);
        std::printf("dspark %s: %zu stages, block %d, window %d, Markov rank %d; %.2f GB on the device\n",
                    dspark_file.c_str(), dspark_w->stages.size(), dspark_w->cfg.block_size, dspark_w->cfg.window,
                    dspark_w->cfg.markov_rank, static_cast<double>(ds4::cuda_weight_bytes(*dspark_dev)) / 1e9);
    }
    const auto mtp_dev = spec_accepts.empty() ? nullptr : upload_mtp_head(*m, w);  // null: no MTP head in the file
    m.reset();  // the host mapping is no longer needed

    // End to end from position 0: 256-token prompt through eval (logits downloaded), then decode.
    {
        std::vector<int32_t> prompt(256);
        for (size_t i = 0; i < prompt.size(); ++i)
            prompt[i] = static_cast<int32_t>((i * 7919 + 13) % 1000 + 100);
        std::vector<float> logits(static_cast<size_t>(seq.hp().n_vocab));
        uint64_t *trace = nullptr;
        const size_t trace_blocks = 1 << 18;
        if (!trace_file.empty()) {
            if (cudaMalloc(reinterpret_cast<void **>(&trace), trace_blocks * 6 * sizeof(uint64_t)) !=
                cudaSuccess)
                throw error("trace buffer");
            cudaMemset(trace, 0, trace_blocks * 6 * sizeof(uint64_t));
            cuda::ds4::set_gemv_trace(trace, trace_blocks);
        }
        seq.eval(std::span(prompt).first(8), logits);  // warm-up + graph capture
        seq.reset();
        double t0 = now_s();
        seq.eval(prompt, logits);
        const double pf = static_cast<double>(prompt.size()) / (now_s() - t0);
        int32_t t = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        t0 = now_s();
        for (int i = 0; i < n_gen; ++i) {
            seq.eval(std::span(&t, 1), logits);
            t = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        }
        const double dc = n_gen / (now_s() - t0);
        std::printf(
            "end to end from position 0 (eval, logits to the host every token): prefill 256 tokens %.1f "
            "tok/s "
            "(chunk %lld), decode %.1f tok/s = %.1f%% of roofline\n",
            pf, static_cast<long long>(chunk), dc, 100.0 * dc * bytes / copy_bw);
        if (trace) {  // the decode graph was captured by the first one-token eval above
            trace_launches = cuda::ds4::gemv_trace_launches();
            trace_buf = trace;
            cuda::ds4::set_gemv_trace(nullptr, 0);
            std::printf("gemv trace: %zu q8x launches captured\n", trace_launches.size());
        }
    }
    // Chunked prefill of a real prompt from position 0, interval by interval.
    if (!prefill.empty()) {
        std::sort(prefill.begin(), prefill.end());
        std::vector<int32_t> prompt(static_cast<size_t>(prefill.back()));
        for (size_t i = 0; i < prompt.size(); ++i)
            prompt[i] = static_cast<int32_t>(
                (i * 2654435761u + 17) % static_cast<size_t>(seq.hp().n_vocab - 200) + 100);
        std::vector<float> logits(static_cast<size_t>(seq.hp().n_vocab));
        seq.reset();
        std::printf("chunked prefill from position 0 (chunk %lld tokens):\n%12s %12s %12s %12s\n",
                    static_cast<long long>(chunk), "interval", "tokens", "seconds", "tok/s");
        int64_t at = 0;
        const double t_all = now_s();
        for (int64_t end : prefill) {
            const double t0 = now_s();
            seq.eval(std::span(prompt).subspan(static_cast<size_t>(at), static_cast<size_t>(end - at)),
                     logits);
            const double dt = now_s() - t0;
            std::printf("%5lld-%-6lld %12lld %12.3f %12.1f\n", static_cast<long long>(at),
                        static_cast<long long>(end), static_cast<long long>(end - at), dt,
                        static_cast<double>(end - at) / dt);
            at = end;
        }
        const double t_prefill = now_s() - t_all;
        std::printf("%12s %12lld %12.3f %12.1f\n", "total", static_cast<long long>(at), t_prefill,
                    static_cast<double>(at) / t_prefill);
        if (!state_file.empty()) state_round_trip(seq, w, state_file, prompt, t_prefill);
    }
    std::vector<std::pair<int64_t, std::vector<std::pair<std::string, float>>>> phases;
    bool rows_differ = false;
    std::printf("%10s %12s %12s %10s %12s\n", "depth", "tok/s", "ms/token", "GB/s", "% roofline");
    for (int64_t depth : depths) {
        ds4::cuda_testing::fill_synthetic(seq, depth, 1);
        int32_t t = 100;
        for (int i = 0; i < 3; ++i) t = ds4::cuda_testing::step_greedy(seq, t);  // warm-up
        const double t0 = now_s();
        // The timed replays form the profiler's capture range (scripts/device/ncu_step.sh runs Nsight
        // Compute with --profile-from-start off); without a profiler these calls do nothing.
        if (profile == "decode") cudaProfilerStart();
        for (int i = 0; i < n_gen; ++i) t = ds4::cuda_testing::step_greedy(seq, t);
        if (profile == "decode") cudaProfilerStop();
        const double dt = (now_s() - t0) / n_gen;
        std::printf("%10lld %12.1f %12.3f %10.1f %11.1f%%\n", static_cast<long long>(depth), 1.0 / dt,
                    dt * 1e3, bytes / dt / 1e9, 100.0 * bytes / dt / copy_bw);
        for (int64_t r : rows) {  // R rows evaluated, then rolled back: the same position every time
            if (r < 1 || r > ds4::max_rollback) throw error("--rows: 1.." + std::to_string(ds4::max_rollback));
            const std::vector<int32_t> toks(static_cast<size_t>(r), t);
            const int64_t base = seq.n_past();
            seq.eval_rows(toks, {});
            seq.truncate(base);
            const int reps = std::max(4, n_gen / static_cast<int>(r));
            const double r0 = now_s();
            const bool prof = profile == "rows" && r == *std::max_element(rows.begin(), rows.end());
            for (int i = 0; i < reps; ++i) {
                if (prof && i == reps - 1) cudaProfilerStart();
                seq.eval_rows(toks, {});
                if (prof && i == reps - 1) cudaProfilerStop();
                seq.truncate(base);
            }
            const double dr = (now_s() - r0) / reps;
            // the rows' logits against the same tokens decoded one step at a time (batch invariance at
            // full geometry, where the dense products take the columns form of the q8x GEMV)
            const size_t V = static_cast<size_t>(seq.hp().n_vocab);
            std::vector<int32_t> probe(static_cast<size_t>(r));
            for (size_t i = 0; i < probe.size(); ++i) probe[i] = static_cast<int32_t>(100 + 37 * i);
            std::vector<float> lr(probe.size() * V), ls(probe.size() * V);
            seq.eval_rows(probe, lr);
            seq.truncate(base);
            for (size_t i = 0; i < probe.size(); ++i) seq.eval(std::span(probe).subspan(i, 1), std::span(ls).subspan(i * V, V));
            seq.truncate(base);
            const bool same = std::memcmp(lr.data(), ls.data(), lr.size() * sizeof(float)) == 0;
            std::printf("%10s rows %2lld of one sequence + rollback: %8.3f ms = %.2fx a one-row step; logits %s\n", "",
                        static_cast<long long>(r), dr * 1e3, dr / dt,
                        same ? "bit-identical to one step per row" : "DIFFER from one step per row");
            if (!same) rows_differ = true;
        }
        if (trace_buf && !trace_launches.empty()) {  // the last replay's per-block stamps
            size_t n = 0;
            for (int b : trace_launches) n += static_cast<size_t>(b);
            std::vector<uint64_t> h(n * 6);
            cudaMemcpy(h.data(), trace_buf, h.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost);
            FILE *f = std::fopen(trace_file.c_str(), "w");
            if (!f) throw error("cannot write " + trace_file);
            size_t at = 0;
            for (size_t l = 0; l < trace_launches.size(); ++l)
                for (int b = 0; b < trace_launches[l]; ++b, ++at)
                    std::fprintf(f, "%zu,%d,%llu,%llu,%llu,%llu,%llu\n", l, b, (unsigned long long)h[6 * at],
                                 (unsigned long long)h[6 * at + 1], (unsigned long long)h[6 * at + 2],
                                 (unsigned long long)h[6 * at + 3], (unsigned long long)h[6 * at + 4]);
            std::fclose(f);
            std::printf("gemv trace of depth %lld written to %s\n", static_cast<long long>(depth),
                        trace_file.c_str());
            trace_launches.clear();
        }
        if (!ktrace_file.empty()) {  // one more replayed step, every instrumented block recorded
            namespace kt = cuda::ktrace;
            const uint32_t cap = 1u << 19;
            kt::record *buf = nullptr;
            uint32_t *n = nullptr;
            if (cudaMalloc(reinterpret_cast<void **>(&buf), cap * sizeof(kt::record)) != cudaSuccess ||
                cudaMalloc(reinterpret_cast<void **>(&n), sizeof(uint32_t)) != cudaSuccess ||
                cudaMemset(n, 0, sizeof(uint32_t)) != cudaSuccess)
                throw error("ktrace buffers");
            if (!kt::bind_all(buf, n, cap)) {
                std::printf("ktrace: not a FATHOM_KTRACE build, nothing recorded\n");
            } else {
                t = ds4::cuda_testing::step_greedy(seq, t);
                cudaDeviceSynchronize();
                uint32_t count = 0;
                cudaMemcpy(&count, n, sizeof count, cudaMemcpyDeviceToHost);
                kt::bind_all(nullptr, nullptr, 0);
                std::vector<kt::record> h(std::min(count, cap));
                cudaMemcpy(h.data(), buf, h.size() * sizeof(kt::record), cudaMemcpyDeviceToHost);
                FILE *f = std::fopen(ktrace_file.c_str(), "w");
                if (!f) throw error("cannot write " + ktrace_file);
                for (const kt::record &r : h)
                    std::fprintf(f, "%s,%u,%llu,%llu,%u,%u\n", kt::name(r.kernel), r.block, (unsigned long long)r.start,
                                 (unsigned long long)r.end, r.sm, r.grid);
                std::fclose(f);
                std::printf("ktrace of one step at depth %lld: %u block records%s, written to %s\n",
                            static_cast<long long>(depth), count, count > cap ? " (buffer full: cut)" : "",
                            ktrace_file.c_str());
            }
            cudaFree(buf);
            cudaFree(n);
            ktrace_file.clear();
        }
        if (dspark_w) dspark_costs(*dspark_w, dspark_dev, seq, t, n_gen, dt);
        if (!spec_accepts.empty())
            spec_controlled(w, state_pool, depth, static_cast<size_t>(seq.hp().n_vocab), spec_accepts, spec_tokens, draft_max,
                            dspark_w.get(), dspark_dev, mtp_dev);
        for (int64_t ns : spec_accepts.empty() ? std::vector<int64_t>{} : spec_seqs)
            spec_batched(w, state_pool, depth, static_cast<size_t>(seq.hp().n_vocab), spec_accepts, spec_tokens, draft_max, ns,
                         mtp_dev);
        if (!seqs_list.empty()) {  // several sequences per step
            const int64_t S = *std::max_element(seqs_list.begin(), seqs_list.end());
            std::vector<std::unique_ptr<ds4::cuda_sequence>> many;
            const int reps = std::max(4, n_gen / 2);
            const int64_t room = static_cast<int64_t>(reps + 1) * static_cast<int64_t>(seqs_list.size()) + 16;
            for (int64_t i = 0; i < S; ++i) {
                many.push_back(std::make_unique<ds4::cuda_sequence>(w, depth + room, true, 0, nullptr, state_pool));
                ds4::cuda_testing::fill_synthetic(*many.back(), depth, static_cast<uint64_t>(2 + i));
            }
            for (int64_t n : seqs_list) {
                if (n < 1 || n > 16) throw error("--seqs: 1..16");
                std::vector<ds4::cuda_sequence *> ptrs;
                for (int64_t i = 0; i < n; ++i) ptrs.push_back(many[static_cast<size_t>(i)].get());
                const std::vector<int> counts(static_cast<size_t>(n), 1);
                std::vector<int32_t> toks(static_cast<size_t>(n), t);
                // A new composition runs eagerly the first time and is captured the second (step_batch).
                const double e0 = now_s();
                ds4::cuda_sequence::step_batch(ptrs, counts, toks, {});
                const double deager = now_s() - e0;
                const double c0 = now_s();
                ds4::cuda_sequence::step_batch(ptrs, counts, toks, {});
                const double dcap = now_s() - c0;  // capture + instantiate + one replay
                const double s0 = now_s();
                const bool prof = profile == "seqs" && n == S;
                for (int i = 0; i < reps; ++i) {
                    if (prof && i == reps - 1) cudaProfilerStart();
                    ds4::cuda_sequence::step_batch(ptrs, counts, toks, {});
                    if (prof && i == reps - 1) cudaProfilerStop();
                }
                const double ds = (now_s() - s0) / reps;
                std::printf("%10s %2lld sequences, one row each: %8.3f ms per step = %.2fx a one-row step, %.1f tok/s in all; "
                            "a new composition's first step (eager) %.3f ms, second (graph capture) %.3f ms\n",
                            "", static_cast<long long>(n), ds * 1e3, ds / dt, static_cast<double>(n) / ds, deager * 1e3,
                            dcap * 1e3);
            }
        }
        phases.emplace_back(depth, ds4::cuda_testing::profile_step(seq, t));
    }
    // Where a step's time goes (eager launches queued behind a device pause; events between phases).
    for (const auto &[depth, ph] : phases) {
        float total = 0;
        for (const auto &x : ph) total += x.second;
        std::printf("phases at depth %lld (eager step, %.3f ms):\n", static_cast<long long>(depth), total);
        for (const auto &x : ph)
            std::printf("  %-44s %8.3f ms %5.1f%%\n", x.first.c_str(), x.second, 100.0 * x.second / total);
    }
    return rows_differ ? 1 : 0;
} catch (const std::exception &e) {
    std::fprintf(stderr, "bench_cuda_ds4: %s\n", e.what());
    return 1;
}
