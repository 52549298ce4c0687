// Synthetic dense-model GGUFs: a real tokenizer (every tokenizer.* key copied from a vocab GGUF)
// plus seeded random weights for a small qwen3 or gemma3 geometry, written with gguf::writer.
// Used to check the dense forward against llama.cpp on architectures whose real checkpoints are
// too large to install (tests/models/test_dense_synth_llamacpp.cpp,
// scripts/goldens/gen_qwen3_goldens.py, `fathom-gguf synth-dense`).
//
// Determinism: the file's bytes depend only on the options. Weights come from a splitmix64
// stream per tensor (seeded by the seed and the tensor's name) and Box-Muller normals computed
// with +,-,*,/ and sqrt only (own log/cos polynomials, no libm, no std::normal_distribution,
// floating-point contraction disabled), and own round-to-nearest quantisers (q8_0, q4_0, q4_k),
// so every IEEE machine produces the same bits. dense_synth_sha256 lets a
// test confirm it regenerated exactly the file a golden was computed on.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "core/types.h"

namespace fathom {

struct dense_synth_options {
    std::string arch = "qwen3";  // qwen3 | gemma3 | llama (llama: no preset; no q/k norm tensors)
    std::string vocab_path;      // GGUF whose tokenizer.* keys are copied; n_vocab = its token count
    uint64_t seed = 1;
    int32_t n_layer = 4;
    int32_t n_embd = 64;
    int32_t n_head = 4;
    int32_t n_head_kv = 2;
    int32_t head_dim = 64;       // may differ from n_embd / n_head (it does in the presets)
    int32_t n_ff = 256;
    int32_t n_ctx_train = 4096;
    float rope_freq_base = 1000000.0f;
    float rms_eps = 1e-6f;
    int32_t sliding_window = 0;  // gemma3: window of the local layers (pattern: every 6th global)
    bool tied_output = false;    // no output.weight: logits use token_embd
    dtype embd_type = dtype::q4_0;
    dtype output_type = dtype::q8_0;
    // Only f32/f16 matrices (output f16; a tied embedding f16 too): no quantised activations anywhere, so a comparison with
    // llama.cpp is free of q8 rounding flips (see tests/models/test_dense_synth_llamacpp.cpp).
    bool float_weights = false;
    // Every weight matrix in this one type (a real release's format, e.g. q8_0 for Qwen3-0.6B),
    // overriding the test mix of dense_synth_weight_type; q4_k falls back to q8_0 as below.
    std::optional<dtype> weight_type;
};

// The two geometries used by the tests and goldens (documented in dense_synth.cpp).
//   qwen3:  4 layers, E 64, 4 heads / 2 kv heads of 64 (Q width 256 != E), FF 256, untied output.
//   gemma3: 6 layers (5 sliding-window + 1 global), window 32, E 64, 4 heads / 1 kv head of 64,
//           FF 256, tied q8_0 embeddings.
dense_synth_options dense_synth_preset(const std::string &arch, const std::string &vocab_path, uint64_t seed);

// The dtype of each weight matrix in a synthetic file, a fixed function of the tensor kind
// (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down) and the layer index: mostly
// f32, with f16, q8_0 and q4_k mixed in; with float_weights only f32 and f16. Norms are f32.
dtype dense_synth_weight_type(const std::string &kind, int32_t layer, bool float_weights = false);

// Write the GGUF to out_path. Throws fathom::error on bad options or I/O failure.
void dense_synth_write(const dense_synth_options &o, const std::string &out_path);

// Lower-case hex SHA-256 (FIPS 180-4) of a file's bytes.
std::string dense_synth_sha256(const std::string &path);

}  // namespace fathom
