// A pipeline rank's blocks on one GPU (stage_device::cuda_device >= 0, pipeline.h): the rank's weights
// and KV state on that device, the HC state crossing in host memory. pipeline_rank calls only this
// interface; the CUDA implementation (dist/cuda/gpu_stage_cuda.cpp, over ds4::cuda_sequence of
// models/cuda/deepseek4_cuda.h) exists only in CUDA builds, and a build without CUDA gets
// dist/no_cuda/gpu_stage_no_cuda.cpp, whose functions throw.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "dist/pipeline.h"

namespace fathom::dist {

class gpu_stage {
  public:
    virtual ~gpu_stage() = default;
    // The rank's blocks over the next tokens (positions n_past, n_past + 1, ...; ds4::cuda_sequence::
    // eval_stage): x [n, n_hc * D] is the HC state entering the range (ignored on the first rank: the
    // tokens are embedded here) and receives the state leaving it (unless the range ends with the last
    // block, which writes `logits` as ds4::cuda_sequence::eval does instead).
    virtual void eval(std::span<const int32_t> tokens, std::span<float> x, std::span<float> logits) = 0;
    // Forget the sequence (n_past 0).
    virtual void reset() = 0;
};

// Rank `lr`'s stage on dev.cuda_device: dev.weights when given (the engine's upload of this range on
// this device), else the blocks uploaded here; a sequence of dev.n_ctx tokens. Throws a one-line
// fathom::error when it cannot be built (no CUDA backend in this build, n_ctx < 1, device memory).
std::unique_ptr<gpu_stage> make_gpu_stage(const ds4::model &m, const stage_device &dev, layer_range lr,
                                          ds4::qat_mode qat, kv_precision kv);

// Upload blocks [lr.first, lr.last) of `m` to CUDA device `ordinal` (a stage's share: the embedding
// comes with block 0, the output head with the last block), for stage_device::weights. `progress`
// (done, total bytes) may be empty. Throws without CUDA in the build.
std::shared_ptr<const ds4::cuda_weights> upload_stage(
    const ds4::model &m, int ordinal, layer_range lr, ds4::qat_mode qat, kv_precision kv,
    const std::function<void(uint64_t, uint64_t)> &progress = {});
// Bytes one decode step reads from a stage's weights (ds4::cuda_bytes_per_token).
double stage_bytes_per_token(const ds4::cuda_weights &w);

}  // namespace fathom::dist
