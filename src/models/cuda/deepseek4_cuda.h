// DS4 (DeepSeek V4 Flash) on one CUDA device: the weights of a ds4::model uploaded once
// (cuda_weights), and a sequence's evaluation state on the device with the decode step as one chain
// of kernel launches (cuda_sequence). The step reads the token id and its position from device
// memory, so it is captured once as a CUDA graph and replayed at every position (raw-ring wrap and
// compressed-row boundaries included: every position-derived count is computed on the device).
//
// Semantics are the CPU reference's (src/models/deepseek4_*.cpp, spec
// ../shared/reference/ds4-architecture.md): the same layer order, HC mixers with Sinkhorn, the raw
// ring + compressors (ratio 4 overlap / 128), the indexer's exact top-k, sink attention with inverse
// RoPE, grouped output projection, MoE with hash / biased routing, QAT round trips. Matrix products
// take f32 activations against the weights' own formats (no requantisation of activations).
//
// Sparse synthetic files (fathom-gguf synth --sparse, key fathom.synth.replicate_rows = P): tensors
// with more than P rows hold rows 0..P-1 and a file hole; upload() fills row r with row r mod P on the
// device, so the full DS4-Flash geometry (~81 GB in the q2 mix) is benchmarked from a file of a few
// GB. This header has no CUDA includes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/types.h"
#include "fathom/kv_precision.h"
#include "fathom/state_stream.h"
#include "models/deepseek4.h"
#include "models/deepseek4_mtp.h"

namespace fathom::cuda {
class block_pool;  // backend/cuda/cuda_vmm.h
}

