// DS4 on one CUDA device (see deepseek4_cuda.h): weight upload, the sequence's device state, and the
// decode step as a chain of launches (ds4_kernels.h, ds4_attn_kernels.h, cuda_kernels.h) that reads
// the token id and position from device memory, captured once as a CUDA graph.
//
// Step, per layer (spec section 2; the CPU's block_forward for one token):
//   attention half: HCPre(X) -> u, post, comb; xn = RMSNorm(u)
//     q_lat = RMSNorm(W_qa xn); q = headnorm+RoPE(W_qb q_lat); kv = norm/RoPE/FP8(W_kv xn) -> ring
//     ratio > 0: compressor(W_ckv xn, W_cg xn) -> compressed row every R tokens
//     ratio 4  : indexer q (W_iqb q_lat, RoPE, Hadamard+FP4), weights W_ip xn, indexer compressor,
//                top-k of the indexer rows
//     o = sink attention(q; window rows + compressed rows), inverse RoPE; y = W_ob (W_oa grouped o)
//     X = HCPost(y, X)
//   MoE half: HCPre, RMSNorm, router + routed experts + shared expert, HCPost
// then HC head, RMSNorm, output head, device argmax. The KV row + compressor and the indexer run on
// two side streams beside the query path (event fork / join; parallel branches of the graph), unless
// cuda_testing::cuda_test_options::serial_step or profiling.
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_impl.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "backend/cuda/cuda_sample.h"
#include "core/error.h"
#include "core/state_io.h"
#include "gguf/gguf.h"
#include "models/deepseek4_exec.h"
#include "models/deepseek4_impl.h"

namespace fathom::ds4 {

namespace cd = cuda::ds4;



namespace cuda_impl {

double mat_bytes(const dmat &m) {
    return m.p || m.fast ? static_cast<double>(m.row_bytes) * static_cast<double>(m.rows) : 0.0;
}

// y = W x for one token: the fast decode GEMV when the weight has it, else the generic one.
void gemv(const dmat &m, const float *x, float *y, cudaStream_t s) {
    if (m.fast)
        cd::launch_gemv_fast(m.fw, x, y, s);
    else
        cuda::launch_gemv(m.type, m.p, m.row_bytes, m.cols, m.rows, x, m.cols, 1, y, m.rows, s);
}

// Several weights reading the same x: one launch when every one has the fast form. With norm_w, of
// RMSNorm(x) (n floats, eps): folded into the int8 GEMV's x staging when every weight has the fast form
// (ds4_gemv.h launch_gemv_multi_normed), else the norm in place first; x's contents afterwards: x or
// its normed values.
void gemv_multi(std::initializer_list<std::pair<const dmat *, float *>> mats, float *x, cudaStream_t s,
                const float *norm_w = nullptr, float eps = 0.0f, int64_t n = 0) {
    cd::gemv_segment seg[cd::gemv_max_segments];
    int k = 0;
    bool all_fast = mats.size() <= static_cast<size_t>(cd::gemv_max_segments);
    for (const auto &[m, y] : mats) all_fast = all_fast && m->fast;
    if (all_fast) {
        for (const auto &[m, y] : mats) seg[k++] = {m->fw, y};
        if (norm_w)
            cd::launch_gemv_multi_normed(seg, k, x, norm_w, eps, s);
        else
            cd::launch_gemv_multi(seg, k, x, s);
        return;
    }
    if (norm_w) cuda::launch_rms_norm(x, n, norm_w, eps, n, 1, x, n, s);
    for (const auto &[m, y] : mats) gemv(*m, x, y, s);
}
// The same over nx rows of x (x_stride floats apart; every y is [nx, its weight's rows]): one launch of the
// columns form when every weight has the fast form (each row's outputs bit-identical to its single-row
// launch, ds4_gemv.h), else the single-row path row by row.
void gemv_multi_rows(std::initializer_list<std::pair<const dmat *, float *>> mats, int nx, float *x, int64_t x_stride,
                     cudaStream_t s, const float *norm_w, float eps, int64_t n) {
    cd::gemv_segment seg[cd::gemv_max_segments];
    int k = 0;
    bool all_fast = mats.size() <= static_cast<size_t>(cd::gemv_max_segments);
    for (const auto &[m, y] : mats) all_fast = all_fast && m->fast;
    if (all_fast) {
        for (const auto &[m, y] : mats) seg[k++] = {m->fw, y};
        if (norm_w)
            cd::launch_gemv_multi_normed_rows(seg, k, nx, x, x_stride, norm_w, eps, s);
        else
            cd::launch_gemv_multi_rows(seg, k, nx, x, x_stride, s);
        return;
    }
    for (int r = 0; r < nx; ++r) {
        float *xr = x + r * x_stride;
        if (norm_w) cuda::launch_rms_norm(xr, n, norm_w, eps, n, 1, xr, n, s);
        for (const auto &[m, y] : mats) gemv(*m, xr, y + r * m->rows, s);
    }
}

// The prefill products' view of a weight (GGUF rows, or the repacked q8_0 of the fast form).
cd::gemm_weight gw(const dmat &m) {
    cd::gemm_weight g;
    g.type = m.type;
    g.p = m.p;
    g.row_bytes = m.row_bytes;
    g.fast = m.fast ? &m.fw : nullptr;
    g.rows = m.rows;
    g.cols = m.cols;
    return g;
}

// Float weights (f32 / f16 / bf16) are multiplied in f32: rounding their activations to bf16 would be
// the largest error of the model (~1e-2 relative, against ~1e-6 for an f32 file; the ds4-tiny golden
// tier is f32's). Quantised weights carry their own larger rounding, so bf16 operands cost nothing
// visible there (the CPU's quantised path rounds activations to q8 blocks likewise).
bool float_weight(dtype t) {
    return t == dtype::f32 || t == dtype::f16 || t == dtype::bf16;
}

// Products over a chunk: the prefill GEMM when it takes the weight's type and shape, else the decode
// GEMV token by token (small geometries such as the ds4-tiny golden, whose widths are not multiples
// of 32).
void chunk_matmul(cd::gemm_runner &g, const dmat &m, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                  cudaStream_t s, cd::gemm_precision prec = cd::gemm_precision::bf16) {
    if (float_weight(m.type)) prec = cd::gemm_precision::f32;
    if (cd::gemm_runner::supported(gw(m))) {
        g.matmul(gw(m), x, ldx, n, y, ldy, prec);
        return;
    }
    for (int64_t t = 0; t < n; ++t) gemv(m, x + t * ldx, y + t * ldy, s);
}
void chunk_matmul_grouped(cd::gemm_runner &g, const dmat &m, int64_t rows_per_group, int groups, const float *x,
                          int64_t ldx, int64_t n, float *y, int64_t ldy, cudaStream_t s) {
    if (cd::gemm_runner::supported(gw(m)) && !float_weight(m.type)) {  // (the grouped GEMM is bf16 only)
        g.matmul_grouped(gw(m), rows_per_group, x, ldx, n, y, ldy);
        return;
    }
    for (int64_t t = 0; t < n; ++t) {
        if (m.fast)
            cd::launch_gemv_fast_grouped(m.fw, rows_per_group, x + t * ldx, y + t * ldy, s);
        else
            cd::launch_gemv_grouped(m.type, m.p, m.row_bytes, m.cols, rows_per_group, groups, x + t * ldx, y + t * ldy, s);
    }
}

// Frontier rows of a compressor of this ratio (the CPU's new_layer_state: position-indexed, what a block
// reads plus ds4::max_rollback) and raw ring rows (the window plus max_rollback): the rows a rolled-back
// sequence reads again are still there (truncate).
int frontier_slots(int ratio) {
    return (ratio == 4 ? 2 * ratio : ratio) + static_cast<int>(max_rollback);
}
int ring_rows(const hparams &hp) {
    return hp.window + static_cast<int>(max_rollback);
}

// One compressor's launch arguments (decode step and chunk): its weights, the frontier state, the
// rows it emits (row_stride bytes apart, f16 or f32) and their capacity.
cd::compressor_args comp_args(const hparams &hp, const dcomp &c, const cd::rope_args &yarn, cd::qat_kind qk, float *skv,
                              float *sscore, void *rows, bool f16, size_t row_stride, int64_t max_rows) {
    cd::compressor_args a;
    a.ratio = c.ratio;
    a.dim = c.dim;
    a.slots = frontier_slots(c.ratio);
    a.ape = c.ape;
    a.norm_w = c.norm;
    a.eps = hp.rms_eps;
    a.rope = yarn;
    a.qat = qk;
    a.state_kv = skv;
    a.state_score = sscore;
    a.rows = rows;
    a.rows_f16 = f16;
    a.row_stride = row_stride;
    a.max_rows = max_rows;
    return a;
}

// Whether the chunked MoE (ds4_prefill.h moe_prefill, bf16 products) takes this model: widths multiples
// of 32 and quantised expert types its dequantiser knows; otherwise (float experts: see float_weight)
// chunks run the decode MoE token by token.
bool chunk_moe_supported(const hparams &hp, const std::vector<dlayer> &layers) {
    if (hp.n_embd % 32 != 0 || hp.n_ff_exp % 32 != 0 || hp.n_expert > 1024 || hp.n_expert_used > 32) return false;
    for (const dlayer &l : layers)
        for (const cd::expert_bank *b : {&l.moe.gate, &l.moe.up, &l.moe.down, &l.moe.gate_sh, &l.moe.up_sh, &l.moe.down_sh}) {
            if (!b->data) continue;
            if (float_weight(b->type)) return false;
            cd::gemm_weight w;
            w.type = b->type;
            w.p = b->data;
            w.row_bytes = b->row_bytes;
            w.rows = b->rows;
            w.cols = b->cols;
            if (!cd::gemm_runner::supported(w)) return false;
        }
    return true;
}

double hc_bytes(const dhc &h) {
    return mat_bytes(h.fn);
}

dlayer upload_layer(uploader &u, const hparams &hp, const layer_weights &l, const int32_t *tid2eid_dev) {
    dlayer d;
    d.ratio = l.ratio;
    d.attn_norm = u.vec(l.attn_norm);
    d.ffn_norm = u.vec(l.ffn_norm);
    d.hc_attn = {u.mat(l.hc_attn.fn), u.vec(l.hc_attn.base), u.vec(l.hc_attn.scale)};
    d.hc_ffn = {u.mat(l.hc_ffn.fn), u.vec(l.hc_ffn.base), u.vec(l.hc_ffn.scale)};
    d.q_a = u.mat(l.q_a, true);
    d.q_a_norm = u.vec(l.q_a_norm);
    d.q_b = u.mat(l.q_b, true);
    d.kv = u.mat(l.kv, true);
    d.kv_norm = u.vec(l.kv_norm);
    d.sinks = u.vec(l.sinks);
    d.out_a = u.mat(l.out_a, true);
    d.out_b = u.mat(l.out_b, true);
    auto comp = [&](const compressor_weights &c) {
        dcomp r;
        r.ratio = c.ratio;
        r.dim = c.dim;
        r.kv = u.mat(c.kv, true);
        r.gate = u.mat(c.gate, true);
        r.ape = u.vec(c.ape);
        r.norm = u.vec(c.norm);
        return r;
    };
    if (l.ratio > 0) d.comp = comp(l.comp);
    if (l.ratio == 4) {
        d.idx_q_b = u.mat(l.idx_q_b, true);
        d.idx_proj = u.mat(l.idx_proj, true);
        d.idx_comp = comp(l.idx_comp);
    }
    cd::moe_layer &m = d.moe;
    const dmat gi = u.mat(l.gate_inp);
    m.gate_inp_type = gi.type;
    m.gate_inp = gi.p;
    m.gate_inp_row_bytes = gi.row_bytes;
    m.exp_bias = l.hash ? nullptr : u.vec(l.exp_bias);
    m.tid2eid = l.hash ? tid2eid_dev : nullptr;
    m.n_vocab = hp.n_vocab;
    m.n_expert = hp.n_expert;
    m.n_used = hp.n_expert_used;
    m.weights_scale = hp.expert_weights_scale;
    m.clamp = l.clamp;
    m.clamp_sh = l.clamp_sh;
    m.gate = u.bank(l.gate_exps);
    m.up = u.bank(l.up_exps);
    m.down = u.bank(l.down_exps);
    if (hp.n_expert_shared == 1) {
        m.gate_sh = u.single(l.gate_sh);
        m.up_sh = u.single(l.up_sh);
        m.down_sh = u.single(l.down_sh);
    }
    return d;  // (weight types: check_weight_types, before the upload)
}

// Every weight of blocks [first, last) (and the embedding / head when this device holds them) has a
// CUDA kernel for its type, checked before anything is uploaded so an unsupported file fails at load
// with one line naming the tensor: dense matrices go through the fast or the generic GEMV and
// get_rows (cuda::mm_supported: f32, f16, bf16, q4_0 .. q8_0, q2_k .. q6_k), experts through the MoE
// (expert_type_supported: also iq2_xxs, mxfp4), HC mixers through the HC kernels (f32 / f16).
void check_weight_types(const model &m, int first, int last) {
    auto fail = [](const std::string &name, dtype t, const char *what) {
        throw error("cuda ds4: " + name + " is " + std::string(dtype_name(t)) + ", which has no CUDA " + what);
    };
    auto dense = [&](const matrix &w, const std::string &name) {
        if (w.data && !cuda::mm_supported(w.type)) fail(name, w.type, "GEMV");
    };
    auto mixer = [&](const hc_weights &h, const std::string &name) {
        if (h.fn.data && h.fn.type != dtype::f32 && h.fn.type != dtype::f16) fail(name, h.fn.type, "HC kernel (f32 / f16)");
    };
    auto experts = [&](dtype t, bool present, const std::string &name) {
        if (present && !cd::expert_type_supported(t)) fail(name, t, "MoE kernel");
    };
    if (first == 0) dense(m.tok_embd, "token_embd");
    if (last == m.hp.n_layer) {
        dense(m.output, "output");
        mixer(m.hc_head, "output_hc_fn");
    }
    for (int il = first; il < last; ++il) {
        const layer_weights &l = m.layers[static_cast<size_t>(il)];
        const std::string p = "blk." + std::to_string(il) + ".";
        mixer(l.hc_attn, p + "hc_attn_fn");
        mixer(l.hc_ffn, p + "hc_ffn_fn");
        for (const auto &[w, name] : {std::pair{&l.q_a, "attn_q_a"}, std::pair{&l.q_b, "attn_q_b"}, std::pair{&l.kv, "attn_kv"},
                                      std::pair{&l.out_a, "attn_output_a"}, std::pair{&l.out_b, "attn_output_b"},
                                      std::pair{&l.comp.kv, "attn_compressor_kv"}, std::pair{&l.comp.gate, "attn_compressor_gate"},
                                      std::pair{&l.idx_q_b, "indexer.attn_q_b"}, std::pair{&l.idx_proj, "indexer.proj"},
                                      std::pair{&l.idx_comp.kv, "indexer_compressor_kv"},
                                      std::pair{&l.idx_comp.gate, "indexer_compressor_gate"},
                                      std::pair{&l.gate_inp, "ffn_gate_inp"}})
            dense(*w, p + name);
        experts(l.gate_exps.first.type, l.gate_exps.first.data, p + "ffn_gate_exps");
        experts(l.up_exps.first.type, l.up_exps.first.data, p + "ffn_up_exps");
        experts(l.down_exps.first.type, l.down_exps.first.data, p + "ffn_down_exps");
        experts(l.gate_sh.type, l.gate_sh.data, p + "ffn_gate_shexp");
        experts(l.up_sh.type, l.up_sh.data, p + "ffn_up_shexp");
        experts(l.down_sh.type, l.down_sh.data, p + "ffn_down_shexp");
    }
}

// Bytes one decode step reads from layer d's weights: every dense matrix, the used experts.
double layer_step_bytes(const hparams &hp, const dlayer &d) {
    double b = hc_bytes(d.hc_attn) + hc_bytes(d.hc_ffn);
    for (const dmat *m : {&d.q_a, &d.q_b, &d.kv, &d.out_a, &d.out_b, &d.idx_q_b, &d.idx_proj, &d.comp.kv, &d.comp.gate,
                          &d.idx_comp.kv, &d.idx_comp.gate})
        b += mat_bytes(*m);
    b += static_cast<double>(d.moe.gate_inp_row_bytes) * hp.n_expert;
    for (const cd::expert_bank *e : {&d.moe.gate, &d.moe.up, &d.moe.down})
        b += static_cast<double>(e->expert_bytes) * hp.n_expert_used;
    for (const cd::expert_bank *e : {&d.moe.gate_sh, &d.moe.up_sh, &d.moe.down_sh})
        if (e->data) b += static_cast<double>(e->expert_bytes);
    return b;
}

}  // namespace cuda_impl

std::shared_ptr<const cuda_weights> cuda_upload(const model &m, const cuda_run_options &o,
                                                const std::function<void(uint64_t, uint64_t)> &progress) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) throw error("cuda ds4: no CUDA device available");
    if (o.device < 0 || o.device >= n_dev)
        throw error("cuda ds4: device " + std::to_string(o.device) + " out of range (" + std::to_string(n_dev) +
                    " devices)");
    ck(cudaSetDevice(o.device), "selecting the device");
    cd::gemv_rows_prepare();  // the multi-row steps' GEMV limits, before any graph capture
    const hparams &hp = m.hp;
    if (hp.n_hc > 5 || hp.head_dim > 512 || hp.idx_dim > 256 || hp.idx_head > 128)
        throw error("cuda ds4: geometry outside the CUDA kernels' limits (n_hc <= 5, head dim <= 512, indexer dim "
                    "<= 256, indexer heads <= 128)");
    const int first = o.first_layer, last = o.last_layer < 0 ? hp.n_layer : o.last_layer;
    // Memory check before any allocation: the bytes of this device's tensors (its blocks "blk.N.*",
    // the embedding with block 0, the output tensors with the last block) plus a 1 GiB margin.
    uint64_t total = 0;
    int64_t replicate = 0;
    if (m.file) {
        for (const auto &t : m.file->tensors()) {
            const std::string_view name = t.name;
            bool mine = false;
            if (name.rfind("blk.", 0) == 0) {
                const int il = std::atoi(std::string(name.substr(4)).c_str());
                mine = il >= first && il < last;
            } else if (name.rfind("token_embd", 0) == 0) {
                mine = first == 0;
            } else if (name.rfind("output", 0) == 0) {
                mine = last == hp.n_layer;
            }
            if (mine) total += t.nbytes;
        }
        replicate = m.file->get_int("fathom.synth.replicate_rows", 0);
        if (replicate < 0) throw error("cuda ds4: fathom.synth.replicate_rows must be >= 0");
    }
    size_t free_b = 0, total_b = 0;
    ck(cudaMemGetInfo(&free_b, &total_b), "querying device memory");
    if (static_cast<double>(total) + (1u << 30) > static_cast<double>(free_b))
        throw error("cuda ds4: the model's weights need " + gib(static_cast<double>(total)) + " (+1 GiB margin) but device " +
                    std::to_string(o.device) + " has " + gib(static_cast<double>(free_b)) + " free");

    if (first < 0 || last <= first || last > hp.n_layer || static_cast<int>(m.layers.size()) != hp.n_layer)
        throw error("cuda ds4: block range [" + std::to_string(first) + ", " + std::to_string(last) + ") outside the model's " +
                    std::to_string(hp.n_layer) + " blocks");
    check_weight_types(m, first, last);

    auto w = std::make_shared<cuda_weights>();
    w->hp = hp;
    w->opt = o;
    w->device = o.device;
    w->first = first;
    w->last = last;
    uploader u(*w, replicate, total, progress);
    if (w->embed()) w->tok_embd = u.mat(m.tok_embd);
    if (w->head()) {
        w->output = u.mat(m.output, true);
        w->output_norm = u.vec(m.output_norm);
        w->hc_head = {u.mat(m.hc_head.fn), u.vec(m.hc_head.base), u.vec(m.hc_head.scale)};
    }
    const rope_set ropes = make_rope_set(hp);
    w->rope_plain = u.vec(ropes.plain.freq);
    w->rope_yarn = u.vec(ropes.yarn.freq);
    w->step_bytes = mat_bytes(w->output) + hc_bytes(w->hc_head) + (w->embed() ? static_cast<double>(w->tok_embd.row_bytes) : 0.0);
    for (int il = w->first; il < w->last; ++il) {
        const layer_weights &l = m.layers[static_cast<size_t>(il)];
        const int32_t *tid = nullptr;
        if (l.hash)
            tid = static_cast<const int32_t *>(u.bytes(reinterpret_cast<const uint8_t *>(l.tid2eid.data()),
                                                       l.tid2eid.size() * sizeof(int32_t), 0, 0));
        w->layers.push_back(upload_layer(u, hp, l, tid));
        w->step_bytes += layer_step_bytes(hp, w->layers.back());
    }
    ck(cudaDeviceSynchronize(), "finishing the upload");
    return w;
}

