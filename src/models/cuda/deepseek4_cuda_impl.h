// Internal to the CUDA DS4 model (src/models/cuda/deepseek4_cuda*.cpp): the device weights, a sequence's
// device state and scratch (cuda_sequence::impl), and the helpers the executors share. Not a public header.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_vmm.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_testing.h"
#include "models/deepseek4_dspark.h"

namespace fathom::ds4 {

namespace cd = cuda::ds4;

namespace cuda_impl {

inline void ck(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw error(std::string("cuda ds4: ") + what + ": " + cudaGetErrorString(e));
}

// Device buffers an owner frees together (free_all: in its destructor, after whatever must stop using them;
// else at the end): dev<T>(n) is n T's plus 256 bytes of padding; `what` names them in the allocation error.
class device_buffers {
  public:
    explicit device_buffers(const char *what) : what_(what) {}
    device_buffers(const device_buffers &) = delete;
    device_buffers &operator=(const device_buffers &) = delete;
    ~device_buffers() { free_all(); }
    template <class T>
    T *dev(size_t n) {
        void *p = nullptr;
        ck(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T) + 256), what_);
        allocs_.push_back(p);
        return static_cast<T *>(p);
    }
    void free_all() noexcept {
        for (void *p : allocs_) cudaFree(p);
        allocs_.clear();
    }

  private:
    const char *what_;
    std::vector<void *> allocs_;
};

inline std::string gib(double b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.2f GiB", b / (1024.0 * 1024.0 * 1024.0));
    return s;
}

// A device matrix [rows, cols] in its GGUF format, rows row_bytes apart.
struct dmat {
    dtype type = dtype::f32;
    const void *p = nullptr;  // GGUF rows (null when only the fast form is kept)
    size_t row_bytes = 0;
    int64_t rows = 0, cols = 0;
    bool fast = false;        // fw is valid: ds4_gemv.h's decode GEMV (q8_0 repacked, f16/f32 in place)
    cd::gemv_weight fw;
};
struct dhc {
    dmat fn;
    const float *base = nullptr, *scale = nullptr;
};
struct dcomp {
    int ratio = 0, dim = 0;
    dmat kv, gate;
    const float *ape = nullptr, *norm = nullptr;
};
struct dlayer {
    int ratio = 0;
    const float *attn_norm = nullptr, *ffn_norm = nullptr;
    dhc hc_attn, hc_ffn;
    dmat q_a, q_b, kv, out_a, out_b, idx_q_b, idx_proj;
    const float *q_a_norm = nullptr, *kv_norm = nullptr, *sinks = nullptr;
    dcomp comp, idx_comp;
    cd::moe_layer moe;
};

struct layer_state_dev {
    void *ring = nullptr;  // [window, d]
    float *comp_kv = nullptr, *comp_score = nullptr;  // [slots, c*d]
    void *comp_rows = nullptr;                        // [max_comp, d], rows comp_stride bytes apart
    int64_t max_comp = 0;
    float *ic_kv = nullptr, *ic_score = nullptr;  // [8, 2*idx_dim]
    void *idx_rows = nullptr;                     // [max_comp, idx_dim], rows idx_stride bytes apart
    // The rows of every layer of a kind (compressed rows of one ratio, indexer rows) are interleaved in one
    // buffer: row r of the kind's k-th layer at base + (r * layers + k) * row bytes (cuda_sequence::impl::
    // row_region), so paged state rounds one buffer per kind, not one per layer, up to whole blocks.
    size_t comp_stride = 0, idx_stride = 0;
    size_t comp_state_floats = 0, ic_state_floats = 0;
};

// Helpers shared by the executors (defined in deepseek4_cuda.cpp).
// y = W x for one token: the fast decode GEMV when the weight has it, else the generic one.
void gemv(const dmat &m, const float *x, float *y, cudaStream_t s);
// Several weights reading the same x, over nx rows of x (x_stride floats apart; every y is [nx, its
// weight's rows]): one launch of the columns form when every weight has the fast form (each row's outputs
// bit-identical to its single-row launch, ds4_gemv.h), else the single-row path row by row. With norm_w, of
// RMSNorm(x) (n floats, eps), as the one-row gemv_multi.
void gemv_multi_rows(std::initializer_list<std::pair<const dmat *, float *>> mats, int nx, float *x, int64_t x_stride,
                     cudaStream_t s, const float *norm_w = nullptr, float eps = 0.0f, int64_t n = 0);
