// The DS4 engine on one GPU, as the engine and its sessions see it (ds4_internal.h): the engine-wide
// ds4_gpu (the weights uploaded once, the prefill scratch and the state pool its sequences share, the
// device's name, the batched step) and a session's gpu_sequence (its state on the device: evaluation,
// rollback, saved states, the last logits). The engine picks this executor once at load (--device
// cuda); the engine and session code that calls it is the same in every build. The CUDA implementation
// (engine/cuda/ds4_gpu_cuda.cpp, over ds4::cuda_weights / ds4::cuda_sequence of
// models/cuda/deepseek4_cuda.h) exists only in CUDA builds; a build without CUDA gets
// engine/no_cuda/engine_no_cuda.cpp's make_ds4_gpu, which throws.
//
// gpu_sequence forwards to ds4::cuda_sequence: a capability of the device sequence the session needs
// is one more virtual here and one forwarding line in ds4_gpu_cuda.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "engine/ds4_drafter.h"
#include "models/deepseek4.h"
#include "models/deepseek4_mtp.h"

namespace fathom::ds4_detail {

// One sequence's DS4 state on the device (ds4::cuda_sequence): raw rings, compressor frontiers,
// compressed and indexer rows, the last evaluated token's logits.
class gpu_sequence {
  public:
    virtual ~gpu_sequence() = default;
    virtual int64_t n_past() const = 0;
    // Forget every token (paged state: every block back to the pool).
    virtual void reset() = 0;
    // Paged state (ds4_gpu::state_pool): map the rows of positions [0, max(n_tokens, n_past())) now, all or
    // nothing (false, nothing changed, when the pool lacks the blocks); a smaller n_tokens gives back the
    // blocks beyond. row_bytes(): the device bytes behind this sequence's rows (its mapped blocks).
    virtual bool reserve(int64_t n_tokens) = 0;
    virtual size_t row_bytes() const = 0;
    // Positions whose rows are mapped (at least n_past(); what reserve asked for, until it shrinks).
    virtual int64_t mapped_tokens() const = 0;
    // Tokens at positions n_past, n_past + 1, ...; logits empty (they stay on the device: last_logits,
    // top), [n_vocab] (the last token's) or [n * n_vocab]. More than one token: chunked prefill
    // (products rounded to bf16). Throws on a bad token or a full context (nothing evaluated), and on a
    // device-side error (the sequence is then reset).
    // hc_tail (empty or [k, n_hc * D], k <= n): the final HC states of the last k tokens (the MTP head's input).
    // features_tail (empty or [k', F]): the DSpark features of the last k' tokens (set_feature_layers).
    virtual void eval(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_tail = {},
                      std::span<float> features_tail = {}) = 0;
    // The same with plain decoding's numerics (each row bit-identical to its own decode step): a
    // speculative verification's rows. logits [n, n_vocab]; hc_out (empty or [n, n_hc * D]) every row's
    // final HC state.
    // features (empty or [n, F]) every row's DSpark features.
    // At most ds4_gpu::max_step_rows() rows (here or in step_batch): the rows' logits also stay on the device,
    // rows_held() of them, until the next evaluation, truncate or reset: row_top / row_logits as top /
    // last_logits for row j.
    virtual void eval_rows(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out = {},
                           std::span<float> features = {}) = 0;
    virtual int rows_held() const = 0;
    virtual std::optional<logits_top> row_top(size_t j, size_t k, std::span<const std::pair<int32_t, int32_t>> penalties,
                                              float repeat, float frequency, float presence) = 0;
    virtual void row_logits(size_t j, std::span<float> out) = 0;
    // Capture the DSpark drafter's features (ds4::cuda_sequence::set_feature_layers): the mean of the HC
    // streams after each of `layers`, at most max(tail_rows, 16) rows per evaluation.
    virtual void set_feature_layers(std::span<const int> layers, int64_t tail_rows) = 0;
    // Rollback: forget positions [n, n_past), free down to rollback_floor() (max_rollback below the
    // furthest evaluated position); throws outside [rollback_floor(), n_past], nothing changed.
    virtual void truncate(int64_t n) = 0;
    virtual int64_t rollback_floor() const = 0;
    // The last evaluated token's logits [n_vocab], downloaded.
    virtual void last_logits(std::span<float> out) = 0;
    // The same logits summarised on the device for sampler::sample_top: penalties applied to the
    // (token, count) pairs, softmax statistics, the best k (clamped to what the device summary
    // supports). nullopt when a NaN / +inf logit was seen (the caller samples the downloaded logits,
    // which reports them).
    virtual std::optional<logits_top> top(size_t k, std::span<const std::pair<int32_t, int32_t>> penalties,
                                          float repeat, float frequency, float presence) = 0;
    // Saved states: ds4::write_state's stream from the device; load_state replaces the state with a saved
    // one of n_past tokens (throws on any mismatch, the sequence then reset); restore_logits uploads a
    // loaded state's last logits [n_vocab].
    virtual void save_state(state_writer &w) const = 0;
    virtual void load_state(state_reader &r, int64_t n_past) = 0;
    virtual void restore_logits(std::span<const float> logits) = 0;
};

class ds4_gpu {
  public:
    virtual ~ds4_gpu() = default;
    // The device's name (model_info::device; state_identity: the kernels' launch geometry, and so a
    // few sums' order, follows its SM count).
    virtual const std::string &name() const = 0;
    // Bytes one decode step reads from the weights (model_info::decode_weight_bytes).
    virtual double bytes_per_token() const = 0;
    // A fresh sequence of n_ctx tokens sharing the engine's prefill scratch: sequences of one ds4_gpu
    // evaluate one at a time (the engine's forward mutex).
    virtual std::unique_ptr<gpu_sequence> new_sequence() const = 0;
    // Paged state: the sequences' compressed and indexer rows (what grows with a context) are blocks of
    // one pool on the device (ds4::cuda_make_state_pool), sized at load to the free memory after the
    // upload less one more sequence's fixed state and a 1 GiB margin. Counts in blocks of block_bytes.
    struct state_pool_info {
        size_t block_bytes = 0;
        int64_t capacity = 0, used = 0;
        int regions = 0;  // row regions per sequence: each maps at least one block of its own
    };
    virtual state_pool_info state_pool() const = 0;
    // The live sequences' mapped positions in blocks of block_tokens (each sequence's rounded up): what
    // the scheduler's admission counts (ds4_engine::kv_pool), not the pool's 2 MiB blocks.
    virtual int64_t mapped_blocks(int32_t block_tokens) const = 0;
    // A new capacity in blocks (at least 1; blocks in use above it stay until given back).
    virtual void set_state_capacity(int64_t blocks) = 0;
    // Bytes of the growing state of n tokens, unrounded (ds4::cuda_row_bytes).
    virtual size_t row_bytes(int64_t n_tokens) const = 0;
    // Batched step (the scheduler's decodes, or verifications side by side): the next counts[i] rows of
    // seqs[i] (this ds4_gpu's sequences; tokens: seqs[0]'s rows, then seqs[1]'s, ...; 1..max_step_rows()
    // rows in all) in one multi-row step, each row bit-identical to its own decode step. logits
    // [rows, n_vocab] (may be empty); every sequence's last logits become its last row's. Throws with
    // nothing evaluated on bad input; on a device-side error every sequence of the step is reset.
    virtual int max_step_rows() const = 0;
    // hc_out (empty or [rows, n_hc * D]): every row's final HC state (the MTP head's input).
    // features (empty or [rows, F]): every row's DSpark features (the sequences capture the same layers).
    virtual void step_batch(std::span<gpu_sequence *const> seqs, std::span<const int> counts,
                            std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out = {},
                            std::span<float> features = {}) = 0;
    // The MTP head on this device (ds4::cuda_upload_mtp: its block, sharing the embedding and output head
    // uploaded here), loaded once; new_mtp_head() a session's head over it (ds4_drafter.h), positions up
    // to n_ctx + ds4::max_rollback. Throws when no head is loaded, or a weight has no CUDA kernel.
    virtual void load_mtp(const ds4::model &m, const ds4::mtp_weights &w) = 0;
    virtual std::unique_ptr<mtp_head> new_mtp_head() const = 0;
    // The DSpark drafter on this device (ds4::cuda_upload_dspark), loaded once; new_dspark_drafter() a
    // session's drafter over it (its own context rings). Loading a drafter (MTP or DSpark) takes its bytes
    // off the state pool's capacity. Throws when none is loaded, or a weight has no CUDA kernel.
    virtual void load_dspark(const ds4::model &m, const ds4::dspark_weights &w) = 0;
    virtual std::unique_ptr<ds4_drafter> new_dspark_drafter() const = 0;
};

struct ds4_gpu_options {
    int ordinal = 0;  // the CUDA device
    ds4::qat_mode qat = ds4::qat_mode::full;
    kv_precision kv = kv_precision::f16;
    int64_t n_ctx = 0;          // a sequence's capacity
    int64_t prefill_chunk = 0;  // tokens per prefill chunk (the engine's n_batch)
    bool cuda_graphs = true;    // replay the captured decode step
    uint64_t file_bytes = 0;    // the model file's size (the memory check's bound on the weights)
    std::function<void(uint64_t, uint64_t)> progress;  // upload progress (done, total bytes); may be empty
};

// Uploads `m` to the device after checking that the weights and one n_ctx sequence fit its free memory
// (throws one line naming both sizes otherwise, before any allocation), then creates the state pool.
// Throws when the build has no CUDA backend, or the device has no virtual memory management.
std::unique_ptr<ds4_gpu> make_ds4_gpu(const ds4::model &m, const ds4_gpu_options &o);

}  // namespace fathom::ds4_detail
