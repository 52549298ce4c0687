// Public entry points of the quant kernels (quants.h): argument checks, the CPUID-based ISA
// detection, and dispatch through one kernel table per ISA level (scalar <- avx2 <- avx512, each
// level starting from the one below and overriding what it implements).
#include <atomic>
#include <string>

#include "backend/cpu/quants_impl.h"
#include "backend/cpu/quants_iq2.h"
#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FATHOM_X86 1
#endif

namespace fathom::cpu {

using namespace detail;

namespace {

#ifdef FATHOM_X86
uint64_t read_xcr0() {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

isa probe_isa() {
#ifdef FATHOM_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return isa::scalar;
    const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave || !avx || !fma || !f16c) return isa::scalar;
    const uint64_t xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) return isa::scalar;  // OS saves XMM and YMM state
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return isa::scalar;
    const bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
    if (!avx2 || !bmi2) return isa::scalar;
    const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
    const bool vnni = c & (1u << 11);
    const bool zmm_os = (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM_Hi256, Hi16_ZMM state
    if (f && dq && bw && vl && vnni && zmm_os) return isa::avx512;
    return isa::avx2;
#else
    return isa::scalar;
#endif
}

struct tables {
    kernel_table level[3];
    tables() {
        fill_generic(level[0]);
        level[1] = level[0];
        fill_avx2(level[1]);
        fill_avx2_iq2(level[1]);  // quants_iq2.h
        level[2] = level[1];
        fill_avx512(level[2]);
        fill_avx512_iq2(level[2]);
    }
};

const tables &all_tables() {
    static const tables t;
    return t;
}

std::atomic<int> g_active{-1};

const kernel_table &active_table() {
    int a = g_active.load(std::memory_order_relaxed);
    if (a < 0) {
        a = static_cast<int>(detected_isa());
        g_active.store(a, std::memory_order_relaxed);
    }
    return all_tables().level[a];
}

std::string type_str(dtype t) { return std::string(dtype_name(t)) + " (id " + std::to_string(static_cast<uint32_t>(t)) + ")"; }

void check_row(const char *what, dtype t, int64_t n) {
    const auto &ti = dtype_info(t);
    if (!ti.known) throw error(std::string(what) + ": unknown dtype " + type_str(t));
    if (n < 0 || n % ti.block_size != 0)
        throw error(std::string(what) + ": n=" + std::to_string(n) + " is not a non-negative multiple of the " +
                    std::string(ti.name) + " block size " + std::to_string(ti.block_size));
}

}  // namespace

isa detected_isa() {
    static const isa d = probe_isa();
    return d;
}

isa active_isa() {
    (void)active_table();
    return static_cast<isa>(g_active.load(std::memory_order_relaxed));
}

void force_isa(isa level) {
    const int want = static_cast<int>(level), best = static_cast<int>(detected_isa());
    g_active.store(want < best ? want : best, std::memory_order_relaxed);
}

const char *isa_name(isa level) {
    switch (level) {
        case isa::scalar: return "scalar";
        case isa::avx2: return "avx2";
        case isa::avx512: return "avx512";
    }
    return "unknown";
}

dtype vec_dot_type(dtype weight) {
    switch (weight) {
        case dtype::q4_0: case dtype::q5_0: case dtype::q8_0: case dtype::mxfp4: return dtype::q8_0;
        case dtype::q4_1: case dtype::q5_1: return dtype::q8_1;
        case dtype::q2_k: case dtype::q3_k: case dtype::q4_k: case dtype::q5_k: case dtype::q6_k:
        case dtype::iq2_xxs: return dtype::q8_k;
        case dtype::f16: return dtype::f16;
        case dtype::bf16: return dtype::bf16;
        case dtype::f32: return dtype::f32;
        default: throw error("vec_dot_type: no dot product kernel for dtype " + type_str(weight));
    }
}

void dequantize_row(dtype t, const void *src, float *dst, int64_t n) {
    check_row("dequantize_row", t, n);
    const auto fn = active_table().dequant[slot(t)];
    if (!fn) throw error("dequantize_row: no dequantisation kernel for dtype " + type_str(t));
    fn(src, dst, n);
}

void quantize_row(dtype t, const float *src, void *dst, int64_t n) {
    check_row("quantize_row", t, n);
    const auto fn = active_table().quant[slot(t)];
    if (!fn) throw error("quantize_row: no quantiser for dtype " + type_str(t));
    fn(src, dst, n);
}

void quantize_row_act(dtype t, const float *src, void *dst, int64_t n) {
    check_row("quantize_row_act", t, n);
    const auto &tab = active_table();
    const auto fn = tab.quant_act[slot(t)] ? tab.quant_act[slot(t)] : tab.quant[slot(t)];
    if (!fn) throw error("quantize_row_act: no quantiser for dtype " + type_str(t));
    fn(src, dst, n);
}

float vec_dot(dtype w, int64_t n, const void *wrow, const void *arow) {
    check_row("vec_dot", w, n);
    const auto fn = active_table().dot[slot(w)];
    if (!fn) throw error("vec_dot: no dot product kernel for dtype " + type_str(w));
    return fn(n, wrow, arow);
}

void gemm(dtype w, int64_t K, const void *W, size_t w_stride, int64_t r0, int64_t r1, const void *X,
          size_t x_stride, int64_t M, float *y, int64_t ldy) {
    check_row("gemm", w, K);
    if (r0 < 0 || r1 < r0 || M < 0 || (M > 1 && ldy < r1))
        throw error("gemm: bad tile r0=" + std::to_string(r0) + " r1=" + std::to_string(r1) + " M=" +
                    std::to_string(M) + " ldy=" + std::to_string(ldy));
    const auto &t = active_table();
    if (const auto g = t.gemm[slot(w)]) return g(K, W, w_stride, r0, r1, X, x_stride, M, y, ldy);
    const auto dot = t.dot[slot(w)];
    if (!dot) throw error("gemm: no dot product kernel for dtype " + type_str(w));
    const auto *wb = static_cast<const uint8_t *>(W);
    const auto *xb = static_cast<const uint8_t *>(X);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t m = 0; m < M; ++m) y[m * ldy + r] = dot(K, wb + r * w_stride, xb + m * x_stride);
}

}  // namespace fathom::cpu
