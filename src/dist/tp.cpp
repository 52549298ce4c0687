// Tensor + expert parallel DS4 ranks over a dist::transport (see tp.h for the split and the protocol):
// every rank runs ds4::forward_layers_tp with its slice and all_reduce_sum between the sublayers.
#include "dist/tp.h"

#include "core/error.h"
#include "dist/collective.h"
#include "dist/local_group.h"

namespace fathom::dist {

namespace {

enum op : int64_t { op_forward = 1, op_reset = 2, op_stop = 3, op_state = 4 };
constexpr size_t header_len = 4;

std::string rank_text(int rank, int size) {
    return "tp rank " + std::to_string(rank) + " of " + std::to_string(size);
}

}  // namespace

ds4::tp_slice tp_share(const ds4::hparams &hp, int rank, int size) {
    if (size < 1 || rank < 0 || rank >= size)
        throw error("dist: tp: rank " + std::to_string(rank) + " of " + std::to_string(size) + " ranks");
    const auto need = [&](int64_t units, const char *what) {
        if (units % size != 0)
            throw error("dist: tp over " + std::to_string(size) + " ranks: " + what + " (" +
                        std::to_string(units) + ") not divisible by " + std::to_string(size) +
                        "; use a rank count that divides it");
    };
    need(hp.n_head, "the attention heads");
    need(hp.o_groups, "the output groups");
    if (hp.n_expert_shared == 1) need(hp.n_ff_exp, "the shared-expert width");
    if (hp.n_expert < size)
        throw error("dist: tp over " + std::to_string(size) + " ranks: only " + std::to_string(hp.n_expert) +
                    " routed experts");
    ds4::tp_slice s;
    s.head0 = rank * (hp.n_head / size), s.head1 = s.head0 + hp.n_head / size;
    s.group0 = rank * (hp.o_groups / size), s.group1 = s.group0 + hp.o_groups / size;
    // The planner's deal (planner.cpp tp_device): the first E mod P ranks own one more expert.
    s.expert0 = rank * (hp.n_expert / size) + std::min(rank, hp.n_expert % size);
    s.expert1 = s.expert0 + hp.n_expert / size + (rank < hp.n_expert % size ? 1 : 0);
    s.ff0 = int64_t{rank} * (hp.n_ff_exp / size), s.ff1 = s.ff0 + hp.n_ff_exp / size;
    return s;
}

void tp_check(const ds4::model &m, int size) {
    const ds4::hparams &hp = m.hp;
    if (size < 1 || size > 1024)
        throw error("dist: tp over " + std::to_string(size) + " ranks: need 1..1024");
    for (int r = 0; r < size; ++r) {
        const ds4::tp_slice s = tp_share(hp, r, size);
        for (size_t il = 0; il < m.layers.size(); ++il) {
            const ds4::layer_weights &l = m.layers[il];
            const std::string at = "blk." + std::to_string(il) + ".";
            try {
                (void)ds4::matrix_cols(l.out_b, int64_t{s.group0} * hp.o_rank, int64_t{s.group1} * hp.o_rank,
                                       (at + "attn_output_b").c_str());
                if (hp.n_expert_shared == 1)
                    (void)ds4::matrix_cols(l.down_sh, s.ff0, s.ff1, (at + "ffn_down_shexp").c_str());
            } catch (const std::exception &e) {
                throw error("dist: tp over " + std::to_string(size) + " ranks: " + e.what());
            }
        }
    }
}

tp_rank::tp_rank(const ds4::model &m, transport &t, ds4::qat_mode qat, kv_precision kv,
                 ds4::exec_options exec)
    : m_(m), t_(t), rank_(t.rank()), qat_(qat), kv_(kv), exec_(exec) {
    tp_.slice = tp_share(m_.hp, rank_, t_.size());
    tp_.reduce = [this](std::span<float> y) { all_reduce_sum(t_, y); };
    fresh_state();
}

void tp_rank::fresh_state() {
    layers_.clear();
    for (const auto &lw : m_.layers) layers_.push_back(ds4::new_layer_state(m_.hp, lw, kv_));
    x_.clear();
    n_past_ = 0;
}

void tp_rank::run(std::span<const int32_t> tokens, std::span<const int64_t> positions) {
    const size_t S = static_cast<size_t>(m_.hp.n_hc) * static_cast<size_t>(m_.hp.n_embd);
    x_.assign(tokens.size() * S, 0.0f);
    ds4::embed_tokens(m_, tokens, x_);  // replicated: every rank embeds the same tokens
    ds4::forward_layers_tp(m_, layers_, qat_, exec_, 0, static_cast<int>(m_.layers.size()), tokens, positions,
                           x_, tp_);
    n_past_ += static_cast<int64_t>(tokens.size());
}

void tp_rank::send_all(const int64_t *hdr) {
    for (int q = 1; q < t_.size(); ++q) t_.send(q, hdr, header_len * sizeof(int64_t));
}

void tp_rank::forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                      std::span<float> logits) {
    if (rank_ != 0) throw error("dist: tp forward() is for rank 0, called on rank " + std::to_string(rank_));
    const size_t n = tokens.size(), V = static_cast<size_t>(m_.hp.n_vocab);
    if (positions.size() != n)
        throw error("dist: tp: " + std::to_string(n) + " tokens but " + std::to_string(positions.size()) +
                    " positions");
    if (!logits.empty() && logits.size() != V && logits.size() != n * V)
        throw error("dist: tp: logits buffer of " + std::to_string(logits.size()) + " floats, expected " +
                    std::to_string(n * V) + " or " + std::to_string(V));
    for (size_t i = 0; i < n; ++i) {
        if (positions[i] != n_past_ + static_cast<int64_t>(i))
            throw error("dist: tp: position " + std::to_string(positions[i]) + " at index " +
                        std::to_string(i) + ", expected " +
                        std::to_string(n_past_ + static_cast<int64_t>(i)));
        if (tokens[i] < 0 || tokens[i] >= m_.hp.n_vocab)
            throw error("dist: tp: token id " + std::to_string(tokens[i]) + " outside [0, " +
                        std::to_string(m_.hp.n_vocab) + ")");
    }
    if (n == 0) return;
    try {
        const int64_t hdr[header_len] = {op_forward, static_cast<int64_t>(n), 0, n_past_};
        send_all(hdr);
        for (int q = 1; q < t_.size(); ++q) {
            t_.send(q, tokens.data(), tokens.size_bytes());
            t_.send(q, positions.data(), positions.size_bytes());
        }
        run(tokens, positions);
        if (!logits.empty()) ds4::head_logits(m_, exec_, x_, logits);
    } catch (const std::exception &e) {
        t_.abort(e.what());  // the other ranks wait in an all-reduce: wake them
        throw;
    }
}

