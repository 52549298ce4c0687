// The DSpark drafter on the CUDA device (deepseek4_cuda_dspark.h): the upload of its stages and heads, the
// context rings fed by observe(), and the block as an executor of the DS4 forward (deepseek4_exec.h's
// run_forward over the stages) followed by the head, the Markov chain and the confidence head.
#include "models/cuda/deepseek4_cuda_dspark.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_kernels.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "models/cuda/deepseek4_cuda_impl.h"
#include "models/deepseek4_exec.h"
#include "models/deepseek4_impl.h"

namespace fathom::ds4 {

std::shared_ptr<const cuda_weights> cuda_upload_dspark(const model &target_model, const dspark_weights &dw,
                                                       std::shared_ptr<const cuda_weights> target) {
    if (!target || !target->embed() || !target->head() || target->mtp || target->dspark)
        throw error("cuda ds4: the DSpark drafter needs the whole target model on its device (embedding and output head)");
    const hparams &hp = dw.hp;
    const dspark_config &cfg = dw.cfg;
    if (cfg.block_size < 1 || cfg.block_size > cd::gemv_max_rows)
        throw error("cuda ds4: a DSpark block of " + std::to_string(cfg.block_size) + " rows (the CUDA drafter takes 1.." +
                    std::to_string(cd::gemv_max_rows) + ")");
    if (hp.n_embd != target->hp.n_embd || hp.n_vocab != target->hp.n_vocab || hp.n_hc != target->hp.n_hc)
        throw error("cuda ds4: the DSpark drafter does not match the target's geometry");
    if (hp.n_hc > 5 || hp.head_dim > 512 || hp.head_dim % 64 != 0)
        throw error("cuda ds4: DSpark geometry outside the CUDA kernels' limits (n_hc <= 5, head dim a multiple of 64 <= 512)");
    for (int il : cfg.target_layers)
        if (il < 0 || il >= target_model.hp.n_layer) throw error("cuda ds4: DSpark capture layer outside the target");
    ck(cudaSetDevice(target->device), "selecting the device");
    // The stages as a model of n_stages blocks (window-only, learned routing), for the type check and the
    // block upload; the drafter's HC head and norm, no embedding or output head of its own.
    model view;
    view.hp = hp;
    view.hp.n_layer = static_cast<int>(dw.stages.size());
    view.hp.n_nextn = 0;
    view.hp.n_hash_layer = 0;
    view.hp.compress_ratio.assign(dw.stages.size(), 0);
    view.hc_head = dw.hc_head;
    view.output_norm = dw.output_norm;
    view.layers = dw.stages;
    for (const layer_weights &l : dw.stages)
        if (l.ratio != 0 || l.hash) throw error("cuda ds4: DSpark stages must be window-only and learned-routed");
    check_weight_types(view, 0, view.hp.n_layer);
    for (const auto &[m, name] : {std::pair{&dw.fc, "dflash.fc"}, std::pair{&dw.markov_w1, "dflash.dspark.markov.w1"},
                                  std::pair{&dw.markov_w2, "dflash.dspark.markov.w2"}})
        if (!cuda::mm_supported(m->type))
            throw error(std::string("cuda ds4: the DSpark ") + name + " is " + std::string(dtype_name(m->type)) +
                        ", which has no CUDA GEMV");
    uint64_t total = 0;
    if (dw.file)
        for (const auto &t : dw.file->tensors()) total += t.nbytes;
    std::shared_ptr<cuda_weights> w = drafter_weights(target, view.hp, total, "the DSpark drafter");
    const int64_t replicate = dw.file ? dw.file->get_int("fathom.synth.replicate_rows", 0) : 0;
    const std::function<void(uint64_t, uint64_t)> no_progress;  // the uploader keeps a reference
    uploader u(*w, std::max<int64_t>(replicate, 0), total, no_progress);
    w->output_norm = u.vec(dw.output_norm);
    w->hc_head = {u.mat(dw.hc_head.fn), u.vec(dw.hc_head.base), u.vec(dw.hc_head.scale)};
    const rope_table rope = rope_plain(hp.rope_base, hp.n_rot);
    std::vector<float> neg(rope.freq.size()), zero(rope.freq.size(), 0.0f);
    for (size_t i = 0; i < neg.size(); ++i) neg[i] = -rope.freq[i];
    w->rope_plain = u.vec(rope.freq);
    auto parts = std::make_unique<cuda_weights::dspark_parts>();
    parts->rope_neg = u.vec(neg);
    parts->rope_zero = u.vec(zero);
    parts->cfg = cfg;
    parts->fc = u.mat(dw.fc, true);
    parts->hidden_norm = u.vec(dw.hidden_norm);
    parts->markov_w1 = u.mat(dw.markov_w1);
    parts->markov_w2 = u.mat(dw.markov_w2, true);
    parts->conf_w = u.vec(dw.conf_w);
    parts->conf_bias = dw.conf_bias;
    for (const layer_weights &l : dw.stages) w->layers.push_back(upload_layer(u, w->hp, l, nullptr));
    w->dspark = std::move(parts);
    ck(cudaDeviceSynchronize(), "finishing the upload");
    return w;
}

// ---- the drafter's device state ------------------------------------------------------------------------

struct cuda_dspark::impl : device_buffers {
    impl() : device_buffers("allocating DSpark state") {}
    std::shared_ptr<const cuda_weights> w;
    qat_mode qat = qat_mode::full;
    int64_t B = 0, W = 0, R = 0, F = 0, D = 0, S = 0, V = 0, d = 0;
    cudaStream_t s = nullptr;
    // Rings: per stage [R, d] f32, position p in row p mod R; ring_pos[row] = the position it holds (-1:
    // none or dropped).
    std::vector<float *> rings;
    std::vector<int64_t> ring_pos;
    // observe(): up to 16 context rows at once
    float *feat = nullptr, *fco = nullptr, *kvo = nullptr, *kvf = nullptr;
    // the block
    int32_t *ids = nullptr, *mk_in = nullptr, *amax = nullptr;
    int64_t *pos = nullptr;  // [0] the observed rows' first position, [1] S, [2] S + B - 1
    float *x[2] = {nullptr, nullptr};
    float *xn, *mix, *post, *comb, *q_lat, *q, *kvrow, *blk, *o, *z, *y, *part, *zh, *zn, *U, *C, *bias, *e, *cin, *conf;
    cd::moe_rows_scratch moe_rows;
    cd::moe_scratch moe;
    // pinned uploads / downloads
    int64_t *h_pos = nullptr;
    int32_t *h_ids = nullptr, *h_amax = nullptr, *h_mk = nullptr;
    float *h_conf = nullptr;
    uint32_t *err_h = nullptr, *err_d = nullptr;
    // The block is captured once per (context rows, teacher forcing) and replayed: the positions and ids
    // are read from device memory; the context length is the attention's window, a launch argument (it
    // is the full window but at the start of a sequence or after a hole). At most kMaxGraphs kept.
    struct graph {
        int64_t n_ctx = 0;
        bool forced = false;
        cudaGraphExec_t exec = nullptr;
    };
    static constexpr size_t kMaxGraphs = 8;
    std::vector<graph> graphs;

