// The DSpark drafter (models/deepseek4_dspark.h; spec section 7; normative:
// ../shared/golden/ds4-tiny-dspark/README.md) on the target's CUDA device, for speculative decoding next to
// a cuda_sequence that captures the drafter's features (cuda_sequence::set_feature_layers).
//
// The block is the CPU's dspark_draft: the context rows' main_x = RMSNorm(W_fc . feat; hidden_norm), the
// block [seed, noise x (B-1)] embedded with the target's table, n_stages DS4 blocks whose attention lets
// every block row see every context row and every block row (keys = values: each stage's W_kv rows of
// main_x at the context positions, of the block rows at S..S+B-1), the drafter's HC head and final norm, the
// target's output head (base logits), the rank-r Markov correction chained left to right from the seed and
// the confidence head. What differs is where the work goes:
//   - a context row's K/V rows depend on its position's features only, so they are computed once, when the
//     target hands the features over (observe), into one position-indexed ring per stage (window + B +
//     ds4::max_rollback + 1 rows: a rollback of up to max_rollback positions finds the rows before it
//     intact, as the target's raw ring does); a draft then projects only its B block rows;
//   - the block's attention is the decode attention kernel over the stage's ring with the key span ending
//     at the block's last row (S + B - 1) for every query row, its inverse RoPE done after it at each
//     row's own position S + j;
//   - the Markov chain runs on the device (argmax of row j -> the embedding row of row j + 1), so one
//     draft is one enqueue and one download of B tokens and B confidences.
// Numerics: the decode kernels' (f32 activations against the weights' formats; the MoE's q8 activations
// with quantised experts), f32 K/V rows; within the golden tolerance of the CPU's f32 block, not its bits.
// This header has no CUDA includes.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "models/deepseek4_dspark.h"

namespace fathom::ds4 {

class cuda_weights;  // deepseek4_cuda.h

// The drafter's stages and heads on the target's device (its embedding and output head shared with
// `target`, which must hold the whole model). Throws fathom::error when a weight has no CUDA kernel, the
// block is wider than a multi-row step (16 rows) or the device lacks the memory.
std::shared_ptr<const cuda_weights> cuda_upload_dspark(const model &target_model, const dspark_weights &w,
                                                       std::shared_ptr<const cuda_weights> target);

class cuda_dspark {
  public:
    // w from cuda_upload_dspark; qat: the target's mode (full: the FP8 round trip of the stages' K/V rows).
    cuda_dspark(std::shared_ptr<const cuda_weights> w, qat_mode qat);
    ~cuda_dspark();
    cuda_dspark(const cuda_dspark &) = delete;
    cuda_dspark &operator=(const cuda_dspark &) = delete;

    const dspark_config &config() const;
    int64_t feature_dim() const;
    // The target evaluated positions p0 .. p0 + n - 1 with these features [n, feature_dim()]: their K/V rows
    // enter the rings (only the last `window` of them can ever be read, so only those are computed).
    void observe(int64_t p0, std::span<const float> features);
    // The target dropped positions >= n; reset: every position.
    void truncate(int64_t n);
    void reset();
    // One block after S positions with seed_token at position S. The context is the longest run of
    // observed positions ending at S - 1, at most `window` long (none: the block attends to itself only).
    // markov_inputs: empty = the greedy chain, else B ids (teacher forcing, as dspark_draft). with_logits:
    // fill base_logits, corrected_logits and hc_head_out too (tests, `fathom logits`); otherwise only
    // seed_pos, ctx_positions, input_ids, markov_prev, draft_tokens and the confidences.
    dspark_block draft(int64_t S, int32_t seed_token, std::span<const int32_t> markov_inputs = {},
                       bool with_logits = false);

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

}  // namespace fathom::ds4
