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

#include "backend/cuda/cuda_pdl.cuh"
#include "backend/cuda/ds4_gemv.h"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

constexpr int kMaxGroup = 512;   // threads per row at most (and the block size limit)
constexpr int kMinBlock = 256;   // threads per block at least
constexpr int kTile = 512;       // q8_0 repack tile (elements)

enum seg_kind : int32_t { kind_q8 = 0, kind_f16 = 1, kind_f32 = 2 };

struct seg_dev {
    const uint8_t *q;
    const uint8_t *scales;
    float *y;
    size_t q_stride, s_stride;
    int64_t rows, rows_per_group;
    int32_t kind;
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
    asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// Partial dot product of one row for thread gl of its group (chunks gl, gl + G, ...). The first
// batch's weight loads are issued before pdl_wait(): only they may overlap the previous kernel.
template <int U>
__device__ __forceinline__ float row_q8(const seg_dev &sg, int64_t r, const float *x, int gl) {
    const uint8_t *q = sg.q + static_cast<size_t>(r) * sg.q_stride;
    const uint8_t *sc = sg.scales + static_cast<size_t>(r) * sg.s_stride;
    const int G = sg.group, chunks = sg.chunks;
    const int lane = gl & 31;  // = chunk & 31 for every chunk of this thread (G % 32 == 0)
    float acc = 0.0f;
    for (int c0 = gl; c0 < chunks; c0 += G * U) {
        uint4 v[U];
        uint2 d[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) {
                v[u] = ld_stream16(q + 16 * static_cast<size_t>(c));
                d[u] = __ldg(reinterpret_cast<const uint2 *>(sc + 32 * (c >> 5) + 8 * (lane >> 3)));
            }
        }
        if (c0 == gl) pdl_wait();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * G;
            if (c < chunks) {
                const float *xb = x + kTile * (c >> 5) + 4 * lane;
                const uint32_t w[4] = {v[u].x ^ 0x80808080u, v[u].y ^ 0x80808080u, v[u].z ^ 0x80808080u,
                                       v[u].w ^ 0x80808080u};
                const float2 d01 = __half22float2(*reinterpret_cast<const __half2 *>(&d[u].x));
                const float2 d23 = __half22float2(*reinterpret_cast<const __half2 *>(&d[u].y));
                acc = fmaf(dot4_i8(w[0], ldx4(xb)), d01.x, acc);
                acc = fmaf(dot4_i8(w[1], ldx4(xb + 128)), d01.y, acc);
                acc = fmaf(dot4_i8(w[2], ldx4(xb + 256)), d23.x, acc);
                acc = fmaf(dot4_i8(w[3], ldx4(xb + 384)), d23.y, acc);
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
__global__ void __launch_bounds__(kMaxGroup, 2) gemv_seg_kernel(const __grid_constant__ seg_table t,
                                                             const float *x) {
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
        if (gl == 0 && r < sg.rows) sg.y[r] = acc;
        return;  // uniform over the block: G is per segment and a block lies in one segment
    }
    const int warp = static_cast<int>(threadIdx.x) >> 5, wpg = G >> 5;
    if ((threadIdx.x & 31) == 0) part[warp] = acc;
    __syncthreads();
    if (gl == 0 && r < sg.rows) {
        float s = part[warp];
        for (int i = 1; i < wpg; ++i) s += part[warp + i];
        sg.y[r] = s;
    }
}

// Repack of q8_0 GGUF rows (34-byte blocks: f16 d, int8 qs[32]) into the tiled layout. One thread
// per 16-byte output chunk (row r, tile t, lane l); lanes l < 16 also write scale position l.
__global__ void repack_q8_kernel(const uint8_t *__restrict__ src, size_t src_stride, int64_t rows, int64_t cols,
                                 uint8_t *__restrict__ q, uint8_t *__restrict__ sc) {
    const int64_t tiles = cols / kTile;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= rows * tiles * 32) return;
    const int l = static_cast<int>(idx & 31);
    const int64_t t = (idx >> 5) % tiles, r = (idx >> 5) / tiles;
    const uint8_t *row = src + static_cast<size_t>(r) * src_stride + 34 * 16 * t;  // tile t's 16 blocks
    uint32_t w[4];
    for (int k = 0; k < 4; ++k) {
        const int b = 4 * k + (l >> 3), e = 4 * (l & 7);  // element 128k + 4l = block b, offset e
        w[k] = 0;
        for (int j = 0; j < 4; ++j) w[k] |= static_cast<uint32_t>(row[34 * b + 2 + e + j]) << (8 * j);
    }
    *reinterpret_cast<uint4 *>(q + static_cast<size_t>(r) * cols + kTile * t + 16 * l) =
        make_uint4(w[0], w[1], w[2], w[3]);
    if (l < 16) {
        const int g = l >> 2, k = l & 3, b = 4 * k + g;  // position 4g + k holds block 4k + g
        uint8_t *o = sc + static_cast<size_t>(r) * (cols / 16) + 32 * t + 2 * l;
        o[0] = row[34 * b];
        o[1] = row[34 * b + 1];
    }
}

// ---- host ---------------------------------------------------------------------------------------------

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}

