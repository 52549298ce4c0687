// Kernel flight recorder for the decode step (a measurement aid; the device image has no Nsight
// Systems): in a build compiled with -DFATHOM_KTRACE, every block of an instrumented kernel appends
// one record (kernel id, block, start and end %globaltimer ns, SM) to a device buffer while one is
// bound; other builds compile the hooks to nothing and bind_all reports false. Records are appended
// in completion order through one atomic counter, so a replayed CUDA graph is recorded as it runs
// (the buffer is read from device variables at run time: binding after the capture works).
// bench_cuda_ds4 --ktrace FILE writes one step's records; scripts/device/ktrace.py turns them into
// launches and a timeline.
//
// Each instrumented .cu file: FATHOM_KTRACE_TU(file) once at global scope (after its includes), and
// FATHOM_KTRACE_SCOPE(k_...) as a kernel's first statement (thread 0 writes the record when it leaves
// the kernel: a block's "end" is thread 0's exit, earlier than the block's where warp 0 returns early).
#pragma once

#include <cstdint>

namespace fathom::cuda::ktrace {

struct record {
    uint64_t start, end;  // ns (%globaltimer): the block's start, and when its thread 0 left the kernel
    uint32_t kernel, block, sm;
    uint32_t grid;  // %gridid (low 32 bits): which launch (launches of one kernel may run concurrently)
};
static_assert(sizeof(record) == 32, "ktrace record layout");

enum kernel_id : uint32_t {
    k_gemv_q8x = 1,
    k_hc_split,
    k_moe_route,
    k_moe_gate_up,
    k_moe_down,
    k_head_norm_rope,
    k_kv_finish,
    k_compressor_step,
    k_attn_split,
    k_attn_split_mma,
    k_attn_combine,
    k_indexer_score,
    k_topk_select,
    k_argmax,
    k_count
};
const char *name(uint32_t kernel);

// Binds buf (room for cap records) and the counter n (u32, device) in every instrumented file; null
// buf unbinds. Returns whether any file of this build records.
bool bind_all(record *buf, uint32_t *n, uint32_t cap);

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t now() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ uint32_t gridid() {
    uint64_t g;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
    return static_cast<uint32_t>(g);
}
__device__ __forceinline__ uint32_t smid() {
    uint32_t s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
#endif

}  // namespace fathom::cuda::ktrace

#ifdef FATHOM_KTRACE
#define FATHOM_KTRACE_TU(file)                                                                                     \
    static __device__ ::fathom::cuda::ktrace::record *fathom_ktrace_buf_ = nullptr;                               \
    static __device__ uint32_t *fathom_ktrace_n_ = nullptr;                                                        \
    static __device__ uint32_t fathom_ktrace_cap_ = 0;                                                             \
    namespace {                                                                                                    \
    struct fathom_ktrace_scope_ {                                                                                  \
        uint64_t t0;                                                                                               \
        uint32_t k;                                                                                                \
        __device__ explicit fathom_ktrace_scope_(uint32_t kk) : t0(::fathom::cuda::ktrace::now()), k(kk) {}       \
        __device__ ~fathom_ktrace_scope_() {                                                                       \
            if (threadIdx.x != 0 || !fathom_ktrace_buf_) return;                                                   \
            const uint32_t i = atomicAdd(fathom_ktrace_n_, 1u);                                                    \
            if (i < fathom_ktrace_cap_)                                                                            \
                fathom_ktrace_buf_[i] = {t0, ::fathom::cuda::ktrace::now(), k, blockIdx.x + gridDim.x * blockIdx.y, \
                                         ::fathom::cuda::ktrace::smid(), ::fathom::cuda::ktrace::gridid()};        \
        }                                                                                                          \
    };                                                                                                             \
    }                                                                                                              \
    bool fathom_ktrace_bind_##file(::fathom::cuda::ktrace::record *b, uint32_t *n, uint32_t cap) {                 \
        return cudaMemcpyToSymbol(fathom_ktrace_buf_, &b, sizeof b) == cudaSuccess &&                              \
               cudaMemcpyToSymbol(fathom_ktrace_n_, &n, sizeof n) == cudaSuccess &&                                \
               cudaMemcpyToSymbol(fathom_ktrace_cap_, &cap, sizeof cap) == cudaSuccess;                            \
    }
#define FATHOM_KTRACE_SCOPE(id) ::fathom_ktrace_scope_ fathom_ktrace_s_(::fathom::cuda::ktrace::id)
#else
#define FATHOM_KTRACE_TU(file)                                                                                     \
    bool fathom_ktrace_bind_##file(::fathom::cuda::ktrace::record *, uint32_t *, uint32_t) { return false; }
#define FATHOM_KTRACE_SCOPE(id) \
    do {                        \
    } while (0)
#endif
