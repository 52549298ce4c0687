// Sampling support on the device: the summary of one step's logits that fathom::sampler::sample_top
// (include/fathom/sampling.h) draws from, so the n_vocab logits never cross to the host.
//   work = logits with the sampler's penalties applied to the listed (token, count) pairs
//          (llama.cpp repeat penalty, then count * frequency + presence subtracted, clamped finite;
//          -inf stays -inf: the same f32 operations as sampler.cpp),
//   max  = max of work, z = sum of exp(work - max) (f32 subtraction, exp rounded to f32 from a
//          double exp as the host's correctly rounded expf, summed in f64 in a fixed tree order),
//   top  = the k largest of work (ties at the cut: lower ids), unordered,
//   bad  = number of NaN or +inf logits (the host sampler rejects those).
// Kernels: cuda_sample.cu. Test: tests/backend/cuda/test_cuda_sample.cpp (against sampler::sample on the
// host over the full logits).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fathom::cuda {

struct logits_top_args {
    const float *logits = nullptr;      // [n] device
    int64_t n = 0;
    const int32_t *pen_ids = nullptr;   // [n_pen] device, distinct ids in [0, n)
    const int32_t *pen_counts = nullptr;
    int n_pen = 0;
    float repeat = 1.0f, frequency = 0.0f, presence = 0.0f;
    int k = 1;                          // 1 <= k <= 4096
};
// Device outputs: ids / vals [min(k, n)], stats: max (f32), z (f64), bad (u32). work: scratch [n].
struct logits_top_out {
    int32_t *ids = nullptr;
    float *vals = nullptr;
    float *max = nullptr;
    double *z = nullptr;
    uint32_t *bad = nullptr;
    float *work = nullptr;
};
constexpr int logits_top_max_k = 4096;
void launch_logits_top(const logits_top_args &a, const logits_top_out &o, cudaStream_t s);

}  // namespace fathom::cuda
