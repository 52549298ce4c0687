// The drafters on one GPU: the MTP head (ds4_drafter.h mtp_head: its block on the target's device,
// ds4::cuda_upload_mtp, the embedding and output head shared with the target, one ds4::cuda_sequence per
// session: a drafted row one eval_mtp, a row it only catches up on one observe_mtp, each a replayed graph) and the DSpark drafter (ds4::cuda_dspark, one per
// session). Compiled only in CUDA builds (src/CMakeLists.txt: engine/cuda/).
#include <algorithm>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "engine/ds4_drafter.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_dspark.h"

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
        seq_.observe_mtp(next, x);
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

// The DSpark drafter on the device: a draft is one block from the pending token over the longest run of
// observed positions before it. The target's features wait on the host (the newest `window` positions:
// older ones cannot reach a block) and enter the drafter's rings in one observe just before a draft: a
// step that drafts nothing (a paused drafter, plain decoding) pays no observe, and a probe after a pause
// observes its window at once (128 rows 2.6 ms against 128 x 0.11 ms one at a time on the H100). The
// rings receive the same positions with the same features as with an observe per step.
class cuda_dspark_drafter final : public ds4_drafter {
  public:
    cuda_dspark_drafter(std::shared_ptr<const ds4::cuda_weights> w, ds4::qat_mode qat)
        : d_(std::move(w), qat), F_(static_cast<size_t>(d_.feature_dim())) {}
    bool wants_hc_state() const override { return false; }
    std::span<const int> feature_layers() const override { return d_.config().target_layers; }
    int64_t context_rows() const override { return d_.config().window; }
    void observe(std::span<const int32_t> held, int64_t p0, std::span<const float> hc,
                 std::span<const float> features) override {
        (void)held, (void)hc;
        if (F_ == 0 || features.size() % F_ != 0) throw error("cuda dspark drafter: features of another width");
        const int64_t n = static_cast<int64_t>(features.size() / F_);
        if (n == 0) return;
        if (!pend_.empty() && p0 != pend_end()) {  // not the next positions: what is pending goes first
            keep_pending_below(p0);
            if (!pend_.empty() && p0 != pend_end()) flush();
        }
        if (pend_.empty()) pend_p0_ = p0;
        pend_.insert(pend_.end(), features.begin(), features.end());
        // Rows older than the newest window are never read again: dropped once they are a window's worth
        // (one move of the buffer per `window` steps, not a 6 MB move every step).
        const int64_t over = static_cast<int64_t>(pend_.size() / F_) - d_.config().window;
        if (over >= d_.config().window) {
            pend_.erase(pend_.begin(), pend_.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(over) * F_));
            pend_p0_ += over;
        }
    }
    void truncate(int64_t n) override {
        keep_pending_below(n);
        d_.truncate(n);
    }
    void reset() override {
        pend_.clear();
        d_.reset();
    }
    std::vector<int32_t> draft(std::span<const int32_t> held, int32_t pending, int32_t max,
                               std::vector<float> *confidence) override {
        if (confidence) confidence->clear();
        if (max <= 0) return {};
        flush();
        const ds4::dspark_block b = d_.draft(static_cast<int64_t>(held.size()), pending);
        std::vector<int32_t> d = b.draft_tokens;
        if (static_cast<int64_t>(d.size()) > max) d.resize(static_cast<size_t>(max));
        if (confidence) confidence->assign(b.confidence.begin(), b.confidence.begin() + static_cast<std::ptrdiff_t>(d.size()));
        return d;
    }

  private:
    int64_t pend_end() const { return pend_p0_ + static_cast<int64_t>(pend_.size() / F_); }
    void keep_pending_below(int64_t n) {  // pending positions >= n dropped
        if (pend_.empty() || n >= pend_end()) return;
        pend_.resize(n <= pend_p0_ ? 0 : static_cast<size_t>(n - pend_p0_) * F_);
    }
    void flush() {  // the newest window of the pending rows (older ones cannot reach a block)
        if (pend_.empty()) return;
        const int64_t rows = static_cast<int64_t>(pend_.size() / F_), skip = std::max<int64_t>(0, rows - d_.config().window);
        d_.observe(pend_p0_ + skip, std::span<const float>(pend_).subspan(static_cast<size_t>(skip) * F_));
        pend_.clear();
    }
    ds4::cuda_dspark d_;
    size_t F_;
    std::vector<float> pend_;  // features of positions pend_p0_ .. (rows of F_ floats), not yet observed
    int64_t pend_p0_ = 0;
};

}  // namespace

std::unique_ptr<ds4_drafter> make_cuda_dspark_drafter(std::shared_ptr<const ds4::cuda_weights> w, ds4::qat_mode qat) {
    if (!w) throw error("ds4 drafter: no DSpark drafter on the device");
    return std::make_unique<cuda_dspark_drafter>(std::move(w), qat);
}

std::unique_ptr<mtp_head> make_cuda_mtp_head(std::shared_ptr<const ds4::cuda_weights> head, int64_t n_ctx) {
    if (!head) throw error("ds4 drafter: no MTP head on the device");
    return std::make_unique<cuda_mtp_head>(std::move(head), n_ctx);
}

}  // namespace fathom