std::shared_ptr<const cuda_weights> cuda_upload_mtp(const model &main, const mtp_weights &mw,
                                                    std::shared_ptr<const cuda_weights> target) {
    if (!target || !target->embed() || !target->head())
        throw error("cuda ds4: the MTP head needs the whole target model on its device (embedding and output head)");
    ck(cudaSetDevice(target->device), "selecting the device");
    // The head as a one-block model: block 0 is the MTP block (ratio 0, learned routing), its HC
    // collapse and final norm the head's own; the embedding and output head the target's.
    model view;
    view.hp = main.hp;
    view.hp.n_layer = 1;
    view.hp.n_nextn = 0;
    view.hp.n_hash_layer = 0;
    view.hp.compress_ratio = {0};
    view.hp.clamp_exp = {mw.block.clamp};
    view.hp.clamp_shexp = {mw.block.clamp_sh};
    view.output_norm = mw.norm;
    view.hc_head = mw.hc_head;
    view.layers = {mw.block};
    if (mw.block.ratio != 0 || mw.block.hash) throw error("cuda ds4: the MTP block must be window-only and learned-routed");
    check_weight_types(view, 0, 1);
    for (const auto &[m, name] : {std::pair{&mw.e_proj, "e_proj"}, std::pair{&mw.h_proj, "h_proj"}})
        if (!cuda::mm_supported(m->type))
            throw error(std::string("cuda ds4: the MTP ") + name + " is " + std::string(dtype_name(m->type)) + ", which has no CUDA GEMV");
    uint64_t total = 0;
    for (const matrix *m : {&mw.e_proj, &mw.h_proj, &mw.block.gate_exps.first, &mw.block.up_exps.first, &mw.block.down_exps.first})
        total += static_cast<uint64_t>(m->rows) * m->row_bytes * (m == &mw.e_proj || m == &mw.h_proj ? 1 : mw.block.gate_exps.n);
    std::shared_ptr<cuda_weights> w = drafter_weights(target, view.hp, total, "the MTP head");
    w->mtp = true;
    const int64_t replicate = main.file ? main.file->get_int("fathom.synth.replicate_rows", 0) : 0;
    const std::function<void(uint64_t, uint64_t)> no_progress;  // the uploader keeps a reference
    uploader u(*w, std::max<int64_t>(replicate, 0), total, no_progress);
    w->output_norm = u.vec(view.output_norm);
    w->hc_head = {u.mat(view.hc_head.fn), u.vec(view.hc_head.base), u.vec(view.hc_head.scale)};
    const rope_set ropes = make_rope_set(view.hp);
    w->rope_plain = u.vec(ropes.plain.freq);
    w->rope_yarn = u.vec(ropes.yarn.freq);
    w->e_proj = u.mat(mw.e_proj, true);
    w->h_proj = u.mat(mw.h_proj, true);
    w->enorm = u.vec(mw.enorm);
    w->hnorm = u.vec(mw.hnorm);
    w->layers.push_back(upload_layer(u, view.hp, mw.block, nullptr));
    w->step_bytes = mat_bytes(w->output) + hc_bytes(w->hc_head) + mat_bytes(w->e_proj) + mat_bytes(w->h_proj) +
                    layer_step_bytes(view.hp, w->layers.back());
    ck(cudaDeviceSynchronize(), "finishing the upload");
    return w;
}

namespace cuda_impl {

std::shared_ptr<cuda_weights> drafter_weights(const std::shared_ptr<const cuda_weights> &target, const hparams &hp,
                                              uint64_t bytes, const char *what) {
    size_t free_b = 0, total_b = 0;
    ck(cudaMemGetInfo(&free_b, &total_b), "querying device memory");
    if (static_cast<double>(bytes) + (1u << 30) > static_cast<double>(free_b))
        throw error(std::string("cuda ds4: ") + what + " needs " + gib(static_cast<double>(bytes)) + " (+1 GiB margin), " +
                    gib(static_cast<double>(free_b)) + " free");
    auto w = std::make_shared<cuda_weights>();
    w->hp = hp;
    w->opt = target->opt;
    w->opt.first_layer = 0;
    w->opt.last_layer = -1;
    w->device = target->device;
    w->first = 0;
    w->last = hp.n_layer;
    w->target = target;
    w->tok_embd = target->tok_embd;  // aliases: the target's allocations (w->target keeps them)
    w->output = target->output;
    return w;
}

void output_projection_rows(const dlayer &l, const hparams &hp, int n, const float *o, float *z, float *y, cudaStream_t s) {
    const int64_t d = hp.head_dim, H = hp.n_head, gd = static_cast<int64_t>(hp.n_head / hp.o_groups) * d,
                  zw = static_cast<int64_t>(hp.o_groups) * hp.o_rank;
    if (l.out_a.fast)
        cd::launch_gemv_grouped_rows(l.out_a.fw, hp.o_rank, n, o, H * d, z, s);
    else
        for (int r = 0; r < n; ++r)
            cd::launch_gemv_grouped(l.out_a.type, l.out_a.p, l.out_a.row_bytes, gd, hp.o_rank, hp.o_groups, o + r * H * d,
                                    z + r * zw, s);
    gemv_multi_rows({{&l.out_b, y}}, n, z, zw, s);
}

}  // namespace cuda_impl

size_t cuda_weight_bytes(const cuda_weights &w) {
    return w.bytes;
}
double cuda_bytes_per_token(const cuda_weights &w) {
    return w.step_bytes;
}

// ---- sequence -----------------------------------------------------------------------------------

namespace {


// The attention arguments that size its scratch for a layer of compression ratio r with max_comp
// compressed rows (pointers unset).
cd::sparse_attn_args attn_shape(const hparams &hp, int r, int64_t max_comp) {
    cd::sparse_attn_args a;
    a.n_head = hp.n_head;
    a.d = hp.head_dim;
    a.window = hp.window;
    a.ring_rows = ring_rows(hp);
    a.mode = r == 0 ? cd::comp_mode::none : r == 4 ? cd::comp_mode::list : cd::comp_mode::all;
    a.ratio = r;
    a.max_comp = r == 4 ? std::min<int64_t>(hp.idx_topk, max_comp) : max_comp;
    return a;
}

int64_t comp_capacity(int64_t n_ctx, int ratio) {
    return ratio > 0 ? n_ctx / ratio + 1 : 0;
}

}  // namespace


