// Host-side views of DS4 weights for the CUDA suites' CPU references (test_cuda_ds4.cpp,
// test_cuda_ds4_prefill_mm.cpp): a ds4::matrix / ds4::expert_bank over bytes the test owns.
#pragma once
#include <cstdint>
#include <vector>

#include "core/types.h"
#include "models/deepseek4.h"

namespace fathom::cuda_test {

// rows x cols of type t, packed rows, in b.
inline ds4::matrix host_matrix(dtype t, const std::vector<uint8_t> &b, int64_t rows, int64_t cols) {
    return {t, b.data(), rows, cols, dtype_row_bytes(t, cols)};
}
// n experts of rows x cols each, back to back in b.
inline ds4::expert_bank host_bank(dtype t, const std::vector<uint8_t> &b, int64_t rows, int64_t cols, int64_t n) {
    ds4::expert_bank e;
    e.first = host_matrix(t, b, rows, cols);
    e.n = n;
    e.expert_bytes = e.first.row_bytes * static_cast<size_t>(rows);
    return e;
}

}  // namespace fathom::cuda_test
