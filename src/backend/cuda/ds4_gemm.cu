// DS4 prefill matrix products (gemm_runner, ds4_prefill.h): a weight in its stored form (GGUF rows
// of q8_0 / f16 / f32 / bf16 / iq2_xxs / q2_k / q3_k / q4_k / q5_k / q6_k / mxfp4, or the decode
// GEMV's repacked q8_0) times a
// chunk of n_tok activation rows, through cuBLAS.
//
// bf16 precision: the weight is dequantised in row tiles (at most max_w_elems elements) to bf16, the
// activations are rounded to bf16 once per call, and cublasGemmEx multiplies them with f32
// accumulation and f32 output. f32 precision (router logits): the weight tile is dequantised to f32
// (f32 weights are used in place) and cublasSgemm runs in CUBLAS_PEDANTIC_MATH (no TF32).
// Row-major y[n_tok, rows] = x[n_tok, cols] W[rows, cols]^T is, column-major, y^T = W^T(op T of
// the cols x rows matrix) * x^T (cols x n_tok): OP_T on W, OP_N on x, ldc = ldy.
//
// Dequantisation: one thread per 32-element unit of a row (ds4q::decode32, bit-identical to the CPU's
// dequantize_row; bf16 rows decoded here), its 4 runs of 8 consecutive elements written as 16-byte
// chunks (bf16: through shared memory so a warp's stores are contiguous, see dequant_rows_kernel) or
// 2 x 16-byte (f32) stores. Repacked q8_0 (ds4_gemv.h banner): one thread per 16-byte chunk of a
// 512-element tile, 4 runs of 4 elements each. Measured on an H200: 3.1 TB/s of bf16 written for
// iq2_xxs and q2_k experts; a q8_0 (repacked) [8192, 4096] product at 4096 tokens 0.42 ms (650 TFLOP/s).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "backend/cuda/ds4_quant.cuh"
#include "core/error.h"

