// Fast decode GEMV for DS4's dense weights (layouts, numerics and launch ordering: ds4_gemv.h).
//
// One kernel serves the plain, grouped and multi-matrix forms: a launch covers up to 8 "segments"
// (weight, output, rows per x group) laid end to end over the grid. Within a segment a group of G
// threads (G = 32 .. 512, a multiple of 32) owns one row; thread i of the group reads the row's
// 16-byte (q8_0, f32) or 8-byte (f16) chunks i, i + G, i + 2G, ... U of them per batch, all loads
// issued before any arithmetic so each thread keeps U loads in flight (Little's law: the H200 needs
// ~4 MB in flight, ~32 KB per SM). G is chosen per segment so that the grid fills the device about
// once over and each thread issues 1-8 loads. Weight loads bypass L1 (ld.global.nc.L1::no_allocate)
// so the activation x, which every row reads, stays in L1; x is read as float4, 512 contiguous bytes
// per warp instruction for every type.
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <mutex>
#include <vector>

#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_pdl.cuh"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_quant.cuh"
#include "core/error.h"

#include "backend/cuda/ktrace.h"

FATHOM_KTRACE_TU(ds4_gemv)

namespace fathom::cuda::ds4 {
namespace {

constexpr int kMaxGroup = 512;  // threads per row at most (and the block size limit)
constexpr int kMinBlock = 256;  // threads per block at least
constexpr int kTile = 512;      // q8_0 repack tile (elements)

enum seg_kind : int32_t { kind_q8 = 0, kind_f16 = 1, kind_f32 = 2 };

struct seg_dev {
    const uint8_t *q;
    const uint8_t *scales;
    float *y;
    size_t q_stride, s_stride;
    int64_t rows, rows_per_group;
    int32_t kind;
    int32_t accumulate;  // 1: y[r] += W_r . x (gemv_segment::accumulate)
    int32_t group;   // G: threads per row
    int32_t chunks;  // loads per row (16 bytes each; f16: 8 bytes)
    uint32_t block_begin;
};
struct seg_table {
    seg_dev s[gemv_max_segments];
    int32_t n;
    int64_t cols;
};

// ---- device helpers ---------------------------------------------------------------------------------

__device__ __forceinline__ uint4 ld_stream16(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_stream8(const uint8_t *p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// A row's result into y[i]: stored, or added to y's value (accumulate: the residual add folded into the
// GEMV; the thread that writes y[i] is the only one that reads it, after the PDL wait).
template <class Seg>
__device__ __forceinline__ void store_y(const Seg &sg, int64_t i, float v) {
    sg.y[i] = sg.accumulate ? sg.y[i] + v : v;
}

// Byte j of w (w already XORed with 0x80808080, i.e. q + 128) as the float q, exactly:
// 0x4B0000bb is 2^23 + bb; subtracting 2^23 + 128 leaves q. One PRMT + one FADD instead of the
// quarter-rate integer-to-float conversion.
template <int J>
__device__ __forceinline__ float i8_to_f(uint32_t w) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | J)) - 8388736.0f;
}
__device__ __forceinline__ float dot4_i8(uint32_t w, const float4 x) {
    float s = i8_to_f<0>(w) * x.x;
    s = fmaf(i8_to_f<1>(w), x.y, s);
    s = fmaf(i8_to_f<2>(w), x.z, s);
    return fmaf(i8_to_f<3>(w), x.w, s);
}
// Activation loads: plain coherent global loads (cached in L1), not the read-only path, because x is
// written by the preceding kernel, which may still be running when this kernel starts (PDL): the
// read-only path is only defined for data constant over the kernel's lifetime. Volatile keeps them
// after griddepcontrol.wait.
__device__ __forceinline__ float4 ldx4(const float *p) {
    float4 v;
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

// Partial dot product of one row for thread gl of its group (chunks gl, gl + G, ...). The first
// batch's weight loads are issued before pdl_wait(): only they may overlap the previous kernel.
template <int U>
__device__ __forceinline__ float row_q8(const seg_dev &sg, int64_t r, const float *x, int gl) {
    const uint8_t *q = sg.q + static_cast<size_t>(r) * sg.q_stride;
    const uint8_t *sc = sg.scales + static_cast<size_t>(r) * sg.s_stride;
    const int G = sg.group, chunks = sg.chunks;
    float acc = 0.0f;
    for (int c0 = gl; c0 < chunks; c0 += G * U) {
        uint4 v[U];
        unsigned short d[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) {
                v[u] = ld_stream16(q + 16 * static_cast<size_t>(c));
                d[u] = __ldg(reinterpret_cast<const unsigned short *>(sc + 2 * (c >> 1)));
            }
        }
        if (c0 == gl) pdl_wait();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) {
                const float *xb = x + 16 * static_cast<int64_t>(c);  // chunk c = elements 16c .. 16c + 15
                const uint32_t w[4] = {v[u].x ^ 0x80808080u, v[u].y ^ 0x80808080u, v[u].z ^ 0x80808080u,
                                       v[u].w ^ 0x80808080u};
                const float ds = __half2float(__ushort_as_half(d[u]));
                acc = fmaf(dot4_i8(w[0], ldx4(xb)), ds, acc);
                acc = fmaf(dot4_i8(w[1], ldx4(xb + 4)), ds, acc);
                acc = fmaf(dot4_i8(w[2], ldx4(xb + 8)), ds, acc);
                acc = fmaf(dot4_i8(w[3], ldx4(xb + 12)), ds, acc);
            }
        }
    }
    return acc;
}

// f16 rows in place: chunk c = 8 bytes = elements 4c .. 4c + 3.
template <int U>
__device__ __forceinline__ float row_f16(const seg_dev &sg, int64_t r, const float *x, int gl) {
    const uint8_t *q = sg.q + static_cast<size_t>(r) * sg.q_stride;
    const int G = sg.group, chunks = sg.chunks;
    float acc = 0.0f;
    for (int c0 = gl; c0 < chunks; c0 += G * U) {
        uint2 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) v[u] = ld_stream8(q + 8 * static_cast<size_t>(c));
        }
        if (c0 == gl) pdl_wait();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) {
                const float4 xv = ldx4(x + 4 * c);
                const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&v[u].x));
                const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&v[u].y));
                acc = fmaf(a.x, xv.x, acc);
                acc = fmaf(a.y, xv.y, acc);
                acc = fmaf(b.x, xv.z, acc);
                acc = fmaf(b.y, xv.w, acc);
            }
        }
    }
    return acc;
}

// f32 rows in place: chunk c = 16 bytes = elements 4c .. 4c + 3.
template <int U>
__device__ __forceinline__ float row_f32(const seg_dev &sg, int64_t r, const float *x, int gl) {
    const uint8_t *q = sg.q + static_cast<size_t>(r) * sg.q_stride;
    const int G = sg.group, chunks = sg.chunks;
    float acc = 0.0f;
    for (int c0 = gl; c0 < chunks; c0 += G * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) v[u] = ld_stream16(q + 16 * static_cast<size_t>(c));
        }
        if (c0 == gl) pdl_wait();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) {
                const float4 xv = ldx4(x + 4 * c);
                acc = fmaf(__uint_as_float(v[u].x), xv.x, acc);
                acc = fmaf(__uint_as_float(v[u].y), xv.y, acc);
                acc = fmaf(__uint_as_float(v[u].z), xv.z, acc);
                acc = fmaf(__uint_as_float(v[u].w), xv.w, acc);
            }
        }
    }
    return acc;
}

// Grid: the segments' blocks end to end (segment i owns blocks [block_begin_i, block_begin_{i+1})).
// Block: blockDim.x threads = blockDim.x / G rows of the segment. Rows past the segment's end still
// take part in the shuffles and the __syncthreads; the only early return (G == 32, no shared-memory
// step) is taken by the whole block.
// At most 64 registers (2 blocks of 512 per SM): 1024 resident threads per SM.
template <int U>
__global__ void __launch_bounds__(kMaxGroup, 2)
    gemv_seg_kernel(const __grid_constant__ seg_table t, const float *x) {
    __shared__ float part[kMaxGroup / 32];
    pdl_launch_dependents();  // the next kernel may start its weight loads (it waits for us itself)
    int si = 0;
    for (int i = 1; i < t.n; ++i)
        if (blockIdx.x >= t.s[i].block_begin) si = i;
    const seg_dev &sg = t.s[si];
    const int G = sg.group;
    const int grp = static_cast<int>(threadIdx.x) / G, gl = static_cast<int>(threadIdx.x) % G;
    const int64_t r = static_cast<int64_t>(blockIdx.x - sg.block_begin) * (blockDim.x / G) + grp;
    float acc = 0.0f;
    if (r < sg.rows) {
        const float *xr = x + (r / sg.rows_per_group) * t.cols;
        // 16-byte types batch at most 4 loads (64 registers); f16's 8-byte loads batch up to 8.
        constexpr int U16 = U > 4 ? 4 : U;
        if (sg.kind == kind_q8)
            acc = row_q8<U16>(sg, r, xr, gl);
        else if (sg.kind == kind_f16)
            acc = row_f16<U>(sg, r, xr, gl);
        else
            acc = row_f32<U16>(sg, r, xr, gl);
    }
    pdl_wait();  // threads without chunks have not waited yet; y is written below
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (G == 32) {
        if (gl == 0 && r < sg.rows) store_y(sg, r, acc);
        return;  // uniform over the block: G is per segment and a block lies in one segment
    }
    const int warp = static_cast<int>(threadIdx.x) >> 5, wpg = G >> 5;
    if ((threadIdx.x & 31) == 0) part[warp] = acc;
    __syncthreads();
    if (gl == 0 && r < sg.rows) {
        float s = part[warp];
        for (int i = 1; i < wpg; ++i) s += part[warp + i];
        store_y(sg, r, s);
    }
}

// ---- persistent GEMV with int8 activations (q8x) ----------------------------------------------------
// The decode default for tables of q8_0 and f16 weights. Why: the kernel above converts every q8_0
// weight byte to float and multiplies it by an f32 activation read from L1 (~4 instructions and 4
// bytes of L1 traffic per weight), and each block owns 1-16 rows, so blocks turn over every few
// microseconds with nothing in flight in between: 52-61 % of the copy rate. Here
//   * each block owns a contiguous range of rows of ONE segment (blocks per segment in proportion to
//     its bytes, about one resident wave in all), so it streams for the whole kernel;
//   * a block quantises the x group(s) its rows read ONCE into shared memory, as the MoE kernels do
//     (ds4q::q8_scale / q8_inv / q8_round: ggml's q8_1 reference rounding, d kept in f32): int8 words in
//     element order and the 16 block scales of every 512-element tile in the repacked weight order, so
//     lane l's float4 at 16 t + 4 (l / 8) holds the scales of its four runs (blocks 4 k + l / 8);
//   * q8_0 products are exact integer dp4a sums per 4-element run, scaled by d_w * d_x: per 16 weight
//     bytes 4 dp4a, 4 shared loads of x words and one of scales, 4 FMA (the CPU's quantised matmul and
//     llama.cpp do the same: the activations are vec_dot_type q8 blocks);
//   * one warp per row; each lane walks its row's 16-byte chunks c = lane + 32 j (q8_0: chunk = 16
//     weights; f16: chunk = 8 weights, x as 2 float4 from L1) in batches of kQ8xU slots that may span
//     rows (short rows like q_b's 1024 columns still keep kQ8xU loads in flight), double-buffered: the
//     next batch's loads are issued before the current batch's arithmetic.
// Numerics: q8_0 rows get the int8-activation result (|error| vs exact f32 x ~ 1e-3 relative, the CPU
// quantised path's own error); f16 rows keep f32 activations and the f32 kernel's per-lane f32
// accumulation. Per row: lane partials in chunk order, then a warp xor tree: deterministic.
// Warps per block (the kernel's WARPS, chosen by plan_q8x), 32 warps per SM either way at 64 registers:
//   16 (2 blocks per SM) when every segment has >= kQ8xWideMinRows rows: after the PDL wait every
//      block reads x from L2 (all blocks the same lines) and quantises it before its first dot, and
//      that prologue is on the step's critical path; half the blocks, half the reads, and a 16-warp
//      block quantises 8192 columns in one load round (out_b: 3.9 -> 2.3 us from the wait to x ready,
//      decode 135.3-136.5 -> 138.0 tok/s at 8K, docs/PERF.md);
//   8 (4 per SM) otherwise: tables with small segments (the ratio-4 projection set has 64-row
//      weights) balance better on the finer grain (11.3 vs 14.0 us for that set with 16).
// The x read itself costs more than its bytes: ~1-2 us after the release even for 1024 columns,
// behind the first weight batch every block issued before the wait.
constexpr int kQ8xWarps = 8, kQ8xWarpsWide = 16;
#ifndef FATHOM_Q8X_WIDE_MIN_ROWS
#define FATHOM_Q8X_WIDE_MIN_ROWS 1024  // (a variant build's macro: the A/B of the choice)
#endif
constexpr int64_t kQ8xWideMinRows = FATHOM_Q8X_WIDE_MIN_ROWS;
// U = 2 slots per batch (4 in flight per lane with the double buffer) at 64 registers. Measured
// against (U, blocks per SM) = (4, 2), (8, 1), (4, 3), (2, 3) on the DS4 shapes, this was fastest on
// every large one (CudaDs4GemvBench, docs/PERF.md): warps in flight matter more than loads per warp;
// so did more bytes in flight through a per-lane cp.async ring in shared memory (2-8 batches, the
// whole ring requested before the wait): 129.7-135.5 vs 136.1-136.5 tok/s.
constexpr int kQ8xU = 2;
constexpr int64_t kQ8xMaxCols = 16384;  // shared memory per x group: cols + cols / 8 bytes