std::shared_ptr<cuda_prefill_pool> cuda_make_prefill_pool() {
    return std::make_shared<cuda_prefill_pool>();
}


namespace {

// Score scratch of the chunk indexer: every token's visible rows when that is at most 64 Mi floats,
// otherwise tokens are scored in groups (launch_indexer_topk_batch).
size_t chunk_score_floats(int64_t chunk, int64_t max_idx) {
    return std::max<size_t>(static_cast<size_t>(max_idx),
                            std::min<size_t>(static_cast<size_t>(chunk) * static_cast<size_t>(max_idx), size_t{64} << 20));
}

// Bytes of prefill-chunk scratch for `chunk` tokens: activations, the bf16 copies the products make,
// the product and MoE scratch (an estimate from above: their own buffers are sized inside them).
size_t chunk_bytes(const hparams &hp, kv_precision kv, int64_t n_ctx, int64_t chunk) {
    if (chunk <= 0) return 0;
    const size_t D = static_cast<size_t>(hp.n_embd), d = static_cast<size_t>(hp.head_dim), Hd = static_cast<size_t>(hp.n_head) * d,
                 Id = static_cast<size_t>(hp.idx_dim), IH = static_cast<size_t>(hp.idx_head), nh = static_cast<size_t>(hp.n_hc),
                 F = static_cast<size_t>(hp.n_ff_exp), k = static_cast<size_t>(hp.n_expert_used) + 1;
    const size_t floats = (2 * nh + 3) * D + static_cast<size_t>(hp.q_lora) + 2 * Hd + 6 * d + IH * Id + 4 * Id + IH +
                          static_cast<size_t>(hp.o_groups * hp.o_rank) + static_cast<size_t>(hp.idx_topk) + 32 +
                          (nh + 2) * nh;
    const size_t per_tok = floats * 4 + d * (kv == kv_precision::f16 ? 2 : 4) + Hd * 2 /* bf16 x */ +
                           k * (D + 3 * F) * 4 /* MoE slots */;
    const size_t score = chunk_score_floats(chunk, n_ctx / 4 + 1) * 4;
    return static_cast<size_t>(chunk) * per_tok + score + (size_t{640} << 20) /* weight tiles, partials, cuBLAS */;
}

}  // namespace

size_t cuda_row_bytes(const hparams &hp, kv_precision kv, int64_t n) {
    const size_t e = kv == kv_precision::f16 ? 2 : 4;
    size_t b = 0;
    for (int il = 0; il < hp.n_layer; ++il) {
        const int r = hp.compress_ratio[static_cast<size_t>(il)];
        if (r > 0) b += static_cast<size_t>(n / r) * hp.head_dim * e;
        if (r == 4) b += static_cast<size_t>(n / 4) * hp.idx_dim * e;
    }
    return b;
}

int cuda_row_regions(const hparams &hp) {
    std::vector<int> ratios;  // the kinds of the sequence's row layout (impl::row_region)
    bool idx = false;
    for (int il = 0; il < hp.n_layer; ++il) {
        const int r = hp.compress_ratio[static_cast<size_t>(il)];
        if (r > 0 && std::find(ratios.begin(), ratios.end(), r) == ratios.end()) ratios.push_back(r);
        idx = idx || r == 4;
    }
    return static_cast<int>(ratios.size()) + (idx ? 1 : 0);
}

std::shared_ptr<cuda::block_pool> cuda_make_state_pool(const cuda_weights &w, size_t max_bytes) {
    ck(cudaSetDevice(w.device), "selecting the device");
    if (max_bytes == 0) {
        size_t free_b = 0, total_b = 0;
        ck(cudaMemGetInfo(&free_b, &total_b), "querying device memory");
        const size_t margin = size_t{2} << 30;
        max_bytes = free_b > margin ? free_b - margin : 0;
    }
    return std::make_shared<cuda::block_pool>(w.device, max_bytes);
}

size_t cuda_sequence_bytes(const hparams &hp, kv_precision kv, int64_t n_ctx, int64_t prefill_chunk) {
    const size_t e = kv == kv_precision::f16 ? 2 : 4;
    size_t b = chunk_bytes(hp, kv, n_ctx, std::min(prefill_chunk, n_ctx));
    for (int il = 0; il < hp.n_layer; ++il) {
        const int r = hp.compress_ratio[static_cast<size_t>(il)];
        b += static_cast<size_t>(ring_rows(hp)) * hp.head_dim * e;
        if (r > 0) {
            const size_t c = r == 4 ? 2 : 1;
            b += static_cast<size_t>(comp_capacity(n_ctx, r)) * hp.head_dim * e +
                 2 * static_cast<size_t>(frontier_slots(r)) * c * hp.head_dim * 4;
        }
        if (r == 4)
            b += static_cast<size_t>(comp_capacity(n_ctx, r)) * hp.idx_dim * e +
                 2 * static_cast<size_t>(frontier_slots(4)) * 2 * hp.idx_dim * 4;
    }
    return b + (size_t{64} << 20);  // scratch (vocab logits, activations, attention partials)
}

const hparams &cuda_sequence::hp() const {
    return p_->w->hp;
}

cuda_sequence::cuda_sequence(std::shared_ptr<const cuda_weights> w, int64_t n_ctx, bool use_graph, int64_t prefill_chunk,
                             std::shared_ptr<cuda_prefill_pool> pool, std::shared_ptr<cuda::block_pool> state_pool)
    : p_(std::make_unique<impl>()), n_ctx_(n_ctx), chunk_(std::min(prefill_chunk, n_ctx)) {
    if (!w) throw error("cuda ds4: no weights");
    if (n_ctx < 1) throw error("cuda ds4: n_ctx must be positive");
    if (prefill_chunk < 0) throw error("cuda ds4: prefill_chunk must be >= 0");
    impl &p = *p_;
    static std::atomic<uint64_t> next_uid{1};
    p.uid = next_uid++;
    p.w = std::move(w);
    p.use_graph = use_graph;
    p.pool = std::move(pool);
    p.n_ctx_of_state = n_ctx;
    p.chunk_cap = chunk_;
    const hparams &hp = p.w->hp;
    ck(cudaSetDevice(p.w->device), "selecting the device");
    size_t free_b = 0, total_b = 0;
    ck(cudaMemGetInfo(&free_b, &total_b), "querying device memory");
    // With a pool the chunk scratch is the pool's (the first sequence allocates it, below; shared), not
    // this sequence's.
    bool pool_ready = false;
    if (p.pool) {
        std::lock_guard<std::mutex> lk(p.pool->mu);
        pool_ready = p.pool->created > 0;
    }
    if (state_pool && state_pool->device() != p.w->device) throw error("cuda ds4: the state pool is on another device");
    // Paged: the rows come from the state pool as the sequence grows, not now.
    const size_t need = cuda_sequence_bytes(hp, p.w->opt.kv, n_ctx, pool_ready ? 0 : chunk_) -
                        (state_pool ? cuda_row_bytes(hp, p.w->opt.kv, n_ctx) : 0);
    if (need > free_b)
        throw error("cuda ds4: a context of " + std::to_string(n_ctx) + " tokens needs " + gib(static_cast<double>(need)) +
                    " of device memory, " + gib(static_cast<double>(free_b)) + " free");
    ck(cudaStreamCreateWithFlags(&p.s, cudaStreamNonBlocking), "creating a stream");
    for (cudaStream_t &b : p.side) ck(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "creating a stream");
    for (cudaEvent_t *e : {&p.ev_fork, &p.ev_q, &p.ev_join[0], &p.ev_join[1]})
        ck(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "creating an event");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_pos), sizeof(int64_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_token), sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_amax), sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&p.err_h), sizeof(uint32_t), cudaHostAllocMapped), "pinned memory");
    *p.err_h = 0;
    ck(cudaHostGetDevicePointer(reinterpret_cast<void **>(&p.err_d), p.err_h, 0), "mapping the error word");

    p.kv_elem = p.w->opt.kv == kv_precision::f16 ? 2 : 4;
    const int64_t D = hp.n_embd, d = hp.head_dim, H = hp.n_head, Id = hp.idx_dim;
    int64_t max_idx = 1;
    size_t part = 1;
    if (state_pool) p.vm = std::make_unique<cuda::vm_regions>(std::move(state_pool));
    // The row buffers, one per kind (impl::row_region): the compressed rows of each ratio, the indexer rows
    // of the ratio-4 layers; a layer's rows are its slot of its kind's interleaved rows.
    struct kind {
        int ratio;
        bool idx;
        std::vector<size_t> layers;
        void *base = nullptr;
    };
    std::vector<kind> kinds;
    auto kind_of = [&](int ratio, bool idx) -> kind & {
        for (kind &k : kinds)
            if (k.ratio == ratio && k.idx == idx) return k;
        kinds.push_back({ratio, idx, {}});
        return kinds.back();
    };
    for (size_t il = 0; il < p.w->layers.size(); ++il) {
        const int r = p.w->layers[il].ratio;
        if (r > 0) kind_of(r, false).layers.push_back(il);
        if (r == 4) kind_of(4, true).layers.push_back(il);
    }
    for (kind &k : kinds) {
        const size_t row = static_cast<size_t>(k.idx ? Id : d) * p.kv_elem, stride = row * k.layers.size();
        const int64_t max_rows = comp_capacity(n_ctx, k.ratio);
        const size_t bytes = static_cast<size_t>(max_rows) * stride;
        k.base = p.vm ? p.vm->add(bytes) : p.dev<uint8_t>(bytes);
        p.row_regions.push_back({k.ratio, stride, max_rows});
    }
    for (const dlayer &l : p.w->layers) {
        layer_state_dev st;
        st.ring = p.dev<uint8_t>(static_cast<size_t>(ring_rows(hp)) * d * p.kv_elem);
        const size_t il = p.ls.size();
        auto slot = [&](bool idx, size_t &stride) -> void * {
            kind &k = kind_of(l.ratio, idx);
            const size_t row = static_cast<size_t>(idx ? Id : d) * p.kv_elem;
            stride = row * k.layers.size();
            const size_t at = static_cast<size_t>(std::find(k.layers.begin(), k.layers.end(), il) - k.layers.begin());
            return static_cast<uint8_t *>(k.base) + at * row;
        };
        if (l.ratio > 0) {
            const int c = l.ratio == 4 ? 2 : 1;
            st.comp_state_floats = static_cast<size_t>(frontier_slots(l.ratio)) * c * d;
            st.comp_kv = p.dev<float>(st.comp_state_floats);
            st.comp_score = p.dev<float>(st.comp_state_floats);
            st.max_comp = comp_capacity(n_ctx, l.ratio);
            st.comp_rows = slot(false, st.comp_stride);
        }
        if (l.ratio == 4) {
            st.ic_state_floats = static_cast<size_t>(frontier_slots(4)) * 2 * Id;
            st.ic_kv = p.dev<float>(st.ic_state_floats);
            st.ic_score = p.dev<float>(st.ic_state_floats);
            st.idx_rows = slot(true, st.idx_stride);
            max_idx = std::max(max_idx, st.max_comp);
        }
        p.ls.push_back(st);
    }
    // attention partials: the largest over the layer kinds
    for (size_t il = 0; il < p.w->layers.size(); ++il)
        part = std::max(part, cd::attn_part_floats(attn_shape(hp, p.w->layers[il].ratio, p.ls[il].max_comp)));
    p.pos = p.dev<int64_t>(1);
    p.token = p.dev<int32_t>(1);
    p.x[0] = p.dev<float>(static_cast<size_t>(hp.n_hc * D));
    p.x[1] = p.dev<float>(static_cast<size_t>(hp.n_hc * D));
    p.xn = p.dev<float>(static_cast<size_t>(D));
    // + 1 word: the fused HC kernels' arrival counter (enqueue_step).
    p.mix = p.dev<float>(static_cast<size_t>((2 + hp.n_hc) * hp.n_hc + 2));
    p.hc_part = p.dev<double>(cd::hc_fused_part_count(hp.n_hc));
    p.post = p.dev<float>(static_cast<size_t>(hp.n_hc));
    p.comb = p.dev<float>(static_cast<size_t>(hp.n_hc * hp.n_hc));
    p.q_lat = p.dev<float>(static_cast<size_t>(hp.q_lora));
    p.q = p.dev<float>(static_cast<size_t>(H * d));
    p.kvrow = p.dev<float>(static_cast<size_t>(d));
    p.ca = p.dev<float>(static_cast<size_t>(2 * d));
    p.cg = p.dev<float>(static_cast<size_t>(2 * d));
    p.iq = p.dev<float>(static_cast<size_t>(hp.idx_head * Id));
    p.iw = p.dev<float>(static_cast<size_t>(std::max(hp.idx_head, 1)));
    p.ica = p.dev<float>(static_cast<size_t>(2 * Id));
    p.icg = p.dev<float>(static_cast<size_t>(2 * Id));
    p.score_floats = static_cast<size_t>(max_idx);
    p.part_floats = part;
    p.score = p.dev<float>(static_cast<size_t>(max_idx));
    p.sel = p.dev<int32_t>(static_cast<size_t>(std::max(hp.idx_topk, 1)));
    p.n_sel = p.dev<int32_t>(1);
    p.part = p.dev<float>(part);
    p.o = p.dev<float>(static_cast<size_t>(H * d));
    p.z = p.dev<float>(static_cast<size_t>(hp.o_groups * hp.o_rank));
    p.y = p.dev<float>(static_cast<size_t>(D));
    p.zh = p.dev<float>(static_cast<size_t>(D));
    p.logits = p.dev<float>(static_cast<size_t>(hp.n_vocab));
    if (p.w->mtp) p.hc_in = p.dev<float>(static_cast<size_t>(hp.n_hc * D));
    p.amax = p.dev<int32_t>(1);
    p.moe.logits = p.dev<float>(static_cast<size_t>(hp.n_expert));
    p.moe.ids = p.dev<int32_t>(static_cast<size_t>(hp.n_expert_used));
    p.moe.weights = p.dev<float>(static_cast<size_t>(hp.n_expert_used));
    p.moe.h = p.dev<float>(static_cast<size_t>((hp.n_expert_used + 1) * hp.n_ff_exp));
    if (chunk_ > 1 && !p.pool) {
        p.cs_own = p.alloc_chunk(chunk_);
        p.cs = p.cs_own.get();
    } else if (chunk_ > 1 && !pool_ready) {  // the pool's first scratch, now: later sequences count on it
        std::unique_ptr<chunk_state> c = p.alloc_chunk(chunk_);
        c->gemm->set_stream(nullptr);
        std::lock_guard<std::mutex> lk(p.pool->mu);
        p.pool->idle.push_back(std::move(c));
        ++p.pool->created;
    }
    reset();
}