namespace fathom::cuda::ds4 {
namespace {

constexpr int kThreads = 256;
constexpr size_t kCublasWorkspace = size_t{32} << 20;  // cuBLAS' recommendation for Hopper
constexpr int kRepackTile = 512;                       // repacked q8_0 tile (ds4_gemv.h)

// ---- device: unit decoding and stores ----------------------------------------------------------------

// Types whose unit's 4 runs are 32 elements apart (Q2_K's unit, shared by the K-quants) rather than
// one stretch of 32.
template <dtype T> constexpr bool strided_unit() {
    return T == dtype::q2_k || T == dtype::q3_k || T == dtype::q4_k || T == dtype::q5_k || T == dtype::q6_k;
}

// Unit u (32 elements) of a row: w[8 r + i] = element base + r * stride + i (r < 4, i < 8).
template <dtype T>
__device__ __forceinline__ void unit32(const uint8_t *row, int64_t u, float w[32], int64_t &base, int &stride,
                                       const uint64_t *grid) {
    if constexpr (T == dtype::bf16) {
        const uint16_t *p = reinterpret_cast<const uint16_t *>(row) + 32 * u;
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = bf16_bits(p[i]);
        base = 32 * u;
        stride = 8;
    } else {
        ds4q::decode32<T>(row, u, w, base, stride, grid);
    }
}

// 8 consecutive values to dst (16-byte aligned): bf16 round-to-nearest-even, or f32.
__device__ __forceinline__ void store8(__nv_bfloat16 *dst, const float *w) {
    __nv_bfloat162 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __floats2bfloat162_rn(w[2 * i], w[2 * i + 1]);
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(v);
}
__device__ __forceinline__ void store8(float *dst, const float *w) {
    reinterpret_cast<float4 *>(dst)[0] = make_float4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<float4 *>(dst)[1] = make_float4(w[4], w[5], w[6], w[7]);
}
// 4 consecutive values to dst (8-byte aligned bf16, 16-byte aligned f32).
__device__ __forceinline__ void store4(__nv_bfloat16 *dst, const float *w) {
    __nv_bfloat162 v[2] = {__floats2bfloat162_rn(w[0], w[1]), __floats2bfloat162_rn(w[2], w[3])};
    *reinterpret_cast<uint2 *>(dst) = *reinterpret_cast<const uint2 *>(v);
}
__device__ __forceinline__ void store4(float *dst, const float *w) {
    *reinterpret_cast<float4 *>(dst) = make_float4(w[0], w[1], w[2], w[3]);
}

// The rows a dequantisation launch covers: dst row i = (list entry j, source s, row r) with
// i = (j * n_src + s) * rows + r, read from src[s] + ids[j] * expert_bytes + r * row_bytes. A plain
// row range is one source, one list entry 0, src[0] = its first row.
struct dq_args {
    const uint8_t *src[2];
    size_t row_bytes, expert_bytes;
    int64_t rows, units;  // rows per (entry, source); 32-element units per row (cols / 32)
    int32_t n_src, n_list;
    int32_t ids[gemm_runner::max_dequant_experts];
    const uint64_t *grid;  // IQ2_XXS grid (device)
};

// One thread per (dst row, unit); dst rows are units * 32 elements apart (16-byte aligned: cols % 32).
// 32-bit index arithmetic (the host checks that a launch has fewer than 2^32 units). IQ2_XXS reads
// its grid from shared memory.
// bf16 output of the types whose unit is 32 consecutive elements (all but q2_k and the other K-quants,
// whose 4 runs are 32 apart, see ds4_quant.cuh): unit idx covers dst
// elements 32 idx .. 32 idx + 31, so a block's units fill one contiguous stretch. Each thread's four
// 16-byte chunks go to shared memory (chunk k of thread t at slot 4 t + (k ^ ((t >> 1) & 3)): the
// 8 threads of a quarter-warp hit 8 distinct 16-byte bank groups), then the block writes the stretch
// with consecutive threads on consecutive chunks. Storing each thread's 64 bytes directly left every
// warp store half a sector per lane (measured: 1.6 TB/s written for iq2_xxs vs 3.1 for q2_k, whose
// runs already interleave across lanes).
template <dtype T, class Out>
__global__ void __launch_bounds__(kThreads) dequant_rows_kernel(const dq_args a, Out *__restrict__ dst) {
    constexpr bool staged = std::is_same_v<Out, __nv_bfloat16> && !strided_unit<T>();
    __shared__ uint64_t sgrid[T == dtype::iq2_xxs ? 256 : 1];
    __shared__ uint4 stage[staged ? 4 * kThreads : 1];
    const uint64_t *grid = a.grid;
    if constexpr (T == dtype::iq2_xxs) {
        for (int k = threadIdx.x; k < 256; k += blockDim.x) sgrid[k] = a.grid[k];
        __syncthreads();
        grid = sgrid;
    }
    const uint32_t units = static_cast<uint32_t>(a.units), rows = static_cast<uint32_t>(a.rows);
    const uint32_t per_entry = static_cast<uint32_t>(a.n_src) * rows;
    const uint32_t total = static_cast<uint32_t>(a.n_list) * per_entry * units;
    const uint32_t idx = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = idx < total;  // no early return: the staged path has a block barrier below
    const uint32_t i = idx / units, u = idx - i * units;
    float w[32];
    int64_t base = 0;
    int stride = 8;
    if (live) {
        const uint32_t j = i / per_entry, q = i - j * per_entry;
        const uint32_t s = q / rows, r = q - s * rows;
        const uint8_t *row =
            a.src[s] + static_cast<size_t>(a.ids[j]) * a.expert_bytes + static_cast<size_t>(r) * a.row_bytes;
        unit32<T>(row, u, w, base, stride, grid);
    }
    if constexpr (!staged) {
        if (!live) return;
        Out *o = dst + static_cast<size_t>(i) * (a.units * 32);
#pragma unroll
        for (int k = 0; k < 4; ++k) store8(o + base + k * stride, w + 8 * k);
    } else {
        const uint32_t t = threadIdx.x;
        if (live) {
#pragma unroll
            for (uint32_t k = 0; k < 4; ++k) {
                __nv_bfloat162 v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) v[e] = __floats2bfloat162_rn(w[8 * k + 2 * e], w[8 * k + 2 * e + 1]);
                stage[4 * t + (k ^ ((t >> 1) & 3u))] = *reinterpret_cast<const uint4 *>(v);
            }
        }
        __syncthreads();
        const uint32_t first = blockIdx.x * blockDim.x;  // the block's first unit (< total)
        const uint32_t n_units = min(static_cast<uint32_t>(blockDim.x), total - first);
        uint4 *o = reinterpret_cast<uint4 *>(dst) + static_cast<size_t>(first) * 4;
        for (uint32_t c = t; c < 4 * n_units; c += blockDim.x) {
            const uint32_t un = c >> 2, part = c & 3u;
            o[c] = stage[4 * un + (part ^ ((un >> 1) & 3u))];
        }
    }
}

// Repacked q8_0 rows r0 .. r0 + n_rows (ds4_gemv.h: quants in element order, scales in block order): thread
// (row i, chunk c) reads the 16-byte chunk of elements 16 c .. 16 c + 15 and its block's scale (block c / 2);
// value = d * q as the CPU's dequantisation.
template <class Out>
__global__ void __launch_bounds__(kThreads)
    dequant_q8_repacked_kernel(const uint8_t *__restrict__ q, const uint8_t *__restrict__ sc, size_t q_stride,
                               size_t s_stride, int64_t r0, int64_t n_rows, int64_t cols, Out *__restrict__ dst) {
    const int64_t chunks = cols / 16;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_rows * chunks) return;
    const int64_t c = idx % chunks, i = idx / chunks;
    const size_t r = static_cast<size_t>(r0 + i);
    const uint4 v = *reinterpret_cast<const uint4 *>(q + r * q_stride + 16 * c);
    const unsigned short db = *reinterpret_cast<const unsigned short *>(sc + r * s_stride + 2 * (c >> 1));
    const float d = half_bits(db);
    const uint32_t wq[4] = {v.x, v.y, v.z, v.w};
    Out *o = dst + i * cols + 16 * c;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            f[j] = ds4q::mul_rn(d, static_cast<float>(static_cast<int8_t>((wq[k] >> (8 * j)) & 0xFFu)));
        store4(o + 4 * k, f);
    }
}