struct q8x_seg {
    const uint8_t *q, *scales;
    float *y;
    size_t q_stride, s_stride;
    int64_t rows, rows_per_group, rows_per_block;
    int32_t f16;     // 1: f16 rows (f32 x), 0: repacked q8_0 rows (int8 x)
    int32_t accumulate;  // 1: y[r] += W_r . x (gemv_segment::accumulate)
    int32_t chunks;  // 16-byte chunks per row
    int32_t
        warps_per_row;  // W: 1, 2, 4, 8 or 16 (few rows: several warps share one, parts summed at the end)
    uint32_t block_begin;
    int64_t y_stride;  // the columns kernel: column c's outputs at y + c * y_stride
};
struct q8x_table {
    q8x_seg s[gemv_max_segments];
    int32_t n;
    // RMSNorm prologue (launch_gemv_multi_normed, one x group; null: none): x' = (x * r) * norm_w, r =
    // 1 / sqrt(mean(x^2) + eps) as cuda::launch_rms_norm computes it; f16 rows then read x' from shared
    // memory at byte xf_off.
    const float *norm_w;
    float norm_eps;
    uint32_t xf_off;
    // GLU prologue (launch_gemv_glu; null: none): x' = act(x) * glu_up, x the gate (glu_act 0: silu,
    // 1: gelu_tanh, cuda_ops.cu's elementwise swiglu / geglu arithmetic). Only q8_0 segments, one group.
    const float *glu_up;
    int32_t glu_act;
    int32_t warps;    // the kernel's WARPS (host side: which instance to launch)
    uint64_t *trace;  // FATHOM_Q8X_TRACE builds: 6 u64 per block (set_gemv_trace)
    int64_t cols;
};

// x group g (cols floats at x + g * cols) -> int8 words xq [cols] and scales ds [cols / 32] (tile
// order above). 8 threads per 32-element block, a float4 each; loads of kQ8xBatch blocks per 8 threads
// issued before any arithmetic (one L2 round trip per batch).
constexpr int kQ8xBatch = 4;
__device__ __forceinline__ float glu_of(float g, float u, int act) {
    if (act == 0) return g / (1.0f + expf(-g)) * u;
    constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f, kCoef = 0.044715f;
    return 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * g * (1.0f + kCoef * g * g))) * u;
}

template <int THREADS>
// tid: the thread's index among the THREADS taking part (threadIdx.x for a block, the lane for one warp).
__device__ __forceinline__ void quantise_x(int tid, const float *x, int64_t cols, uint32_t *xq, float *ds,
                                           const float *norm_w = nullptr, float r = 1.0f,
                                           const float *glu_up = nullptr, int glu_act = 0) {
    const int sub = tid & 7, nblk = static_cast<int>(cols >> 5);
    constexpr int per_pass = THREADS / 8;  // blocks per pass; a warp takes 4 consecutive ones
    // The loop bound is warp-uniform (the warp's first block), so the shuffles see the whole warp.
    for (int wb = static_cast<int>(tid >> 5) * 4; wb < nblk; wb += kQ8xBatch * per_pass) {
        const int b0 = wb + static_cast<int>((tid >> 3) & 3);
        float4 v[kQ8xBatch];
#pragma unroll
        for (int i = 0; i < kQ8xBatch; ++i) {
            const int b = b0 + i * per_pass;
            v[i] = b < nblk ? ldx4(x + 32 * static_cast<int64_t>(b) + 4 * sub)
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (norm_w && b < nblk) {  // rms_norm_kernel's (x * r) * w
                const float4 wv =
                    *reinterpret_cast<const float4 *>(norm_w + 32 * static_cast<int64_t>(b) + 4 * sub);
                v[i] =
                    make_float4(__fmul_rn(__fmul_rn(v[i].x, r), wv.x), __fmul_rn(__fmul_rn(v[i].y, r), wv.y),
                                __fmul_rn(__fmul_rn(v[i].z, r), wv.z), __fmul_rn(__fmul_rn(v[i].w, r), wv.w));
            }
            if (glu_up && b < nblk) {  // act(gate) * up
                const float4 u = ldx4(glu_up + 32 * static_cast<int64_t>(b) + 4 * sub);
                v[i] = make_float4(glu_of(v[i].x, u.x, glu_act), glu_of(v[i].y, u.y, glu_act),
                                   glu_of(v[i].z, u.z, glu_act), glu_of(v[i].w, u.w, glu_act));
            }
        }
#pragma unroll
        for (int i = 0; i < kQ8xBatch; ++i) {
            const int b =
                b0 + i * per_pass;  // the 8 threads of a block agree on b: the shuffles stay within them
            float amax = fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w)));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
            const float d = ds4q::q8_scale(amax), id = ds4q::q8_inv(d);
            if (b < nblk) {
                xq[8 * b + sub] = ds4q::q8_round(v[i].x, id) | ds4q::q8_round(v[i].y, id) << 8 |
                                  ds4q::q8_round(v[i].z, id) << 16 | ds4q::q8_round(v[i].w, id) << 24;
                if (sub == 0) ds[b] = d;
            }
        }
    }
}

// r = 1 / sqrt(mean(x^2) + eps) over cols floats with cuda_ops.cu rms_norm_kernel's arithmetic and
// reduction tree (256 threads: strided double partials of float squares, warp xor sums, the 8 warp
// sums in order), so the normed activations have the separate kernel's bits.
__device__ __forceinline__ float q8x_norm_r(const float *x, int64_t cols, float eps, double *sh) {
    constexpr int kNorm = 256;  // rms_norm_kernel's block size: threads t < 256 form its partials
    double ss = 0;
    if (threadIdx.x < kNorm)  // unrolled: the loads of 4 steps are issued before their squares are summed
#pragma unroll 4
        for (int64_t i = threadIdx.x; i < cols; i += kNorm) {
            const float v = x[i];
            ss += static_cast<double>(__fmul_rn(v, v));
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0 && threadIdx.x < kNorm) sh[threadIdx.x >> 5] = ss;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < kNorm / 32; ++i) t += sh[i];
    return 1.0f / sqrtf(static_cast<float>(t / static_cast<double>(cols)) + eps);
}

// A warp's place in its block: W = warps_per_row warps share a row (sub = 0 .. W - 1 takes the
// row's tiles sub, sub + W, ...), P = WARPS / W rows are in flight per block pass; the warp's rows are
// r0 + grp + P * ri. A lane's chunk for step j of a row: c = lane + 32 (sub + W j) (tile sub + W j,
// whose 32 chunks the 32 lanes read contiguously), cpl steps per row.
struct q8x_warp {
    int64_t r0, r1, g0;
    int lane, grp, sub, W, P, cpl;
};

template <int U>
struct q8x_batch {
    uint4 v[U];
    unsigned short d[U];  // q8_0: the f16 scale of the slot's block
};

// A walk over the warp's (row, step) slots: row r (r0 + grp + P ri), step j; the row's weight and
// scale pointers advance with it, so a slot costs no index arithmetic beyond the chunk offset.
struct q8x_cursor {
    int64_t r;
    int j;
    const uint8_t *q, *sc;
};
__device__ __forceinline__ q8x_cursor q8x_start(const q8x_seg &sg, const q8x_warp &w) {
    const int64_t r = w.r0 + w.grp;
    return {r, 0, sg.q + static_cast<size_t>(r) * sg.q_stride,
            sg.scales + static_cast<size_t>(r) * sg.s_stride};
}
__device__ __forceinline__ bool q8x_next(const q8x_seg &sg, const q8x_warp &w, q8x_cursor &k) {
    if (++k.j < w.cpl) return false;
    k.j = 0;
    k.r += w.P;
    k.q += static_cast<size_t>(w.P) * sg.q_stride;
    k.sc += static_cast<size_t>(w.P) * sg.s_stride;
    return true;  // a new row
}

// Issues the loads of the next U slots.
template <bool F16, int U>
__device__ __forceinline__ void q8x_load(const q8x_seg &sg, const q8x_warp &w, q8x_cursor &k,
                                         q8x_batch<U> &b) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int tile = w.sub + w.W * k.j, c = w.lane + 32 * tile;
        if (k.r < w.r1 && c < sg.chunks) {
            b.v[u] = ld_stream16(k.q + 16 * c);
            if (!F16) b.d[u] = __ldg(reinterpret_cast<const unsigned short *>(k.sc + 2 * (16 * tile + (w.lane >> 1))));
        }
        q8x_next(sg, w, k);
    }
}

// Where row r's activations are: f16 rows: its x group in global memory; q8_0 rows: its shared slot.
struct q8x_xrow {
    const float *xf;
    const uint32_t *xw;
    const float *dx;
};
__device__ __forceinline__ q8x_xrow q8x_x_of(const q8x_seg &sg, const q8x_warp &w, const float *x,
                                             int64_t cols, const uint8_t *smem, int64_t r) {
    const int64_t g =
        static_cast<int64_t>(static_cast<uint64_t>(r) / static_cast<uint64_t>(sg.rows_per_group));
    const uint8_t *xs = smem + (g == w.g0 ? 0 : static_cast<size_t>(cols + cols / 8));
    return {x + g * cols, reinterpret_cast<const uint32_t *>(xs) + 4 * w.lane,
            reinterpret_cast<const float *>(xs + cols) + (w.lane >> 1)};
}
// f16 rows' x: global (ldx4: coherent, after the PDL wait) or the normed copy in shared memory.
template <bool XS>
__device__ __forceinline__ float4 q8x_ldx(const float *p) {
    if constexpr (XS)
        return *reinterpret_cast<const float4 *>(p);
    else
        return ldx4(p);
}

// One 16-byte q8_0 chunk of lane l: half of block p = l / 2 of its tile (elements 16 l .. 16 l + 15 of
// the tile), dotted with the int8 x words of the same elements by 4 chained dp4a (exact); the lane pair's
// halves are summed (exact: the block's integer dot), and the even lane alone accumulates the block:
// acc = fma(d_w * d_x, dot, acc); the odd lane adds +0 (its acc stays +0). So a row's f32 arithmetic
// is, per lane pair, one fma per 32-element block in the pair's block order: the canonical order of
// ds4_gemv.h that the tensor-core columns kernel repeats. Warp-uniform call (the shuffle).
__device__ __forceinline__ float q8x_block_fma(const uint4 &wq, const uint4 &xq, unsigned short dw_bits, float dx,
                                               int lane, float acc) {
    int s = ds4q::dp4a(static_cast<int>(wq.x), static_cast<int>(xq.x), 0);
    s = ds4q::dp4a(static_cast<int>(wq.y), static_cast<int>(xq.y), s);
    s = ds4q::dp4a(static_cast<int>(wq.z), static_cast<int>(xq.z), s);
    s = ds4q::dp4a(static_cast<int>(wq.w), static_cast<int>(xq.w), s);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    const float sc = (lane & 1) ? 0.0f : __half2float(__ushort_as_half(dw_bits)) * dx;
    return fmaf(sc, ds4q::i2f_exact(s), acc);
}

