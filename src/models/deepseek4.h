// DeepSeek V4 Flash ("DS4") reference model: hyper-parameters, weights bound to a GGUF mapping
// (llama.cpp `deepseek4` layout), the explicit evaluation state and the f32 forward pass.
//
// Normative description: ../shared/reference/ds4-architecture.md (section numbers below refer to it).
// The forward is evaluated layer-major over a chunk of tokens (prefill chunk of n tokens; decode is
// n = 1); all model state lives in `ds4::state`, so any split of a sequence into chunks gives the same
// logits up to f32 rounding.
//
// File map: deepseek4_load.cpp (hparams + tensors + validation), deepseek4_ops.* (f32 helpers),
// deepseek4_qat.* (FP8/FP4/Hadamard round trips), deepseek4_attn.cpp (attention, compressors,
// indexer), deepseek4_moe.cpp (hyper-connections, MoE), deepseek4_forward.cpp (layer builder),
// deepseek4_mtp.cpp (multi-token-prediction head).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/types.h"
#include "fathom/kv_precision.h"
#include "fathom/state_stream.h"

namespace fathom::gguf {
class file;
struct tensor_info;
}
namespace fathom::cpu {
class thread_pool;
}

namespace fathom::ds4 {

// Which quantisation-aware-training round trips are simulated (spec section 8).
//   full    : QAT-1 (FP8 e4m3 on non-RoPE KV dims) and QAT-2 (Hadamard + FP4 e2m1 on indexer q/k)
//   fp4only : QAT-2 only (what one copy of the official TileLang kernel computes)
//   off     : neither
enum class qat_mode { full, fp4only, off };

struct hparams {
    int n_layer = 0;  // main-model blocks (block_count - nextn_predict_layers)
    int n_nextn = 0;  // MTP blocks stored after the main ones (llama.cpp MTP files)
    int n_embd = 0;   // D
    int n_vocab = 0;
    int n_head = 0;    // H query heads (one shared K=V row)
    int head_dim = 0;  // d (q, k and v)
    int n_rot = 0;     // RoPE dims at the tail of each head
    int q_lora = 0;    // Q low rank
    int o_groups = 0;  // output groups
    int o_rank = 0;    // output low rank per group
    int window = 0;    // raw sliding window (rows, including the query itself)
    int n_expert = 0;
    int n_expert_used = 0;
    int n_expert_shared = 0;  // 0 or 1
    int n_ff_exp = 0;         // routed and shared expert width
    int n_hash_layer = 0;     // first layers use tid2eid hash routing
    int idx_head = 0;         // indexer heads
    int idx_dim = 0;          // indexer head dim (power of two: Hadamard)
    int idx_topk = 0;
    int n_hc = 0;  // hyper-connection streams
    int sinkhorn_iters = 0;
    float hc_eps = 0;
    float rms_eps = 0;
    float rope_base = 0;           // ratio-0 layers, no YaRN
    float compress_rope_base = 0;  // compressed layers, their compressors and indexer (YaRN)
    float yarn_factor = 0;
    float yarn_beta_fast = 0;
    float yarn_beta_slow = 0;
    int64_t yarn_orig_ctx = 0;
    float expert_weights_scale = 0;
    std::vector<int> compress_ratio;  // [n_layer + n_nextn]: 0, or R >= 2 (overlap iff R == 4)
    std::vector<float> clamp_exp;     // [n_layer + n_nextn] SwiGLU clamp, routed experts
    std::vector<float> clamp_shexp;   // [n_layer + n_nextn] SwiGLU clamp, shared expert
};

// Read and validate hyper-parameters. Throws fathom::error naming the key.
hparams load_hparams(const gguf::file &f);

// A 2-D weight in torch orientation [rows = out, cols = in], rows `row_bytes` apart. Any dtype with
// CPU dequantisation; `data` points into the GGUF mapping (or at a column offset inside a wider row).
struct matrix {
    dtype type = dtype::f32;
    const uint8_t *data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
    size_t row_bytes = 0;
    const uint8_t *row(int64_t r) const { return data + static_cast<size_t>(r) * row_bytes; }
};

// Stacked experts: ggml {cols, rows, n}; expert e is a [rows, cols] matrix.
struct expert_bank {
    matrix first;  // expert 0
    int64_t n = 0;
    size_t expert_bytes = 0;  // rows * row_bytes
    matrix expert(int64_t e) const {
        matrix m = first;
        m.data += static_cast<size_t>(e) * expert_bytes;
        return m;
    }
};

struct hc_weights {            // one hyper-connection mixer (spec 3.1 / 3.4)
    matrix fn;                 // [n_mix, n_hc*D], n_mix = (2+n_hc)*n_hc (sublayer) or n_hc (head)
    std::vector<float> base;   // [n_mix]
    std::vector<float> scale;  // [3] (sublayer) or [1] (head)
};

struct compressor_weights {  // spec 4.4; c = 2 if ratio == 4 (overlapping windows) else 1
    int ratio = 0;
    int dim = 0;              // d' (row width)
    matrix kv;                // [c*d', D]
    matrix gate;              // [c*d', D]
    std::vector<float> ape;   // [ratio, c*d']
    std::vector<float> norm;  // [d']
};

struct layer_weights {
    int ratio = 0;                           // 0: window only
    bool hash = false;                       // hash-routed (tid2eid) instead of learned routing + bias
    float clamp = 0;                         // SwiGLU clamp, routed experts
    float clamp_sh = 0;                      // SwiGLU clamp, shared expert
    std::vector<float> attn_norm, ffn_norm;  // [D]
    hc_weights hc_attn, hc_ffn;
    matrix q_a;                   // [q_lora, D]
    std::vector<float> q_a_norm;  // [q_lora]
    matrix q_b;                   // [H*d, q_lora]
    matrix kv;                    // [d, D]
    std::vector<float> kv_norm;   // [d]
    std::vector<float> sinks;     // [H]
    matrix out_a;                 // [G*o_rank, (H/G)*d]
    matrix out_b;                 // [D, G*o_rank]
    compressor_weights comp;      // ratio > 0
    // indexer (ratio == 4)
    matrix idx_q_b;   // [idx_head*idx_dim, q_lora]
    matrix idx_proj;  // [idx_head, D]
    compressor_weights idx_comp;
    // MoE
    matrix gate_inp;                 // [E, D]
    std::vector<float> exp_bias;     // [E] (learned routing)
    std::vector<int32_t> tid2eid;    // [n_vocab, used] (hash routing)
    expert_bank gate_exps, up_exps;  // each expert [F, D]
    expert_bank down_exps;           // each expert [D, F]
    matrix gate_sh, up_sh;           // [F, D]
    matrix down_sh;                  // [D, F]
};

struct model {
    hparams hp;
    std::shared_ptr<const gguf::file> file;  // keeps the mapping alive
    matrix tok_embd;                         // [n_vocab, D]
    matrix output;                           // [n_vocab, D]
    std::vector<float> output_norm;          // [D]
    hc_weights hc_head;
    std::vector<layer_weights> layers;  // [n_layer]
};

// Bind and validate every tensor of the main model. Throws fathom::error naming the tensor.
std::unique_ptr<model> load_model(std::shared_ptr<const gguf::file> f);
std::unique_ptr<model> load_model(const std::string &path);

// Load one block whose tensors are named `<prefix><suffix>` (e.g. "blk.3.", "mtp.0.").
layer_weights load_layer(const gguf::file &f, const hparams &hp, const std::string &prefix, int ratio,
                         bool hash, float clamp, float clamp_sh);

// ---- evaluation state --------------------------------------------------------------------------

// Rows of fixed width stored in f32 or f16 (KV cache precision).
class row_store {
  public:
    row_store() = default;
    row_store(int64_t width, kv_precision prec) : width_(width), prec_(prec) {}
    int64_t width() const { return width_; }
    int64_t size() const { return n_rows_; }
    void resize(int64_t n_rows);
    void set(int64_t r, const float *src);  // rounds through f16 when stored as f16
    void push(const float *src);
    void get(int64_t r, float *dst) const;
    kv_precision precision() const { return prec_; }
    // The stored rows as bytes ([size() x width()] f32 or f16 values): saved states (deepseek4_state.cpp).
    std::span<const uint8_t> bytes() const;
    std::span<uint8_t> bytes();