namespace fathom::ds4 {

struct cuda_run_options {
    int device = 0;
    qat_mode qat = qat_mode::full;
    kv_precision kv = kv_precision::f16;  // raw ring, compressed and indexer rows
    // The indexer's row scores: false (default) on tensor cores (f16 rows exact, queries split into f16
    // hi + lo, f32 sums: ~1e-6 relative, so a near-tie may select the other row; ~4x less time at 128K);
    // true in the CPU reference's exact order (double sums), so selections equal the CPU's.
    bool exact_indexer = false;
    // Pipeline stages (src/dist): only blocks [first_layer, last_layer) live on this device (-1: all
    // of them); the embedding is uploaded only with block 0, the HC head and output head only with
    // the last block.
    int first_layer = 0, last_layer = -1;
    // Test switches of the decode step (serial step, branch delays): cuda_testing::cuda_test_options
    // (deepseek4_cuda_testing.h).
};

class cuda_weights;
namespace cuda_testing {
struct access;  // deepseek4_cuda_testing.cpp
}

// Upload every tensor of `m` to the device (m and its mapping may be released afterwards).
// `progress(done, total)` reports bytes. Throws fathom::error before allocating when the device does
// not have the memory (weights + a 1 GiB margin), naming both sizes.
std::shared_ptr<const cuda_weights> cuda_upload(const model &m, const cuda_run_options &o,
                                                const std::function<void(uint64_t, uint64_t)> &progress = {});
// The MTP head (deepseek4_mtp.h) on the target's device, for drafting: its block uploaded as a one-block
// model whose step mixes its input - stream s = e_proj(RMSNorm(embed(t_(i+1)))) + h_proj(RMSNorm(stream s of
// the target's final HC state at i)) - instead of embedding a token; the embedding and output head are the
// target's device copies (not uploaded again). A cuda_sequence over these weights evaluates one row per
// eval_mtp. Throws fathom::error when `target` is not a whole model or a weight has no CUDA kernel.
std::shared_ptr<const cuda_weights> cuda_upload_mtp(const model &main, const mtp_weights &w,
                                                    std::shared_ptr<const cuda_weights> target);
// Bytes of weights on the device, and the bytes one decode step reads (every dense weight, the
// selected experts of every layer, the output head): the numerator of the roofline.
size_t cuda_weight_bytes(const cuda_weights &w);
double cuda_bytes_per_token(const cuda_weights &w);

// Tokens per prefill chunk by default: eval() of n > 1 tokens runs them layer-major in chunks of
// this many (every token of a chunk through a layer before the next layer).
constexpr int64_t default_prefill_chunk = 4096;

// Device bytes a sequence of n_ctx tokens needs (KV rows, compressor frontiers, decode scratch, and
// the scratch of prefill chunks of prefill_chunk tokens).
size_t cuda_sequence_bytes(const hparams &hp, kv_precision kv, int64_t n_ctx,
                           int64_t prefill_chunk = default_prefill_chunk);

// Prefill-chunk scratch shared by the sequences of one engine (~4 GB at DS4-Flash with chunks of 4096
// tokens, against ~6.9 KB per token of state): a sequence given a pool takes a scratch from it for each
// multi-token evaluation and gives it back afterwards, so S sequences hold one scratch instead of S. The
// sequences must not evaluate concurrently with each other more than the pool holds scratches (the engine's
// forward mutex serialises them: one). Without a pool a sequence owns its scratch.
class cuda_prefill_pool;
std::shared_ptr<cuda_prefill_pool> cuda_make_prefill_pool();

// Paged state (backend/cuda/cuda_vmm.h). What grows with a sequence's context - the compressed KV rows
// of every compressed layer and the indexer rows of the ratio-4 layers, ~6.9 KB per token at DS4-Flash -
// can live in physical blocks (2 MiB) of one pool that the sequences of an engine share: each sequence
// reserves address space for its whole context and maps blocks as it grows (cuda_sequence::reserve), so S
// sequences use the memory their tokens need, not S full contexts, and the pool's count of blocks in use is
// the real memory behind every sequence's rows. What does not grow (raw rings, compressor frontiers,
// decode and multi-row scratch, ~10 MB at DS4-Flash) stays a sequence's own allocation.
// cuda_make_state_pool: a pool on the weights' device of at most max_bytes (0: the device's free memory
// now, less a 2 GiB margin for the scratch that sequences allocate later). Throws fathom::error when the
// device has no virtual memory management.
std::shared_ptr<cuda::block_pool> cuda_make_state_pool(const cuda_weights &w, size_t max_bytes = 0);
// Bytes of the growing state (compressed and indexer rows) of n tokens, unrounded: n times about 6.9 KB at
// DS4-Flash.
size_t cuda_row_bytes(const hparams &hp, kv_precision kv, int64_t n);
// Row regions a sequence maps (one per kind: the compressed rows of each ratio, the ratio-4 layers'
// indexer rows); a paged sequence holds at least one state block per region.
int cuda_row_regions(const hparams &hp);

class cuda_sequence {
  public:
    // Allocates the state for up to n_ctx tokens (fathom::error when the device lacks the memory).
    // use_graph: replay the captured decode step (default) instead of launching it eagerly.
    // prefill_chunk: eval() / eval_stage() of more than one token run them as chunks of up to this
    // many tokens, layer-major (ds4_prefill.h: batched matrix products, compressors, indexer and
    // attention); 0 evaluates every token as a decode step (token-serial, the reference path).
    // pool: share prefill scratch with the engine's other sequences (see cuda_prefill_pool); the
    // constructor's memory check then counts only the sequence's own bytes (cuda_sequence_bytes with
    // prefill_chunk 0).
    // state_pool: the compressed and indexer rows in blocks of that pool (paged state, above), mapped on
    // demand; the memory check then leaves the rows out too. Without one they are allocated for n_ctx.
    cuda_sequence(std::shared_ptr<const cuda_weights> w, int64_t n_ctx, bool use_graph = true,
                  int64_t prefill_chunk = default_prefill_chunk, std::shared_ptr<cuda_prefill_pool> pool = {},
                  std::shared_ptr<cuda::block_pool> state_pool = {});
    ~cuda_sequence();
    cuda_sequence(const cuda_sequence &) = delete;
    cuda_sequence &operator=(const cuda_sequence &) = delete;

