// The CUDA backend object: memory (cudaMalloc'd buffers, weights uploaded once per host pointer),
// op validation (same checks and messages as the CPU reference), dispatch to the kernel launchers
// in cuda_kernels.h, cuBLAS for prefill GEMMs, device-side error reporting and CUDA-graph capture.
// Everything is enqueued on one non-blocking stream; download() and synchronize() are the only
// calls that wait for the device.
#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_gemv.h"
#include "core/error.h"

namespace fathom {
namespace cuda {
namespace {

void ck(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw error(std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e));
}
void ckb(cublasStatus_t st, const char *what) {
    if (st != CUBLAS_STATUS_SUCCESS)
        throw error(std::string("cuda backend: ") + what + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
}
void check(bool ok, const char *op, const std::string &what) {
    if (!ok) throw error(std::string(op) + ": " + what);
}
std::string shape(const tensor &t) {
    return std::string(dtype_name(t.type)) + "[" + std::to_string(t.ne[1]) + "x" + std::to_string(t.ne[0]) + "]";
}
void check_f32(const tensor &t, const char *op, const char *name) {
    check(t.type == dtype::f32, op, std::string(name) + " must be f32, got " + shape(t));
    check(t.data != nullptr || t.ne[1] == 0, op, std::string(name) + " has no data");
    check(t.nb1 % 4 == 0 && reinterpret_cast<uintptr_t>(t.data) % 4 == 0, op,
          std::string(name) + " rows must be 4-byte aligned");
}
void check_same(const tensor &a, const tensor &b, const char *op) {
    check(a.ne[0] == b.ne[0] && a.ne[1] == b.ne[1], op, "shape mismatch " + shape(a) + " vs " + shape(b));
}
int64_t ld(const tensor &t) { return static_cast<int64_t>(t.nb1 / 4); }  // f32 row stride in elements
float *fp(const tensor &t) { return static_cast<float *>(t.data); }

// YaRN correction dimension (ggml_rope_yarn_corr_dims), identical to the CPU reference.
float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot_turns, float base) {
    return static_cast<float>(n_dims * std::log(n_ctx_orig / (n_rot_turns * 2.0 * M_PI)) / (2.0 * std::log(base)));
}

std::atomic<uint64_t> g_graph_launches{0};  // cuda_graph_launch_count()

// Every allocation gets this many spare bytes: block loads of 2-byte aligned formats (q8_0, q4_0,
// q5_0, q6_k) read whole aligned words and may touch 2 bytes past a tensor's last block.
constexpr size_t kAllocPad = 16;

// A grow-only device buffer (scratch). Growing is refused while a graph is being captured.
struct dev_buf {
    void *p = nullptr;
    size_t n = 0;
};

class cuda_backend final : public cuda_backend_api {
public:
    explicit cuda_backend(const cuda_options &o);
    ~cuda_backend() override;

    const char *name() const override { return "cuda"; }
    int n_threads() const override { return n_sm_; }  // streaming multiprocessors

    void *alloc(size_t bytes) override;
    void release(void *ptr) override;
    void *map_weights(const void *host, size_t bytes) override;
    void prepare_weight(const tensor &w) override;
    void upload(const tensor &dst, const void *host) override;
    void download(const tensor &src, void *host) override;
    void synchronize() override;

    void get_rows(const tensor &table, const int32_t *ids, int64_t n, const tensor &out) override;
    void mul_mat(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) override;
    void rms_norm(const tensor &x, const tensor *w, float eps, const tensor &out) override;
    void rope_table(int64_t p0, int64_t n, const rope_params &p, const tensor &out) override;
    void rope(const tensor &x, int32_t head_dim, const tensor &table, rope_mode mode) override;
    void kv_store(const tensor &src, const tensor &cache, int32_t n_head_kv, int64_t n_ctx, int64_t p0) override;
    void attention(const tensor &q, const tensor &k, const tensor &v, const attn_params &p,
                   const tensor &out) override;
    void attention_prob_max(const tensor &q, const tensor &k, int32_t n_head, int32_t n_head_kv, int64_t n_ctx,
                            float scale, float softcap, int64_t first_pos, const tensor &agg) override {
        const int64_t n_q = q.ne[1], hd = k.ne[0];
        if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0 || q.ne[0] != int64_t{n_head} * hd ||
            k.type != dtype::f16 || q.type != dtype::f32 || agg.type != dtype::f32 || agg.ne[1] != n_q ||
            agg.ne[0] < first_pos + n_q || k.ne[1] < int64_t{n_head_kv} * n_ctx || first_pos + n_q > n_ctx ||
            first_pos < 0 || hd > 512 || hd % 8 != 0 || k.nb1 != static_cast<size_t>(hd) * 2)
            throw error("attention_prob_max (cuda): bad shapes");
        launch_attn_prob_max(static_cast<const float *>(q.data), static_cast<int64_t>(q.nb1 / 4),
                             static_cast<const uint16_t *>(k.data), n_head, n_head / n_head_kv, n_ctx,
                             static_cast<int>(hd), scale, softcap, first_pos, n_q, static_cast<float *>(agg.data),
                             static_cast<int64_t>(agg.nb1 / 4), stream_);
        launched("attention_prob_max");
    }
    void glu(const tensor &gate, const tensor &up, glu_kind kind, const tensor &out) override;
    void add(const tensor &a, const tensor &b, const tensor &out) override;
    void scale(const tensor &x, float s) override;
    void softcap(const tensor &x, float cap) override;
    void softmax(const tensor &x) override;
    void copy(const tensor &src, const tensor &dst) override;

    // Fused decode ops (backend.h; docs/cuda.md "The dense decode step").
    void mul_mat_normed(const tensor &x, const tensor &norm_w, float eps, const tensor &xn, int n_pairs,
                        const tensor *const *w, const tensor *const *out) override;
    void mul_mat_add(const tensor &x, const tensor &w, const tensor &tmp, const tensor &acc) override;
    void glu_mul_mat_add(const tensor &gate, const tensor &up, glu_kind kind, const tensor &w, const tensor &tmp,
                         const tensor &acc) override;
    void rms_norm_add(const tensor &x, const tensor &w, float eps, const tensor &acc) override;
    void qk_rope_store(const tensor &q, const tensor &k, const tensor &v, const qk_rope_store_params &p) override;