// ---- host: types and checks ---------------------------------------------------------------------------

// Column multiple and row alignment (bytes) the decoders need per type.
struct type_req {
    int block = 0, align = 0;
};
type_req req_of(dtype t) {
    switch (t) {
    case dtype::f32: return {32, 4};
    case dtype::f16: return {32, 2};
    case dtype::bf16: return {32, 2};
    case dtype::q8_0: return {32, 2};
    case dtype::mxfp4: return {32, 1};
    case dtype::iq2_xxs: return {256, 2};
    case dtype::q2_k: return {256, 4};
    case dtype::q3_k: return {256, 2};
    case dtype::q4_k: return {256, 4};
    case dtype::q5_k: return {256, 4};
    case dtype::q6_k: return {256, 2};
    default: return {};
    }
}
template <class F>
bool dispatch_type(dtype t, F &&f) {
    switch (t) {
    case dtype::f32: f.template operator()<dtype::f32>(); return true;
    case dtype::f16: f.template operator()<dtype::f16>(); return true;
    case dtype::bf16: f.template operator()<dtype::bf16>(); return true;
    case dtype::q8_0: f.template operator()<dtype::q8_0>(); return true;
    case dtype::mxfp4: f.template operator()<dtype::mxfp4>(); return true;
    case dtype::iq2_xxs: f.template operator()<dtype::iq2_xxs>(); return true;
    case dtype::q2_k: f.template operator()<dtype::q2_k>(); return true;
    case dtype::q3_k: f.template operator()<dtype::q3_k>(); return true;
    case dtype::q4_k: f.template operator()<dtype::q4_k>(); return true;
    case dtype::q5_k: f.template operator()<dtype::q5_k>(); return true;
    case dtype::q6_k: f.template operator()<dtype::q6_k>(); return true;
    default: return false;
    }
}

std::string shape_of(const gemm_weight &w) {
    return std::string(dtype_name(w.type)) + " [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]" +
           (w.p ? "" : " (prepared)");
}

