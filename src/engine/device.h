// Device selection shared by the engines (engine.cpp: dense families; ds4_engine.cpp, ds4_devices.cpp: DS4),
// defined in device.cpp.
#pragma once
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

}  // namespace fathom