int sm_count() {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        n < 1)
        throw error("cuda ds4 gemv: cannot query the multiprocessor count");
    return n;
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
        throw error(std::string("cuda ds4 ") + what + ": unsupported weight (" + std::string(dtype_name(w.type)) + ", " +
                    std::to_string(w.rows) + " x " + std::to_string(w.cols) + ")");
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

// Fills the segment table (group sizes, block ranges) and launches. rpg[i] = rows per x group.
void launch_segments(const gemv_segment *segs, const int64_t *rpg, int n, const float *x, const char *what,
                     cudaStream_t s) {
    if (n < 1 || n > gemv_max_segments) throw error(std::string("cuda ds4 ") + what + ": 1..8 segments");
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw error(std::string("cuda ds4 ") + what + ": x must be 16-byte aligned");
    seg_table t = {};
    t.n = n;
    t.cols = segs[0].w.cols;
    double total_bytes = 0;
    for (int i = 0; i < n; ++i) {
        check_weight(segs[i].w, what);
        if (segs[i].w.cols != t.cols) throw error(std::string("cuda ds4 ") + what + ": segments differ in cols");
        if (!segs[i].y) throw error(std::string("cuda ds4 ") + what + ": null output");
        total_bytes += static_cast<double>(row_bytes_of(segs[i].w.type, t.cols)) * static_cast<double>(segs[i].w.rows);
    }
    // One device-full of resident threads (about 1024 per SM at the register use here), shared
    // between segments in proportion to their bytes.
    const double device_threads = 1024.0 * sm_count();
    int max_group = 32;
    int64_t max_loads = 1;
    for (int i = 0; i < n; ++i) {
        const gemv_weight &w = segs[i].w;
        const int64_t chunks = chunks_of(w.type, t.cols);
        const double share = static_cast<double>(row_bytes_of(w.type, t.cols)) * static_cast<double>(w.rows) / total_bytes;
        const int g = pick_group(chunks, w.rows, max_loads_of(w.type), device_threads * share);
        max_group = std::max(max_group, g);
        max_loads = std::max<int64_t>(max_loads, (chunks + g - 1) / g);
        seg_dev &d = t.s[i];
        d.q = static_cast<const uint8_t *>(w.q);
        d.scales = static_cast<const uint8_t *>(w.scales);
        d.y = segs[i].y;
        d.q_stride = w.q_stride;
        d.s_stride = w.s_stride;
        d.rows = w.rows;
        d.rows_per_group = rpg[i];
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

}  // namespace

bool gemv_fast_supported(dtype t, int64_t cols) {
    if (cols < 4 || cols > (int64_t{1} << 28)) return false;
    switch (t) {
    case dtype::q8_0: return cols % kTile == 0;
    case dtype::f16:
    case dtype::f32: return cols % 4 == 0;
    default: return false;
    }
}

size_t gemv_prepared_bytes(dtype t, int64_t rows, int64_t cols) {
    if (!gemv_fast_supported(t, cols) || rows < 0) throw error("cuda ds4 gemv: unsupported weight " + std::string(dtype_name(t)));
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
    if (src_stride < static_cast<size_t>(cols / 32 * 34) || src_stride % 2 != 0 || reinterpret_cast<uintptr_t>(src) % 2 != 0)
        throw error("cuda ds4 gemv prepare: q8_0 source rows must be 2-byte aligned and whole");
    if (!dst || reinterpret_cast<uintptr_t>(dst) % 16 != 0) throw error("cuda ds4 gemv prepare: dst must be 16-byte aligned");
    auto *q = static_cast<uint8_t *>(dst);
    uint8_t *sc = q + static_cast<size_t>(rows) * static_cast<size_t>(cols);  // 16-byte aligned: cols % 512 == 0
    const int64_t threads = rows * (cols / kTile) * 32;
    const int64_t grid = (threads + 255) / 256;
    if (grid > 0x7fffffff) throw error("cuda ds4 gemv prepare: weight too large");
    repack_q8_kernel<<<static_cast<unsigned>(grid), 256, 0, s>>>(static_cast<const uint8_t *>(src), src_stride, rows,
                                                                 cols, q, sc);
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

void launch_gemv_multi(const gemv_segment *segs, int n_segs, const float *x, cudaStream_t s) {
    if (n_segs < 1 || n_segs > gemv_max_segments) throw error("cuda ds4 multi gemv: 1..8 segments");
    int64_t rpg[gemv_max_segments];
    for (int i = 0; i < n_segs; ++i) rpg[i] = segs[i].w.rows;
    launch_segments(segs, rpg, n_segs, x, "multi gemv", s);
}

}  // namespace fathom::cuda::ds4
