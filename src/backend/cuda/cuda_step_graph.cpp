// cuda_step_graph (cuda_backend.h): a forward step captured once as a CUDA graph and replayed at
// any position with new token ids. The step function runs against a proxy backend that forwards
// every op to the CUDA backend but turns host token ids into device ids, downloads into
// in-graph copies to pinned staging, and synchronize() into nothing; positions come from the
// backend's device step scalar (set_device_positions), so the step is captured at offset 0.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace fathom {

namespace {

void ck(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw error(std::string("cuda step graph: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

struct cuda_step_graph::impl final : public backend {
    cuda_backend_api &gpu;
    int32_t *ids_dev = nullptr;     // [n_ids] read by the captured get_rows
    int32_t *ids_pinned = nullptr;  // [n_ids] staging for the per-replay upload
    uint8_t *staging = nullptr;     // [staging_bytes] pinned: in-graph downloads land here
    int64_t n_ids = 0, ids_used = 0;
    size_t staging_bytes = 0, staging_used = 0;
    struct download_rec {
        size_t offset, bytes;
        void *host;
    };
    std::vector<download_rec> downloads;

    impl(cuda_backend_api &g, int64_t n, size_t sb) : gpu(g), n_ids(n), staging_bytes(sb) {
        ck(cudaMalloc(&ids_dev, static_cast<size_t>(n) * 4), "ids buffer");
        ck(cudaHostAlloc(reinterpret_cast<void **>(&ids_pinned), static_cast<size_t>(n) * 4, cudaHostAllocDefault),
           "ids staging");
        ck(cudaHostAlloc(reinterpret_cast<void **>(&staging), sb, cudaHostAllocDefault), "download staging");
    }
    ~impl() override {
        cudaFree(ids_dev);
        cudaFreeHost(ids_pinned);
        cudaFreeHost(staging);
    }

    const char *name() const override { return gpu.name(); }
    int n_threads() const override { return gpu.n_threads(); }
    void *alloc(size_t bytes) override { return gpu.alloc(bytes); }  // refused while capturing
    void release(void *ptr) override { gpu.release(ptr); }
    void *map_weights(const void *host, size_t bytes) override { return gpu.map_weights(host, bytes); }
    void upload(const tensor &dst, const void *host) override { gpu.upload(dst, host); }

    void download(const tensor &src, void *host) override {
        if (!src.contiguous()) throw error("download: source must be contiguous");
        const size_t bytes = src.nbytes();
        if (staging_used + bytes > staging_bytes)
            throw error("cuda step graph: downloads exceed the " + std::to_string(staging_bytes) + "-byte staging");
        ck(cudaMemcpyAsync(staging + staging_used, src.data, bytes, cudaMemcpyDeviceToHost,
                           static_cast<cudaStream_t>(gpu.stream())),
           "download");
        downloads.push_back({staging_used, bytes, host});
        staging_used += (bytes + 63) & ~size_t{63};
    }
    void synchronize() override {}

    void get_rows(const tensor &table, const int32_t *, int64_t n, const tensor &out) override {
        if (ids_used + n > n_ids)
            throw error("cuda step graph: get_rows takes more than " + std::to_string(n_ids) + " ids");
        gpu.get_rows_device(table, ids_dev + ids_used, n, out);
        ids_used += n;
    }
    void mul_mat(const tensor &x, int n_pairs, const tensor *const *w, const tensor *const *out) override {
        gpu.mul_mat(x, n_pairs, w, out);
    }
    void rms_norm(const tensor &x, const tensor *w, float eps, const tensor &out) override {
        gpu.rms_norm(x, w, eps, out);
    }
    void rope_table(int64_t p0, int64_t n, const rope_params &p, const tensor &out) override {
        gpu.rope_table(p0, n, p, out);
    }
    void rope(const tensor &x, int32_t head_dim, const tensor &table, rope_mode mode) override {
        gpu.rope(x, head_dim, table, mode);
    }
    void kv_store(const tensor &src, const tensor &cache, int32_t n_head_kv, int64_t n_ctx, int64_t p0) override {
        gpu.kv_store(src, cache, n_head_kv, n_ctx, p0);
    }
    void attention(const tensor &q, const tensor &k, const tensor &v, const attn_params &p,
                   const tensor &out) override {
        gpu.attention(q, k, v, p, out);
    }
    void glu(const tensor &gate, const tensor &up, glu_kind kind, const tensor &out) override {
        gpu.glu(gate, up, kind, out);
    }
    void add(const tensor &a, const tensor &b, const tensor &out) override { gpu.add(a, b, out); }
    void scale(const tensor &x, float s) override { gpu.scale(x, s); }
    void softcap(const tensor &x, float cap) override { gpu.softcap(x, cap); }
    void softmax(const tensor &x) override { gpu.softmax(x); }
    void copy(const tensor &src, const tensor &dst) override { gpu.copy(src, dst); }
    // The fused ops too: the defaults would split them into the separate ops above.
    void mul_mat_normed(const tensor &x, const tensor &norm_w, float eps, const tensor &xn, int n_pairs,
                        const tensor *const *w, const tensor *const *out) override {
        gpu.mul_mat_normed(x, norm_w, eps, xn, n_pairs, w, out);
    }
    void mul_mat_add(const tensor &x, const tensor &w, const tensor &tmp, const tensor &acc) override {
        gpu.mul_mat_add(x, w, tmp, acc);
    }
    void glu_mul_mat_add(const tensor &gate, const tensor &up, glu_kind kind, const tensor &w, const tensor &tmp,
                         const tensor &acc) override {
        gpu.glu_mul_mat_add(gate, up, kind, w, tmp, acc);
    }
    void rms_norm_add(const tensor &x, const tensor &w, float eps, const tensor &acc) override {
        gpu.rms_norm_add(x, w, eps, acc);
    }
    void qk_rope_store(const tensor &q, const tensor &k, const tensor &v, const qk_rope_store_params &p) override {
        gpu.qk_rope_store(q, k, v, p);
    }
};

cuda_step_graph::cuda_step_graph(cuda_backend_api &gpu, int64_t n_ids, size_t staging_bytes)
    : gpu_(gpu), n_ids_(n_ids), staging_bytes_(staging_bytes) {
    if (n_ids < 1) throw error("cuda step graph: n_ids must be positive");
    impl_ = std::make_unique<impl>(gpu, n_ids, staging_bytes);
}

cuda_step_graph::~cuda_step_graph() {
    if (graph_ >= 0) gpu_.graph_destroy(graph_);
}

bool cuda_step_graph::stale() const { return graph_ >= 0 && epoch_ != gpu_.scratch_epoch(); }

void cuda_step_graph::capture(const std::function<void(backend &)> &fn) {
    if (graph_ >= 0) gpu_.graph_destroy(graph_);
    graph_ = -1;
    impl_->ids_used = 0;
    impl_->staging_used = 0;
    impl_->downloads.clear();
    const uint64_t epoch = gpu_.scratch_epoch();
    gpu_.set_device_positions(true);
    try {
        gpu_.capture_begin();
        fn(*impl_);
        const int g = gpu_.capture_end();
        gpu_.set_device_positions(false);
        graph_ = g;
    } catch (...) {
        gpu_.capture_abort();
        gpu_.set_device_positions(false);
        impl_->downloads.clear();
        throw;
    }
    epoch_ = epoch;
    if (gpu_.scratch_epoch() != epoch_) {  // cannot happen (growth is refused while capturing); be safe
        gpu_.graph_destroy(graph_);
        graph_ = -1;
        throw error("cuda step graph: scratch reallocated during capture");
    }
}

void cuda_step_graph::replay(const int32_t *ids, int64_t pos) {
    if (graph_ < 0) throw error("cuda step graph: replay before capture");
    if (stale()) throw error("cuda step graph: scratch was reallocated since capture; capture again");
    auto st = static_cast<cudaStream_t>(gpu_.stream());
    std::memcpy(impl_->ids_pinned, ids, static_cast<size_t>(n_ids_) * 4);
    ck(cudaMemcpyAsync(impl_->ids_dev, impl_->ids_pinned, static_cast<size_t>(n_ids_) * 4, cudaMemcpyHostToDevice, st),
       "ids upload");
    gpu_.set_step_pos(pos);
    gpu_.graph_launch(graph_);
    gpu_.synchronize();  // also reports device-side position / id checks
    for (const auto &d : impl_->downloads) std::memcpy(d.host, impl_->staging + d.offset, d.bytes);
}

}  // namespace fathom
