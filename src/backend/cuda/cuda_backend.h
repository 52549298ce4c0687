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
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace fathom {

struct cuda_options {
    int device = 0;                   // CUDA device ordinal
    size_t cublas_workspace = 32u << 20;  // bytes reserved for cuBLAS (fixed, so GEMMs can be captured)
};

// True when the CUDA runtime finds at least one usable device (false on a machine with no GPU).
bool cuda_device_available();
// Number of CUDA devices (0 when there is none or no driver).
int cuda_device_count();
// Free and total memory of a device in bytes, and its name (cudaMemGetInfo / device properties).
struct cuda_device_memory {
    size_t free_bytes = 0, total_bytes = 0;
    std::string name;
};
cuda_device_memory cuda_query_memory(int device);
// Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the median of
// `reps` cudaMemcpyAsync copies of `bytes` (two fresh buffers, filled first, one warm-up copy),
// timed with events. The roofline ceiling for memory-bound decode.
double cuda_measure_copy_bandwidth(int device, size_t bytes = size_t{1} << 30, int reps = 10);

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
    // Ends a capture that failed midway (an op threw): the partial graph is discarded.
    virtual void capture_abort() = 0;
    virtual void graph_launch(int id) = 0;
    virtual void graph_destroy(int id) = 0;
    // Incremented whenever a backend-owned scratch buffer (GEMM staging, attention partials, ...) is
    // reallocated: a graph captured at an older epoch holds freed pointers and must be re-captured.
    virtual uint64_t scratch_epoch() const = 0;
    // Make this backend's device the calling thread's current CUDA device (the runtime's current
    // device is per thread; call it when another thread than the creating one issues ops).
    virtual void make_current() = 0;
    // Weights uploaded by map_weights (bytes on the device), for reporting.
    virtual size_t weight_bytes() const = 0;
    // The cudaStream_t the backend enqueues on (as void* to keep this header CUDA-free).
    virtual void *stream() const = 0;
};

// Throws fathom::error when no device is available or the ordinal is out of range.
std::unique_ptr<cuda_backend_api> make_cuda_backend(const cuda_options &opts);
// Graphs launched by all CUDA backends of the process so far (tests use it to see that a path
// really replays graphs rather than falling back to eager launches).
uint64_t cuda_graph_launch_count();

// One forward step recorded as a CUDA graph and replayed at any position. capture() runs `fn` on a
// proxy backend that forwards every op to the CUDA backend, except:
//   get_rows with host ids -> the ids are read from a device buffer that replay() fills (so the
//                             step takes new token ids): successive get_rows calls take
//                             consecutive ids, n_ids in all,
//   download(src, host)    -> a device-to-host copy into pinned staging inside the graph; replay()
//                             copies the staging to the same host pointer afterwards (the host
//                             buffer must outlive the graph and keep its address; at most
//                             staging_bytes in all),
//   synchronize()          -> nothing (replay() synchronizes),
// and with device positions on, so `fn` must pass position 0 wherever it would pass the step's
// position (rope_table p0, kv_store p0, attention n_past): replay(ids, pos) runs it at `pos`.
// A graph captured before a scratch reallocation is stale(): capture again (sizes only grow, so a
// re-capture after any eager run of the same step succeeds). Results equal an eager run bit for bit.
class cuda_step_graph {
public:
    cuda_step_graph(cuda_backend_api &gpu, int64_t n_ids, size_t staging_bytes);
    ~cuda_step_graph();
    cuda_step_graph(const cuda_step_graph &) = delete;
    cuda_step_graph &operator=(const cuda_step_graph &) = delete;

    // Throws (and leaves no graph) when an op cannot be captured, e.g. a scratch buffer that an
    // eager run has not sized yet.
    void capture(const std::function<void(backend &)> &fn);
    bool ready() const { return graph_ >= 0; }
    bool stale() const;
    // Upload ids[0, n_ids), set the step position, replay, wait, copy downloads to their host buffers.
    void replay(const int32_t *ids, int64_t pos);

private:
    struct impl;
    cuda_backend_api &gpu_;
    int64_t n_ids_;
    size_t staging_bytes_;
    int graph_ = -1;
    uint64_t epoch_ = 0;
    std::unique_ptr<impl> impl_;
};

}  // namespace fathom
