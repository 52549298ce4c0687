// Per-session key/value cache for dense transformers: for every layer one K and one V tensor of
// [n_head_kv * n_ctx rows x head_dim], head-major (row h*n_ctx + pos) so the attention op reads
// each head's keys contiguously. F16 by default (half the memory, what llama.cpp stores), F32 for
// reference runs. The memory comes from the backend and is sized to n_ctx at creation; the CPU
// backend maps it lazily, so unused positions cost no resident memory. Positions >= n_used are
// stale and never read (the session truncates by lowering n_used).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace fathom {

struct kv_cache {
    int64_t n_ctx = 0;
    int32_t n_layer = 0, n_head_kv = 0, head_dim = 0;
    dtype type = dtype::f16;
    std::vector<tensor> k, v;  // [n_layer]
    int64_t n_used = 0;        // positions [0, n_used) hold valid entries

    kv_cache(backend &be, int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int64_t n_ctx, dtype type);
    ~kv_cache();
    kv_cache(const kv_cache &) = delete;
    kv_cache &operator=(const kv_cache &) = delete;

    // Bytes one token occupies across all layers (K and V).
    static uint64_t bytes_per_token(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, dtype type);

private:
    backend &be_;
    void *mem_ = nullptr;
};

}  // namespace fathom
