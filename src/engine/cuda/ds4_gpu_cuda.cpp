// The DS4 engine's one-GPU executor (engine/ds4_gpu.h) over ds4::cuda_weights / ds4::cuda_sequence
// (models/cuda/deepseek4_cuda.h). Compiled only in CUDA builds (src/CMakeLists.txt: files under a cuda/
// directory); engine/no_cuda/engine_no_cuda.cpp stands in otherwise.
#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_sample.h"
#include "backend/cuda/cuda_vmm.h"
#include "backend/cuda/ds4_gemv.h"
#include "core/error.h"
#include "engine/ds4_gpu.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/cuda/deepseek4_cuda_dspark.h"

namespace fathom::ds4_detail {

namespace {

// The executor's live sequences (mapped_blocks sums their mapped positions).
struct sequence_registry {
    mutable std::mutex mu;
    std::vector<const ds4::cuda_sequence *> live;
};

// A session's sequence: forwards to ds4::cuda_sequence; listed in its executor's registry while it lives.
class cuda_gpu_sequence final : public gpu_sequence {
  public:
    cuda_gpu_sequence(std::unique_ptr<ds4::cuda_sequence> seq, std::shared_ptr<sequence_registry> reg)
        : seq_(std::move(seq)), reg_(std::move(reg)) {
        std::lock_guard<std::mutex> lock(reg_->mu);
        reg_->live.push_back(seq_.get());
    }
    ~cuda_gpu_sequence() override {
        std::lock_guard<std::mutex> lock(reg_->mu);
        reg_->live.erase(std::find(reg_->live.begin(), reg_->live.end(), seq_.get()));
    }
    cuda_gpu_sequence(const cuda_gpu_sequence &) = delete;
    cuda_gpu_sequence &operator=(const cuda_gpu_sequence &) = delete;
    ds4::cuda_sequence &seq() { return *seq_; }

    int64_t n_past() const override { return seq_->n_past(); }
    void reset() override { seq_->reset(); }
    bool reserve(int64_t n_tokens) override { return seq_->reserve(n_tokens); }
    size_t row_bytes() const override { return seq_->row_bytes(); }
    int64_t mapped_tokens() const override { return seq_->mapped_tokens(); }
    void eval(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_tail,
              std::span<float> features_tail) override {
        seq_->eval(tokens, logits, hc_tail, features_tail);
    }
    void eval_rows(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out,
                   std::span<float> features) override {
        seq_->eval_rows(tokens, logits, hc_out, features);
    }
    void set_feature_layers(std::span<const int> layers, int64_t tail_rows) override {
        seq_->set_feature_layers(layers, tail_rows);
    }
    void truncate(int64_t n) override { seq_->truncate(n); }
    int64_t rollback_floor() const override { return seq_->rollback_floor(); }
    void last_logits(std::span<float> out) override { seq_->last_logits(out); }
    std::optional<logits_top> top(size_t k, std::span<const std::pair<int32_t, int32_t>> penalties,
                                  float repeat, float frequency, float presence) override {
        return summary(seq_->logits_top(clamp_k(k), penalties, repeat, frequency, presence));
    }
    int rows_held() const override { return seq_->rows_held(); }
    std::optional<logits_top> row_top(size_t j, size_t k, std::span<const std::pair<int32_t, int32_t>> penalties,
                                      float repeat, float frequency, float presence) override {
        return summary(seq_->row_top(row_index(j), clamp_k(k), penalties, repeat, frequency, presence));
    }
    void row_logits(size_t j, std::span<float> out) override { seq_->row_logits(row_index(j), out); }
    void save_state(state_writer &w) const override { seq_->save_state(w); }
    void load_state(state_reader &r, int64_t n_past) override { seq_->load_state(r, n_past); }
    void restore_logits(std::span<const float> logits) override { seq_->restore_logits(logits); }

  private:
    static int clamp_k(size_t k) { return static_cast<int>(std::min<size_t>(k, static_cast<size_t>(cuda::logits_top_max_k))); }
    static int row_index(size_t j) { return static_cast<int>(std::min<size_t>(j, INT32_MAX)); }
    std::optional<logits_top> summary(ds4::cuda_sequence::top_summary d) const {
        if (d.bad != 0) return std::nullopt;  // NaN / +inf
        logits_top t;
        t.ids = std::move(d.ids);
        t.logits = std::move(d.logits);
        t.max_logit = d.max_logit;
        t.z = d.z;
        t.n_vocab = seq_->hp().n_vocab;
        return t;
    }
    std::unique_ptr<ds4::cuda_sequence> seq_;
    std::shared_ptr<sequence_registry> reg_;
};

class cuda_gpu final : public ds4_gpu {
  public:
    cuda_gpu(std::shared_ptr<const ds4::cuda_weights> w, std::shared_ptr<cuda::block_pool> state,
             std::string name, const ds4::hparams &hp, const ds4_gpu_options &o)
        : w_(std::move(w)),
          state_(std::move(state)),
          name_(std::move(name)),
          hp_(hp),
          kv_(o.kv),
          n_ctx_(o.n_ctx),
          prefill_chunk_(o.prefill_chunk),
          graphs_(o.cuda_graphs),
          qat_(o.qat) {}