// Arithmetic of one batch. A row's last slot ends the warp's part of it: warp xor sum, then lane 0
// stores it to part[(r - r0) W + sub] (summed over sub at the end of the block), or to y when W = 1.
template <bool F16, int U, bool XS>
__device__ __forceinline__ void q8x_compute(const q8x_seg &sg, const q8x_warp &w, const float *x,
                                            int64_t cols, const uint8_t *smem, float *part, q8x_cursor &k,
                                            q8x_xrow &xr, const q8x_batch<U> &b, float &acc) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (k.r >= w.r1) return;  // warp-uniform: the warp's rows are done
        const int tile = w.sub + w.W * k.j, c = w.lane + 32 * tile;
        if (c < sg.chunks) {
            if (F16) {
                const float4 xa = q8x_ldx<XS>(xr.xf + 8 * c), xb = q8x_ldx<XS>(xr.xf + 8 * c + 4);
                const uint32_t hw[4] = {b.v[u].x, b.v[u].y, b.v[u].z, b.v[u].w};
                const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hw[i]));
                    acc = fmaf(f.x, xv[2 * i], acc);
                    acc = fmaf(f.y, xv[2 * i + 1], acc);
                }
            } else {
                const uint4 xv = *reinterpret_cast<const uint4 *>(xr.xw + 128 * tile);
                acc = q8x_block_fma(b.v[u], xv, b.d[u], xr.dx[16 * tile], w.lane, acc);
            }
        }
        const int64_t r = k.r;
        if (q8x_next(sg, w, k)) {  // warp-uniform: the warp's part of row r is complete
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (w.lane == 0) {
                if (w.W == 1)
                    store_y(sg, r, acc);
                else
                    part[(r - w.r0) * w.W + w.sub] = acc;
            }
            acc = 0.0f;
            if (k.r < w.r1) xr = q8x_x_of(sg, w, x, cols, smem, k.r);
        }
    }
}

// FATHOM_Q8X_TRACE builds (set_gemv_trace): thread 0 stamps field f of its block's 6 u64 (0 start, also
// the SM id in field 4; 1 after the PDL wait; 2 x ready; 3 end) with %globaltimer. Nothing otherwise.
__device__ __forceinline__ void q8x_stamp(const q8x_table &t, int f) {
#ifdef FATHOM_Q8X_TRACE
    if (!t.trace || threadIdx.x != 0) return;
    t.trace[6 * blockIdx.x + f] = ktrace::now();
    if (f == 0) t.trace[6 * blockIdx.x + 4] = ktrace::smid();
#else
    (void)t, (void)f;
#endif
}

constexpr int kQ8xMaxParts = 1024;  // rows per block x warps per row

template <int WARPS, bool F16, int U, bool XS, bool NORM>
__device__ __forceinline__ void q8x_rows(const q8x_seg &sg, const q8x_table &t, const float *x,
                                         const uint8_t *smem, float *part, int64_t r0, int64_t r1) {
    const int warp = static_cast<int>(threadIdx.x >> 5);
    q8x_warp w;
    w.r0 = r0;
    w.r1 = r1;
    w.g0 = r0 / sg.rows_per_group;
    w.lane = static_cast<int>(threadIdx.x & 31);
    w.W = sg.warps_per_row;
    w.P = WARPS / w.W;
    w.grp = warp / w.W;
    w.sub = warp % w.W;
    w.cpl = (sg.chunks + 32 * w.W - 1) / (32 * w.W);
    const int64_t cols = t.cols;
    q8x_cursor lk = q8x_start(sg, w), ck = lk;  // load / compute cursors
    q8x_batch<U> A, B;
    // the first batch's loads: weights only, so they may overlap the previous kernel. (A 32 KB bulk L2
    // prefetch of the block's rows here, before the wait, once paid; with today's step it costs 2-3 %:
    // 8K decode 132.4-132.8 -> 134.7-136.0 tok/s, 128K 124.5 -> 127.1-127.6 without it, docs/PERF.md.)
    q8x_load<F16, U>(sg, w, lk, A);
    pdl_wait();
    q8x_stamp(t, 1);
    float nr = 1.0f;
    if constexpr (NORM) {
        __shared__ double norm_sh[8];
        nr = q8x_norm_r(x, cols, t.norm_eps, norm_sh);
    }
    if constexpr (XS) {  // f16 rows of a normed table: x' into shared memory (one group)
        float *xf = reinterpret_cast<float *>(const_cast<uint8_t *>(smem) + t.xf_off);
        for (int64_t i = threadIdx.x; i < cols; i += 32 * WARPS)
            xf[i] = __fmul_rn(__fmul_rn(x[i], nr), t.norm_w[i]);
        __syncthreads();
    }
    if (!F16) {  // block-uniform: quantise the x group(s) of the block's rows (at most two)
        uint8_t *s = const_cast<uint8_t *>(smem);
        const size_t slot_bytes = static_cast<size_t>(cols + cols / 8);
        const int64_t last = (r1 - 1) / sg.rows_per_group;
        quantise_x<32 * WARPS>(static_cast<int>(threadIdx.x), x + w.g0 * cols, cols, reinterpret_cast<uint32_t *>(s),
                               reinterpret_cast<float *>(s + cols), NORM ? t.norm_w : nullptr, nr, t.glu_up,
                               t.glu_act);
        if (last != w.g0)
            quantise_x<32 * WARPS>(static_cast<int>(threadIdx.x), x + last * cols, cols, reinterpret_cast<uint32_t *>(s + slot_bytes),
                                   reinterpret_cast<float *>(s + slot_bytes + cols));
        __syncthreads();
    }
    q8x_stamp(t, 2);
    float acc = 0.0f;
    const float *xg = XS ? reinterpret_cast<const float *>(smem + t.xf_off) : x;  // f16 rows' x
    q8x_xrow xr = q8x_x_of(sg, w, xg, cols, smem, ck.r);
    for (;;) {
        const bool more_b = lk.r < r1;
        if (more_b) q8x_load<F16, U>(sg, w, lk, B);
        q8x_compute<F16, U, XS>(sg, w, xg, cols, smem, part, ck, xr, A, acc);
        if (!more_b) break;
        const bool more_a = lk.r < r1;
        if (more_a) q8x_load<F16, U>(sg, w, lk, A);
        q8x_compute<F16, U, XS>(sg, w, xg, cols, smem, part, ck, xr, B, acc);
        if (!more_a) break;
    }
    if (w.W > 1) {  // block-uniform: the rows' warp parts, summed in sub order
        __syncthreads();
        for (int64_t i = threadIdx.x; i < r1 - r0; i += blockDim.x) {
            float v = part[i * w.W];
            for (int k = 1; k < w.W; ++k) v += part[i * w.W + k];
            store_y(sg, r0 + i, v);
        }
    }
}

// Grid: the segments' blocks end to end; block b of segment i owns rows [b rpb, (b + 1) rpb).
template <int WARPS, int U, bool NORM>
__global__ void __launch_bounds__(32 * WARPS, 32 / WARPS)
    gemv_q8x_kernel(const __grid_constant__ q8x_table t, const float *x) {
    FATHOM_KTRACE_SCOPE(k_gemv_q8x);
    extern __shared__ __align__(16) uint8_t q8x_smem[];
    __shared__ float part[kQ8xMaxParts];
    q8x_stamp(t, 0);
    pdl_launch_dependents();
    int si = 0;
    for (int i = 1; i < t.n; ++i)
        if (blockIdx.x >= t.s[i].block_begin) si = i;
    const q8x_seg &sg = t.s[si];
    const int64_t r0 = static_cast<int64_t>(blockIdx.x - sg.block_begin) * sg.rows_per_block;
    const int64_t r1 = r0 + sg.rows_per_block < sg.rows ? r0 + sg.rows_per_block : sg.rows;
    if (!sg.f16)
        q8x_rows<WARPS, false, U, false, NORM>(sg, t, x, q8x_smem, part, r0, r1);
    else
        q8x_rows<WARPS, true, U, NORM, NORM>(sg, t, x, q8x_smem, part, r0, r1);
#ifdef FATHOM_Q8X_TRACE
    __syncthreads();  // the block's end: every warp done
#endif
    q8x_stamp(t, 3);
}

// ---- the columns form: several x at once (a multi-row decode step) ----------------------------------------
// Column c (c < nx) reads x + c * x_stride and writes each segment's y + c * y_stride. Every weight chunk is
// loaded once and dotted with every column's activations; each column's arithmetic is the single-x kernel's
// exactly (the same quantisation of its x, the same per-lane fmaf order, warp tree and part sums: the plan -
// blocks, rows per block, warps per row - is the single-x launch's), so a column's outputs are bit-identical
// to launching the kernel above on its x alone. Dynamic shared memory: per column its x slot(s) (col_bytes
// apart), then the normed f16 x (xf_off, cols floats per column), then the warp parts (part_off, nx floats
// per (row, warp) of a block).
struct q8x_cols {
    int32_t nx;
    int64_t x_stride;
    uint32_t col_bytes;  // shared bytes of one column's x slots
    uint32_t part_off;
};

template <bool F16, int U, bool XS, int NC>
__device__ __forceinline__ void q8x_compute_cols(const q8x_seg &sg, const q8x_warp &w, const q8x_cols &cx,
                                                 const float *x, int64_t cols, const uint8_t *smem, float *part,
                                                 q8x_cursor &k, q8x_xrow &xr, const q8x_batch<U> &b, float (&acc)[NC],
                                                 int64_t xf_stride) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (k.r >= w.r1) return;  // warp-uniform: the warp's rows are done
        const int tile = w.sub + w.W * k.j, c = w.lane + 32 * tile;
        if (c < sg.chunks) {
            if (F16) {
                const uint32_t hw[4] = {b.v[u].x, b.v[u].y, b.v[u].z, b.v[u].w};
#pragma unroll
                for (int col = 0; col < NC; ++col) {
                    if (col >= cx.nx) break;  // warp-uniform
                    const float *xp = xr.xf + col * xf_stride + 8 * c;
                    const float4 xa = q8x_ldx<XS>(xp), xb = q8x_ldx<XS>(xp + 4);
                    const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hw[i]));
                        acc[col] = fmaf(f.x, xv[2 * i], acc[col]);
                        acc[col] = fmaf(f.y, xv[2 * i + 1], acc[col]);
                    }
                }
            } else {
#pragma unroll
                for (int col = 0; col < NC; ++col) {
                    if (col >= cx.nx) break;  // warp-uniform
                    const size_t off = static_cast<size_t>(col) * cx.col_bytes;
                    const uint4 xv = *reinterpret_cast<const uint4 *>(reinterpret_cast<const uint8_t *>(xr.xw + 128 * tile) + off);
                    const float dx = *reinterpret_cast<const float *>(reinterpret_cast<const uint8_t *>(xr.dx + 16 * tile) + off);
                    acc[col] = q8x_block_fma(b.v[u], xv, b.d[u], dx, w.lane, acc[col]);
                }
            }
        }
        const int64_t r = k.r;
        if (q8x_next(sg, w, k)) {  // warp-uniform: the warp's part of row r is complete
#pragma unroll
            for (int col = 0; col < NC; ++col) {
                if (col >= cx.nx) break;
                float v = acc[col];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (w.lane == 0) {
                    if (w.W == 1)
                        store_y(sg, col * sg.y_stride + r, v);
                    else
                        part[((r - w.r0) * w.W + w.sub) * cx.nx + col] = v;
                }
                acc[col] = 0.0f;
            }
            if (k.r < w.r1) xr = q8x_x_of(sg, w, x, cols, smem, k.r);
        }
    }
}