// Empty string when the weight is usable, else why not.
std::string weight_problem(const gemm_weight &w) {
    if (w.rows < 1 || w.cols < 1) return "empty weight";
    if (w.rows >= (int64_t{1} << 31) || w.cols >= (int64_t{1} << 31)) return "dimensions exceed the cuBLAS int range";
    if (!w.p) {
        if (!w.fast) return "no weight data (p and fast both null)";
        const gemv_weight &f = *w.fast;
        if (f.rows != w.rows || f.cols != w.cols || f.type != w.type) return "prepared weight differs in type or shape";
        if (f.type == dtype::q8_0) {
            if (w.cols % kRepackTile != 0) return "repacked q8_0 needs cols % 512 == 0";
            if (!f.q || !f.scales || reinterpret_cast<uintptr_t>(f.q) % 16 != 0 ||
                reinterpret_cast<uintptr_t>(f.scales) % 16 != 0 || f.q_stride % 16 != 0 || f.s_stride % 8 != 0 ||
                f.q_stride < static_cast<size_t>(w.cols) || f.s_stride < static_cast<size_t>(w.cols / 16))
                return "repacked q8_0 layout (16-byte aligned q / scales, strides)";
            return "";
        }
        if (f.type != dtype::f16 && f.type != dtype::f32) return "prepared weights are q8_0, f16 or f32";
        if (!f.q) return "no weight data";
    }
    const type_req rq = req_of(w.type);
    if (rq.block == 0) return "unsupported weight type";
    if (w.cols % rq.block != 0) return "cols is not a multiple of " + std::to_string(rq.block);
    const void *p = w.p ? w.p : w.fast->q;
    const size_t rb = w.p ? w.row_bytes : w.fast->q_stride;
    if (rb < dtype_row_bytes(w.type, w.cols)) return "row_bytes smaller than one row";
    if (reinterpret_cast<uintptr_t>(p) % rq.align != 0 || rb % rq.align != 0)
        return "rows must be " + std::to_string(rq.align) + "-byte aligned";
    return "";
}

void check_weight(const gemm_weight &w, const char *what) {
    const std::string why = weight_problem(w);
    if (!why.empty()) throw error(std::string("cuda ds4 ") + what + ": weight " + shape_of(w) + ": " + why);
}

void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw error(std::string("cuda ds4 ") + what + ": launch failed: " + cudaGetErrorString(e));
}
void ckb(cublasStatus_t st, const char *what) {
    if (st != CUBLAS_STATUS_SUCCESS)
        throw error(std::string("cuda ds4 ") + what + ": cuBLAS error " + std::to_string(static_cast<int>(st)));
}
// Blocks of kThreads for `threads` threads; every launch here indexes its threads in 32 bits.
unsigned blocks_for(int64_t threads, const char *what) {
    if (threads >= (int64_t{1} << 32) - kThreads) throw error(std::string("cuda ds4 ") + what + ": launch too large");
    return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}
int to_int(int64_t v, const char *what) {
    if (v < 0 || v >= (int64_t{1} << 31)) throw error(std::string("cuda ds4 ") + what + ": size exceeds the cuBLAS int range");
    return static_cast<int>(v);
}

// Rows r0 .. r0 + n of w dequantised to dst ([n, cols], bf16 or f32).
template <class Out>
void dequant_range(const gemm_weight &w, int64_t r0, int64_t n, Out *dst, const uint64_t *grid, cudaStream_t s) {
    if (!w.p && w.fast->type == dtype::q8_0) {
        const gemv_weight &f = *w.fast;
        dequant_q8_repacked_kernel<Out><<<blocks_for(n * (w.cols / 16), "gemm dequantise"), kThreads, 0, s>>>(
            static_cast<const uint8_t *>(f.q), static_cast<const uint8_t *>(f.scales), f.q_stride, f.s_stride, r0, n,
            w.cols, dst);
        check_launch("gemm dequantise (repacked q8_0)");
        return;
    }
    const size_t rb = w.p ? w.row_bytes : w.fast->q_stride;
    dq_args a{};
    a.src[0] = static_cast<const uint8_t *>(w.p ? w.p : w.fast->q) + static_cast<size_t>(r0) * rb;
    a.row_bytes = rb;
    a.expert_bytes = 0;
    a.rows = n;
    a.units = w.cols / 32;
    a.n_src = 1;
    a.n_list = 1;
    a.ids[0] = 0;
    a.grid = grid;
    dispatch_type(w.type, [&]<dtype T>() {
        dequant_rows_kernel<T, Out><<<blocks_for(n * a.units, "gemm dequantise"), kThreads, 0, s>>>(a, dst);
    });
    check_launch("gemm dequantise");
}