    void set_device_positions(bool on) override { device_pos_ = on; }
    void set_step_pos(int64_t pos) override;
    void get_rows_device(const tensor &table, const int32_t *dev_ids, int64_t n, const tensor &out) override;
    void capture_begin() override;
    int capture_end() override;
    void capture_abort() override;
    void graph_launch(int id) override;
    void graph_destroy(int id) override;
    uint64_t scratch_epoch() const override { return scratch_epoch_; }
    void make_current() override { ck(cudaSetDevice(device_), "cudaSetDevice"); }
    size_t weight_bytes() const override { return weight_bytes_; }
    void *stream() const override { return stream_; }

private:
    void *grow(dev_buf &b, size_t bytes, const char *op);
    void launched(const char *op) { ck(cudaGetLastError(), op); }
    void not_capturing(const char *op) const {
        if (capturing_) throw error(std::string(op) + ": not allowed while capturing a CUDA graph");
    }
    const int64_t *pos_base() const { return device_pos_ ? pos_dev_ + 1 : pos_dev_; }
    void check_get_rows(const tensor &table, int64_t n, const tensor &out) const;
    void gemm_prefill(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out);
    // The fast decode GEMV's form of weight w (prepare_weight), or null when it has none.
    const ds4::gemv_weight *fast_weight(const tensor &w) const;
    // Segments for the fast GEMV when x is one 16-byte aligned row and every weight has the fast form.
    bool fast_segments(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out,
                       ds4::gemv_segment *segs) const;

    int device_ = 0;
    int n_sm_ = 0;
    cudaStream_t stream_ = nullptr;
    cublasHandle_t cublas_ = nullptr;
    void *cublas_ws_ = nullptr;
    uint32_t *err_host_ = nullptr;  // host-mapped device error word (cuda_kernels.h bits)
    uint32_t *err_dev_ = nullptr;
    int64_t *pos_dev_ = nullptr;    // [0] = 0 (host positions), [1] = step position S
    bool device_pos_ = false;
    bool capturing_ = false;
    std::unordered_map<void *, size_t> allocs_;
    std::map<std::pair<const void *, size_t>, void *> weights_;
    std::unordered_map<const float *, float *> freq_factors_;
    // Weights with the fast decode GEMV's form (ds4_gemv.h), by device address: q8_0 repacked into
    // fast_mem_ (the GGUF rows stay for prefill and M > 1), f16 / f32 used in place.
    std::unordered_map<const void *, ds4::gemv_weight> fast_;
    std::vector<void *> fast_mem_;
    size_t weight_bytes_ = 0;
    dev_buf wbuf_, xbuf_, attn_part_, ids_dev_;
    int32_t *ids_host_ = nullptr;   // pinned staging for host token ids
    size_t ids_host_n_ = 0;
    cudaEvent_t ids_done_ = nullptr;
    std::vector<cudaGraphExec_t> graphs_;  // null where destroyed
    uint64_t scratch_epoch_ = 0;
};

cuda_backend::cuda_backend(const cuda_options &o) : device_(o.device) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        throw error("cuda backend: no CUDA device available");
    }
    if (o.device < 0 || o.device >= count)
        throw error("cuda backend: device " + std::to_string(o.device) + " outside [0, " + std::to_string(count) + ")");
    ck(cudaSetDevice(device_), "cudaSetDevice");
    ck(cudaDeviceGetAttribute(&n_sm_, cudaDevAttrMultiProcessorCount, device_), "device attributes");
    ck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    ckb(cublasCreate(&cublas_), "cublasCreate");
    ckb(cublasSetStream(cublas_, stream_), "cublasSetStream");
    ck(cudaMalloc(&cublas_ws_, o.cublas_workspace), "cuBLAS workspace");
    ckb(cublasSetWorkspace(cublas_, cublas_ws_, o.cublas_workspace), "cublasSetWorkspace");
    ck(cudaHostAlloc(reinterpret_cast<void **>(&err_host_), sizeof(uint32_t), cudaHostAllocMapped), "error word");
    *err_host_ = 0;
    ck(cudaHostGetDevicePointer(reinterpret_cast<void **>(&err_dev_), err_host_, 0), "error word");
    ck(cudaMalloc(&pos_dev_, 2 * sizeof(int64_t)), "step position");
    ck(cudaMemsetAsync(pos_dev_, 0, 2 * sizeof(int64_t), stream_), "step position");
    ck(cudaEventCreateWithFlags(&ids_done_, cudaEventDisableTiming), "cudaEventCreate");
    ck(cudaEventRecord(ids_done_, stream_), "cudaEventRecord");
}

cuda_backend::~cuda_backend() {
    // Errors are ignored here: a destructor cannot report them and the context is going away.
    cudaStreamSynchronize(stream_);
    for (auto g : graphs_)
        if (g) cudaGraphExecDestroy(g);
    for (auto &[p, n] : allocs_) cudaFree(p);
    for (auto &[k, p] : weights_) cudaFree(p);
    for (auto &[k, p] : freq_factors_) cudaFree(p);
    for (void *p : fast_mem_) cudaFree(p);
    for (dev_buf *b : {&wbuf_, &xbuf_, &attn_part_, &ids_dev_}) cudaFree(b->p);
    cudaFreeHost(ids_host_);
    cudaEventDestroy(ids_done_);
    cudaFree(pos_dev_);
    cudaFreeHost(err_host_);
    cublasDestroy(cublas_);
    cudaFree(cublas_ws_);
    cudaStreamDestroy(stream_);
}

