// The dense engine's one-GPU executor (engine/dense_gpu.h): the CUDA backend (backend/cuda/cuda_backend.h)
// and its captured decode step (cuda_step_graph). Compiled only in CUDA builds (src/CMakeLists.txt: files
// under a cuda/ directory); engine/no_cuda/engine_no_cuda.cpp stands in otherwise.
#include <utility>

#include "backend/cuda/cuda_backend.h"
#include "engine/dense_gpu.h"

namespace fathom {

namespace {

class cuda_dense_step_graph final : public dense_step_graph {
  public:
    cuda_dense_step_graph(cuda_backend_api &gpu, size_t staging_bytes) : g_(gpu, 1, staging_bytes) {}
    void capture(const std::function<void(backend &)> &fn) override { g_.capture(fn); }
    bool ready() const override { return g_.ready(); }
    bool stale() const override { return g_.stale(); }
    void replay(const int32_t *id, int64_t pos) override { g_.replay(id, pos); }

  private:
    cuda_step_graph g_;
};

class cuda_dense_gpu final : public dense_gpu {
  public:
    explicit cuda_dense_gpu(std::unique_ptr<cuda_backend_api> be) : be_(std::move(be)) {}
    backend &be() override { return *be_; }
    void make_current() override { be_->make_current(); }
    std::unique_ptr<dense_step_graph> new_step_graph(size_t staging_bytes) override {
        return std::make_unique<cuda_dense_step_graph>(*be_, staging_bytes);
    }

  private:
    std::unique_ptr<cuda_backend_api> be_;
};

}  // namespace

std::unique_ptr<backend> make_gpu_backend(int ordinal) {
    cuda_options co;
    co.device = ordinal;
    return make_cuda_backend(co);
}

std::unique_ptr<dense_gpu> make_dense_gpu(int ordinal) {
    cuda_options co;
    co.device = ordinal;
    return std::make_unique<cuda_dense_gpu>(make_cuda_backend(co));
}

}  // namespace fathom
