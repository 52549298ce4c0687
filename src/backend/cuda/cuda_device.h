// The current CUDA device's fixed attributes (SM count, compute capability, opt-in shared memory),
// queried once per device ordinal and cached for the process. Launchers that pick a kernel or a grid
// from these call current_device_caps() instead of cudaGetDevice + cudaDeviceGetAttribute on every
// launch. Host code only; usable from .cpp and .cu files.
#pragma once

namespace fathom::cuda {

struct device_caps {
    int ordinal = -1;    // the device these are for (cudaGetDevice)
    int sm_count = 0;    // cudaDevAttrMultiProcessorCount
    int cc_major = 0;    // cudaDevAttrComputeCapabilityMajor
    int cc_minor = 0;    // cudaDevAttrComputeCapabilityMinor
    int smem_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes
};

// The attributes of the calling thread's current device, or null when cudaGetDevice or an attribute
// query fails (the CUDA error is cleared, so a later cudaGetLastError after a launch does not report
// it; nothing is cached, so the next call queries again). Callers keep their own failure policy
// (fall back, or throw with their own message). Thread-safe. Ordinals 0..63 are cached for the
// process (the pointer stays valid for good); others are queried on every call into a thread-local
// slot, valid until this thread's next call.
const device_caps *current_device_caps() noexcept;

}  // namespace fathom::cuda