// Frontier slots of a compressor of this ratio and raw ring rows (both with ds4::max_rollback spare).
int frontier_slots(int ratio);
int ring_rows(const hparams &hp);
// One compressor's launch arguments (decode step, chunk, multi-row step).
cd::compressor_args comp_args(const hparams &hp, const dcomp &c, const cd::rope_args &yarn, cd::qat_kind qk, float *skv,
                              float *sscore, void *rows, bool f16, size_t row_stride, int64_t max_rows);

}  // namespace cuda_impl

using namespace cuda_impl;

class cuda_weights {
  public:
    hparams hp;
    cuda_run_options opt;
    cuda_testing::cuda_test_options test;  // default except under cuda_testing::cuda_upload
    int device = 0;
    int first = 0, last = 0;  // blocks [first, last) on this device
    bool embed() const { return first == 0; }
    bool head() const { return last == hp.n_layer; }
    std::vector<void *> allocs;
    size_t bytes = 0;
    double step_bytes = 0;
    dmat tok_embd, output;
    const float *output_norm = nullptr;
    dhc hc_head;
    std::vector<dlayer> layers;
    const float *rope_plain = nullptr, *rope_yarn = nullptr;
    // The MTP head (cuda_upload_mtp): one block whose input is mixed from the target's final HC state and
    // the next token's embedding (step_exec::embed), tok_embd and output aliasing the target's copies
    // (kept alive by `target`, not in allocs).
    bool mtp = false;
    dmat e_proj, h_proj;  // [D, D] each
    const float *enorm = nullptr, *hnorm = nullptr;
    std::shared_ptr<const cuda_weights> target;
    // The DSpark drafter (cuda_upload_dspark, deepseek4_cuda_dspark.h): `layers` are its stages (ratio 0,
    // learned routing), hc_head / output_norm the drafter's own, tok_embd / output the target's (aliases,
    // as the MTP head's); the rest below.
    struct dspark_parts {
        dspark_config cfg;
        dmat fc;                            // [D, F]
        const float *hidden_norm = nullptr;  // [D]
        dmat markov_w1, markov_w2;          // [V, r] each: a table (get_rows) and a GEMV
        const float *conf_w = nullptr;      // [D + r]
        float conf_bias = 0;
        // RoPE tables of the stages: the plain table, its negation (a rotation by -angle: the inverse RoPE of
        // the outputs) and zeros (no rotation: the attention's own inverse RoPE switched off)
        const float *rope_neg = nullptr, *rope_zero = nullptr;
    };
    std::unique_ptr<dspark_parts> dspark;
    cuda_weights() = default;
    cuda_weights(const cuda_weights &) = delete;
    cuda_weights &operator=(const cuda_weights &) = delete;
    ~cuda_weights() {
        cudaSetDevice(device);
        for (void *p : allocs) cudaFree(p);
    }
};

namespace cuda_impl {

// Copies host tensors to the device once each (a map from host address to device address), with
// 256 zeroed bytes after every buffer (block decoders read a little past a row; float expert rows
// up to 31 elements). replicate > 0: sparse synthetic file, rows >= replicate repeat rows 0..P-1.
class uploader {
  public:
    uploader(cuda_weights &w, int64_t replicate, uint64_t total, const std::function<void(uint64_t, uint64_t)> &cb)
        : w_(w), replicate_(replicate), total_(total), cb_(cb) {}

