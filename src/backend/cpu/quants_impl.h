// Private to the quant kernels (quants*.cpp): ggml-compatible block layouts, the per-ISA kernel
// tables that quants.cpp dispatches through, and small scalar helpers shared by every ISA file.
// Nothing here is part of the backend API; callers use quants.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cpu/quants.h"

namespace fathom::cpu::detail {

// ---- Block layouts (byte-exact with ggml; static_asserts pin the GGUF type sizes) ----------------
constexpr int qk32 = 32;   // elements per block of the q4_0 .. q8_1 and mxfp4 families
constexpr int qk_k = 256;  // elements per k-quant / iq super-block

struct block_q4_0 { uint16_t d; uint8_t qs[16]; };                       // x = d * (q - 8)
struct block_q4_1 { uint16_t d, m; uint8_t qs[16]; };                    // x = d * q + m
struct block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };        // x = d * (q - 16)
struct block_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };     // x = d * q + m
struct block_q8_0 { uint16_t d; int8_t qs[32]; };                        // x = d * q
struct block_q8_1 { uint16_t d, s; int8_t qs[32]; };                     // s = d * sum(q), f16
struct block_mxfp4 { uint8_t e; uint8_t qs[16]; };                       // x = e2m1(q) * 2^(e-127)
struct block_q2_k { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct block_q3_k { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct block_q4_k { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct block_q5_k { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct block_q6_k { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct block_q8_k { float d; int8_t qs[256]; int16_t bsums[16]; };       // bsums: sums of 16 qs
struct block_iq2_xxs { uint16_t d; uint16_t qs[32]; };

static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20);
static_assert(sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24);
static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q8_1) == 36 && sizeof(block_mxfp4) == 17);
static_assert(sizeof(block_q2_k) == 84 && sizeof(block_q3_k) == 110 && sizeof(block_q4_k) == 144);
static_assert(sizeof(block_q5_k) == 176 && sizeof(block_q6_k) == 210 && sizeof(block_q8_k) == 292);
static_assert(sizeof(block_iq2_xxs) == 66);

// ---- Kernel tables ---------------------------------------------------------------------------------
using dequant_fn = void (*)(const void *src, float *dst, int64_t n);
using quant_fn = void (*)(const float *src, void *dst, int64_t n);
using dot_fn = float (*)(int64_t n, const void *w, const void *a);
using gemm_fn = void (*)(int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1,
                         const void *X, size_t x_stride, int64_t M, float *y, int64_t ldy);

constexpr int n_type_slots = 40;  // dtype ids are < 40 (core/types.cpp)

struct kernel_table {
    dequant_fn dequant[n_type_slots] = {};
    quant_fn quant[n_type_slots] = {};
    // Activation conversion as ggml-cpu's x86 from_float (q8_0/q8_1: id = 127/amax, round half to
    // even); null: same as quant.
    quant_fn quant_act[n_type_slots] = {};
    dot_fn dot[n_type_slots] = {};    // weight type -> dot against vec_dot_type(weight)
    gemm_fn gemm[n_type_slots] = {};  // null: quants.cpp loops dot()
};

void fill_generic(kernel_table &t);  // quants_generic.cpp: every compute type
void fill_avx2(kernel_table &t);     // quants_avx2.cpp: overrides for hot types
void fill_avx512(kernel_table &t);   // quants_avx512.cpp: overrides on top of avx2

// ---- Scalar helpers ----------------------------------------------------------------------------------
// Internal linkage on purpose: this header is compiled in TUs with different ISA flags, and an
// external inline function could be deduplicated by the linker into a copy holding AVX-512 code.
namespace {

inline int slot(dtype t) { return static_cast<int>(t); }

inline float fp16(uint16_t h) { return f16_to_f32(h); }

// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e-128) as a float, exact for every e (subnormal for e < 2).
inline float e8m0_to_fp32_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// e2m1 code -> value * 2 (so the table is integral); paired with e8m0_to_fp32_half.
inline constexpr int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 6-bit scale j and min j (j < 8) of a q4_k / q5_k 12-byte scales array.
inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t &d, uint8_t &m) {
    if (j < 4) {
        d = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// Signed 6-bit scale i (i < 16) of a q3_k block, already offset by -32.
inline int q3k_scale(const uint8_t *s, int i) {
    int lo = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    int hi = (s[8 + (i % 4)] >> (2 * (i / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

// Heap scratch owned by one thread (kept between calls). A plain new[] instead of std::vector so
// that no std template gets instantiated with ISA-specific code in the x86 kernel TUs.
template <class T>
struct scratch {
    T *p = nullptr;
    size_t n = 0;
    scratch() = default;
    scratch(const scratch &) = delete;
    scratch &operator=(const scratch &) = delete;
    ~scratch() { delete[] p; }
    T *get(size_t want) {
        if (want > n) {
            delete[] p;
            p = new T[want];
            n = want;
        }
        return p;
    }
};

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

}  // namespace
}  // namespace fathom::cpu::detail
