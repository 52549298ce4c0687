// DS4 layer pipeline over a dist::transport (see pipeline.h for the protocol): rank 0 drives and
// embeds, every rank runs ds4::forward_layers on its own blocks, the last rank runs the head and
// returns the logits to rank 0.
#include "dist/pipeline.h"

#include <algorithm>

#include "core/error.h"
#include "dist/gpu_stage.h"
#include "dist/local_group.h"

namespace fathom::dist {

namespace {

// No op is 0: a zeroed or never-written buffer is a bad header, not a stop (a transport bug once
// delivered zeros; docs/dist.md).
enum op : int64_t { op_forward = 1, op_reset = 2, op_stop = 3 };
enum logits_mode : int64_t { logits_none = 0, logits_last = 1, logits_all = 2 };
constexpr size_t header_len = 4;

}  // namespace

void check_ranges(const std::vector<layer_range> &ranges, int n_layer) {
    if (ranges.empty()) throw error("dist: no layer ranges");
    int next = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
        const auto &r = ranges[i];
        if (r.first != next || r.last <= r.first || r.last > n_layer)
            throw error("dist: layer range " + std::to_string(i) + " = [" + std::to_string(r.first) + ", " +
                        std::to_string(r.last) + ") does not continue at layer " + std::to_string(next) +
                        " with at least one of the model's " + std::to_string(n_layer) + " layers");
        next = r.last;
    }
    if (next != n_layer)
        throw error("dist: layer ranges end at layer " + std::to_string(next) + ", the model has " +
                    std::to_string(n_layer));
}

std::vector<layer_range> even_ranges(int n_layer, int parts) {
    if (parts < 1 || parts > n_layer)
        throw error("dist: cannot split " + std::to_string(n_layer) + " layers into " + std::to_string(parts) +
                    " non-empty ranges");
    std::vector<layer_range> out;
    int first = 0;
    for (int i = 0; i < parts; ++i) {
        const int len = n_layer / parts + (i < n_layer % parts ? 1 : 0);
        out.push_back({first, first + len});
        first += len;
    }
    return out;
}

pipeline_rank::pipeline_rank(const ds4::model &m, std::vector<layer_range> ranges, transport &t,
                             ds4::qat_mode qat, kv_precision kv, ds4::exec_options exec, stage_device dev)
    : m_(m), ranges_(std::move(ranges)), t_(t), rank_(t.rank()), qat_(qat), kv_(kv), exec_(exec), dev_(dev) {
    check_ranges(ranges_, static_cast<int>(m_.layers.size()));
    if (static_cast<int>(ranges_.size()) != t_.size())
        throw error("dist: " + std::to_string(ranges_.size()) + " layer ranges for " + std::to_string(t_.size()) +
                    " ranks");
    if (dev_.cuda_device >= 0) gpu_ = make_gpu_stage(m_, dev_, range(), qat, kv);
    fresh_state();
}

pipeline_rank::~pipeline_rank() = default;

void pipeline_rank::gpu_layers(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                               std::span<float> x, std::span<float> logits) {
    for (size_t i = 0; i < positions.size(); ++i)
        if (positions[i] != n_past_ + static_cast<int64_t>(i))
            throw error("dist: rank " + std::to_string(rank_) + ": position " + std::to_string(positions[i]) +
                        " at index " + std::to_string(i) + ", expected " +
                        std::to_string(n_past_ + static_cast<int64_t>(i)));
    gpu_->eval(tokens, x, logits);
    n_past_ += static_cast<int64_t>(tokens.size());
}

void pipeline_rank::fresh_state() {
    if (gpu_) {
        gpu_->reset();
        n_past_ = 0;
        return;
    }
    layers_.clear();
    for (int il = range().first; il < range().last; ++il)
        layers_.push_back(ds4::new_layer_state(m_.hp, m_.layers[static_cast<size_t>(il)], kv_));
    n_past_ = 0;
}

void pipeline_rank::run_layers(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                               std::span<float> x) {
    for (size_t i = 0; i < positions.size(); ++i)
        if (positions[i] != n_past_ + static_cast<int64_t>(i))
            throw error("dist: rank " + std::to_string(rank_) + ": position " + std::to_string(positions[i]) +
                        " at index " + std::to_string(i) + ", expected " +
                        std::to_string(n_past_ + static_cast<int64_t>(i)));
    ds4::forward_layers(m_, layers_, qat_, exec_, range().first, range().last, tokens, positions, x);
    n_past_ += static_cast<int64_t>(tokens.size());
}

void pipeline_rank::send_on(const int64_t *hdr, std::span<const int32_t> tokens, std::span<const int64_t> positions,
                            std::span<const float> x) {
    const int next = rank_ + 1;
    t_.send(next, hdr, header_len * sizeof(int64_t));
    if (hdr[0] != op_forward) return;
    t_.send(next, tokens.data(), tokens.size_bytes());
    t_.send(next, positions.data(), positions.size_bytes());
    t_.send(next, x.data(), x.size_bytes());
}