    const void *bytes(const uint8_t *src, size_t n, size_t row_bytes, int64_t rows) {
        if (auto it = seen_.find(src); it != seen_.end()) return it->second;
        void *d = nullptr;
        ck(cudaMalloc(&d, n + 256), "allocating weights");
        w_.allocs.push_back(d);
        ck(cudaMemset(static_cast<uint8_t *>(d) + n, 0, 256), "padding");
        if (replicate_ > 0 && rows > replicate_ && row_bytes > 0) {
            size_t have = static_cast<size_t>(replicate_) * row_bytes;
            ck(cudaMemcpy(d, src, have, cudaMemcpyHostToDevice), "uploading weights");
            while (have < n) {  // doubling device copies: row r = row r mod P
                const size_t c = std::min(have, n - have);
                ck(cudaMemcpy(static_cast<uint8_t *>(d) + have, d, c, cudaMemcpyDeviceToDevice), "replicating rows");
                have += c;
            }
        } else {
            ck(cudaMemcpy(d, src, n, cudaMemcpyHostToDevice), "uploading weights");
        }
        w_.bytes += n;
        done_ += n;
        if (cb_) cb_(std::min(done_, total_), total_);
        seen_.emplace(src, d);
        return d;
    }
    // gemv: the matrix is only ever multiplied by launch_gemv-style decode GEMVs, so it gets the fast
    // form when ds4_gemv supports its type and shape (q8_0: repacked once on the device, the GGUF copy
    // freed; f16 / f32: used in place).
    dmat mat(const matrix &m, bool gemv = false) {
        dmat r;
        r.type = m.type;
        r.rows = m.rows;
        r.cols = m.cols;
        r.row_bytes = m.row_bytes;
        if (!m.data) return r;
        const size_t n = static_cast<size_t>(m.rows - 1) * m.row_bytes + dtype_row_bytes(m.type, m.cols);
        r.p = bytes(m.data, n, m.row_bytes, m.rows);
        if (!gemv || !cd::gemv_fast_supported(m.type, m.cols) || (m.type != dtype::q8_0 && m.row_bytes % 16 != 0))
            return r;
        void *dst = nullptr;
        if (m.type == dtype::q8_0) {
            ck(cudaMalloc(&dst, cd::gemv_prepared_bytes(m.type, m.rows, m.cols) + 256), "allocating weights");
            w_.allocs.push_back(dst);
        }
        r.fw = cd::gemv_prepare(m.type, r.p, m.row_bytes, m.rows, m.cols, dst, nullptr);
        r.fast = true;
        if (m.type == dtype::q8_0) {  // the repacked copy replaces the GGUF rows
            ck(cudaDeviceSynchronize(), "repacking weights");
            void *raw = const_cast<void *>(r.p);
            w_.allocs.erase(std::find(w_.allocs.begin(), w_.allocs.end(), raw));
            seen_.erase(m.data);
            ck(cudaFree(raw), "freeing repacked rows");
            r.p = nullptr;
        }
        return r;
    }
    const float *vec(const std::vector<float> &v) {
        if (v.empty()) return nullptr;
        return static_cast<const float *>(bytes(reinterpret_cast<const uint8_t *>(v.data()), v.size() * sizeof(float), 0, 0));
    }
    cd::expert_bank bank(const expert_bank &b) {
        cd::expert_bank r;
        r.type = b.first.type;
        r.row_bytes = b.first.row_bytes;
        r.expert_bytes = b.expert_bytes;
        r.n_expert = b.n;
        r.rows = b.first.rows;
        r.cols = b.first.cols;
        if (b.first.data)
            r.data = bytes(b.first.data, b.expert_bytes * static_cast<size_t>(b.n), b.first.row_bytes, b.first.rows * b.n);
        return r;
    }
    cd::expert_bank single(const matrix &m) {
        cd::expert_bank r;
        const dmat d = mat(m);
        r.type = d.type;
        r.data = d.p;
        r.row_bytes = d.row_bytes;
        r.expert_bytes = d.row_bytes * static_cast<size_t>(d.rows);
        r.n_expert = 1;
        r.rows = d.rows;
        r.cols = d.cols;
        return r;
    }