void *cuda_backend::grow(dev_buf &b, size_t bytes, const char *op) {
    if (b.n >= bytes) return b.p;
    if (capturing_)
        throw error(std::string(op) + ": scratch of " + std::to_string(bytes) +
                    " bytes not allocated before graph capture (run the same ops once eagerly first)");
    ck(cudaStreamSynchronize(stream_), op);  // the old buffer may still be in use
    ++scratch_epoch_;                        // graphs holding the old pointer are now stale
    const size_t n = std::max(bytes, b.n * 2);
    cudaFree(b.p);
    b.p = nullptr;
    b.n = 0;
    ck(cudaMalloc(&b.p, n), op);
    b.n = n;
    return b.p;
}

// ---- memory ------------------------------------------------------------------------------------

void *cuda_backend::alloc(size_t bytes) {
    not_capturing("alloc");
    void *p = nullptr;
    ck(cudaMalloc(&p, bytes + kAllocPad), ("alloc of " + std::to_string(bytes) + " bytes").c_str());
    allocs_[p] = bytes;
    ck(cudaMemsetAsync(p, 0, bytes, stream_), "alloc: zero fill");
    return p;
}

void cuda_backend::release(void *ptr) {
    not_capturing("release");
    auto it = allocs_.find(ptr);
    if (it == allocs_.end()) return;
    ck(cudaStreamSynchronize(stream_), "release");
    cudaFree(ptr);
    allocs_.erase(it);
}

void *cuda_backend::map_weights(const void *host, size_t bytes) {
    not_capturing("map_weights");
    const auto key = std::make_pair(host, bytes);
    if (auto it = weights_.find(key); it != weights_.end()) return it->second;
    void *p = nullptr;
    ck(cudaMalloc(&p, bytes + kAllocPad), ("map_weights: " + std::to_string(bytes) + " bytes").c_str());
    ck(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "map_weights: upload");
    weights_[key] = p;
    weight_bytes_ += bytes;
    return p;
}

// The fast decode GEMV's form of a weight, built at load: q8_0 matrices whose rows are whole 512-element
// tiles are repacked into a copy (rows * cols * 17 / 16 bytes more on the device); f16 / f32 ones with
// 16-byte aligned rows are taken in place. Others (k-quants, odd shapes) keep only the generic GEMV.
void cuda_backend::prepare_weight(const tensor &w) {
    not_capturing("prepare_weight");
    if (!w.data || w.ne[1] < 1 || fast_.count(w.data) || !ds4::gemv_fast_supported(w.type, w.ne[0])) return;
    if (w.type != dtype::q8_0 && (w.nb1 % 16 != 0 || reinterpret_cast<uintptr_t>(w.data) % 16 != 0)) return;
    void *dst = nullptr;
    if (w.type == dtype::q8_0) {
        ck(cudaMalloc(&dst, ds4::gemv_prepared_bytes(w.type, w.ne[1], w.ne[0]) + 256), "prepare_weight");
        fast_mem_.push_back(dst);
    }
    fast_[w.data] = ds4::gemv_prepare(w.type, w.data, w.nb1, w.ne[1], w.ne[0], dst, stream_);
    // The fast GEMV starts reading weights before its predecessor ends (PDL): the repack must be done.
    ck(cudaStreamSynchronize(stream_), "prepare_weight");
}

const ds4::gemv_weight *cuda_backend::fast_weight(const tensor &w) const {
    const auto it = fast_.find(w.data);
    if (it == fast_.end() || it->second.rows != w.ne[1] || it->second.cols != w.ne[0] || it->second.type != w.type)
        return nullptr;
    return &it->second;
}

bool cuda_backend::fast_segments(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out,
                                 ds4::gemv_segment *segs) const {
    if (x.ne[1] != 1 || n_pairs > ds4::gemv_max_segments || reinterpret_cast<uintptr_t>(x.data) % 16 != 0)
        return false;
    for (int i = 0; i < n_pairs; ++i) {
        const ds4::gemv_weight *fw = fast_weight(*w[i]);
        if (!fw) return false;
        segs[i] = {*fw, fp(*out[i])};
    }
    return true;
}

void cuda_backend::upload(const tensor &dst, const void *host) {
    not_capturing("upload");
    check(dst.contiguous(), "upload", "destination must be contiguous");
    ck(cudaMemcpyAsync(dst.data, host, dst.nbytes(), cudaMemcpyHostToDevice, stream_), "upload");
    ck(cudaStreamSynchronize(stream_), "upload");  // host buffer may be reused on return
}

void cuda_backend::download(const tensor &src, void *host) {
    not_capturing("download");
    check(src.contiguous(), "download", "source must be contiguous");
    ck(cudaMemcpyAsync(host, src.data, src.nbytes(), cudaMemcpyDeviceToHost, stream_), "download");
    synchronize();
}

void cuda_backend::synchronize() {
    not_capturing("synchronize");
    ck(cudaStreamSynchronize(stream_), "synchronize");
    const uint32_t e = __atomic_exchange_n(err_host_, 0u, __ATOMIC_SEQ_CST);
    if (e == 0) return;
    std::string what;
    if (e & err_get_rows_id) what += " get_rows: device token id outside the table;";
    if (e & err_kv_pos) what += " kv_store: position outside the cache;";
    if (e & err_attn_pos) what += " attention: query position outside the cache;";
    throw error("cuda backend: device-side check failed:" + what);
}

// ---- graphs and step position ------------------------------------------------------------------

void cuda_backend::set_step_pos(int64_t pos) {
    not_capturing("set_step_pos");
    launch_set_i64(pos_dev_ + 1, pos, stream_);
    launched("set_step_pos");
}

void cuda_backend::capture_begin() {
    not_capturing("capture_begin");
    ck(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "capture_begin");
    capturing_ = true;
}

int cuda_backend::capture_end() {
    if (!capturing_) throw error("capture_end: no capture in progress");
    capturing_ = false;
    cudaGraph_t g = nullptr;
    ck(cudaStreamEndCapture(stream_, &g), "capture_end");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    ck(e, "capture_end: instantiate");
    graphs_.push_back(exec);
    return static_cast<int>(graphs_.size()) - 1;
}

