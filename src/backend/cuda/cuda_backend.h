// The CUDA backend: backend.h implemented by kernels enqueued on one CUDA stream, plus the extras a
// decode loop needs to run as a replayed CUDA graph (device-resident step position, device token
// ids, graph capture/replay). Only compiled with -DFATHOM_CUDA=ON; this header has no CUDA includes
// so host code can use it from plain C++ translation units.
//
// Device-resident positions (for CUDA graphs). A captured graph bakes every kernel argument, so a
// graph that must be replayed at a new position cannot take the position as a host value. The
// backend owns one device int64 "step position" S. With set_device_positions(true), the host
// positions given to rope_table (p0), kv_store (p0) and attention (n_past) are OFFSETS added to S
// when the kernel runs: a decode step captured with offsets 0 replays at any position after
// set_step_pos(pos). Positions that land outside the cache are caught on the device (the op writes
// nothing out of bounds) and reported by the next synchronize()/download() as a fathom::error.
#pragma once
#include <cstdint>
#include <memory>

#include "backend/backend.h"

namespace fathom {

struct cuda_options {
    int device = 0;                   // CUDA device ordinal
    size_t cublas_workspace = 32u << 20;  // bytes reserved for cuBLAS (fixed, so GEMMs can be captured)
};

// True when the CUDA runtime finds at least one usable device (false on a machine with no GPU).
bool cuda_device_available();

class cuda_backend_api : public backend {
public:
    // ---- CUDA-graph support --------------------------------------------------------------------
    // See the file banner. Switching mode is a host-side flag read when ops are enqueued.
    virtual void set_device_positions(bool on) = 0;
    // Enqueue "S = pos" on the stream (ordered with the ops around it). Throws while capturing.
    virtual void set_step_pos(int64_t pos) = 0;
    // get_rows with ids already in device memory (n int32s at dev_ids); ids outside the table are
    // reported by the next synchronize() and their rows are left untouched.
    virtual void get_rows_device(const tensor &table, const int32_t *dev_ids, int64_t n, const tensor &out) = 0;
    // Capture every op enqueued between capture_begin() and capture_end() into a graph; returns its
    // id for graph_launch(). Ops are not executed while capturing.
    virtual void capture_begin() = 0;
    virtual int capture_end() = 0;
    virtual void graph_launch(int id) = 0;
    // Weights uploaded by map_weights (bytes on the device), for reporting.
    virtual size_t weight_bytes() const = 0;
    // The cudaStream_t the backend enqueues on (as void* to keep this header CUDA-free).
    virtual void *stream() const = 0;
};

// Throws fathom::error when no device is available or the ordinal is out of range.
std::unique_ptr<cuda_backend_api> make_cuda_backend(const cuda_options &opts);

}  // namespace fathom
