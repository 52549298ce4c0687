// Tensor + expert parallel DS4 (the planner's "tp" layout, docs/dist.md): P ranks each hold the full
// hyper-connection state and run every block; per sublayer each rank computes a partial [n, D] output
// from its share of the weights, and one all-reduce (src/dist/collective.h) gives every rank the sum
// before HCPost:
//   attention: q_a, kv, compressors, indexer and the KV state replicated (MQA: one shared K=V row that
//              every head reads); q_b rows / heads H/P, output groups G/P (rows of o_a, the matching
//              column block of o_b) split by rank;
//   MoE:       router replicated (same routing on every rank); rank r runs the routed experts it owns
//              (experts_first .. +count, the planner's split) for the tokens routed to them, plus its
//              F/P slice of the shared expert (rows of gate/up, the column block of down).
// Every rank reads its rows/columns through views into the same loaded weights (ds4::matrix_rows /
// matrix_cols): no copies. Rank 0 drives: it sends the tokens to every rank, runs its own share, and
// computes the output head alone (the HC state is replicated, so it has everything).
//
// Numerics: the all-reduce sums partial outputs, so P > 1 matches the single-rank forward within f32
// rounding (not bit for bit); P = 1 is the single-rank forward bit for bit. The all-reduce gives every
// rank identical bits, so the replicated HC and KV states stay identical across ranks (hc_states()).
//
// Wire protocol (rank 0 -> every rank r > 0, in this order):
//   header int64[4] = {op, n, 0, n_past}   op: 1 forward, 2 reset, 3 stop, 4 send your HC state (never 0)
//   forward: tokens int32[n], positions int64[n]; then, per block, two all_reduce_sum of f32[n * D]
//   state:   rank r -> 0: int64 count, f32[count] (its HC state after the last forward)
// Errors: as the pipeline (pipeline.h): the rank that fails aborts its transport with a one-line reason,
// every other rank's wait ends at once, and rank 0's forward throws; a failed tp group must be torn down.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "dist/transport.h"
#include "models/deepseek4.h"
#include "models/deepseek4_impl.h"

namespace fathom::dist {

// Rank `rank` of `size`: heads, output groups and shared-expert width split into `size` contiguous equal
// parts (rank order), routed experts dealt out as the planner's tp layout (planner.cpp tp_device: the
// first E mod P ranks own one more). Throws one line when size does not divide the heads, the output
// groups or the shared-expert width, or is out of range.
ds4::tp_slice tp_share(const ds4::hparams &hp, int rank, int size);

// tp_share for every rank, and every block's column views (attn_output_b, ffn_down_shexp) on their
// quantisation-block boundaries (row splits are always aligned). Throws one line naming the first
// tensor that cannot be split `size` ways.
void tp_check(const ds4::model &m, int size);

// One tensor-parallel rank over a transport of `size` ranks.
class tp_rank {
  public:
    tp_rank(const ds4::model &m, transport &t, ds4::qat_mode qat, kv_precision kv,
            ds4::exec_options exec = {});

    // Rank 0: evaluate `tokens` at `positions` (n_past, n_past+1, ...) on every rank. `logits` is empty,
    // [n_vocab] (last token) or [n, n_vocab] (every token). Arguments are checked before anything is
    // sent (a bad call leaves the ranks usable); a failure after that aborts the transport.
    void forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                 std::span<float> logits);
    void reset();  // rank 0: fresh KV state on every rank
    void stop();   // rank 0: every other rank leaves serve()
    void serve();  // ranks > 0: handle rank 0's messages until stop; aborts the transport on any error
    bool serve_one();  // ranks > 0: exactly one of rank 0's messages (false after stop), as serve()
    // Rank 0: [rank] that rank's HC state [n, n_hc, D] after the last forward (empty before any).
    std::vector<std::vector<float>> hc_states();

    int rank() const { return rank_; }
    int64_t n_past() const { return n_past_; }
    const ds4::tp_slice &slice() const { return tp_.slice; }

  private:
    void run(std::span<const int32_t> tokens, std::span<const int64_t> positions);
    void send_all(const int64_t *hdr);
    void fresh_state();

    const ds4::model &m_;
    transport &t_;
    int rank_ = 0;
    ds4::qat_mode qat_;
    kv_precision kv_;
    ds4::exec_options exec_;
    ds4::tp_block tp_;                      // this rank's slice + the all-reduce over t_
    std::vector<ds4::layer_state> layers_;  // every block's state (replicated)
    std::vector<float> x_;                  // HC state [n, n_hc, D] of the last forward
    int64_t n_past_ = 0;
};

// All P ranks in one process: ranks 1.. serve() on their own threads over an inprocess_hub, the caller
// drives rank 0 (the tests; the engine's --devices with the tp layout). The ranks compute concurrently,
// so `exec.pool` serves rank 0 only (the others run without a pool; a pool is not re-entrant).
// The destructor stops and joins the threads.
class local_tp {
  public:
    // Throws (tp_check) before any thread starts when `size` ranks cannot split the model.
    local_tp(const ds4::model &m, int size, ds4::qat_mode qat, kv_precision kv, ds4::exec_options exec = {},
             std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
    ~local_tp();
    local_tp(const local_tp &) = delete;
    local_tp &operator=(const local_tp &) = delete;
    void forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                 std::span<float> logits);
    void reset();
    int64_t n_past() const;
    int size() const;
    std::vector<std::vector<float>> hc_states();  // see tp_rank::hc_states
    const ds4::tp_slice &slice(int rank) const;

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

}  // namespace fathom::dist
