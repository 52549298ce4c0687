// A DS4 session's own drafter for speculative decoding (engine_options::ds4_draft): the model's MTP head
// or a DSpark drafter, fed from the target's steps. Owned by one session on one CPU device; every call
// runs under the engine's forward mutex (the drafters' products use the engine's thread pool).
//
// The session reports every forward (observe: the rows it appended, with their final HC states or
// capture-layer features), every rollback (truncate) and every reset; draft() then proposes up to `max`
// tokens to follow the pending token. Drafts are greedy (argmax), so the speculation loop's acceptance
// rule (every position sampled from the target's own logits, drafts kept while they match) keeps
// plain decoding's output distribution, and its exact tokens under batch-invariant numerics.
//
//   MTP    The head (deepseek4_mtp.h) keeps its own window-only KV history, one row per target position
//          i made from (target HC state at i, token i+1). observe() runs the rows whose next token is
//          known; draft() runs row n-1 with the pending token, then chains the head on its own output
//          state and drafted token, and rolls its KV back to the n true rows.
//   DSpark One draft block (deepseek4_dspark.h) from the pending token over the last `window` positions,
//          whose stage K/V rows are made once, as their features come (ds4::dspark_context: position-
//          indexed rings on the CPU, ds4::cuda_dspark's on one GPU).
// After a state load (the prompt cache) neither has the history of the loaded positions: the MTP head
// restarts its rows there and DSpark drafts from the features it has; drafts are guesses either way
// and only the acceptance rate suffers.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_mtp.h"

namespace fathom {
namespace ds4 {
class cuda_weights;  // models/cuda/deepseek4_cuda.h
}

class ds4_drafter {
  public:
    virtual ~ds4_drafter() = default;
    // What the target's step must capture for this drafter (ds4::step_extras).
    virtual bool wants_hc_state() const = 0;
    virtual std::span<const int> feature_layers() const = 0;
    // Rows at the end of a long prompt the drafter can use (the rest cannot change a draft): a GPU target
    // hands over the states / features of that many rows only.
    virtual int64_t context_rows() const = 0;
    // The session now holds `held`; its last forward appended rows at positions [p0, p0 + n) with final
    // HC states hc [n, n_hc * D] (empty unless wants_hc_state) and features [n, F] (empty unless
    // feature_layers is not).
    virtual void observe(std::span<const int32_t> held, int64_t p0, std::span<const float> hc,
                         std::span<const float> features) = 0;
    // The session dropped its positions >= n (n >= 0).
    virtual void truncate(int64_t n) = 0;
    virtual void reset() = 0;
    // The session holds `held` (its last forward observed) and `pending` comes next: up to `max` tokens
    // to follow it. confidence (when not null) receives each draft's predicted probability of being
    // kept given its predecessors were (DSpark's confidence head), or is emptied (MTP: none).
    virtual std::vector<int32_t> draft(std::span<const int32_t> held, int32_t pending, int32_t max,
                                       std::vector<float> *confidence) = 0;
};

// The MTP head's rows, wherever they run (the CPU: ds4::mtp_forward; one GPU: ds4::cuda_sequence::eval_mtp,
// make_cuda_mtp_head in engine/cuda/ds4_drafter_cuda.cpp); the MTP drafter's rule (observe, draft, rollback) is written
// once over it.
class mtp_head {
  public:
    virtual ~mtp_head() = default;
    virtual int64_t n_past() const = 0;
    virtual int64_t window() const = 0;          // the block's raw window (rows a row attends to)
    virtual int64_t rollback_floor() const = 0;  // the lowest n_past truncate() reaches
    // Rows n_past, n_past + 1, ...: the target's HC states x [n, S] and the tokens after them.
    virtual void rows(std::span<const float> x, std::span<const int32_t> next) = 0;
    // One row; returns the argmax of its logits and its output state in out [S].
    virtual int32_t row(std::span<const float> x, int32_t next, std::span<float> out) = 0;
    virtual void truncate(int64_t n) = 0;
    // Forget every row and continue at position `at` (a fresh history there).
    virtual void restart(int64_t at) = 0;
};

std::unique_ptr<ds4_drafter> make_mtp_drafter(const ds4::model &target, std::shared_ptr<const ds4::mtp_weights> w,
                                              ds4::qat_mode qat, kv_precision kv, const ds4::exec_options &exec);
// The MTP drafter over any head (state_floats: n_hc * D).
std::unique_ptr<ds4_drafter> make_mtp_drafter(std::unique_ptr<mtp_head> head, size_t state_floats);
// CUDA builds only (engine/cuda/ds4_drafter_cuda.cpp): the head on the weights of ds4::cuda_upload_mtp, positions up
// to n_ctx (the target's context plus the drafts' rows).
std::unique_ptr<mtp_head> make_cuda_mtp_head(std::shared_ptr<const ds4::cuda_weights> head, int64_t n_ctx);
std::unique_ptr<ds4_drafter> make_dspark_drafter(const ds4::model &target, std::shared_ptr<const ds4::dspark_weights> w,
                                                 ds4::qat_mode qat, const ds4::exec_options &exec);
// CUDA builds only (engine/cuda/ds4_drafter_cuda.cpp): the DSpark drafter on the target's device
// (ds4::cuda_dspark over the weights of ds4::cuda_upload_dspark), fed with the features the session's
// cuda_sequence captures.
std::unique_ptr<ds4_drafter> make_cuda_dspark_drafter(std::shared_ptr<const ds4::cuda_weights> w, ds4::qat_mode qat);

}  // namespace fathom