void cuda_backend::capture_abort() {
    if (!capturing_) return;
    capturing_ = false;
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream_, &g);  // invalidated capture: the error is expected, the graph discarded
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
}

void cuda_backend::graph_launch(int id) {
    not_capturing("graph_launch");
    if (id < 0 || id >= static_cast<int>(graphs_.size()) || !graphs_[static_cast<size_t>(id)])
        throw error("graph_launch: unknown graph " + std::to_string(id));
    ck(cudaGraphLaunch(graphs_[static_cast<size_t>(id)], stream_), "graph_launch");
    g_graph_launches.fetch_add(1, std::memory_order_relaxed);
}

void cuda_backend::graph_destroy(int id) {
    if (id < 0 || id >= static_cast<int>(graphs_.size()) || !graphs_[static_cast<size_t>(id)]) return;
    cudaStreamSynchronize(stream_);  // a replay in flight may still use it
    cudaGraphExecDestroy(graphs_[static_cast<size_t>(id)]);
    graphs_[static_cast<size_t>(id)] = nullptr;
}

// ---- get_rows ----------------------------------------------------------------------------------

void cuda_backend::check_get_rows(const tensor &table, int64_t n, const tensor &out) const {
    check_f32(out, "get_rows", "out");
    check(n >= 0 && out.ne[0] == table.ne[0] && out.ne[1] == n, "get_rows",
          "out " + shape(out) + " vs table " + shape(table));
    check(mm_supported(table.type), "get_rows", "unsupported table type " + shape(table));
    check(table.ne[0] % 16 == 0 && table.ne[0] % dtype_info(table.type).block_size == 0, "get_rows",
          "row of " + std::to_string(table.ne[0]) + " is not whole 16-element units");
    const int a = mm_alignment(table.type);
    check(reinterpret_cast<uintptr_t>(table.data) % a == 0 && table.nb1 % a == 0, "get_rows",
          "table rows not " + std::to_string(a) + "-byte aligned");
}

void cuda_backend::get_rows(const tensor &table, const int32_t *ids, int64_t n, const tensor &out) {
    not_capturing("get_rows (host ids; use get_rows_device in graphs)");
    check_get_rows(table, n, out);
    for (int64_t i = 0; i < n; ++i)
        check(ids[i] >= 0 && ids[i] < table.ne[1], "get_rows",
              "token id " + std::to_string(ids[i]) + " outside [0, " + std::to_string(table.ne[1]) + ")");
    if (n == 0) return;
    // The pinned staging buffer is reused: wait until the previous copy out of it has completed.
    ck(cudaEventSynchronize(ids_done_), "get_rows");
    if (ids_host_n_ < static_cast<size_t>(n)) {
        cudaFreeHost(ids_host_);
        ids_host_ = nullptr;
        ids_host_n_ = 0;
        ck(cudaHostAlloc(reinterpret_cast<void **>(&ids_host_), static_cast<size_t>(n) * 4, cudaHostAllocDefault),
           "get_rows: staging");
        ids_host_n_ = static_cast<size_t>(n);
    }
    auto *dev = static_cast<int32_t *>(grow(ids_dev_, static_cast<size_t>(n) * 4, "get_rows"));
    std::memcpy(ids_host_, ids, static_cast<size_t>(n) * 4);
    ck(cudaMemcpyAsync(dev, ids_host_, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice, stream_), "get_rows");
    ck(cudaEventRecord(ids_done_, stream_), "get_rows");
    launch_get_rows(table.type, table.data, table.nb1, table.ne[0], table.ne[1], dev, n, fp(out), ld(out), err_dev_,
                    stream_);
    launched("get_rows");
}

void cuda_backend::get_rows_device(const tensor &table, const int32_t *dev_ids, int64_t n, const tensor &out) {
    check_get_rows(table, n, out);
    if (n == 0) return;
    launch_get_rows(table.type, table.data, table.nb1, table.ne[0], table.ne[1], dev_ids, n, fp(out), ld(out),
                    err_dev_, stream_);
    launched("get_rows_device");
}

// ---- mul_mat -------------------------------------------------------------------------------------

void cuda_backend::mul_mat(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) {
    check_f32(x, "mul_mat", "x");
    check(n_pairs >= 1 && n_pairs <= 8, "mul_mat", "1..8 weight/output pairs");
    const int64_t K = x.ne[0], M = x.ne[1];
    for (int i = 0; i < n_pairs; ++i) {
        const tensor &W = *w[i], &Y = *out[i];
        check(W.ne[0] == K, "mul_mat", "weight " + shape(W) + " does not take " + std::to_string(K) + " inputs");
        check(mm_supported(W.type), "mul_mat", "unsupported weight type " + shape(W) + " on the CUDA backend");
        check(K % 16 == 0 && K % dtype_info(W.type).block_size == 0, "mul_mat",
              std::to_string(K) + " inputs are not whole blocks of " + shape(W));
        const int a = mm_alignment(W.type);
        check(reinterpret_cast<uintptr_t>(W.data) % a == 0 && W.nb1 % a == 0, "mul_mat",
              "weight " + shape(W) + " rows not " + std::to_string(a) + "-byte aligned");
        check_f32(Y, "mul_mat", "out");
        check(Y.ne[0] == W.ne[1] && Y.ne[1] == M, "mul_mat", "out " + shape(Y) + " for weight " + shape(W) +
              " and x " + shape(x));
    }
    if (M == 0) return;
    if (M <= 8) {
        // The GEMV reads x as float4: a misaligned view is first copied to aligned scratch.
        const float *xs = fp(x);
        int64_t ldxs = ld(x);
        if (reinterpret_cast<uintptr_t>(x.data) % 16 != 0 || x.nb1 % 16 != 0) {
            auto *tmp = static_cast<float *>(grow(xbuf_, static_cast<size_t>(M * K) * 4, "mul_mat"));
            launch_elementwise(ew_op::copy_f32, fp(x), ld(x), nullptr, 0, tmp, K, K, M, 0.0f, stream_);
            launched("mul_mat: align x");
            xs = tmp;
            ldxs = K;
        }
        for (int i = 0; i < n_pairs; ++i) {
            const tensor &W = *w[i], &Y = *out[i];
            launch_gemv(W.type, W.data, W.nb1, K, W.ne[1], xs, ldxs, M, fp(Y), ld(Y), stream_);
            launched("mul_mat");
        }
        return;
    }
    gemm_prefill(x, n_pairs, w, out);
}

