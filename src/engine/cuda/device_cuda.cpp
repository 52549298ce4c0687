// The CUDA runtime as the engines see it at load (engine/device.h), from the CUDA backend's queries
// (backend/cuda/cuda_backend.h). Compiled only in CUDA builds (src/CMakeLists.txt: files under a cuda/
// directory); engine/no_cuda/engine_no_cuda.cpp stands in otherwise.
#include "backend/cuda/cuda_backend.h"
#include "engine/device.h"

namespace fathom {

bool gpu_in_build() {
    return true;
}

int gpu_count() {
    return cuda_device_count();
}

gpu_memory gpu_query_memory(int ordinal) {
    const cuda_device_memory m = cuda_query_memory(ordinal);
    return {m.name, m.free_bytes};
}

double gpu_measure_copy_bandwidth(int ordinal) {
    return cuda_measure_copy_bandwidth(ordinal);
}

}  // namespace fathom
