// Host-side DS4 helpers of the CUDA suites: views of weights for the CPU references
// (test_cuda_ds4.cpp, test_cuda_ds4_prefill_mm.cpp; a ds4::matrix / ds4::expert_bank over bytes the
// test owns) and the quantised synthetic model file (test_cuda_ds4_model.cpp, test_cuda_ds4_branches.cpp).
#pragma once
#include <cstdint>
#include <cmath>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "core/types.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/deepseek4.h"
#include "models/deepseek4_synth.h"

namespace fathom::cuda_test {

// Plain decoding on the device: toks one decode step each from the sequence's position, every step's
// logits [toks.size(), V] (the reference the rollback and saved-state tests compare with).
inline std::vector<float> decode_each(ds4::cuda_sequence &seq, std::span<const int32_t> toks, size_t V) {
    std::vector<float> out(toks.size() * V, std::nanf(""));
    for (size_t i = 0; i < toks.size(); ++i) seq.eval(toks.subspan(i, 1), std::span(out).subspan(i * V, V));
    return out;
}

// rows x cols of type t, packed rows, in b.
inline ds4::matrix host_matrix(dtype t, const std::vector<uint8_t> &b, int64_t rows, int64_t cols) {
    return {t, b.data(), rows, cols, dtype_row_bytes(t, cols)};
}
// n experts of rows x cols each, back to back in b.
inline ds4::expert_bank host_bank(dtype t, const std::vector<uint8_t> &b, int64_t rows, int64_t cols, int64_t n) {
    ds4::expert_bank e;
    e.first = host_matrix(t, b, rows, cols);
    e.n = n;
    e.expert_bytes = e.first.row_bytes * static_cast<size_t>(rows);
    return e;
}

// n token ids in [0, vocab), a fixed LCG stream per seed (test_cuda_ds4_branches.cpp, test_cuda_ds4_state.cpp).
inline std::vector<int32_t> tokens_of(size_t n, int vocab, uint64_t seed) {
    std::vector<int32_t> t(n);
    for (auto &x : t) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        x = static_cast<int32_t>((seed >> 33) % static_cast<uint64_t>(vocab));
    }
    return t;
}

// Writes a quantised synthetic model with the ds4-tiny layout but 256-wide rows (IQ2_XXS / Q2_K
// blocks: the q2 mix by default, or another synth mix such as q4k / q3k; seed 7; 5 layers of
// compression ratios 0, 0, 4, 128, 4) to the temp directory as file_name and returns its path. Suites
// that may run in parallel pass their own file names.
inline std::string write_quant_tiny_model(const std::string &file_name, const std::string &mix = "q2") {
    ds4::hparams hp = ds4::synth_preset("tiny");
    hp.n_embd = 256;
    hp.n_ff_exp = 256;
    hp.n_layer = 5;  // ratios 0, 0, 4, 128, 4
    ds4::synth_fix_layers(hp, 1.5f);
    ds4::synth_options o;
    o.mix = mix;
    o.seed = 7;
    const std::string p = (std::filesystem::temp_directory_path() / file_name).string();
    ds4::synth_write(p, hp, o);
    return p;
}

}  // namespace fathom::cuda_test