// The weight used in place by the GEMM (no dequantisation): bf16 rows for bf16 precision, f32 rows
// for f32 precision. Returns null otherwise; ld = row stride in elements.
const void *in_place(const gemm_weight &w, dtype want, int64_t &ld) {
    if (w.type != want) return nullptr;
    const void *p = w.p ? w.p : w.fast->q;
    const size_t rb = w.p ? w.row_bytes : w.fast->q_stride;
    const size_t el = want == dtype::f32 ? 4 : 2;
    if (reinterpret_cast<uintptr_t>(p) % el != 0 || rb % el != 0) return nullptr;
    ld = static_cast<int64_t>(rb / el);
    return p;
}

}  // namespace

// ---- gemm_runner ----------------------------------------------------------------------------------------

struct gemm_runner::impl {
    cudaStream_t s = nullptr;
    cublasHandle_t h = nullptr;
    void *ws = nullptr;
    size_t max_x = 0, max_w = 0;  // elements (bf16) of xb / wb
    uint16_t *xb = nullptr;       // activations as bf16 [max_x]
    void *wb = nullptr;           // weight tile: max_w bf16 or max_w / 2 f32
    const uint64_t *grid = nullptr;

    ~impl() {
        if (h) cublasDestroy(h);
        cudaFree(ws);
        cudaFree(xb);
        cudaFree(wb);
    }
    // y (rows x n_tok tile at y, ldy) = W tile (bf16, ldw) . xb (bf16, ldx)
    void gemm(const void *w, int64_t ldw, int64_t rows, int64_t cols, const void *x, int64_t ldx, int64_t n_tok,
              float *y, int64_t ldy, bool accumulate) {
        const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
        ckb(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, to_int(rows, "gemm"), to_int(n_tok, "gemm"), to_int(cols, "gemm"),
                         &one, w, CUDA_R_16BF, to_int(ldw, "gemm"), x, CUDA_R_16BF, to_int(ldx, "gemm"), &beta, y,
                         CUDA_R_32F, to_int(ldy, "gemm"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "gemm: bf16 GEMM");
    }
    void matmul_f32(const gemm_weight &w, const float *x, int64_t ldx, int64_t n_tok, float *y, int64_t ldy,
                    bool accumulate);
};

gemm_runner::gemm_runner(cudaStream_t s, size_t max_x_elems, size_t max_w_elems) : p_(std::make_unique<impl>()) {
    if (max_w_elems < 512) throw error("cuda ds4 gemm: max_w_elems must be at least 512");
    impl &m = *p_;
    m.s = s;
    m.max_x = max_x_elems;
    m.max_w = max_w_elems;
    // 16 spare bytes each (nothing reads past, but allocations elsewhere keep the same habit)
    if (cudaMalloc(&m.xb, max_x_elems * 2 + 16) != cudaSuccess || cudaMalloc(&m.wb, max_w_elems * 2 + 16) != cudaSuccess ||
        cudaMalloc(&m.ws, kCublasWorkspace) != cudaSuccess)
        throw error("cuda ds4 gemm: cannot allocate the scratch (" + std::to_string((max_x_elems + max_w_elems) * 2) +
                    " bytes)");
    ckb(cublasCreate(&m.h), "gemm: cublasCreate");
    ckb(cublasSetStream(m.h, s), "gemm: cublasSetStream");
    ckb(cublasSetWorkspace(m.h, m.ws, kCublasWorkspace), "gemm: cublasSetWorkspace");  // after SetStream (it resets it)
    ckb(cublasSetMathMode(m.h, CUBLAS_DEFAULT_MATH), "gemm: cublasSetMathMode");
    m.grid = iq2xxs_grid_device();
}

gemm_runner::~gemm_runner() = default;

cudaStream_t gemm_runner::stream() const {
    return p_->s;
}

void gemm_runner::set_stream(cudaStream_t s) {
    p_->s = s;
    ckb(cublasSetStream(p_->h, s), "gemm: cublasSetStream");
    ckb(cublasSetWorkspace(p_->h, p_->ws, kCublasWorkspace), "gemm: cublasSetWorkspace");  // SetStream resets it
}

bool gemm_runner::supported(const gemm_weight &w) {
    return weight_problem(w).empty();
}

void gemm_runner::impl::matmul_f32(const gemm_weight &w, const float *x, int64_t ldx, int64_t n_tok, float *y,
                                   int64_t ldy, bool accumulate) {
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    int64_t ldw = 0;
    const void *direct = in_place(w, dtype::f32, ldw);
    const int64_t tile_rows = direct ? w.rows : std::min<int64_t>(w.rows, static_cast<int64_t>(max_w / 2) / w.cols);
    if (tile_rows < 1) throw error("cuda ds4 gemm: max_w_elems too small for one f32 row of " + shape_of(w));
    // pedantic math: the prescribed f32 arithmetic throughout (no TF32), restored afterwards
    ckb(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH), "gemm: cublasSetMathMode");
    for (int64_t r0 = 0; r0 < w.rows; r0 += tile_rows) {
        const int64_t n = std::min(tile_rows, w.rows - r0);
        const float *wt;
        if (direct) {
            wt = static_cast<const float *>(direct);  // one tile of every row (r0 = 0), ldw from in_place
        } else {
            dequant_range(w, r0, n, static_cast<float *>(wb), grid, s);
            wt = static_cast<const float *>(wb);
            ldw = w.cols;
        }
        const cublasStatus_t st =
            cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, to_int(n, "gemm"), to_int(n_tok, "gemm"), to_int(w.cols, "gemm"),
                        &one, wt, to_int(ldw, "gemm"), x, to_int(ldx, "gemm"), &beta, y + r0, to_int(ldy, "gemm"));
        if (st != CUBLAS_STATUS_SUCCESS) {
            cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
            ckb(st, "gemm: f32 GEMM");
        }
    }
    ckb(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "gemm: cublasSetMathMode");
}