std::unique_ptr<chunk_state> cuda_sequence::impl::alloc_chunk(int64_t T) {
    const hparams &hp = w->hp;
    const size_t n = static_cast<size_t>(T), D = static_cast<size_t>(hp.n_embd), d = static_cast<size_t>(hp.head_dim),
                 Hd = static_cast<size_t>(hp.n_head) * d, Id = static_cast<size_t>(hp.idx_dim),
                 IH = static_cast<size_t>(std::max(hp.idx_head, 1)), nh = static_cast<size_t>(hp.n_hc);
    auto own = std::make_unique<chunk_state>();
    chunk_state &c = *own;
    c.device = w->device;
    c.cap = T;
    c.n_ctx = ls.empty() ? 0 : n_ctx_of_state;
    c.tokens = c.dev<int32_t>(n);
    c.x[0] = c.dev<float>(n * nh * D);
    c.x[1] = c.dev<float>(n * nh * D);
    c.xn = c.dev<float>(n * D);
    c.mix = c.dev<float>(n * ((2 + nh) * nh + 1));
    c.post = c.dev<float>(n * nh);
    c.comb = c.dev<float>(n * nh * nh);
    c.q_lat = c.dev<float>(n * static_cast<size_t>(hp.q_lora));
    c.q = c.dev<float>(n * Hd);
    c.kv = c.dev<float>(n * d);
    c.kv_rows = c.dev<uint8_t>(n * d * kv_elem);
    c.ca = c.dev<float>(n * 2 * d);
    c.cg = c.dev<float>(n * 2 * d);
    c.iq = c.dev<float>(n * IH * Id);
    c.iw = c.dev<float>(n * IH);
    c.ica = c.dev<float>(n * 2 * Id);
    c.icg = c.dev<float>(n * 2 * Id);
    int64_t max_idx = 1;
    for (const layer_state_dev &st : ls)
        if (st.idx_rows) max_idx = std::max(max_idx, st.max_comp);
    c.score_floats = chunk_score_floats(T, max_idx);
    c.score = c.dev<float>(c.score_floats);
    c.sel = c.dev<int32_t>(n * static_cast<size_t>(std::max(hp.idx_topk, 1)));
    c.n_sel = c.dev<int32_t>(n);
    size_t part = 1;
    // The partials' size is not monotone in the token count (small chunks split rows over blocks):
    // the largest over every chunk length this sequence can launch, once per layer kind (the
    // compressed-row capacity depends only on the ratio).
    std::vector<int> kinds;
    for (size_t il = 0; il < w->layers.size(); ++il) {
        const int r = w->layers[il].ratio;
        if (std::find(kinds.begin(), kinds.end(), r) != kinds.end()) continue;
        kinds.push_back(r);
        const cd::sparse_attn_args a = attn_shape(hp, r, ls[il].max_comp);
        for (int64_t m = 1; m <= T; ++m) part = std::max(part, cd::attn_batch_part_floats(a, m));
    }
    c.part = c.dev<float>(part);
    c.o = c.dev<float>(n * Hd);
    c.z = c.dev<float>(n * static_cast<size_t>(hp.o_groups * hp.o_rank));
    c.y = c.dev<float>(n * D);
    // The widest product input: the grouped output projection's [T, H * d] (q_b reads q_lora, out_b
    // o_groups * o_rank, the rest D).
    const size_t widest = std::max({Hd, D, static_cast<size_t>(hp.q_lora), static_cast<size_t>(hp.o_groups * hp.o_rank)});
    c.gemm = std::make_unique<cd::gemm_runner>(s, n * widest);
    if (chunk_moe_supported(hp, w->layers))
        c.moe = std::make_unique<cd::moe_prefill>(*c.gemm, T, hp.n_embd, hp.n_ff_exp, hp.n_expert, hp.n_expert_used);
    return own;
}

void cuda_sequence::impl::take_chunk() {
    if (cs) return;
    if (pool) {
        std::lock_guard<std::mutex> lk(pool->mu);
        for (size_t i = 0; i < pool->idle.size(); ++i)
            if (pool->idle[i]->cap >= chunk_cap && pool->idle[i]->n_ctx == n_ctx_of_state) {
                cs_own = std::move(pool->idle[i]);
                pool->idle.erase(pool->idle.begin() + static_cast<std::ptrdiff_t>(i));
                break;
            }
    }
    if (!cs_own) {
        cs_own = alloc_chunk(chunk_cap);
        if (pool) {
            std::lock_guard<std::mutex> lk(pool->mu);
            ++pool->created;
        }
    }
    cs_own->gemm->set_stream(s);
    cs = cs_own.get();
}

void cuda_sequence::impl::give_back_chunk() noexcept {
    if (!pool || !cs_own) return;
    cudaStreamSynchronize(s);  // its work on the scratch is done before another sequence's starts
    try {
        cs_own->gemm->set_stream(nullptr);  // this stream dies with the sequence
        std::lock_guard<std::mutex> lk(pool->mu);
        pool->idle.push_back(std::move(cs_own));
    } catch (...) {
        cs_own.reset();  // freed instead
    }
    cs = nullptr;
}



cuda_sequence::~cuda_sequence() = default;

void cuda_sequence::reset() {
    impl &p = *p_;
    ck(cudaSetDevice(p.w->device), "selecting the device");
    const hparams &hp = p.w->hp;
    // Frontier scores start at -inf (empty slots): one host row of -inf, as long as the widest
    // frontier, is the source of every copy; it outlives them (one synchronisation at the end).
    size_t widest = 0;
    for (const layer_state_dev &st : p.ls) widest = std::max({widest, st.comp_state_floats, st.ic_state_floats});
    const std::vector<float> inf(widest, -std::numeric_limits<float>::infinity());
    auto clear_frontier = [&](float *kv, float *score, size_t n) {
        ck(cudaMemsetAsync(kv, 0, n * sizeof(float), p.s), "clearing");
        ck(cudaMemcpyAsync(score, inf.data(), n * sizeof(float), cudaMemcpyHostToDevice, p.s), "clearing");
    };
    for (layer_state_dev &st : p.ls) {
        ck(cudaMemsetAsync(st.ring, 0, static_cast<size_t>(ring_rows(hp)) * hp.head_dim * p.kv_elem, p.s), "clearing");
        if (st.comp_kv) clear_frontier(st.comp_kv, st.comp_score, st.comp_state_floats);
        if (st.ic_kv) clear_frontier(st.ic_kv, st.ic_score, st.ic_state_floats);
    }
    ck(cudaStreamSynchronize(p.s), "clearing");
    if (p.vm) {  // every block back to the pool (the stream is idle: nothing reads them any more)
        p.vm->shrink(std::vector<size_t>(p.vm->size(), 0));
        p.mapped_tokens = 0;
    }
    *p.err_h = 0;
    n_past_ = reached_ = floor_ = 0;
    have_logits_ = false;
    rows_held_ = 0;
}

// ---- paged state ----------------------------------------------------------------------------------------

std::vector<size_t> cuda_sequence::impl::region_bytes(int64_t n) const {
    std::vector<size_t> b;
    for (const row_region &r : row_regions)
        // positions [0, n) complete rows 0 .. n / R - 1 (a row is written at its block's last position)
        b.push_back(static_cast<size_t>(std::min(n / r.ratio, r.max_rows)) * r.stride);
    return b;
}

bool cuda_sequence::paged() const {
    return p_->vm != nullptr;
}

size_t cuda_sequence::row_bytes() const {
    const impl &p = *p_;
    if (p.vm) return p.vm->mapped_bytes();
    size_t b = 0;
    for (const impl::row_region &r : p.row_regions) b += static_cast<size_t>(r.max_rows) * r.stride;
    return b;
}

int64_t cuda_sequence::mapped_tokens() const {
    return p_->vm ? p_->mapped_tokens : n_ctx_;
}

bool cuda_sequence::reserve(int64_t n_tokens) {
    impl &p = *p_;
    if (!p.vm) return true;
    const int64_t n = std::clamp<int64_t>(n_tokens, n_past_, n_ctx_);
    ck(cudaSetDevice(p.w->device), "selecting the device");
    if (n > p.mapped_tokens) {
        if (!p.vm->grow(p.region_bytes(n))) return false;
    } else if (n < p.mapped_tokens) {
        ck(cudaStreamSynchronize(p.s), "releasing state blocks");
        p.vm->shrink(p.region_bytes(n));
    }
    p.mapped_tokens = n;
    return true;
}

void cuda_sequence::map_rows(int64_t n_end) {
    impl &p = *p_;
    if (!p.vm || n_end <= p.mapped_tokens) return;
    ck(cudaSetDevice(p.w->device), "selecting the device");
    const std::vector<size_t> want = p.region_bytes(n_end);
    if (!p.vm->grow(want)) {
        const cuda::block_pool &pool = p.vm->pool();
        const double mib = static_cast<double>(pool.block_bytes()) / (1 << 20);
        throw error("cuda ds4: the state pool is exhausted: the rows of " + std::to_string(n_end) + " tokens need " +
                    std::to_string(p.vm->blocks_needed(want)) + " more blocks of " + std::to_string(static_cast<int>(mib)) +
                    " MiB; " + std::to_string(pool.used()) + " of " + std::to_string(pool.capacity()) + " are in use");
    }
    p.mapped_tokens = n_end;
}

int64_t cuda_sequence::rollback_floor() const {
    return std::min(n_past_, std::max(floor_, reached_ - max_rollback));
}

void cuda_sequence::restart_at(int64_t n) {
    for (const dlayer &l : p_->w->layers)
        if (l.ratio != 0) throw error("cuda ds4: restart_at needs a window-only model (the MTP head)");
    if (n < 0 || n > n_ctx_) throw error("cuda ds4: restart_at " + std::to_string(n) + " outside [0, n_ctx]");
    reset();  // zero rings: the rows before n read as the CPU head's fresh state
    n_past_ = reached_ = floor_ = n;
}

void cuda_sequence::truncate(int64_t n) {
    if (n > n_past_ || n < rollback_floor())
        throw error("cuda ds4: cannot roll back to " + std::to_string(n) + " tokens (holds " + std::to_string(n_past_) +
                    "; rollback reaches " + std::to_string(rollback_floor()) + ", at most " +
                    std::to_string(max_rollback) + " positions behind the furthest evaluated one)");
    if (n == n_past_) return;
    n_past_ = n;  // every count the device derives (window span, compressed rows, indexer rows) follows it
    have_logits_ = false;
    rows_held_ = 0;
}

// The row's KV row (kvrow, the projection's output) normed, rotated, QAT-rounded into the ring at pos.
void cuda_sequence::impl::store_kv_row(const dlayer &l, layer_state_dev &st, cudaStream_t on) {
    const hparams &hp = w->hp;
    const int64_t d = hp.head_dim;
    const cd::rope_args rope{l.ratio > 0 ? w->rope_yarn : w->rope_plain, hp.n_rot};
    phase("attn kv (norm, rope, fp8, ring)");
    cd::launch_kv_finish_store(kvrow, static_cast<int>(d), l.kv_norm, hp.rms_eps, rope,
                               w->opt.qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none, st.ring,
                               kv_elem == 2, static_cast<size_t>(d) * kv_elem, ring_rows(hp), pos, on);
}

void cuda_sequence::impl::enqueue_attention_state(const dlayer &l, layer_state_dev &st) {
    if (l.ratio != 0)
        throw error("cuda ds4: a state-only row takes window-only blocks (the MTP head), not a ratio-" +
                    std::to_string(l.ratio) + " block");
    // The decode step's projection launch (q_a beside kv: the same plan, so the KV row's bits), then its store.
    phase("projections of xn (q_a, kv)");
    gemv_multi({{&l.q_a, q_lat}, {&l.kv, kvrow}}, xn, s);
    store_kv_row(l, st, s);
}