template <int WARPS, bool F16, int U, bool XS, bool NORM, int NC>
__device__ __forceinline__ void q8x_rows_cols(const q8x_seg &sg, const q8x_table &t, const q8x_cols &cx,
                                              const float *x, const uint8_t *smem, int64_t r0, int64_t r1) {
    const int warp = static_cast<int>(threadIdx.x >> 5);
    q8x_warp w;
    w.r0 = r0;
    w.r1 = r1;
    w.g0 = r0 / sg.rows_per_group;
    w.lane = static_cast<int>(threadIdx.x & 31);
    w.W = sg.warps_per_row;
    w.P = WARPS / w.W;
    w.grp = warp / w.W;
    w.sub = warp % w.W;
    w.cpl = (sg.chunks + 32 * w.W - 1) / (32 * w.W);
    const int64_t cols = t.cols;
    float *part = reinterpret_cast<float *>(const_cast<uint8_t *>(smem) + cx.part_off);
    q8x_cursor lk = q8x_start(sg, w), ck = lk;
    q8x_batch<U> A, B;
    q8x_load<F16, U>(sg, w, lk, A);
    pdl_wait();
    float nr[NC];
#pragma unroll
    for (int col = 0; col < NC; ++col) nr[col] = 1.0f;
    if constexpr (NORM) {
        __shared__ double norm_sh[8];
#pragma unroll
        for (int col = 0; col < NC; ++col) {
            if (col >= cx.nx) break;
            nr[col] = q8x_norm_r(x + col * cx.x_stride, cols, t.norm_eps, norm_sh);
            __syncthreads();  // norm_sh is rewritten by the next column
        }
    }
    if constexpr (XS) {  // f16 rows of a normed table: each column's x' into shared memory (one group)
        float *xf = reinterpret_cast<float *>(const_cast<uint8_t *>(smem) + t.xf_off);
        for (int col = 0; col < cx.nx; ++col)
            for (int64_t i = threadIdx.x; i < cols; i += 32 * WARPS)
                xf[col * cols + i] = __fmul_rn(__fmul_rn(x[col * cx.x_stride + i], nr[col]), t.norm_w[i]);
        __syncthreads();
    }
    if (!F16) {  // block-uniform: quantise every column's x group(s) of the block's rows (at most two)
        uint8_t *s = const_cast<uint8_t *>(smem);
        const size_t slot_bytes = static_cast<size_t>(cols + cols / 8);
        const int64_t last = (r1 - 1) / sg.rows_per_group;
#pragma unroll
        for (int col = 0; col < NC; ++col) {
            if (col >= cx.nx) break;
            uint8_t *sc = s + static_cast<size_t>(col) * cx.col_bytes;
            const float *xc = x + col * cx.x_stride;
            quantise_x<32 * WARPS>(static_cast<int>(threadIdx.x), xc + w.g0 * cols, cols, reinterpret_cast<uint32_t *>(sc),
                                   reinterpret_cast<float *>(sc + cols), NORM ? t.norm_w : nullptr, nr[col]);
            if (last != w.g0)
                quantise_x<32 * WARPS>(static_cast<int>(threadIdx.x), xc + last * cols, cols, reinterpret_cast<uint32_t *>(sc + slot_bytes),
                                       reinterpret_cast<float *>(sc + slot_bytes + cols));
        }
        __syncthreads();
    }
    float acc[NC];
#pragma unroll
    for (int col = 0; col < NC; ++col) acc[col] = 0.0f;
    const float *xg = XS ? reinterpret_cast<const float *>(smem + t.xf_off) : x;  // f16 rows' x (column 0)
    const int64_t xf_stride = XS ? cols : cx.x_stride;
    q8x_xrow xr = q8x_x_of(sg, w, xg, cols, smem, ck.r);
    for (;;) {
        const bool more_b = lk.r < r1;
        if (more_b) q8x_load<F16, U>(sg, w, lk, B);
        q8x_compute_cols<F16, U, XS, NC>(sg, w, cx, xg, cols, smem, part, ck, xr, A, acc, xf_stride);
        if (!more_b) break;
        const bool more_a = lk.r < r1;
        if (more_a) q8x_load<F16, U>(sg, w, lk, A);
        q8x_compute_cols<F16, U, XS, NC>(sg, w, cx, xg, cols, smem, part, ck, xr, B, acc, xf_stride);
        if (!more_a) break;
    }
    if (w.W > 1) {  // block-uniform: the rows' warp parts, summed in sub order, per column
        __syncthreads();
        for (int64_t i = threadIdx.x; i < (r1 - r0) * cx.nx; i += blockDim.x) {
            const int64_t row = i / cx.nx, col = i % cx.nx;
            float v = part[(row * w.W) * cx.nx + col];
            for (int k = 1; k < w.W; ++k) v += part[(row * w.W + k) * cx.nx + col];
            store_y(sg, col * sg.y_stride + r0 + row, v);
        }
    }
}

template <int WARPS, int U, bool NORM, int NC>
__global__ void __launch_bounds__(32 * WARPS, 1)
    gemv_q8x_cols_kernel(const __grid_constant__ q8x_table t, const __grid_constant__ q8x_cols cx, const float *x) {
    extern __shared__ __align__(16) uint8_t q8x_smem[];
    pdl_launch_dependents();
    int si = 0;
    for (int i = 1; i < t.n; ++i)
        if (blockIdx.x >= t.s[i].block_begin) si = i;
    const q8x_seg &sg = t.s[si];
    const int64_t r0 = static_cast<int64_t>(blockIdx.x - sg.block_begin) * sg.rows_per_block;
    const int64_t r1 = r0 + sg.rows_per_block < sg.rows ? r0 + sg.rows_per_block : sg.rows;
    if (!sg.f16)
        q8x_rows_cols<WARPS, false, U, false, NORM, NC>(sg, t, cx, x, q8x_smem, r0, r1);
    else
        q8x_rows_cols<WARPS, true, U, NORM, NORM, NC>(sg, t, cx, x, q8x_smem, r0, r1);
}

// ---- the columns form on tensor cores (q8_0 segments, 2..16 x) --------------------------------------------
// Every output of a q8_0 row follows the canonical order of ds4_gemv.h, which only needs each 32-element
// block's exact integer dot and one fma per block in a fixed order: an int8 MMA (m16n8k32: one k-step is
// one q8_0 block) gives the dots of 16 rows x 8 columns per instruction, so the weights stream once for all
// the columns at a few instructions per block instead of the dp4a kernel's per-column arithmetic.
// Work: a block (kMmaWarps = 16 warps, one per accumulator p of a(s, p)) owns a contiguous range of 16-row
// tiles of the q8_0 segments (the plan's segments, their W from the single-x plan). For each tile and each
// s < W, warp p walks j (blocks b = 16 (s + W j) + p), one MMA per 8 columns and k-step, and keeps
// a(s, p) of its 16 rows x nx columns in the MMA's accumulator layout (fma per element, as the decode
// lane does); the block then forms each (row, column)'s 32-lane xor tree and the running sum of the warp
// parts in the canonical order, and stores. x: every column's group quantised once into shared memory by
// the block (warp w takes columns w, w + 16, ..; with the RMSNorm's r of q8x_norm_r, repeated by one warp in
// the 256-thread order), again only when a tile's x group changes (grouped tables).
constexpr int kMmaWarps = 16;
// k-steps whose weight loads are issued together (x 2 tiles): 4 with 8 x, 3 with 16 (128 registers)
template <int NT>
constexpr int kMmaJ = NT == 1 ? 4 : 3;

struct q8x_mma_args {
    int32_t segs[gemv_max_segments];  // the table's q8_0 segments, in order
    int32_t tiles_begin[gemv_max_segments + 1];  // their 32-row units end to end
    int32_t n;
    int32_t nx;
    int64_t x_stride;
    uint32_t xq_stride;  // shared bytes between columns' int8 x (cols + 16: conflict-free B loads)
    uint32_t dx_off;     // shared byte offset of the columns' scales [8 NT][cols / 32 + 1] (padded: conflict-free)
    uint32_t red_off;    // shared byte offset of the tree buffers [slots][2 tiles][16 p][16 rows][16 columns] f32
    int32_t slots;       // units whose warp parts wait in shared memory for one meeting (1..kMmaSlots)
};
// Units per block-wide meeting at most (32 KB of tree buffer each).
constexpr int kMmaSlots = 4;
constexpr size_t kMmaRedBytes = 2 * 16 * 16 * 16 * sizeof(float);

// q8x_norm_r's r, by one warp: lane l stands for the 256-thread block's threads l + 32 v (v < 8), each
// summing its strided double partials in the same order; each virtual warp's xor tree is the real one
// (lane 0's value, as the block's lane 0 stores it), then the 8 sums in order.
__device__ __forceinline__ float q8x_norm_r_warp(const float *x, int64_t cols, float eps, int lane) {
    double ss[8];
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        ss[v] = 0;
        for (int64_t i = lane + 32 * v; i < cols; i += 256) {
            const float e = x[i];
            ss[v] += static_cast<double>(__fmul_rn(e, e));
        }
    }
    double t = 0;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        double a = ss[v];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        t += __shfl_sync(0xffffffffu, a, 0);
    }
    return 1.0f / sqrtf(static_cast<float>(t / static_cast<double>(cols)) + eps);
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}
__device__ __forceinline__ uint32_t ld_w32(const uint8_t *p) {
    return __ldg(reinterpret_cast<const unsigned int *>(p));
}

// Lane 0's value of the decode warp's xor tree (steps 16, 8, 4, 2, 1) over lanes 2p = v[p], odd lanes +0:
// the 16-leaf butterfly on p (p ^ 8, p ^ 4, p ^ 2, p ^ 1) ends at p = 0 with this association; the last step
// adds an odd lane's +0.
__device__ __forceinline__ float q8x_lane_tree(const float *v, int stride) {
    auto at = [&](int p) { return v[p * stride]; };
    const float x0 = ((at(0) + at(8)) + (at(4) + at(12))) + ((at(2) + at(10)) + (at(6) + at(14)));
    const float x1 = ((at(1) + at(9)) + (at(5) + at(13))) + ((at(3) + at(11)) + (at(7) + at(15)));
    return (x0 + x1) + 0.0f;
}

