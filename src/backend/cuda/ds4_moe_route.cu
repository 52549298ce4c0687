// DS4 MoE router on CUDA: sqrt-softplus scores, hash or biased top-k, weight normalisation (spec section
// 5), one block per token (decode: one; prefill chunks: launch_moe_route_batch), in the CPU's order; and the
// seeded fill of synthetic weights. Split out of ds4_moe.cu (the expert GEMVs), which launches the router at
// the head of its decode chain through moe_route_launch (ds4_moe_route.h).
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/cuda_pdl.cuh"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_moe_route.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"

#include "backend/cuda/ktrace.h"

FATHOM_KTRACE_TU(ds4_moe_route)

namespace fathom::cuda::ds4 {
namespace {

// softplus as the CPU computes it in float (log1pf(expf(x)), torch threshold 20), each step
// evaluated in double and rounded once: the correctly rounded float result of each step.
__device__ __forceinline__ float softplus_ref(float x) {
    if (x > 20.0f) return x;
    const float e = static_cast<float>(exp(static_cast<double>(x)));
    return static_cast<float>(log1p(static_cast<double>(e)));
}

// Scores by the whole block of kRouteThreads (one expert per thread at E = 256: the logit and bias
// loads and the double-precision softplus of all experts overlap; one warp doing 8 experts each in
// turn spent ~8 dependent L2 round trips + softplus chains, ~3 us of the serial router front), one
// barrier, then warp 0 alone: top-k by k rounds of a warp-wide argmax (larger value, then lower id)
// over the experts not yet taken, the order of the CPU's partial_sort (a whole-block top-k spent ~2
// barriers per chosen expert). PDL (launch_moe_ffn): logits are read after pdl_wait, and the
// dependent gate/up kernel is let launch only after it (everything before this kernel has then
// completed, which gate/up relies on).
constexpr int kRouteThreads = 256;
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const float *__restrict__ logits, int E, const float *__restrict__ bias,
                     const int32_t *__restrict__ tid2eid, int64_t n_vocab, const int32_t *__restrict__ token, int k,
                     float scale, int32_t *ids, float *weights, uint32_t *err) {
    FATHOM_KTRACE_SCOPE(k_moe_route);
    __shared__ float score[kMaxExperts], biased[kMaxExperts];
    __shared__ unsigned char taken[kMaxExperts];
    __shared__ int chosen[kMaxUsed];
    // Block b routes token b of a chunk (launch_moe_route_batch: logits [n_tok, E], ids / weights
    // [n_tok, k]); the decode launch is the one-block case (b = 0), unchanged.
    const int64_t b = blockIdx.x;
    logits += b * E;
    token += b;
    ids += b * k;
    weights += b * k;
    pdl_wait();
    pdl_launch_dependents();  // a PDL-launched gate/up kernel starts its shared expert meanwhile
    for (int e = static_cast<int>(threadIdx.x); e < E; e += static_cast<int>(blockDim.x)) {
        const float sc = sqrtf(softplus_ref(logits[e]));
        score[e] = sc;
        if (bias) biased[e] = sc + bias[e];
        taken[e] = 0;
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;  // warp 0 only from here: no further block barriers
    const int lane = threadIdx.x;
    if (!bias) {
        if (lane == 0) {
            const int32_t t = *token;
            bool ok = t >= 0 && t < n_vocab;
            for (int j = 0; ok && j < k; ++j) {
                const int32_t e = tid2eid[static_cast<int64_t>(t) * k + j];
                if (e < 0 || e >= E) ok = false;
                chosen[j] = e;
            }
            if (!ok) {
                atomicOr(err, (t >= 0 && t < n_vocab) ? err_expert_id : err_token_id);
                for (int j = 0; j < k; ++j) chosen[j] = -1;
            }
        }
    } else {
        for (int j = 0; j < k; ++j) {
            float bv = 0.0f;
            int bi = -1;
            for (int e = lane; e < E; e += 32) {
                if (taken[e]) continue;
                const float v = biased[e];
                if (bi < 0 || v > bv) {  // ascending e per lane: ties keep the lower id
                    bv = v;
                    bi = e;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                    bv = ov;
                    bi = oi;
                }
            }
            // every lane holds the same winner (k <= E: one is always left)
            if (lane == 0) {
                chosen[j] = bi;
                taken[bi] = 1;
            }
            __syncwarp();
        }
    }
    __syncwarp();
    if (lane == 0) {
        if (chosen[0] < 0) {
            for (int j = 0; j < k; ++j) {
                ids[j] = -1;
                weights[j] = 0.0f;
            }
            return;
        }
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += score[chosen[j]];
        for (int j = 0; j < k; ++j) {
            ids[j] = chosen[j];
            weights[j] = score[chosen[j]] / sum * scale;
        }
    }
}

__global__ void fill_random_kernel(uint64_t *dst, size_t n_words, uint64_t seed) {
    const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n_words) return;
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    dst[i] = z ^ (z >> 31);
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

}  // namespace

// moe_route_kernel on n_tok blocks of kRouteThreads (one token each; decode: 1); pdl: programmatic
// stream serialisation (the kernel waits for its predecessor before reading logits).
void moe_route_launch(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                  const int32_t *token, int k, float scale, int32_t *ids, float *weights, uint32_t *err, bool pdl,
                  cudaStream_t s, int64_t n_tok) {
    if (n_tok < 1 || n_tok > 0x7fffffff) throw error("cuda ds4 route: bad token count " + std::to_string(n_tok));
    if (E < 1 || E > kMaxExperts || k < 1 || k > kMaxUsed || k > E)
        throw error("cuda ds4 route: unsupported expert count " + std::to_string(E) + " / used " + std::to_string(k) +
                    " (E <= 1024, used <= 32)");
    if (!bias && (!tid2eid || !token || n_vocab < 1))
        throw error("cuda ds4 route: hash routing needs tid2eid, n_vocab and the token id");
    const cudaError_t e = launch_pdl(moe_route_kernel, dim3(static_cast<unsigned>(n_tok)), dim3(kRouteThreads), 0, s,
                                     pdl, logits, E, bias, tid2eid, n_vocab, token, k, scale, ids, weights, err);
    if (e != cudaSuccess) throw error(std::string("cuda ds4 route: launch failed: ") + cudaGetErrorString(e));
}

void launch_moe_route(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                      const int32_t *token, int k, float scale, int32_t *ids, float *weights, uint32_t *err,
                      cudaStream_t s) {
    moe_route_launch(logits, E, bias, tid2eid, n_vocab, token, k, scale, ids, weights, err, false, s);
}

void launch_moe_route_batch(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                            const int32_t *tokens, int64_t n_tok, int k, float scale, int32_t *ids, float *weights,
                            uint32_t *err, cudaStream_t s) {
    if (n_tok == 0) return;
    moe_route_launch(logits, E, bias, tid2eid, n_vocab, tokens, k, scale, ids, weights, err, false, s, n_tok);
}

void launch_fill_random(void *dst, size_t n, uint64_t seed, cudaStream_t s) {
    if (n % 8 != 0 || reinterpret_cast<uintptr_t>(dst) % 8 != 0)
        throw error("cuda ds4 fill: size and address must be multiples of 8 bytes");
    const size_t words = n / 8;
    if (!words) return;
    fill_random_kernel<<<static_cast<unsigned>((words + 255) / 256), 256, 0, s>>>(static_cast<uint64_t *>(dst), words,
                                                                                  seed);
    check_launch("fill");
}

}  // namespace fathom::cuda::ds4