  private:
    cuda_weights &w_;
    int64_t replicate_;
    uint64_t total_, done_ = 0;
    const std::function<void(uint64_t, uint64_t)> &cb_;
    std::unordered_map<const void *, void *> seen_;
};

// What the uploads share (deepseek4_cuda.cpp): a block's device copy (the weight types checked first by
// check_weight_types, which throws naming the first tensor without a CUDA kernel), the bytes a decode step
// reads from a matrix / a block.
dlayer upload_layer(uploader &u, const hparams &hp, const layer_weights &l, const int32_t *tid2eid_dev);
void check_weight_types(const model &m, int first, int last);
double mat_bytes(const dmat &m);
double layer_step_bytes(const hparams &hp, const dlayer &d);
// A drafter's weights on the target's device (the MTP head, the DSpark drafter): after the memory check of
// its `bytes` (+1 GiB; fathom::error naming `what` and both sizes), blocks [0, hp.n_layer) with the
// drafter's hp and the target's options, embedding and output head (aliases `target` keeps alive).
std::shared_ptr<cuda_weights> drafter_weights(const std::shared_ptr<const cuda_weights> &target, const hparams &hp,
                                              uint64_t bytes, const char *what);
// The attention's output projections of n rows: z [n, groups * rank] = grouped W_oa . o [n, H * d], then
// y [n, D] = W_ob . z (each row's bits as its one-row step's).
void output_projection_rows(const dlayer &l, const hparams &hp, int n, const float *o, float *z, float *y, cudaStream_t s);

}  // namespace cuda_impl

// Scratch of a prefill chunk of up to `cap` tokens, all [cap, ...] row-major (alloc_chunk sizes it for a
// sequence's geometry and context; every sequence of an engine has the same).
struct chunk_state : device_buffers {
    chunk_state() : device_buffers("allocating prefill scratch") {}
    int device = 0;
    int64_t cap = 0, n_ctx = 0;
    int32_t *tokens = nullptr;
    float *x[2] = {nullptr, nullptr};
    float *xn, *mix, *post, *comb, *q_lat, *q, *kv, *ca, *cg, *iq, *iw, *ica, *icg, *score, *part, *o, *z, *y;
    void *kv_rows = nullptr;  // the chunk's KV rows in the ring's precision (window source)
    int32_t *sel = nullptr, *n_sel = nullptr;
    size_t score_floats = 0;
    std::unique_ptr<cd::gemm_runner> gemm;
    std::unique_ptr<cd::moe_prefill> moe;
    ~chunk_state() {
        cudaSetDevice(device);
        moe.reset();
        gemm.reset();
        free_all();
    }
};