    ~impl() {
        if (w) cudaSetDevice(w->device);
        if (s) cudaStreamSynchronize(s);
        for (const graph &g : graphs) cudaGraphExecDestroy(g.exec);
        free_all();
        for (void *h : {static_cast<void *>(h_pos), static_cast<void *>(h_ids), static_cast<void *>(h_amax),
                        static_cast<void *>(h_mk), static_cast<void *>(h_conf), static_cast<void *>(err_h)})
            if (h) cudaFreeHost(h);
        if (s) cudaStreamDestroy(s);
    }
    const cuda_weights::dspark_parts &parts() const { return *w->dspark; }
    void check_error(const char *what) {
        const cudaError_t e = cudaStreamSynchronize(s);
        if (e != cudaSuccess) throw error(std::string("cuda ds4 dspark: ") + what + ": " + cudaGetErrorString(e));
        if (*err_h != 0) {
            char b[16];
            std::snprintf(b, sizeof b, "%x", *err_h);
            *err_h = 0;
            throw error("cuda ds4 dspark: device-side error 0x" + std::string(b) + " in " + what);
        }
    }
    void enqueue_block(int64_t n_ctx, bool forced);
    void launch_block(int64_t n_ctx, bool forced);
};

namespace {

// The block through the stages as an executor of the DS4 forward: B rows [seed, noise...] at positions
// S..S+B-1; HC mixers unfused (pre + RMSNorm, post applied at once, as a prefill chunk does), the stage's
// attention over its ring (context rows from observe, the block's own rows stored first). head() is the
// caller's (enqueue_block).
class dspark_exec final : public executor {
  public:
    dspark_exec(cuda_dspark::impl &p, int64_t n_ctx)
        : p_(p), w_(*p.w), hp_(w_.hp), hcp_{hp_.n_hc, hp_.n_embd, hp_.sinkhorn_iters, hp_.hc_eps, hp_.rms_eps},
          n_ctx_(n_ctx) {}
    void embed() override {
        for (int k = 0; k < hp_.n_hc; ++k)
            cuda::launch_get_rows(w_.tok_embd.type, w_.tok_embd.p, w_.tok_embd.row_bytes, p_.D, hp_.n_vocab, p_.ids,
                                  p_.B, p_.x[0] + k * p_.D, p_.S, p_.err_d, p_.s);
    }
    void hc_pre(int il, sublayer which) override {
        const dlayer &l = w_.layers[static_cast<size_t>(il)];
        const bool attn = which == sublayer::attention;
        const dhc &h = attn ? l.hc_attn : l.hc_ffn;
        cd::launch_hc_pre_batch(hcp_, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale, p_.x[cur_], p_.B, p_.mix, p_.xn,
                                p_.post, p_.comb, p_.s);
        cuda::launch_rms_norm(p_.xn, p_.D, attn ? l.attn_norm : l.ffn_norm, hp_.rms_eps, p_.D, p_.B, p_.xn, p_.D, p_.s);
    }
    void attention(int il) override;
    void moe(int il) override {
        const dlayer &l = w_.layers[static_cast<size_t>(il)];
        const int B = static_cast<int>(p_.B);
        if (cd::moe_rows_supported(l.moe)) {
            cd::launch_moe_ffn_rows(l.moe, B, p_.xn, p_.D, p_.ids, p_.moe_rows, p_.y, p_.D, p_.err_d, p_.s);
            return;
        }
        for (int j = 0; j < B; ++j)  // (learned routing: the token is not read)
            cd::launch_moe_ffn(l.moe, p_.xn + j * p_.D, p_.ids + j, p_.moe, p_.y + j * p_.D, p_.err_d, p_.s);
    }
    void hc_post() override {
        cd::launch_hc_post_batch(hp_.n_hc, p_.D, p_.B, p_.y, p_.x[cur_], p_.post, p_.comb, p_.x[1 - cur_], p_.s);
        cur_ = 1 - cur_;
    }
    void head() override {}
    const float *state() const { return p_.x[cur_]; }