// Block: 16 warps (warp p = accumulator p); a unit is 32 rows (two 16-row MMA tiles) of one segment, so
// each warp has the loads of both tiles in flight. Units of one warp part (W = 1: every large DS4 segment)
// leave their a(0, p) in one of m.slots tree buffers and the block meets once per m.slots units (then every
// thread forms the trees of all of them): a meeting per unit left the warps waiting at the barrier for the
// slowest one's loads ~38 % of the time (ncu, the 4-row step on an H100). Units of W > 1 parts meet per
// part as before (the running sum over the parts), after the waiting units' trees.
template <int NT, bool NORM>
__global__ void __launch_bounds__(32 * kMmaWarps, 1)
    gemv_q8x_mma_kernel(const __grid_constant__ q8x_table t, const __grid_constant__ q8x_mma_args m, const float *x) {
    extern __shared__ __align__(16) uint8_t smem[];
    pdl_launch_dependents();
    const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
    const int g = lane >> 2, tq = lane & 3;  // the MMA fragments' row group and thread in group
    const int64_t cols = t.cols, nblk = cols / 32, ntile = cols / 512, dstride = nblk + 1;
    const int total = m.tiles_begin[m.n];
    const int ub = static_cast<int>((static_cast<int64_t>(blockIdx.x) * total) / gridDim.x);
    const int ue = static_cast<int>((static_cast<int64_t>(blockIdx.x + 1) * total) / gridDim.x);
    float *dxs = reinterpret_cast<float *>(smem + m.dx_off);
    float *red = reinterpret_cast<float *>(smem + m.red_off);  // [slots][2 tiles][16 p][16 rows][16 columns]
    // thread (tile h, row, column) of the trees
    const int th = static_cast<int>(threadIdx.x >> 8), trow = static_cast<int>((threadIdx.x >> 4) & 15),
              tcol = static_cast<int>(threadIdx.x & 15);
    int pending = 0;  // W = 1 units whose parts wait in red slots 0 .. pending - 1: units last - pending + 1 .. last
    auto meet = [&](int last) {  // block-uniform: their trees, each the decode warp's, stored
        __syncthreads();
        for (int q = 0; q < pending; ++q) {
            const int u = last - pending + 1 + q;
            int kq = 0;
            while (kq + 1 < m.n && u >= m.tiles_begin[kq + 1]) ++kq;
            const q8x_seg &sq = t.s[m.segs[kq]];
            const int64_t r = static_cast<int64_t>(u - m.tiles_begin[kq]) * 32 + 16 * th + trow;
            const float tv = q8x_lane_tree(red + q * (kMmaRedBytes / 4) + ((th * 16) * 16 + trow) * 16 + tcol, 16 * 16);
            if (tcol < m.nx && r < sq.rows) store_y(sq, tcol * sq.y_stride + r, tv);
        }
        __syncthreads();  // the slots are rewritten by the next units
        pending = 0;
    };
    pdl_wait();
    int64_t staged = -1;  // the x group in shared memory
    for (int unit = ub; unit < ue; ++unit) {
        int k = 0;
        while (k + 1 < m.n && unit >= m.tiles_begin[k + 1]) ++k;
        const q8x_seg &sg = t.s[m.segs[k]];
        const int64_t r0 = static_cast<int64_t>(unit - m.tiles_begin[k]) * 32;
        const int W = sg.warps_per_row;
        if (W > 1 && pending > 0) meet(unit - 1);  // its parts use slot 0
        const int64_t grp = r0 / sg.rows_per_group;
        if (grp != staged) {  // block-uniform
            __syncthreads();  // nobody still reads the previous group
            for (int col = warp; col < m.nx; col += kMmaWarps) {
                const float *xc = x + col * m.x_stride + grp * cols;
                const float r = NORM ? q8x_norm_r_warp(xc, cols, t.norm_eps, lane) : 1.0f;
                quantise_x<32>(lane, xc, cols, reinterpret_cast<uint32_t *>(smem + col * m.xq_stride), dxs + col * dstride,
                               NORM ? t.norm_w : nullptr, r);  // one warp: quantise_x's blocks, the same bits
            }
            __syncthreads();
            staged = grp;
        }
        // fragment rows r0 + 16 h + g and + 8 (past the segment's end: its last row, outputs dropped)
        const uint8_t *qr[4], *sr[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int64_t r = min(r0 + 8 * i + g, sg.rows - 1);  // i = 2 h + (row half)
            qr[i] = sg.q + static_cast<size_t>(r) * sg.q_stride + 4 * tq;
            sr[i] = sg.scales + static_cast<size_t>(r) * sg.s_stride;
        }
        float part = 0.0f;  // thread (tile, row, column): the running sum of the warp parts (W > 1)
        for (int sub = 0; sub < W; ++sub) {
            float acc[2][NT][4];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[h][n][e] = 0.0f;
            for (int64_t j0 = sub; j0 < ntile; j0 += static_cast<int64_t>(W) * kMmaJ<NT>) {
                uint32_t a[kMmaJ<NT>][2][4];
                unsigned short d[kMmaJ<NT>][4];
#pragma unroll
                for (int u = 0; u < kMmaJ<NT>; ++u) {
                    const int64_t tl = j0 + static_cast<int64_t>(W) * u;
                    if (tl < ntile) {
                        const int64_t b = 16 * tl + warp;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            a[u][h][0] = ld_w32(qr[2 * h] + 32 * b);
                            a[u][h][1] = ld_w32(qr[2 * h + 1] + 32 * b);
                            a[u][h][2] = ld_w32(qr[2 * h] + 32 * b + 16);
                            a[u][h][3] = ld_w32(qr[2 * h + 1] + 32 * b + 16);
                        }
#pragma unroll
                        for (int i = 0; i < 4; ++i) d[u][i] = __ldg(reinterpret_cast<const unsigned short *>(sr[i] + 2 * b));
                    }
                }
#pragma unroll
                for (int u = 0; u < kMmaJ<NT>; ++u) {
                    const int64_t tl = j0 + static_cast<int64_t>(W) * u;
                    if (tl >= ntile) break;  // warp-uniform
                    const int64_t b = 16 * tl + warp;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const uint32_t *xw = reinterpret_cast<const uint32_t *>(smem + (8 * n + g) * m.xq_stride) + 8 * b + tq;
                        const uint32_t b0 = xw[0], b1 = xw[4];
                        const int c0 = 8 * n + 2 * tq;  // this thread's accumulator columns c0, c0 + 1
                        const float dx0 = dxs[c0 * dstride + b], dx1 = dxs[(c0 + 1) * dstride + b];
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            int c[4];
                            mma_s8(c, a[u][h], b0, b1);
                            const float fa = __half2float(__ushort_as_half(d[u][2 * h]));
                            const float fb = __half2float(__ushort_as_half(d[u][2 * h + 1]));
                            acc[h][n][0] = fmaf(fa * dx0, ds4q::i2f_exact(c[0]), acc[h][n][0]);
                            acc[h][n][1] = fmaf(fa * dx1, ds4q::i2f_exact(c[1]), acc[h][n][1]);
                            acc[h][n][2] = fmaf(fb * dx0, ds4q::i2f_exact(c[2]), acc[h][n][2]);
                            acc[h][n][3] = fmaf(fb * dx1, ds4q::i2f_exact(c[3]), acc[h][n][3]);
                        }
                    }
                }
            }
            // a(sub, warp) of the unit's rows and this thread's columns -> red slot [h][warp][row][column]
            // (W = 1: the next free slot; W > 1: slot 0, one part at a time)
            float *slot = red + (W == 1 ? pending : 0) * (kMmaRedBytes / 4);
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int c0 = 8 * n + 2 * tq;
                    float *rp = slot + ((h * 16 + warp) * 16) * 16;
                    rp[g * 16 + c0] = acc[h][n][0];
                    rp[g * 16 + c0 + 1] = acc[h][n][1];
                    rp[(g + 8) * 16 + c0] = acc[h][n][2];
                    rp[(g + 8) * 16 + c0 + 1] = acc[h][n][3];
                }
            if (W == 1) break;  // its tree waits for the meeting
            __syncthreads();
            {  // thread = (tile h, row, column): the decode warp's tree, then the running sum of the parts
                const float tv = q8x_lane_tree(red + ((th * 16) * 16 + trow) * 16 + tcol, 16 * 16);
                part = sub == 0 ? tv : part + tv;
            }
            __syncthreads();  // red is rewritten by the next sub
        }
        if (W == 1) {
            if (++pending == m.slots || unit + 1 == ue) meet(unit);
            continue;
        }
        const int64_t r = r0 + 16 * th + trow;
        if (tcol < m.nx && r < sg.rows) store_y(sg, tcol * sg.y_stride + r, part);
    }
}

// Repack of q8_0 GGUF rows (34-byte blocks: f16 d, int8 qs[32]) into the split layout: the quants of a
// row end to end in element order, the scales apart in block order. One thread per 16-byte output chunk
// (row r, chunk c = elements 16 c .. 16 c + 15 = half (c & 1) of block c / 2); even chunks also write
// their block's scale.
__global__ void repack_q8_kernel(const uint8_t *__restrict__ src, size_t src_stride, int64_t rows,
                                 int64_t cols, uint8_t *__restrict__ q, uint8_t *__restrict__ sc) {
    const int64_t chunks = cols / 16;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= rows * chunks) return;
    const int64_t c = idx % chunks, r = idx / chunks;
    const uint8_t *blk = src + static_cast<size_t>(r) * src_stride + 34 * static_cast<size_t>(c >> 1);
    const uint8_t *qs = blk + 2 + 16 * (c & 1);
    uint32_t w[4];
    for (int k = 0; k < 4; ++k)
        w[k] = static_cast<uint32_t>(qs[4 * k]) | static_cast<uint32_t>(qs[4 * k + 1]) << 8 |
               static_cast<uint32_t>(qs[4 * k + 2]) << 16 | static_cast<uint32_t>(qs[4 * k + 3]) << 24;
    *reinterpret_cast<uint4 *>(q + static_cast<size_t>(r) * cols + 16 * c) = make_uint4(w[0], w[1], w[2], w[3]);
    if ((c & 1) == 0) {
        uint8_t *o = sc + static_cast<size_t>(r) * (cols / 16) + 2 * static_cast<size_t>(c >> 1);
        o[0] = blk[0];
        o[1] = blk[1];
    }
}

// ---- host ---------------------------------------------------------------------------------------------

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// The fields both kernels' segment records (seg_dev, q8x_seg) take from a segment: the weight's
// pointers, strides and rows, the output, and the rows per x group.
template <class Seg>
void set_weight(Seg &d, const gemv_segment &seg, int64_t rows_per_group) {
    const gemv_weight &w = seg.w;
    d.q = static_cast<const uint8_t *>(w.q);
    d.scales = static_cast<const uint8_t *>(w.scales);
    d.y = seg.y;
    d.accumulate = seg.accumulate ? 1 : 0;
    d.q_stride = w.q_stride;
    d.s_stride = w.s_stride;
    d.rows = w.rows;
    d.rows_per_group = rows_per_group;
}

int sm_count() {
    const device_caps *caps = current_device_caps();
    if (!caps || caps->sm_count < 1) throw error("cuda ds4 gemv: cannot query the multiprocessor count");
    return caps->sm_count;
}

int32_t kind_of(dtype t) {
    return t == dtype::q8_0 ? kind_q8 : t == dtype::f16 ? kind_f16 : kind_f32;
}
// Loads per row: q8_0 16 elements per 16 bytes, f16 4 per 8 bytes, f32 4 per 16 bytes.
int64_t chunks_of(dtype t, int64_t cols) {
    return t == dtype::q8_0 ? cols / 16 : cols / 4;
}
int64_t row_bytes_of(dtype t, int64_t cols) {
    return t == dtype::q8_0 ? cols * 17 / 16 : t == dtype::f16 ? cols * 2 : cols * 4;
}

void check_weight(const gemv_weight &w, const char *what) {
    if (!gemv_fast_supported(w.type, w.cols) || w.rows < 1 || !w.q)
        throw error(std::string("cuda ds4 ") + what + ": unsupported weight (" +
                    std::string(dtype_name(w.type)) + ", " + std::to_string(w.rows) + " x " +
                    std::to_string(w.cols) + ")");
    const bool q8 = w.type == dtype::q8_0;
    if (reinterpret_cast<uintptr_t>(w.q) % 16 != 0 || w.q_stride % 16 != 0 ||
        w.q_stride < static_cast<size_t>(q8 ? w.cols : row_bytes_of(w.type, w.cols)) ||
        (q8 && (!w.scales || reinterpret_cast<uintptr_t>(w.scales) % 16 != 0 || w.s_stride % 16 != 0 ||
                w.s_stride < static_cast<size_t>(w.cols / 16))))
        throw error(std::string("cuda ds4 ") + what + ": weight rows must be 16-byte aligned (prepare it)");
}

// Loads a thread may batch: 64 bytes (4 x 16 for q8_0 / f32, 8 x 8 for f16).
int max_loads_of(dtype t) {
    return t == dtype::f16 ? 8 : 4;
}
// Threads per row: doubled from 32 while a thread would have more than max_loads loads, or while
// the doubled grid still fits the segment's share of one resident wave (target threads): small
// matrices spread over the whole device, large ones keep 64 bytes in flight per thread. Never more
// threads than loads, never more than kMaxGroup.
int pick_group(int64_t chunks, int64_t rows, int max_loads, double target) {
    int g = 32;
    while (g < kMaxGroup && 2 * g <= chunks &&
           (chunks > static_cast<int64_t>(max_loads) * g || static_cast<double>(rows) * 2 * g <= target))
        g *= 2;
    return g;
}

template <int U>
void launch_table(const seg_table &t, unsigned blocks, int block, const float *x, cudaStream_t s) {
    const cudaError_t e =
        launch_pdl(gemv_seg_kernel<U>, dim3(blocks), dim3(static_cast<unsigned>(block)), 0, s, true, t, x);
    if (e != cudaSuccess) throw error(std::string("cuda ds4 gemv: launch failed: ") + cudaGetErrorString(e));
}

