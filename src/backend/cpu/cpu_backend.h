// CPU backend internals shared with tests (tests reach them through this private header; the
// engine only sees backend.h). The CPU backend runs every op at once on a persistent thread pool.
#pragma once
#include "backend/backend.h"

namespace fathom::cpu {

// Row split helper: the [begin, end) share of thread ith out of nth over n items, aligned to
// `align` items so register-blocked kernels get whole tiles (the last share takes the remainder).
inline void split_range(int64_t n, int ith, int nth, int64_t align, int64_t &begin, int64_t &end) {
    const int64_t blocks = (n + align - 1) / align;
    const int64_t per = blocks / nth, extra = blocks % nth;
    const int64_t b0 = ith * per + (ith < extra ? ith : extra);
    const int64_t b1 = b0 + per + (ith < extra ? 1 : 0);
    begin = b0 * align < n ? b0 * align : n;
    end = b1 * align < n ? b1 * align : n;
}

}  // namespace fathom::cpu
