// The DS4 drafters' raw outputs (`fathom logits --mtp` / `--dspark`), from outside the test suite:
// the MTP head's logits at every position, or a DSpark block's logits and draft. Sessions only draft
// tokens (session::draft); these rows exist to be checked against the goldens, so the engine computes
// them with the DS4 CPU reference model (src/engine/ds4_drafter_logits.cpp), and the CLI needs no model
// internals.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fathom {

struct drafter_logits_args {
    std::string model_path;  // target GGUF (resolved)
    std::string qat = "full";
    std::string kv_type = "f16";
    int threads = 0;          // 0 = all online cores
    int64_t chunk = 0;        // target (and MTP) chunk: 0 = all tokens at once
    std::string mtp;          // MTP file (either layout), or ""
    int64_t next_token = -1;  // with mtp: the token after the sequence
    std::string dspark;       // DSpark drafter file, or ""
    int64_t seed_token = -1;  // with dspark: the token at position n_tokens
};

struct drafter_logits_result {
    std::vector<float> rows;  // [n_rows, n_vocab]
    int64_t n_rows = 0, n_vocab = 0;
    std::string summary;  // one JSON line for stdout ("" = none)
};

// read_ids(n_vocab) reads the token file once the target and the drafter are loaded and checked.
// MTP: rows = the MTP logits of every position i (state of i with token i+1; the last row uses
// next_token). DSpark: rows = the block's base logits [B] then its corrected logits [B]; summary =
// {"seed_position", "block_input_ids", "ctx_positions", "markov_prev_tokens", "draft_tokens",
// "confidence_logit", "confidence"}.
drafter_logits_result drafter_logits(const drafter_logits_args &a,
                                     const std::function<std::vector<int32_t>(int32_t n_vocab)> &read_ids);

}  // namespace fathom