bool launch_q8x(const gemv_segment *segs, const int64_t *rpg, int n, const float *x, const char *what,
                cudaStream_t s, const float *norm_w = nullptr, float norm_eps = 0.0f, const float *glu_up = nullptr,
                int glu_act = 0);

// Fills the segment table (group sizes, block ranges) and launches. rpg[i] = rows per x group.
// The checks every launch makes: 1..8 segments of supported, aligned weights with the same cols and an
// output each, x 16-byte aligned. Returns the segments' weight bytes.
double check_segments(const gemv_segment *segs, int n, const float *x, const char *what) {
    if (n < 1 || n > gemv_max_segments) throw error(std::string("cuda ds4 ") + what + ": 1..8 segments");
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0)
        throw error(std::string("cuda ds4 ") + what + ": x must be 16-byte aligned");
    double total_bytes = 0;
    for (int i = 0; i < n; ++i) {
        check_weight(segs[i].w, what);
        if (segs[i].w.cols != segs[0].w.cols)
            throw error(std::string("cuda ds4 ") + what + ": segments differ in cols");
        if (!segs[i].y) throw error(std::string("cuda ds4 ") + what + ": null output");
        total_bytes += static_cast<double>(row_bytes_of(segs[i].w.type, segs[0].w.cols)) *
                       static_cast<double>(segs[i].w.rows);
    }
    return total_bytes;
}

void launch_segments(const gemv_segment *segs, const int64_t *rpg, int n, const float *x, const char *what,
                     cudaStream_t s) {
    const double total_bytes = check_segments(segs, n, x, what);
    seg_table t = {};
    t.n = n;
    t.cols = segs[0].w.cols;
    if (launch_q8x(segs, rpg, n, x, what, s)) return;
    // One device-full of resident threads (about 1024 per SM at the register use here), shared
    // between segments in proportion to their bytes.
    const double device_threads = 1024.0 * sm_count();
    int max_group = 32;
    int64_t max_loads = 1;
    for (int i = 0; i < n; ++i) {
        const gemv_weight &w = segs[i].w;
        const int64_t chunks = chunks_of(w.type, t.cols);
        const double share =
            static_cast<double>(row_bytes_of(w.type, t.cols)) * static_cast<double>(w.rows) / total_bytes;
        const int g = pick_group(chunks, w.rows, max_loads_of(w.type), device_threads * share);
        max_group = std::max(max_group, g);
        max_loads = std::max<int64_t>(max_loads, (chunks + g - 1) / g);
        seg_dev &d = t.s[i];
        set_weight(d, segs[i], rpg[i]);
        d.kind = kind_of(w.type);
        d.group = g;
        d.chunks = static_cast<int32_t>(chunks);
    }
    const int block = std::max(kMinBlock, max_group);
    int64_t blocks = 0;
    for (int i = 0; i < n; ++i) {
        t.s[i].block_begin = static_cast<uint32_t>(blocks);
        const int64_t rows_per_block = block / t.s[i].group;
        blocks += (t.s[i].rows + rows_per_block - 1) / rows_per_block;
    }
    if (blocks > 0x7fffffff) throw error(std::string("cuda ds4 ") + what + ": too many rows");
    const unsigned nb = static_cast<unsigned>(blocks);
    // Loads per batch: the most any thread issues, as a power of two up to 8 (16-byte types cap at 4;
    // more run in batches). 64 bytes per thread at 1024 threads per SM is 64 KB in flight per SM,
    // twice what Little's law asks.
    if (max_loads <= 1)
        launch_table<1>(t, nb, block, x, s);
    else if (max_loads <= 2)
        launch_table<2>(t, nb, block, x, s);
    else if (max_loads <= 4)
        launch_table<4>(t, nb, block, x, s);
    else
        launch_table<8>(t, nb, block, x, s);
}

// ---- q8x host side ----

bool g_q8x = true;            // set_gemv_q8_activations
bool g_q8x_mma = true;        // set_gemv_tensor_cores
int g_mma_slots = kMmaSlots;  // set_gemv_mma_slots: units per meeting of the tensor-core kernel
uint64_t *g_trace = nullptr;  // set_gemv_trace: buffer, capacity in blocks, blocks taken, launches
size_t g_trace_cap = 0, g_trace_used = 0;
std::vector<int> g_trace_launches;

// Resident blocks of gemv_q8x_kernel per SM at `smem` bytes (queried once per device and size).
int q8x_blocks_per_sm(size_t smem, int warps) {
    struct entry {
        int dev = -1, warps = 0;
        size_t smem = 0;
        int n = 0;
    };
    static thread_local entry cache[8];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) throw error("cuda ds4 gemv: no current device");
    for (const entry &e : cache)
        if (e.dev == dev && e.smem == smem && e.warps == warps) return e.n;
    int n = 0;
    const cudaError_t e =
        warps == kQ8xWarpsWide
            ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemv_q8x_kernel<kQ8xWarpsWide, kQ8xU, false>,
                                                            32 * kQ8xWarpsWide, smem)
            : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemv_q8x_kernel<kQ8xWarps, kQ8xU, false>,
                                                            32 * kQ8xWarps, smem);
    if (e != cudaSuccess || n < 1) throw error("cuda ds4 gemv: cannot query the occupancy of the q8x kernel");
    static thread_local int next = 0;
    cache[next] = {dev, warps, smem, n};
    next = (next + 1) % 8;
    return n;
}

// The q8x kernel takes the table when every segment is q8_0 or f16 (cols % 8 == 0), cols fits its
// shared memory, and every block's rows read at most two x groups (rows per block <= rows per group).
// Returns false (the caller uses the kernel above) otherwise.
bool plan_q8x(const gemv_segment *segs, const int64_t *rpg, int n, q8x_table &t, size_t &smem,
              int64_t &blocks, const float *norm_w = nullptr, float norm_eps = 0.0f, bool narrow = false) {
    const int64_t cols = segs[0].w.cols;
    if (!g_q8x || cols > kQ8xMaxCols) return false;
    if (norm_w && reinterpret_cast<uintptr_t>(norm_w) % 16 != 0) return false;
    bool any_q8 = false, any_f16 = false, grouped = false;
    double total_bytes = 0;
    for (int i = 0; i < n; ++i) {
        const dtype t = segs[i].w.type;
        if (t != dtype::q8_0 && !(t == dtype::f16 && cols % 8 == 0)) return false;
        any_q8 = any_q8 || t == dtype::q8_0;
        any_f16 = any_f16 || t == dtype::f16;
        grouped = grouped || rpg[i] < segs[i].w.rows;
        total_bytes += static_cast<double>(row_bytes_of(t, cols)) * static_cast<double>(segs[i].w.rows);
    }
    t = {};
    t.n = n;
    t.cols = cols;
    const int x_slots = any_q8 ? (grouped ? 2 : 1) : 0;  // x groups a block quantises (at most two)
    smem = static_cast<size_t>(x_slots) * static_cast<size_t>(cols + cols / 8);
    if (norm_w) {  // the normed prologue reads one x group
        if (grouped) return false;
        t.norm_w = norm_w;
        t.norm_eps = norm_eps;
        t.xf_off = static_cast<uint32_t>(smem);
        if (any_f16) smem += static_cast<size_t>(cols) * sizeof(float);
    }
    // 16-warp blocks (2 per SM) when every segment is large: half the blocks read and quantise x
    // (the prologue after the PDL wait: x from L2 by every block, ~2-4 us at 8 warps for 8192 columns);
    // tables with small segments keep 8-warp blocks, whose finer grain balances them.
    int64_t min_rows = segs[0].w.rows;
    for (int i = 1; i < n; ++i) min_rows = std::min(min_rows, segs[i].w.rows);
    t.warps = !narrow && min_rows >= kQ8xWideMinRows ? kQ8xWarpsWide : kQ8xWarps;
    const double resident = static_cast<double>(q8x_blocks_per_sm(smem, t.warps)) * sm_count();
    blocks = 0;
    for (int i = 0; i < n; ++i) {
        const gemv_weight &w = segs[i].w;
        const double share =
            static_cast<double>(row_bytes_of(w.type, cols)) * static_cast<double>(w.rows) / total_bytes;
        // about one resident wave in all, split by bytes; a block's warps (8 or 16) share its rows, several
        // warps per row when the rows are fewer than the warps (and each warp keeps >= 1 tile per row)
        const int64_t chunks = w.type == dtype::q8_0 ? cols / 16 : cols / 8;
        int64_t nb = std::min<int64_t>(w.rows, std::max<int64_t>(1, std::llround(resident * share)));
        int64_t rpb = (w.rows + nb - 1) / nb;
        int W = 1;
        while (W < t.warps && W * rpb < t.warps && 2 * W * 32 <= chunks) W *= 2;
        if (rpb * W > kQ8xMaxParts) rpb = kQ8xMaxParts / W;
        if (rpb > rpg[i] && rpg[i] < w.rows)  // would read three or more x groups: finer blocks, or the other kernel
            return t.warps == kQ8xWarpsWide && plan_q8x(segs, rpg, n, t, smem, blocks, norm_w, norm_eps, true);
        nb = (w.rows + rpb - 1) / rpb;
        q8x_seg &d = t.s[i];
        set_weight(d, segs[i], rpg[i]);
        d.rows_per_block = rpb;
        d.f16 = w.type == dtype::f16;
        d.chunks = static_cast<int32_t>(chunks);
        d.warps_per_row = W;
        d.block_begin = static_cast<uint32_t>(blocks);
        blocks += nb;
    }
    return true;
}

// The single-x kernel instance a planned table launches (its warps, with or without the norm prologue).
using q8x_kernel_t = void (*)(const q8x_table, const float *);
q8x_kernel_t q8x_kernel_of(const q8x_table &t) {
    if (t.warps == kQ8xWarpsWide)
        return t.norm_w ? gemv_q8x_kernel<kQ8xWarpsWide, kQ8xU, true> : gemv_q8x_kernel<kQ8xWarpsWide, kQ8xU, false>;
    return t.norm_w ? gemv_q8x_kernel<kQ8xWarps, kQ8xU, true> : gemv_q8x_kernel<kQ8xWarps, kQ8xU, false>;
}

bool launch_q8x(const gemv_segment *segs, const int64_t *rpg, int n, const float *x, const char *what,
                cudaStream_t s, const float *norm_w, float norm_eps, const float *glu_up, int glu_act) {
    q8x_table t;
    size_t smem = 0;
    int64_t blocks = 0;
    if (!plan_q8x(segs, rpg, n, t, smem, blocks, norm_w, norm_eps)) return false;
    t.glu_up = glu_up;
    t.glu_act = glu_act;
    if (blocks > 0x7fffffff) throw error(std::string("cuda ds4 ") + what + ": too many rows");
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (g_trace && cudaStreamIsCapturing(s, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive &&
        g_trace_used + static_cast<size_t>(blocks) <= g_trace_cap) {
        t.trace = g_trace + 6 * g_trace_used;
        g_trace_used += static_cast<size_t>(blocks);
        g_trace_launches.push_back(static_cast<int>(blocks));
    }
    const cudaError_t e =
        launch_pdl(q8x_kernel_of(t), dim3(static_cast<unsigned>(blocks)), dim3(32 * t.warps), smem, s, true, t, x);
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
    return true;
}

// The columns form of launch_q8x (gemv_q8x_cols_kernel): the single-x plan, shared memory laid out for nx
// columns (split into several launches when it would not fit). False when the q8x kernel does not take
// the table (the caller launches column by column).
constexpr size_t kQ8xColsMaxSmem = 200 * 1024;
constexpr size_t kQ8xMmaMaxSmem = 200 * 1024;

// The columns kernels' shared-memory limit raised to kQ8xColsMaxSmem, once per device (outside any graph
// capture: gemv_rows_prepare, called at upload; the launches call it too, a no-op after the first time).
void prepare_cols_kernels() {
    static std::mutex mu;
    static std::vector<int> done;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) throw error("cuda ds4 gemv: no current device");
    std::lock_guard<std::mutex> lk(mu);
    if (std::find(done.begin(), done.end(), dev) != done.end()) return;
    const int lim = static_cast<int>(kQ8xColsMaxSmem);
    cudaError_t e = cudaSuccess;
    auto set = [&](auto kernel) {
        if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lim);
    };
    set(gemv_q8x_cols_kernel<kQ8xWarpsWide, kQ8xU, true, 4>);
    set(gemv_q8x_cols_kernel<kQ8xWarpsWide, kQ8xU, false, 4>);
    set(gemv_q8x_cols_kernel<kQ8xWarps, kQ8xU, true, 4>);
    set(gemv_q8x_cols_kernel<kQ8xWarps, kQ8xU, false, 4>);
    set(gemv_q8x_cols_kernel<kQ8xWarpsWide, kQ8xU, true, 16>);
    set(gemv_q8x_cols_kernel<kQ8xWarpsWide, kQ8xU, false, 16>);
    set(gemv_q8x_cols_kernel<kQ8xWarps, kQ8xU, true, 16>);
    set(gemv_q8x_cols_kernel<kQ8xWarps, kQ8xU, false, 16>);
    const int lim_mma = static_cast<int>(kQ8xMmaMaxSmem);
    auto set_mma = [&](auto kernel) {
        if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lim_mma);
    };
    set_mma(gemv_q8x_mma_kernel<1, false>);
    set_mma(gemv_q8x_mma_kernel<1, true>);
    set_mma(gemv_q8x_mma_kernel<2, false>);
    set_mma(gemv_q8x_mma_kernel<2, true>);
    if (e != cudaSuccess) throw error(std::string("cuda ds4 gemv: cannot raise the shared memory limit: ") + cudaGetErrorString(e));
    done.push_back(dev);
}

