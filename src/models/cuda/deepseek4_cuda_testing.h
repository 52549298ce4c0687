// Test and benchmark hooks of DS4 on one CUDA device (deepseek4_cuda.h; defined in
// deepseek4_cuda_testing.cpp): switches of the decode step's parallel attention branches, a sequence
// made deep without evaluating it, a profiled step, a greedy step and the graph replay count. Only
// tests/ and bench/ include this header (and the implementation, for cuda_test_options); the engine
// never calls these.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/cuda/deepseek4_cuda.h"

namespace fathom::ds4::cuda_testing {

// Switches of the decode step (cuda_run_options' test-only counterpart). The step's attention runs its
// independent sub-chains on parallel branches (side streams forked and joined with events, captured into
// the step graph as parallel graph branches): the KV row + compressor, and the indexer, beside the query
// path.
struct cuda_test_options {
    // true: every launch on the one stream in issue order (tests compare the two bitwise;
    // profile_step is always serial).
    bool serial_step = false;
    // A device pause of this many ns at the start of each branch (> 0: on the side streams, exposing a
    // missing join; < 0: on the main stream's query path, exposing a side branch that reads the query
    // projections without waiting for them). Results do not change.
    int64_t branch_delay_ns = 0;
};

// cuda_upload (deepseek4_cuda.h) with the test switches t, which every sequence on these weights follows.
std::shared_ptr<const cuda_weights> cuda_upload(const model &m, const cuda_run_options &o,
                                                const cuda_test_options &t,
                                                const std::function<void(uint64_t, uint64_t)> &progress = {});

// Benchmarks: make the sequence look n tokens deep without evaluating them. The raw ring, the n / R
// compressed rows and the n / 4 indexer rows of every layer are filled with seeded N(0, 1) values
// (compressor frontiers stay empty) and n_past becomes n, so the next decode step does exactly the work
// (rows scored, selected and attended) of a real step at position n. The logits that follow are
// meaningless; reset() before real use.
void fill_synthetic(cuda_sequence &seq, int64_t n, uint64_t seed);
// Profiling: one eager decode step of `token` with device events between its phases (the host enqueues
// the whole step behind a device-side pause first, so phases run back to back). Returns (phase,
// milliseconds) summed over layers, in first-seen order; advances n_past.
std::vector<std::pair<std::string, float>> profile_step(cuda_sequence &seq, int32_t token);
// Evaluate one token and return the argmax of its logits (computed on the device; ties: lower id).
int32_t step_greedy(cuda_sequence &seq, int32_t token);
// Number of decode steps replayed from the captured graph (tests check graphs are really used).
uint64_t graph_replays(const cuda_sequence &seq);

}  // namespace fathom::ds4::cuda_testing