// Prefill: weights dequantised to bf16 (one weight at a time into a scratch buffer), x converted to
// bf16 once, cuBLAS bf16 GEMM with f32 accumulation and f32 output. f32 weights use an f32 GEMM.
// Row-major Y[M,N] = X[M,K] W[N,K]^T is column-major Y^T = W^T(op T of K x N) * X^T(K x M).
void cuda_backend::gemm_prefill(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) {
    const int64_t K = x.ne[0], M = x.ne[1];
    const float one = 1.0f, zero = 0.0f;
    uint16_t *xb = nullptr;
    for (int i = 0; i < n_pairs; ++i) {
        const tensor &W = *w[i], &Y = *out[i];
        const int64_t N = W.ne[1];
        check(N < (1ll << 31) && M < (1ll << 31) && K < (1ll << 31), "mul_mat", "dimensions exceed cuBLAS int range");
        if (W.type == dtype::f32) {
            ckb(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                             static_cast<int>(K), &one, W.data, CUDA_R_32F, static_cast<int>(W.nb1 / 4), x.data,
                             CUDA_R_32F, static_cast<int>(ld(x)), &zero, Y.data, CUDA_R_32F, static_cast<int>(ld(Y)),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "mul_mat: f32 GEMM");
            continue;
        }
        if (!xb) {
            xb = static_cast<uint16_t *>(grow(xbuf_, static_cast<size_t>(M * K) * 2, "mul_mat"));
            launch_f32_to_bf16(fp(x), ld(x), K, M, xb, stream_);
            launched("mul_mat: convert x");
        }
        auto *wb = static_cast<uint16_t *>(grow(wbuf_, static_cast<size_t>(N * K) * 2, "mul_mat"));
        launch_dequant_bf16(W.type, W.data, W.nb1, K, N, wb, stream_);
        launched("mul_mat: dequantise");
        ckb(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                         static_cast<int>(K), &one, wb, CUDA_R_16BF, static_cast<int>(K), xb, CUDA_R_16BF,
                         static_cast<int>(K), &zero, Y.data, CUDA_R_32F, static_cast<int>(ld(Y)), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            "mul_mat: bf16 GEMM");
    }
}

// ---- norms, rope ---------------------------------------------------------------------------------

void cuda_backend::rms_norm(const tensor &x, const tensor *w, float eps, const tensor &out) {
    check_f32(x, "rms_norm", "x");
    check_f32(out, "rms_norm", "out");
    check_same(x, out, "rms_norm");
    if (w) check(w->type == dtype::f32 && w->ne[0] == x.ne[0], "rms_norm", "weight " + shape(*w) + " for x " + shape(x));
    launch_rms_norm(fp(x), ld(x), w ? fp(*w) : nullptr, eps, x.ne[0], x.ne[1], fp(out), ld(out), stream_);
    launched("rms_norm");
}

void cuda_backend::rope_table(int64_t p0, int64_t n, const rope_params &p, const tensor &out) {
    check_f32(out, "rope_table", "out");
    check(p.n_rot > 0 && p.n_rot % 2 == 0, "rope_table", "n_rot must be positive and even");
    check(out.ne[0] == p.n_rot && out.ne[1] == n, "rope_table", "out " + shape(out));
    check(p.freq_base > 0 && p.freq_scale > 0, "rope_table", "freq_base and freq_scale must be positive");
    rope_table_args a{};
    a.n_rot = p.n_rot;
    a.freq_base = p.freq_base;
    a.freq_scale = p.freq_scale;
    a.ext_factor = p.ext_factor;
    if (p.ext_factor != 0.0f) {
        check(p.n_ctx_orig > 0, "rope_table", "YaRN needs the original context length");
        a.corr0 = std::max(0.0f, std::floor(yarn_corr_dim(p.n_rot, p.n_ctx_orig, p.beta_fast, p.freq_base)));
        a.corr1 = std::min(static_cast<float>(p.n_rot - 1),
                           std::ceil(yarn_corr_dim(p.n_rot, p.n_ctx_orig, p.beta_slow, p.freq_base)));
    }
    a.mscale = p.attn_factor;
    if (p.ext_factor != 0.0f) a.mscale *= 1.0f + 0.1f * std::log(1.0f / p.freq_scale);
    if (p.freq_factors) {
        // Frequency factors come from the (immutable) GGUF: uploaded once per host pointer.
        auto it = freq_factors_.find(p.freq_factors);
        if (it == freq_factors_.end()) {
            not_capturing("rope_table (first use of freq_factors)");
            float *d = nullptr;
            const size_t bytes = static_cast<size_t>(p.n_rot / 2) * sizeof(float);
            ck(cudaMalloc(&d, bytes), "rope_table: freq_factors");
            ck(cudaMemcpy(d, p.freq_factors, bytes, cudaMemcpyHostToDevice), "rope_table: freq_factors");
            it = freq_factors_.emplace(p.freq_factors, d).first;
        }
        a.freq_factors = it->second;
    }
    launch_rope_table(pos_base(), p0, n, a, fp(out), ld(out), stream_);
    launched("rope_table");
}

