// Internal to the DS4 MoE kernels (ds4_moe.cu, ds4_moe_route.cu): the router launch with the PDL choice
// the decode chain needs (the public launch_moe_route / launch_moe_route_batch of ds4_kernels.h and
// ds4_prefill.h launch without it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fathom::cuda::ds4 {

// The router's limits: experts per layer, experts used per token.
constexpr int kMaxExperts = 1024, kMaxUsed = 32;

// moe_route_kernel on n_tok blocks (one token each; decode: 1): logits [n_tok, E] -> ids / weights
// [n_tok, k]. pdl: programmatic stream serialisation (the kernel waits for its predecessor before
// reading logits, then lets a PDL-launched gate/up kernel start). Throws fathom::error on a bad
// geometry or a failed launch.
void moe_route_launch(const float *logits, int E, const float *bias, const int32_t *tid2eid, int64_t n_vocab,
                      const int32_t *token, int k, float scale, int32_t *ids, float *weights, uint32_t *err, bool pdl,
                      cudaStream_t s, int64_t n_tok = 1);

}  // namespace fathom::cuda::ds4
