// DS4 layer pipeline: each rank owns a contiguous range of blocks (their weights and their KV state)
// and the hyper-connection state X [n, n_hc, D] of a chunk crosses each range boundary over a
// dist::transport. Rank 0 is the driver: it embeds the tokens, runs its blocks, sends the state on,
// and receives the logits back from the last rank (which runs the HC head and the output head).
// Every rank runs the same CPU code as ds4::forward on its range, so the logits of a pipeline equal
// the unsplit forward bit for bit.
//
// Wire protocol per chunk (rank r -> r+1), every message sized from the header:
//   header int64[4] = {op, n, logits_mode, n_past}   op: 1 forward, 2 reset, 3 stop (never 0)
//   tokens int32[n], positions int64[n], state f32[n * n_hc * D]      (op == forward only)
// and last rank -> rank 0: logits f32[n * n_vocab] (mode all) or f32[n_vocab] (mode last).
// Errors: any failure (a peer's death, a timeout, a bad message) throws a one-line fathom::error on the
// rank that sees it and aborts that rank's transport, so the others fail fast too. The ranks' states
// then disagree: a pipeline that threw must be torn down, not reused.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dist/transport.h"
#include "models/deepseek4.h"

namespace fathom::ds4 {
class cuda_weights;  // models/cuda/deepseek4_cuda.h (CUDA builds only)
}

namespace fathom::dist {

class gpu_stage;  // dist/gpu_stage.h

// Blocks [first, last) of one rank.
struct layer_range {
    int first = 0;
    int last = 0;
    int count() const { return last - first; }
};

// Validate that `ranges` tile [0, n_layer) in order, each non-empty. Throws fathom::error naming
// the offending range.
void check_ranges(const std::vector<layer_range> &ranges, int n_layer);

// Split n_layer blocks into `parts` contiguous ranges of sizes differing by at most one (earlier
// ranges take the remainder).
std::vector<layer_range> even_ranges(int n_layer, int parts);

// Where a rank evaluates its blocks: the CPU (default) or one CUDA device (ds4::cuda_sequence on the
// rank's block range: its weights and KV live on that device, the embedding on rank 0's, the heads on
// the last rank's; the HC state crosses as host f32, so the logits equal a single-device CUDA run bit
// for bit; the rank drives it through dist::gpu_stage, gpu_stage.h). CUDA needs a build with
// -DFATHOM_CUDA=ON.
struct stage_device {
    int cuda_device = -1;  // -1: CPU
    int64_t n_ctx = 0;     // CUDA: the sequence capacity (tokens)
    // CUDA: this rank's blocks already on the device (ds4::cuda_upload with the rank's block range
    // and cuda_device), shared by every pipeline of an engine so that a new sequence costs only its
    // KV state; null: the rank uploads its blocks itself.
    std::shared_ptr<const ds4::cuda_weights> weights;
    bool cuda_graphs = true;  // CUDA: replay the captured decode step (ds4::cuda_sequence use_graph)
};

class pipeline_rank {
  public:
    // `ranges[transport.rank()]` is this rank's share; ranges.size() must equal transport.size().
    pipeline_rank(const ds4::model &m, std::vector<layer_range> ranges, transport &t, ds4::qat_mode qat,
                  kv_precision kv, ds4::exec_options exec = {}, stage_device dev = {});
    ~pipeline_rank();

    // Rank 0: evaluate `tokens` at `positions` (n_past, n_past+1, ...) through every rank. `logits`
    // is empty (no logits), [n_vocab] (last token) or [n, n_vocab] (every token).
    // forward() = begin_forward() + finish_forward().
    void forward(std::span<const int32_t> tokens, std::span<const int64_t> positions, std::span<float> logits);
    // Rank 0, the two halves of forward(), so that one thread can keep several pipelines busy (the
    // DS4 engine's in-flight batches): begin_forward checks the request, runs rank 0's blocks on the
    // calling thread and sends the state on (every micro-batch of it), returning while the later
    // ranks still compute; finish_forward waits for the last rank's logits into the `logits` given to
    // begin_forward, which must stay valid until then (one rank: written by begin_forward already).
    // At most one forward is outstanding: begin_forward or reset() before finish_forward throws,
    // changing nothing, and so does finish_forward without an outstanding forward. A failure of any
    // rank surfaces in one of the two; the pipeline must then be torn down (see the banner).
    void begin_forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                       std::span<float> logits);
    void finish_forward();
    bool forward_outstanding() const { return pending_.has_value(); }
    // Rank 0: split forward()s of more than `tokens` tokens (0 = never) into micro-batches of `tokens`
    // sent down the pipeline back to back, so the stages overlap: rank r works on micro-batch k while
    // rank r + 1 works on k - 1. Only the last micro-batch asks for logits; a forward that wants every
    // token's logits is not split. The logits are the unsplit forward's bit for bit (the blocks are
    // chunk-size invariant).
    void set_micro_batch(int64_t tokens);
    // Rank 0: forward messages (pipeline protocol steps of every other rank) that forward(n tokens,
    // logits of logits_floats floats) sends: 1, or the micro-batch count.
    int64_t forward_messages(size_t n, size_t logits_floats) const;
    // Rank 0: forget the sequence on every rank (fresh KV state, n_past 0).
    void reset();
    // Rank 0: tell every other rank to leave serve().
    void stop();
    // Ranks > 0: handle messages from the previous rank until stop. On any error the rank aborts its
    // transport (so its peers fail fast instead of waiting) and rethrows.
    void serve();
    // Ranks > 0: handle exactly one message of rank 0's (forward, reset or stop; false after stop), with
    // serve()'s error handling. A rank process serving several sessions runs one step per session
    // turn (src/dist/rank_procs.h).
    bool serve_one();

