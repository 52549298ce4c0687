// dist/gpu_stage.h in a build without the CUDA backend (src/CMakeLists.txt: files under a no_cuda/
// directory stand in for those under cuda/): a CUDA stage cannot be built.
#include "core/error.h"
#include "dist/gpu_stage.h"
#include "dist/planner.h"

namespace fathom::dist {

namespace {

[[noreturn]] void no_cuda() {
    throw error(
        "dist: CUDA stage requested but this build has no CUDA backend (configure with -DFATHOM_CUDA=ON)");
}

}  // namespace

std::unique_ptr<gpu_stage> make_gpu_stage(const ds4::model &, const stage_device &, layer_range,
                                          ds4::qat_mode, kv_precision) {
    no_cuda();
}

std::shared_ptr<const ds4::cuda_weights> upload_stage(const ds4::model &, int, layer_range, ds4::qat_mode,
                                                      kv_precision,
                                                      const std::function<void(uint64_t, uint64_t)> &) {
    no_cuda();
}

double stage_bytes_per_token(const ds4::cuda_weights &) {
    no_cuda();
}

uint64_t device_free_bytes(const std::string &) {
    throw error("plan: this build has no CUDA backend to query device memory; give --mem-gib (one value per device)");
}

}  // namespace fathom::dist
