// Collectives over a dist::transport (built from its point-to-point send/recv, so they run over the
// in-process hub and over NCCL alike): the all-reduce of the tensor-parallel DS4 forward (src/dist/tp.*)
// and a broadcast.
//
// Determinism: all_reduce_sum gives every rank the SAME bits (rank 0 sums the vectors in rank order,
// ((x0 + x1) + x2) + ..., then sends the sum to every rank), which is what keeps replicated state (the
// hyper-connection streams of every rank) identical across ranks. A ring or tree all-reduce would be
// faster for large vectors; DS4's per-sublayer vectors are [n, D] (16 KiB per token at D = 4096), so
// latency, not bandwidth, dominates at decode.
//
// Failures follow the transport contract: every wait has the transport's deadline, and a rank whose
// collective fails (timeout, a peer's failure, a size mismatch) aborts its transport with the one-line
// reason before rethrowing, so the other ranks' waits end at once instead of at their deadlines.
// Every rank must call the same collectives in the same order with the same sizes.
#pragma once
#include <cstddef>
#include <span>

#include "dist/transport.h"

namespace fathom::dist {

// data [n] on every rank -> the element-wise sum over all ranks, identical bits on every rank.
// One rank: unchanged. Throws fathom::error (after aborting the transport) on any failure.
void all_reduce_sum(transport &t, std::span<float> data);

// `bytes` bytes at `data` on rank `root` -> the same bytes on every rank.
void broadcast(transport &t, int root, void *data, size_t bytes);

}  // namespace fathom::dist