void pipeline_rank::forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                            std::span<float> logits) {
    begin_forward(tokens, positions, logits);
    finish_forward();
}

void pipeline_rank::begin_forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                                  std::span<float> logits) {
    if (rank_ != 0) throw error("dist: forward() is for rank 0, called on rank " + std::to_string(rank_));
    if (pending_) throw error("dist: a forward is already outstanding on this pipeline (finish it first)");
    const size_t n = tokens.size(), V = static_cast<size_t>(m_.hp.n_vocab);
    const size_t S = static_cast<size_t>(m_.hp.n_hc) * static_cast<size_t>(m_.hp.n_embd);
    if (positions.size() != n)
        throw error("dist: " + std::to_string(n) + " tokens but " + std::to_string(positions.size()) + " positions");
    if (n == 0) {
        pending_ = std::span<float>();  // nothing was sent: nothing comes back
        return;
    }
    const int64_t mode = logits.empty() ? logits_none : logits.size() == V ? logits_last : logits_all;
    if (mode == logits_all && logits.size() != n * V)
        throw error("dist: logits buffer of " + std::to_string(logits.size()) + " floats, expected " +
                    std::to_string(n * V) + " or " + std::to_string(V));
    const int last = t_.size() - 1;
    // Pieces of at most mb tokens (one, unless micro-batched), sent back to back; only the final piece
    // asks for logits. One rank: the piece is the whole chunk and rank 0 runs the heads itself.
    const size_t mb = forward_messages(n, logits.size()) > 1 ? static_cast<size_t>(micro_batch_) : n;
    std::vector<float> x(mb * S);
    for (size_t i0 = 0; i0 < n; i0 += mb) {
        const size_t k = std::min(mb, n - i0);
        const int64_t piece_mode = i0 + k == n ? mode : logits_none;
        const auto tk = tokens.subspan(i0, k);
        const auto ps = positions.subspan(i0, k);
        const std::span<float> xk(x.data(), k * S);
        const int64_t past = n_past_;
        if (dev_.cuda_device >= 0) {
            gpu_layers(tk, ps, xk, last == 0 ? logits : std::span<float>());
        } else {
            ds4::embed_tokens(m_, tk, xk);
            run_layers(tk, ps, xk);
            if (last == 0 && piece_mode != logits_none) ds4::head_logits(m_, exec_, xk, logits);
        }
        if (last == 0) continue;
        const int64_t hdr[header_len] = {op_forward, static_cast<int64_t>(k), piece_mode, past};
        send_on(hdr, tk, ps, xk);
    }
    // Only the last rank's reply is left to wait for (one rank: the logits are written already).
    pending_ = last > 0 && mode != logits_none ? logits : std::span<float>();
}

void pipeline_rank::finish_forward() {
    if (rank_ != 0) throw error("dist: forward() is for rank 0, called on rank " + std::to_string(rank_));
    if (!pending_) throw error("dist: no forward outstanding on this pipeline to finish");
    const std::span<float> out = *pending_;
    pending_.reset();  // a failed receive below also ends the forward (the pipeline is torn down then)
    if (!out.empty()) t_.recv(t_.size() - 1, out.data(), out.size_bytes());
}

void pipeline_rank::set_micro_batch(int64_t tokens) {
    if (tokens < 0) throw error("dist: micro-batch size must be >= 0, got " + std::to_string(tokens));
    micro_batch_ = tokens;
}

int64_t pipeline_rank::forward_messages(size_t n, size_t logits_floats) const {
    const size_t V = static_cast<size_t>(m_.hp.n_vocab);
    const bool all = logits_floats != 0 && logits_floats != V;  // every token's logits: not split
    if (t_.size() < 2 || micro_batch_ <= 0 || all || n <= static_cast<size_t>(micro_batch_)) return 1;
    return static_cast<int64_t>((n + static_cast<size_t>(micro_batch_) - 1) / static_cast<size_t>(micro_batch_));
}

void pipeline_rank::reset() {
    if (rank_ != 0) throw error("dist: reset() is for rank 0, called on rank " + std::to_string(rank_));
    // The outstanding forward's logits would still arrive after the reset and be taken for a later one's.
    if (pending_)
        throw error("dist: reset() while a forward is outstanding on this pipeline (finish it first)");
    fresh_state();
    if (t_.size() > 1) {
        const int64_t hdr[header_len] = {op_reset, 0, 0, 0};
        send_on(hdr, {}, {}, {});
    }
}

