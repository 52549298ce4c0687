// NCCL transport (see nccl_transport.h): non-blocking communicator, staged host<->device copies,
// deadline + liveness polling and abort.
#include "dist/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace fathom::dist {

namespace {

using clk = std::chrono::steady_clock;

std::string cuda_msg(cudaError_t e) {
    return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

class nccl_endpoint final : public transport {
  public:
    // `live`: the joined liveness side channel, or null (bare id: no side channel).
    nccl_endpoint(int rank, int size, const ncclUniqueId &id, const nccl_options &o, std::unique_ptr<liveness> live)
        : rank_(rank), size_(size), device_(o.device), timeout_(o.timeout), live_(std::move(live)) {
        check_cuda(cudaSetDevice(device_), "cudaSetDevice");
        check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;  // calls return ncclInProgress; completion is polled with a deadline
        ncclResult_t r = ncclCommInitRankConfig(&comm_, size, id, rank, &cfg);
        if (r != ncclSuccess && r != ncclInProgress) fail_nccl(r, "communicator init");
        wait_comm("communicator init", true, clk::now(), " (are all " + std::to_string(size) + " ranks started?)");
    }

    ~nccl_endpoint() override {
        // A clean stop says goodbye on the side channel, so peers do not report this exit as a death.
        // Destroyed while an exception unwinds (this rank failed outside the transport) or after
        // abort(): no goodbye, the peers fail at once instead of waiting for a rank that is leaving.
        if (live_ && !aborted_.load() && std::uncaught_exceptions() == 0) live_->say_bye();
        if (comm_ && !aborted_.load()) ncclCommAbort(comm_);  // never blocks on a peer that may be gone
        if (buf_) cudaFree(buf_);
        if (stream_) cudaStreamDestroy(stream_);
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }

    void send(int peer, const void *data, size_t bytes) override {
        std::lock_guard<std::mutex> lock(mu_);
        begin(peer, "send to");
        reserve(bytes);
        check_cuda(cudaMemcpyAsync(buf_, data, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
        const ncclResult_t r = ncclSend(buf_, bytes, ncclUint8, peer, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) fail_nccl(r, "ncclSend to rank " + std::to_string(peer));
        const std::string what = "sending " + std::to_string(bytes) + " bytes to rank " + std::to_string(peer);
        const auto t0 = clk::now();
        wait_comm(what, true, t0);  // enqueued (non-blocking NCCL), then delivered
        wait_stream(what, true, t0);
    }

    void recv(int peer, void *data, size_t bytes) override { receive(peer, data, bytes, true); }
    void recv_idle(int peer, void *data, size_t bytes) override { receive(peer, data, bytes, false); }

    void abort(const std::string &why) override {
        bool expected = false;
        if (!aborted_.compare_exchange_strong(expected, true)) return;
        {
            std::lock_guard<std::mutex> lock(why_mu_);
            why_ = why.empty() ? "aborted" : why;
        }
        // The peers learn the reason over the side channel (NCCL cannot carry it). ncclCommAbort may be
        // called while another thread waits in this endpoint: the waiter's next poll sees aborted_ and
        // throws.
        if (live_) live_->say_abort(why_);
        if (comm_) ncclCommAbort(comm_);
    }

  private:
    void receive(int peer, void *data, size_t bytes, bool deadline) {
        std::lock_guard<std::mutex> lock(mu_);
        begin(peer, "receive from");
        reserve(bytes);
        const ncclResult_t r = ncclRecv(buf_, bytes, ncclUint8, peer, comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) fail_nccl(r, "ncclRecv from rank " + std::to_string(peer));
        const std::string what = "waiting for " + std::to_string(bytes) + " bytes from rank " + std::to_string(peer);
        const auto t0 = clk::now();
        wait_comm(what, deadline, t0);  // enqueued (non-blocking NCCL), then arrived
        wait_stream(what, deadline, t0);
        check_cuda(cudaMemcpyAsync(data, buf_, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
        wait_stream("copying a received message", true, clk::now());
    }

    void begin(int peer, const char *what) {
        if (aborted_.load()) throw error("dist: rank " + std::to_string(rank_) + " aborted: " + reason());
        poll_live();
        if (peer < 0 || peer >= size_ || peer == rank_)
            throw error("dist: rank " + std::to_string(rank_) + " cannot " + what + " rank " + std::to_string(peer) +
                        " (ranks 0.." + std::to_string(size_ - 1) + ", not itself)");
    }

    void reserve(size_t bytes) {
        if (bytes <= cap_) return;
        if (buf_) check_cuda(cudaFree(buf_), "cudaFree");
        buf_ = nullptr;
        cap_ = 0;
        check_cuda(cudaMalloc(&buf_, bytes), "cudaMalloc of a " + std::to_string(bytes) + "-byte staging buffer");
        cap_ = bytes;
    }

    std::string reason() {
        std::lock_guard<std::mutex> lock(why_mu_);
        return why_;
    }

    // Poll until the stream drains; NCCL errors, abort() and the deadline (from t0) end the wait with
    // an error.
    void wait_stream(const std::string &what, bool deadline, clk::time_point t0) {
        for (;;) {
            if (aborted_.load()) throw error("dist: rank " + std::to_string(rank_) + " aborted: " + reason());
            const cudaError_t e = cudaStreamQuery(stream_);
            if (e == cudaSuccess) return;
            if (e != cudaErrorNotReady) fatal("dist: rank " + std::to_string(rank_) + ": CUDA error " + cuda_msg(e) +
                                              " while " + what);
            poll_async(what);
            poll_live();
            if (deadline && clk::now() - t0 > timeout_)
                fatal("dist: rank " + std::to_string(rank_) + " timed out after " + std::to_string(timeout_.count()) +
                      " ms " + what);
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    // Non-blocking NCCL: a call that returned ncclInProgress (init; a send/recv, which may first
    // connect to its peer) has finished -- for a send/recv: is enqueued on the stream -- only when
    // ncclCommGetAsyncError reports ncclSuccess. Before that the stream looks idle (a receiver would
    // read a stale buffer) and NCCL refuses the next call, so every call waits here first (first run
    // on 2 GPUs, docs/dist.md). abort(), NCCL errors and the deadline (from t0) end the wait.
    void wait_comm(const std::string &what, bool deadline, clk::time_point t0, const std::string &hint = "") {
        for (;;) {
            if (aborted_.load()) throw error("dist: rank " + std::to_string(rank_) + " aborted: " + reason());
            ncclResult_t st = ncclSuccess;
            const ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
            if (r != ncclSuccess) fail_nccl(r, what);
            if (st == ncclSuccess) return;
            if (st != ncclInProgress) fail_nccl(st, what);
            poll_live();
            if (deadline && clk::now() - t0 > timeout_)
                fatal("dist: rank " + std::to_string(rank_) + " timed out after " + std::to_string(timeout_.count()) +
                      " ms " + (hint.empty() ? what : "in " + what + hint));
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    void poll_async(const std::string &what) {
        ncclResult_t st = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
        if (r != ncclSuccess) fail_nccl(r, what);
        if (st != ncclSuccess && st != ncclInProgress) fail_nccl(st, what);
    }

    // A peer process that exited or aborted (side channel, non-blocking): abort and throw its reason.
    void poll_live() {
        if (!live_) return;
        if (auto why = live_->check()) fatal(*why);
    }

    [[noreturn]] void fail_nccl(ncclResult_t r, const std::string &what) {
        std::string last = comm_ ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
        for (char &c : last)
            if (c == '\n' || c == '\r') c = ' ';
        fatal("dist: rank " + std::to_string(rank_) + ": NCCL " + ncclGetErrorString(r) + " in " + what +
              (last.empty() ? "" : ": " + last));
    }

    // Abort the communicator (peers waiting on this rank fail instead of hanging) and throw.
    [[noreturn]] void fatal(const std::string &msg) {
        abort(msg);
        throw error(msg);
    }

    void check_cuda(cudaError_t e, const std::string &what) {
        if (e != cudaSuccess) fatal("dist: rank " + std::to_string(rank_) + ": " + what + ": " + cuda_msg(e));
    }

    int rank_, size_, device_;
    std::chrono::milliseconds timeout_;
    cudaStream_t stream_ = nullptr;
    ncclComm_t comm_ = nullptr;
    void *buf_ = nullptr;
    size_t cap_ = 0;
    std::mutex mu_;  // one operation at a time (abort() may come from another thread)
    std::atomic<bool> aborted_{false};
    std::mutex why_mu_;
    std::string why_;
    std::unique_ptr<liveness> live_;  // null without a side channel (bare id)
};

constexpr size_t id_hex_len = 2 * sizeof(ncclUniqueId::internal);

ncclUniqueId parse_id(const std::string &hex) {
    ncclUniqueId id;
    if (hex.size() != id_hex_len)
        throw error("dist: nccl id must be " + std::to_string(id_hex_len) + " hex characters (+ \"@host:port\"), got " +
                    std::to_string(hex.size()));
    for (size_t i = 0; i < sizeof(id.internal); ++i) {
        unsigned v = 0;
        if (std::sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1)
            throw error("dist: nccl id has a non-hex character near offset " + std::to_string(2 * i));
        id.internal[i] = static_cast<char>(v);
    }
    return id;
}

// The liveness token of a rendezvous: FNV-1a of the hex id, so rank 0 ignores connections of other runs.
std::string id_token(const std::string &hex) {
    uint64_t h = 1469598103934665603ull;
    for (char c : hex) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    char b[17];
    std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(h));
    return b;
}

void check_join(int rank, int size, const nccl_options &o) {
    ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast off unless the user chose otherwise
    if (size < 1 || rank < 0 || rank >= size)
        throw error("dist: nccl rank " + std::to_string(rank) + " of " + std::to_string(size) + " is out of range");
    if (o.timeout.count() <= 0) throw error("dist: nccl timeout must be positive");
}

}  // namespace

std::string nccl_new_id() {
    ::setenv("NCCL_NVLS_ENABLE", "0", 0);
    ncclUniqueId id;
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) throw error(std::string("dist: ncclGetUniqueId: ") + ncclGetErrorString(r));
    std::string hex;
    char b[3];
    for (size_t i = 0; i < sizeof(id.internal); ++i) {
        std::snprintf(b, sizeof b, "%02x", static_cast<unsigned char>(id.internal[i]));
        hex += b;
    }
    return hex;
}

nccl_root::nccl_root(const nccl_options &o)
    : listener_(std::make_unique<liveness_listener>(o.liveness_host)) {
    id_ = nccl_new_id() + "@" + listener_->address();
}

std::unique_ptr<transport> make_nccl_transport(nccl_root &&root, int size, const nccl_options &o) {
    check_join(0, size, o);
    if (!root.listener_) throw error("dist: nccl_root was already used to join");
    const std::string hex = root.id_.substr(0, root.id_.find('@'));
    const ncclUniqueId id = parse_id(hex);
    // Every other rank connects before it starts NCCL init, so this is bounded by the same deadline.
    auto live = liveness::accept_ranks(*root.listener_, id_token(hex), size, o.timeout);
    root.listener_.reset();  // no later connections
    return std::make_unique<nccl_endpoint>(0, size, id, o, std::move(live));
}

std::unique_ptr<transport> make_nccl_transport(int rank, int size, const std::string &id_text, const nccl_options &o) {
    check_join(rank, size, o);
    const size_t at = id_text.find('@');
    const std::string hex = id_text.substr(0, at);
    const ncclUniqueId id = parse_id(hex);
    std::unique_ptr<liveness> live;
    if (at != std::string::npos) {
        if (rank == 0)
            throw error("dist: nccl rank 0 joins through its nccl_root (it owns the liveness listener), not an id string");
        live = liveness::connect_root(id_text.substr(at + 1), id_token(hex), rank, size, o.timeout);
    }
    return std::make_unique<nccl_endpoint>(rank, size, id, o, std::move(live));
}

}  // namespace fathom::dist