  private:
    int64_t width_ = 0;
    kv_precision prec_ = kv_precision::f32;
    int64_t n_rows_ = 0;
    std::vector<float> f32_;
    std::vector<uint16_t> f16_;
};

// Rollback (session::truncate): a state can forget up to this many of its newest positions for nothing
// (no re-evaluation). The position-indexed rings below keep max_rollback positions more than plain
// decoding reads, so the rows a longer step overwrote are still there when it is rolled back.
constexpr int64_t max_rollback = 16;

// Compressor frontier (spec 4.4, decode state): the (a, g + ape) projections of the latest positions,
// position p in slot p mod slots, each row c*d' wide. A block ending at p pools the projections of its
// own positions (and, ratio 4, of the previous block's; positions < 0 are empty: score -inf, value 0),
// read by position, so rolling back over a block boundary needs no copy. slots = (ratio 4: 2 * 4,
// otherwise ratio) + max_rollback (new_layer_state); any slots >= that base also evaluate correctly.
struct compressor_state {
    int ratio = 0;
    int dim = 0;
    std::vector<float> kv;     // [slots, c*d']
    std::vector<float> score;  // [slots, c*d'] (-inf in slots not yet written)
};

struct layer_state {
    row_store raw;              // raw KV rows of the latest positions: window + max_rollback rows, slot = pos mod size
    compressor_state comp;      // attention compressor frontier (ratio > 0)
    row_store comp_rows;        // emitted attention-compressor rows [n_comp, d]
    compressor_state idx_comp;  // indexer compressor frontier (ratio == 4)
    row_store idx_rows;         // emitted indexer rows [n_comp, idx_dim]
};

// How forward() evaluates matrix products (deepseek4_ops.cpp). The default is the single-threaded
// reference: dequantised weight rows x f32 activations, double accumulation. `pool` splits the rows
// of every product over its threads (same bits as without it). `quantised` sends non-f32 weights
// through the quantised kernels (activations quantised to cpu::vec_dot_type(weight), cpu::gemm);
// f32 weights always take the reference path.
struct exec_options {
    cpu::thread_pool *pool = nullptr;
    bool quantised = false;
};

struct state {
    int64_t n_past = 0;  // tokens evaluated so far (next position)
    // Rollback bookkeeping: `reached` is the highest n_past since the state was fresh or loaded (the
    // rings may hold rows of positions in [n_past, reached) that a truncation dropped); `floor` is the
    // lowest n_past a truncation may return to (a loaded state keeps no rows older than its window).
    int64_t reached = 0;
    int64_t floor = 0;
    exec_options exec;   // how products are evaluated (set by the engine; default: reference)
    qat_mode qat = qat_mode::full;
    kv_precision kv = kv_precision::f32;
    std::vector<layer_state> layers;
};

// The lowest n_past truncate() accepts: max(floor, reached - max_rollback), and never above n_past.
int64_t rollback_floor(const state &st);
// Forget positions [n, n_past): afterwards st is, bit for bit in everything later evaluations read, the
// state plain decoding had at n (raw rows, compressor frontiers, compressed and indexer rows). Throws
// fathom::error (st unchanged) when n < rollback_floor(st) or n > n_past.
void truncate(state &st, int64_t n);

// KV-cache bytes per token of context for KV rows stored at `kv` precision (spec 4.3-4.5): per
// ratio-R layer d/R compressed-row elements per token, per ratio-4 layer also idx_dim/4 indexer-row
// elements, plus every layer's raw ring (window x d, a fixed size) amortised over n_ctx tokens.
// Compressor frontiers (f32, a fixed few KiB per layer) are not KV rows and are not counted.
double kv_bytes_per_token(const hparams &hp, kv_precision kv, int64_t n_ctx);

// Fresh state for `m` (no tokens).
state new_state(const model &m, qat_mode qat, kv_precision kv);
layer_state new_layer_state(const hparams &hp, const layer_weights &lw, kv_precision kv);
// The same from the geometry alone (compressor widths head_dim / idx_dim): the CUDA sequence's host copies.
layer_state new_layer_state(const hparams &hp, int ratio, kv_precision kv);

// What forward() returns besides logits.
struct forward_out {
    // [n, n_vocab] logits of every token, or [n_vocab] of the last one only (size decides).
    std::span<float> logits;
    // optional [n, n_hc, D]: final hyper-connection state of every token (before the HC head),
    // the input of the MTP head.
    std::span<float> hc_state;
};

// Evaluate `tokens` at `positions` (must be n_past, n_past+1, ...), updating `st`.
void forward(const model &m, state &st, std::span<const int32_t> tokens, std::span<const int64_t> positions,
             const forward_out &out);

// ---- multi-row steps (deepseek4_forward.cpp; the layer sequence: deepseek4_exec.h) ------------------

// One row of a step: `token` of sequence `seq` (an index into the step's sequence list) at `pos`.
struct step_row {
    int32_t seq = 0;
    int64_t pos = 0;
    int32_t token = 0;
};

// Evaluates every row in one forward. The rows of a sequence must be its next positions in row order
// (n_past, n_past + 1, ...: several rows of one sequence are causal among themselves, as a
// verification needs); rows of different sequences may interleave (batched decode, a prompt chunk
// beside decodes). Every row attends with its own indexer top-k, raw-window span and compressor state.
// A row's logits are bit-identical to evaluating it alone (batch invariance: every product, norm and
// attention sum is computed per row in an order that does not depend on the other rows).
// logit_rows: the rows whose logits are wanted, in any order; logits is [logit_rows.size(), n_vocab] in
// that order. The sequences must share one QAT mode and KV precision; products use seqs[0]'s exec.
// Throws fathom::error, changing no state, on: an unknown sequence, a sequence listed twice, a token
// outside the vocabulary, a position that skips or repeats, a bad logit row or buffer size.
void step(const model &m, std::span<state *const> seqs, std::span<const step_row> rows,
          std::span<const int32_t> logit_rows, std::span<float> logits);

// What a speculative drafter reads from the target's step besides logits (each span empty or full size):
// hc_state [R, n_hc * D]: every row's final HC state (before the HC head; the MTP head's input);
// features [R, feature_layers.size() * D]: per row, for each listed block in order, the mean of the
// n_hc streams leaving it (the DSpark drafter's target features).
struct step_extras {
    std::span<float> hc_state;
    std::span<const int> feature_layers;
    std::span<float> features;
};
void step(const model &m, std::span<state *const> seqs, std::span<const step_row> rows,
          std::span<const int32_t> logit_rows, std::span<float> logits, const step_extras &extras);

// ---- saved states (session::save_state / load_state; deepseek4_state.cpp) ---------------------------
// The whole of `st` that later evaluations read: n_past, and per layer the raw ring, the compressor
// frontiers and the compressed and indexer rows (layout: docs/prompt-cache.md "DS4 state"). Every
// length read_state accepts follows from the model's geometry and n_past, which must equal `n_past`
// (the caller's token count); st keeps its exec / qat / kv settings, which must match the saved ones.
// The stream holds the raw ring and frontiers in plain decoding's layout (window slots, slot = pos mod
// window; ratio 4: previous block then current block), converted from and to the position-indexed
// rings; a loaded state cannot be rolled back below its n_past (its floor).
// A compressor frontier at n_past in plain decoding's layout (the stream's and the CUDA sequence's): ratio
// 4: slots 0..3 the previous block, 4..7 the current one; otherwise `ratio` slots by phase; kv and score
// [slots, c*d'] each (positions < 0: value 0, score -inf).
void frontier_plain_layout(const compressor_state &s, int64_t n_past, std::vector<float> &kv, std::vector<float> &score);
void write_state(const model &m, const state &st, state_writer &w);
void read_state(const model &m, state &st, state_reader &r, int64_t n_past);
// One layer's part of the stream (after the header): u64 ratio, raw ring, frontiers, rows, from / into a
// layer_state of new_layer_state's sizes (get: the row counts follow n_past). The CUDA sequence streams
// its layers through these one at a time (its device buffers have the layer_state layouts).
void put_layer_state(state_writer &w, const hparams &hp, int ratio, const layer_state &ls, int64_t n_past);
void get_layer_state(state_reader &r, const hparams &hp, int il, layer_state &ls, int64_t n_past);
// The stream's head, shared with the CUDA sequence's save / load (models/cuda/deepseek4_cuda.cpp): u32
// magic "DS41", u32 version, then these u64 fields in order (with the names load errors use).
struct state_header_field {
    uint64_t value;
    const char *name;
};
constexpr uint32_t state_magic = 0x31345344, state_version = 1;
std::array<state_header_field, 7> state_header(const hparams &hp, int64_t n_past, kv_precision kv, qat_mode qat);
// Writes magic, version and the fields; reads and checks them (fathom::error naming a mismatch).
void put_state_header(state_writer &w, const hparams &hp, int64_t n_past, kv_precision kv, qat_mode qat);
void check_state_header(state_reader &r, const hparams &hp, int64_t n_past, kv_precision kv, qat_mode qat);

// ---- layer ranges (pipeline stages, src/dist) ---------------------------------------------------
// forward() is embed_tokens -> forward_layers(0, n_layer) -> head_logits; a pipeline runs the same
// three pieces on different ranks, each rank holding the state of its own layers only, and gets the
// bits of the unsplit forward.

// x [n, n_hc, D] = the embedding row of every token copied into all n_hc streams.
void embed_tokens(const model &m, std::span<const int32_t> tokens, std::span<float> x);

// Blocks [l0, l1) over a chunk: x [n, n_hc, D] updated in place. `layers` holds the states of
// exactly these blocks (layers[i] belongs to block l0 + i). `positions` must be n_past, n_past+1, ...
// of the caller's sequence (checked by forward(); here only the sizes and the range are checked).
void forward_layers(const model &m, std::span<layer_state> layers, qat_mode qat, const exec_options &exec,
                    int l0, int l1, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                    std::span<float> x);

// Logits from the final HC state x [n, n_hc, D]: `logits` is [n, n_vocab] (every token) or [n_vocab]
// (the last token only).
void head_logits(const model &m, const exec_options &exec, std::span<const float> x, std::span<float> logits);

}  // namespace fathom::ds4
