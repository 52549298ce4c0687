// Synthetic dense-model GGUF writer (see dense_synth.h): tokenizer keys copied from a vocab GGUF,
// hyperparameters for a small qwen3 / gemma3 geometry, and deterministic random weights streamed
// row by row through gguf::writer. Also a self-contained SHA-256 for checking regenerated files.
#include "models/dense_synth.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "gguf/gguf.h"

// The normal generator must give the same bits on every machine: forbid fusing a*b+c into one
// FMA (GCC contracts across statements by default when FMA is available, e.g. on aarch64).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace fathom {

namespace {

// ---- deterministic random numbers ----

uint64_t splitmix64(uint64_t &state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string &s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
    return h;
}

// ln(u) for u in [2^-24, 1]: u = m * 2^e with m in [sqrt(1/2), sqrt(2)], ln m = 2 atanh(s),
// s = (m-1)/(m+1), |s| <= 0.172, series to s^11 (error < 1e-9). Only +,-,*,/ in f32.
float synth_log(float u) {
    const uint32_t bits = std::bit_cast<uint32_t>(u);
    int32_t e = static_cast<int32_t>((bits >> 23) & 0xff) - 127;
    float m = std::bit_cast<float>((bits & 0x7fffffu) | 0x3f800000u);  // [1, 2)
    if (m > 1.41421356f) {
        m = m * 0.5f;
        e += 1;
    }
    const float s = (m - 1.0f) / (m + 1.0f);
    const float s2 = s * s;
    float p = 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return static_cast<float>(e) * 0.693147181f + 2.0f * s * p;
}

// cos and sin of a in [0, pi/2] by Taylor series (degree 14 / 13; error < 1e-8).
void synth_cos_sin(float a, float &c, float &s) {
    const float a2 = a * a;
    float pc = 1.0f / 87178291200.0f;  // 1/14!
    pc = pc * a2 * -1.0f + 1.0f / 479001600.0f;
    pc = pc * a2 * -1.0f + 1.0f / 3628800.0f;
    pc = pc * a2 * -1.0f + 1.0f / 40320.0f;
    pc = pc * a2 * -1.0f + 1.0f / 720.0f;
    pc = pc * a2 * -1.0f + 1.0f / 24.0f;
    pc = pc * a2 * -1.0f + 0.5f;
    c = pc * a2 * -1.0f + 1.0f;
    float ps = 1.0f / 6227020800.0f;  // 1/13!
    ps = ps * a2 * -1.0f + 1.0f / 39916800.0f;
    ps = ps * a2 * -1.0f + 1.0f / 362880.0f;
    ps = ps * a2 * -1.0f + 1.0f / 5040.0f;
    ps = ps * a2 * -1.0f + 1.0f / 120.0f;
    ps = ps * a2 * -1.0f + 1.0f / 6.0f;
    ps = ps * a2 * -1.0f + 1.0f;
    s = ps * a;
}

// Standard normals by Box-Muller, two per pair of 24-bit uniforms, in a fixed order.
class normal_stream {
public:
    explicit normal_stream(uint64_t seed) : state_(seed) {}
    float next() {
        if (have_spare_) {
            have_spare_ = false;
            return spare_;
        }
        const uint64_t r = splitmix64(state_);
        const float u1 = static_cast<float>((r >> 40) + 1) * 0x1p-24f;             // (0, 1]
        const uint32_t k = static_cast<uint32_t>(r & 0xffffff);                       // angle: k / 2^24 turns
        const float rad = std::sqrt(-2.0f * synth_log(u1));                           // sqrt is exact-rounded
        const uint32_t quadrant = k >> 22;
        const float frac = static_cast<float>(k & 0x3fffff) * 0x1p-22f;             // [0, 1) of a quadrant
        float c, s;
        synth_cos_sin(frac * 1.57079633f, c, s);
        const float cs[4][2] = {{c, s}, {-s, c}, {-c, -s}, {s, -c}};
        spare_ = rad * cs[quadrant][1];
        have_spare_ = true;
        return rad * cs[quadrant][0];
    }

private:
    uint64_t state_;
    float spare_ = 0.0f;
    bool have_spare_ = false;
};

// ---- weight quantisers ----
// Own round-to-nearest quantisers for the weight types the files use, so the bytes (and the
// recorded SHA-256) do not change when the engine's reference quantisers are tuned. Layouts are
// ggml's (docs/formats/quant-types.md); f16 conversion is IEEE round-to-nearest-even.

int synth_round(float v) { return static_cast<int>(v >= 0.0f ? v + 0.5f : v - 0.5f); }

void put_f16(uint8_t *dst, float v) {
    const uint16_t h = cpu::f32_to_f16(v);
    dst[0] = static_cast<uint8_t>(h & 0xff);
    dst[1] = static_cast<uint8_t>(h >> 8);
}

// q8_0: 32 values -> f16 d = amax/127, int8 q = round(x/d).          [34 bytes]
void synth_q8_0(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(x[i]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    put_f16(y, d);
    for (int i = 0; i < 32; ++i) y[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(synth_round(x[i] * id)));
}

// q4_0: 32 values -> f16 d = (signed max)/-8, q = x/d + 8 in [0, 15]; byte j = q[j] | q[j+16]<<4.
void synth_q4_0(const float *x, uint8_t *y) {
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < 32; ++i)
        if (std::abs(x[i]) > amax) amax = std::abs(x[i]), mx = x[i];
    const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(y, d);
    for (int j = 0; j < 16; ++j) {
        const int q0 = std::clamp(synth_round(x[j] * id) + 8, 0, 15);
        const int q1 = std::clamp(synth_round(x[j + 16] * id) + 8, 0, 15);
        y[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
}

// q4_k: 256 values in 8 sub-blocks of 32, x ~= d*sc_j*q - dmin*m_j with q in [0, 15] and 6-bit
// sc_j, m_j. Layout: f16 d, f16 dmin, scales[12] (get_scale_min_k4 packing), qs[128] where byte
// 32c + l holds sub-block 2c element l (low nibble) and sub-block 2c+1 element l (high).  [144 bytes]
void synth_q4_k(const float *x, uint8_t *y) {
    float scale[8], minv[8];
    for (int j = 0; j < 8; ++j) {
        float lo = 0.0f, hi = 0.0f;  // the range always includes 0: mins are stored non-negative
        for (int i = 0; i < 32; ++i) lo = std::min(lo, x[32 * j + i]), hi = std::max(hi, x[32 * j + i]);
        scale[j] = (hi - lo) / 15.0f;
        minv[j] = -lo;
    }
    float smax = 0.0f, mmax = 0.0f;
    for (int j = 0; j < 8; ++j) smax = std::max(smax, scale[j]), mmax = std::max(mmax, minv[j]);
    const uint16_t dh = cpu::f32_to_f16(smax / 63.0f), mh = cpu::f32_to_f16(mmax / 63.0f);
    const float d = cpu::f16_to_f32(dh), dmin = cpu::f16_to_f32(mh);
    int sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
        sc[j] = d > 0.0f ? std::clamp(synth_round(scale[j] / d), 0, 63) : 0;
        m[j] = dmin > 0.0f ? std::clamp(synth_round(minv[j] / dmin), 0, 63) : 0;
    }
    put_f16(y, d);
    put_f16(y + 2, dmin);
    uint8_t *scales = y + 4, *qs = y + 16;
    std::memset(scales, 0, 12);
    for (int j = 0; j < 4; ++j) {
        scales[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
        scales[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
        scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
    std::memset(qs, 0, 128);
    for (int j = 0; j < 8; ++j) {
        const float step = d * static_cast<float>(sc[j]), off = dmin * static_cast<float>(m[j]);
        for (int i = 0; i < 32; ++i) {
            const int q = step > 0.0f ? std::clamp(synth_round((x[32 * j + i] + off) / step), 0, 15) : 0;
            qs[32 * (j / 2) + i] |= static_cast<uint8_t>(j % 2 ? q << 4 : q);
        }
    }
}

// One row of n values in type t.
void synth_pack_row(dtype t, const float *x, uint8_t *dst, int64_t n) {
    switch (t) {
        case dtype::f32: std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float)); return;
        case dtype::f16:
            for (int64_t i = 0; i < n; ++i) put_f16(dst + 2 * i, x[i]);
            return;
        case dtype::q8_0:
            for (int64_t b = 0; b < n / 32; ++b) synth_q8_0(x + 32 * b, dst + 34 * b);
            return;
        case dtype::q4_0:
            for (int64_t b = 0; b < n / 32; ++b) synth_q4_0(x + 32 * b, dst + 18 * b);
            return;
        case dtype::q4_k:
            for (int64_t b = 0; b < n / 256; ++b) synth_q4_k(x + 256 * b, dst + 144 * b);
            return;
        default: throw error("synth-dense: no quantiser for " + std::string(dtype_name(t)));
    }
}

// ---- tokenizer keys ----

// Copy one metadata value of the vocab file under the same key and type.
void copy_kv(gguf::writer &w, const gguf::file &f, const std::string &key, const gguf::value &v) {
    using vt = gguf::value_type;
    switch (v.type) {
        case vt::string: w.set_string(key, std::string(v.str)); return;
        case vt::u8: w.set_u8(key, static_cast<uint8_t>(v.u)); return;
        case vt::i8: w.set_i8(key, static_cast<int8_t>(v.i)); return;
        case vt::u16: w.set_u16(key, static_cast<uint16_t>(v.u)); return;
        case vt::i16: w.set_i16(key, static_cast<int16_t>(v.i)); return;
        case vt::u32: w.set_u32(key, static_cast<uint32_t>(v.u)); return;
        case vt::i32: w.set_i32(key, static_cast<int32_t>(v.i)); return;
        case vt::u64: w.set_u64(key, v.u); return;
        case vt::i64: w.set_i64(key, v.i); return;
        case vt::f32: w.set_f32(key, static_cast<float>(v.f)); return;
        case vt::f64: w.set_f64(key, v.f); return;
        case vt::boolean: w.set_bool(key, v.i != 0); return;
        case vt::array: break;
    }
    switch (v.elem_type) {
        case vt::string: w.set_arr_str(key, std::vector<std::string>(v.arr_str.begin(), v.arr_str.end())); return;
        case vt::i32: w.set_arr_i32(key, std::vector<int32_t>(v.arr_int.begin(), v.arr_int.end())); return;
        case vt::u32: w.set_arr_u32(key, std::vector<uint32_t>(v.arr_int.begin(), v.arr_int.end())); return;
        case vt::i64: w.set_arr_i64(key, v.arr_int); return;
        case vt::f32: w.set_arr_f32(key, std::vector<float>(v.arr_float.begin(), v.arr_float.end())); return;
        case vt::f64: w.set_arr_f64(key, v.arr_float); return;
        case vt::boolean: w.set_arr_bool(key, std::vector<bool>(v.arr_int.begin(), v.arr_int.end())); return;
        default:
            throw error(f.path() + ": cannot copy " + key + " of type " + gguf::value_type_label(v));
    }
}

// ---- tensors ----

struct synth_tensor {
    std::string name;
    dtype type;
    int64_t ne0, ne1;    // ne0 = K (row length), ne1 = rows
    float center, scale; // value = center + scale * N(0, 1)
};

std::vector<synth_tensor> plan_tensors(const dense_synth_options &o, int64_t n_vocab) {
    const int64_t E = o.n_embd, Q = int64_t{o.n_head} * o.head_dim, KV = int64_t{o.n_head_kv} * o.head_dim;
    const bool gemma = o.arch == "gemma3";
    // Matrices: unit-variance outputs for unit-variance inputs (scale 1/sqrt(K)); the output
    // projection 3x that, so logits spread over a few units as in a trained model.
    auto mat = [](std::string n, dtype t, int64_t k, int64_t rows, float gain) {
        return synth_tensor{std::move(n), t, k, rows, 0.0f, gain / std::sqrt(static_cast<float>(k))};
    };
    auto norm = [](std::string n, int64_t k) { return synth_tensor{std::move(n), dtype::f32, k, 1, 1.0f, 0.1f}; };
    std::vector<synth_tensor> ts;
    // Tied output in float mode: the embedding doubles as the output matrix, so it must be f16 too.
    const dtype embd_type = o.float_weights && o.tied_output ? dtype::f16 : o.embd_type;
    ts.push_back({"token_embd.weight", embd_type, E, n_vocab, 0.0f, 1.0f});
    ts.push_back(norm("output_norm.weight", E));
    const dtype out_type = o.float_weights ? dtype::f16 : o.output_type;
    if (!o.tied_output) ts.push_back(mat("output.weight", out_type, E, n_vocab, 3.0f));
    for (int32_t il = 0; il < o.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        // q4_k needs rows of whole 256-blocks: other row lengths (real geometries such as K = 576)
        // get q8_0 instead, as llama.cpp's quantiser falls back. The presets never hit this.
        auto ty = [&o, il](const char *kind) {
            const dtype t = o.weight_type ? *o.weight_type : dense_synth_weight_type(kind, il, o.float_weights);
            const int64_t k = std::string(kind) == "attn_output" ? int64_t{o.n_head} * o.head_dim
                              : std::string(kind) == "ffn_down"  ? o.n_ff
                                                                 : o.n_embd;
            return t == dtype::q4_k && k % 256 != 0 ? dtype::q8_0 : t;
        };
        ts.push_back(norm(p + "attn_norm.weight", E));
        ts.push_back(mat(p + "attn_q.weight", ty("attn_q"), E, Q, 1.0f));
        ts.push_back(mat(p + "attn_k.weight", ty("attn_k"), E, KV, 1.0f));
        ts.push_back(mat(p + "attn_v.weight", ty("attn_v"), E, KV, 1.0f));
        ts.push_back(mat(p + "attn_output.weight", ty("attn_output"), Q, E, 1.0f));
        if (o.arch != "llama") {  // llama has no per-head q/k norms
            ts.push_back(norm(p + "attn_q_norm.weight", o.head_dim));
            ts.push_back(norm(p + "attn_k_norm.weight", o.head_dim));
        }
        if (gemma) ts.push_back(norm(p + "post_attention_norm.weight", E));
        ts.push_back(norm(p + "ffn_norm.weight", E));
        ts.push_back(mat(p + "ffn_gate.weight", ty("ffn_gate"), E, o.n_ff, 1.0f));
        ts.push_back(mat(p + "ffn_up.weight", ty("ffn_up"), E, o.n_ff, 1.0f));
        ts.push_back(mat(p + "ffn_down.weight", ty("ffn_down"), o.n_ff, E, 1.0f));
        if (gemma) ts.push_back(norm(p + "post_ffw_norm.weight", E));
    }
    for (const synth_tensor &t : ts) {
        if (t.type != dtype::f32 && t.type != dtype::f16 && t.type != dtype::q8_0 && t.type != dtype::q4_0 &&
            t.type != dtype::q4_k)
            throw error("synth-dense: " + t.name + ": type " + std::string(dtype_name(t.type)) +
                        " not supported (f32, f16, q8_0, q4_0, q4_k)");
        const auto &info = dtype_info(t.type);
        if (t.ne0 % info.block_size != 0)
            throw error("synth-dense: " + t.name + " row of " + std::to_string(t.ne0) + " is not a multiple of the " +
                        std::string(info.name) + " block (" + std::to_string(info.block_size) + ")");
    }
    return ts;
}

void check_options(const dense_synth_options &o) {
    if (o.arch != "qwen3" && o.arch != "gemma3" && o.arch != "llama")
        throw error("synth-dense: unsupported arch '" + o.arch + "' (qwen3, gemma3, llama)");
    auto pos = [](int32_t v, const char *what) {
        if (v <= 0 || v > (1 << 20)) throw error(std::string("synth-dense: ") + what + " out of range: " + std::to_string(v));
    };
    pos(o.n_layer, "n_layer");
    pos(o.n_embd, "n_embd");
    pos(o.n_head, "n_head");
    pos(o.n_head_kv, "n_head_kv");
    pos(o.head_dim, "head_dim");
    pos(o.n_ff, "n_ff");
    pos(o.n_ctx_train, "n_ctx_train");
    if (o.n_head % o.n_head_kv != 0) throw error("synth-dense: n_head must be a multiple of n_head_kv");
    if (o.head_dim % 2 != 0) throw error("synth-dense: head_dim must be even (RoPE pairs)");
    if (o.sliding_window < 0) throw error("synth-dense: negative sliding window");
    if (o.sliding_window > 0 && o.arch != "gemma3") throw error("synth-dense: sliding window is gemma3-only");
}

}  // namespace

dense_synth_options dense_synth_preset(const std::string &arch, const std::string &vocab_path, uint64_t seed) {
    dense_synth_options o;
    o.arch = arch;
    o.vocab_path = vocab_path;
    o.seed = seed;
    if (arch == "qwen3") return o;  // the defaults of dense_synth_options
    if (arch == "gemma3") {
        o.n_layer = 6;          // layers 0-4 sliding window, layer 5 global (pattern 6)
        o.n_head_kv = 1;
        o.sliding_window = 32;  // well below the test's 200+ positions
        o.tied_output = true;
        o.embd_type = dtype::q8_0;
        return o;
    }
    throw error("synth-dense: no preset for arch '" + arch + "' (qwen3, gemma3)");
}

dtype dense_synth_weight_type(const std::string &kind, int32_t layer, bool float_weights) {
    const size_t l = static_cast<size_t>(layer) % 4;
    if (float_weights && (kind == "attn_output" || kind == "ffn_down")) return layer % 2 ? dtype::f16 : dtype::f32;
    if (kind == "attn_q" || kind == "attn_k" || kind == "ffn_gate") return dtype::f32;
    if (kind == "attn_v") return dtype::f16;
    if (kind == "ffn_up") return layer % 2 ? dtype::f16 : dtype::f32;
    // K = n_head*head_dim and n_ff (256 in the presets): the k-quant block fits.
    static const dtype attn_out[4] = {dtype::f32, dtype::q4_k, dtype::q8_0, dtype::f16};
    static const dtype ffn_down[4] = {dtype::q8_0, dtype::f32, dtype::q4_k, dtype::f32};
    if (kind == "attn_output") return attn_out[l];
    if (kind == "ffn_down") return ffn_down[l];
    throw error("synth-dense: unknown weight kind '" + kind + "'");
}

void dense_synth_write(const dense_synth_options &o, const std::string &out_path) {
    check_options(o);
    auto vocab = gguf::file::open(o.vocab_path);
    const int64_t n_vocab = static_cast<int64_t>(vocab->get_string_array("tokenizer.ggml.tokens").size());
    if (n_vocab <= 0) throw error(o.vocab_path + ": empty tokenizer.ggml.tokens");
    const std::vector<synth_tensor> ts = plan_tensors(o, n_vocab);

    gguf::writer w(out_path);
    const std::string &a = o.arch;
    w.set_string("general.architecture", a);
    w.set_string("general.name", "fathom-synth-" + a + (o.float_weights ? "-float" : "") + "-seed" + std::to_string(o.seed));
    w.set_u32(a + ".context_length", static_cast<uint32_t>(o.n_ctx_train));
    w.set_u32(a + ".embedding_length", static_cast<uint32_t>(o.n_embd));
    w.set_u32(a + ".block_count", static_cast<uint32_t>(o.n_layer));
    w.set_u32(a + ".feed_forward_length", static_cast<uint32_t>(o.n_ff));
    w.set_u32(a + ".attention.head_count", static_cast<uint32_t>(o.n_head));
    w.set_u32(a + ".attention.head_count_kv", static_cast<uint32_t>(o.n_head_kv));
    w.set_u32(a + ".attention.key_length", static_cast<uint32_t>(o.head_dim));
    w.set_u32(a + ".attention.value_length", static_cast<uint32_t>(o.head_dim));
    w.set_f32(a + ".attention.layer_norm_rms_epsilon", o.rms_eps);
    w.set_f32(a + ".rope.freq_base", o.rope_freq_base);
    if (o.sliding_window > 0) w.set_u32(a + ".attention.sliding_window", static_cast<uint32_t>(o.sliding_window));
    for (const gguf::kv &e : vocab->metadata()) {
        const std::string key(e.key);
        if (key.rfind("tokenizer.", 0) == 0) copy_kv(w, *vocab, key, e.val);
    }
    for (const synth_tensor &t : ts) {
        std::vector<int64_t> ne = {t.ne0};
        if (t.ne1 > 1) ne.push_back(t.ne1);
        w.add_tensor(t.name, t.type, ne);
    }
    w.write_header();

    // Stream every tensor row by row: ne0 normals -> quantise -> append.
    for (const synth_tensor &t : ts) {
        uint64_t st = o.seed ^ fnv1a64(t.name);
        normal_stream rng(splitmix64(st));
        std::vector<float> row(static_cast<size_t>(t.ne0));
        std::vector<uint8_t> packed(dtype_row_bytes(t.type, t.ne0));
        for (int64_t r = 0; r < t.ne1; ++r) {
            for (float &x : row) x = t.center + t.scale * rng.next();
            synth_pack_row(t.type, row.data(), packed.data(), t.ne0);
            w.write_tensor_data(packed.data(), packed.size());
        }
    }
    w.finish();
}

// ---- SHA-256 (FIPS 180-4) ----

namespace {

struct sha256_state {
    std::array<uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    uint8_t buf[64] = {};
    size_t buf_len = 0;
    uint64_t total = 0;

    void block(const uint8_t *p) {
        static const uint32_t k[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
            0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
            0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
            0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
            0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
            0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
            0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
        uint32_t w[64];
        for (int i = 0; i < 16; ++i)
            w[i] = uint32_t{p[4 * i]} << 24 | uint32_t{p[4 * i + 1]} << 16 | uint32_t{p[4 * i + 2]} << 8 | p[4 * i + 3];
        for (int i = 16; i < 64; ++i) {
            const uint32_t s0 = std::rotr(w[i - 15], 7) ^ std::rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            const uint32_t s1 = std::rotr(w[i - 2], 17) ^ std::rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
        for (int i = 0; i < 64; ++i) {
            const uint32_t t1 = hh + (std::rotr(e, 6) ^ std::rotr(e, 11) ^ std::rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
            const uint32_t t2 = (std::rotr(a, 2) ^ std::rotr(a, 13) ^ std::rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
    }

    void update(const uint8_t *p, size_t n) {
        total += n;
        while (n > 0) {
            const size_t take = std::min(n, size_t{64} - buf_len);
            std::memcpy(buf + buf_len, p, take);
            buf_len += take, p += take, n -= take;
            if (buf_len == 64) block(buf), buf_len = 0;
        }
    }

    std::string hex() {
        const uint64_t bits = total * 8;
        const uint8_t one = 0x80, zero = 0;
        update(&one, 1);
        while (buf_len != 56) update(&zero, 1);
        uint8_t len[8];
        for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
        update(len, 8);
        static const char *digits = "0123456789abcdef";
        std::string out;
        for (uint32_t v : h)
            for (int s = 28; s >= 0; s -= 4) out += digits[(v >> s) & 15];
        return out;
    }
};

}  // namespace

std::string dense_synth_sha256(const std::string &path) {
    std::unique_ptr<FILE, int (*)(FILE *)> fp(std::fopen(path.c_str(), "rb"), &std::fclose);
    if (!fp) throw error(path + ": cannot open for hashing");
    sha256_state st;
    std::vector<uint8_t> buf(1 << 16);
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), fp.get())) > 0) st.update(buf.data(), n);
    if (std::ferror(fp.get())) throw error(path + ": read error while hashing");
    return st.hex();
}

}  // namespace fathom