void tp_rank::reset() {
    if (rank_ != 0) throw error("dist: tp reset() is for rank 0, called on rank " + std::to_string(rank_));
    const int64_t hdr[header_len] = {op_reset, 0, 0, 0};
    send_all(hdr);
    fresh_state();
}

void tp_rank::stop() {
    if (rank_ != 0) throw error("dist: tp stop() is for rank 0, called on rank " + std::to_string(rank_));
    const int64_t hdr[header_len] = {op_stop, 0, 0, 0};
    send_all(hdr);
}

std::vector<std::vector<float>> tp_rank::hc_states() {
    if (rank_ != 0)
        throw error("dist: tp hc_states() is for rank 0, called on rank " + std::to_string(rank_));
    std::vector<std::vector<float>> out{x_};
    try {
        const int64_t hdr[header_len] = {op_state, 0, 0, 0};
        send_all(hdr);
        for (int q = 1; q < t_.size(); ++q) {
            int64_t count = 0;
            t_.recv(q, &count, sizeof(count));
            if (count < 0 || count > (int64_t{1} << 32))
                throw error("dist: tp: rank " + std::to_string(q) + " sent a bad state size " +
                            std::to_string(count));
            out.emplace_back(static_cast<size_t>(count));
            t_.recv(q, out.back().data(), out.back().size() * sizeof(float));
        }
    } catch (const std::exception &e) {
        t_.abort(e.what());
        throw;
    }
    return out;
}

void tp_rank::serve() {
    while (serve_one()) {
    }
}

bool tp_rank::serve_one() {
    if (rank_ == 0) throw error("dist: tp serve() is for ranks > 0");
    try {
        int64_t hdr[header_len];
        t_.recv_idle(0, hdr, sizeof(hdr));  // idle between requests is normal
        if (hdr[0] == op_stop) return false;
        if (hdr[0] == op_reset) {
            fresh_state();
            return true;
        }
        if (hdr[0] == op_state) {
            const int64_t count = static_cast<int64_t>(x_.size());
            t_.send(0, &count, sizeof(count));
            t_.send(0, x_.data(), x_.size() * sizeof(float));
            return true;
        }
        const int64_t n = hdr[1];
        if (hdr[0] != op_forward || n <= 0 || n > (int64_t{1} << 24) || hdr[3] != n_past_)
            throw error("dist: " + rank_text(rank_, t_.size()) + " received a bad header {" +
                        std::to_string(hdr[0]) + ", " + std::to_string(hdr[1]) + ", " +
                        std::to_string(hdr[2]) + ", " + std::to_string(hdr[3]) + "} at n_past " +
                        std::to_string(n_past_));
        std::vector<int32_t> tokens(static_cast<size_t>(n));
        std::vector<int64_t> positions(static_cast<size_t>(n));
        t_.recv(0, tokens.data(), tokens.size() * sizeof(int32_t));
        t_.recv(0, positions.data(), positions.size() * sizeof(int64_t));
        run(tokens, positions);
        return true;
    } catch (const std::exception &e) {
        t_.abort(e.what());
        throw;
    }
}

// ---- local_tp --------------------------------------------------------------------------------------

struct local_tp::impl : local_group<tp_rank> {
    using local_group<tp_rank>::local_group;
};

local_tp::local_tp(const ds4::model &m, int size, ds4::qat_mode qat, kv_precision kv, ds4::exec_options exec,
                   std::chrono::milliseconds timeout) {
    tp_check(m, size);
    const auto make = [&](int r, transport &t) {
        ds4::exec_options ex = exec;
        if (r > 0) ex.pool = nullptr;  // ranks run concurrently: a pool is not shared
        return std::make_unique<tp_rank>(m, t, qat, kv, ex);
    };
    p_ = std::make_unique<impl>(size, timeout, make, "starting the tp ranks");
}

local_tp::~local_tp() = default;  // ~local_group stops rank 0's peers and joins their threads

void local_tp::forward(std::span<const int32_t> tokens, std::span<const int64_t> positions,
                       std::span<float> logits) {
    p_->driver().forward(tokens, positions, logits);
}

void local_tp::reset() {
    p_->driver().reset();
}

int64_t local_tp::n_past() const {
    return p_->driver().n_past();
}

int local_tp::size() const {
    return p_->size();
}

std::vector<std::vector<float>> local_tp::hc_states() {
    return p_->driver().hc_states();
}

const ds4::tp_slice &local_tp::slice(int rank) const {
    return p_->rank(rank).slice();
}

}  // namespace fathom::dist
