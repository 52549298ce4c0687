// Malformed GGUF input: each defect must produce a one-line error naming the file and the reason.
// Files are built by hand (gguf_test::builder), with the writer's set_raw, or by patching the bytes of
// a valid writer-produced file at positions located through a successful parse.
#include "gguf_test_util.h"

using namespace gguf_test;
using fathom::dtype;
using fathom::gguf::value_type;
using fathom::gguf::writer;

namespace {

// Valid base file: 3 keys, tensors "a.0" (q4_0 [64, 2], 72 bytes) and "a.1" (f32 [8], 32 bytes).
bytes base_file() {
    const std::string path = temp_path("base.gguf");
    {
        writer w(path);
        w.set_string("general.name", "base");
        w.set_u32("k.u32", 5);
        w.set_arr_i32("k.arr", {1, 2, 3});
        w.add_tensor("a.0", dtype::q4_0, {64, 2});
        w.add_tensor("a.1", dtype::f32, {8});
        w.write_header();
        bytes q(72, 1), f(32, 2);
        w.write_tensor_data(q.data(), q.size());
        w.write_tensor_data(f.data(), f.size());
        w.finish();
    }
    return read_file(path);
}

// A file whose metadata is written by `fill` through the writer (no tensors).
template <typename F>
bytes meta_file(F fill) {
    const std::string path = temp_path("meta.gguf");
    {
        writer w(path);
        fill(w);
        w.write_header();
        w.finish();
    }
    return read_file(path);
}

}  // namespace

TEST(GgufMalformed, BaseFileIsValid) {
    EXPECT_EQ(parse_error(base_file()), "");
    auto b = base_file();
    auto f = parse(b);
    EXPECT_EQ(f->tensor("a.0").nbytes, 72u);
    EXPECT_EQ(f->tensor("a.1").offset, 96u);
}

TEST(GgufMalformed, Header) {
    bytes b = base_file();
    b[0] = 'X';
    EXPECT_PARSE_ERROR(b, "bad magic 'XGUF'");
    EXPECT_PARSE_ERROR(builder().header(1, 0, 0).b, "GGUF version 1 is not supported");
    EXPECT_PARSE_ERROR(builder().header(4, 0, 0).b, "unsupported GGUF version 4");
    EXPECT_PARSE_ERROR(builder().header(0x03000000, 0, 0).b, "big-endian GGUF file");
    EXPECT_PARSE_ERROR(bytes({'G', 'G'}),
                       "truncated file at offset 0: header: magic needs 4 bytes, only 2 left");
    EXPECT_PARSE_ERROR(bytes({'G', 'G', 'U', 'F', 3, 0}), "truncated file at offset 4: header: version");
}

TEST(GgufMalformed, CountsOutOfRange) {
    EXPECT_PARSE_ERROR(builder().header(3, 0, 1ull << 60).b, "metadata count 1152921504606846976 exceeds");
    EXPECT_PARSE_ERROR(builder().header(3, ~0ull, 0).b, "tensor count 18446744073709551615 exceeds");
    // n_tensors = 1 with no bytes for the directory: the bound says it cannot fit.
    EXPECT_PARSE_ERROR(builder().header(3, 1, 0).b, "tensor count 1 exceeds");
}

// Every proper prefix that cuts into the header, metadata, directory or tensor data must fail cleanly.
TEST(GgufMalformed, EveryTruncationFails) {
    const bytes full = base_file();
    auto f = parse(full);
    const auto &last = f->tensor("a.1");
    const size_t data_end = f->data_offset() + last.offset + last.nbytes;
    for (size_t n = 0; n < data_end; ++n) {
        bytes cut(full.begin(), full.begin() + n);
        const std::string m = parse_error(cut);
        EXPECT_NE(m, "") << "prefix " << n;
    }
    // A cut inside a key's string value names the offset, key and field.
    builder h;
    h.header(3, 0, 1).str("general.name").u32(8).u64(4).u8('b').u8('a');
    EXPECT_PARSE_ERROR(
        h.b, "truncated file at offset 56: key 'general.name': string value needs 4 bytes, only 2 left");
    // A cut inside the data of the last tensor.
    bytes cut2(full.begin(), full.begin() + data_end - 1);
    EXPECT_PARSE_ERROR(cut2, "tensor 'a.1': data (offset 96, 32 bytes) extends past the end of the file");
}

