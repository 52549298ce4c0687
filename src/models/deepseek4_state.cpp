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
#include <string>

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

}  // namespace

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

void write_state(const model &m, const state &st, state_writer &w) {
    const hparams &hp = m.hp;
    if (st.layers.size() != m.layers.size()) throw error("ds4 state: does not belong to this model");
    put_state_header(w, hp, st.n_past, st.kv, st.qat);
    for (size_t il = 0; il < st.layers.size(); ++il) {
        const layer_state &ls = st.layers[il];
        const int ratio = m.layers[il].ratio;
        state_io::put<uint64_t>(w, static_cast<uint64_t>(ratio));
        const auto raw = ls.raw.bytes();
        w.write(raw.data(), raw.size());
        if (ratio > 0) {
            put_floats(w, ls.comp.kv);
            put_floats(w, ls.comp.score);
            const auto rows = ls.comp_rows.bytes();
            w.write(rows.data(), rows.size());
        }
        if (ratio == 4) {
            put_floats(w, ls.idx_comp.kv);
            put_floats(w, ls.idx_comp.score);
            const auto rows = ls.idx_rows.bytes();
            w.write(rows.data(), rows.size());
        }
    }
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
        const int ratio = m.layers[il].ratio;
        state_io::expect(r, static_cast<uint64_t>(ratio),
                         ("compression ratio of layer " + std::to_string(il)).c_str());
        get_rows(r, ls.raw, hp.window);
        if (ratio > 0) {
            get_floats(r, ls.comp.kv);
            get_floats(r, ls.comp.score);
            get_rows(r, ls.comp_rows, n_past / ratio);
        }
        if (ratio == 4) {
            get_floats(r, ls.idx_comp.kv);
            get_floats(r, ls.idx_comp.score);
            get_rows(r, ls.idx_rows, n_past / 4);
        }
        st.layers[il] = std::move(ls);
    }
    st.n_past = n_past;
}

}  // namespace fathom::ds4