void cuda_backend::rope(const tensor &x, int32_t head_dim, const tensor &table, rope_mode mode) {
    check_f32(x, "rope", "x");
    check_f32(table, "rope", "table");
    const int64_t n_rot = table.ne[0];
    check(head_dim > 0 && x.ne[0] % head_dim == 0, "rope", "row of " + std::to_string(x.ne[0]) +
          " is not whole heads of " + std::to_string(head_dim));
    check(n_rot <= head_dim && table.ne[1] == x.ne[1], "rope", "table " + shape(table) + " for x " + shape(x));
    launch_rope(fp(x), ld(x), x.ne[1], x.ne[0] / head_dim, head_dim, fp(table), ld(table), static_cast<int32_t>(n_rot),
                mode == rope_mode::neox, stream_);
    launched("rope");
}

// ---- KV cache and attention ------------------------------------------------------------------

void cuda_backend::kv_store(const tensor &src, const tensor &cache, int32_t n_head_kv, int64_t n_ctx, int64_t p0) {
    check_f32(src, "kv_store", "src");
    check(cache.type == dtype::f32 || cache.type == dtype::f16, "kv_store", "cache must be f16 or f32");
    check(n_head_kv > 0 && src.ne[0] == n_head_kv * cache.ne[0] && cache.ne[1] == n_head_kv * n_ctx, "kv_store",
          "src " + shape(src) + " vs cache " + shape(cache));
    if (!device_pos_) check(p0 >= 0 && p0 + src.ne[1] <= n_ctx, "kv_store", "positions beyond the cache");
    launch_kv_store(fp(src), ld(src), src.ne[1], n_head_kv, static_cast<int32_t>(cache.ne[0]), cache.data,
                    cache.type == dtype::f16, cache.nb1, n_ctx, pos_base(), p0, err_dev_, stream_);
    launched("kv_store");
}

void cuda_backend::attention(const tensor &q, const tensor &k, const tensor &v, const attn_params &p,
                             const tensor &out) {
    check_f32(q, "attention", "q");
    check_f32(out, "attention", "out");
    check_same(q, out, "attention");
    check(p.n_head > 0 && p.n_head_kv > 0 && p.n_head % p.n_head_kv == 0 && p.head_dim > 0, "attention",
          "bad head counts");
    check(p.head_dim <= 256, "attention", "head_dim " + std::to_string(p.head_dim) + " > 256 on the CUDA backend");
    check(q.ne[0] == static_cast<int64_t>(p.n_head) * p.head_dim, "attention", "q " + shape(q) + " is not heads x head_dim");
    check(k.type == v.type && (k.type == dtype::f16 || k.type == dtype::f32), "attention", "cache must be f16 or f32");
    check(k.ne[0] == p.head_dim && v.ne[0] == p.head_dim && k.ne[1] == p.n_head_kv * p.n_ctx &&
          v.ne[1] == k.ne[1] && k.nb1 == v.nb1, "attention", "cache " + shape(k) + " vs head layout");
    const int64_t n_tok = q.ne[1];
    if (!device_pos_) check(p.n_past >= 0 && p.n_past + n_tok <= p.n_ctx, "attention", "positions beyond the cache");
    attn_args a{p.n_head, p.n_head_kv, p.head_dim, p.n_ctx, p.n_past, p.scale, p.softcap, p.window};
    const int n_split = attention_splits(n_tok, p.n_head, p.n_ctx);
    float *part = nullptr;
    if (n_split > 1)
        part = static_cast<float *>(grow(attn_part_,
                                         static_cast<size_t>(n_tok * p.n_head * n_split * (p.head_dim + 2)) * 4,
                                         "attention"));
    launch_attention(fp(q), ld(q), n_tok, k.data, v.data, k.type == dtype::f16, k.nb1, a, pos_base(), fp(out), ld(out),
                     err_dev_, part, n_split, stream_);
    launched("attention");
}

// ---- fused decode ops ----------------------------------------------------------------------------

// One row with fast weights: one launch of the int8 GEMV with the norm folded into its x staging (x is
// not written; xn neither), or, when that kernel does not take the set (f32 weights), the norm into xn
// and one launch of the f32-activation GEMV for all pairs. Otherwise the composition.
void cuda_backend::mul_mat_normed(const tensor &x, const tensor &norm_w, float eps, const tensor &xn, int n_pairs,
                                  const tensor *const *w, const tensor *const *out) {
    check_f32(x, "mul_mat_normed", "x");
    check_f32(xn, "mul_mat_normed", "xn");
    check_same(x, xn, "mul_mat_normed");
    check(norm_w.type == dtype::f32 && norm_w.ne[0] == x.ne[0], "mul_mat_normed",
          "weight " + shape(norm_w) + " for x " + shape(x));
    ds4::gemv_segment segs[ds4::gemv_max_segments];
    if (!fast_segments(x, n_pairs, w, out, segs) || reinterpret_cast<uintptr_t>(xn.data) % 16 != 0) {
        backend::mul_mat_normed(x, norm_w, eps, xn, n_pairs, w, out);
        return;
    }
    for (int i = 0; i < n_pairs; ++i) {
        check(w[i]->ne[0] == x.ne[0], "mul_mat_normed", "weight " + shape(*w[i]) + " for x " + shape(x));
        check_f32(*out[i], "mul_mat_normed", "out");
        check(out[i]->ne[0] == w[i]->ne[1] && out[i]->ne[1] == 1, "mul_mat_normed", "out " + shape(*out[i]));
    }
    if (ds4::gemv_multi_normed_folds(segs, n_pairs, fp(x), fp(norm_w))) {
        ds4::launch_gemv_multi_normed(segs, n_pairs, fp(x), fp(norm_w), eps, stream_);  // x left as it is
    } else {
        launch_rms_norm(fp(x), ld(x), fp(norm_w), eps, x.ne[0], 1, fp(xn), ld(xn), stream_);
        launched("mul_mat_normed: norm");
        ds4::launch_gemv_multi(segs, n_pairs, fp(xn), stream_);
    }
    launched("mul_mat_normed");
}