// The scratch of multi-row steps (cuda_sequence::step_batch, eval_rows of 2..gemv_max_rows rows): every
// activation [rows, ...] row-major, the rows' tokens and positions in device memory (uploaded from pinned
// copies), the captured graphs. It belongs to the step, not to a sequence: the sequences of an engine
// (a cuda_prefill_pool) share one, taken by the step's first sequence for the step and given back after
// it (steps run one at a time); a sequence without a pool keeps its own. Sized for one set of weights and
// the largest score / attention partials a step's sequences need (score_floats, part_floats).
struct row_scratch : device_buffers {
    row_scratch(int device, const void *weights, size_t score_floats, size_t part_floats)
        : device_buffers("allocating multi-row scratch"), device(device), weights(weights), score_floats(score_floats),
          part_floats(part_floats) {}
    row_scratch(const row_scratch &) = delete;
    row_scratch &operator=(const row_scratch &) = delete;
    ~row_scratch();
    const int device;
    const void *const weights;
    const size_t score_floats, part_floats;
    int cap = 0;
    int32_t *tokens = nullptr, *h_tokens = nullptr, *amax = nullptr;
    int64_t *pos = nullptr, *h_pos = nullptr;
    float *x[2] = {nullptr, nullptr};
    float *xn, *post, *comb, *q_lat, *q, *kvrow, *ca, *cg, *iq, *iw, *ica, *icg, *o, *z, *y, *zh, *logits;
    // Graphs by step composition ((sequence id, rows) per sequence, the step's first sequence first): a
    // batch's graph holds its sequences' state addresses (and its first sequence's error word), and ids
    // are never reused, so a graph of a destroyed sequence is never replayed again; at most kMaxGraphs
    // kept (the oldest dropped).
    static constexpr size_t kMaxGraphs = 32;
    std::vector<std::pair<std::vector<uint64_t>, cudaGraphExec_t>> graphs;
    // Compositions seen once (the newest kMaxSeen): a composition runs eagerly the first time and is
    // captured the second, so one that never recurs (a verification's row counts, a finished sequence's
    // last step) costs no capture and instantiation.
    static constexpr size_t kMaxSeen = 64;
    std::vector<std::vector<uint64_t>> seen;
    // Lanes: the per-sequence and per-row chains of a step are independent of each other's, so they
    // run on side streams forked from and joined to the step's stream (parallel branches of the
    // captured graph): sequence i's KV rows, compressors, query heads and indexer on the lane of its
    // first row, row r's attention (and the MoE of layers the rows chain does not take) on lane r mod
    // lanes. Each lane has its own copy of the scratch those chains share in the one-row step;
    // allocated as steps first need them (ensure_lanes), up to one per row.
    void ensure_lanes(int n, const hparams &hp);  // lanes [0, n) allocated (n <= kLanes)
    static constexpr int kLanes = cd::gemv_max_rows;
    struct lane {
        cudaStream_t s = nullptr;
        cudaEvent_t done = nullptr, ready = nullptr;  // join; the lane's sequences' selections made
        float *part = nullptr;
        float *score = nullptr;  // indexer scores (kIdxRows rows)
        cd::moe_scratch moe;
    };
    lane lanes[kLanes];
    int n_lanes = 0;                                   // lanes allocated
    cudaEvent_t fork = nullptr, queries = nullptr;  // the step's fork; every row's query heads projected
    cd::moe_rows_scratch moe;  // the MoE of all rows in one chain (launch_moe_ffn_rows)
    // the HC mixers of all rows in one launch (launch_hc_*_fused_rows): per-row mixer scratch,
    // arrival counters (zeroed by every step) and split partial sums
    float *hc_mix = nullptr;
    uint32_t *hc_sync = nullptr;
    double *hc_part = nullptr;
    // the indexer of a sequence's consecutive rows in one batched launch (launch_indexer_topk_batch):
    // every row's selection; score rows for up to kIdxRows rows at once (more go in groups) in its lane
    static constexpr int kIdxRows = 5;
    int32_t *sel = nullptr, *n_sel = nullptr;
};
// Idle chunk scratch of an engine's sequences (cuda_make_prefill_pool). One chunk runs at a time per
// engine (its forward mutex), so it holds one in practice.
class cuda_prefill_pool {
  public:
    std::mutex mu;
    std::vector<std::unique_ptr<chunk_state>> idle;
    int64_t created = 0;  // scratches allocated for it (the first with the first sequence)
    std::unique_ptr<row_scratch> rows;  // the multi-row steps' scratch while no step holds it
};