    int rank() const { return rank_; }
    int64_t n_past() const { return n_past_; }
    const layer_range &range() const { return ranges_[static_cast<size_t>(rank_)]; }

  private:
    void run_layers(std::span<const int32_t> tokens, std::span<const int64_t> positions, std::span<float> x);
    void send_on(const int64_t *hdr, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                 std::span<const float> x);
    void fresh_state();

    const ds4::model &m_;
    std::vector<layer_range> ranges_;
    transport &t_;
    int rank_ = 0;
    ds4::qat_mode qat_;
    kv_precision kv_;
    ds4::exec_options exec_;
    std::vector<ds4::layer_state> layers_;  // states of this rank's blocks only (CPU)
    int64_t n_past_ = 0;
    int64_t micro_batch_ = 0;  // rank 0: set_micro_batch
    // Rank 0, between begin_forward and finish_forward: where the last rank's logits go (empty: nothing
    // comes back, i.e. no logits asked, no tokens, or one rank that computed them itself).
    std::optional<std::span<float>> pending_;
    stage_device dev_;
    std::unique_ptr<gpu_stage> gpu_;  // CUDA stage (dev_.cuda_device >= 0; gpu_stage.h), else null
    // CUDA: run this rank's blocks (embedding on rank 0, heads on the last rank) over the chunk.
    void gpu_layers(std::span<const int32_t> tokens, std::span<const int64_t> positions, std::span<float> x,
                    std::span<float> logits);
};

}  // namespace fathom::dist

namespace fathom::dist {

// A whole pipeline inside one process: ranks 1.. run serve() on their own threads over an
// inprocess_hub (host-memory hand-off of the HC state); the caller drives rank 0. Used by the DS4
// engine's --devices (one pipeline per session; src/engine/ds4_engine.cpp) and by the CPU tests.
// The destructor stops and joins the threads.
class local_pipeline {
  public:
    // Every rank on the CPU with the reference exec options (no thread pool).
    local_pipeline(const ds4::model &m, std::vector<layer_range> ranges, ds4::qat_mode qat, kv_precision kv,
                   std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
    // Rank r evaluates on devices[r] (devices.size() == ranges.size()); CPU ranks use `exec`. The
    // ranks are built on the calling thread (a CUDA stage allocates its sequence there); a rank that
    // cannot be built throws here, before any thread starts. `exec.pool` may be shared by the ranks
    // (and by other pipelines): its callers take turns, one job at a time. A forward without logits,
    // or a submit, returns once rank 0 has sent its state on, while the later ranks still compute.
    local_pipeline(const ds4::model &m, std::vector<layer_range> ranges, ds4::qat_mode qat, kv_precision kv,
                   ds4::exec_options exec, std::vector<stage_device> devices,
                   std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
    ~local_pipeline();
    local_pipeline(const local_pipeline &) = delete;
    local_pipeline &operator=(const local_pipeline &) = delete;
    // As pipeline_rank::forward / reset on rank 0; an error on any rank surfaces here.
    void forward(std::span<const int32_t> tokens, std::span<const int64_t> positions, std::span<float> logits);
    // As pipeline_rank::begin_forward / finish_forward on rank 0 (forward() is submit + collect): submit
    // returns once rank 0 has sent its state on, so the caller can submit to other pipelines (other
    // sequences) while this one's later ranks compute; collect waits for the logits. One outstanding
    // submit per pipeline; `logits` must stay valid until collect. Destroying the pipeline with a
    // submit outstanding is safe (its logits are dropped).
    void submit(std::span<const int32_t> tokens, std::span<const int64_t> positions, std::span<float> logits);
    void collect();
    void reset();
    void set_micro_batch(int64_t tokens);  // pipeline_rank::set_micro_batch on rank 0
    int64_t n_past() const;

    struct impl;

  private:
    std::unique_ptr<impl> p_;
};

}  // namespace fathom::dist