void cuda_sequence::impl::enqueue_attention(const dlayer &l, layer_state_dev &st) {
    const hparams &hp = w->hp;
    const qat_mode qat = w->opt.qat;
    const int64_t D = hp.n_embd, d = hp.head_dim, Id = hp.idx_dim;
    const bool f16 = kv_elem == 2;
    const cd::rope_args rope{l.ratio > 0 ? w->rope_yarn : w->rope_plain, hp.n_rot};
    const cd::rope_args yarn{w->rope_yarn, hp.n_rot};
    const bool idx = l.ratio == 4;
    // Streams: sk runs the KV row and the main compressor, si the indexer, s the query path (all s
    // when serial). What each reads and writes, per layer:
    //   s : xn -> projections -> q_lat, kvrow, ca, cg [, iw, ica, icg]; q_lat -> q [, iq]; q in place
    //   sk: kvrow in place -> st.ring row (pos mod window); ca, cg -> st.comp_kv / comp_score, comp_rows
    //   si: ica, icg -> st.ic_kv / ic_score, idx_rows; after ev_q: iq in place; iq, iw, idx_rows ->
    //       score, sel, n_sel
    //   s after the join: q, st.ring, st.comp_rows, sel, n_sel -> part, o -> z -> y
    // Between branches only pos (read-only) and err_d (atomicOr) are shared. Every scratch buffer a
    // branch touches is next written by the next layer's projections (or, for iq, its q_b GEMV), on
    // s after this layer's join, so the join also orders those writes after the branches' reads.
    const bool par = branched();
    const cudaStream_t sk = par ? side[0] : s, si = par ? side[1] : s;
    auto pause = [&](cudaStream_t b, bool on_side) {
        const int64_t ns = w->test.branch_delay_ns;
        if (par && ns != 0 && (ns > 0) == on_side) cd::launch_gpu_sleep(static_cast<uint64_t>(ns > 0 ? ns : -ns), b);
    };
    // Every projection of the normed input xn in one launch (q_a, kv, compressor and indexer inputs),
    // then those of the query latent (q_b, indexer q_b).
    phase("projections of xn (q_a, kv, compressors, indexer weights)");
    if (idx)
        gemv_multi({{&l.q_a, q_lat}, {&l.kv, kvrow}, {&l.comp.kv, ca}, {&l.comp.gate, cg}, {&l.idx_proj, iw},
                    {&l.idx_comp.kv, ica}, {&l.idx_comp.gate, icg}},
                   xn, s);
    else if (l.ratio > 0)
        gemv_multi({{&l.q_a, q_lat}, {&l.kv, kvrow}, {&l.comp.kv, ca}, {&l.comp.gate, cg}}, xn, s);
    else
        gemv_multi({{&l.q_a, q_lat}, {&l.kv, kvrow}}, xn, s);
    // Fork after the projections. The GEMVs are PDL launches (their programmatic edge is valid only
    // to the previous kernel of the same stream): no PDL launch directly follows a wait on another
    // stream's event here - each branch starts with, and the attention after the join is, a plain
    // launch, which waits for the whole of its predecessors.
    if (par) {
        ck(cudaEventRecord(ev_fork, s), "forking the attention");
        ck(cudaStreamWaitEvent(sk, ev_fork, 0), "forking the attention");
        if (idx) ck(cudaStreamWaitEvent(si, ev_fork, 0), "forking the attention");
        pause(sk, true);
        if (idx) pause(si, true);
        pause(s, false);
    }
    store_kv_row(l, st, sk);
    auto compressor = [&](const dcomp &c, float *skv, float *sscore, void *rows, size_t stride, cd::qat_kind qk,
                          const float *a, const float *g, cudaStream_t on) {
        cd::launch_compressor_step(comp_args(hp, c, yarn, qk, skv, sscore, rows, f16, stride, st.max_comp), a, g, pos,
                                   err_d, on);
    };
    if (l.ratio > 0) {
        phase("attn compressor step");
        compressor(l.comp, st.comp_kv, st.comp_score, st.comp_rows, st.comp_stride,
                   qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none, ca, cg, sk);
    }
    const cd::qat_kind iqk = qat != qat_mode::off ? cd::qat_kind::hadamard_fp4 : cd::qat_kind::none;
    if (idx) {
        phase("indexer compressor step");
        compressor(l.idx_comp, st.ic_kv, st.ic_score, st.idx_rows, st.idx_stride, iqk, ica, icg, si);
    }
    phase("attn q (norm, q_b [+ indexer q_b], head norm+rope)");
    // RMSNorm(q_lat) folded into the q_b GEMV's activation staging (q_lat itself is not read again).
    // The indexer query's GEMV shares q_b's launch (as its own launch ahead of q_b, with the indexer
    // branch forked right after it, the step was slower: 131.4 vs 131.9 tok/s at 8K, docs/PERF.md).
    if (idx)
        gemv_multi({{&l.q_b, q}, {&l.idx_q_b, iq}}, q_lat, s, l.q_a_norm, hp.rms_eps, hp.q_lora);
    else
        gemv_multi({{&l.q_b, q}}, q_lat, s, l.q_a_norm, hp.rms_eps, hp.q_lora);
    if (idx && par) {  // the indexer branch may read iq from here on
        ck(cudaEventRecord(ev_q, s), "forking the indexer query");
        ck(cudaStreamWaitEvent(si, ev_q, 0), "forking the indexer query");
    }
    cd::launch_head_norm_rope(q, hp.n_head, static_cast<int>(d), true, hp.rms_eps, rope, cd::qat_kind::none, pos, s);
    if (idx) {
        phase("indexer q rope+fp4");
        cd::launch_head_norm_rope(iq, hp.idx_head, static_cast<int>(Id), false, hp.rms_eps, yarn, iqk, pos, si);
        const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Id) * hp.idx_head));
        phase("indexer top-k");
        cd::launch_indexer_topk(iq, iw, scale, st.idx_rows, f16, st.idx_stride, 4, st.max_comp,
                                hp.idx_head, static_cast<int>(Id), hp.idx_topk, pos, score, sel, n_sel, si,
                                w->opt.exact_indexer);
    }
    // Join: the attention reads the ring row, the compressed rows and the selections.
    if (par) {
        for (int i = 0; i < (idx ? 2 : 1); ++i) {
            ck(cudaEventRecord(ev_join[i], side[i]), "joining the attention");
            ck(cudaStreamWaitEvent(s, ev_join[i], 0), "joining the attention");
        }
    }
    phase("sparse sink attention");
    cd::sparse_attn_args a;
    a.n_head = hp.n_head;
    a.d = static_cast<int>(d);
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    a.sinks = l.sinks;
    a.ring = st.ring;
    a.ring_f16 = f16;
    a.ring_stride = static_cast<size_t>(d) * kv_elem;
    a.window = hp.window;
    a.ring_rows = ring_rows(hp);
    a.mode = l.ratio == 0 ? cd::comp_mode::none : l.ratio == 4 ? cd::comp_mode::list : cd::comp_mode::all;
    a.comp = st.comp_rows;
    a.comp_f16 = f16;
    a.comp_stride = st.comp_stride;
    a.ratio = l.ratio;
    a.sel = sel;
    a.n_sel = n_sel;
    a.max_comp = l.ratio == 4 ? std::min<int64_t>(hp.idx_topk, st.max_comp) : st.max_comp;
    a.rope = rope;
    // fused_combine stays off: one launch with a grid barrier measured slower than split + combine on
    // the H200 (CudaDs4AttnMma.BenchOldVsNew, 20.2 vs 18.2 us at 128 rows; step 1.22 vs 1.05 ms).
    cd::launch_sparse_sink_attention(a, q, pos, part, o, s);
    phase("attn output (grouped A, B)");
    const int64_t gd = static_cast<int64_t>(hp.n_head / hp.o_groups) * d;
    if (l.out_a.fast)
        cd::launch_gemv_fast_grouped(l.out_a.fw, hp.o_rank, o, z, s);
    else
        cd::launch_gemv_grouped(l.out_a.type, l.out_a.p, l.out_a.row_bytes, gd, hp.o_rank, hp.o_groups, o, z, s);
    gemv(l.out_b, z, y, s);
    (void)D;
}

namespace {

// The decode step as an executor of the DS4 forward (deepseek4_exec.h: run_forward drives it): one row,
// its token and position read from device memory (the step is captured once as a CUDA graph). HC: one
// fused launch per sublayer (ds4_kernels.h launch_hc_pre_fused): a sublayer's HCPost is deferred
// (pending) and folded into the next HCPre or the head; x[cur] is the state, or with a pending post the
// state it was made from (x[1 - cur] receives the new one). The fused kernels' arrival counter is the
// word after mix's (2 + n_hc) n_hc + 1 floats (allocated with mix), cleared once per step (the kernels
// leave it zero; the clear makes a step self-contained). Blocks are the device's [w.first, w.last).
class step_exec final : public executor {
  public:
    explicit step_exec(cuda_sequence::impl &p)
        : p_(p), w_(*p.w), hcp_{w_.hp.n_hc, w_.hp.n_embd, w_.hp.sinkhorn_iters, w_.hp.hc_eps, w_.hp.rms_eps} {
        const int nh = w_.hp.n_hc;
        sync_ = reinterpret_cast<uint32_t *>(p.mix + (2 + nh) * nh + 1);
        ck(cudaMemsetAsync(sync_, 0, sizeof(uint32_t), p.s), "clearing the hc counter");
    }
    void embed() override {
        p_.phase("embedding");
        const int64_t D = w_.hp.n_embd;
        if (w_.mtp) {
            embed_mtp();
            return;
        }
        for (int k = 0; k < w_.hp.n_hc; ++k)
            cuda::launch_get_rows(w_.tok_embd.type, w_.tok_embd.p, w_.tok_embd.row_bytes, D, w_.hp.n_vocab, p_.token, 1,
                                  p_.x[0] + k * D, D, p_.err_d, p_.s);
    }
    void hc_pre(int il, sublayer which) override {
        const dlayer &l = layer(il);
        const bool attn = which == sublayer::attention;
        const dhc &h = attn ? l.hc_attn : l.hc_ffn;
        p_.phase("hc post + pre + rmsnorm");
        cd::launch_hc_pre_fused(hcp_, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale,
                                io(attn ? l.attn_norm : l.ffn_norm, p_.xn), p_.s);
        capture();
    }
    void attention(int il) override { p_.enqueue_attention(layer(il), p_.ls[static_cast<size_t>(il - w_.first)]); }
    void attention_state(int il) override {
        p_.enqueue_attention_state(layer(il), p_.ls[static_cast<size_t>(il - w_.first)]);
    }
    void moe(int il) override {
        p_.phase("moe (router, 6 routed + shared expert)");
        cd::launch_moe_ffn(layer(il).moe, p_.xn, p_.token, p_.moe, p_.y, p_.err_d, p_.s);
    }
    void hc_post() override { pending_ = true; }
    // HC head (with the last pending post), norm, output head, argmax; logits stay on the device.
    void head() override {
        p_.phase("head (hc post + head, norm, output, argmax)");
        const dhc &h = w_.hc_head;
        cd::launch_hc_head_fused(hcp_, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale, io(w_.output_norm, p_.zh), p_.s);
        capture();
        gemv(w_.output, p_.zh, p_.logits, p_.s);
        cd::launch_argmax(p_.logits, w_.hp.n_vocab, p_.amax, p_.s);
    }
    // DSpark features (set_feature_layers): the state after block il is whole once the next fused launch
    // has folded its HCPost in (x[cur] then), so the capture of a capture block waits for that launch.
    void after_block(int il) { cap_ = p_.feat_slot(il); }
    // A stage without the head: the pending post applied (two per block: the state is back in x[0]).
    void end_stage() {
        p_.phase("hc post");
        if (pending_) cd::launch_hc_post(w_.hp.n_hc, w_.hp.n_embd, p_.y, p_.x[cur_], p_.post, p_.comb, p_.x[1 - cur_], p_.s);
        pending_ = false;
    }

  private:
    // The MTP head's input (deepseek4_mtp.cpp mtp_forward): stream s of x[0] = e_proj(RMSNorm(embed(token)))
    // + h_proj(RMSNorm(hc_in stream s)). Scratch: zh (the embedding), y (e), x[1] (the normed streams); none
    // holds anything yet at the start of a step.
    void embed_mtp() {
        const hparams &hp = w_.hp;
        const int64_t D = hp.n_embd, nh = hp.n_hc;
        cuda::launch_get_rows(w_.tok_embd.type, w_.tok_embd.p, w_.tok_embd.row_bytes, D, hp.n_vocab, p_.token, 1, p_.zh, D,
                              p_.err_d, p_.s);
        cuda::launch_rms_norm(p_.zh, D, w_.enorm, hp.rms_eps, D, 1, p_.zh, D, p_.s);
        gemv(w_.e_proj, p_.zh, p_.y, p_.s);
        cuda::launch_rms_norm(p_.hc_in, D, w_.hnorm, hp.rms_eps, D, nh, p_.x[1], D, p_.s);
        for (int64_t k = 0; k < nh; ++k) gemv(w_.h_proj, p_.x[1] + k * D, p_.x[0] + k * D, p_.s);
        cuda::launch_elementwise(cuda::ew_op::add_bcast, p_.x[0], D, p_.y, 0, p_.x[0], D, D, nh, 0.0f, p_.s);
    }
    const dlayer &layer(int il) const { return w_.layers[static_cast<size_t>(il - w_.first)]; }
    void capture() {
        if (cap_ < 0) return;
        const int64_t D = w_.hp.n_embd;
        cd::launch_hc_stream_mean(w_.hp.n_hc, D, 1, p_.x[cur_], p_.feat + cap_ * D, p_.feat_floats(), p_.s);
        cap_ = -1;
    }
    cd::hc_fused_io io(const float *norm, float *out) {
        cd::hc_fused_io r;
        r.y = pending_ ? p_.y : nullptr;
        r.x = p_.x[cur_];
        r.x_new = pending_ ? p_.x[1 - cur_] : nullptr;
        r.post = p_.post, r.comb = p_.comb, r.mix = p_.mix, r.sync = sync_, r.norm = norm, r.out = out;
        r.part = p_.hc_part;
        if (pending_) cur_ = 1 - cur_;
        pending_ = false;
        return r;
    }
    cuda_sequence::impl &p_;
    const cuda_weights &w_;
    const cd::hc_params hcp_;
    uint32_t *sync_ = nullptr;
    int cur_ = 0, cap_ = -1;
    bool pending_ = false;
};

}  // namespace