// One row with a fast weight: the GEMV adds its result to acc (gemv_segment::accumulate), tmp unused.
void cuda_backend::mul_mat_add(const tensor &x, const tensor &w, const tensor &tmp, const tensor &acc) {
    check_f32(acc, "mul_mat_add", "acc");
    check(acc.ne[0] == w.ne[1] && acc.ne[1] == x.ne[1], "mul_mat_add", "acc " + shape(acc) + " for weight " +
          shape(w) + " and x " + shape(x));
    ds4::gemv_segment seg;
    const tensor *pw[] = {&w};
    const tensor *pa[] = {&acc};
    if (w.ne[0] != x.ne[0] || x.type != dtype::f32 || !fast_segments(x, 1, pw, pa, &seg)) {
        backend::mul_mat_add(x, w, tmp, acc);
        return;
    }
    seg.accumulate = true;
    ds4::launch_gemv_multi(&seg, 1, fp(x), stream_);
    launched("mul_mat_add");
}

// One row with a q8_0 fast weight: act(gate) * up is formed in the int8 GEMV's x staging and the result
// added to acc (one launch; gate and up not written). Otherwise the composition.
void cuda_backend::glu_mul_mat_add(const tensor &gate, const tensor &up, glu_kind kind, const tensor &w,
                                   const tensor &tmp, const tensor &acc) {
    check_f32(gate, "glu_mul_mat_add", "gate");
    check_f32(up, "glu_mul_mat_add", "up");
    check_same(gate, up, "glu_mul_mat_add");
    check_f32(acc, "glu_mul_mat_add", "acc");
    check(w.ne[0] == gate.ne[0] && acc.ne[0] == w.ne[1] && acc.ne[1] == gate.ne[1], "glu_mul_mat_add",
          "weight " + shape(w) + " for gate " + shape(gate) + " and acc " + shape(acc));
    ds4::gemv_segment seg;
    const tensor *pw[] = {&w};
    const tensor *pa[] = {&acc};
    if (fast_segments(gate, 1, pw, pa, &seg)) {
        seg.accumulate = true;
        if (ds4::launch_gemv_glu(&seg, 1, fp(gate), fp(up), kind == glu_kind::swiglu ? 0 : 1, stream_)) {
            launched("glu_mul_mat_add");
            return;
        }
    }
    backend::glu_mul_mat_add(gate, up, kind, w, tmp, acc);
}

void cuda_backend::rms_norm_add(const tensor &x, const tensor &w, float eps, const tensor &acc) {
    check_f32(x, "rms_norm_add", "x");
    check_f32(acc, "rms_norm_add", "acc");
    check_same(x, acc, "rms_norm_add");
    check(w.type == dtype::f32 && w.ne[0] == x.ne[0], "rms_norm_add", "weight " + shape(w) + " for x " + shape(x));
    launch_rms_norm_add(fp(x), ld(x), fp(w), eps, x.ne[0], x.ne[1], fp(acc), ld(acc), stream_);
    launched("rms_norm_add");
}

void cuda_backend::qk_rope_store(const tensor &q, const tensor &k, const tensor &v, const qk_rope_store_params &p) {
    const char *op = "qk_rope_store";
    check(p.table && p.k_cache && p.v_cache, op, "missing rope table or caches");
    check_f32(q, op, "q");
    check_f32(k, op, "k");
    check_f32(v, op, "v");
    check_f32(*p.table, op, "table");
    const int32_t hd = p.head_dim;
    if (hd > 512 || q.ne[1] > 65535) {  // beyond the kernel's head / grid limits: the separate ops
        backend::qk_rope_store(q, k, v, p);
        return;
    }
    const tensor &kc = *p.k_cache, &vc = *p.v_cache;
    check(hd > 0 && q.ne[0] % hd == 0, op, "q " + shape(q) + " is not whole heads of " + std::to_string(hd));
    check(p.n_head_kv > 0 && k.ne[0] == int64_t{p.n_head_kv} * hd && v.ne[0] == k.ne[0] && k.ne[1] == q.ne[1] &&
              v.ne[1] == q.ne[1], op, "k " + shape(k) + " / v " + shape(v) + " vs q " + shape(q));
    check((kc.type == dtype::f16 || kc.type == dtype::f32) && vc.type == kc.type && kc.nb1 == vc.nb1 &&
              kc.ne[0] == hd && vc.ne[0] == hd && kc.ne[1] == p.n_head_kv * p.n_ctx && vc.ne[1] == kc.ne[1],
          op, "cache " + shape(kc) + " vs head layout");
    const int64_t n_rot = p.table->ne[0];
    check(n_rot > 0 && n_rot % 2 == 0 && n_rot <= hd && p.table->ne[1] == q.ne[1], op,
          "table " + shape(*p.table) + " for q " + shape(q));
    for (const tensor *nw : {p.q_norm, p.k_norm})
        if (nw) check(nw->type == dtype::f32 && nw->ne[0] == hd, op, "norm weight " + shape(*nw));
    if (!device_pos_) check(p.p0 >= 0 && p.p0 + q.ne[1] <= p.n_ctx, op, "positions beyond the cache");
    qk_rope_store_args a{};
    a.n_head = static_cast<int32_t>(q.ne[0] / hd);
    a.n_head_kv = p.n_head_kv;
    a.hd = hd;
    a.n_rot = static_cast<int32_t>(n_rot);
    a.neox = p.mode == rope_mode::neox;
    a.f16 = kc.type == dtype::f16;
    a.q_norm = p.q_norm ? fp(*p.q_norm) : nullptr;
    a.k_norm = p.k_norm ? fp(*p.k_norm) : nullptr;
    a.eps = p.eps;
    a.q_scale = p.q_scale;
    a.k_cache = kc.data;
    a.v_cache = vc.data;
    a.cache_stride = kc.nb1;
    a.n_ctx = p.n_ctx;
    a.p0 = p.p0;
    launch_qk_rope_store(fp(q), ld(q), fp(k), ld(k), fp(v), ld(v), q.ne[1], fp(*p.table), ld(*p.table), a, pos_base(),
                         err_dev_, stream_);
    launched(op);
}