template <int NC>
void launch_q8x_cols_nc(const q8x_table &t, const q8x_cols &cx, size_t smem, int64_t blocks, const float *x,
                        const char *what, cudaStream_t s) {
    void (*kernel)(const q8x_table, const q8x_cols, const float *) =
        t.warps == kQ8xWarpsWide
            ? (t.norm_w ? gemv_q8x_cols_kernel<kQ8xWarpsWide, kQ8xU, true, NC>
                        : gemv_q8x_cols_kernel<kQ8xWarpsWide, kQ8xU, false, NC>)
            : (t.norm_w ? gemv_q8x_cols_kernel<kQ8xWarps, kQ8xU, true, NC> : gemv_q8x_cols_kernel<kQ8xWarps, kQ8xU, false, NC>);
    if (smem > 48 * 1024) prepare_cols_kernels();
    const cudaError_t e =
        launch_pdl(kernel, dim3(static_cast<unsigned>(blocks)), dim3(32 * t.warps), smem, s, true, t, cx, x);
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

// The dp4a columns kernel over a planned table t (blocks: its grid); false when not even two columns fit.
bool launch_cols_table(const q8x_table &t, int64_t blocks, size_t smem1, bool grouped, int nx, const float *x,
                       int64_t x_stride, const char *what, cudaStream_t s) {
    const int64_t cols = t.cols;
    bool any_q8 = false, any_f16 = false;
    int64_t max_parts = 0;
    for (int i = 0; i < t.n; ++i) {
        any_q8 = any_q8 || !t.s[i].f16;
        any_f16 = any_f16 || t.s[i].f16;
        if (t.s[i].warps_per_row > 1) max_parts = std::max(max_parts, t.s[i].rows_per_block * t.s[i].warps_per_row);
    }
    const size_t col_bytes = static_cast<size_t>(any_q8 ? (grouped ? 2 : 1) : 0) * static_cast<size_t>(cols + cols / 8);
    const size_t per_col = col_bytes + (t.norm_w && any_f16 ? static_cast<size_t>(cols) * 4 : 0) +
                           static_cast<size_t>(max_parts) * 4;
    if (per_col * 2 > kQ8xColsMaxSmem) return false;  // not even two columns fit: column by column
    // per_col is 0 for f16-only tables without a norm or split rows (their x stays f32, read in place)
    const int fit = per_col == 0 ? 16 : static_cast<int>(std::min<size_t>(16, kQ8xColsMaxSmem / per_col));
    for (int c0 = 0; c0 < nx; c0 += fit) {
        const int m = std::min(fit, nx - c0);
        q8x_table tc = t;  // the plan's, outputs moved to column c0
        for (int i = 0; i < t.n; ++i) tc.s[i].y += static_cast<int64_t>(c0) * t.s[i].y_stride;
        const float *xc = x + static_cast<int64_t>(c0) * x_stride;
        if (m == 1) {  // the single-x kernel itself, as launch_q8x
            const cudaError_t e =
                launch_pdl(q8x_kernel_of(t), dim3(static_cast<unsigned>(blocks)), dim3(32 * t.warps), smem1, s, true, tc, xc);
            if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
            continue;
        }
        q8x_cols cx;
        cx.nx = m;
        cx.x_stride = x_stride;
        cx.col_bytes = static_cast<uint32_t>(col_bytes);
        size_t off = static_cast<size_t>(m) * col_bytes;
        if (t.norm_w && any_f16) {
            tc.xf_off = static_cast<uint32_t>(off);
            off += static_cast<size_t>(m) * static_cast<size_t>(cols) * 4;
        }
        cx.part_off = static_cast<uint32_t>(off);
        off += static_cast<size_t>(m) * static_cast<size_t>(max_parts) * 4;
        if (m <= 4)
            launch_q8x_cols_nc<4>(tc, cx, off, blocks, xc, what, s);
        else
            launch_q8x_cols_nc<16>(tc, cx, off, blocks, xc, what, s);
    }
    return true;
}

// Shared bytes of the tensor-core kernel for NT 8-column tiles at cols with `slots` tree buffers.
size_t mma_smem(int nt, int64_t cols, int slots = 1) {
    const size_t c = static_cast<size_t>(8 * nt);
    return c * static_cast<size_t>(cols + 16) + c * static_cast<size_t>(cols / 32 + 1) * 4 +
           static_cast<size_t>(slots) * kMmaRedBytes;
}

// The tensor-core kernel over the q8_0 segments of the planned table t (each segment's plan, W included, is
// the single-x launch's: the same bits). False (nothing launched) when it does not take them: no q8_0
// segment, fewer than 2 x, tensor cores switched off, a grouped segment whose groups are not whole 16-row tiles.
bool launch_q8x_mma(const q8x_table &t, const int64_t *rpg, int nx, const float *x, int64_t x_stride, const char *what,
                    cudaStream_t s) {
    if (nx < 2 || !g_q8x_mma) return false;
    q8x_mma_args m = {};
    int64_t tiles = 0;
    for (int i = 0; i < t.n; ++i) {
        if (t.s[i].f16) continue;
        if (rpg[i] < t.s[i].rows && rpg[i] % 32 != 0) return false;
        m.segs[m.n] = i;
        m.tiles_begin[m.n] = static_cast<int32_t>(tiles);
        tiles += (t.s[i].rows + 31) / 32;  // 32-row units
        ++m.n;
    }
    if (m.n == 0 || tiles > 0x7fffffff) return false;
    m.tiles_begin[m.n] = static_cast<int32_t>(tiles);
    m.x_stride = x_stride;
    const int64_t cols = t.cols;
    const int per = mma_smem(2, cols) <= kQ8xMmaMaxSmem ? 16 : 8;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, sm_count()));
    prepare_cols_kernels();
    for (int c0 = 0; c0 < nx; c0 += per) {
        const int cnt = std::min(per, nx - c0);
        const int nt = cnt > 8 ? 2 : 1;
        q8x_table tc = t;
        for (int i = 0; i < t.n; ++i) tc.s[i].y += static_cast<int64_t>(c0) * t.s[i].y_stride;
        m.nx = cnt;
        m.xq_stride = static_cast<uint32_t>(cols + 16);
        m.dx_off = static_cast<uint32_t>(static_cast<size_t>(8 * nt) * static_cast<size_t>(cols + 16));
        m.red_off = static_cast<uint32_t>(m.dx_off + static_cast<size_t>(8 * nt) * static_cast<size_t>(cols / 32 + 1) * 4);
        m.slots = g_mma_slots;  // as many tree buffers as fit beside x (kQ8xMmaMaxSmem)
        while (m.slots > 1 && mma_smem(nt, cols, m.slots) > kQ8xMmaMaxSmem) --m.slots;
        const size_t smem = mma_smem(nt, cols, m.slots);
        void (*kernel)(const q8x_table, const q8x_mma_args, const float *) =
            nt == 2 ? (t.norm_w ? gemv_q8x_mma_kernel<2, true> : gemv_q8x_mma_kernel<2, false>)
                    : (t.norm_w ? gemv_q8x_mma_kernel<1, true> : gemv_q8x_mma_kernel<1, false>);
        const cudaError_t e = launch_pdl(kernel, dim3(grid), dim3(32 * kMmaWarps), smem, s, true, tc, m,
                                         x + static_cast<int64_t>(c0) * x_stride);
        if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
    }
    return true;
}

bool launch_q8x_cols(const gemv_segment *segs, const int64_t *rpg, int n, int nx, const float *x, int64_t x_stride,
                     const char *what, cudaStream_t s, const float *norm_w = nullptr, float norm_eps = 0.0f) {
    q8x_table t;
    size_t smem1 = 0;
    int64_t blocks = 0;
    if (!plan_q8x(segs, rpg, n, t, smem1, blocks, norm_w, norm_eps)) return false;
    if (blocks > 0x7fffffff) throw error(std::string("cuda ds4 ") + what + ": too many rows");
    bool grouped = false, any_f16 = false;
    for (int i = 0; i < n; ++i) {
        grouped = grouped || rpg[i] < segs[i].w.rows;
        any_f16 = any_f16 || t.s[i].f16;
        t.s[i].y_stride = t.s[i].rows;
    }
    if (!launch_q8x_mma(t, rpg, nx, x, x_stride, what, s))
        return launch_cols_table(t, blocks, smem1, grouped, nx, x, x_stride, what, s);
    if (!any_f16) return true;
    // The f16 segments with their own plan entries (their W and rows per block: the same bits), blocks
    // renumbered; x stays f32 (normed: x' staged per column as before).
    q8x_table tf = t;
    tf.n = 0;
    int64_t fb = 0;
    for (int i = 0; i < n; ++i) {
        if (!t.s[i].f16) continue;
        q8x_seg sg = t.s[i];
        sg.block_begin = static_cast<uint32_t>(fb);
        fb += (sg.rows + sg.rows_per_block - 1) / sg.rows_per_block;
        tf.s[tf.n++] = sg;
    }
    tf.xf_off = 0;  // no int8 x slots in front of the normed f16 x
    // f16-only tables always fit two columns (no int8 slots: at most cols floats and the parts per column)
    if (!launch_cols_table(tf, fb, smem1, false, nx, x, x_stride, what, s))
        throw error(std::string("cuda ds4 ") + what + ": f16 segments do not fit the columns kernel");
    return true;
}

void check_columns(int nx, const float *x, int64_t x_stride, int64_t cols, const char *what) {
    if (nx < 1 || nx > gemv_max_rows) throw error(std::string("cuda ds4 ") + what + ": 1.." + std::to_string(gemv_max_rows) + " rows of x");
    if (x_stride < cols || x_stride % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)
        throw error(std::string("cuda ds4 ") + what + ": x rows must be >= cols floats apart, 16-byte aligned");
}

}  // namespace

void gemv_rows_prepare() {
    prepare_cols_kernels();
}

void launch_gemv_multi_rows(const gemv_segment *segs, int n_segs, int nx, const float *x, int64_t x_stride,
                            cudaStream_t s) {
    if (n_segs < 1 || n_segs > gemv_max_segments) throw error("cuda ds4 multi gemv rows: 1..8 segments");
    check_segments(segs, n_segs, x, "multi gemv rows");
    check_columns(nx, x, x_stride, segs[0].w.cols, "multi gemv rows");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) rpg[i] = segs[i].w.rows;
    if (nx > 1 && launch_q8x_cols(segs, rpg, n_segs, nx, x, x_stride, "multi gemv rows", s)) return;
    for (int c = 0; c < nx; ++c) {  // column by column: the single-x launches
        gemv_segment sc[gemv_max_segments];
        for (int i = 0; i < n_segs; ++i) sc[i] = {segs[i].w, segs[i].y + static_cast<int64_t>(c) * segs[i].w.rows, segs[i].accumulate};
        launch_segments(sc, rpg, n_segs, x + static_cast<int64_t>(c) * x_stride, "multi gemv rows", s);
    }
}