TEST(GgufMalformed, StringAndArrayLengths) {
    bytes b = base_file();
    const size_t t = locate_key_type(b, "general.name");
    patch_u64(b, t + 4, 1ull << 62);  // string length
    EXPECT_PARSE_ERROR(b, "key 'general.name': string value needs 4611686018427387904 bytes");
    b = base_file();
    const size_t a = locate_key_type(b, "k.arr");
    patch_u64(b, a + 8, ~0ull);  // array length
    EXPECT_PARSE_ERROR(b, "key 'k.arr': array length 18446744073709551615 of i32 exceeds");
    b = base_file();
    patch_u64(b, a - 5 - 8, 1ull << 40);  // key length of "k.arr" (5 bytes before its type)
    EXPECT_PARSE_ERROR(b, "metadata entry #2: key needs 1099511627776 bytes");
    // Arrays of strings: each element needs at least its 8-byte length.
    EXPECT_PARSE_ERROR(
        meta_file([](writer &w) { w.set_raw("s", value_type::array, builder().u32(8).u64(1000).u64(0).b); }),
        "key 's': array length 1000 of string exceeds");
}

TEST(GgufMalformed, ValueTypes) {
    bytes b = base_file();
    patch_u32(b, locate_key_type(b, "k.u32"), 13);
    EXPECT_PARSE_ERROR(b, "key 'k.u32': unknown value type 13");
    b = base_file();
    patch_u32(b, locate_key_type(b, "k.arr") + 4, 77);
    EXPECT_PARSE_ERROR(b, "key 'k.arr': unknown array element type 77");
    EXPECT_PARSE_ERROR(meta_file([](writer &w) { w.set_raw("b", value_type::boolean, {2}); }),
                       "key 'b': bool value 2 (must be 0 or 1)");
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_raw("b", value_type::array, builder().u32(7).u64(2).u8(1).u8(3).b);
                       }),
                       "key 'b': bool array element has value 3");
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_raw("big", value_type::array, builder().u32(10).u64(1).u64(~0ull).b);
                       }),
                       "key 'big': u64 array element 18446744073709551615 exceeds the int64 range");
}

TEST(GgufMalformed, NestedArraysBounded) {
    // depth levels of [[[...]]] around one u8.
    auto nested = [](int depth) {
        builder b;
        for (int i = 0; i < depth; ++i) b.u32(9).u64(1);
        b.u32(0).u64(1).u8(7);
        return b.b;
    };
    EXPECT_EQ(parse_error(meta_file([&](writer &w) { w.set_raw("n", value_type::array, nested(7)); })), "");
    EXPECT_PARSE_ERROR(meta_file([&](writer &w) { w.set_raw("n", value_type::array, nested(12)); }),
                       "key 'n': arrays nested deeper than 8 levels");
    // A nested array claiming more elements than the file can hold.
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_raw("n", value_type::array,
                                     builder().u32(9).u64(1).u32(9).u64(1ull << 50).b);
                       }),
                       "array length 1125899906842624 of array exceeds");
}

TEST(GgufMalformed, DuplicateKeys) {
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_u32("dup", 1);
                           w.set_raw("dup", value_type::u32, builder().u32(2).b);
                       }),
                       "duplicate key 'dup'");
}

TEST(GgufMalformed, Alignment) {
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_raw("general.alignment", value_type::string, builder().str("32").b);
                       }),
                       "key 'general.alignment' has type string, expected u32");
    EXPECT_PARSE_ERROR(
        meta_file([](writer &w) { w.set_raw("general.alignment", value_type::u64, builder().u64(32).b); }),
        "key 'general.alignment' has type u64, expected u32");
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_raw("general.alignment", value_type::u32, {0, 0, 0, 0});
                       }),
                       "general.alignment = 0 is not a non-zero power of two");
    EXPECT_PARSE_ERROR(meta_file([](writer &w) {
                           w.set_raw("general.alignment", value_type::u32, {48, 0, 0, 0});
                       }),
                       "general.alignment = 48 is not a non-zero power of two");
}

