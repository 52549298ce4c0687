// Real dense-model geometries for the CUDA whole-model tests and benchmarks (test_cuda_model.cpp,
// cuda_synth.cpp): synthetic GGUFs (dense_synth_write, the code behind `fathom-gguf synth-dense`)
// with each real model's per-layer shapes, head layout, RoPE base, tied q8_0 embeddings and a real
// tokenizer of similar size (the real vocabularies are not in ../shared):
//
//   llama  (SmolLM2-135M): E 576, 9 heads / 3 kv of 64, FF 1536, 30 layers, gpt-2 vocab (50257; real 49152)
//   qwen3  (Qwen3-0.6B):   E 1024, 16 / 8 heads of 128, FF 3072, 28 layers, qwen2 vocab (151936)
//   gemma3 (Gemma3-270M):  E 640, 4 / 1 heads of 256, FF 2048, 18 layers (every 6th global),
//                          window 512, llama-bpe vocab (128256; real 262144)
//
// Weight types follow dense_synth_weight_type (f32, f16, q8_0, q4_k mixed), not the real files'.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "models/dense_synth.h"

namespace fathom::cuda_test {

struct family {
    const char *arch, *vocab;
    int32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, window;
    float rope_base, eps;
};

inline const family kFamilies[3] = {
    {"llama", "ggml-vocab-gpt-2.gguf", 30, 576, 9, 3, 64, 1536, 0, 100000.0f, 1e-5f},
    {"qwen3", "ggml-vocab-qwen2.gguf", 28, 1024, 16, 8, 128, 3072, 0, 1000000.0f, 1e-6f},
    {"gemma3", "ggml-vocab-llama-bpe.gguf", 18, 640, 4, 1, 256, 2048, 512, 1000000.0f, 1e-6f},
};

inline const family *find_family(const std::string &arch) {
    for (const family &f : kFamilies)
        if (arch == f.arch) return &f;
    return nullptr;
}

// Where the vocab GGUFs the synthetic models copy their tokenizers from live: $FATHOM_CUDA_VOCAB_DIR
// (the device machine, where ../shared is not at the build's path), else FATHOM_SHARED_DIR/tokenizer-tests.
inline std::string vocab_dir() {
    if (const char *d = std::getenv("FATHOM_CUDA_VOCAB_DIR")) return d;
    return std::string(FATHOM_SHARED_DIR) + "/tokenizer-tests";
}

// Writes the family's synthetic model to `out`; n_layer / window > 0 override the real values.
inline void write_family_model(const family &f, const std::string &vocab_dir, const std::string &out,
                               int32_t n_layer = 0, int32_t window = -1,
                               std::optional<dtype> weight_type = std::nullopt) {
    dense_synth_options o;
    o.weight_type = weight_type;
    o.arch = f.arch;
    o.vocab_path = vocab_dir + "/" + f.vocab;
    o.seed = 7;
    o.n_layer = n_layer > 0 ? n_layer : f.n_layer;
    o.n_embd = f.n_embd;
    o.n_head = f.n_head;
    o.n_head_kv = f.n_head_kv;
    o.head_dim = f.head_dim;
    o.n_ff = f.n_ff;
    o.n_ctx_train = 4096;
    o.rope_freq_base = f.rope_base;
    o.rms_eps = f.eps;
    o.sliding_window = window >= 0 ? window : f.window;
    o.tied_output = true;
    o.embd_type = dtype::q8_0;
    dense_synth_write(o, out);
}

}  // namespace fathom::cuda_test