    int64_t n_past() const { return n_past_; }
    int64_t n_ctx() const { return n_ctx_; }
    // Paged state: map the rows of positions [0, max(n_tokens, n_past())) now, so that evaluations up to
    // n_tokens positions need no more blocks; a smaller n_tokens gives back the blocks mapped beyond
    // max(n_tokens, n_past()). All or nothing: false, changing nothing, when the pool lacks the blocks.
    // Without a state pool: true (the whole context's rows are allocated). Every evaluation (and
    // load_state, fill_synthetic) maps what it needs itself and throws fathom::error, with nothing
    // evaluated, when the pool is exhausted; reset() gives every block back.
    bool reserve(int64_t n_tokens);
    bool paged() const;
    // Device bytes behind this sequence's rows: its mapped blocks (paged), else the whole context's rows.
    size_t row_bytes() const;
    // Positions whose rows are mapped (paged: reserve / evaluations, at least n_past), else n_ctx.
    int64_t mapped_tokens() const;
    const hparams &hp() const;
    // Forget every token (clears rings, frontiers and rows on the device).
    void reset();
    // Evaluate tokens at positions n_past, n_past + 1, ...; logits: empty, [n_vocab] (the last
    // token's) or [n * n_vocab] (every token's). More than one token: chunked prefill (see the
    // constructor's prefill_chunk), whose products are bf16 x bf16 -> f32 instead of the decode
    // GEMVs' f32 activations: logits agree with token-serial evaluation to bf16 precision. Throws on a token outside the vocabulary or past
    // n_ctx (nothing evaluated), and on a device-side error (the sequence is then reset).
    // hc_tail (empty or [k, n_hc * D], k <= tokens.size()): the final HC states (before the HC head) of the
    // last k tokens, what the MTP head drafts from (eval_mtp). features_tail (empty or [k', F], k' <=
    // min(tokens.size(), the tail_rows of set_feature_layers)): the DSpark features of the last k' tokens.
    void eval(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_tail = {},
              std::span<float> features_tail = {});
    // A pipeline stage (weights uploaded for a block range): x [n, n_hc * D] is the HC state entering
    // the range (ignored when the range starts at block 0: the tokens are embedded here) and, unless
    // the range ends with the last block, receives the state leaving it. logits as in eval() (only
    // when the range ends with the last block). Token ids are needed by every stage (hash routing).
    void eval_stage(std::span<const int32_t> tokens, std::span<float> x, std::span<float> logits);
    // Rows of this sequence (positions n_past, n_past + 1, ...) in multi-row steps of up to
    // cuda::ds4::gemv_max_rows (16) rows, with plain decoding's numerics: every row's logits bit-identical
    // to evaluating it alone by a decode step (batch invariance), where eval()'s chunked prefill would
    // round products to bf16: what a speculative verification needs. The dense products read each weight
    // once for all the rows of a step; a graph is captured per row count and replayed. logits [n, n_vocab]
    // (every row's; may be empty), hc_out [n, n_hc * D] (the final HC state of every row before the HC
    // head, the MTP head's input; may be empty), features [n, F] (every row's DSpark features; may be
    // empty). Throws as eval(); on a device-side error the sequence is reset.
    // At most cuda::ds4::gemv_max_rows rows: every row's logits also stay on the device (rows_held(),
    // row_top, row_logits) until the next evaluation, truncate or reset.
    void eval_rows(std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out = {},
                   std::span<float> features = {});
    // The rows of the last eval_rows (or step_batch) that kept them: row j's logits summarised on the
    // device as logits_top does (row_top) or downloaded (row_logits, [n_vocab]). Throw for j >= rows_held().
    int rows_held() const { return rows_held_; }
    // The DSpark drafter's target features (deepseek4_dspark.h, spec 7): from now on every evaluation
    // computes, for each row, the mean of the n_hc streams of the state after each of `layers` (block
    // indices of the model, in feature order; F = layers.size() * n_embd floats a row, the bits of the
    // CPU's ds4::dspark_capture), and hands them out where its features buffer asks; at most
    // max(tail_rows, 16) rows per evaluation. Empty layers: no capture (the default). Drops the captured
    // graphs. Throws fathom::error for a block outside the model or a pipeline stage.
    void set_feature_layers(std::span<const int> layers, int64_t tail_rows);
    // Rollback (the CPU state's ds4::truncate): forget positions [n, n_past). The raw ring keeps
    // ds4::max_rollback rows more than the window and the compressor frontiers max_rollback slots more
    // than a block reads, all indexed by position, so the rows of positions < n are intact and nothing
    // is re-evaluated; compressed and indexer rows are counted from the position on the device. Allowed
    // down to rollback_floor(): max_rollback positions below the furthest evaluated one (reached since
    // the last reset or load), not below a loaded state's start. Throws fathom::error (nothing changed)
    // outside [rollback_floor(), n_past]. The last logits are dropped unless n == n_past.
    void truncate(int64_t n);
    int64_t rollback_floor() const;
    // Window-only models (every block ratio 0: the MTP head): forget every row and continue at position n as
    // if the positions before had zero rows, as the CPU head's restart does (ds4_drafter.cpp). Throws
    // fathom::error for a model with compressed blocks or n outside [0, n_ctx].
    void restart_at(int64_t n);
    // The MTP head's row n_past (weights from cuda_upload_mtp; every other evaluation refuses them): hc
    // [n_hc * D] the target's final HC state at position n_past, next_token the token at n_past + 1. Returns
    // the argmax of the head's logits (the drafted token at n_past + 2; ties: lower id); logits (empty or
    // [n_vocab]) and hc_out (empty or [n_hc * D]: the block's output state before the head's HC collapse, a
    // chained row's hc) on request. Replayed from one captured graph like the decode step; truncate() rolls
    // the head's window-only history back.
    int32_t eval_mtp(int32_t next_token, std::span<const float> hc, std::span<float> logits = {},
                     std::span<float> hc_out = {});
    // Rows n_past, n_past + 1, ..: their effect on the head's state alone (ds4::mtp_observe's device form: each
    // row's KV row into the ring, bit for bit as eval_mtp writes it; no query, attention, MoE or output head),
    // for the rows a drafter only catches up on. hc [n, n_hc * D], next_tokens [n]. Each row is a replay of
    // its own captured graph, queued back to back (one synchronisation per 32 rows); no logits afterwards.
    void observe_mtp(std::span<const int32_t> next_tokens, std::span<const float> hc);
    // The last evaluated token's logits stay on the device (eval() with empty logits downloads
    // nothing): last_logits() downloads them; logits_top() summarises them for the host sampler
    // (cuda_sample.h: penalties applied to the (token, count) pairs, softmax statistics, the k best)
    // so that fathom::sampler::sample_top draws without the n_vocab logits crossing to the host.
    // Both throw when no token has been evaluated since the last reset (or on a pipeline stage
    // without the output head).
    struct top_summary {
        std::vector<int32_t> ids;
        std::vector<float> logits;
        float max_logit = 0;
        double z = 0;
        uint32_t bad = 0;  // NaN / +inf logits seen
    };
    void last_logits(std::span<float> out);
    top_summary logits_top(int k, std::span<const std::pair<int32_t, int32_t>> penalties, float repeat,
                           float frequency, float presence);
    top_summary row_top(int j, int k, std::span<const std::pair<int32_t, int32_t>> penalties, float repeat,
                        float frequency, float presence);
    void row_logits(int j, std::span<float> out);
    // Test and benchmark hooks (fill_synthetic, profile_step, step_greedy, graph_replays): free functions
    // of namespace cuda_testing (deepseek4_cuda_testing.h).
    // Saved states (the on-disk prompt cache, docs/prompt-cache.md "DS4 state"): the stream of
    // ds4::write_state (deepseek4_state.cpp) from the device - raw rings, compressor frontiers,
    // compressed and indexer rows, bits as stored - so a sequence that load_state()s it continues bit
    // for bit as this one would. Whole-model sequences only (not a pipeline stage; throws). The last
    // logits are not part of it: last_logits() / restore_logits().
    void save_state(state_writer &w) const;
    // Replaces the sequence's state with a saved one of n_past tokens (n_past <= n_ctx). Throws
    // fathom::error on any mismatch (geometry, token count, KV precision, QAT mode, a short stream);
    // the sequence is then reset. No logits afterwards until restore_logits() or an evaluation.
    void load_state(state_reader &r, int64_t n_past);
    // Uploads n_vocab logits as the last evaluated token's (a loaded state's saved logits).
    void restore_logits(std::span<const float> logits);