TEST(GgufMalformed, TensorTypeAndDims) {
    const bytes good = base_file();
    const tensor_fields a0 = locate_tensor(good, "a.0");
    const tensor_fields a1 = locate_tensor(good, "a.1");
    bytes b = good;
    patch_u32(b, a0.type, 99);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': unknown tensor type id 99");
    b = good;
    patch_u32(b, a0.type, 4);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': type id 4 (q4_2, removed from ggml) has no known block geometry");
    b = good;
    patch_u32(b, a0.n_dims, 5);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': n_dims = 5 (must be 1..4)");
    b = good;
    patch_u32(b, a0.n_dims, 0);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': n_dims = 0 (must be 1..4)");
    b = good;
    patch_u64(b, a0.ne + 8, 0);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': ne[1] = 0 is out of range");
    b = good;
    patch_u64(b, a0.ne + 8, 1ull << 63);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': ne[1] = 9223372036854775808 is out of range");
    b = good;
    patch_u64(b, a0.ne, 33);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': ne[0] = 33 is not a multiple of the q4_0 block size 32");
    b = good;
    patch_u64(b, a0.ne, 1ull << 37);  // q4_0: 2^37 * 2^30 elements overflows int64
    patch_u64(b, a0.ne + 8, 1ull << 30);
    EXPECT_PARSE_ERROR(b, "tensor 'a.0': element count overflows int64");
    b = good;
    patch_u64(b, a1.ne, 1ull << 62);  // f32: 2^62 elements * 4 bytes overflows u64
    EXPECT_PARSE_ERROR(b, "tensor 'a.1': byte size overflows");
}

TEST(GgufMalformed, TensorPlacement) {
    const bytes good = base_file();
    const tensor_fields a1 = locate_tensor(good, "a.1");
    bytes b = good;
    patch_u64(b, a1.offset, 100);
    EXPECT_PARSE_ERROR(b, "tensor 'a.1': data offset 100 is not a multiple of the alignment 32");
    b = good;
    patch_u64(b, a1.offset, 1ull << 40);
    EXPECT_PARSE_ERROR(
        b, "tensor 'a.1': data (offset 1099511627776, 32 bytes) extends past the end of the file");
    b = good;
    patch_u64(b, a1.offset, ~0ull << 5);  // aligned, and data_offset + offset overflows
    EXPECT_PARSE_ERROR(b, "extends past the end of the file");
    b = good;
    patch_u64(b, a1.offset, 64);  // a.0 occupies [0, 72)
    EXPECT_PARSE_ERROR(b, "tensors 'a.0' and 'a.1' overlap");
    b = good;
    patch_u64(b, a1.offset, 0);  // both at 0: overlap regardless of sort order
    EXPECT_PARSE_ERROR(b, "overlap");
    b = good;
    b[a1.n_dims - 1] = '0';  // rename a.1 -> a.0
    EXPECT_PARSE_ERROR(b, "duplicate tensor name 'a.0'");
}

TEST(GgufMalformed, OddBytesInNamesAreAllowedAndEscapedInMessages) {
    // Keys and strings are plain bytes (invalid UTF-8 accepted); messages escape them to stay one line.
    const std::string key("bad\n\xff", 5);
    bytes ok = meta_file([&](writer &w) { w.set_string(key, std::string("\xc3\x28", 2)); });
    EXPECT_EQ(parse_error(ok), "");
    EXPECT_EQ(parse(ok)->get_string(key), std::string("\xc3\x28", 2));
    bytes b = meta_file([&](writer &w) { w.set_raw(key, value_type::boolean, {9}); });
    EXPECT_PARSE_ERROR(b, "key 'bad\\x0a\\xff': bool value 9");
}
