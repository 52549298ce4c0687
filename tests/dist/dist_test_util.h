// Helpers shared by the tests/dist tests (and, through conversation_util.h, tests/engine's CUDA --devices
// test): error text of a call, a fixed token stream, bitwise comparison, and a DS4 forward run in chunks
// with the unsplit single-rank forward as the reference every split (pipeline, tp) is compared with.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/deepseek4.h"
#include "models/deepseek4_synth.h"

namespace dist_test {

using namespace fathom;

// A synthetic DS4 model of geometry hp with seeded weights: written to a per-process temporary file
// named after `tag` (ctest runs tests in parallel processes), loaded, and unlinked once mapped.
inline std::unique_ptr<ds4::model> load_synth(const ds4::hparams &hp, uint64_t seed, const std::string &tag) {
    const std::string path =
        (std::filesystem::temp_directory_path() / (tag + "_" + std::to_string(::getpid()) + ".gguf")).string();
    ds4::synth_options o;
    o.seed = seed;
    ds4::synth_write(path, hp, o);
    auto m = ds4::load_model(path);
    std::filesystem::remove(path);
    return m;
}

// The message of the fathom::error that f throws ("" if it returns; any other exception propagates).
inline std::string error_of(const std::function<void()> &f) {
    try {
        f();
    } catch (const error &e) {
        return e.what();
    }
    return "";
}

inline bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// n token ids of a fixed pseudo-random pattern inside [0, vocab).
inline std::vector<int32_t> test_tokens(size_t n, int vocab) {
    std::vector<int32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 37 + 11) % static_cast<size_t>(vocab));
    return t;
}

// Logits [n, V] of `tokens` at positions 0..n-1, evaluated in the given chunk sizes (the last size
// repeats) through fwd(tokens, positions, logits) with spans of the chunk; after_chunk() (if set) runs
// after every chunk.
template <class F>
std::vector<float> run_chunks(F &&fwd, const std::vector<int32_t> &tokens, const std::vector<size_t> &chunks,
                              size_t V, const std::function<void()> &after_chunk = nullptr) {
    const size_t n = tokens.size();
    std::vector<float> logits(n * V);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    size_t b = 0, k = 0;
    while (b < n) {
        const size_t len = std::min(n - b, chunks[std::min(k++, chunks.size() - 1)]);
        fwd(std::span(tokens).subspan(b, len), std::span(pos).subspan(b, len),
            std::span(logits).subspan(b * V, len * V));
        if (after_chunk) after_chunk();
        b += len;
    }
    return logits;
}

// The single-rank reference: run_chunks through ds4::forward on one fresh f32-KV state.
inline std::vector<float> reference(const ds4::model &m, const std::vector<int32_t> &tokens,
                                    const std::vector<size_t> &chunks, ds4::qat_mode qat) {
    ds4::state st = ds4::new_state(m, qat, kv_precision::f32);
    return run_chunks([&](auto t, auto p, auto l) { ds4::forward(m, st, t, p, {l, {}}); }, tokens, chunks,
                      static_cast<size_t>(m.hp.n_vocab));
}

}  // namespace dist_test