struct cuda_sequence::impl : device_buffers {
    impl() : device_buffers("allocating sequence state") {}
    std::shared_ptr<const cuda_weights> w;
    cudaStream_t s = nullptr;
    std::vector<layer_state_dev> ls;
    size_t kv_elem = 2;
    // Paged state (a state pool given): the compressed and indexer rows of every layer are regions of vm
    // (reserved for the whole context, in ls order: comp_rows, then idx_rows where the layer has them),
    // mapped for the first mapped_tokens positions. Null without a pool (the rows allocated whole).
    std::unique_ptr<cuda::vm_regions> vm;
    int64_t mapped_tokens = 0;
    // The interleaved row buffers (layer_state_dev::comp_stride): one per compression ratio for the
    // compressed rows, one for the ratio-4 layers' indexer rows; stride = layers * row bytes. With a
    // state pool each is a region of vm (in this order), else one allocation.
    struct row_region {
        int ratio = 0;
        size_t stride = 0;
        int64_t max_rows = 0;
    };
    std::vector<row_region> row_regions;
    // Bytes of each row buffer that positions [0, n) use (rows n / ratio, the rows they complete, capped).
    std::vector<size_t> region_bytes(int64_t n) const;
    int64_t *pos = nullptr;
    int32_t *token = nullptr;
    float *x[2] = {nullptr, nullptr};
    float *hc_in = nullptr;  // the MTP head: the target's HC state entering the step [n_hc * D]
    float *xn, *mix, *post, *comb, *q_lat, *q, *kvrow, *ca, *cg, *iq, *iw, *ica, *icg, *score, *part, *o, *z, *y,
        *zh, *logits;
    int32_t *sel, *n_sel, *amax;
    double *hc_part = nullptr;  // the column-split HC kernel's partial dots (cd::hc_fused_part_count)
    cd::moe_scratch moe;
    // DSpark features (cuda_sequence::set_feature_layers): the capture blocks (model indices, in feature
    // order) and feat [feat_rows, feat_floats()] on the device: row i of the rows an evaluation captures.
    // feat_epoch counts the changes (the multi-row graphs' key).
    std::vector<int> feat_layers;
    float *feat = nullptr;
    int64_t feat_rows = 0;
    size_t feat_cap = 0;  // floats allocated
    uint64_t feat_epoch = 0;
    int64_t feat_floats() const { return static_cast<int64_t>(feat_layers.size()) * w->hp.n_embd; }
    // The feature slot of block il (its index in feat_layers), or -1.
    int feat_slot(int il) const {
        for (size_t t = 0; t < feat_layers.size(); ++t)
            if (feat_layers[t] == il) return static_cast<int>(t);
        return -1;
    }
    int64_t *h_pos = nullptr;  // pinned
    int32_t *h_token = nullptr, *h_amax = nullptr;
    uint32_t *err_h = nullptr, *err_d = nullptr;  // host-mapped error word
    cudaGraphExec_t graph = nullptr;
    cudaGraphExec_t graph_state = nullptr;  // the MTP head's state-only row (enqueue_state_row)
    // observe_mtp's rows, queued back to back (allocated at its first call): their states on the device
    // (each copied into hc_in before its replay) and their positions and tokens in pinned memory.
    static constexpr int kObserveRows = 32;
    float *obs_hc = nullptr;
    int64_t *h_obs_pos = nullptr;
    int32_t *h_obs_tok = nullptr;
    bool use_graph = true;
    std::function<void(const char *)> mark;  // profiling: phase boundary (null otherwise)
    void phase(const char *name) {
        if (mark) mark(name);
    }
    // Branches of the decode attention (enqueue_attention): side[0] runs the KV row and the main
    // compressor, side[1] the indexer, beside the query path on s. ev_fork (recorded on s after the
    // projections) starts both; ev_q (after the q_b GEMV) lets side[1] read the indexer query;
    // ev_join[i] (recorded on side[i]) orders the attention after each branch. Events are reused
    // layer after layer: a wait takes the record made before it, eagerly and under capture.
    cudaStream_t side[2] = {nullptr, nullptr};
    cudaEvent_t ev_fork = nullptr, ev_q = nullptr, ev_join[2] = {nullptr, nullptr};
    // Branches on: neither test.serial_step nor profiling (phase events time one stream).
    bool branched() const { return !w->test.serial_step && !mark; }
    // Error paths: every side stream taking part rejoins s (a capture must end joined; eager work
    // must not outlive the step). Errors are ignored: the caller is already failing.
    void join_side() noexcept {
        cudaStreamCaptureStatus main_st = cudaStreamCaptureStatusNone;
        cudaStreamIsCapturing(s, &main_st);
        for (int i = 0; i < 2; ++i) {
            cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
            if (!side[i] || cudaStreamIsCapturing(side[i], &st) != cudaSuccess) continue;
            if ((main_st == cudaStreamCaptureStatusNone) != (st == cudaStreamCaptureStatusNone)) continue;
            if (cudaEventRecord(ev_join[i], side[i]) == cudaSuccess) cudaStreamWaitEvent(s, ev_join[i], 0);
        }
    }