  private:
    cuda_dspark::impl &p_;
    const cuda_weights &w_;
    const hparams &hp_;
    const cd::hc_params hcp_;
    const int64_t n_ctx_;
    int cur_ = 0;
};

// Stage il's attention (the CPU's stage_attention): queries of the block rows, their K/V rows into the
// ring at S + j, every row attending to the ring's positions S - n_ctx .. S + B - 1, inverse RoPE at S + j,
// grouped output projection.
void dspark_exec::attention(int il) {
    const dlayer &l = w_.layers[static_cast<size_t>(il)];
    const cuda_weights::dspark_parts &dp = p_.parts();
    const int64_t d = p_.d, H = hp_.n_head, D = p_.D;
    const int B = static_cast<int>(p_.B);
    const cudaStream_t s = p_.s;
    const cd::rope_args rope{w_.rope_plain, hp_.n_rot};
    const cd::qat_kind kvq = p_.qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none;
    gemv_multi_rows({{&l.q_a, p_.q_lat}, {&l.kv, p_.kvrow}}, B, p_.xn, D, s);
    cd::launch_kv_finish_batch(p_.kvrow, B, static_cast<int>(d), l.kv_norm, hp_.rms_eps, rope, kvq, p_.blk, false,
                               static_cast<size_t>(d) * sizeof(float), p_.pos + 1, s);
    float *ring = p_.rings[static_cast<size_t>(il)];
    cd::launch_ring_store_tail(p_.blk, static_cast<size_t>(d) * sizeof(float), B, static_cast<int>(d), 4, ring,
                               static_cast<size_t>(d) * sizeof(float), static_cast<int>(p_.R), p_.pos + 1, s);
    gemv_multi_rows({{&l.q_b, p_.q}}, B, p_.q_lat, hp_.q_lora, s, l.q_a_norm, hp_.rms_eps, hp_.q_lora);
    cd::launch_head_norm_rope_batch(p_.q, B, hp_.n_head, static_cast<int>(d), true, hp_.rms_eps, rope, cd::qat_kind::none,
                                    p_.pos + 1, s);
    cd::sparse_attn_args a;
    a.n_head = hp_.n_head;
    a.d = static_cast<int>(d);
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    a.sinks = l.sinks;
    a.ring = ring;
    a.ring_f16 = false;
    a.ring_stride = static_cast<size_t>(d) * sizeof(float);
    a.window = static_cast<int>(n_ctx_ + p_.B);  // positions S - n_ctx .. S + B - 1 for every row
    a.ring_rows = static_cast<int>(p_.R);
    a.mode = cd::comp_mode::none;
    a.rope = {dp.rope_zero, hp_.n_rot};  // no rotation here: each row's own inverse RoPE below
    for (int j = 0; j < B; ++j) cd::launch_sparse_sink_attention(a, p_.q + j * H * d, p_.pos + 2, p_.part, p_.o + j * H * d, s);
    cd::launch_head_norm_rope_batch(p_.o, B, hp_.n_head, static_cast<int>(d), false, hp_.rms_eps, {dp.rope_neg, hp_.n_rot},
                                    cd::qat_kind::none, p_.pos + 1, s);
    output_projection_rows(l, hp_, B, p_.o, p_.z, p_.y, s);
}

}  // namespace

// The stages, then per row: HC head (z pre-norm), the final norm, the target's output head (U), and the
// Markov chain left to right: e_j = W1[x_j], C_j = U_j + W2 e_j, x_(j+1) = argmax C_j (greedy: copied into
// the next row's input), confidence logit w_conf . [z_j, e_j].
void cuda_dspark::impl::enqueue_block(int64_t n_ctx, bool forced) {
    const hparams &hp = w->hp;
    const cuda_weights::dspark_parts &dp = parts();
    const int64_t r = dp.cfg.markov_rank;
    dspark_exec ex(*this, n_ctx);
    run_forward(ex, hp.n_layer, 0, hp.n_layer, true, false);
    const cd::hc_params hcp{hp.n_hc, D, hp.sinkhorn_iters, hp.hc_eps, hp.rms_eps};
    const dhc &h = w->hc_head;
    for (int64_t j = 0; j < B; ++j)
        cd::launch_hc_head(hcp, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale, ex.state() + j * S, mix, zh + j * D, s);
    cuda::launch_rms_norm(zh, D, w->output_norm, hp.rms_eps, D, B, zn, D, s);
    if (w->output.fast)
        cd::launch_gemv_rows(w->output.fw, static_cast<int>(B), zn, D, U, s);
    else
        for (int64_t j = 0; j < B; ++j) gemv(w->output, zn + j * D, U + j * V, s);
    const dmat &w1 = dp.markov_w1;
    for (int64_t j = 0; j < B; ++j) {
        float *ej = e + j * r, *cj = C + j * V;
        cuda::launch_get_rows(w1.type, w1.p, w1.row_bytes, r, V, mk_in + j, 1, ej, r, err_d, s);
        gemv(dp.markov_w2, ej, bias, s);
        cuda::launch_elementwise(cuda::ew_op::add, U + j * V, V, bias, V, cj, V, V, 1, 0.0f, s);
        cd::launch_argmax(cj, V, amax + j, s);
        if (!forced && j + 1 < B)
            ck(cudaMemcpyAsync(mk_in + j + 1, amax + j, sizeof(int32_t), cudaMemcpyDeviceToDevice, s), "chaining the draft");
        float *cinj = cin + j * (D + r);
        ck(cudaMemcpyAsync(cinj, zh + j * D, static_cast<size_t>(D) * sizeof(float), cudaMemcpyDeviceToDevice, s), "confidence input");
        ck(cudaMemcpyAsync(cinj + D, ej, static_cast<size_t>(r) * sizeof(float), cudaMemcpyDeviceToDevice, s), "confidence input");
        cuda::launch_gemv(dtype::f32, dp.conf_w, static_cast<size_t>(D + r) * sizeof(float), D + r, 1, cinj, D + r, 1, conf + j,
                          1, s);
    }
}

void cuda_dspark::impl::launch_block(int64_t n_ctx, bool forced) {
    auto it = std::find_if(graphs.begin(), graphs.end(), [&](const graph &g) { return g.n_ctx == n_ctx && g.forced == forced; });
    if (it == graphs.end()) {
        cudaGraph_t g = nullptr;
        ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "beginning graph capture");
        try {
            enqueue_block(n_ctx, forced);
        } catch (...) {
            cudaStreamEndCapture(s, &g);
            if (g) cudaGraphDestroy(g);
            throw;
        }
        ck(cudaStreamEndCapture(s, &g), "ending graph capture");
        cudaGraphExec_t x = nullptr;
        const cudaError_t e = cudaGraphInstantiate(&x, g, 0);
        cudaGraphDestroy(g);
        ck(e, "instantiating the DSpark graph");
        if (graphs.size() >= kMaxGraphs) {
            cudaGraphExecDestroy(graphs.front().exec);
            graphs.erase(graphs.begin());
        }
        graphs.push_back({n_ctx, forced, x});
        it = graphs.end() - 1;
    }
    ck(cudaGraphLaunch(it->exec, s), "launching the DSpark graph");
}

