// Placement planner (see planner.h): tensor directory -> byte groups, DS4 KV layout -> KV bytes per
// layer, then a pipeline split (minimax fill ratio by dynamic programming over contiguous ranges) or
// tensor/expert-parallel shares, checked against each device's free memory.
#include "dist/planner.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "gguf/gguf.h"
#ifdef FATHOM_ENGINE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace fathom::dist {

uint64_t device_free_bytes(const std::string &name) {
#ifdef FATHOM_ENGINE_CUDA
    int ordinal = -1;
    if (name.rfind("cuda:", 0) == 0) {
        try {
            size_t used = 0;
            ordinal = std::stoi(name.substr(5), &used);
            if (used != name.size() - 5) ordinal = -1;
        } catch (const std::exception &) {
            ordinal = -1;
        }
    }
    if (ordinal < 0) throw error("plan: device '" + name + "': expected cuda:N (or give --mem-gib)");
    const int n = cuda_device_count();
    if (ordinal >= n)
        throw error("plan: device " + name + " not present (" + std::to_string(n) +
                    " CUDA devices); give --mem-gib to plan for it");
    return cuda_query_memory(ordinal).free_bytes;
#else
    (void)name;
    throw error("plan: this build has no CUDA backend to query device memory; give --mem-gib (one value per device)");
#endif
}

namespace {

bool starts_with(const std::string &s, const std::string &prefix) {
    return s.compare(0, prefix.size(), prefix) == 0;
}

// Block number of "blk.<i>.<rest>", or -1.
int block_of(const std::string &name, std::string &rest) {
    if (!starts_with(name, "blk.")) return -1;
    const size_t dot = name.find('.', 4);
    if (dot == std::string::npos || dot == 4) return -1;
    int il = -1;
    const auto r = std::from_chars(name.data() + 4, name.data() + dot, il);
    if (r.ec != std::errc() || r.ptr != name.data() + dot) return -1;
    rest = name.substr(dot + 1);
    return il;
}

// Tensors split across devices in the tp layout (by query head, output group, expert width or
// indexer head); routed experts are sharded separately.
bool is_split(const std::string &rest) {
    for (const char *s : {"attn_q_b.", "attn_output_a.", "attn_output_b.", "ffn_gate_shexp.", "ffn_up_shexp.",
                          "ffn_down_shexp.", "indexer.attn_q_b.", "indexer.proj."})
        if (starts_with(rest, s)) return true;
    return false;
}
bool is_expert(const std::string &rest) {
    return starts_with(rest, "ffn_gate_exps.") || starts_with(rest, "ffn_up_exps.") ||
           starts_with(rest, "ffn_down_exps.");
}

double gib(uint64_t b) {
    return static_cast<double>(b) / static_cast<double>(1ull << 30);
}
std::string gib_str(double g) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", g);
    return buf;
}

uint64_t reserve_of(const weight_inventory &inv, const plan_options &o) {
    return o.reserve_bytes + activation_bytes(inv.hp, o.chunk, o.n_ctx, o.n_seq);
}

// Per-block bytes that live with the block in a pipeline: weights + KV of n_seq sequences.
std::vector<uint64_t> block_costs(const weight_inventory &inv, const plan_options &o) {
    std::vector<uint64_t> c(inv.layer.size());
    for (size_t il = 0; il < c.size(); ++il)
        c[il] = inv.layer[il] +
                static_cast<uint64_t>(o.n_seq) * layer_kv_bytes(inv.hp, static_cast<int>(il), o.n_ctx, o.kv);
    return c;
}

void fill_pipeline_device(const weight_inventory &inv, const plan_options &o, const layer_range &r, bool first,
                          bool last, device_plan &d) {
    d.layers = r;
    d.weights = (first ? inv.embed : 0) + (last ? inv.output + inv.head : 0);
    d.kv = 0;
    for (int il = r.first; il < r.last; ++il) {
        d.weights += inv.layer[static_cast<size_t>(il)];
        d.kv += static_cast<uint64_t>(o.n_seq) * layer_kv_bytes(inv.hp, il, o.n_ctx, o.kv);
    }
    d.reserve = reserve_of(inv, o);
}