void launch_gemv_rows(const gemv_weight &w, int nx, const float *x, int64_t x_stride, float *y, cudaStream_t s) {
    const gemv_segment seg{w, y};
    launch_gemv_multi_rows(&seg, 1, nx, x, x_stride, s);
}

void launch_gemv_grouped_rows(const gemv_weight &w, int64_t rows_per_group, int nx, const float *x, int64_t x_stride,
                              float *y, cudaStream_t s) {
    if (rows_per_group < 1) throw error("cuda ds4 grouped gemv rows: rows_per_group must be >= 1");
    const gemv_segment seg{w, y};
    check_segments(&seg, 1, x, "grouped gemv rows");
    const int64_t groups = (w.rows + rows_per_group - 1) / rows_per_group;
    check_columns(nx, x, x_stride, groups * w.cols, "grouped gemv rows");
    if (nx > 1 && launch_q8x_cols(&seg, &rows_per_group, 1, nx, x, x_stride, "grouped gemv rows", s)) return;
    for (int c = 0; c < nx; ++c) {
        const gemv_segment sc{w, y + static_cast<int64_t>(c) * w.rows};
        launch_segments(&sc, &rows_per_group, 1, x + static_cast<int64_t>(c) * x_stride, "grouped gemv rows", s);
    }
}

void launch_gemv_multi_normed_rows(const gemv_segment *segs, int n_segs, int nx, float *x, int64_t x_stride,
                                   const float *norm_w, float eps, cudaStream_t s) {
    if (!norm_w) throw error("cuda ds4 normed gemv rows: null norm weight");
    if (n_segs < 1 || n_segs > gemv_max_segments) throw error("cuda ds4 normed gemv rows: 1..8 segments");
    check_segments(segs, n_segs, x, "normed gemv rows");
    check_columns(nx, x, x_stride, segs[0].w.cols, "normed gemv rows");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) rpg[i] = segs[i].w.rows;
    if (nx > 1 && launch_q8x_cols(segs, rpg, n_segs, nx, x, x_stride, "normed gemv rows", s, norm_w, eps)) return;
    for (int c = 0; c < nx; ++c) {
        gemv_segment sc[gemv_max_segments];
        for (int i = 0; i < n_segs; ++i) sc[i] = {segs[i].w, segs[i].y + static_cast<int64_t>(c) * segs[i].w.rows, segs[i].accumulate};
        launch_gemv_multi_normed(sc, n_segs, x + static_cast<int64_t>(c) * x_stride, norm_w, eps, s);
    }
}

void set_gemv_q8_activations(bool on) {
    g_q8x = on;
}

void set_gemv_mma_slots(int slots) {
    if (slots < 1 || slots > kMmaSlots)
        throw error("cuda ds4 gemv: tensor-core meeting slots must be 1.." + std::to_string(kMmaSlots) + ", not " +
                    std::to_string(slots));
    g_mma_slots = slots;
}
void set_gemv_tensor_cores(bool on) {
    g_q8x_mma = on;
}

void set_gemv_trace(uint64_t *buf, size_t max_blocks) {
    g_trace = buf;
    g_trace_cap = buf ? max_blocks : 0;
    g_trace_used = 0;
    g_trace_launches.clear();
}

std::vector<int> gemv_trace_launches() {
    return g_trace_launches;
}

namespace {
template <int U, bool Contig>
__global__ void read_probe_kernel(const uint4 *src, size_t n16, uint32_t *sink) {
    pdl_launch_dependents();
    pdl_wait();
    uint32_t acc = 0;
    size_t i, step, end;
    if constexpr (Contig) {  // block b: [b n16 / B, (b + 1) n16 / B)
        const size_t per = (n16 + gridDim.x - 1) / gridDim.x;
        i = blockIdx.x * per + threadIdx.x;
        end = min(n16, (blockIdx.x + 1) * per);
        step = blockDim.x;
    } else {
        i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
        end = n16;
        step = static_cast<size_t>(gridDim.x) * blockDim.x;
    }
    for (; i < end; i += U * step) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * step < end)
                v[u] = ld_stream16(reinterpret_cast<const uint8_t *>(src + i + u * step));
            else
                v[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // practically never: keeps the loads
}
template <int U>
void read_probe_u(const void *src, size_t bytes, int blocks, int threads, bool contiguous, bool pdl,
                  uint32_t *sink, cudaStream_t s) {
    const uint4 *p = static_cast<const uint4 *>(src);
    const size_t n16 = bytes / 16;
    const cudaError_t e =
        contiguous
            ? launch_pdl(read_probe_kernel<U, true>, dim3(blocks), dim3(threads), 0, s, pdl, p, n16, sink)
            : launch_pdl(read_probe_kernel<U, false>, dim3(blocks), dim3(threads), 0, s, pdl, p, n16, sink);
    if (e != cudaSuccess)
        throw error(std::string("cuda ds4 read probe: launch failed: ") + cudaGetErrorString(e));
}
}  // namespace

void launch_read_probe(const void *src, size_t bytes, int blocks, int threads, int unroll, bool contiguous,
                       bool pdl, uint32_t *sink, cudaStream_t s) {
    if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 || !sink || blocks < 1 || threads < 32 ||
        threads > 1024)
        throw error("cuda ds4 read probe: src 16-byte aligned, bytes % 16, a sink, blocks >= 1, threads in [32, 1024]");
    switch (unroll) {
        case 1:
            read_probe_u<1>(src, bytes, blocks, threads, contiguous, pdl, sink, s);
            break;
        case 2:
            read_probe_u<2>(src, bytes, blocks, threads, contiguous, pdl, sink, s);
            break;
        case 4:
            read_probe_u<4>(src, bytes, blocks, threads, contiguous, pdl, sink, s);
            break;
        case 8:
            read_probe_u<8>(src, bytes, blocks, threads, contiguous, pdl, sink, s);
            break;
        default:
            throw error("cuda ds4 read probe: unroll 1, 2, 4 or 8");
    }
}

bool gemv_q8_activations_used(const gemv_segment *segs, const int64_t *rows_per_group, int n_segs) {
    if (n_segs < 1 || n_segs > gemv_max_segments) return false;
    q8x_table t;
    size_t smem = 0;
    int64_t blocks = 0;
    return plan_q8x(segs, rows_per_group, n_segs, t, smem, blocks);
}

bool gemv_fast_supported(dtype t, int64_t cols) {
    if (cols < 4 || cols > (int64_t{1} << 28)) return false;
    switch (t) {
        case dtype::q8_0:
            return cols % kTile == 0;
        case dtype::f16:
        case dtype::f32:
            return cols % 4 == 0;
        default:
            return false;
    }
}

size_t gemv_prepared_bytes(dtype t, int64_t rows, int64_t cols) {
    if (!gemv_fast_supported(t, cols) || rows < 0)
        throw error("cuda ds4 gemv: unsupported weight " + std::string(dtype_name(t)));
    return t == dtype::q8_0 ? static_cast<size_t>(rows) * static_cast<size_t>(cols) * 17 / 16 : 0;
}

gemv_weight gemv_prepare(dtype t, const void *src, size_t src_stride, int64_t rows, int64_t cols, void *dst,
                         cudaStream_t s) {
    if (!gemv_fast_supported(t, cols) || rows < 1 || !src)
        throw error("cuda ds4 gemv prepare: unsupported weight (" + std::string(dtype_name(t)) + ", " +
                    std::to_string(rows) + " x " + std::to_string(cols) + ")");
    gemv_weight w;
    w.type = t;
    w.rows = rows;
    w.cols = cols;
    if (t != dtype::q8_0) {
        w.q = src;
        w.q_stride = src_stride;
        check_weight(w, "gemv prepare");
        return w;
    }
    if (src_stride < static_cast<size_t>(cols / 32 * 34) || src_stride % 2 != 0 ||
        reinterpret_cast<uintptr_t>(src) % 2 != 0)
        throw error("cuda ds4 gemv prepare: q8_0 source rows must be 2-byte aligned and whole");
    if (!dst || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
        throw error("cuda ds4 gemv prepare: dst must be 16-byte aligned");
    auto *q = static_cast<uint8_t *>(dst);
    uint8_t *sc =
        q + static_cast<size_t>(rows) * static_cast<size_t>(cols);  // 16-byte aligned: cols % 512 == 0
    const int64_t threads = rows * (cols / 16);
    const int64_t grid = (threads + 255) / 256;
    if (grid > 0x7fffffff) throw error("cuda ds4 gemv prepare: weight too large");
    repack_q8_kernel<<<static_cast<unsigned>(grid), 256, 0, s>>>(static_cast<const uint8_t *>(src),
                                                                 src_stride, rows, cols, q, sc);
    check_launch("gemv prepare");
    w.q = q;
    w.scales = sc;
    w.q_stride = static_cast<size_t>(cols);
    w.s_stride = static_cast<size_t>(cols / 16);
    return w;
}

void launch_gemv_fast(const gemv_weight &w, const float *x, float *y, cudaStream_t s) {
    const gemv_segment seg{w, y};
    const int64_t rpg = w.rows;
    launch_segments(&seg, &rpg, 1, x, "gemv", s);
}

void launch_gemv_fast_grouped(const gemv_weight &w, int64_t rows_per_group, const float *x, float *y,
                              cudaStream_t s) {
    if (rows_per_group < 1) throw error("cuda ds4 grouped gemv: rows_per_group must be >= 1");
    const gemv_segment seg{w, y};
    launch_segments(&seg, &rows_per_group, 1, x, "grouped gemv", s);
}

void launch_gemv_multi_normed(const gemv_segment *segs, int n_segs, float *x, const float *norm_w, float eps,
                              cudaStream_t s) {
    if (!norm_w) throw error("cuda ds4 normed gemv: null norm weight");
    check_segments(segs, n_segs, x, "normed gemv");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) rpg[i] = segs[i].w.rows;
    if (launch_q8x(segs, rpg, n_segs, x, "normed gemv", s, norm_w, eps)) return;
    // otherwise: the separate norm in place, then the plain launch
    cuda::launch_rms_norm(x, segs[0].w.cols, norm_w, eps, segs[0].w.cols, 1, x, segs[0].w.cols, s);
    launch_gemv_multi(segs, n_segs, x, s);
}

bool launch_gemv_glu(const gemv_segment *segs, int n_segs, const float *gate, const float *up, int act,
                     cudaStream_t s) {
    if (n_segs < 1 || n_segs > gemv_max_segments) throw error("cuda ds4 glu gemv: 1..8 segments");
    if (!up || reinterpret_cast<uintptr_t>(up) % 16 != 0) return false;
    check_segments(segs, n_segs, gate, "glu gemv");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) {
        if (segs[i].w.type != dtype::q8_0) return false;  // f16 rows would read the gate itself
        rpg[i] = segs[i].w.rows;
    }
    return launch_q8x(segs, rpg, n_segs, gate, "glu gemv", s, nullptr, 0.0f, up, act);
}

bool gemv_multi_normed_folds(const gemv_segment *segs, int n_segs, const float *x, const float *norm_w) {
    if (!norm_w) return false;
    check_segments(segs, n_segs, x, "normed gemv");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) rpg[i] = segs[i].w.rows;
    q8x_table t;
    size_t smem = 0;
    int64_t blocks = 0;
    return plan_q8x(segs, rpg, n_segs, t, smem, blocks, norm_w, 1e-6f);
}

void launch_gemv_multi(const gemv_segment *segs, int n_segs, const float *x, cudaStream_t s) {
    if (n_segs < 1 || n_segs > gemv_max_segments) throw error("cuda ds4 multi gemv: 1..8 segments");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) rpg[i] = segs[i].w.rows;
    launch_segments(segs, rpg, n_segs, x, "multi gemv", s);
}

}  // namespace fathom::cuda::ds4