    const std::string &name() const override { return name_; }
    double bytes_per_token() const override { return ds4::cuda_bytes_per_token(*w_); }
    std::unique_ptr<gpu_sequence> new_sequence() const override {
        return std::make_unique<cuda_gpu_sequence>(
            std::make_unique<ds4::cuda_sequence>(w_, n_ctx_, graphs_, prefill_chunk_, prefill_, state_), reg_);
    }
    state_pool_info state_pool() const override {
        return {state_->block_bytes(), state_->capacity(), state_->used(), ds4::cuda_row_regions(hp_)};
    }
    int64_t mapped_blocks(int32_t block_tokens) const override {
        if (block_tokens < 1) throw error("ds4 gpu: block size must be >= 1 token");
        std::lock_guard<std::mutex> lock(reg_->mu);
        int64_t n = 0;
        for (const ds4::cuda_sequence *s : reg_->live) n += (s->mapped_tokens() + block_tokens - 1) / block_tokens;
        return n;
    }
    void set_state_capacity(int64_t blocks) override { state_->set_capacity(blocks); }
    size_t row_bytes(int64_t n_tokens) const override { return ds4::cuda_row_bytes(hp_, kv_, n_tokens); }
    int max_step_rows() const override { return cuda::ds4::gemv_max_rows; }
    void step_batch(std::span<gpu_sequence *const> seqs, std::span<const int> counts, std::span<const int32_t> tokens,
                    std::span<float> logits, std::span<float> hc_out, std::span<float> features) override {
        std::vector<ds4::cuda_sequence *> cs;  // every sequence is this executor's (new_sequence)
        cs.reserve(seqs.size());
        for (gpu_sequence *s : seqs) cs.push_back(s ? &static_cast<cuda_gpu_sequence *>(s)->seq() : nullptr);
        ds4::cuda_sequence::step_batch(cs, counts, tokens, logits, hc_out, features);
    }
    void load_mtp(const ds4::model &m, const ds4::mtp_weights &w) override {
        mtp_ = ds4::cuda_upload_mtp(m, w, w_);
        shrink_pool(ds4::cuda_weight_bytes(*mtp_));
    }
    std::unique_ptr<mtp_head> new_mtp_head() const override {
        if (!mtp_) throw error("ds4 gpu: no MTP head loaded");
        return make_cuda_mtp_head(mtp_, n_ctx_ + ds4::max_rollback);
    }
    void load_dspark(const ds4::model &m, const ds4::dspark_weights &w) override {
        dspark_ = ds4::cuda_upload_dspark(m, w, w_);
        shrink_pool(ds4::cuda_weight_bytes(*dspark_));
    }
    std::unique_ptr<ds4_drafter> new_dspark_drafter() const override {
        if (!dspark_) throw error("ds4 gpu: no DSpark drafter loaded");
        return make_cuda_dspark_drafter(dspark_, qat_);
    }

  private:
    // A drafter's weights came out of the memory the state pool was sized from (make_ds4_gpu).
    void shrink_pool(size_t bytes) {
        const int64_t blocks = static_cast<int64_t>((bytes + state_->block_bytes() - 1) / state_->block_bytes());
        state_->set_capacity(std::max<int64_t>(1, state_->capacity() - blocks));
    }
    std::shared_ptr<const ds4::cuda_weights> w_;
    std::shared_ptr<const ds4::cuda_weights> mtp_;     // load_mtp (null without)
    std::shared_ptr<const ds4::cuda_weights> dspark_;  // load_dspark (null without)
    // The sequences share one prefill scratch: their evaluations run under the engine's forward mutex.
    std::shared_ptr<ds4::cuda_prefill_pool> prefill_ = ds4::cuda_make_prefill_pool();
    std::shared_ptr<cuda::block_pool> state_;  // the sequences' compressed and indexer rows
    std::shared_ptr<sequence_registry> reg_ = std::make_shared<sequence_registry>();
    std::string name_;
    ds4::hparams hp_;
    kv_precision kv_;
    int64_t n_ctx_, prefill_chunk_;
    bool graphs_;
    ds4::qat_mode qat_;
};

}  // namespace

std::unique_ptr<ds4_gpu> make_ds4_gpu(const ds4::model &m, const ds4_gpu_options &o) {
    ds4::cuda_run_options co;
    co.device = o.ordinal;
    co.qat = o.qat;
    co.kv = o.kv;
    const size_t seq = ds4::cuda_sequence_bytes(m.hp, o.kv, o.n_ctx, o.prefill_chunk);
    const cuda_device_memory mem = cuda_query_memory(o.ordinal);
    if (seq + o.file_bytes > mem.free_bytes)
        throw error("device 'cuda:" + std::to_string(o.ordinal) + "' (" + mem.name + "): the weights (" +
                    std::to_string(o.file_bytes >> 20) + " MiB) and one " + std::to_string(o.n_ctx) +
                    "-token context (" + std::to_string(seq >> 20) + " MiB) exceed its " +
                    std::to_string(mem.free_bytes >> 20) + " MiB free; lower --ctx or use more devices");
    std::shared_ptr<const ds4::cuda_weights> w = ds4::cuda_upload(m, co, o.progress);
    // The sessions' rows: the free memory now, less one more sequence's fixed state and the prefill
    // scratch (allocated with the first session) and a 1 GiB margin for the sessions' own allocations.
    const size_t fixed = seq - ds4::cuda_row_bytes(m.hp, o.kv, o.n_ctx), margin = size_t{1} << 30;
    const size_t free_now = cuda_query_memory(o.ordinal).free_bytes;
    std::shared_ptr<cuda::block_pool> state =
        ds4::cuda_make_state_pool(*w, free_now > fixed + margin ? free_now - fixed - margin : 1);
    return std::make_unique<cuda_gpu>(std::move(w), std::move(state), mem.name, m.hp, o);
}

}  // namespace fathom::ds4_detail
