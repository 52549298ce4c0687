// Device selection shared by the engines (see device.h).
#include "engine/device.h"

#include <algorithm>

#include "core/error.h"

namespace fathom {

device_choice parse_device(const std::string &d) {
    if (d == "cpu") return {};
    if (d == "auto") return {device_choice::automatic, 0};
    if (d == "cuda") return {device_choice::cuda, 0};
    if (d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.size() <= 8 &&
        std::all_of(d.begin() + 5, d.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return {device_choice::cuda, std::stoi(d.substr(5))};
    throw error("device '" + d + "': expected cpu, cuda, cuda:N or auto");
}

// (engine/device.h) auto falls back to the CPU silently; the caller reports it through
// model_info::device.
int resolve_cuda_ordinal(const std::string &device) {
    const device_choice dc = parse_device(device);
    if (dc.kind == device_choice::cpu) return -1;
    if (dc.kind == device_choice::automatic) return gpu_in_build() && gpu_count() > 0 ? 0 : -1;
    if (!gpu_in_build())
        throw error("device '" + device + "': this build has no CUDA backend (configure with -DFATHOM_CUDA=ON)");
    const int n = gpu_count();
    if (n == 0)
        throw error("device '" + device + "': no CUDA device present (use --device cpu, or --device auto to fall back to the CPU)");
    if (dc.ordinal >= n)
        throw error("device '" + device + "': only " + std::to_string(n) + " CUDA device(s) present");
    return dc.ordinal;
}

}  // namespace fathom
