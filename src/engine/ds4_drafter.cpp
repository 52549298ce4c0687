// DS4 session drafters (see ds4_drafter.h): the MTP head and the DSpark drafter behind one interface.
#include "engine/ds4_drafter.h"

#include <algorithm>

#include "core/error.h"

namespace fathom {

namespace {

int32_t argmax(std::span<const float> v) {
    return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());  // ties: the lower id
}

// Rows of `width` floats for the newest positions: position q in slot q mod slots, tagged with q so a
// row overwritten (or never written) is told from a current one.
class position_ring {
  public:
    position_ring(size_t slots, size_t width) : width_(width), rows_(slots * width), tag_(slots, -1) {}
    void put(int64_t q, const float *row) {
        const size_t s = static_cast<size_t>(q) % tag_.size();
        std::copy(row, row + width_, rows_.begin() + static_cast<std::ptrdiff_t>(s * width_));
        tag_[s] = q;
    }
    const float *get(int64_t q) const {
        if (q < 0) return nullptr;
        const size_t s = static_cast<size_t>(q) % tag_.size();
        return tag_[s] == q ? &rows_[s * width_] : nullptr;
    }
    void clear() { std::fill(tag_.begin(), tag_.end(), -1); }
    size_t slots() const { return tag_.size(); }

  private:
    size_t width_;
    std::vector<float> rows_;
    std::vector<int64_t> tag_;
};

// The MTP drafting rule over a head that runs rows on the CPU or a GPU (mtp_head).
// Lazy: observe() only keeps the target's HC states (a ring of the newest kCatchUp + max_rollback + 2
// positions); draft() first runs the head over the rows it has not seen since its last draft. A step that
// does not draft (the width paused by the cost model: an always-wrong drafter) costs the head nothing;
// before, the head ran every verified row at once, drafting or not (~30 ms of a ~70 ms step of the
// 4-block CPU bench model, a block's forward per verified row on the GPU). While drafting goes on, each
// draft catches up the rows verified since the previous one (at most max_rollback + 1), so its timed cost
// (verify_cost::observe_draft) is what drafting costs per step and the head's history is whole. After a
// pause the head resumes from at most kCatchUp rows back (its window is 128): such a draft comes from a
// shorter history than a head that never paused (a proposal only; the verification decides what is
// kept) and costs kCatchUp rows more, not a window's, so the probes that decide whether to resume are
// not priced as if drafting always cost that much.
constexpr int64_t kCatchUp = 2 * ds4::max_rollback;
class mtp_drafter final : public ds4_drafter {
  public:
    mtp_drafter(std::unique_ptr<mtp_head> head, size_t state_floats)
        : head_(std::move(head)), S_(state_floats),
          hc_(static_cast<size_t>(kCatchUp + ds4::max_rollback) + 2, S_) {
        head_->restart(0);
    }
    bool wants_hc_state() const override { return true; }
    std::span<const int> feature_layers() const override { return {}; }
    int64_t context_rows() const override { return std::min<int64_t>(kCatchUp, head_->window()) + 2; }

    // Keeps the states of positions p0 .. (hc: this forward's rows); the head runs them at the next draft.
    void observe(std::span<const int32_t> held, int64_t p0, std::span<const float> hc,
                 std::span<const float> features) override {
        (void)held;
        (void)features;
        const int64_t n = static_cast<int64_t>(hc.size() / S_);
        for (int64_t i = std::max<int64_t>(0, n - static_cast<int64_t>(hc_.slots())); i < n; ++i)
            hc_.put(p0 + i, &hc[static_cast<size_t>(i) * S_]);
    }

    void truncate(int64_t n) override {
        const int64_t keep = std::max<int64_t>(0, n - 1);  // rows i <= n - 2 have their next token
        if (head_->n_past() <= keep) return;
        if (keep >= head_->rollback_floor())
            head_->truncate(keep);
        else
            head_->restart(keep);  // deeper than its rollback reach: the head restarts its history at keep
    }
    void reset() override {
        head_->restart(0);
        hc_.clear();
    }

