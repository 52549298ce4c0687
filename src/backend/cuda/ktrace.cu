// ktrace.h's host side: the names and the binding of every instrumented file.
#include "backend/cuda/ktrace.h"

#include <cuda_runtime.h>

// One per instrumented file (FATHOM_KTRACE_TU): false in files built without FATHOM_KTRACE.
bool fathom_ktrace_bind_ds4_gemv(fathom::cuda::ktrace::record *, uint32_t *, uint32_t);
bool fathom_ktrace_bind_ds4_hc(fathom::cuda::ktrace::record *, uint32_t *, uint32_t);
bool fathom_ktrace_bind_ds4_moe(fathom::cuda::ktrace::record *, uint32_t *, uint32_t);
bool fathom_ktrace_bind_ds4_moe_route(fathom::cuda::ktrace::record *, uint32_t *, uint32_t);
bool fathom_ktrace_bind_ds4_attn(fathom::cuda::ktrace::record *, uint32_t *, uint32_t);
bool fathom_ktrace_bind_ds4_indexer(fathom::cuda::ktrace::record *, uint32_t *, uint32_t);

namespace fathom::cuda::ktrace {

const char *name(uint32_t kernel) {
    switch (kernel) {
    case k_gemv_q8x: return "gemv_q8x";
    case k_hc_split: return "hc_split";
    case k_moe_route: return "moe_route";
    case k_moe_gate_up: return "moe_gate_up";
    case k_moe_down: return "moe_down";
    case k_head_norm_rope: return "head_norm_rope";
    case k_kv_finish: return "kv_finish";
    case k_compressor_step: return "compressor_step";
    case k_attn_split: return "attn_split";
    case k_attn_split_mma: return "attn_split_mma";
    case k_attn_combine: return "attn_combine";
    case k_indexer_score: return "indexer_score";
    case k_topk_select: return "topk_select";
    case k_argmax: return "argmax";
    default: return "?";
    }
}

bool bind_all(record *buf, uint32_t *n, uint32_t cap) {
    bool any = false;
    for (auto *bind : {fathom_ktrace_bind_ds4_gemv, fathom_ktrace_bind_ds4_hc, fathom_ktrace_bind_ds4_moe,
                       fathom_ktrace_bind_ds4_moe_route, fathom_ktrace_bind_ds4_attn, fathom_ktrace_bind_ds4_indexer})
        any = bind(buf, n, cap) || any;
    return any;
}

}  // namespace fathom::cuda::ktrace