cuda_dspark::cuda_dspark(std::shared_ptr<const cuda_weights> w, qat_mode qat) : p_(std::make_unique<impl>()) {
    if (!w || !w->dspark) throw error("cuda ds4: no DSpark weights (cuda_upload_dspark)");
    impl &p = *p_;
    p.w = std::move(w);
    p.qat = qat;
    const hparams &hp = p.w->hp;
    const dspark_config &cfg = p.w->dspark->cfg;
    p.B = cfg.block_size;
    p.W = cfg.window;
    p.R = p.W + p.B + max_rollback + 1;
    p.D = hp.n_embd;
    p.S = static_cast<int64_t>(hp.n_hc) * p.D;
    p.V = hp.n_vocab;
    p.d = hp.head_dim;
    p.F = static_cast<int64_t>(cfg.target_layers.size()) * p.D;
    const size_t B = static_cast<size_t>(p.B), D = static_cast<size_t>(p.D), d = static_cast<size_t>(p.d),
                 V = static_cast<size_t>(p.V), r = static_cast<size_t>(cfg.markov_rank), nh = static_cast<size_t>(hp.n_hc),
                 n16 = static_cast<size_t>(cd::gemv_max_rows);
    ck(cudaSetDevice(p.w->device), "selecting the device");
    ck(cudaStreamCreateWithFlags(&p.s, cudaStreamNonBlocking), "creating a stream");
    for (int k = 0; k < hp.n_layer; ++k) p.rings.push_back(p.dev<float>(static_cast<size_t>(p.R) * d));
    p.ring_pos.assign(static_cast<size_t>(p.R), -1);
    p.feat = p.dev<float>(n16 * static_cast<size_t>(p.F));
    p.fco = p.dev<float>(n16 * D);
    p.kvo = p.dev<float>(n16 * d);
    p.kvf = p.dev<float>(n16 * d);
    p.ids = p.dev<int32_t>(B);
    p.mk_in = p.dev<int32_t>(B);
    p.amax = p.dev<int32_t>(B);
    p.pos = p.dev<int64_t>(3);
    p.x[0] = p.dev<float>(B * nh * D);
    p.x[1] = p.dev<float>(B * nh * D);
    p.xn = p.dev<float>(B * D);
    p.mix = p.dev<float>(B * static_cast<size_t>((2 + hp.n_hc) * hp.n_hc + 1));
    p.post = p.dev<float>(B * nh);
    p.comb = p.dev<float>(B * nh * nh);
    p.q_lat = p.dev<float>(B * static_cast<size_t>(hp.q_lora));
    p.q = p.dev<float>(B * static_cast<size_t>(hp.n_head) * d);
    p.kvrow = p.dev<float>(B * d);
    p.blk = p.dev<float>(B * d);
    p.o = p.dev<float>(B * static_cast<size_t>(hp.n_head) * d);
    p.z = p.dev<float>(B * static_cast<size_t>(hp.o_groups * hp.o_rank));
    p.y = p.dev<float>(B * D);
    cd::sparse_attn_args a;
    a.n_head = hp.n_head;
    a.d = hp.head_dim;
    a.window = static_cast<int>(p.W + p.B);
    a.ring_rows = static_cast<int>(p.R);
    a.mode = cd::comp_mode::none;
    p.part = p.dev<float>(cd::attn_part_floats(a));
    p.zh = p.dev<float>(B * D);
    p.zn = p.dev<float>(B * D);
    p.U = p.dev<float>(B * V);
    p.C = p.dev<float>(B * V);
    p.bias = p.dev<float>(V);
    p.e = p.dev<float>(B * r);
    p.cin = p.dev<float>(B * (D + r));
    p.conf = p.dev<float>(B);
    const size_t E = static_cast<size_t>(hp.n_expert), k = static_cast<size_t>(hp.n_expert_used),
                 Ff = static_cast<size_t>(hp.n_ff_exp);
    p.moe_rows.logits = p.dev<float>(B * E);
    p.moe_rows.ids = p.dev<int32_t>(B * k);
    p.moe_rows.weights = p.dev<float>(B * k);
    p.moe_rows.h = p.dev<float>(B * (k + 1) * Ff);
    p.moe_rows.xq = p.dev<uint8_t>(cd::moe_rows_q8_bytes(p.B, p.D));
    p.moe_rows.hq = p.dev<uint8_t>(cd::moe_rows_q8_bytes(static_cast<int64_t>(B * (k + 1)), static_cast<int64_t>(Ff)));
    p.moe.logits = p.dev<float>(E);
    p.moe.ids = p.dev<int32_t>(k);
    p.moe.weights = p.dev<float>(k);
    p.moe.h = p.dev<float>((k + 1) * Ff);
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_pos), 3 * sizeof(int64_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_ids), B * sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_mk), B * sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_amax), B * sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_conf), B * sizeof(float), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.err_h), sizeof(uint32_t), cudaHostAllocMapped), "pinned memory");
    *p.err_h = 0;
    ck(cudaHostGetDevicePointer(reinterpret_cast<void **>(&p.err_d), p.err_h, 0), "mapping the error word");
}