    std::vector<int32_t> draft(std::span<const int32_t> held, int32_t pending, int32_t max,
                               std::vector<float> *confidence) override {
        if (confidence) confidence->clear();
        const int64_t n = static_cast<int64_t>(held.size());
        if (n == 0 || max <= 0) return {};
        const float *h = hc_.get(n - 1);
        if (!h) return {};  // the target's state at n - 1 was not observed (nothing to draft from)
        if (head_->n_past() > n - 1) truncate(n);
        catch_up(held, n - 1);
        if (head_->n_past() < n - 1) head_->restart(n - 1);
        std::vector<float> x(h, h + S_), out(S_);
        std::vector<int32_t> drafts;
        int32_t tok = pending;
        // Row n - 1 (true inputs) then rows chained on the head's own output state and drafted token;
        // at most max_rollback of them, so the chain rolls back for free.
        max = std::min<int32_t>(max, static_cast<int32_t>(ds4::max_rollback));
        for (int32_t j = 0; j < max; ++j) {
            tok = head_->row(x, tok, out);
            drafts.push_back(tok);
            x.swap(out);
        }
        head_->truncate(n);  // keep the true row n - 1
        return drafts;
    }

  private:
    // The head's rows up to `end` - 1 (each: the HC state at i, token i + 1), from where it stands or
    // kCatchUp rows before `end`, whichever is later; a state the ring no longer holds (or never held: a
    // loaded state) starts the head's history after it.
    void catch_up(std::span<const int32_t> held, int64_t end) {
        const int64_t from = end - std::min<int64_t>(kCatchUp, head_->window());
        if (head_->n_past() < from) head_->restart(from);
        for (int64_t q = end - 1; q >= head_->n_past(); --q)
            if (!hc_.get(q)) {
                head_->restart(q + 1);
                break;
            }
        std::vector<float> x;
        std::vector<int32_t> next;
        for (int64_t i = head_->n_past(); i < end; ++i) {
            const float *row = hc_.get(i);
            x.insert(x.end(), row, row + S_);
            next.push_back(held[static_cast<size_t>(i + 1)]);
        }
        if (!next.empty()) head_->rows(x, next);
    }

    std::unique_ptr<mtp_head> head_;
    size_t S_;
    position_ring hc_;  // the target's final HC states of the newest positions
};

// The head on the CPU (ds4::mtp_forward over ds4::mtp_state).
class cpu_mtp_head final : public mtp_head {
  public:
    cpu_mtp_head(const ds4::model &m, std::shared_ptr<const ds4::mtp_weights> w, ds4::qat_mode qat, kv_precision kv,
                 const ds4::exec_options &exec)
        : m_(m), w_(std::move(w)), qat_(qat), kv_(kv), exec_(exec), logits_(static_cast<size_t>(m.hp.n_vocab)) {}
    int64_t n_past() const override { return st_.n_past; }
    int64_t window() const override { return m_.hp.window; }
    int64_t rollback_floor() const override { return std::max<int64_t>(0, st_.reached - ds4::max_rollback); }
    void rows(std::span<const float> x, std::span<const int32_t> next) override {
        std::vector<int64_t> pos(next.size());
        for (size_t i = 0; i < pos.size(); ++i) pos[i] = st_.n_past + static_cast<int64_t>(i);
        ds4::mtp_observe(m_, *w_, st_, x, next, pos);
    }
    int32_t row(std::span<const float> x, int32_t next, std::span<float> out) override {
        const int64_t p = st_.n_past;
        ds4::mtp_forward(m_, *w_, st_, x, std::span<const int32_t>(&next, 1), std::span<const int64_t>(&p, 1), logits_, out);
        return argmax(logits_);
    }
    void truncate(int64_t n) override { ds4::mtp_truncate(st_, n); }
    void restart(int64_t at) override {
        st_ = ds4::new_mtp_state(m_, *w_, qat_, kv_);
        st_.exec = exec_;
        st_.n_past = st_.reached = at;
    }

