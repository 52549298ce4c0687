// Placement planner for a DS4 model over several devices: from the GGUF metadata and tensor
// directory (bytes per layer, routed experts, embedding, output head), the context length (KV bytes
// from the DS4 KV layout: raw ring + compressed rows + indexer rows + compressor frontiers) and each
// device's free memory, choose a layout and report per device what it holds and what is left.
//
// Layouts:
//   pipeline : contiguous layer ranges per device (weights and KV of a layer on one device; the
//              embedding on the first device, the output head and any MTP blocks on the last).
//              Chosen ranges minimise the largest fill ratio (needed / free) over the devices, so
//              equal devices get balanced memory and unequal ones proportional shares.
//   tp       : every device holds every layer: attention heads, output groups, the shared expert
//              and the indexer heads split across devices, routed experts sharded by expert id, the
//              embedding and output head split by vocabulary rows, everything else replicated. DS4's
//              attention has a single shared K=V head (MQA), so the KV cache is replicated on every
//              device (see docs/dist.md).
// Each device also keeps a reserve for activations and scratch (reserve_bytes + activation_bytes()).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dist/pipeline.h"
#include "models/deepseek4.h"

namespace fathom::gguf {
class file;
}

namespace fathom::dist {

// One tensor of the directory: its name and stored bytes.
struct tensor_bytes {
    std::string name;
    uint64_t bytes = 0;
};

// Tensor bytes grouped for placement.
struct weight_inventory {
    ds4::hparams hp;
    uint64_t embed = 0;                 // token_embd.weight
    uint64_t output = 0;                // output.weight (split by vocabulary rows in tp)
    uint64_t head = 0;                  // output_norm, output_hc_*, MTP blocks, other globals
    std::vector<uint64_t> layer;        // [n_layer] every blk.<i>.* tensor
    std::vector<uint64_t> experts;      // [n_layer] of which routed experts (blk.<i>.ffn_*_exps.*)
    std::vector<uint64_t> split;        // [n_layer] of which split by heads/groups/width in tp
    uint64_t total() const;
};

// Group a tensor directory. `hp` gives n_layer (blocks at or above it are MTP blocks -> head).
weight_inventory make_inventory(const ds4::hparams &hp, const std::vector<tensor_bytes> &tensors);
// Same from a GGUF file (hyper-parameters through ds4::load_hparams; no tensor data is read).
weight_inventory inventory_from_gguf(const gguf::file &f);

// KV-cache and compressor-state bytes of block `il` for one sequence of n_ctx tokens: raw ring
// window*d, floor(n_ctx/R) compressed rows of d and (R = 4) indexer rows of idx_dim at `kv`
// precision, plus the f32 compressor frontiers ((a, score) pairs: 8 slots x 2d' for R = 4, R slots x d'
// otherwise).
uint64_t layer_kv_bytes(const ds4::hparams &hp, int il, int64_t n_ctx, kv_precision kv);

struct device_spec {
    std::string name;         // "cuda:0"
    uint64_t free_bytes = 0;  // memory the plan may use
};

// The memory device `name` ("cuda:N") has free now (cudaMemGetInfo), for planning without --mem-gib.
// Throws the one-line reason for another name, a device not present, or a build without CUDA.
uint64_t device_free_bytes(const std::string &name);

enum class layout { pipeline, tp };

struct plan_options {
    int64_t n_ctx = 0;                 // context length per sequence
    int n_seq = 1;                     // sequences resident at once (KV is per sequence)
    kv_precision kv = kv_precision::f16;
    layout kind = layout::pipeline;
    int64_t chunk = 512;               // prefill chunk (tokens in flight per device)
    uint64_t reserve_bytes = 1536ull << 20;  // per device: CUDA context, cuBLAS workspace, allocator slack
    std::vector<layer_range> ranges;   // pipeline: user override (empty = choose)
};

// Activation/scratch bytes of one device evaluating a chunk (f32): HC state and its copy (2 n_hc D),
// query and attention output (2 H d), output-LoRA (G r), norms/sublayer in/out (4 D), expert
// intermediates (3 F (used + shared)), attention scores over window + top-k + n_ctx/128 rows per head,
// indexer scores over n_ctx/4 rows; plus the last-token logits (n_vocab) once per sequence.
uint64_t activation_bytes(const ds4::hparams &hp, int64_t chunk, int64_t n_ctx, int n_seq);

struct device_plan {
    std::string name;
    layer_range layers;     // pipeline: its blocks; tp: all blocks
    uint64_t weights = 0;   // bytes of weights it holds
    uint64_t kv = 0;        // KV + compressor state
    uint64_t reserve = 0;   // reserve_bytes + activation_bytes
    uint64_t free_bytes = 0;
    uint64_t used() const { return weights + kv + reserve; }
    int64_t left() const { return static_cast<int64_t>(free_bytes) - static_cast<int64_t>(used()); }
    int experts_first = 0, experts_count = 0;  // tp: routed experts [first, first + count)
};

struct plan {
    layout kind = layout::pipeline;
    int64_t n_ctx = 0;
    int n_seq = 1;
    kv_precision kv = kv_precision::f16;
    uint64_t total_weights = 0;
    std::vector<device_plan> devices;
};

// Choose (or check, with options.ranges) a placement. Throws fathom::error with the shortfall when the
// model does not fit, or when the layout cannot split the model over these devices.
plan make_plan(const weight_inventory &inv, const std::vector<device_spec> &devices, const plan_options &o);

// Human-readable table and JSON (nlohmann-free string; keys documented in docs/dist.md).
std::string plan_text(const plan &p);
std::string plan_json(const plan &p);

// "0-21,22-42" (inclusive block numbers) -> ranges; throws on malformed text.
std::vector<layer_range> parse_layer_ranges(const std::string &text);

}  // namespace fathom::dist
