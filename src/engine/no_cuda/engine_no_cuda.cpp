// The engines' CUDA entry points (engine/device.h, dense_gpu.h, ds4_gpu.h, ds4_drafter.h's
// make_cuda_mtp_head) in a build without the CUDA backend (src/CMakeLists.txt: files under a no_cuda/
// directory stand in for those under cuda/): no CUDA device is ever present, and whatever would use
// one throws the same line.
#include "core/error.h"
#include "engine/dense_gpu.h"
#include "engine/device.h"
#include "engine/ds4_drafter.h"
#include "engine/ds4_gpu.h"

namespace fathom {

namespace {

[[noreturn]] void no_cuda() {
    throw error("this build has no CUDA backend (configure with -DFATHOM_CUDA=ON)");
}

}  // namespace

bool gpu_in_build() {
    return false;
}

int gpu_count() {
    return 0;
}

gpu_memory gpu_query_memory(int) {
    no_cuda();
}

double gpu_measure_copy_bandwidth(int) {
    no_cuda();
}

std::unique_ptr<dense_gpu> make_dense_gpu(int) {
    no_cuda();
}

std::unique_ptr<backend> make_gpu_backend(int) {
    no_cuda();
}

std::unique_ptr<mtp_head> make_cuda_mtp_head(std::shared_ptr<const ds4::cuda_weights>, int64_t) {
    no_cuda();
}

std::unique_ptr<ds4_drafter> make_cuda_dspark_drafter(std::shared_ptr<const ds4::cuda_weights>, ds4::qat_mode) {
    no_cuda();
}

namespace ds4_detail {

std::unique_ptr<ds4_gpu> make_ds4_gpu(const ds4::model &, const ds4_gpu_options &) {
    no_cuda();
}

}  // namespace ds4_detail

}  // namespace fathom
