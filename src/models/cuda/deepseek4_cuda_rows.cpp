// The multi-row step of the CUDA DS4 model (deepseek4_cuda.h: eval_rows, step_batch): up to 16 rows of one
// or several sequences in one forward (rows_exec, an executor of deepseek4_exec.h's run_forward), every
// row's logits bit-identical to its own decode step.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/cuda/deepseek4_cuda_impl.h"
#include "models/deepseek4_exec.h"

namespace fathom::ds4 {

void cuda_sequence::eval_rows(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out,
                              std::span<float> features) {
    impl &p = *p_;
    const hparams &hp = p.w->hp;
    const size_t n = tokens.size(), V = static_cast<size_t>(hp.n_vocab),
                 S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd);
    if (!p.w->embed() || !p.w->head()) throw error("cuda ds4: eval_rows needs the whole model on this device");
    if (!logits.empty() && logits.size() != n * V)
        throw error("cuda ds4: eval_rows logits buffer of " + std::to_string(logits.size()) + " floats, expected " +
                    std::to_string(n * V));
    if (!hc_out.empty() && hc_out.size() != n * S)
        throw error("cuda ds4: eval_rows hc_out buffer of " + std::to_string(hc_out.size()) + " floats, expected " +
                    std::to_string(n * S));
    const size_t F = static_cast<size_t>(p.feat_floats());
    if (!features.empty() && (F == 0 || features.size() != n * F))
        throw error("cuda ds4: eval_rows features buffer of " + std::to_string(features.size()) + " floats, expected " +
                    std::to_string(n * F) + " (set_feature_layers)");
    check_tokens(tokens);
    rows_held_ = 0;
    cuda_sequence *self = this;
    for (size_t i0 = 0; i0 < n;) {
        const size_t m = std::min(n - i0, static_cast<size_t>(cd::gemv_max_rows));
        if (m == 1) {
            step(tokens[i0], logits.empty() ? nullptr : logits.data() + i0 * V, nullptr, nullptr,
                 hc_out.empty() ? nullptr : hc_out.data() + i0 * S, features.empty() ? nullptr : features.data() + i0 * F);
        } else {
            const int count = static_cast<int>(m);
            step_batch(std::span<cuda_sequence *const>(&self, 1), std::span<const int>(&count, 1), tokens.subspan(i0, m),
                       logits.empty() ? logits : logits.subspan(i0 * V, m * V),
                       hc_out.empty() ? hc_out : hc_out.subspan(i0 * S, m * S),
                       features.empty() ? features : features.subspan(i0 * F, m * F));
        }
        i0 += m;
    }
    // the rows stay on the device (one step's: step_batch kept them, or a single row's last logits)
    rows_held_ = n <= static_cast<size_t>(cd::gemv_max_rows) ? static_cast<int>(n) : 0;
}

