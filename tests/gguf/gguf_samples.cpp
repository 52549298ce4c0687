// gguf_samples OUTDIR: writes small GGUF files with the Fathom writer, covering every metadata value
// type, every tensor type with known geometry, non-default alignment, version 2 and nested arrays.
// Used by the gguf-py cross-check (tests/gguf/check_gguf_py.py) and as the fuzzing seed corpus
// (scripts/fuzz.sh). Files stay small (a few KiB) so that they make good fuzz seeds.
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/types.h"
#include "gguf/gguf.h"

namespace {

using fathom::dtype;
using fathom::gguf::value_type;
using fathom::gguf::writer;

// Deterministic filler bytes for tensor payloads.
std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
    std::vector<uint8_t> v(n);
    uint32_t x = seed * 2654435761u + 1;
    for (auto &b : v) {
        x = x * 1664525u + 1013904223u;
        b = static_cast<uint8_t>(x >> 24);
    }
    return v;
}

// Raw array payload: element type, count, then `elems` bytes as given.
std::vector<uint8_t> raw_array(value_type elem, uint64_t count, std::vector<uint8_t> elems) {
    std::vector<uint8_t> p(12);
    const auto e = static_cast<uint32_t>(elem);
    for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(e >> (8 * i));
    for (int i = 0; i < 8; ++i) p[4 + i] = static_cast<uint8_t>(count >> (8 * i));
    p.insert(p.end(), elems.begin(), elems.end());
    return p;
}

void write_values(const std::string &dir) {
    writer w(dir + "/values.gguf");
    w.set_string("general.architecture", "sample");
    w.set_string("general.name", "values: every type");
    w.set_u8("v.u8", 200);
    w.set_i8("v.i8", -100);
    w.set_u16("v.u16", 60000);
    w.set_i16("v.i16", -30000);
    w.set_u32("v.u32", 4000000000u);
    w.set_i32("v.i32", -2000000000);
    w.set_u64("v.u64", 18000000000000000000ull);
    w.set_i64("v.i64", -9000000000000000000ll);
    w.set_f32("v.f32", 3.14159f);
    w.set_f64("v.f64", -2.718281828459045);
    w.set_bool("v.true", true);
    w.set_bool("v.false", false);
    w.set_string("v.empty", "");
    w.set_string("v.utf8", "h\xc3\xa9llo \xe2\x9c\x93");
    w.set_arr_str("a.str", {"a", "", "bc", "\xe2\x96\x81the"});
    w.set_arr_i32("a.i32", {-5, 0, 7, 2147483647});
    w.set_arr_u32("a.u32", {1, 4294967295u});
    w.set_arr_i64("a.i64", {-1, 1ll << 40});
    w.set_arr_f32("a.f32", {0.5f, -1.25f, 1e-30f});
    w.set_arr_f64("a.f64", {1e300, -0.125});
    w.set_arr_bool("a.bool", {true, false, false, true});
    w.set_arr_f32("a.empty", {});
    w.set_raw("a.u8", value_type::array, raw_array(value_type::u8, 3, {0, 128, 255}));
    w.set_raw("a.i8", value_type::array, raw_array(value_type::i8, 2, {0x80, 0x7f}));
    w.set_raw("a.u16", value_type::array, raw_array(value_type::u16, 1, {0xff, 0xff}));
    w.set_raw("a.i16", value_type::array, raw_array(value_type::i16, 1, {0x00, 0x80}));
    w.set_raw("a.u64", value_type::array, raw_array(value_type::u64, 1, {1, 0, 0, 0, 0, 0, 0, 0x40}));
    w.add_tensor("one", dtype::f32, {4});
    w.write_header();
    const float one[4] = {1, 2, 3, 4};
    w.write_tensor_data(one, sizeof one);
    w.finish();
}

// One tensor per known type, one block wide and two rows, alignment 64.
void write_tensors(const std::string &dir) {
    writer w(dir + "/tensors.gguf", 3, 64);
    w.set_string("general.architecture", "sample");
    std::vector<std::pair<dtype, size_t>> decl;
    for (uint32_t id = 0; id < 64; ++id) {
        const auto &ti = fathom::dtype_info(id);
        if (!ti.known) continue;
        const auto t = static_cast<dtype>(id);
        w.add_tensor("t." + std::string(ti.name), t, {int64_t(ti.block_size), 2});
        decl.emplace_back(t, size_t(ti.type_size) * 2);
    }
    w.add_tensor("t.4d", dtype::f16, {2, 3, 2, 2});
    w.write_header();
    for (const auto &[t, n] : decl) {
        const auto data = pattern(n, static_cast<uint32_t>(t));
        w.write_tensor_data(data.data(), data.size());
    }
    const auto d4 = pattern(2 * 3 * 2 * 2 * 2, 99);
    w.write_tensor_data(d4.data(), d4.size());
    w.finish();
}

// A tiny llama-like model in GGUF v2 with quantized weights.
void write_model_v2(const std::string &dir) {
    writer w(dir + "/model_v2.gguf", 2);
    w.set_string("general.architecture", "llama");
    w.set_u32("llama.block_count", 1);
    w.set_u32("llama.embedding_length", 64);
    w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    w.set_arr_str("tokenizer.ggml.tokens", {"<s>", "</s>", "a", "b"});
    w.set_arr_f32("tokenizer.ggml.scores", {0, 0, -1, -2});
    w.set_arr_i32("tokenizer.ggml.token_type", {3, 3, 1, 1});
    w.add_tensor("token_embd.weight", dtype::q8_0, {64, 4});
    w.add_tensor("blk.0.attn_norm.weight", dtype::f32, {64});
    w.add_tensor("blk.0.ffn_up.weight", dtype::q4_k, {256, 2});
    w.write_header();
    for (size_t n : {size_t(34 * 2 * 4), size_t(64 * 4), size_t(144 * 2)}) {
        const auto data = pattern(n, static_cast<uint32_t>(n));
        w.write_tensor_data(data.data(), data.size());
    }
    w.finish();
}

// Arrays of arrays (parsed and skipped by Fathom): [[1, 2], [3]] of u8 and [["x"], []] of strings.
void write_nested(const std::string &dir) {
    writer w(dir + "/nested.gguf");
    std::vector<uint8_t> inner1 = raw_array(value_type::u8, 2, {1, 2});
    std::vector<uint8_t> inner2 = raw_array(value_type::u8, 1, {3});
    std::vector<uint8_t> elems = inner1;
    elems.insert(elems.end(), inner2.begin(), inner2.end());
    w.set_raw("n.u8", value_type::array, raw_array(value_type::array, 2, elems));
    std::vector<uint8_t> s1 = raw_array(value_type::string, 1, {1, 0, 0, 0, 0, 0, 0, 0, 'x'});
    std::vector<uint8_t> s2 = raw_array(value_type::string, 0, {});
    s1.insert(s1.end(), s2.begin(), s2.end());
    w.set_raw("n.str", value_type::array, raw_array(value_type::array, 2, s1));
    w.set_u32("after", 7);
    w.write_header();
    w.finish();
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: gguf_samples OUTDIR\n");
        return 2;
    }
    try {
        const std::string dir = argv[1];
        write_values(dir);
        write_tensors(dir);
        write_model_v2(dir);
        write_nested(dir);
    } catch (const fathom::error &e) {
        std::fprintf(stderr, "gguf_samples: %s\n", e.what());
        return 1;
    }
    return 0;
}