// ---- elementwise -------------------------------------------------------------------------------

void cuda_backend::glu(const tensor &gate, const tensor &up, glu_kind kind, const tensor &out) {
    check_f32(gate, "glu", "gate");
    check_f32(up, "glu", "up");
    check_f32(out, "glu", "out");
    check_same(gate, up, "glu");
    check_same(gate, out, "glu");
    launch_elementwise(kind == glu_kind::swiglu ? ew_op::swiglu : ew_op::geglu, fp(gate), ld(gate), fp(up), ld(up),
                       out.data, ld(out), gate.ne[0], gate.ne[1], 0.0f, stream_);
    launched("glu");
}

void cuda_backend::add(const tensor &a, const tensor &b, const tensor &out) {
    check_f32(a, "add", "a");
    check_f32(b, "add", "b");
    check_f32(out, "add", "out");
    check_same(a, out, "add");
    const bool bcast = b.ne[1] == 1 && a.ne[1] != 1;
    check(b.ne[0] == a.ne[0] && (bcast || b.ne[1] == a.ne[1]), "add", "shape mismatch " + shape(a) + " vs " + shape(b));
    launch_elementwise(bcast ? ew_op::add_bcast : ew_op::add, fp(a), ld(a), fp(b), ld(b), out.data, ld(out), a.ne[0],
                       a.ne[1], 0.0f, stream_);
    launched("add");
}

void cuda_backend::scale(const tensor &x, float s) {
    check_f32(x, "scale", "x");
    launch_elementwise(ew_op::scale, fp(x), ld(x), nullptr, 0, x.data, ld(x), x.ne[0], x.ne[1], s, stream_);
    launched("scale");
}

void cuda_backend::softcap(const tensor &x, float cap) {
    check_f32(x, "softcap", "x");
    check(cap > 0, "softcap", "cap must be positive");
    launch_elementwise(ew_op::softcap, fp(x), ld(x), nullptr, 0, x.data, ld(x), x.ne[0], x.ne[1], cap, stream_);
    launched("softcap");
}

void cuda_backend::softmax(const tensor &x) {
    check_f32(x, "softmax", "x");
    launch_softmax(fp(x), ld(x), x.ne[0], x.ne[1], stream_);
    launched("softmax");
}

void cuda_backend::copy(const tensor &src, const tensor &dst) {
    check_f32(src, "copy", "src");
    check(dst.type == dtype::f32 || dst.type == dtype::f16, "copy", "dst must be f32 or f16");
    check_same(src, dst, "copy");
    const bool f16 = dst.type == dtype::f16;
    check(dst.nb1 % (f16 ? 2 : 4) == 0, "copy", "dst rows misaligned");
    launch_elementwise(f16 ? ew_op::copy_f16 : ew_op::copy_f32, fp(src), ld(src), nullptr, 0, dst.data,
                       static_cast<int64_t>(dst.nb1 / (f16 ? 2 : 4)), src.ne[0], src.ne[1], 0.0f, stream_);
    launched("copy");
}

}  // namespace
}  // namespace cuda

bool cuda_device_available() {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device" error
        return false;
    }
    return count > 0;
}

uint64_t cuda_graph_launch_count() { return cuda::g_graph_launches.load(std::memory_order_relaxed); }

int cuda_device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

cuda_device_memory cuda_query_memory(int device) {
    const int count = cuda_device_count();
    if (device < 0 || device >= count)
        throw error("cuda: device " + std::to_string(device) + " outside [0, " + std::to_string(count) + ")");
    cuda::ck(cudaSetDevice(device), "cudaSetDevice");
    cuda_device_memory m;
    cuda::ck(cudaMemGetInfo(&m.free_bytes, &m.total_bytes), "cudaMemGetInfo");
    cudaDeviceProp prop{};
    cuda::ck(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    m.name = prop.name;
    return m;
}

double cuda_measure_copy_bandwidth(int device, size_t bytes, int reps) {
    if (reps < 1 || bytes < 4096) throw error("cuda_measure_copy_bandwidth: reps >= 1 and bytes >= 4096");
    cuda::ck(cudaSetDevice(device), "cudaSetDevice");
    void *a = nullptr, *b = nullptr;
    cudaStream_t st = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    std::vector<float> ms;
    std::string err;
    // Every resource is released on all paths; the first failure is reported after clean-up.
    auto step = [&err](cudaError_t e, const char *what) {
        if (e != cudaSuccess && err.empty()) err = std::string(what) + ": " + cudaGetErrorString(e);
        return err.empty();
    };
    if (step(cudaMalloc(&a, bytes), "cudaMalloc") && step(cudaMalloc(&b, bytes), "cudaMalloc") &&
        step(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream") &&
        step(cudaEventCreate(&e0), "event") && step(cudaEventCreate(&e1), "event") &&
        step(cudaMemsetAsync(a, 0x5a, bytes, st), "memset") &&
        step(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st), "warm-up copy")) {
        for (int r = 0; r < reps && err.empty(); ++r) {
            float t = 0.0f;
            if (step(cudaEventRecord(e0, st), "event") &&
                step(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, st), "copy") &&
                step(cudaEventRecord(e1, st), "event") && step(cudaEventSynchronize(e1), "sync") &&
                step(cudaEventElapsedTime(&t, e0, e1), "elapsed"))
                ms.push_back(t);
        }
    }
    if (st) cudaStreamSynchronize(st);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (st) cudaStreamDestroy(st);
    cudaFree(a);
    cudaFree(b);
    if (!err.empty()) throw error("cuda: copy bandwidth: " + err);
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2] * 1e-3;
    return med > 0 ? 2.0 * static_cast<double>(bytes) / med : 0.0;
}

std::unique_ptr<cuda_backend_api> make_cuda_backend(const cuda_options &opts) {
    return std::make_unique<cuda::cuda_backend>(opts);
}

}  // namespace fathom