// Contiguous ranges minimising max_d used_d / free_d; every device gets at least one block.
std::vector<layer_range> best_ranges(const weight_inventory &inv, const std::vector<device_spec> &devs,
                                     const plan_options &o) {
    const int L = static_cast<int>(inv.layer.size()), P = static_cast<int>(devs.size());
    const auto cost = block_costs(inv, o);
    std::vector<uint64_t> prefix(static_cast<size_t>(L) + 1, 0);
    for (int i = 0; i < L; ++i) prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + cost[static_cast<size_t>(i)];
    const uint64_t reserve = reserve_of(inv, o);
    auto ratio = [&](int d, int a, int b) {  // device d holding blocks [a, b)
        uint64_t need = reserve + prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)];
        if (d == 0) need += inv.embed;
        if (d == P - 1) need += inv.output + inv.head;
        const uint64_t f = devs[static_cast<size_t>(d)].free_bytes;
        return f == 0 ? std::numeric_limits<double>::infinity() : static_cast<double>(need) / static_cast<double>(f);
    };
    const double inf = std::numeric_limits<double>::infinity();
    // best[d][j]: minimax ratio of devices 0..d-1 holding blocks [0, j); from[d][j]: start of device d-1.
    std::vector<std::vector<double>> best(static_cast<size_t>(P) + 1, std::vector<double>(static_cast<size_t>(L) + 1, inf));
    std::vector<std::vector<int>> from(static_cast<size_t>(P) + 1, std::vector<int>(static_cast<size_t>(L) + 1, -1));
    best[0][0] = 0;
    for (int d = 1; d <= P; ++d)
        for (int j = d; j <= L - (P - d); ++j)
            for (int i = d - 1; i < j; ++i) {
                const double prev = best[static_cast<size_t>(d) - 1][static_cast<size_t>(i)];
                if (prev == inf) continue;
                const double v = std::max(prev, ratio(d - 1, i, j));
                if (v < best[static_cast<size_t>(d)][static_cast<size_t>(j)]) {
                    best[static_cast<size_t>(d)][static_cast<size_t>(j)] = v;
                    from[static_cast<size_t>(d)][static_cast<size_t>(j)] = i;
                }
            }
    std::vector<layer_range> out(static_cast<size_t>(P));
    int j = L;
    for (int d = P; d >= 1; --d) {
        const int i = from[static_cast<size_t>(d)][static_cast<size_t>(j)];
        out[static_cast<size_t>(d) - 1] = {i, j};
        j = i;
    }
    return out;
}

void tp_device(const weight_inventory &inv, const plan_options &o, int r, int P, device_plan &d) {
    const ds4::hparams &hp = inv.hp;
    const auto share = [&](int64_t units) {  // units owned by rank r when `units` are dealt out evenly
        return units / P + (r < units % P ? 1 : 0);
    };
    d.layers = {0, hp.n_layer};
    const int64_t e_count = share(hp.n_expert);
    d.experts_first = static_cast<int>(r * (hp.n_expert / P) + std::min<int64_t>(r, hp.n_expert % P));
    d.experts_count = static_cast<int>(e_count);
    const uint64_t vocab_rows = static_cast<uint64_t>(share(hp.n_vocab));
    d.weights = inv.embed / static_cast<uint64_t>(hp.n_vocab) * vocab_rows +
                inv.output / static_cast<uint64_t>(hp.n_vocab) * vocab_rows + inv.head;
    d.kv = 0;
    for (size_t il = 0; il < inv.layer.size(); ++il) {
        const uint64_t rep = inv.layer[il] - inv.experts[il] - inv.split[il];
        d.weights += rep + inv.split[il] / static_cast<uint64_t>(P) +
                     inv.experts[il] / static_cast<uint64_t>(hp.n_expert) * static_cast<uint64_t>(e_count);
        d.kv += static_cast<uint64_t>(o.n_seq) * layer_kv_bytes(hp, static_cast<int>(il), o.n_ctx, o.kv);
    }
    d.reserve = reserve_of(inv, o);
}

