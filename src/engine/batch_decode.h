// Continuous-batching decode for the dense family: ONE forward pass that evaluates one new token
// for each of B independent sequences (each with its own KV cache and position). Every weight
// matmul runs with M = B rows (the speed-up: the weights are streamed once for all sequences);
// RoPE uses each row's own position; K/V are stored into and attention reads from each sequence's
// own cache. Every per-row operation is the same one dense_forward() applies to a single decode
// token, so a sequence's logits are bit-identical to a single-session eval of the same token as long
// as the backend's ops compute rows independently (tests/models/test_batch_decode.cpp checks it).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "models/dense.h"

namespace fathom {

// One sequence of a batched decode step.
struct dense_batch_seq {
    dense_kv kv;              // the sequence's cache or paged-pool sequence; positions [0, pos) hold its past
    int64_t pos = 0;          // position of the new token
    int32_t token = 0;        // the new token
    float *logits = nullptr;  // out: [n_vocab] logits of the new token (host)
};

class dense_batch_decoder {
public:
    dense_batch_decoder(const dense_model &m, backend &be);
    ~dense_batch_decoder();
    dense_batch_decoder(const dense_batch_decoder &) = delete;
    dense_batch_decoder &operator=(const dense_batch_decoder &) = delete;

    // Evaluate seqs[i].token at seqs[i].pos against seqs[i].kv for all i in one forward pass and
    // write its logits. The caches (pool sequences) must be distinct; position pos must be inside
    // the cache (paged: inside the blocks the sequence's table holds). A contiguous cache's n_used
    // is raised to pos + 1. Not thread-safe (the engine serialises forward calls).
    void run(std::span<const dense_batch_seq> seqs);

private:
    const dense_model &m_;
    backend &be_;
    std::unique_ptr<dense_scratch> s_;  // activations for up to s_->n_batch sequences (grown on demand)
    std::vector<std::vector<uint8_t *>> blocks_;  // [B] paged sequences' block addresses (reused)
    std::vector<kv_pages> pages_;                 // [B] one layer's pages of every sequence (all paged)
    std::vector<int64_t> past_;                   // [B] every sequence's position
};

}  // namespace fathom
