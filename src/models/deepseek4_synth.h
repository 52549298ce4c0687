// `fathom-gguf synth`: writes a DS4-architecture GGUF (llama.cpp `deepseek4` layout, every key and
// tensor ds4::load_model reads, plus a byte-level gpt2 tokenizer) with seeded random weights for
// any geometry, streamed through gguf::writer so memory stays bounded (one row pool per tensor),
// optionally with one MTP (nextn) block in llama.cpp's layout (ds4::load_mtp reads it from the same
// file); and DSpark drafters for such a target (lucebox's `deepseek4-dflash-draft` layout,
// ds4::load_dspark).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/deepseek4.h"

namespace fathom::ds4 {

// Preset geometries: "tiny" (ds4-tiny-a: 6 layers, D 128, 8 experts, vocab 512) and "flash"
// (DeepSeek-V4-Flash, spec section 1: 43 layers, D 4096, 256 experts, vocab 129280).
// Throws fathom::error for any other name.
hparams synth_preset(const std::string &name);

// Re-derive the per-layer arrays after n_layer changed: compress ratios by the Flash rule (layers 0
// and 1 window-only, then even -> 4, odd -> 128), clamps repeated, hash layers = min(3, n_layer).
void synth_fix_layers(hparams &hp, float clamp);

// Validate a geometry against the same constraints as the loader (fathom::error naming the field).
void synth_check(const hparams &hp);

struct synth_options {
    // Weight types: "q2" (routed gate/up experts IQ2_XXS, down experts Q2_K, projections and the
    // output head Q8_0, HC/compressor/indexer-projection/router matrices and the embedding F16,
    // vectors F32; a row length that a type's block does not divide falls back to Q8_0, then F16),
    // "q2k" (as q2 with every routed expert Q2_K), "mxfp4" (as q2 with 4-bit MXFP4 routed experts: the
    // "4-bit experts" layout, ~153 GB at the Flash geometry), "q8_0" (every matrix Q8_0 where it fits), "f16"
    // or "f32".
    std::string mix = "q2";
    uint64_t seed = 1;
    // Tensors with more rows than this draw each row from a pool of this many seeded random rows,
    // quantised once (keeps synthesising a multi-GiB file to seconds); 0 = every row drawn fresh.
    int64_t pool_rows = 256;
    // Device-scale files: pooled tensors store their pool rows 0..P-1 once and leave the remaining rows
    // as a file hole (zeros on disk, no space used); the key fathom.synth.replicate_rows = P tells the
    // CUDA loader to fill row r with row r mod P on the device. The CPU loader refuses such files
    // (their zero rows would not be the model the key describes). Needs pool_rows > 0.
    bool sparse = false;
    // Target files: one MTP (nextn) block after the main ones, in llama.cpp's layout (ds4::load_mtp):
    // deepseek4.nextn_predict_layers = 1, block_count = n_layer + 1, the block as blk.<n_layer>.* (ratio 0,
    // learned routing + bias, the last main block's SwiGLU clamps, weight types by `mix` as the main
    // blocks') plus blk.<n_layer>.nextn.{eh_proj, enorm, hnorm, shared_head_norm}. The head's HC collapse
    // is read from output_hc_*, the main model's (one file cannot hold both under llama.cpp's names; the
    // golden MTP file is separate for that reason): a synthetic head shares the main model's collapse.
    // Every other tensor keeps its bytes (each tensor has its own random stream), so the main model of an
    // --mtp file is the file without it. synth_write_dspark refuses it (a drafter file has no MTP block).
    bool mtp = false;
    std::string name;  // general.name ("" = "ds4-synth")
    std::function<void(uint64_t done, uint64_t total)> on_progress;  // bytes of tensor data
};

// Write the file. Returns the number of tensor-data bytes written.
uint64_t synth_write(const std::string &path, const hparams &hp, const synth_options &opt);

// A DSpark drafter's own settings; its stages take the target's block geometry (heads, experts, eps,
// RoPE base, SwiGLU clamp), window-only attention and learned routing.
struct dspark_synth {
    int n_stages = 3;
    int block_size = 5;
    int markov_rank = 0;
    int32_t noise_token = 0;
    int window = 0;                   // context rows (attention.sliding_window)
    std::vector<int> capture_layers;  // target layers whose stream means are the features
};

// Presets for a target geometry: both capture the last 3 target layers (40..42 for Flash) with the
// target's window; "tiny" (as the ds4-tiny-dspark golden drafter): Markov rank 32, noise id
// n_vocab - 1; "flash" (DeepSeek-V4-Flash-DSpark): rank 256, noise id 128799 (n_vocab - 1 for a
// smaller vocabulary). Throws fathom::error for any other name.
dspark_synth synth_dspark_preset(const std::string &name, const hparams &target);

// Write a drafter for `target` (weights drawn as synth_write's, from other streams of the same seed;
// the mix applies as to the target's blocks). Returns the tensor-data bytes written.
uint64_t synth_write_dspark(const std::string &path, const hparams &target, const dspark_synth &d,
                            const synth_options &opt);

}  // namespace fathom::ds4