void check_tp_divisible(const ds4::hparams &hp, int P) {
    for (auto [v, what] : {std::pair{hp.n_head, "attention heads"}, {hp.o_groups, "output groups"},
                           {hp.n_ff_exp, "shared-expert width"}, {hp.idx_head, "indexer heads"}})
        if (v % P != 0)
            throw error("plan: tp over " + std::to_string(P) + " devices needs the " + what + " (" +
                        std::to_string(v) + ") divisible by " + std::to_string(P));
    if (hp.n_expert < P)
        throw error("plan: tp over " + std::to_string(P) + " devices needs at least as many routed experts (" +
                    std::to_string(hp.n_expert) + ")");
}

}  // namespace

uint64_t weight_inventory::total() const {
    uint64_t t = embed + output + head;
    for (uint64_t b : layer) t += b;
    return t;
}

weight_inventory make_inventory(const ds4::hparams &hp, const std::vector<tensor_bytes> &tensors) {
    weight_inventory inv;
    inv.hp = hp;
    const size_t L = static_cast<size_t>(hp.n_layer);
    inv.layer.assign(L, 0);
    inv.experts.assign(L, 0);
    inv.split.assign(L, 0);
    for (const auto &t : tensors) {
        std::string rest;
        const int il = block_of(t.name, rest);
        if (t.name == "token_embd.weight") {
            inv.embed += t.bytes;
        } else if (t.name == "output.weight") {
            inv.output += t.bytes;
        } else if (il >= 0 && il < hp.n_layer) {
            inv.layer[static_cast<size_t>(il)] += t.bytes;
            if (is_expert(rest)) inv.experts[static_cast<size_t>(il)] += t.bytes;
            if (is_split(rest)) inv.split[static_cast<size_t>(il)] += t.bytes;
        } else {
            inv.head += t.bytes;  // output_norm, output_hc_*, MTP blocks (blk.<n_layer..>, mtp.*)
        }
    }
    if (inv.embed == 0) throw error("plan: tensor directory has no token_embd.weight");
    if (inv.output == 0) throw error("plan: tensor directory has no output.weight");
    for (size_t il = 0; il < L; ++il)
        if (inv.layer[il] == 0) throw error("plan: tensor directory has no tensors of block " + std::to_string(il));
    return inv;
}

weight_inventory inventory_from_gguf(const gguf::file &f) {
    const ds4::hparams hp = ds4::load_hparams(f);
    std::vector<tensor_bytes> t;
    for (const auto &ti : f.tensors()) t.push_back({std::string(ti.name), ti.nbytes});
    return make_inventory(hp, t);
}

uint64_t layer_kv_bytes(const ds4::hparams &hp, int il, int64_t n_ctx, kv_precision kv) {
    if (il < 0 || il >= hp.n_layer) throw error("plan: block " + std::to_string(il) + " out of range");
    if (n_ctx <= 0) throw error("plan: context length must be positive, got " + std::to_string(n_ctx));
    const uint64_t elt = kv == kv_precision::f16 ? 2 : 4, ctx = static_cast<uint64_t>(n_ctx);
    const uint64_t d = static_cast<uint64_t>(hp.head_dim), di = static_cast<uint64_t>(hp.idx_dim);
    const int R = hp.compress_ratio[static_cast<size_t>(il)];
    uint64_t b = static_cast<uint64_t>(hp.window) * d * elt;  // raw ring
    if (R > 0) {
        const uint64_t ur = static_cast<uint64_t>(R);
        b += ctx / ur * d * elt;
        b += (R == 4 ? 8 * 2 * d : ur * d) * 2 * sizeof(float);  // frontier (a, score)
    }
    if (R == 4) b += ctx / 4 * di * elt + 8 * 2 * di * 2 * sizeof(float);
    return b;
}

