// DS4 saved states (deepseek4.h, "saved states"): the evaluation state as a byte stream, for the
// on-disk prompt cache (src/cache). Everything forward() reads from `state` is written, raw (f32 / f16
// bits as stored), so a loaded state continues bit for bit.
//
// Stream (little-endian; docs/prompt-cache.md "DS4 state"):
//   u32 magic "DS41", u32 version 1
//   u64 n_layer, n_past, KV precision (0 f16, 1 f32), QAT (0 full, 1 fp4only, 2 off), window, head_dim,
//   idx_dim per layer: u64 ratio
//              raw ring       [window][head_dim]                   (slot = pos mod window)
//     ratio>0: compressor kv  [slots][c*d'] f32, score [slots][c*d'] f32 (-inf where empty)
//              comp rows      [n_past / ratio][head_dim]
//     ratio 4: indexer compressor kv, score (as above), indexer rows [n_past / 4][idx_dim]
// (rows at the KV precision; slots = 8 and c = 2 for ratio 4, slots = ratio and c = 1 otherwise).
#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/state_io.h"
#include "models/deepseek4.h"

namespace fathom::ds4 {

namespace {

uint64_t qat_code(qat_mode q) {
    return q == qat_mode::full ? 0 : q == qat_mode::fp4only ? 1 : 2;
}

void put_floats(state_writer &w, const std::vector<float> &v) {
    w.write(v.data(), v.size() * sizeof(float));
}

void get_floats(state_reader &r, std::vector<float> &v) {
    r.read(v.data(), v.size() * sizeof(float));
}

// Rows of a store: their count follows from n_past (one row per completed block of `ratio` tokens).
void get_rows(state_reader &r, row_store &rows, int64_t n_rows) {
    rows.resize(n_rows);
    const std::span<uint8_t> b = rows.bytes();
    r.read(b.data(), b.size());
}

// ---- plain decoding's layouts <-> the position-indexed rings ----------------------------------------
// The stream keeps the layouts of a decoder without rollback, so states saved before rollback existed
// (and the CUDA sequence's) load unchanged. Raw ring: `window` slots, slot j holding the latest position
// p < n_past with p = j (mod window) (zeros where none). Frontier: ratio 4: slots 0..3 the previous
// block, 4..7 the current one; otherwise `ratio` slots by phase; a slot whose position the current block
// has not reached still holds the position one block earlier (plain decoding never clears it), and
// positions < 0 hold the fresh state's (value 0, score -inf).

// The position plain decoding's raw slot j holds at n_past (-1: none yet).
int64_t raw_slot_position(int64_t j, int64_t window, int64_t n_past) {
    if (n_past <= j) return -1;
    return j + (n_past - 1 - j) / window * window;
}

// The position plain decoding's frontier slot c holds at n_past (may be negative: the fresh value).
int64_t frontier_slot_position(int c, int ratio, int64_t n_past) {
    const int64_t start = n_past / ratio * ratio;  // the current block's first position
    const bool overlap = ratio == 4;
    if (overlap && c < ratio) return start - ratio + c;  // the previous block
    const int phase = overlap ? c - ratio : c;
    return start + phase < n_past ? start + phase : start - ratio + phase;
}

size_t frontier_width(const compressor_state &s) {
    return static_cast<size_t>((s.ratio == 4 ? 2 : 1) * s.dim);
}

void put_frontier(state_writer &w, const compressor_state &s, int64_t n_past) {
    std::vector<float> kv, score;
    frontier_plain_layout(s, n_past, kv, score);
    put_floats(w, kv);
    put_floats(w, score);
}

void get_frontier(state_reader &r, compressor_state &s, int64_t n_past) {
    const size_t width = frontier_width(s), ring = s.kv.size() / width;
    const int slots = s.ratio == 4 ? 8 : s.ratio;
    std::vector<float> kv(static_cast<size_t>(slots) * width), score(kv.size());
    get_floats(r, kv);
    get_floats(r, score);
    for (int c = 0; c < slots; ++c) {
        const int64_t q = frontier_slot_position(c, s.ratio, n_past);
        if (q < 0) continue;
        const size_t to = static_cast<size_t>(q) % ring * width, from = static_cast<size_t>(c) * width;
        std::copy(kv.begin() + static_cast<std::ptrdiff_t>(from), kv.begin() + static_cast<std::ptrdiff_t>(from + width),
                  s.kv.begin() + static_cast<std::ptrdiff_t>(to));
        std::copy(score.begin() + static_cast<std::ptrdiff_t>(from), score.begin() + static_cast<std::ptrdiff_t>(from + width),
                  s.score.begin() + static_cast<std::ptrdiff_t>(to));
    }
}

// One row's bytes in a store (its precision).
size_t row_bytes(const row_store &rows) {
    return rows.size() > 0 ? rows.bytes().size() / static_cast<size_t>(rows.size()) : 0;
}

void put_raw(state_writer &w, const row_store &raw, int64_t window, int64_t n_past) {
    const size_t rb = row_bytes(raw);
    const std::span<const uint8_t> b = raw.bytes();
    const std::vector<uint8_t> zero(rb, 0);
    for (int64_t j = 0; j < window; ++j) {
        const int64_t q = raw_slot_position(j, window, n_past);
        w.write(q < 0 ? zero.data() : b.data() + static_cast<size_t>(q % raw.size()) * rb, rb);
    }
}

void get_raw(state_reader &r, row_store &raw, int64_t window, int64_t n_past) {
    const size_t rb = row_bytes(raw);
    const std::span<uint8_t> b = raw.bytes();
    std::vector<uint8_t> row(rb);
    for (int64_t j = 0; j < window; ++j) {
        r.read(row.data(), rb);
        const int64_t q = raw_slot_position(j, window, n_past);
        if (q >= 0) std::copy(row.begin(), row.end(), b.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(q % raw.size()) * rb));
    }
}

}  // namespace