void gemm_runner::matmul(const gemm_weight &w, const float *x, int64_t ldx, int64_t n_tok, float *y, int64_t ldy,
                         gemm_precision prec, bool accumulate) {
    check_weight(w, "gemm");
    if (n_tok < 0) throw error("cuda ds4 gemm: negative token count");
    if (n_tok == 0) return;
    if (!x || !y || ldx < w.cols || ldy < w.rows)
        throw error("cuda ds4 gemm: x / y missing or strides too small (ldx " + std::to_string(ldx) + " < cols " +
                    std::to_string(w.cols) + " or ldy " + std::to_string(ldy) + " < rows " + std::to_string(w.rows) + ")");
    impl &m = *p_;
    if (prec == gemm_precision::f32) {
        m.matmul_f32(w, x, ldx, n_tok, y, ldy, accumulate);
        return;
    }
    if (static_cast<size_t>(n_tok) * static_cast<size_t>(w.cols) > m.max_x)
        throw error("cuda ds4 gemm: " + std::to_string(n_tok) + " x " + std::to_string(w.cols) +
                    " activations exceed max_x_elems " + std::to_string(m.max_x));
    launch_f32_to_bf16(x, ldx, w.cols, n_tok, m.xb, m.s);
    check_launch("gemm: convert x");
    int64_t ldw = 0;
    if (const void *direct = in_place(w, dtype::bf16, ldw)) {
        m.gemm(direct, ldw, w.rows, w.cols, m.xb, w.cols, n_tok, y, ldy, accumulate);
        return;
    }
    const int64_t tile_rows = std::min<int64_t>(w.rows, static_cast<int64_t>(m.max_w) / w.cols);
    if (tile_rows < 1) throw error("cuda ds4 gemm: max_w_elems too small for one row of " + shape_of(w));
    auto *wb = static_cast<__nv_bfloat16 *>(m.wb);
    for (int64_t r0 = 0; r0 < w.rows; r0 += tile_rows) {
        const int64_t n = std::min(tile_rows, w.rows - r0);
        dequant_range(w, r0, n, wb, m.grid, m.s);
        m.gemm(wb, w.cols, n, w.cols, m.xb, w.cols, n_tok, y + r0, ldy, accumulate);
    }
}