uint64_t activation_bytes(const ds4::hparams &hp, int64_t chunk, int64_t n_ctx, int n_seq) {
    if (chunk <= 0) throw error("plan: prefill chunk must be positive, got " + std::to_string(chunk));
    const uint64_t D = static_cast<uint64_t>(hp.n_embd), S = static_cast<uint64_t>(hp.n_hc) * D;
    const uint64_t H = static_cast<uint64_t>(hp.n_head), d = static_cast<uint64_t>(hp.head_dim);
    const uint64_t ctx = static_cast<uint64_t>(n_ctx);
    const uint64_t per_token = 2 * S + 2 * H * d + static_cast<uint64_t>(hp.o_groups) * static_cast<uint64_t>(hp.o_rank) +
                               4 * D +
                               3 * static_cast<uint64_t>(hp.n_ff_exp) *
                                   static_cast<uint64_t>(hp.n_expert_used + hp.n_expert_shared) +
                               H * (static_cast<uint64_t>(hp.window) + static_cast<uint64_t>(hp.idx_topk) + ctx / 128) +
                               ctx / 4;
    return sizeof(float) * (static_cast<uint64_t>(chunk) * per_token +
                            static_cast<uint64_t>(n_seq) * static_cast<uint64_t>(hp.n_vocab));
}

plan make_plan(const weight_inventory &inv, const std::vector<device_spec> &devs, const plan_options &o) {
    const int P = static_cast<int>(devs.size()), L = inv.hp.n_layer;
    if (P < 1) throw error("plan: no devices");
    if (o.n_ctx <= 0) throw error("plan: context length must be positive, got " + std::to_string(o.n_ctx));
    if (o.n_seq < 1) throw error("plan: sequences must be >= 1, got " + std::to_string(o.n_seq));
    plan p;
    p.kind = o.kind;
    p.n_ctx = o.n_ctx;
    p.n_seq = o.n_seq;
    p.kv = o.kv;
    p.total_weights = inv.total();
    p.devices.resize(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
        p.devices[static_cast<size_t>(r)].name = devs[static_cast<size_t>(r)].name;
        p.devices[static_cast<size_t>(r)].free_bytes = devs[static_cast<size_t>(r)].free_bytes;
    }
    if (o.kind == layout::pipeline) {
        if (P > L)
            throw error("plan: " + std::to_string(P) + " devices but only " + std::to_string(L) +
                        " layers to split (pipeline needs at least one layer per device)");
        std::vector<layer_range> ranges = o.ranges;
        if (ranges.empty()) {
            ranges = best_ranges(inv, devs, o);
        } else {
            if (static_cast<int>(ranges.size()) != P)
                throw error("plan: " + std::to_string(ranges.size()) + " layer ranges for " + std::to_string(P) +
                            " devices");
            check_ranges(ranges, L);
        }
        for (int r = 0; r < P; ++r)
            fill_pipeline_device(inv, o, ranges[static_cast<size_t>(r)], r == 0, r == P - 1,
                                 p.devices[static_cast<size_t>(r)]);
    } else {
        check_tp_divisible(inv.hp, P);
        if (!o.ranges.empty()) throw error("plan: layer ranges apply to the pipeline layout only");
        for (int r = 0; r < P; ++r) tp_device(inv, o, r, P, p.devices[static_cast<size_t>(r)]);
    }
    uint64_t need = 0, have = 0;
    for (const auto &d : p.devices) need += d.used(), have += d.free_bytes;
    for (const auto &d : p.devices)
        if (d.left() < 0)
            throw error("plan: does not fit: " + d.name + " needs " + gib_str(gib(d.used())) + " GiB (weights " +
                        gib_str(gib(d.weights)) + ", KV " + gib_str(gib(d.kv)) + ", reserve " +
                        gib_str(gib(d.reserve)) + ") but has " + gib_str(gib(d.free_bytes)) + " GiB free; all " +
                        std::to_string(P) + " devices need " + gib_str(gib(need)) + " GiB of " +
                        gib_str(gib(have)) + " GiB (" + (o.kind == layout::pipeline ? "pipeline" : "tp") +
                        ", ctx " + std::to_string(o.n_ctx) + ")");
    return p;
}

