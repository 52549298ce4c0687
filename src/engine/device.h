// Device selection shared by the engines (engine.cpp: dense families; ds4_engine.cpp, ds4_devices.cpp: DS4),
// defined in device.cpp, and the CUDA runtime as the engines see it at load (defined in
// engine/cuda/device_cuda.cpp in a CUDA build; engine/no_cuda/engine_no_cuda.cpp stands in otherwise:
// no CUDA in this build, no devices). The engines' executors on one GPU are behind dense_gpu.h and
// ds4_gpu.h, chosen the same way.
#pragma once
#include <cstddef>
#include <string>

namespace fathom {

// A parsed --device.
struct device_choice {
    enum kind_t { cpu, cuda, automatic } kind = cpu;
    int ordinal = 0;
};

// "cpu" | "auto" | "cuda" | "cuda:N" (N decimal, no sign).
device_choice parse_device(const std::string &d);

// Resolves --device ("cpu" | "auto" | "cuda" | "cuda:N") to -1 (the CPU) or a CUDA ordinal, or
// throws the one-line reason a forced CUDA device cannot be used (no CUDA in this build, no device
// present, ordinal out of range). "auto" falls back to the CPU silently.
int resolve_cuda_ordinal(const std::string &device);

// ---- the CUDA runtime (engine/cuda/device_cuda.cpp, or the no-CUDA stand-in) ----------------------

// Whether this build has the CUDA backend (-DFATHOM_CUDA=ON).
bool gpu_in_build();
// CUDA devices present (0 without CUDA in the build, without a driver or without a device).
int gpu_count();
// A device's name and its free memory now. Throws without CUDA in the build.
struct gpu_memory {
    std::string name;
    size_t free_bytes = 0;
};
gpu_memory gpu_query_memory(int ordinal);
// Device-to-device copy bandwidth in bytes/s (cuda_measure_copy_bandwidth: the roofline ceiling of a
// memory-bound decode). Throws without CUDA in the build.
double gpu_measure_copy_bandwidth(int ordinal);

}  // namespace fathom