cuda_dspark::~cuda_dspark() = default;

const dspark_config &cuda_dspark::config() const {
    return p_->parts().cfg;
}
int64_t cuda_dspark::feature_dim() const {
    return p_->F;
}

void cuda_dspark::reset() {
    std::fill(p_->ring_pos.begin(), p_->ring_pos.end(), -1);
}

void cuda_dspark::truncate(int64_t n) {
    for (int64_t &q : p_->ring_pos)
        if (q >= n) q = -1;
}

void cuda_dspark::observe(int64_t p0, std::span<const float> features) {
    impl &p = *p_;
    const int64_t n = static_cast<int64_t>(features.size()) / std::max<int64_t>(p.F, 1);
    if (p0 < 0 || n * p.F != static_cast<int64_t>(features.size()))
        throw error("cuda ds4 dspark: " + std::to_string(features.size()) + " feature floats at position " + std::to_string(p0) +
                    " are not whole rows of " + std::to_string(p.F));
    if (n == 0) return;
    ck(cudaSetDevice(p.w->device), "selecting the device");
    const hparams &hp = p.w->hp;
    const cuda_weights::dspark_parts &dp = p.parts();
    const cd::rope_args rope{p.w->rope_plain, hp.n_rot};
    const cd::qat_kind kvq = p.qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none;
    const size_t row = static_cast<size_t>(p.d) * sizeof(float);
    // Only the last `window` positions can be context of a later block.
    for (int64_t i0 = std::max<int64_t>(0, n - p.W); i0 < n; i0 += cd::gemv_max_rows) {
        const int m = static_cast<int>(std::min<int64_t>(n - i0, cd::gemv_max_rows));
        *p.h_pos = p0 + i0;
        ck(cudaMemcpyAsync(p.pos, p.h_pos, sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading the position");
        ck(cudaMemcpyAsync(p.feat, features.data() + i0 * p.F, static_cast<size_t>(m * p.F) * sizeof(float), cudaMemcpyHostToDevice,
                           p.s),
           "uploading features");
        // main_x = RMSNorm(W_fc . feat; hidden_norm), then each stage's K/V rows of it at their positions
        gemv_multi_rows({{&dp.fc, p.fco}}, m, p.feat, p.F, p.s);
        cuda::launch_rms_norm(p.fco, p.D, dp.hidden_norm, hp.rms_eps, p.D, m, p.fco, p.D, p.s);
        for (size_t k = 0; k < p.rings.size(); ++k) {
            const dlayer &l = p.w->layers[k];
            gemv_multi_rows({{&l.kv, p.kvo}}, m, p.fco, p.D, p.s);
            cd::launch_kv_finish_batch(p.kvo, m, static_cast<int>(p.d), l.kv_norm, hp.rms_eps, rope, kvq, p.kvf, false, row, p.pos,
                                       p.s);
            cd::launch_ring_store_tail(p.kvf, row, m, static_cast<int>(p.d), 4, p.rings[k], row, static_cast<int>(p.R), p.pos, p.s);
        }
        p.check_error("observing context rows");  // (the staging buffers are reused by the next rows)
        for (int i = 0; i < m; ++i) {
            const int64_t q = p0 + i0 + i;
            p.ring_pos[static_cast<size_t>(q % p.R)] = q;
        }
    }
}

dspark_block cuda_dspark::draft(int64_t S, int32_t seed_token, std::span<const int32_t> markov_inputs, bool with_logits) {
    impl &p = *p_;
    const dspark_config &cfg = p.parts().cfg;
    if (S < 0) throw error("cuda ds4 dspark: negative position");
    if (seed_token < 0 || seed_token >= p.V)
        throw error("cuda ds4 dspark: seed token " + std::to_string(seed_token) + " outside the vocabulary");
    if (!markov_inputs.empty() && static_cast<int64_t>(markov_inputs.size()) != p.B)
        throw error("cuda ds4 dspark: " + std::to_string(markov_inputs.size()) + " Markov inputs for a block of " +
                    std::to_string(p.B));
    for (int32_t t : markov_inputs)
        if (t < 0 || t >= p.V) throw error("cuda ds4 dspark: Markov input " + std::to_string(t) + " outside the vocabulary");
    auto held = [&](int64_t q) { return q >= 0 && p.ring_pos[static_cast<size_t>(q % p.R)] == q; };
    int64_t c0 = S;
    while (c0 > 0 && S - c0 < p.W && held(c0 - 1)) --c0;
    const int64_t n_ctx = S - c0;
    dspark_block b;
    b.seed_pos = S;
    for (int64_t c = c0; c < S; ++c) b.ctx_positions.push_back(c);
    b.input_ids.assign(static_cast<size_t>(p.B), cfg.noise_token);
    b.input_ids[0] = seed_token;
    const bool forced = !markov_inputs.empty();
    // the block's rows take ring rows S .. S + B - 1 (whatever positions those held are gone)
    for (int64_t j = 0; j < p.B; ++j) p.ring_pos[static_cast<size_t>((S + j) % p.R)] = -1;
    ck(cudaSetDevice(p.w->device), "selecting the device");
    std::copy(b.input_ids.begin(), b.input_ids.end(), p.h_ids);
    for (int64_t j = 0; j < p.B; ++j) p.h_mk[j] = forced ? markov_inputs[static_cast<size_t>(j)] : seed_token;
    p.h_pos[1] = S;
    p.h_pos[2] = S + p.B - 1;
    const size_t Bb = static_cast<size_t>(p.B);
    ck(cudaMemcpyAsync(p.ids, p.h_ids, Bb * sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading the block");
    ck(cudaMemcpyAsync(p.mk_in, p.h_mk, Bb * sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading the block");
    ck(cudaMemcpyAsync(p.pos + 1, p.h_pos + 1, 2 * sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading positions");
    p.launch_block(n_ctx, forced);
    ck(cudaMemcpyAsync(p.h_amax, p.amax, Bb * sizeof(int32_t), cudaMemcpyDeviceToHost, p.s), "downloading the draft");
    ck(cudaMemcpyAsync(p.h_mk, p.mk_in, Bb * sizeof(int32_t), cudaMemcpyDeviceToHost, p.s), "downloading the draft");
    ck(cudaMemcpyAsync(p.h_conf, p.conf, Bb * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading the confidences");
    if (with_logits) {
        const size_t BV = Bb * static_cast<size_t>(p.V);
        b.base_logits.resize(BV);
        b.corrected_logits.resize(BV);
        b.hc_head_out.resize(Bb * static_cast<size_t>(p.D));
        ck(cudaMemcpyAsync(b.base_logits.data(), p.U, BV * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading logits");
        ck(cudaMemcpyAsync(b.corrected_logits.data(), p.C, BV * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading logits");
        ck(cudaMemcpyAsync(b.hc_head_out.data(), p.zh, b.hc_head_out.size() * sizeof(float), cudaMemcpyDeviceToHost, p.s),
           "downloading the head's output");
    }
    p.check_error("a draft block");
    const float bias = p.parts().conf_bias;
    for (int64_t j = 0; j < p.B; ++j) {
        b.markov_prev.push_back(p.h_mk[j]);
        b.draft_tokens.push_back(p.h_amax[j]);
        const float c = p.h_conf[j] + bias;
        b.confidence_logit.push_back(c);
        b.confidence.push_back(sigmoid(c));
    }
    return b;
}

}  // namespace fathom::ds4