std::string plan_text(const plan &p) {
    std::string s;
    char line[256];
    std::snprintf(line, sizeof line, "layout %s, ctx %lld x %d seq, kv %s, weights %.2f GiB\n",
                  p.kind == layout::pipeline ? "pipeline" : "tp", static_cast<long long>(p.n_ctx), p.n_seq,
                  p.kv == kv_precision::f16 ? "f16" : "f32", gib(p.total_weights));
    s += line;
    std::snprintf(line, sizeof line, "%-10s %-12s %10s %10s %10s %10s %10s %10s\n", "device",
                  p.kind == layout::pipeline ? "layers" : "experts", "weights", "kv", "reserve", "used", "free",
                  "left");
    s += line;
    for (const auto &d : p.devices) {
        const std::string what = p.kind == layout::pipeline
                                     ? std::to_string(d.layers.first) + "-" + std::to_string(d.layers.last - 1)
                                     : std::to_string(d.experts_first) + "-" +
                                           std::to_string(d.experts_first + d.experts_count - 1);
        std::snprintf(line, sizeof line, "%-10s %-12s %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f\n", d.name.c_str(),
                      what.c_str(), gib(d.weights), gib(d.kv), gib(d.reserve), gib(d.used()), gib(d.free_bytes),
                      static_cast<double>(d.left()) / static_cast<double>(1ull << 30));
        s += line;
    }
    s += "(GiB; layers are inclusive block numbers)\n";
    return s;
}

std::string plan_json(const plan &p) {
    nlohmann::json j;
    j["layout"] = p.kind == layout::pipeline ? "pipeline" : "tp";
    j["n_ctx"] = p.n_ctx;
    j["n_seq"] = p.n_seq;
    j["kv"] = p.kv == kv_precision::f16 ? "f16" : "f32";
    j["total_weight_bytes"] = p.total_weights;
    j["devices"] = nlohmann::json::array();
    for (const auto &d : p.devices) {
        nlohmann::json e = {{"name", d.name},
                            {"first_layer", d.layers.first},
                            {"last_layer", d.layers.last - 1},
                            {"weight_bytes", d.weights},
                            {"kv_bytes", d.kv},
                            {"reserve_bytes", d.reserve},
                            {"used_bytes", d.used()},
                            {"free_bytes", d.free_bytes},
                            {"left_bytes", d.left()}};
        if (p.kind == layout::tp) {
            e["first_expert"] = d.experts_first;
            e["expert_count"] = d.experts_count;
        }
        j["devices"].push_back(e);
    }
    return j.dump(2);
}

std::vector<layer_range> parse_layer_ranges(const std::string &text) {
    std::vector<layer_range> out;
    size_t pos = 0;
    const auto bad = [&](const std::string &why) {
        return error("plan: layer ranges '" + text + "': " + why + " (expected e.g. 0-21,22-42)");
    };
    while (pos <= text.size()) {
        const size_t comma = std::min(text.find(',', pos), text.size());
        const std::string item = text.substr(pos, comma - pos);
        const size_t dash = item.find('-');
        int a = -1, b = -1;
        const char *s = item.data(), *e = item.data() + item.size();
        if (dash == std::string::npos) {
            const auto r = std::from_chars(s, e, a);
            if (r.ec != std::errc() || r.ptr != e) throw bad("'" + item + "' is not a block number or range");
            b = a;
        } else {
            const auto r1 = std::from_chars(s, s + dash, a);
            const auto r2 = std::from_chars(s + dash + 1, e, b);
            if (r1.ec != std::errc() || r1.ptr != s + dash || r2.ec != std::errc() || r2.ptr != e)
                throw bad("'" + item + "' is not FIRST-LAST");
        }
        if (a < 0 || b < a) throw bad("'" + item + "' is empty or negative");
        out.push_back({a, b + 1});
        pos = comma + 1;
    }
    return out;
}

}  // namespace fathom::dist