void gemm_runner::matmul_grouped(const gemm_weight &w, int64_t rows_per_group, const float *x, int64_t ldx,
                                 int64_t n_tok, float *y, int64_t ldy) {
    check_weight(w, "grouped gemm");
    if (rows_per_group < 1 || w.rows % rows_per_group != 0)
        throw error("cuda ds4 grouped gemm: rows " + std::to_string(w.rows) + " not a multiple of rows_per_group " +
                    std::to_string(rows_per_group));
    if (n_tok < 0) throw error("cuda ds4 grouped gemm: negative token count");
    if (n_tok == 0) return;
    const int64_t G = w.rows / rows_per_group, K = G * w.cols;  // groups; inputs per token
    if (!x || !y || ldx < K || ldy < w.rows)
        throw error("cuda ds4 grouped gemm: x / y missing or strides too small (ldx " + std::to_string(ldx) + " < " +
                    std::to_string(K) + " or ldy " + std::to_string(ldy) + " < rows " + std::to_string(w.rows) + ")");
    impl &m = *p_;
    if (static_cast<size_t>(n_tok) * static_cast<size_t>(K) > m.max_x)
        throw error("cuda ds4 grouped gemm: " + std::to_string(n_tok) + " x " + std::to_string(K) +
                    " activations exceed max_x_elems " + std::to_string(m.max_x));
    launch_f32_to_bf16(x, ldx, K, n_tok, m.xb, m.s);  // xb [n_tok, G * cols]
    check_launch("grouped gemm: convert x");
    const float one = 1.0f, zero = 0.0f;
    const int64_t rpg = rows_per_group, group_elems = rpg * w.cols;
    int64_t ldw = 0;
    const void *direct = in_place(w, dtype::bf16, ldw);
    // Strided batch over whole groups: batch g multiplies W rows g * rpg .. (A stride rpg * ldw) with
    // the token rows' input g (B: ldb = G * cols, stride cols) into y columns g * rpg .. (C stride rpg).
    auto batched = [&](const void *wt, int64_t ldwt, int64_t g0, int64_t ng) {
        ckb(cublasGemmStridedBatchedEx(m.h, CUBLAS_OP_T, CUBLAS_OP_N, to_int(rpg, "grouped gemm"),
                                       to_int(n_tok, "grouped gemm"), to_int(w.cols, "grouped gemm"), &one, wt,
                                       CUDA_R_16BF, to_int(ldwt, "grouped gemm"), rpg * ldwt, m.xb + g0 * w.cols,
                                       CUDA_R_16BF, to_int(K, "grouped gemm"), w.cols, &zero, y + g0 * rpg, CUDA_R_32F,
                                       to_int(ldy, "grouped gemm"), rpg, to_int(ng, "grouped gemm"), CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT),
            "grouped gemm: bf16 batched GEMM");
    };
    if (direct) {
        batched(direct, ldw, 0, G);
        return;
    }
    auto *wb = static_cast<__nv_bfloat16 *>(m.wb);
    const int64_t groups_per_tile = static_cast<int64_t>(m.max_w) / group_elems;
    if (groups_per_tile >= 1) {
        for (int64_t g0 = 0; g0 < G; g0 += groups_per_tile) {
            const int64_t ng = std::min(groups_per_tile, G - g0);
            dequant_range(w, g0 * rpg, ng * rpg, wb, m.grid, m.s);
            batched(wb, w.cols, g0, ng);
        }
        return;
    }
    // a group larger than one tile: row tiles within each group, plain GEMMs
    const int64_t tile_rows = static_cast<int64_t>(m.max_w) / w.cols;
    if (tile_rows < 1) throw error("cuda ds4 grouped gemm: max_w_elems too small for one row of " + shape_of(w));
    for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < rpg; r += tile_rows) {
            const int64_t n = std::min(tile_rows, rpg - r);
            dequant_range(w, g * rpg + r, n, wb, m.grid, m.s);
            m.gemm(wb, w.cols, n, w.cols, m.xb + g * w.cols, K, n_tok, y + g * rpg + r, ldy, false);
        }
}

