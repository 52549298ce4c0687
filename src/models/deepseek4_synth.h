// `fathom-gguf synth`: writes a DS4-architecture GGUF (llama.cpp `deepseek4` layout, every key and
// tensor ds4::load_model reads, plus a byte-level gpt2 tokenizer) with seeded random weights for
// any geometry, streamed through gguf::writer so memory stays bounded (one row pool per tensor).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

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
    std::string name;  // general.name ("" = "ds4-synth")
    std::function<void(uint64_t done, uint64_t total)> on_progress;  // bytes of tensor data
};

// Write the file. Returns the number of tensor-data bytes written.
uint64_t synth_write(const std::string &path, const hparams &hp, const synth_options &opt);

}  // namespace fathom::ds4
