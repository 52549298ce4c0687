// DS4 DSpark drafter (DeepSeek-V4-Flash-DSpark's three-stage `mtp.*` head; spec section 7 and
// ../shared/golden/ds4-tiny-dspark/README.md, which is normative for the computation below).
//
// One draft block: target features (the mean of the HC streams after each capture layer, concatenated)
// of the last `window` positions before the seed are projected to main_x; the block input is the seed
// token followed by block_size - 1 noise tokens, embedded with the target's table; `n_stages` DS4
// blocks with window-only attention run over it, each query row attending bidirectionally to every
// context row (K = V = the stage's kv projection of main_x) and every block row; the HC head, the
// drafter's final norm and the target's output head give the base logits; a rank-r Markov bias
// conditioned on the previous draft token (greedy chain from the seed) corrects them; a linear
// confidence head reads the pre-norm head output and the Markov embedding.
//
// File layout: lucebox's `deepseek4-dflash-draft` GGUF (metadata and tensors listed in docs/ds4.md,
// "DSpark drafter"). The drafter holds no embedding and no output head: both are the target's.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "models/deepseek4.h"

namespace fathom::ds4 {

// Drafter settings read from the GGUF metadata (`deepseek4-dflash-draft.dflash.*`).
struct dspark_config {
    int n_stages = 0;         // block_count
    int block_size = 0;       // dflash.block_size: rows per draft block (seed + noise)
    int32_t noise_token = 0;  // dflash.mask_token_id
    int window = 0;           // attention.sliding_window: context rows a block attends to
    int markov_rank = 0;      // dflash.dspark.markov_rank
    // dflash.capture_layer_ids: 0-based target layers; the features are concatenated in this order.
    std::vector<int> target_layers;
};

struct dspark_weights {
    std::shared_ptr<const gguf::file> file;  // keeps the mapping alive
    // The stages' hyper-parameters: the drafter's own keys (heads, experts, eps, RoPE base, window);
    // embedding_length, vocab_size and hyper_connection.count equal the target's (checked at load).
    hparams hp;
    dspark_config cfg;
    std::vector<layer_weights> stages;  // [n_stages], ratio 0, learned routing + bias
    matrix fc;                          // [D, n_feat*D]  dflash.fc.weight
    std::vector<float> hidden_norm;     // [D]            dflash.hidden_norm.weight
    hc_weights hc_head;                 // the last stage's own HC collapse (output_hc_*)
    std::vector<float> output_norm;     // [D]
    matrix markov_w1;                   // [V, r] embedding table, row = previous token
    matrix markov_w2;                   // [V, r] bias head: B = W2 . W1[x]
    std::vector<float> conf_w;          // [D + r] confidence weights (z first, then the Markov embedding)
    float conf_bias = 0;                // dflash.dspark.confidence.bias (0 when absent, as lucebox writes)
    int64_t feature_dim() const { return static_cast<int64_t>(cfg.target_layers.size()) * hp.n_embd; }
};

// Load a DSpark drafter for `target`; throws fathom::error with a one-line message naming the key or
// tensor that is missing, malformed or does not match the target.
std::unique_ptr<dspark_weights> load_dspark(const model &target, std::shared_ptr<const gguf::file> f);
std::unique_ptr<dspark_weights> load_dspark(const model &target, const std::string &path);

// Run the target over a chunk (positions st.n_past, st.n_past+1, ...; st advances) layer by layer
// and capture the drafter's features: features [n, feature_dim()] with row i = concat over
// cfg.target_layers of the mean of the n_hc streams after that layer. logits (optional, may be
// empty): [n, n_vocab] or [n_vocab] as forward() returns them; the same bits as forward().
void dspark_capture(const model &target, const dspark_weights &w, state &st, std::span<const int32_t> tokens,
                    std::span<const int64_t> positions, std::span<float> features,
                    std::span<float> logits = {});

// One draft block (all [rows, cols] row-major; B = block_size, V = n_vocab, D = n_embd).
struct dspark_block {
    int64_t seed_pos = 0;                 // S: position of the seed (row j sits at S + j)
    std::vector<int64_t> ctx_positions;   // context rows used: the last min(window, n) given
    std::vector<int32_t> input_ids;       // [B] seed, then noise tokens
    std::vector<float> hc_head_out;       // [B, D] z_j = HCHead(X_j), before the final norm
    std::vector<float> base_logits;       // [B, V] U_j
    std::vector<float> corrected_logits;  // [B, V] U_j + W2 . W1[x_j]
    std::vector<int32_t> markov_prev;     // [B] x_0..x_(B-1): the Markov inputs (x_0 = seed)
    std::vector<int32_t> draft_tokens;    // [B] argmax of each corrected row (x_1..x_B when greedy)
    std::vector<float> confidence_logit;  // [B] w_conf . concat(z_j, W1[x_j]) + bias
    std::vector<float> confidence;        // [B] sigmoid of it
};

// The context side of the drafter kept per position: each stage's K/V row of main_x(p) (RMSNorm, RoPE at p,
// QAT as the stage attention makes them) for the positions observed, in position-indexed rings of window +
// block_size + max_rollback + 1 rows, so a rollback of up to max_rollback positions finds the rows before it
// intact and a draft computes only its block rows (what cuda_dspark keeps on the GPU). A row depends on its
// position's features alone, so the rows are those dspark_draft computes from the features, bit for bit.
struct dspark_context {
    int64_t rows = 0;                     // ring rows
    std::vector<int64_t> pos;             // [rows] the position a ring row holds (-1: none)
    std::vector<std::vector<float>> kv;   // [n_stages][rows * head_dim]
};
dspark_context new_dspark_context(const dspark_weights &w);
// Positions p0 .. p0 + n - 1 with their features [n, feature_dim()] (only the last `window` can be read by a
// later block, so only those are computed); dspark_truncate forgets positions >= n.
void dspark_observe(const dspark_weights &w, qat_mode qat, const exec_options &exec, dspark_context &c, int64_t p0,
                    std::span<const float> features);
void dspark_truncate(dspark_context &c, int64_t n);
// One block after S positions with seed_token at S; the context is the longest run of observed positions
// ending at S - 1, at most `window` long. markov_inputs as dspark_draft's.
dspark_block dspark_draft_at(const model &target, const dspark_weights &w, qat_mode qat, const exec_options &exec,
                             const dspark_context &c, int64_t S, int32_t seed_token,
                             std::span<const int32_t> markov_inputs = {});

// Draft one block after a sequence of S = ctx_pos0 + n tokens: ctx_features [n, feature_dim()] are
// the features of positions ctx_pos0 .. S-1 (only the last min(window, n) are used, so passing a
// whole sequence or just its window gives the same block); seed_token is the token at position S.
// markov_inputs: empty = greedy chain (x_(j+1) = argmax corrected_j), else B ids used as x_0..x_(B-1)
// (teacher forcing). qat == full applies the FP8 round trip to the stages' KV rows (dims before the
// RoPE tail), as the official code's act_quant; fp4only and off do not.
dspark_block dspark_draft(const model &target, const dspark_weights &w, qat_mode qat,
                          const exec_options &exec, std::span<const float> ctx_features, int64_t ctx_pos0,
                          int32_t seed_token, std::span<const int32_t> markov_inputs = {});

}  // namespace fathom::ds4