  private:
    const ds4::model &m_;
    std::shared_ptr<const ds4::mtp_weights> w_;
    ds4::qat_mode qat_;
    kv_precision kv_;
    ds4::exec_options exec_;
    ds4::mtp_state st_;
    std::vector<float> logits_;
};

class dspark_drafter final : public ds4_drafter {
  public:
    dspark_drafter(const ds4::model &m, std::shared_ptr<const ds4::dspark_weights> w, ds4::qat_mode qat,
                   const ds4::exec_options &exec)
        : m_(m), w_(std::move(w)), qat_(qat), exec_(exec), ctx_(ds4::new_dspark_context(*w_)) {}
    bool wants_hc_state() const override { return false; }
    std::span<const int> feature_layers() const override { return w_->cfg.target_layers; }
    int64_t context_rows() const override { return w_->cfg.window; }

    // Each observed position's K/V rows go into the context rings at once (ds4::dspark_context), so a draft
    // computes its block rows only.
    void observe(std::span<const int32_t> held, int64_t p0, std::span<const float> hc,
                 std::span<const float> features) override {
        (void)held, (void)hc;
        ds4::dspark_observe(*w_, qat_, exec_, ctx_, p0, features);
    }
    void truncate(int64_t n) override { ds4::dspark_truncate(ctx_, n); }
    void reset() override { ds4::dspark_truncate(ctx_, 0); }

    std::vector<int32_t> draft(std::span<const int32_t> held, int32_t pending, int32_t max,
                               std::vector<float> *confidence) override {
        if (confidence) confidence->clear();
        if (max <= 0) return {};
        // The context: the longest run of observed positions ending at held.size() - 1, at most `window`.
        const ds4::dspark_block b =
            ds4::dspark_draft_at(m_, *w_, qat_, exec_, ctx_, static_cast<int64_t>(held.size()), pending);
        std::vector<int32_t> d = b.draft_tokens;
        if (static_cast<int64_t>(d.size()) > max) d.resize(static_cast<size_t>(max));
        if (confidence) confidence->assign(b.confidence.begin(), b.confidence.begin() + static_cast<std::ptrdiff_t>(d.size()));
        return d;
    }

  private:
    const ds4::model &m_;
    std::shared_ptr<const ds4::dspark_weights> w_;
    ds4::qat_mode qat_;
    ds4::exec_options exec_;
    ds4::dspark_context ctx_;  // each stage's K/V rows of the newest positions
};

}  // namespace

std::unique_ptr<ds4_drafter> make_mtp_drafter(const ds4::model &target, std::shared_ptr<const ds4::mtp_weights> w,
                                              ds4::qat_mode qat, kv_precision kv, const ds4::exec_options &exec) {
    if (!w) throw error("ds4 drafter: no MTP weights");
    return make_mtp_drafter(std::make_unique<cpu_mtp_head>(target, std::move(w), qat, kv, exec),
                            static_cast<size_t>(target.hp.n_hc) * static_cast<size_t>(target.hp.n_embd));
}

std::unique_ptr<ds4_drafter> make_mtp_drafter(std::unique_ptr<mtp_head> head, size_t state_floats) {
    if (!head) throw error("ds4 drafter: no MTP head");
    return std::make_unique<mtp_drafter>(std::move(head), state_floats);
}

std::unique_ptr<ds4_drafter> make_dspark_drafter(const ds4::model &target, std::shared_ptr<const ds4::dspark_weights> w,
                                                 ds4::qat_mode qat, const ds4::exec_options &exec) {
    if (!w) throw error("ds4 drafter: no DSpark weights");
    return std::make_unique<dspark_drafter>(target, std::move(w), qat, exec);
}

}  // namespace fathom