void frontier_plain_layout(const compressor_state &s, int64_t n_past, std::vector<float> &kv, std::vector<float> &score) {
    const size_t width = frontier_width(s), ring = s.kv.size() / width;
    const int slots = s.ratio == 4 ? 8 : s.ratio;
    kv.assign(static_cast<size_t>(slots) * width, 0.0f);
    score.assign(static_cast<size_t>(slots) * width, -INFINITY);
    for (int c = 0; c < slots; ++c) {
        const int64_t q = frontier_slot_position(c, s.ratio, n_past);
        if (q < 0) continue;
        const size_t from = static_cast<size_t>(q) % ring * width, to = static_cast<size_t>(c) * width;
        std::copy(s.kv.begin() + static_cast<std::ptrdiff_t>(from), s.kv.begin() + static_cast<std::ptrdiff_t>(from + width),
                  kv.begin() + static_cast<std::ptrdiff_t>(to));
        std::copy(s.score.begin() + static_cast<std::ptrdiff_t>(from),
                  s.score.begin() + static_cast<std::ptrdiff_t>(from + width), score.begin() + static_cast<std::ptrdiff_t>(to));
    }
}

int64_t rollback_floor(const state &st) {
    return std::min(st.n_past, std::max(st.floor, st.reached - max_rollback));
}

void truncate(state &st, int64_t n) {
    if (n > st.n_past || n < rollback_floor(st))
        throw error("ds4 state: cannot roll back to " + std::to_string(n) + " tokens (holds " + std::to_string(st.n_past) +
                    "; rollback reaches " + std::to_string(rollback_floor(st)) + ", at most " +
                    std::to_string(max_rollback) + " positions behind the furthest evaluated one)");
    // The rings are indexed by position and keep max_rollback positions more than decoding reads, so the
    // rows of positions < n are intact; compressed and indexer rows of blocks completed at >= n go.
    for (layer_state &ls : st.layers) {
        if (ls.comp.ratio > 0) ls.comp_rows.resize(n / ls.comp.ratio);
        if (ls.idx_comp.ratio > 0) ls.idx_rows.resize(n / ls.idx_comp.ratio);
    }
    st.n_past = n;
}

