// Programmatic dependent launch (PDL) helpers shared by the kernels launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (ds4_gemv.cu, ds4_hc.cu, ds4_moe.cu): on the device,
// wait for the preceding kernel of the stream (its writes visible) / let the next one launch (no-ops
// when a kernel was launched without the attribute, and on targets before sm_90); on the host, the
// launch with the attribute. Include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace fathom::cuda {

// kernel<<<grid, block, smem, s>>>(args...), with programmatic stream serialisation when pdl: the
// kernel may start while the stream's previous kernel is finishing, and waits for it in pdl_wait().
// Returns the launch's error (the caller reports it).
template <class... Params, class... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl,
                       Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

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