void cuda_sequence::step_batch(std::span<cuda_sequence *const> seqs, std::span<const int> counts,
                               std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out,
                               std::span<float> features) {
    if (seqs.empty() || counts.size() != seqs.size()) throw error("cuda ds4 batch: one row count per sequence");
    impl &p = *seqs[0]->p_;
    const hparams &hp = p.w->hp;
    const size_t V = static_cast<size_t>(hp.n_vocab), S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd);
    std::vector<impl::row_run> runs;
    std::vector<uint64_t> key;
    int n = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
        const std::string who = "cuda ds4 batch: sequence " + std::to_string(i);
        if (!seqs[i]) throw error(who + " is null");
        if (seqs[i]->p_->w != p.w) throw error(who + " has other weights");
        if (!p.w->embed() || !p.w->head()) throw error("cuda ds4 batch: needs the whole model on this device");
        for (size_t j = 0; j < i; ++j)
            if (seqs[j] == seqs[i]) throw error(who + " is sequence " + std::to_string(j) + " again");
        if (counts[i] < 1) throw error(who + ": no rows");
        runs.push_back({seqs[i]->p_.get(), n, counts[i]});
        key.push_back(seqs[i]->p_->uid);
        key.push_back(static_cast<uint64_t>(counts[i]));
        n += counts[i];
    }
    if (n > cd::gemv_max_rows || static_cast<size_t>(n) != tokens.size())
        throw error("cuda ds4 batch: " + std::to_string(tokens.size()) + " tokens for " + std::to_string(n) +
                    " rows (at most " + std::to_string(cd::gemv_max_rows) + ")");
    if ((!logits.empty() && logits.size() != static_cast<size_t>(n) * V) || (!hc_out.empty() && hc_out.size() != static_cast<size_t>(n) * S))
        throw error("cuda ds4 batch: logits / state buffers do not match the rows");
    const size_t F = static_cast<size_t>(p.feat_floats());
    if (!features.empty() && (F == 0 || features.size() != static_cast<size_t>(n) * F))
        throw error("cuda ds4 batch: the features buffer does not match the rows (set_feature_layers)");
    key.push_back(p.feat_layers.empty() ? 0 : p.feat_epoch);  // the graph holds the first sequence's capture
    for (const impl::row_run &r : runs) {
        cuda_sequence *q = seqs[static_cast<size_t>(&r - runs.data())];
        q->check_tokens(tokens.subspan(static_cast<size_t>(r.first), static_cast<size_t>(r.count)));
    }
    // Paged state: every sequence's rows mapped before anything runs (a sequence the pool cannot grow
    // throws here; those grown before it keep their blocks, which they hold for their next rows anyway).
    for (size_t i = 0; i < seqs.size(); ++i) seqs[i]->map_rows(seqs[i]->n_past_ + counts[i]);
    ck(cudaSetDevice(p.w->device), "selecting the device");
    // The step's scratch, from the engine's pool for this step (given back however it ends).
    p.take_rows();
    struct give_back {
        impl &p;
        ~give_back() { p.give_back_rows(); }
    } back{p};
    p.rs->ensure_lanes(std::min(n, row_scratch::kLanes), hp);
    row_scratch &rs = *p.rs;
    for (size_t i = 0; i < runs.size(); ++i)
        for (int k = 0; k < runs[i].count; ++k) {
            rs.h_tokens[runs[i].first + k] = tokens[static_cast<size_t>(runs[i].first + k)];
            rs.h_pos[runs[i].first + k] = seqs[i]->n_past_ + k;
        }
    ck(cudaMemcpyAsync(rs.tokens, rs.h_tokens, static_cast<size_t>(n) * sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading tokens");
    ck(cudaMemcpyAsync(rs.pos, rs.h_pos, static_cast<size_t>(n) * sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading positions");
    auto it = std::find_if(rs.graphs.begin(), rs.graphs.end(), [&](const auto &g) { return g.first == key; });
    bool graph = p.use_graph;
    if (graph && it == rs.graphs.end()) {  // first sight: eager (and remembered); second: captured
        const auto s = std::find(rs.seen.begin(), rs.seen.end(), key);
        if (s == rs.seen.end()) {
            graph = false;
            if (rs.seen.size() >= row_scratch::kMaxSeen) rs.seen.erase(rs.seen.begin());
            rs.seen.push_back(key);
        } else {
            rs.seen.erase(s);
        }
    }
    if (graph) {
        if (it == rs.graphs.end()) {
            cudaGraph_t g = nullptr;
            ck(cudaStreamBeginCapture(p.s, cudaStreamCaptureModeThreadLocal), "beginning graph capture");
            try {
                p.enqueue_rows(runs, n);
            } catch (...) {
                cudaStreamEndCapture(p.s, &g);
                if (g) cudaGraphDestroy(g);
                throw;
            }
            ck(cudaStreamEndCapture(p.s, &g), "ending graph capture");
            cudaGraphExec_t gx = nullptr;
            const cudaError_t e = cudaGraphInstantiate(&gx, g, 0);
            cudaGraphDestroy(g);
            ck(e, "instantiating the multi-row graph");
            if (rs.graphs.size() >= row_scratch::kMaxGraphs) {
                cudaGraphExecDestroy(rs.graphs.front().second);
                rs.graphs.erase(rs.graphs.begin());
            }
            rs.graphs.emplace_back(key, gx);
            it = rs.graphs.end() - 1;
        }
        ck(cudaGraphLaunch(it->second, p.s), "launching the multi-row graph");
        ++seqs[0]->replays_;
    } else {
        p.enqueue_rows(runs, n);
    }
    if (!logits.empty())
        ck(cudaMemcpyAsync(logits.data(), rs.logits, static_cast<size_t>(n) * V * sizeof(float), cudaMemcpyDeviceToHost, p.s),
           "downloading logits");
    if (!hc_out.empty())
        ck(cudaMemcpyAsync(hc_out.data(), rs.x[0], static_cast<size_t>(n) * S * sizeof(float), cudaMemcpyDeviceToHost, p.s),
           "downloading the state");
    if (!features.empty())
        ck(cudaMemcpyAsync(features.data(), p.feat, features.size() * sizeof(float), cudaMemcpyDeviceToHost, p.s),
           "downloading features");
    // each sequence's last row's logits are its last logits (last_logits, logits_top); a sequence of several
    // rows keeps them all (row_top: a verification sampled on the device; ~2 us for 5 rows)
    for (const impl::row_run &r : runs) {
        ck(cudaMemcpyAsync(r.seq->logits, rs.logits + static_cast<size_t>(r.first + r.count - 1) * V, V * sizeof(float),
                           cudaMemcpyDeviceToDevice, p.s),
           "keeping the last logits");
        if (r.count < 2) continue;
        if (!r.seq->rows_logits) r.seq->rows_logits = r.seq->dev<float>(static_cast<size_t>(cd::gemv_max_rows) * V);
        ck(cudaMemcpyAsync(r.seq->rows_logits, rs.logits + static_cast<size_t>(r.first) * V,
                           static_cast<size_t>(r.count) * V * sizeof(float), cudaMemcpyDeviceToDevice, p.s),
           "keeping the rows' logits");
    }
    ck(cudaStreamSynchronize(p.s), "multi-row step");
    if (*p.err_h != 0) {
        const uint32_t e = *p.err_h;
        for (cuda_sequence *q : seqs) q->reset();
        char b[16];
        std::snprintf(b, sizeof b, "%x", e);
        throw error("cuda ds4: device-side error 0x" + std::string(b) +
                    " in a multi-row step (bad token/expert id or a row index past its buffer); its sequences were reset");
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
        cuda_sequence &q = *seqs[i];
        q.n_past_ += counts[i];
        q.reached_ = std::max(q.reached_, q.n_past_);
        q.have_logits_ = true;
        q.rows_held_ = counts[i];
    }
}


// ---- multi-row steps ---------------------------------------------------------------------------------
// n rows of this sequence (positions n_past .. n_past + n - 1: a verification) in one forward with the
// decode step's numerics: every row's logits bit-identical to its own decode step. The dense products
// read each weight once for all rows (ds4_gemv.h's columns form); the per-row stages run the decode
// launchers row by row (HC, indexer, attention, MoE) or their chunk forms where those are bit-identical
// to them (RoPE'd query heads, compressors: ds4_prefill.h). The chains of different sequences (KV rows,
// compressors, query heads, indexer) and of different rows (attention) run on parallel lanes (row_scratch::
// lane), so a step of 16 sequences is not 16 chains of small kernels one after another. Causality among the rows: every row's KV row
// enters the ring and every compressor step runs (in row order) before any row attends, and a row reads
// only positions <= its own (window span, compressed and indexer row counts from its position; the ring
// and frontier slack of ds4::max_rollback keeps rows of later positions from landing on them).

row_scratch::~row_scratch() {
    cudaSetDevice(device);
    for (auto &g : graphs) cudaGraphExecDestroy(g.second);
    for (lane &ln : lanes) {
        if (ln.done) cudaEventDestroy(ln.done);
        if (ln.ready) cudaEventDestroy(ln.ready);
        if (ln.s) cudaStreamDestroy(ln.s);
    }
    if (fork) cudaEventDestroy(fork);
    if (queries) cudaEventDestroy(queries);
    if (h_tokens) cudaFreeHost(h_tokens);
    if (h_pos) cudaFreeHost(h_pos);
    free_all();
}

namespace {

// A multi-row scratch for the weights w and sequences needing score / part floats (lanes: ensure_lanes).
std::unique_ptr<row_scratch> make_row_scratch(const cuda_weights &w, size_t score_floats, size_t part_floats) {
    const hparams &hp = w.hp;
    auto r = std::make_unique<row_scratch>(w.device, &w, score_floats, part_floats);
    const size_t n = static_cast<size_t>(cd::gemv_max_rows), D = static_cast<size_t>(hp.n_embd),
                 d = static_cast<size_t>(hp.head_dim), Id = static_cast<size_t>(hp.idx_dim), nh = static_cast<size_t>(hp.n_hc);
    r->cap = cd::gemv_max_rows;
    r->tokens = r->dev<int32_t>(n);
    r->pos = r->dev<int64_t>(n);
    r->amax = r->dev<int32_t>(n);
    ck(cudaHostAlloc(reinterpret_cast<void **>(&r->h_tokens), n * sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&r->h_pos), n * sizeof(int64_t), cudaHostAllocDefault), "pinned memory");
    r->x[0] = r->dev<float>(n * nh * D);
    r->x[1] = r->dev<float>(n * nh * D);
    r->xn = r->dev<float>(n * D);
    r->post = r->dev<float>(n * nh);
    r->comb = r->dev<float>(n * nh * nh);
    r->q_lat = r->dev<float>(n * static_cast<size_t>(hp.q_lora));
    r->q = r->dev<float>(n * static_cast<size_t>(hp.n_head) * d);
    r->kvrow = r->dev<float>(n * d);
    r->ca = r->dev<float>(n * 2 * d);
    r->cg = r->dev<float>(n * 2 * d);
    r->iq = r->dev<float>(n * static_cast<size_t>(std::max(hp.idx_head, 1)) * Id);
    r->iw = r->dev<float>(n * static_cast<size_t>(std::max(hp.idx_head, 1)));
    r->ica = r->dev<float>(n * 2 * Id);
    r->icg = r->dev<float>(n * 2 * Id);
    r->o = r->dev<float>(n * static_cast<size_t>(hp.n_head) * d);
    r->z = r->dev<float>(n * static_cast<size_t>(hp.o_groups * hp.o_rank));
    r->y = r->dev<float>(n * D);
    r->zh = r->dev<float>(n * D);
    r->logits = r->dev<float>(n * static_cast<size_t>(hp.n_vocab));
    {
        const size_t E = static_cast<size_t>(hp.n_expert), k = static_cast<size_t>(hp.n_expert_used),
                     F = static_cast<size_t>(hp.n_ff_exp);
        r->moe.logits = r->dev<float>(n * E);
        r->moe.ids = r->dev<int32_t>(n * k);
        r->moe.weights = r->dev<float>(n * k);
        r->moe.h = r->dev<float>(n * (k + 1) * F);
        r->moe.xq = r->dev<uint8_t>(cd::moe_rows_q8_bytes(static_cast<int64_t>(n), static_cast<int64_t>(D)));
        r->moe.hq = r->dev<uint8_t>(cd::moe_rows_q8_bytes(static_cast<int64_t>(n * (k + 1)), static_cast<int64_t>(F)));
    }
    r->hc_mix = r->dev<float>(n * cd::hc_rows_mix_floats(hp.n_hc));
    r->hc_sync = r->dev<uint32_t>(n);
    r->hc_part = r->dev<double>(n * cd::hc_fused_part_count(hp.n_hc));
    r->sel = r->dev<int32_t>(n * static_cast<size_t>(std::max(hp.idx_topk, 1)));
    r->n_sel = r->dev<int32_t>(n);
    ck(cudaEventCreateWithFlags(&r->fork, cudaEventDisableTiming), "creating an event");
    ck(cudaEventCreateWithFlags(&r->queries, cudaEventDisableTiming), "creating an event");
    return r;
}

}  // namespace

void row_scratch::ensure_lanes(int n, const hparams &hp) {
    for (; n_lanes < n; ++n_lanes) {
        lane &ln = lanes[n_lanes];
        ck(cudaStreamCreateWithFlags(&ln.s, cudaStreamNonBlocking), "creating a stream");
        ck(cudaEventCreateWithFlags(&ln.done, cudaEventDisableTiming), "creating an event");
        ck(cudaEventCreateWithFlags(&ln.ready, cudaEventDisableTiming), "creating an event");
        ln.part = dev<float>(part_floats);
        ln.score = dev<float>(row_scratch::kIdxRows * score_floats);
        ln.moe.logits = dev<float>(static_cast<size_t>(hp.n_expert));
        ln.moe.ids = dev<int32_t>(static_cast<size_t>(hp.n_expert_used));
        ln.moe.weights = dev<float>(static_cast<size_t>(hp.n_expert_used));
        ln.moe.h = dev<float>(static_cast<size_t>((hp.n_expert_used + 1) * hp.n_ff_exp));
    }
}

void cuda_sequence::impl::take_rows() {
    if (rs) return;  // a sequence without a pool keeps its own
    if (pool) {
        std::lock_guard<std::mutex> lk(pool->mu);
        const row_scratch *q = pool->rows.get();
        if (q && q->weights == w.get() && q->score_floats >= score_floats && q->part_floats >= part_floats)
            rs = std::move(pool->rows);
    }
    // (a pool's scratch too small for this sequence is replaced by this one when it goes back)
    if (!rs) rs = make_row_scratch(*w, std::max(score_floats, size_t{1}), std::max(part_floats, size_t{1}));
}

void cuda_sequence::impl::give_back_rows() noexcept {
    if (!pool || !rs) return;
    cudaStreamSynchronize(s);  // the step's work on the scratch is done before another sequence's starts
    try {
        std::lock_guard<std::mutex> lk(pool->mu);
        const row_scratch *q = pool->rows.get();
        if (!q || (rs->score_floats >= q->score_floats && rs->part_floats >= q->part_floats)) pool->rows = std::move(rs);
    } catch (...) {
    }
    rs.reset();  // freed when the pool keeps a larger one (or the lock failed)
}

namespace {

class rows_exec final : public executor {
  public:
    using row_run = cuda_sequence::impl::row_run;
    // p: the step's host sequence (its stream, error word, shared scratch and row scratch); runs: the
    // rows of each sequence, in row order, n rows in all.
    rows_exec(cuda_sequence::impl &p, std::span<const row_run> runs, int n)
        : p_(p), runs_(runs), w_(*p.w), r_(*p.rs), n_(n), hp_(w_.hp), hcp_{hp_.n_hc, hp_.n_embd, hp_.sinkhorn_iters, hp_.hc_eps, hp_.rms_eps},
          D_(hp_.n_embd), S_(static_cast<int64_t>(hp_.n_hc) * hp_.n_embd),
          L_(std::min(n, row_scratch::kLanes)) {
        ck(cudaMemsetAsync(r_.hc_sync, 0, static_cast<size_t>(n) * sizeof(uint32_t), p.s), "clearing the hc counters");
    }
    ~rows_exec() { join(std::nothrow); }  // an error mid-step must not leave a lane unjoined (graph capture)
    void embed() override {
        join();
        for (int k = 0; k < hp_.n_hc; ++k)
            cuda::launch_get_rows(w_.tok_embd.type, w_.tok_embd.p, w_.tok_embd.row_bytes, D_, hp_.n_vocab, r_.tokens, n_,
                                  r_.x[0] + k * D_, S_, p_.err_d, p_.s);
    }
    // Every row's HC mixer in one launch (launch_hc_pre_fused_rows: each row's bits as its decode step's).
    void hc_pre(int il, sublayer which) override {
        const dlayer &l = layer(il);
        const bool attn = which == sublayer::attention;
        const dhc &h = attn ? l.hc_attn : l.hc_ffn;
        join();
        cd::launch_hc_pre_fused_rows(hcp_, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale,
                                     io(attn ? l.attn_norm : l.ffn_norm, r_.xn), n_, p_.s);
        flip();
        capture();
    }
    void attention(int il) override;
    // Every row's MoE in one chain on the step's stream (launch_moe_ffn_rows: the shared expert and the
    // experts several rows chose read about once), else the decode chain per row on its lane.
    void moe(int il) override {
        const dlayer &l = layer(il);
        if (cd::moe_rows_supported(l.moe)) {
            join();
            cd::launch_moe_ffn_rows(l.moe, n_, r_.xn, D_, r_.tokens, r_.moe, r_.y, D_, p_.err_d, p_.s);
            return;
        }
        fork();
        for (int r = 0; r < n_; ++r)
            cd::launch_moe_ffn(l.moe, r_.xn + r * D_, r_.tokens + r, lane(r).moe, r_.y + r * D_, p_.err_d, lane(r).s);
    }
    void hc_post() override { pending_ = true; }
    void head() override {
        const dhc &h = w_.hc_head;
        join();
        cd::launch_hc_head_fused_rows(hcp_, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale, io(w_.output_norm, r_.zh),
                                      n_, p_.s);
        flip();
        capture();
        if (w_.output.fast)
            cd::launch_gemv_rows(w_.output.fw, n_, r_.zh, D_, r_.logits, p_.s);
        else
            for (int r = 0; r < n_; ++r) gemv(w_.output, r_.zh + r * D_, r_.logits + r * hp_.n_vocab, p_.s);
        cd::launch_argmax_rows(r_.logits, hp_.n_vocab, n_, hp_.n_vocab, r_.amax, p_.s);
    }

    // The lanes (row_scratch::lanes): fork() starts every lane after what the step's stream has enqueued,
    // join() makes the stream wait for every lane. A plain kernel follows each wait, so no PDL launch (its
    // programmatic edge is to the previous kernel of its own stream) directly follows a cross-stream wait.
    void fork() {
        if (forked_) return;
        ck(cudaEventRecord(r_.fork, p_.s), "forking the rows");
        for (int k = 0; k < L_; ++k) {
            ck(cudaStreamWaitEvent(r_.lanes[k].s, r_.fork, 0), "forking the rows");
            cd::launch_gpu_sleep(0, r_.lanes[k].s);
        }
        forked_ = true;
    }
    void join() {
        if (!forked_) return;
        for (int k = 0; k < L_; ++k) {
            ck(cudaEventRecord(r_.lanes[k].done, r_.lanes[k].s), "joining the rows");
            ck(cudaStreamWaitEvent(p_.s, r_.lanes[k].done, 0), "joining the rows");
        }
        cd::launch_gpu_sleep(0, p_.s);
        forked_ = false;
    }
    void join(std::nothrow_t) noexcept {
        if (!forked_) return;
        for (int k = 0; k < L_; ++k)
            if (cudaEventRecord(r_.lanes[k].done, r_.lanes[k].s) == cudaSuccess) cudaStreamWaitEvent(p_.s, r_.lanes[k].done, 0);
        forked_ = false;
    }
    row_scratch::lane &lane(int r) const { return r_.lanes[r % L_]; }
    // DSpark features of every row (the step's first sequence's set_feature_layers, into its feat): the
    // state after block il is whole once the next fused launch has folded its HCPost in.
    void after_block(int il) { cap_ = p_.feat_slot(il); }

  private:
    void capture() {
        if (cap_ < 0) return;
        cd::launch_hc_stream_mean(hp_.n_hc, D_, n_, r_.x[cur_], p_.feat + cap_ * D_, p_.feat_floats(), p_.s);
        cap_ = -1;
    }
    const dlayer &layer(int il) const { return w_.layers[static_cast<size_t>(il - w_.first)]; }
    // The fused-HC arguments of all rows (row r at its offsets: launch_hc_*_fused_rows); flip() then
    // moves every row on.
    cd::hc_fused_io io(const float *norm, float *out) const {
        cd::hc_fused_io o;
        o.y = pending_ ? r_.y : nullptr;
        o.x = r_.x[cur_];
        o.x_new = pending_ ? r_.x[1 - cur_] : nullptr;
        o.post = r_.post, o.comb = r_.comb;
        o.mix = r_.hc_mix, o.sync = r_.hc_sync;
        o.norm = norm, o.out = out;
        o.part = r_.hc_part;
        return o;
    }
    void flip() {
        if (pending_) cur_ = 1 - cur_;
        pending_ = false;
    }
    cuda_sequence::impl &p_;
    std::span<const row_run> runs_;
    const cuda_weights &w_;
    row_scratch &r_;
    const int n_;
    const hparams &hp_;
    const cd::hc_params hcp_;
    const int64_t D_, S_;
    const int L_;  // lanes in use: min(rows, kLanes)
    int cur_ = 0, cap_ = -1;
    bool pending_ = false, forked_ = false;
};

void rows_exec::attention(int il) {
    const dlayer &l = layer(il);
    const size_t li = static_cast<size_t>(il - w_.first);
    const qat_mode qat = w_.opt.qat;
    const int64_t d = hp_.head_dim, Id = hp_.idx_dim, H = hp_.n_head, IH = hp_.idx_head;
    const bool f16 = p_.kv_elem == 2, idx = l.ratio == 4;
    const cd::rope_args rope{l.ratio > 0 ? w_.rope_yarn : w_.rope_plain, hp_.n_rot};
    const cd::rope_args yarn{w_.rope_yarn, hp_.n_rot};
    const cudaStream_t s = p_.s;
    join();  // every row's xn
    // projections of every row's xn
    if (idx)
        gemv_multi_rows({{&l.q_a, r_.q_lat}, {&l.kv, r_.kvrow}, {&l.comp.kv, r_.ca}, {&l.comp.gate, r_.cg}, {&l.idx_proj, r_.iw},
                         {&l.idx_comp.kv, r_.ica}, {&l.idx_comp.gate, r_.icg}},
                        n_, r_.xn, D_, s);
    else if (l.ratio > 0)
        gemv_multi_rows({{&l.q_a, r_.q_lat}, {&l.kv, r_.kvrow}, {&l.comp.kv, r_.ca}, {&l.comp.gate, r_.cg}}, n_, r_.xn, D_, s);
    else
        gemv_multi_rows({{&l.q_a, r_.q_lat}, {&l.kv, r_.kvrow}}, n_, r_.xn, D_, s);
    // Each sequence on the lane of its first row (its chain depends on nothing of the other sequences'):
    // every row's KV row into its sequence's ring, the sequence's compressors over its rows (= its steps,
    // bit for bit), while the step's stream projects the queries.
    fork();
    const cd::qat_kind kvq = qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none;
    const cd::qat_kind iqk = qat != qat_mode::off ? cd::qat_kind::hadamard_fp4 : cd::qat_kind::none;
    const int64_t cw = (idx ? 2 : 1) * d;
    for (const row_run &run : runs_) {
        layer_state_dev &st = run.seq->ls[li];
        const int f = run.first;
        const cudaStream_t ls = lane(f).s;
        for (int r = f; r < f + run.count; ++r)
            cd::launch_kv_finish_store(r_.kvrow + r * d, static_cast<int>(d), l.kv_norm, hp_.rms_eps, rope, kvq, st.ring, f16,
                                       static_cast<size_t>(d) * p_.kv_elem, ring_rows(hp_), r_.pos + r, ls);
        if (l.ratio > 0)
            cd::launch_compressor_chunk(comp_args(hp_, l.comp, yarn, kvq, st.comp_kv, st.comp_score, st.comp_rows, f16,
                                                  st.comp_stride, st.max_comp),
                                        r_.ca + f * cw, r_.cg + f * cw, run.count, r_.pos + f, p_.err_d, ls);
        if (idx)
            cd::launch_compressor_chunk(comp_args(hp_, l.idx_comp, yarn, iqk, st.ic_kv, st.ic_score, st.idx_rows, f16,
                                                  st.idx_stride, st.max_comp),
                                        r_.ica + f * 2 * Id, r_.icg + f * 2 * Id, run.count, r_.pos + f, p_.err_d, ls);
    }
    // queries (RMSNorm(q_lat) folded into q_b's staging as in the step) on the step's stream
    if (idx)
        gemv_multi_rows({{&l.q_b, r_.q}, {&l.idx_q_b, r_.iq}}, n_, r_.q_lat, hp_.q_lora, s, l.q_a_norm, hp_.rms_eps, hp_.q_lora);
    else
        gemv_multi_rows({{&l.q_b, r_.q}}, n_, r_.q_lat, hp_.q_lora, s, l.q_a_norm, hp_.rms_eps, hp_.q_lora);
    ck(cudaEventRecord(r_.queries, s), "recording the queries");
    // per sequence on its lane, once the queries are there: its heads normed and RoPE'd, its rows' indexer
    // selection (each row's own, one batched launch; positions are consecutive within a run)
    const float iscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Id) * hp_.idx_head));
    const int64_t K = hp_.idx_topk;
    for (const row_run &run : runs_) {
        const layer_state_dev &st = run.seq->ls[li];
        const int f = run.first;
        const auto &ln = lane(f);
        ck(cudaStreamWaitEvent(ln.s, r_.queries, 0), "waiting for the queries");
        cd::launch_gpu_sleep(0, ln.s);  // a plain kernel after the wait (no PDL edge across streams)
        cd::launch_head_norm_rope_batch(r_.q + f * H * d, run.count, hp_.n_head, static_cast<int>(d), true, hp_.rms_eps, rope,
                                        cd::qat_kind::none, r_.pos + f, ln.s);
        if (idx) {
            cd::launch_head_norm_rope_batch(r_.iq + f * IH * Id, run.count, hp_.idx_head, static_cast<int>(Id), false, hp_.rms_eps,
                                            yarn, iqk, r_.pos + f, ln.s);
            cd::launch_indexer_topk_batch(r_.iq + f * IH * Id, r_.iw + f * IH, iscale, st.idx_rows, f16, st.idx_stride, 4,
                                          st.max_comp, hp_.idx_head, static_cast<int>(Id), hp_.idx_topk, run.count, r_.pos + f,
                                          ln.score, row_scratch::kIdxRows * p_.score_floats,
                                          r_.sel + f * K, r_.n_sel + f, ln.s, w_.opt.exact_indexer);
        }
        if (run.count > 1) ck(cudaEventRecord(ln.ready, ln.s), "recording the selections");
    }
    // per row, on its lane: its attention (the decode launcher at its position); a row on another lane
    // than its sequence's first waits for that lane's selections
    cd::sparse_attn_args a;
    a.n_head = hp_.n_head;
    a.d = static_cast<int>(d);
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    a.sinks = l.sinks;
    a.ring_f16 = f16;
    a.ring_stride = static_cast<size_t>(d) * p_.kv_elem;
    a.window = hp_.window;
    a.ring_rows = ring_rows(hp_);
    a.mode = l.ratio == 0 ? cd::comp_mode::none : idx ? cd::comp_mode::list : cd::comp_mode::all;
    a.comp_f16 = f16;
    a.comp_stride = static_cast<size_t>(d) * p_.kv_elem;
    a.ratio = l.ratio;
    a.rope = rope;
    for (const row_run &run : runs_) {
        const layer_state_dev &st = run.seq->ls[li];
        a.ring = st.ring;
        a.comp = st.comp_rows;
        a.comp_stride = st.comp_stride;
        a.max_comp = idx ? std::min<int64_t>(hp_.idx_topk, st.max_comp) : st.max_comp;
        const auto &home = lane(run.first);
        for (int r = run.first; r < run.first + run.count; ++r) {
            const auto &ln = lane(r);
            if (&ln != &home) {
                ck(cudaStreamWaitEvent(ln.s, home.ready, 0), "waiting for the selections");
                cd::launch_gpu_sleep(0, ln.s);
            }
            a.sel = r_.sel + r * K;
            a.n_sel = r_.n_sel + r;
            cd::launch_sparse_sink_attention(a, r_.q + r * H * d, r_.pos + r, ln.part, r_.o + r * H * d, ln.s);
        }
    }
    join();  // every row's attention output
    output_projection_rows(l, hp_, n_, r_.o, r_.z, r_.y, s);  // over all rows
}

}  // namespace

void cuda_sequence::impl::enqueue_rows(std::span<const row_run> runs, int n) {
    rows_exec ex(*this, runs, n);
    std::function<void(int)> after;
    if (!feat_layers.empty()) after = [&](int il) { ex.after_block(il); };
    run_forward(ex, w->hp.n_layer, w->first, w->last, true, true, after);
    ex.join();
}

}  // namespace fathom::ds4