    // Batched step (the scheduler's decode of several sequences, or verifications side by side): the next
    // counts[i] rows of seqs[i] (tokens: seqs[0]'s rows, then seqs[1]'s, ...; 1..16 rows in all) in ONE
    // multi-row step, each row bit-identical to its own decode step. The sequences share the weights
    // (cuda_upload) and n_ctx; the step runs on seqs[0]'s stream with its scratch, and each distinct
    // composition ((sequence, rows) list) runs eagerly the first time and is captured as a graph the second
    // (an LRU of 32; a composition that never recurs costs no capture). logits [rows, n_vocab]
    // and hc_out [rows, n_hc * D] of every row (either may be empty); every sequence's last logits become
    // its last row's, and each sequence keeps its rows on the device (rows_held, row_top). Throws fathom::error with nothing evaluated on: no rows, a null or repeated sequence,
    // other weights, more than 16 rows, a token outside the vocabulary, a full context; on a device-side
    // error every sequence of the step is reset.
    // features (empty or [rows, F]): every row's DSpark features (seqs[0]'s set_feature_layers decides
    // which).
    static void step_batch(std::span<cuda_sequence *const> seqs, std::span<const int> counts,
                           std::span<const int32_t> tokens, std::span<float> logits, std::span<float> hc_out = {},
                           std::span<float> features = {});

