// Test and benchmark hooks of the fast DS4 GEMV (ds4_gemv.h; defined in ds4_gemv.cu): a process-wide
// switch of its int8-activation path, a pure streaming probe, a per-block trace of its launches and the
// query of which kernel a launch takes. Only tests/ and bench/ include this header; the engine never
// calls these.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cuda/ds4_gemv.h"

namespace fathom::cuda::ds4 {

// Process-wide switch of the q8_0 int8-activation path (default on); off: every table takes the
// f32-activation kernel (tests and A/B benchmarks).
void set_gemv_q8_activations(bool on);
// Process-wide switch of the tensor-core columns kernel (the rows forms' q8_0 segments with 2..16 x; default
// on); off: they take the dp4a columns kernel. Either gives the single-x launch's bits (tests, A/B).
void set_gemv_tensor_cores(bool on);
// Process-wide units per block-wide meeting of the tensor-core kernel (1..4, default 4; fewer where shared
// memory does not hold them beside x). The same bits for any value (tests, A/B).
void set_gemv_mma_slots(int slots);

// Measurement aids for the benchmarks (bench/cuda/bench_ds4_gemv.cpp, bench/cuda/bench_cuda_ds4.cpp):
// launch_read_probe: reads `bytes` (a multiple of 16) at src once with 16-byte streaming loads, `unroll`
// (1, 2, 4 or 8) in flight per thread, `blocks` blocks of `threads`; contiguous: each block reads its
// own contiguous slice (else grid-stride); pdl: launched with programmatic dependent launch. The xor
// of the data goes to *sink (so the loads are not elided). What a one-launch stream can reach.
void launch_read_probe(const void *src, size_t bytes, int blocks, int threads, int unroll, bool contiguous,
                       bool pdl, uint32_t *sink, cudaStream_t s);
// Trace of the q8x GEMV launches (only builds compiled with FATHOM_Q8X_TRACE write it): while set, each
// q8x launch made during a stream capture takes the next `blocks` x 6 u64 of buf (room for max_blocks
// blocks; per block: start, after the PDL wait, x ready, end (globaltimer ns), SM id, 0), and
// gemv_trace_launches lists the traced launches' block counts in order. Null: off (and the list cleared).
void set_gemv_trace(uint64_t *buf, size_t max_blocks);
std::vector<int> gemv_trace_launches();
// True when a launch over these segments (rows_per_group[i]: rows per x group of segment i; the
// plain and multi forms pass each weight's rows) takes the int8-activation kernel (tests).
bool gemv_q8_activations_used(const gemv_segment *segs, const int64_t *rows_per_group, int n_segs);

}  // namespace fathom::cuda::ds4
