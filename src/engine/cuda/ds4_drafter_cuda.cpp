// The MTP head on one GPU (ds4_drafter.h mtp_head): its block on the target's device (ds4::cuda_upload_mtp,
// the embedding and output head shared with the target), one ds4::cuda_sequence per session, every row one
// eval_mtp (a replayed graph). Compiled only in CUDA builds (src/CMakeLists.txt: engine/cuda/).
#include <memory>
#include <span>

#include "core/error.h"
#include "engine/ds4_drafter.h"
#include "models/cuda/deepseek4_cuda.h"

namespace fathom {
namespace {

class cuda_mtp_head final : public mtp_head {
  public:
    cuda_mtp_head(std::shared_ptr<const ds4::cuda_weights> w, int64_t n_ctx)
        : seq_(std::move(w), n_ctx, true, 0),
          S_(static_cast<size_t>(seq_.hp().n_hc) * static_cast<size_t>(seq_.hp().n_embd)) {}
    int64_t n_past() const override { return seq_.n_past(); }
    int64_t window() const override { return seq_.hp().window; }
    int64_t rollback_floor() const override { return seq_.rollback_floor(); }
    void rows(std::span<const float> x, std::span<const int32_t> next) override {
        if (x.size() != next.size() * S_) throw error("cuda mtp head: states and tokens do not match");
        for (size_t i = 0; i < next.size(); ++i) seq_.eval_mtp(next[i], x.subspan(i * S_, S_));
    }
    int32_t row(std::span<const float> x, int32_t next, std::span<float> out) override {
        return seq_.eval_mtp(next, x, {}, out);
    }
    void truncate(int64_t n) override { seq_.truncate(n); }
    void restart(int64_t at) override { seq_.restart_at(at); }

  private:
    ds4::cuda_sequence seq_;
    size_t S_;
};

}  // namespace

std::unique_ptr<mtp_head> make_cuda_mtp_head(std::shared_ptr<const ds4::cuda_weights> head, int64_t n_ctx) {
    if (!head) throw error("ds4 drafter: no MTP head on the device");
    return std::make_unique<cuda_mtp_head>(std::move(head), n_ctx);
}

}  // namespace fathom