void gemm_runner::gemm_bf16(const uint16_t *w, int64_t ldw, int64_t rows, int64_t cols, const uint16_t *x,
                            int64_t ldx, int64_t n_tok, float *y, int64_t ldy, bool accumulate) {
    if (n_tok == 0 || rows == 0) return;
    if (!w || !x || !y || rows < 0 || cols < 1 || n_tok < 0 || ldw < cols || ldx < cols || ldy < rows)
        throw error("cuda ds4 gemm_bf16: bad operands or strides");
    p_->gemm(w, ldw, rows, cols, x, ldx, n_tok, y, ldy, accumulate);
}

void gemm_runner::dequant_experts_bf16(const expert_bank *src, int n_src, const int32_t *ids, int n_ids,
                                       uint16_t *dst) {
    if (n_src < 1 || n_src > 2 || n_ids < 1 || n_ids > max_dequant_experts || !ids || !dst)
        throw error("cuda ds4 expert dequantise: 1..2 banks and 1.." + std::to_string(max_dequant_experts) + " experts");
    const expert_bank &b = src[0];
    const type_req rq = req_of(b.type);
    if (rq.block == 0) throw error("cuda ds4 expert dequantise: unsupported type " + std::string(dtype_name(b.type)));
    if (b.rows < 1 || b.cols < 1 || b.cols % rq.block != 0 || b.row_bytes < dtype_row_bytes(b.type, b.cols) ||
        b.expert_bytes < b.row_bytes * static_cast<size_t>(b.rows) || b.row_bytes % rq.align != 0 ||
        b.expert_bytes % rq.align != 0)
        throw error("cuda ds4 expert dequantise: " + std::string(dtype_name(b.type)) + " bank [" + std::to_string(b.rows) +
                    ", " + std::to_string(b.cols) + "] needs cols % " + std::to_string(rq.block) + " and " +
                    std::to_string(rq.align) + "-byte aligned rows");
    dq_args a{};
    for (int j = 0; j < n_src; ++j) {
        const expert_bank &o = src[j];
        if (o.type != b.type || o.rows != b.rows || o.cols != b.cols || o.row_bytes != b.row_bytes ||
            o.expert_bytes != b.expert_bytes || !o.data || reinterpret_cast<uintptr_t>(o.data) % rq.align != 0)
            throw error("cuda ds4 expert dequantise: banks differ in type, shape or strides, or are misaligned");
        a.src[j] = static_cast<const uint8_t *>(o.data);
    }
    for (int i = 0; i < n_ids; ++i) {
        if (ids[i] < 0 || ids[i] >= b.n_expert)
            throw error("cuda ds4 expert dequantise: expert " + std::to_string(ids[i]) + " outside the bank");
        a.ids[i] = ids[i];
    }
    a.row_bytes = b.row_bytes;
    a.expert_bytes = b.expert_bytes;
    a.rows = b.rows;
    a.units = b.cols / 32;
    a.n_src = n_src;
    a.n_list = n_ids;
    a.grid = p_->grid;
    const int64_t threads = static_cast<int64_t>(n_ids) * n_src * b.rows * a.units;
    auto *out = reinterpret_cast<__nv_bfloat16 *>(dst);
    dispatch_type(b.type, [&]<dtype T>() {
        dequant_rows_kernel<T, __nv_bfloat16>
            <<<blocks_for(threads, "expert dequantise"), kThreads, 0, p_->s>>>(a, out);
    });
    check_launch("expert dequantise");
}

}  // namespace fathom::cuda::ds4