void pipeline_rank::stop() {
    if (rank_ != 0) throw error("dist: stop() is for rank 0, called on rank " + std::to_string(rank_));
    if (t_.size() > 1) {
        const int64_t hdr[header_len] = {op_stop, 0, 0, 0};
        send_on(hdr, {}, {}, {});
    }
}

void pipeline_rank::serve() {
    while (serve_one()) {
    }
}

bool pipeline_rank::serve_one() {
    if (rank_ == 0) throw error("dist: serve() is for ranks > 0");
    const int prev = rank_ - 1, last = t_.size() - 1;
    const size_t S = static_cast<size_t>(m_.hp.n_hc) * static_cast<size_t>(m_.hp.n_embd);
    const size_t V = static_cast<size_t>(m_.hp.n_vocab);
    try {
        int64_t hdr[header_len];
        t_.recv_idle(prev, hdr, sizeof(hdr));  // idle between requests is normal
        if (hdr[0] == op_stop || hdr[0] == op_reset) {
            if (hdr[0] == op_reset) fresh_state();
            if (rank_ < last) send_on(hdr, {}, {}, {});
            return hdr[0] != op_stop;
        }
        const int64_t n = hdr[1];
        if (hdr[0] != op_forward || n <= 0 || n > (int64_t{1} << 24) || hdr[2] < logits_none ||
            hdr[2] > logits_all || hdr[3] != n_past_)
            throw error("dist: rank " + std::to_string(rank_) + " received a bad header {" +
                        std::to_string(hdr[0]) + ", " + std::to_string(hdr[1]) + ", " + std::to_string(hdr[2]) +
                        ", " + std::to_string(hdr[3]) + "} at n_past " + std::to_string(n_past_));
        const size_t un = static_cast<size_t>(n);
        std::vector<int32_t> tokens(un);
        std::vector<int64_t> positions(un);
        std::vector<float> x(un * S);
        t_.recv(prev, tokens.data(), tokens.size() * sizeof(int32_t));
        t_.recv(prev, positions.data(), positions.size() * sizeof(int64_t));
        t_.recv(prev, x.data(), x.size() * sizeof(float));
        std::vector<float> logits(rank_ == last && hdr[2] != logits_none ? (hdr[2] == logits_all ? un * V : V) : 0);
        if (dev_.cuda_device >= 0)
            gpu_layers(tokens, positions, x, logits);  // the last CUDA stage runs the heads itself
        else
            run_layers(tokens, positions, x);
        if (rank_ < last) {
            send_on(hdr, tokens, positions, x);
        } else if (hdr[2] != logits_none) {
            if (dev_.cuda_device < 0) ds4::head_logits(m_, exec_, x, logits);
            t_.send(0, logits.data(), logits.size() * sizeof(float));
        }
        return true;
    } catch (const std::exception &e) {
        t_.abort(e.what());
        throw;
    }
}

// ---- local_pipeline --------------------------------------------------------------------------------

struct local_pipeline::impl : local_group<pipeline_rank> {
    using local_group<pipeline_rank>::local_group;
};

local_pipeline::local_pipeline(const ds4::model &m, std::vector<layer_range> ranges, ds4::qat_mode qat,
                               kv_precision kv, std::chrono::milliseconds timeout)
    : local_pipeline(m, ranges, qat, kv, ds4::exec_options{}, std::vector<stage_device>(ranges.size()), timeout) {}

local_pipeline::local_pipeline(const ds4::model &m, std::vector<layer_range> ranges, ds4::qat_mode qat,
                               kv_precision kv, ds4::exec_options exec, std::vector<stage_device> devices,
                               std::chrono::milliseconds timeout) {
    const int n = static_cast<int>(ranges.size());
    if (devices.size() != ranges.size())
        throw error("dist: " + std::to_string(devices.size()) + " stage devices for " + std::to_string(n) +
                    " layer ranges");
    const auto make = [&](int r, transport &t) {
        return std::make_unique<pipeline_rank>(m, ranges, t, qat, kv, exec, devices[static_cast<size_t>(r)]);
    };
    p_ = std::make_unique<impl>(n, timeout, make, "starting the pipeline");
}

local_pipeline::~local_pipeline() = default;  // ~local_group stops rank 0's peers and joins their threads

void local_pipeline::forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                             std::span<float> logits) {
    submit(tokens, positions, logits);
    collect();
}

void local_pipeline::submit(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                            std::span<float> logits) {
    p_->driver().begin_forward(tokens, positions, logits);
}

void local_pipeline::collect() {
    p_->driver().finish_forward();
}

void local_pipeline::reset() {
    p_->driver().reset();
}

void local_pipeline::set_micro_batch(int64_t tokens) {
    p_->driver().set_micro_batch(tokens);
}

int64_t local_pipeline::n_past() const {
    return p_->driver().n_past();
}

}  // namespace fathom::dist