    // The device state and launch code (deepseek4_cuda.cpp; its executors of the DS4 forward drive it).
    struct impl;

  private:
    friend struct cuda_testing::access;  // the hooks of deepseek4_cuda_testing.h
    std::unique_ptr<impl> p_;
    int64_t n_past_ = 0, n_ctx_ = 0, chunk_ = 0;
    int64_t reached_ = 0, floor_ = 0;  // rollback bookkeeping (truncate)
    bool have_logits_ = false;  // p_->logits holds the last evaluated token's logits
    int rows_held_ = 0;  // rows of the last multi-row evaluation on the device (1: p_->logits; more: p_->rows_logits)
    uint64_t replays_ = 0;
    // x_out: the state leaving the chunk's rows [x_out_first, n) (stages: all of them).
    // feat_out: the features of the chunk's rows [feat_first, n) (set_feature_layers), or null.
    void eval_chunk(std::span<const int32_t> tokens, const float *x_in, float *x_out, float *logits, bool all_logits,
                    int64_t x_out_first = 0, float *feat_out = nullptr, int64_t feat_first = 0);
    void eval_impl(std::span<const int32_t> tokens, std::span<float> x, std::span<float> logits, std::span<float> hc_tail,
                   std::span<float> feat_tail = {});
    void step(int32_t token, float *logits_host, int32_t *argmax_host, const float *x_in = nullptr,
              float *x_out = nullptr, float *feat_out = nullptr);
    // The step's graph (state_only: the state-only row's) launched on the stream, captured first if needed.
    void launch_step_graph(bool state_only);
    // A device-side error word set: the sequence reset and a fathom::error naming the position.
    void check_device_error();

    void check_tokens(std::span<const int32_t> tokens) const;
    const float *row_device_ptr(int j, const char *what) const;  // row j of the held rows (throws)
    top_summary top_of(const float *logits, int k, std::span<const std::pair<int32_t, int32_t>> penalties, float repeat,
                       float frequency, float presence);
    // Paged state: the rows of positions [0, n_end) mapped, or fathom::error (nothing changed) when the
    // pool cannot supply them.
    void map_rows(int64_t n_end);
};

}  // namespace fathom::ds4