void cuda_sequence::impl::enqueue_step() {
    step_exec ex(*this);
    std::function<void(int)> after;
    if (!feat_layers.empty()) after = [&](int il) { ex.after_block(il); };
    run_forward(ex, w->hp.n_layer, w->first, w->last, w->embed(), w->head(), after);
    if (!w->head()) ex.end_stage();
    phase("");
}

void cuda_sequence::impl::enqueue_state_row() {
    if (!w->mtp || w->last - w->first != 1) throw error("cuda ds4: a state-only row is the MTP head's (one block)");
    step_exec ex(*this);
    ex.embed();
    run_block_state(ex, w->first);
    phase("");
}

// ---- prefill chunks ------------------------------------------------------------------------------
// The same sublayers as enqueue_attention / enqueue_step for n tokens at once (ds4_prefill.h): the
// products of all n tokens are matrix-matrix (gemm_runner), the element-wise kernels take a token
// dimension, and the chunk's KV rows feed its own attention window before the ring gets them.

void cuda_sequence::impl::enqueue_chunk_attention(const dlayer &l, layer_state_dev &st, int64_t n) {
    const hparams &hp = w->hp;
    const qat_mode qat = w->opt.qat;
    const int64_t D = hp.n_embd, d = hp.head_dim, H = hp.n_head, Id = hp.idx_dim, IH = hp.idx_head;
    const bool f16 = kv_elem == 2;
    const cd::rope_args rope{l.ratio > 0 ? w->rope_yarn : w->rope_plain, hp.n_rot};
    const cd::rope_args yarn{w->rope_yarn, hp.n_rot};
    cd::gemm_runner &g = *cs->gemm;
    const int64_t cw = (l.ratio == 4 ? 2 : 1) * d;
    // Projections of xn. The indexer's (query, head weights) stay f32: they decide which rows are
    // attended, and bf16 rounding there would flip near-tied selections against the decode path.
    chunk_matmul(g, l.q_a, cs->xn, D, n, cs->q_lat, hp.q_lora, s);
    chunk_matmul(g, l.kv, cs->xn, D, n, cs->kv, d, s);
    if (l.ratio > 0) {
        chunk_matmul(g, l.comp.kv, cs->xn, D, n, cs->ca, cw, s);
        chunk_matmul(g, l.comp.gate, cs->xn, D, n, cs->cg, cw, s);
    }
    if (l.ratio == 4) {
        chunk_matmul(g, l.idx_proj, cs->xn, D, n, cs->iw, IH, s, cd::gemm_precision::f32);
        chunk_matmul(g, l.idx_comp.kv, cs->xn, D, n, cs->ica, 2 * Id, s);
        chunk_matmul(g, l.idx_comp.gate, cs->xn, D, n, cs->icg, 2 * Id, s);
    }
    cuda::launch_rms_norm(cs->q_lat, hp.q_lora, l.q_a_norm, hp.rms_eps, hp.q_lora, n, cs->q_lat, hp.q_lora, s);
    chunk_matmul(g, l.q_b, cs->q_lat, hp.q_lora, n, cs->q, H * d, s);
    if (l.ratio == 4) chunk_matmul(g, l.idx_q_b, cs->q_lat, hp.q_lora, n, cs->iq, IH * Id, s, cd::gemm_precision::f32);
    cd::launch_head_norm_rope_batch(cs->q, n, hp.n_head, static_cast<int>(d), true, hp.rms_eps, rope, cd::qat_kind::none,
                                    pos, s);
    const size_t row_stride = static_cast<size_t>(d) * kv_elem;
    cd::launch_kv_finish_batch(cs->kv, n, static_cast<int>(d), l.kv_norm, hp.rms_eps, rope,
                               qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none, cs->kv_rows, f16,
                               row_stride, pos, s);
    auto compressor = [&](const dcomp &c, float *skv, float *sscore, void *rows, size_t stride, cd::qat_kind qk,
                          const float *a, const float *gt) {
        cd::launch_compressor_chunk(comp_args(hp, c, yarn, qk, skv, sscore, rows, f16, stride, st.max_comp), a, gt, n, pos,
                                    err_d, s);
    };
    if (l.ratio > 0)
        compressor(l.comp, st.comp_kv, st.comp_score, st.comp_rows, st.comp_stride,
                   qat == qat_mode::full ? cd::qat_kind::fp8_nope : cd::qat_kind::none, cs->ca, cs->cg);
    if (l.ratio == 4) {
        const cd::qat_kind qk = qat != qat_mode::off ? cd::qat_kind::hadamard_fp4 : cd::qat_kind::none;
        cd::launch_head_norm_rope_batch(cs->iq, n, hp.idx_head, static_cast<int>(Id), false, hp.rms_eps, yarn, qk, pos, s);
        compressor(l.idx_comp, st.ic_kv, st.ic_score, st.idx_rows, st.idx_stride, qk, cs->ica, cs->icg);
        const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Id) * hp.idx_head));
        cd::launch_indexer_topk_batch(cs->iq, cs->iw, scale, st.idx_rows, f16, st.idx_stride, 4,
                                      st.max_comp, hp.idx_head, static_cast<int>(Id), hp.idx_topk, n, pos, cs->score,
                                      cs->score_floats, cs->sel, cs->n_sel, s, w->opt.exact_indexer);
    }
    cd::sparse_attn_args a;
    a.n_head = hp.n_head;
    a.d = static_cast<int>(d);
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    a.sinks = l.sinks;
    a.ring = st.ring;
    a.ring_f16 = f16;
    a.ring_stride = row_stride;
    a.window = hp.window;
    a.ring_rows = ring_rows(hp);
    a.mode = l.ratio == 0 ? cd::comp_mode::none : l.ratio == 4 ? cd::comp_mode::list : cd::comp_mode::all;
    a.comp = st.comp_rows;
    a.comp_f16 = f16;
    a.comp_stride = st.comp_stride;
    a.ratio = l.ratio;
    a.sel = cs->sel;
    a.n_sel = cs->n_sel;
    a.max_comp = l.ratio == 4 ? std::min<int64_t>(hp.idx_topk, st.max_comp) : st.max_comp;
    a.rope = rope;
    cd::launch_sparse_sink_attention_batch(a, cs->kv_rows, row_stride, n, std::max(hp.idx_topk, 1), cs->q, pos, cs->part,
                                           cs->o, s);
    // Every token of the chunk has attended: the ring takes the chunk's last rows.
    cd::launch_ring_store_tail(cs->kv_rows, row_stride, n, static_cast<int>(d), static_cast<int>(kv_elem), st.ring,
                               row_stride, ring_rows(hp), pos, s);
    chunk_matmul_grouped(g, l.out_a, hp.o_rank, hp.o_groups, cs->o, H * d, n, cs->z, hp.o_groups * hp.o_rank, s);
    chunk_matmul(g, l.out_b, cs->z, hp.o_groups * hp.o_rank, n, cs->y, D, s);
}

namespace {

// A prefill chunk as an executor of the DS4 forward: the chunk's n rows of one sequence (cs->tokens,
// position *pos) through this device's blocks, products matrix-matrix, the element-wise kernels over a
// token dimension; the state leaving the blocks is in cs->x[0] (two HCPosts per block). The head is the
// caller's (eval_chunk: the rows whose logits are wanted). Synchronises once per layer (MoE expert counts).
class chunk_exec final : public executor {
  public:
    chunk_exec(cuda_sequence::impl &p, int64_t n)
        : p_(p), w_(*p.w), cs_(*p.cs), n_(n), hcp_{w_.hp.n_hc, w_.hp.n_embd, w_.hp.sinkhorn_iters, w_.hp.hc_eps, w_.hp.rms_eps} {}
    void embed() override {
        const int64_t D = w_.hp.n_embd, S = w_.hp.n_hc * D;
        for (int k = 0; k < w_.hp.n_hc; ++k)
            cuda::launch_get_rows(w_.tok_embd.type, w_.tok_embd.p, w_.tok_embd.row_bytes, D, w_.hp.n_vocab, cs_.tokens, n_,
                                  cs_.x[0] + k * D, S, p_.err_d, p_.s);
    }
    void hc_pre(int il, sublayer which) override {
        const dlayer &l = layer(il);
        const bool attn = which == sublayer::attention;
        const dhc &h = attn ? l.hc_attn : l.hc_ffn;
        const int64_t D = w_.hp.n_embd;
        cd::launch_hc_pre_batch(hcp_, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale, cs_.x[cur_], n_, cs_.mix, cs_.xn,
                                cs_.post, cs_.comb, p_.s);
        cuda::launch_rms_norm(cs_.xn, D, attn ? l.attn_norm : l.ffn_norm, w_.hp.rms_eps, D, n_, cs_.xn, D, p_.s);
    }
    void attention(int il) override {
        p_.enqueue_chunk_attention(layer(il), p_.ls[static_cast<size_t>(il - w_.first)], n_);
    }
    void moe(int il) override {
        const dlayer &l = layer(il);
        const int64_t D = w_.hp.n_embd;
        if (cs_.moe) {
            cs_.moe->forward(l.moe, cs_.xn, cs_.tokens, n_, cs_.y, p_.err_d);
        } else {
            for (int64_t t = 0; t < n_; ++t)
                cd::launch_moe_ffn(l.moe, cs_.xn + t * D, cs_.tokens + t, p_.moe, cs_.y + t * D, p_.err_d, p_.s);
        }
    }
    void hc_post() override {
        cd::launch_hc_post_batch(w_.hp.n_hc, w_.hp.n_embd, n_, cs_.y, cs_.x[cur_], cs_.post, cs_.comb, cs_.x[1 - cur_], p_.s);
        cur_ = 1 - cur_;
    }
    void head() override {}  // eval_chunk's: per wanted row, from cs->x[0]
    // DSpark features of the chunk's rows [feat_first_, n) after a capture block (its state is whole here:
    // the chunk applies every HCPost at once) into feat rows 0...
    void after_block(int il) {
        const int t = p_.feat_slot(il);
        if (t < 0 || feat_first_ >= n_) return;
        const int64_t D = w_.hp.n_embd;
        cd::launch_hc_stream_mean(w_.hp.n_hc, D, n_ - feat_first_, cs_.x[cur_] + feat_first_ * w_.hp.n_hc * D,
                                  p_.feat + t * D, p_.feat_floats(), p_.s);
    }
    int64_t feat_first_ = 0;

  private:
    const dlayer &layer(int il) const { return w_.layers[static_cast<size_t>(il - w_.first)]; }
    cuda_sequence::impl &p_;
    const cuda_weights &w_;
    chunk_state &cs_;
    int64_t n_;
    const cd::hc_params hcp_;
    int cur_ = 0;
};

}  // namespace

void cuda_sequence::impl::enqueue_chunk(int64_t n, int64_t feat_first) {
    chunk_exec ex(*this, n);
    ex.feat_first_ = feat_first;
    std::function<void(int)> after;
    if (feat_first < n) after = [&](int il) { ex.after_block(il); };
    run_forward(ex, w->hp.n_layer, w->first, w->last, w->embed(), false, after);
}

