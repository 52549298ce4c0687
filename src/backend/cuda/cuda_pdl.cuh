// Programmatic dependent launch (PDL) device helpers shared by the kernels launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (ds4_gemv.cu, ds4_moe.cu): wait for the preceding
// kernel of the stream (its writes visible) / let the next one launch. No-ops when a kernel was launched
// without the attribute, and on targets before sm_90.
#pragma once

namespace fathom::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace fathom::cuda
