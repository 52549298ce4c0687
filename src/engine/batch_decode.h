// Continuous-batching forward for the dense family: ONE forward pass that evaluates the new tokens
// of B independent sequences, each with its own KV cache and position. Sequence i contributes
// n_i >= 1 consecutive tokens: one for a decoding request, a prompt chunk for a prefilling one.
// Every weight matmul runs with M = sum(n_i) rows (the speed-up: the weights are streamed once for
// all sequences); RoPE uses each row's own position; K/V are stored into and attention reads from
// each sequence's own cache. Logits are computed only for the last row of the sequences that ask
// for them (a decode, a prompt's final chunk), not for every prompt row.
// Every per-row operation is the one dense_forward() applies to the same tokens of a single
// session, and a sequence's attention runs over its own rows only, so its logits are bit-identical
// to a single-session evaluation of the same tokens as long as the backend's ops compute rows
// independently (the CPU backend's batch-invariant mode; tests/server/test_batch_decode.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "models/dense.h"

namespace fathom {

// One sequence of a batched step.
struct dense_batch_seq {
    dense_kv kv;                       // the sequence's cache or paged-pool sequence; positions [0, pos) hold its past
    int64_t pos = 0;                   // position of tokens[0]
    std::span<const int32_t> tokens;   // [n_i >= 1] new tokens, at positions [pos, pos + n_i)
    float *logits = nullptr;           // out: [n_vocab] logits of tokens.back() (host); null: not wanted
    // out: [n_rows, n_vocab] logits of the last n_rows tokens (a speculative verification); null: none.
    // Not together with `logits` (rows' last row is tokens.back()'s).
    float *rows = nullptr;
    int64_t n_rows = 0;
};

class dense_batch_decoder {
public:
    dense_batch_decoder(const dense_model &m, backend &be);
    ~dense_batch_decoder();
    dense_batch_decoder(const dense_batch_decoder &) = delete;
    dense_batch_decoder &operator=(const dense_batch_decoder &) = delete;

    // Evaluate seqs[i].tokens at positions [pos, pos + n_i) against seqs[i].kv for all i in one
    // forward pass and write the logits asked for. The caches (pool sequences) must be distinct;
    // the positions must be inside the cache (paged: inside the blocks the sequence's table holds).
    // A contiguous cache's n_used is raised to pos + n_i. Not thread-safe (the engine serialises
    // forward calls). Activations grow with sum(n_i): the caller bounds the rows per call.
    void run(std::span<const dense_batch_seq> seqs);

private:
    void attend(std::span<const dense_batch_seq> seqs, int32_t il, bool swa);
    void output(std::span<const dense_batch_seq> seqs);

    const dense_model &m_;
    backend &be_;
    std::unique_ptr<dense_scratch> s_;  // activations for up to s_->n_batch rows (grown on demand)
    int64_t n_rows_ = 0;                // rows of the current run
    bool all_paged_ = false;            // every sequence of the current run is paged
    int64_t n_single_ = 0;              // leading sequences with one row each (rows [0, n_single_))
    std::vector<int64_t> row0_;                   // [B] first row of every sequence in the activations
    std::vector<int32_t> ids_;                    // [rows] token ids, row order
    std::vector<std::vector<uint8_t *>> blocks_;  // [B] paged sequences' block addresses (reused)
    std::vector<kv_pages> pages_;                 // [B] one layer's pages of every sequence (all paged)
    std::vector<int64_t> past_;                   // [B] every sequence's first position
};

}  // namespace fathom
