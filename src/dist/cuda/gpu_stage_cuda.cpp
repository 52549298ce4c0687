// A pipeline rank's blocks on one CUDA device (dist/gpu_stage.h) over ds4::cuda_sequence's stage
// evaluation (models/cuda/deepseek4_cuda.h). Compiled only in CUDA builds (src/CMakeLists.txt: files
// under a cuda/ directory); dist/no_cuda/gpu_stage_no_cuda.cpp stands in otherwise.
#include <string>
#include <utility>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "dist/planner.h"
#include "dist/gpu_stage.h"
#include "models/cuda/deepseek4_cuda.h"

namespace fathom::dist {

namespace {

class cuda_stage final : public gpu_stage {
  public:
    explicit cuda_stage(std::unique_ptr<ds4::cuda_sequence> seq) : seq_(std::move(seq)) {}
    void eval(std::span<const int32_t> tokens, std::span<float> x, std::span<float> logits) override {
        seq_->eval_stage(tokens, x, logits);
    }
    void reset() override { seq_->reset(); }

  private:
    std::unique_ptr<ds4::cuda_sequence> seq_;
};

}  // namespace

std::unique_ptr<gpu_stage> make_gpu_stage(const ds4::model &m, const stage_device &dev, layer_range lr,
                                          ds4::qat_mode qat, kv_precision kv) {
    if (dev.n_ctx < 1) throw error("dist: a CUDA stage needs a positive n_ctx");
    // Reuse the engine's upload of this range when given (it must be this device's and range's).
    std::shared_ptr<const ds4::cuda_weights> w =
        dev.weights ? dev.weights : upload_stage(m, dev.cuda_device, lr, qat, kv);
    return std::make_unique<cuda_stage>(
        std::make_unique<ds4::cuda_sequence>(std::move(w), dev.n_ctx, dev.cuda_graphs));
}

std::shared_ptr<const ds4::cuda_weights> upload_stage(
    const ds4::model &m, int ordinal, layer_range lr, ds4::qat_mode qat, kv_precision kv,
    const std::function<void(uint64_t, uint64_t)> &progress) {
    ds4::cuda_run_options co;
    co.device = ordinal;
    co.qat = qat;
    co.kv = kv;
    co.first_layer = lr.first;
    co.last_layer = lr.last;
    return ds4::cuda_upload(m, co, progress);
}

double stage_bytes_per_token(const ds4::cuda_weights &w) {
    return ds4::cuda_bytes_per_token(w);
}

// planner.h: a CUDA device's free memory for `fathom plan`.
uint64_t device_free_bytes(const std::string &name) {
    int ordinal = -1;
    if (name.rfind("cuda:", 0) == 0) {
        try {
            size_t used = 0;
            ordinal = std::stoi(name.substr(5), &used);
            if (used != name.size() - 5) ordinal = -1;
        } catch (const std::exception &) {
            ordinal = -1;
        }
    }
    if (ordinal < 0) throw error("plan: device '" + name + "': expected cuda:N (or give --mem-gib)");
    const int n = cuda_device_count();
    if (ordinal >= n)
        throw error("plan: device " + name + " not present (" + std::to_string(n) +
                    " CUDA devices); give --mem-gib to plan for it");
    return cuda_query_memory(ordinal).free_bytes;
}

}  // namespace fathom::dist
