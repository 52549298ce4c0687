// All-reduce (reduce to rank 0 in rank order, then broadcast) and broadcast over transport send/recv;
// see collective.h for the determinism and failure contract.
#include "dist/collective.h"

#include <exception>
#include <string>
#include <vector>

#include "core/error.h"

namespace fathom::dist {

namespace {

// Run fn; on failure abort the transport with the reason (peers wake at once) and rethrow.
template <class F>
void abort_on_failure(transport &t, F &&fn) {
    try {
        fn();
    } catch (const std::exception &e) {
        t.abort(e.what());
        throw;
    }
}

}  // namespace

void all_reduce_sum(transport &t, std::span<float> data) {
    const int P = t.size(), r = t.rank();
    if (P == 1) return;
    abort_on_failure(t, [&] {
        if (r == 0) {
            // Sum in rank order: rank 0's values, then rank 1's, ... (the same order for every element).
            std::vector<float> part(data.size());
            for (int q = 1; q < P; ++q) {
                t.recv(q, part.data(), part.size() * sizeof(float));
                for (size_t i = 0; i < data.size(); ++i) data[i] += part[i];
            }
            for (int q = 1; q < P; ++q) t.send(q, data.data(), data.size_bytes());
        } else {
            t.send(0, data.data(), data.size_bytes());
            t.recv(0, data.data(), data.size_bytes());
        }
    });
}

void broadcast(transport &t, int root, void *data, size_t bytes) {
    const int P = t.size(), r = t.rank();
    if (root < 0 || root >= P)
        throw error("dist: broadcast root " + std::to_string(root) + " outside ranks 0.." +
                    std::to_string(P - 1));
    if (P == 1) return;
    abort_on_failure(t, [&] {
        if (r == root) {
            for (int q = 0; q < P; ++q)
                if (q != root) t.send(q, data, bytes);
        } else {
            t.recv(root, data, bytes);
        }
    });
}

}  // namespace fathom::dist
