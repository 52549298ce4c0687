// KV cache allocation (see kv_cache.h).
#include "kv/kv_cache.h"

#include <string>

#include "core/error.h"

namespace fathom {

uint64_t kv_cache::bytes_per_token(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, dtype type) {
    return static_cast<uint64_t>(n_layer) * 2u * static_cast<uint64_t>(n_head_kv) * static_cast<uint64_t>(head_dim) *
           (type == dtype::f16 ? 2u : 4u);
}

kv_cache::kv_cache(backend &be, int32_t n_layer_, int32_t n_head_kv_, int32_t head_dim_, int64_t n_ctx_, dtype type_)
    : n_ctx(n_ctx_), n_layer(n_layer_), n_head_kv(n_head_kv_), head_dim(head_dim_), type(type_), be_(be) {
    if (type != dtype::f16 && type != dtype::f32) throw error("kv cache: type must be f16 or f32");
    if (n_ctx <= 0 || n_layer <= 0 || n_head_kv <= 0 || head_dim <= 0)
        throw error("kv cache: invalid geometry (n_ctx " + std::to_string(n_ctx) + ")");
    const int64_t rows = static_cast<int64_t>(n_head_kv) * n_ctx;
    const size_t per = dtype_row_bytes(type, head_dim) * static_cast<size_t>(rows);
    mem_ = be.alloc(per * 2 * static_cast<size_t>(n_layer));
    auto *p = static_cast<uint8_t *>(mem_);
    k.reserve(static_cast<size_t>(n_layer));
    v.reserve(static_cast<size_t>(n_layer));
    for (int32_t l = 0; l < n_layer; ++l) {
        k.push_back(make_tensor(type, head_dim, rows, p));
        p += per;
        v.push_back(make_tensor(type, head_dim, rows, p));
        p += per;
    }
}

kv_cache::~kv_cache() { be_.release(mem_); }

}  // namespace fathom
