// The dense engine (engine.cpp) on one GPU: the CUDA backend its forward runs on, and a session's
// single-token decode step captured as a graph and replayed at every position. engine.cpp calls only
// this interface; the CUDA implementation is engine/cuda/dense_gpu_cuda.cpp (CUDA builds only), and
// a build without CUDA gets engine/no_cuda/engine_no_cuda.cpp's make_dense_gpu, which throws.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "backend/backend.h"

namespace fathom {

// One forward step recorded once and replayed at any position (cuda_step_graph with one token id, see
// backend/cuda/cuda_backend.h): capture() runs `fn` on a proxy backend with every position passed as
// 0; replay(id, pos) runs it for token `id` at position `pos` and copies the step's downloads to their
// host buffers. A graph captured before a scratch reallocation is stale(): capture again.
class dense_step_graph {
  public:
    virtual ~dense_step_graph() = default;
    // Throws (and leaves no graph) when an op cannot be captured.
    virtual void capture(const std::function<void(backend &)> &fn) = 0;
    virtual bool ready() const = 0;
    virtual bool stale() const = 0;
    virtual void replay(const int32_t *id, int64_t pos) = 0;
};

class dense_gpu {
  public:
    virtual ~dense_gpu() = default;
    // The CUDA backend (owned here): the engine loads its weights on it and runs every forward there.
    virtual backend &be() = 0;
    // Make the device the calling thread's current one (the CUDA runtime's current device is per thread).
    virtual void make_current() = 0;
    // A step graph whose downloads total at most staging_bytes.
    virtual std::unique_ptr<dense_step_graph> new_step_graph(size_t staging_bytes) = 0;
};

// The CUDA backend on device `ordinal` (its context and cuBLAS workspace created). Throws
// fathom::error when the device cannot be used, or when the build has no CUDA backend.
std::unique_ptr<dense_gpu> make_dense_gpu(int ordinal);
// The CUDA backend of device `ordinal` alone (PFlash's token scorer runs its forward there). Throws when the
// build has no CUDA backend.
std::unique_ptr<backend> make_gpu_backend(int ordinal);

}  // namespace fathom