std::array<state_header_field, 7> state_header(const hparams &hp, int64_t n_past, kv_precision kv, qat_mode qat) {
    return {{{static_cast<uint64_t>(hp.n_layer), "layer count"},
             {static_cast<uint64_t>(n_past), "token count"},
             {kv == kv_precision::f32 ? 1u : 0u, "KV precision (0 f16, 1 f32)"},
             {qat_code(qat), "QAT mode (0 full, 1 fp4only, 2 off)"},
             {static_cast<uint64_t>(hp.window), "raw window"},
             {static_cast<uint64_t>(hp.head_dim), "head dim"},
             {static_cast<uint64_t>(hp.idx_dim), "indexer dim"}}};
}

void put_state_header(state_writer &w, const hparams &hp, int64_t n_past, kv_precision kv, qat_mode qat) {
    state_io::put<uint32_t>(w, state_magic);
    state_io::put<uint32_t>(w, state_version);
    for (const state_header_field &f : state_header(hp, n_past, kv, qat)) state_io::put<uint64_t>(w, f.value);
}

void check_state_header(state_reader &r, const hparams &hp, int64_t n_past, kv_precision kv, qat_mode qat) {
    if (state_io::get<uint32_t>(r) != state_magic) throw error("saved state: not a DeepSeek V4 state");
    if (state_io::get<uint32_t>(r) != state_version) throw error("saved state: unknown DeepSeek V4 state version");
    for (const state_header_field &f : state_header(hp, n_past, kv, qat)) state_io::expect(r, f.value, f.name);
}

void put_layer_state(state_writer &w, const hparams &hp, int ratio, const layer_state &ls, int64_t n_past) {
    state_io::put<uint64_t>(w, static_cast<uint64_t>(ratio));
    put_raw(w, ls.raw, hp.window, n_past);
    if (ratio > 0) {
        put_frontier(w, ls.comp, n_past);
        const auto rows = ls.comp_rows.bytes();
        w.write(rows.data(), rows.size());
    }
    if (ratio == 4) {
        put_frontier(w, ls.idx_comp, n_past);
        const auto rows = ls.idx_rows.bytes();
        w.write(rows.data(), rows.size());
    }
}

void get_layer_state(state_reader &r, const hparams &hp, int il, layer_state &ls, int64_t n_past) {
    const int ratio = hp.compress_ratio[static_cast<size_t>(il)];
    state_io::expect(r, static_cast<uint64_t>(ratio), ("compression ratio of layer " + std::to_string(il)).c_str());
    get_raw(r, ls.raw, hp.window, n_past);
    if (ratio > 0) {
        get_frontier(r, ls.comp, n_past);
        get_rows(r, ls.comp_rows, n_past / ratio);
    }
    if (ratio == 4) {
        get_frontier(r, ls.idx_comp, n_past);
        get_rows(r, ls.idx_rows, n_past / 4);
    }
}

void write_state(const model &m, const state &st, state_writer &w) {
    const hparams &hp = m.hp;
    if (st.layers.size() != m.layers.size()) throw error("ds4 state: does not belong to this model");
    put_state_header(w, hp, st.n_past, st.kv, st.qat);
    for (size_t il = 0; il < st.layers.size(); ++il)
        put_layer_state(w, hp, m.layers[il].ratio, st.layers[il], st.n_past);
}

void read_state(const model &m, state &st, state_reader &r, int64_t n_past) {
    const hparams &hp = m.hp;
    if (st.layers.size() != m.layers.size()) throw error("ds4 state: does not belong to this model");
    if (n_past < 0) throw error("saved state: negative token count");
    check_state_header(r, hp, n_past, st.kv, st.qat);
    for (size_t il = 0; il < st.layers.size(); ++il) {
        // A fresh layer state has the frontier sizes of this layer's compressors; only the row
        // counts depend on n_past.
        layer_state ls = new_layer_state(hp, m.layers[il], st.kv);
        get_layer_state(r, hp, static_cast<int>(il), ls, n_past);
        st.layers[il] = std::move(ls);
    }
    st.n_past = n_past;
    st.reached = n_past;
    st.floor = n_past;  // the stream holds no rows older than plain decoding reads: no rollback below it
}

}  // namespace fathom::ds4
