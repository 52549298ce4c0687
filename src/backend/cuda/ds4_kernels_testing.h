// Test and benchmark switches of the DS4 MoE expert kernels (ds4_kernels.h; defined in ds4_moe.cu):
// which kernels run the q8 expert GEMVs, the activation precision, and a count of staged launches.
// Only tests/ and bench/ include this header; the engine never calls these (it runs the defaults).
#pragma once
#include <cstdint>

#include "backend/cuda/ds4_kernels.h"

namespace fathom::cuda::ds4 {

// Which kernels run the q8 expert GEMVs (launch_moe_gate_up / _down / _ffn with iq2_xxs, q2_k, q8_0
// weights): 1 (default) weight rows staged through shared memory with cp.async (gate/up: slabs 2 or 3
// stages deep; down: the block's routed rows at once), each falling back to the direct kernel unless
// weight bases and strides are 16-byte multiples and the stages fit in shared memory; 2 / 3 the same
// with the gate/up depth forced (tests); 0 the direct kernels (loads from global memory). Results are
// bit-identical in every mode. Process-wide (default 1). A captured graph
// keeps the kernels chosen at capture.
void set_moe_staged(int mode);
int moe_staged();
// false: every expert launch takes the f32-activation kernels (tests compare whole models with the
// CPU reference to f32 rounding this way). Process-wide (default true); a captured graph keeps the
// kernels chosen at capture.
void set_moe_q8_activations(bool on);
// Staged gate/up and down kernel launches enqueued so far (process-wide; tests check the staged path
// ran rather than fell back).
uint64_t moe_staged_launches();

}  // namespace fathom::cuda::ds4