// Logits of token i of the chunk (its state in cs->x[0]): HC head, norm, output head, argmax.
void cuda_sequence::eval_chunk(std::span<const int32_t> tokens, const float *x_in, float *x_out, float *logits,
                               bool all_logits, int64_t x_out_first, float *feat_out, int64_t feat_first) {
    impl &p = *p_;
    const hparams &hp = p.w->hp;
    const int64_t n = static_cast<int64_t>(tokens.size()), D = hp.n_embd;
    const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(D), V = static_cast<size_t>(hp.n_vocab);
    ck(cudaSetDevice(p.w->device), "selecting the device");
    *p.h_pos = n_past_;
    ck(cudaMemcpyAsync(p.pos, p.h_pos, sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading the position");
    ck(cudaMemcpyAsync(p.cs->tokens, tokens.data(), tokens.size() * sizeof(int32_t), cudaMemcpyHostToDevice, p.s),
       "uploading tokens");
    if (x_in) ck(cudaMemcpyAsync(p.cs->x[0], x_in, n * S * sizeof(float), cudaMemcpyHostToDevice, p.s), "uploading the state");
    p.enqueue_chunk(n, feat_out ? feat_first : n);
    if (feat_out)
        ck(cudaMemcpyAsync(feat_out, p.feat, static_cast<size_t>((n - feat_first) * p.feat_floats()) * sizeof(float),
                           cudaMemcpyDeviceToHost, p.s),
           "downloading features");
    if (x_out)
        ck(cudaMemcpyAsync(x_out, p.cs->x[0] + x_out_first * S, (n - x_out_first) * S * sizeof(float), cudaMemcpyDeviceToHost,
                           p.s),
           "downloading the state");
    if (p.w->head()) {  // the last token's logits always (they stay on the device), others on request
        const cd::hc_params hcp{hp.n_hc, D, hp.sinkhorn_iters, hp.hc_eps, hp.rms_eps};
        const dhc &h = p.w->hc_head;
        for (int64_t i = logits && all_logits ? 0 : n - 1; i < n; ++i) {
            cd::launch_hc_head(hcp, h.fn.type, h.fn.p, h.fn.row_bytes, h.base, h.scale, p.cs->x[0] + i * S, p.mix, p.zh, p.s);
            cuda::launch_rms_norm(p.zh, D, p.w->output_norm, hp.rms_eps, D, 1, p.zh, D, p.s);
            gemv(p.w->output, p.zh, p.logits, p.s);
            if (logits)
                ck(cudaMemcpyAsync(logits + (all_logits ? static_cast<size_t>(i) * V : 0), p.logits, V * sizeof(float),
                                   cudaMemcpyDeviceToHost, p.s),
                   "downloading logits");
        }
    }
    const cudaError_t e = cudaStreamSynchronize(p.s);
    if (e != cudaSuccess || *p.err_h != 0) {
        const uint32_t bits = *p.err_h;
        reset();
        if (e != cudaSuccess) throw error(std::string("cuda ds4: prefill chunk: ") + cudaGetErrorString(e));
        char b[16];
        std::snprintf(b, sizeof b, "%x", bits);
        throw error("cuda ds4: device-side error 0x" + std::string(b) + " in the prefill chunk at position " +
                    std::to_string(*p.h_pos) + " (bad token/expert id or a row index past its buffer); the sequence was reset");
    }
    n_past_ += n;
    reached_ = std::max(reached_, n_past_);
    have_logits_ = p.w->head();
}

// ---- saved states -------------------------------------------------------------------------------------
// The stream is ds4::write_state's (deepseek4_state.cpp, docs/prompt-cache.md "DS4 state"). The device
// buffers have the layouts of the CPU's layer_state (position-indexed raw ring of window + max_rollback
// rows, position-indexed frontiers, rows in order), so a layer goes through a host layer_state and
// ds4::put_layer_state / get_layer_state, one layer at a time.
namespace {
// (device address, host bytes) of a layer's buffers in a host layer_state of the same layout; the row
// stores sized for n_past first.
struct state_region {
    void *dev;
    std::span<uint8_t> host;
    size_t pitch = 0, width = 0;  // rows of `width` bytes, `pitch` apart on the device (0: contiguous)
};
// host <-> device for one region (rows interleaved on the device: layer_state_dev::comp_stride).
void copy_region(const state_region &g, bool to_host) {
    if (g.host.empty()) return;
    if (g.pitch == 0) {
        ck(to_host ? cudaMemcpy(g.host.data(), g.dev, g.host.size(), cudaMemcpyDeviceToHost)
                   : cudaMemcpy(g.dev, g.host.data(), g.host.size(), cudaMemcpyHostToDevice),
           to_host ? "saving the state" : "loading the state");
        return;
    }
    const size_t rows = g.host.size() / g.width;
    ck(to_host ? cudaMemcpy2D(g.host.data(), g.width, g.dev, g.pitch, g.width, rows, cudaMemcpyDeviceToHost)
               : cudaMemcpy2D(g.dev, g.pitch, g.host.data(), g.width, g.width, rows, cudaMemcpyHostToDevice),
       to_host ? "saving the state" : "loading the state");
}
std::span<uint8_t> float_bytes(std::vector<float> &v) {
    return {reinterpret_cast<uint8_t *>(v.data()), v.size() * sizeof(float)};
}
std::vector<state_region> layer_regions(const layer_state_dev &st, int ratio, int64_t n_past, layer_state &h) {
    std::vector<state_region> r{{st.ring, h.raw.bytes()}};
    if (ratio > 0) {
        h.comp_rows.resize(n_past / ratio);
        r.push_back({st.comp_kv, float_bytes(h.comp.kv)});
        r.push_back({st.comp_score, float_bytes(h.comp.score)});
        r.push_back({st.comp_rows, h.comp_rows.bytes(), st.comp_stride, h.comp_rows.bytes().size() / std::max<size_t>(1, static_cast<size_t>(h.comp_rows.size()))});
    }
    if (ratio == 4) {
        h.idx_rows.resize(n_past / 4);
        r.push_back({st.ic_kv, float_bytes(h.idx_comp.kv)});
        r.push_back({st.ic_score, float_bytes(h.idx_comp.score)});
        r.push_back({st.idx_rows, h.idx_rows.bytes(), st.idx_stride, h.idx_rows.bytes().size() / std::max<size_t>(1, static_cast<size_t>(h.idx_rows.size()))});
    }
    return r;
}
}  // namespace

void cuda_sequence::save_state(state_writer &w) const {
    const impl &p = *p_;
    const hparams &hp = p.w->hp;
    if (!p.w->embed() || !p.w->head()) throw error("cuda ds4: a pipeline stage's state cannot be saved");
    ck(cudaSetDevice(p.w->device), "selecting the device");
    ck(cudaStreamSynchronize(p.s), "saving the state");
    put_state_header(w, hp, n_past_, p.w->opt.kv, p.w->opt.qat);
    for (size_t il = 0; il < p.ls.size(); ++il) {
        const int ratio = p.w->layers[il].ratio;
        layer_state h = new_layer_state(hp, ratio, p.w->opt.kv);
        for (const state_region &g : layer_regions(p.ls[il], ratio, n_past_, h)) copy_region(g, true);
        put_layer_state(w, hp, ratio, h, n_past_);
    }
}

void cuda_sequence::load_state(state_reader &r, int64_t n_past) {
    impl &p = *p_;
    rows_held_ = 0;
    const hparams &hp = p.w->hp;
    if (!p.w->embed() || !p.w->head()) throw error("cuda ds4: a pipeline stage cannot load a state");
    if (n_past < 0 || n_past > n_ctx_)
        throw error("saved state: " + std::to_string(n_past) + " tokens do not fit this sequence's " +
                    std::to_string(n_ctx_) + "-token context");
    reset();  // also on failure below: a half-loaded state must not be used
    try {
        check_state_header(r, hp, n_past, p.w->opt.kv, p.w->opt.qat);
        map_rows(n_past);
        ck(cudaSetDevice(p.w->device), "selecting the device");
        for (size_t il = 0; il < p.ls.size(); ++il) {
            const int ratio = p.w->layers[il].ratio;
            layer_state h = new_layer_state(hp, ratio, p.w->opt.kv);
            get_layer_state(r, hp, static_cast<int>(il), h, n_past);
            for (const state_region &g : layer_regions(p.ls[il], ratio, n_past, h)) copy_region(g, false);
        }
    } catch (...) {
        reset();
        throw;
    }
    n_past_ = n_past;
    reached_ = floor_ = n_past;  // the stream keeps no rows older than plain decoding reads
    have_logits_ = false;
}

void cuda_sequence::restore_logits(std::span<const float> logits) {
    impl &p = *p_;
    if (!p.w->head()) throw error("cuda ds4: a stage without the head has no logits");
    if (logits.size() != static_cast<size_t>(p.w->hp.n_vocab)) throw error("cuda ds4: restore_logits needs n_vocab floats");
    ck(cudaSetDevice(p.w->device), "selecting the device");
    ck(cudaMemcpy(p.logits, logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice), "restoring logits");
    have_logits_ = true;
}

void cuda_sequence::last_logits(std::span<float> out) {
    impl &p = *p_;
    if (!have_logits_) throw error("cuda ds4: no logits (nothing evaluated since the reset, or a stage without the head)");
    if (out.size() != static_cast<size_t>(p.w->hp.n_vocab)) throw error("cuda ds4: last_logits needs n_vocab floats");
    ck(cudaSetDevice(p.w->device), "selecting the device");
    ck(cudaMemcpyAsync(out.data(), p.logits, out.size() * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading logits");
    ck(cudaStreamSynchronize(p.s), "downloading logits");
}

cuda_sequence::top_summary cuda_sequence::logits_top(int k, std::span<const std::pair<int32_t, int32_t>> penalties,
                                                     float repeat, float frequency, float presence) {
    if (!have_logits_) throw error("cuda ds4: no logits (nothing evaluated since the reset, or a stage without the head)");
    return top_of(p_->logits, k, penalties, repeat, frequency, presence);
}

const float *cuda_sequence::row_device_ptr(int j, const char *what) const {
    if (j < 0 || j >= rows_held_ || !have_logits_)
        throw error(std::string("cuda ds4: ") + what + ": row " + std::to_string(j) + " is not held (" +
                    std::to_string(rows_held_) + " rows of the last multi-row evaluation)");
    return rows_held_ == 1 ? p_->logits : p_->rows_logits + static_cast<size_t>(j) * static_cast<size_t>(p_->w->hp.n_vocab);
}

cuda_sequence::top_summary cuda_sequence::row_top(int j, int k, std::span<const std::pair<int32_t, int32_t>> penalties,
                                                  float repeat, float frequency, float presence) {
    return top_of(row_device_ptr(j, "row_top"), k, penalties, repeat, frequency, presence);
}

void cuda_sequence::row_logits(int j, std::span<float> out) {
    impl &p = *p_;
    const float *src = row_device_ptr(j, "row_logits");
    if (out.size() != static_cast<size_t>(p.w->hp.n_vocab)) throw error("cuda ds4: row_logits needs n_vocab floats");
    ck(cudaSetDevice(p.w->device), "selecting the device");
    ck(cudaMemcpyAsync(out.data(), src, out.size() * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading a row's logits");
    ck(cudaStreamSynchronize(p.s), "downloading a row's logits");
}

// The summary of the logits at `logits` (device, n_vocab floats): cuda_sample.h's launch_logits_top.
cuda_sequence::top_summary cuda_sequence::top_of(const float *logits, int k,
                                                 std::span<const std::pair<int32_t, int32_t>> penalties, float repeat,
                                                 float frequency, float presence) {
    impl &p = *p_;
    const int64_t V = p.w->hp.n_vocab;
    k = static_cast<int>(std::min<int64_t>(std::clamp(k, 1, cuda::logits_top_max_k), V));
    ck(cudaSetDevice(p.w->device), "selecting the device");
    impl::sample_state &ss = p.ss;
    if (!ss.work) {
        ss.work = p.dev<float>(static_cast<size_t>(V));
        ss.vals = p.dev<float>(cuda::logits_top_max_k);
        ss.ids = p.dev<int32_t>(cuda::logits_top_max_k);
        ss.max = p.dev<float>(1);
        ss.z = p.dev<double>(1);
        ss.bad = p.dev<uint32_t>(1);
    }
    const int n_pen = static_cast<int>(penalties.size());
    if (n_pen > ss.pen_cap) {
        ss.pen = p.dev<int32_t>(2 * static_cast<size_t>(n_pen));  // the old buffer stays allocated until the sequence dies
        ss.pen_cap = n_pen;
    }
    std::vector<int32_t> pen(2 * static_cast<size_t>(n_pen));
    for (int j = 0; j < n_pen; ++j) {
        if (penalties[static_cast<size_t>(j)].first < 0 || penalties[static_cast<size_t>(j)].first >= V)
            throw error("cuda ds4: penalty token outside the vocabulary");
        pen[static_cast<size_t>(j)] = penalties[static_cast<size_t>(j)].first;
        pen[static_cast<size_t>(n_pen + j)] = penalties[static_cast<size_t>(j)].second;
    }
    if (n_pen > 0)
        ck(cudaMemcpyAsync(ss.pen, pen.data(), pen.size() * sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading penalties");
    cuda::logits_top_args a;
    a.logits = logits;
    a.n = V;
    a.pen_ids = ss.pen;
    a.pen_counts = ss.pen ? ss.pen + n_pen : nullptr;
    a.n_pen = n_pen;
    a.repeat = repeat;
    a.frequency = frequency;
    a.presence = presence;
    a.k = k;
    cuda::launch_logits_top(a, {ss.ids, ss.vals, ss.max, ss.z, ss.bad, ss.work}, p.s);
    top_summary r;
    r.ids.resize(static_cast<size_t>(k));
    r.logits.resize(static_cast<size_t>(k));
    ck(cudaMemcpyAsync(r.ids.data(), ss.ids, r.ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, p.s), "downloading");
    ck(cudaMemcpyAsync(r.logits.data(), ss.vals, r.logits.size() * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading");
    ck(cudaMemcpyAsync(&r.max_logit, ss.max, sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading");
    ck(cudaMemcpyAsync(&r.z, ss.z, sizeof(double), cudaMemcpyDeviceToHost, p.s), "downloading");
    ck(cudaMemcpyAsync(&r.bad, ss.bad, sizeof(uint32_t), cudaMemcpyDeviceToHost, p.s), "downloading");
    ck(cudaStreamSynchronize(p.s), "summarising logits");
    return r;
}

void cuda_sequence::step(int32_t tok, float *logits_host, int32_t *argmax_host, const float *x_in, float *x_out,
                         float *feat_out) {
    impl &p = *p_;
    rows_held_ = 0;
    const hparams &hp = p.w->hp;
    const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd);
    if (tok < 0 || tok >= hp.n_vocab)
        throw error("cuda ds4: token id " + std::to_string(tok) + " outside [0, " + std::to_string(hp.n_vocab) + ")");
    if (n_past_ >= n_ctx_) throw error("cuda ds4: context full (" + std::to_string(n_ctx_) + " tokens)");
    map_rows(n_past_ + 1);
    ck(cudaSetDevice(p.w->device), "selecting the device");
    *p.h_pos = n_past_;
    *p.h_token = tok;
    ck(cudaMemcpyAsync(p.pos, p.h_pos, sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading the position");
    ck(cudaMemcpyAsync(p.token, p.h_token, sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading the token");
    if (x_in)  // the MTP head mixes its input state in the step (step_exec::embed_mtp); a stage starts from it
        ck(cudaMemcpyAsync(p.w->mtp ? p.hc_in : p.x[0], x_in, S * sizeof(float), cudaMemcpyHostToDevice, p.s),
           "uploading the state");
    launch_step_graph(false);
    if (logits_host)
        ck(cudaMemcpyAsync(logits_host, p.logits, static_cast<size_t>(hp.n_vocab) * sizeof(float),
                           cudaMemcpyDeviceToHost, p.s),
           "downloading logits");
    if (argmax_host) ck(cudaMemcpyAsync(p.h_amax, p.amax, sizeof(int32_t), cudaMemcpyDeviceToHost, p.s), "downloading");
    if (x_out) ck(cudaMemcpyAsync(x_out, p.x[0], S * sizeof(float), cudaMemcpyDeviceToHost, p.s), "downloading the state");
    if (feat_out)
        ck(cudaMemcpyAsync(feat_out, p.feat, static_cast<size_t>(p.feat_floats()) * sizeof(float), cudaMemcpyDeviceToHost, p.s),
           "downloading features");
    ck(cudaStreamSynchronize(p.s), "decode step");
    check_device_error();
    if (argmax_host) *argmax_host = *p.h_amax;
    ++n_past_;
    reached_ = std::max(reached_, n_past_);
    have_logits_ = p.w->head();
}

void cuda_sequence::check_tokens(std::span<const int32_t> tokens) const {
    const hparams &hp = p_->w->hp;
    if (p_->w->mtp) throw error("cuda ds4: the MTP head evaluates its rows one at a time (eval_mtp)");
    if (n_past_ + static_cast<int64_t>(tokens.size()) > n_ctx_)
        throw error("cuda ds4: " + std::to_string(n_past_) + " + " + std::to_string(tokens.size()) +
                    " tokens exceed n_ctx " + std::to_string(n_ctx_));
    for (int32_t t : tokens)
        if (t < 0 || t >= hp.n_vocab)
            throw error("cuda ds4: token id " + std::to_string(t) + " outside [0, " + std::to_string(hp.n_vocab) + ")");
}

void cuda_sequence::eval_stage(std::span<const int32_t> tokens, std::span<float> x, std::span<float> logits) {
    eval_impl(tokens, x, logits, {});
}

void cuda_sequence::eval_impl(std::span<const int32_t> tokens, std::span<float> x, std::span<float> logits,
                              std::span<float> hc_tail, std::span<float> feat_tail) {
    rows_held_ = 0;
    const cuda_weights &w = *p_->w;
    const size_t n = tokens.size(), V = static_cast<size_t>(w.hp.n_vocab);
    const size_t S = static_cast<size_t>(w.hp.n_hc) * static_cast<size_t>(w.hp.n_embd);
    if ((!w.embed() || !w.head()) && x.size() != n * S)
        throw error("cuda ds4: stage state buffer of " + std::to_string(x.size()) + " floats, expected " +
                    std::to_string(n * S));
    if (!logits.empty() && (!w.head() || (logits.size() != V && logits.size() != n * V)))
        throw error("cuda ds4: logits buffer of " + std::to_string(logits.size()) + " floats " +
                    (w.head() ? "(expected n_vocab = " + std::to_string(V) + " or n * n_vocab = " + std::to_string(n * V) + ")"
                              : "for a stage without the output head"));
    if (hc_tail.size() % S != 0 || hc_tail.size() / S > n)
        throw error("cuda ds4: hc_tail buffer of " + std::to_string(hc_tail.size()) + " floats for " + std::to_string(n) +
                    " tokens of " + std::to_string(S) + "-float states");
    const size_t F = static_cast<size_t>(p_->feat_floats());
    if (!feat_tail.empty() && (F == 0 || feat_tail.size() % F != 0 || feat_tail.size() / F > n ||
                               static_cast<int64_t>(feat_tail.size() / F) > p_->feat_rows))
        throw error("cuda ds4: features buffer of " + std::to_string(feat_tail.size()) + " floats for " + std::to_string(n) +
                    " tokens of " + std::to_string(F) + "-float features (at most " + std::to_string(p_->feat_rows) +
                    " rows; set_feature_layers)");
    check_tokens(tokens);
    map_rows(n_past_ + static_cast<int64_t>(n));
    const size_t t0 = n - hc_tail.size() / S;  // the first token whose state goes to hc_tail
    const size_t f0 = feat_tail.empty() ? n : n - feat_tail.size() / F;  // ... whose features go to feat_tail
    if (n > 1 && chunk_ > 1) {  // layer-major chunks
        p_->take_chunk();
        struct give_back {
            impl &p;
            ~give_back() { p.give_back_chunk(); }
        } g{*p_};
        const bool all = logits.size() == n * V && n > 0;
        for (size_t c0 = 0; c0 < n; c0 += static_cast<size_t>(chunk_)) {
            const size_t m = std::min(n - c0, static_cast<size_t>(chunk_));
            const bool last = c0 + m == n;
            float *lg = logits.empty() ? nullptr : all ? logits.data() + c0 * V : last ? logits.data() : nullptr;
            float *out = w.head() ? nullptr : x.data() + c0 * S;
            size_t first = 0;
            if (w.head() && !hc_tail.empty() && c0 + m > t0) {  // this chunk holds some of the tail
                first = t0 > c0 ? t0 - c0 : 0;
                out = hc_tail.data() + (c0 + first - t0) * S;
            }
            float *fo = nullptr;
            size_t ff = m;
            if (c0 + m > f0) {  // ... some of the features' tail
                ff = f0 > c0 ? f0 - c0 : 0;
                fo = feat_tail.data() + (c0 + ff - f0) * F;
            }
            eval_chunk(tokens.subspan(c0, m), w.embed() ? nullptr : x.data() + c0 * S, out, lg, all,
                       static_cast<int64_t>(first), fo, static_cast<int64_t>(ff));
        }
        return;
    }
    for (size_t i = 0; i < n; ++i) {
        float *out = nullptr;
        if (logits.size() == n * V)
            out = logits.data() + i * V;
        else if (!logits.empty() && i + 1 == n)
            out = logits.data();
        float *state = w.head() ? (i >= t0 && !hc_tail.empty() ? hc_tail.data() + (i - t0) * S : nullptr) : x.data() + i * S;
        step(tokens[i], out, nullptr, w.embed() ? nullptr : x.data() + i * S, state,
             i >= f0 ? feat_tail.data() + (i - f0) * F : nullptr);
    }
}

int32_t cuda_sequence::eval_mtp(int32_t next_token, std::span<const float> hc, std::span<float> logits,
                                std::span<float> hc_out) {
    impl &p = *p_;
    const hparams &hp = p.w->hp;
    const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd);
    if (!p.w->mtp) throw error("cuda ds4: eval_mtp needs the MTP head's weights (cuda_upload_mtp)");
    if (hc.size() != S || (!hc_out.empty() && hc_out.size() != S) ||
        (!logits.empty() && logits.size() != static_cast<size_t>(hp.n_vocab)))
        throw error("cuda ds4: eval_mtp buffers: state " + std::to_string(hc.size()) + ", output state " +
                    std::to_string(hc_out.size()) + " and logits " + std::to_string(logits.size()) +
                    " floats (expected n_hc * D = " + std::to_string(S) + " and n_vocab)");
    int32_t amax = -1;
    step(next_token, logits.empty() ? nullptr : logits.data(), &amax, hc.data(), hc_out.empty() ? nullptr : hc_out.data());
    return amax;
}

void cuda_sequence::launch_step_graph(bool state_only) {
    impl &p = *p_;
    const auto enqueue = [&] {
        if (state_only) p.enqueue_state_row();
        else p.enqueue_step();
    };
    if (!p.use_graph) {
        try {
            enqueue();
        } catch (...) {
            p.join_side();
            throw;
        }
        return;
    }
    cudaGraphExec_t &graph = state_only ? p.graph_state : p.graph;
    if (!graph) {
        cudaGraph_t g = nullptr;
        ck(cudaStreamBeginCapture(p.s, cudaStreamCaptureModeThreadLocal), "beginning graph capture");
        // Side streams join the capture through the fork events and rejoin s before its end
        // (enqueue_attention), so the graph holds the branches as parallel paths.
        try {
            enqueue();
        } catch (...) {
            p.join_side();
            cudaStreamEndCapture(p.s, &g);
            if (g) cudaGraphDestroy(g);
            throw;
        }
        ck(cudaStreamEndCapture(p.s, &g), "ending graph capture");
        const cudaError_t e = cudaGraphInstantiate(&graph, g, 0);
        cudaGraphDestroy(g);
        ck(e, "instantiating the decode graph");
    }
    ck(cudaGraphLaunch(graph, p.s), "launching the decode graph");
    ++replays_;
}

void cuda_sequence::check_device_error() {
    impl &p = *p_;
    if (*p.err_h == 0) return;
    const uint32_t e = *p.err_h;
    const int64_t at = *p.h_pos;
    reset();
    char b[16];
    std::snprintf(b, sizeof b, "%x", e);
    throw error("cuda ds4: device-side error 0x" + std::string(b) + " at position " + std::to_string(at) +
                " (bad token/expert id or a row index past its buffer); the sequence was reset");
}

void cuda_sequence::observe_mtp(std::span<const int32_t> next_tokens, std::span<const float> hc) {
    impl &p = *p_;
    const hparams &hp = p.w->hp;
    const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd), n = next_tokens.size();
    if (!p.w->mtp) throw error("cuda ds4: observe_mtp needs the MTP head's weights (cuda_upload_mtp)");
    if (hc.size() != n * S)
        throw error("cuda ds4: observe_mtp states of " + std::to_string(hc.size()) + " floats for " + std::to_string(n) +
                    " rows (expected n * n_hc * D)");
    for (int32_t t : next_tokens)
        if (t < 0 || t >= hp.n_vocab)
            throw error("cuda ds4: token id " + std::to_string(t) + " outside [0, " + std::to_string(hp.n_vocab) + ")");
    if (n_past_ + static_cast<int64_t>(n) > n_ctx_)
        throw error("cuda ds4: " + std::to_string(n_past_) + " + " + std::to_string(n) + " rows exceed n_ctx " +
                    std::to_string(n_ctx_));
    if (n == 0) return;
    rows_held_ = 0;
    map_rows(n_past_ + static_cast<int64_t>(n));
    ck(cudaSetDevice(p.w->device), "selecting the device");
    constexpr size_t B = impl::kObserveRows;
    if (!p.obs_hc) {
        ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_obs_pos), B * sizeof(int64_t), cudaHostAllocDefault), "pinned memory");
        ck(cudaHostAlloc(reinterpret_cast<void **>(&p.h_obs_tok), B * sizeof(int32_t), cudaHostAllocDefault), "pinned memory");
        p.obs_hc = p.dev<float>(B * S);
    }
    for (size_t i0 = 0; i0 < n; i0 += B) {  // B rows queued back to back, then one synchronisation
        const size_t m = std::min(B, n - i0);
        ck(cudaMemcpyAsync(p.obs_hc, hc.data() + i0 * S, m * S * sizeof(float), cudaMemcpyHostToDevice, p.s),
           "uploading the states");
        for (size_t i = 0; i < m; ++i) {
            p.h_obs_pos[i] = n_past_ + static_cast<int64_t>(i);
            p.h_obs_tok[i] = next_tokens[i0 + i];
            ck(cudaMemcpyAsync(p.pos, p.h_obs_pos + i, sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading the position");
            ck(cudaMemcpyAsync(p.token, p.h_obs_tok + i, sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading the token");
            ck(cudaMemcpyAsync(p.hc_in, p.obs_hc + i * S, S * sizeof(float), cudaMemcpyDeviceToDevice, p.s),
               "staging the state");
            launch_step_graph(true);
        }
        ck(cudaStreamSynchronize(p.s), "observing rows");
        *p.h_pos = n_past_;  // the first row of the batch, for the error message
        check_device_error();
        n_past_ += static_cast<int64_t>(m);
        reached_ = std::max(reached_, n_past_);
    }
    have_logits_ = false;
}

void cuda_sequence::eval(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_tail,
                         std::span<float> features_tail) {
    if (!p_->w->embed() || !p_->w->head()) throw error("cuda ds4: eval() needs the whole model; a stage uses eval_stage()");
    eval_impl(tokens, {}, logits, hc_tail, features_tail);  // the whole model: no state enters through the host
}

void cuda_sequence::set_feature_layers(std::span<const int> layers, int64_t tail_rows) {
    impl &p = *p_;
    const cuda_weights &w = *p.w;
    if (!layers.empty() && (!w.embed() || !w.head() || w.mtp))
        throw error("cuda ds4: feature capture needs the whole target model on this device");
    for (int il : layers)
        if (il < 0 || il >= w.hp.n_layer)
            throw error("cuda ds4: feature layer " + std::to_string(il) + " outside the model's " +
                        std::to_string(w.hp.n_layer) + " blocks");
    if (tail_rows < 0) throw error("cuda ds4: negative feature rows");
    ck(cudaSetDevice(w.device), "selecting the device");
    ck(cudaStreamSynchronize(p.s), "feature capture");
    if (p.graph) {  // captured with the old capture points
        cudaGraphExecDestroy(p.graph);
        p.graph = nullptr;
    }
    p.feat_layers.assign(layers.begin(), layers.end());
    ++p.feat_epoch;
    const int64_t rows = layers.empty() ? 0 : std::max<int64_t>(tail_rows, cd::gemv_max_rows);
    const size_t need = static_cast<size_t>(rows * p.feat_floats());
    if (need > p.feat_cap) {  // (the smaller buffer stays allocated until the sequence goes)
        p.feat = p.dev<float>(need);
        p.feat_cap = need;
    }
    p.feat_rows = rows;
}

}  // namespace fathom::ds4
