// DS4 multi-token-prediction (MTP) head: one extra DS4 block (window-only attention with its own KV
// history, learned routing) fed with the main model's final hyper-connection state of position i and
// the embedding of token t_(i+1); its logits predict t_(i+2) (DeepSeek-V3 MTP convention; see
// ../shared/golden/ds4-tiny/README.md, "MTP").
//
// Two file layouts are accepted: llama.cpp's MTP draft GGUF (`blk.<n_layer>.*`, `blk.<n_layer>.nextn.*`,
// the MTP head's HC collapse under `output_hc_*`) and antirez/ds4's (`mtp.0.*`).
#pragma once
#include <memory>
#include <span>
#include <string>

#include "models/deepseek4.h"

namespace fathom::ds4 {

struct mtp_weights {
    std::shared_ptr<const gguf::file> file;  // keeps the mapping alive
    layer_weights block;                     // ratio 0, learned routing + bias
    matrix e_proj;                           // [D, D] (llama.cpp: input columns 0..D-1 of eh_proj)
    matrix h_proj;                           // [D, D] (llama.cpp: input columns D..2D-1 of eh_proj)
    std::vector<float> enorm, hnorm, norm;   // [D]
    hc_weights hc_head;                      // the MTP head's own HC collapse
};

// Load the MTP module for `main` from either layout; validates shapes against the main model.
std::unique_ptr<mtp_weights> load_mtp(const model &main, std::shared_ptr<const gguf::file> f);
std::unique_ptr<mtp_weights> load_mtp(const model &main, const std::string &path);

struct mtp_state {
    int64_t n_past = 0;
    int64_t reached = 0;  // the highest n_past since the state was fresh (rollback: see ds4::state)
    qat_mode qat = qat_mode::full;
    exec_options exec;  // see ds4::state
    layer_state block;
};
mtp_state new_mtp_state(const model &main, const mtp_weights &w, qat_mode qat, kv_precision kv);
// Forget MTP rows [n, n_past): free within max_rollback of `reached` (the block's raw ring is
// position-indexed like the main model's); throws fathom::error otherwise (st unchanged).
void mtp_truncate(mtp_state &st, int64_t n);

// Rows i of a chunk: hc_state [n, n_hc, D] (main model's final HC state at position i), next_tokens [n]
// (t_(i+1)), positions [n] (n_past, n_past+1, ...). logits: [n, n_vocab] or [n_vocab] (last row), or
// empty. hc_out (empty or [n, n_hc, D]): the block's output state of every row, before the MTP head's
// HC collapse (a chained draft feeds it back as the next row's hc_state).
void mtp_forward(const model &main, const mtp_weights &w, mtp_state &st, std::span<const float> hc_state,
                 std::span<const int32_t> next_tokens, std::span<const int64_t> positions,
                 std::span<float> logits, std::span<float> hc_out = {});
// The same rows' effect on the head's state alone (its KV rows: the block's window-only attention is the
// only state it keeps), for rows whose output nothing reads (the drafter catching its history up):
// st ends bit for bit as mtp_forward leaves it, at the cost of the input mixing, the attention half's
// HCPre and the KV projection (no query, attention, MoE or output head).
void mtp_observe(const model &main, const mtp_weights &w, mtp_state &st, std::span<const float> hc_state,
                 std::span<const int32_t> next_tokens, std::span<const int64_t> positions);

}  // namespace fathom::ds4