    ~impl() {
        if (w) cudaSetDevice(w->device);
        if (s) cudaStreamSynchronize(s);  // no kernel may still use the blocks vm gives back
        vm.reset();
        if (graph) cudaGraphExecDestroy(graph);
        if (graph_state) cudaGraphExecDestroy(graph_state);
        rs.reset();
        free_all();
        if (h_pos) cudaFreeHost(h_pos);
        if (h_token) cudaFreeHost(h_token);
        if (h_amax) cudaFreeHost(h_amax);
        if (h_obs_pos) cudaFreeHost(h_obs_pos);
        if (h_obs_tok) cudaFreeHost(h_obs_tok);
        if (err_h) cudaFreeHost(err_h);
        for (cudaEvent_t e : {ev_fork, ev_q, ev_join[0], ev_join[1]})
            if (e) cudaEventDestroy(e);
        for (cudaStream_t b : side)
            if (b) cudaStreamDestroy(b);
        if (s) cudaStreamDestroy(s);
    }

    void enqueue_attention(const dlayer &l, layer_state_dev &st);
    void store_kv_row(const dlayer &l, layer_state_dev &st, cudaStream_t on);
    // The attention sublayer's state updates alone (executor::attention_state): window-only layers (the
    // MTP block), whose one state is the KV row; the same launches as enqueue_attention's for it.
    void enqueue_attention_state(const dlayer &l, layer_state_dev &st);
    void enqueue_step();
    // The MTP head's state-only row (run_block_state over the embedding: what mtp_observe computes).
    void enqueue_state_row();

    // A run of a multi-row step: `count` rows of sequence `seq` starting at row `first`.
    struct row_run {
        impl *seq;
        int first, count;
    };
    // The multi-row scratch: held during a step (take_rows / give_back_rows: from and back to the pool),
    // or for good without a pool.
    std::unique_ptr<row_scratch> rs;
    uint64_t uid = 0;  // unique per sequence (the graph cache's key)
    size_t score_floats = 0, part_floats = 0;  // sizes of score / part (the lanes' copies)
    void take_rows();
    void give_back_rows() noexcept;
    void enqueue_rows(std::span<const row_run> runs, int n);

    // Prefill chunks (ds4_prefill.h): the scratch of one chunk (chunk_state, below the class), owned
    // (cs_own) while an evaluation uses it; with a prefill pool taken from it for the evaluation and given
    // back afterwards (take_chunk / give_back_chunk), so the sequences of an engine share one.
    chunk_state *cs = nullptr;
    std::unique_ptr<chunk_state> cs_own;
    std::shared_ptr<cuda_prefill_pool> pool;
    int64_t chunk_cap = 0, n_ctx_of_state = 0;
    // A multi-row evaluation's rows kept for row_top / row_logits (cuda_sequence::rows_held_ > 1):
    // [gemv_max_rows, n_vocab], allocated when a sequence first keeps rows.
    float *rows_logits = nullptr;
    // Sampling summary (logits_top): scratch allocated on first use.
    struct sample_state {
        float *work = nullptr, *vals = nullptr, *max = nullptr;
        int32_t *ids = nullptr, *pen = nullptr;
        double *z = nullptr;
        uint32_t *bad = nullptr;
        int pen_cap = 0;
    } ss;
    std::unique_ptr<chunk_state> alloc_chunk(int64_t cap);
    // The scratch for this evaluation: the sequence's own, or one from the pool (allocated when none is
    // idle), on this sequence's stream; give_back_chunk waits for the stream and returns a pooled one.
    void take_chunk();
    void give_back_chunk() noexcept;
    void enqueue_chunk_attention(const dlayer &l, layer_state_dev &st, int64_t n);
    // The chunk's n tokens (cs->tokens, position *pos) through this device's blocks; the state leaving
    // them is in cs->x[0]; the DSpark features of rows [feat_first, n) into feat (none when feat_first >= n).
    // Synchronises once per layer (MoE expert counts).
    void enqueue_chunk(int64_t n, int64_t feat_first);
};

}  // namespace fathom::ds4
