// Tensor element types as numbered in GGUF files (the ggml_type ids), with their block geometry.
// Quantisation is a property of a tensor's type: every kernel dispatches on this enum.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fathom {

enum class dtype : uint32_t {
    f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q8_1 = 9,
    q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, q8_k = 15,
    iq2_xxs = 16, iq2_xs = 17, iq3_xxs = 18, iq1_s = 19, iq4_nl = 20, iq3_s = 21, iq2_s = 22, iq4_xs = 23,
    i8 = 24, i16 = 25, i32 = 26, i64 = 27, f64 = 28, iq1_m = 29, bf16 = 30,
    tq1_0 = 34, tq2_0 = 35, mxfp4 = 39,
};

struct dtype_traits {
    std::string_view name;  // lower-case ggml name, e.g. "q4_k"
    uint32_t block_size;    // elements per block (1 for plain types)
    uint32_t type_size;     // bytes per block
    bool known;             // the id is a ggml type whose geometry we know
    bool compute;           // Fathom has dequantisation + dot kernels for it
};

// Traits for an id read from a file; unknown ids return {known=false}.
const dtype_traits &dtype_info(uint32_t id);
inline const dtype_traits &dtype_info(dtype t) { return dtype_info(static_cast<uint32_t>(t)); }
inline std::string_view dtype_name(dtype t) { return dtype_info(t).name; }

// Bytes for a row of n elements; n must be a multiple of the block size (checked by callers).
inline size_t dtype_row_bytes(dtype t, int64_t n) {
    const auto &ti = dtype_info(t);
    return static_cast<size_t>(n / ti.block_size) * ti.type_size;
}

}  // namespace fathom
