// GGUF reader/writer tests: hand-encoded files read correctly, writer output is byte-exact against the
// spec encoding, round trips of every value type and every tensor type, typed getters, and the shared
// real-world files. Malformed input is covered in test_gguf_malformed.cpp.
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "gguf_test_util.h"

using namespace gguf_test;
using fathom::dtype;
using fathom::gguf::file;
using fathom::gguf::value_type;
using fathom::gguf::writer;

namespace {

// Block geometry from ggml's type traits (block elements, bytes per block), typed in by hand so that the
// test does not depend on core/types.cpp.
const std::map<uint32_t, std::pair<uint32_t, uint32_t>> kGeometry = {
    {0, {1, 4}},      {1, {1, 2}},      {2, {32, 18}},   {3, {32, 20}},    {6, {32, 22}},    {7, {32, 24}},
    {8, {32, 34}},    {9, {32, 36}},    {10, {256, 84}}, {11, {256, 110}}, {12, {256, 144}}, {13, {256, 176}},
    {14, {256, 210}}, {15, {256, 292}}, {16, {256, 66}}, {17, {256, 74}},  {18, {256, 98}},  {19, {256, 50}},
    {20, {32, 18}},   {21, {256, 110}}, {22, {256, 82}}, {23, {256, 136}}, {24, {1, 1}},     {25, {1, 2}},
    {26, {1, 4}},     {27, {1, 8}},     {28, {1, 8}},    {29, {256, 56}},  {30, {1, 2}},     {34, {256, 54}},
    {35, {256, 66}},  {39, {32, 17}},
};

// "t<id>". (Appending instead of `"t" + std::to_string(id)` avoids a GCC 12 -Wrestrict false positive.)
std::string type_tensor_name(uint32_t id) {
    std::string s = "t";
    s += std::to_string(id);
    return s;
}

}  // namespace

// A file encoded by hand from the spec: every field must come back as written.
TEST(GgufRead, HandEncodedFile) {
    builder b;
    b.header(3, 2, 3);
    b.str("general.name").u32(8).str("tiny");
    b.str("n").u32(4).u32(42);
    b.str("xs").u32(9).u32(6).u64(3).f32(0.5f).f32(-1.0f).f32(2.25f);
    b.str("w").u32(2).u64(4).u64(3).u32(0).u64(0);  // f32 [4, 3] at 0
    b.str("b").u32(1).u64(4).u32(0).u64(64);        // f32 [4] at 64 (48 bytes after w, aligned up)
    const size_t data_start = (b.b.size() + 31) / 32 * 32;
    b.pad_to(32);
    for (int i = 0; i < 12; ++i) b.f32(static_cast<float>(i));
    b.pad_to(32);
    for (int i = 0; i < 4; ++i) b.f32(100.0f + i);

    auto f = parse(b.b);
    EXPECT_EQ(f->version(), 3u);
    EXPECT_EQ(f->alignment(), 32u);
    EXPECT_EQ(f->data_offset(), data_start);
    ASSERT_EQ(f->metadata().size(), 3u);
    EXPECT_EQ(f->metadata()[0].key, "general.name");
    EXPECT_EQ(f->get_string("general.name"), "tiny");
    EXPECT_EQ(f->get_u32("n"), 42u);
    EXPECT_EQ(f->get_float_array("xs"), (std::vector<double>{0.5, -1.0, 2.25}));
    ASSERT_EQ(f->tensors().size(), 2u);
    const auto &w = f->tensor("w");
    EXPECT_EQ(w.n_dims, 2u);
    EXPECT_EQ(w.ne[0], 4);
    EXPECT_EQ(w.ne[1], 3);
    EXPECT_EQ(w.ne[2], 1);
    EXPECT_EQ(w.nelements(), 12);
    EXPECT_EQ(w.nbytes, 48u);
    EXPECT_EQ(w.data, b.b.data() + data_start);
    float x;
    std::memcpy(&x, w.data + 4 * 7, 4);
    EXPECT_EQ(x, 7.0f);
    const auto &bias = f->tensor("b");
    EXPECT_EQ(bias.offset, 64u);
    std::memcpy(&x, bias.data + 4, 4);
    EXPECT_EQ(x, 101.0f);
    EXPECT_EQ(f->find_tensor("nope"), nullptr);
}

TEST(GgufRead, Version2Accepted) {
    builder b;
    b.header(2, 0, 1).str("k").u32(0).u8(9);
    auto f = parse(b.b);
    EXPECT_EQ(f->version(), 2u);
    EXPECT_EQ(f->get_int("k"), 9);
}

// The writer must produce exactly the spec encoding (built independently with `builder`).
TEST(GgufWrite, ByteExact) {
    const std::string path = temp_path("exact.gguf");
    {
        writer w(path);
        w.set_u32("a", 7);
        w.set_string("s", "hi");
        w.add_tensor("t", dtype::f32, {2});
        w.add_tensor("u", dtype::q8_0, {32});
        w.write_header();
        const float d[2] = {1.0f, 2.0f};
        w.write_tensor_data(d, 4);  // in two pieces
        w.write_tensor_data(d + 1, 4);
        std::vector<uint8_t> q(34, 0xab);
        w.write_tensor_data(q.data(), q.size());
        w.finish();
    }
    builder e;
    e.header(3, 2, 2).str("a").u32(4).u32(7).str("s").u32(8).str("hi");
    e.str("t").u32(1).u64(2).u32(0).u64(0);
    e.str("u").u32(1).u64(32).u32(8).u64(32);
    e.pad_to(32).f32(1.0f).f32(2.0f).pad_to(32);
    e.raw(bytes(34, 0xab)).pad_to(32);
    EXPECT_EQ(read_file(path), e.b);
}

// write_tensor_zeros: the same bytes as writing zeros (mid-tensor, across a tensor boundary and at
// the very end of the file, where the hole must still extend the file to its full size).
TEST(GgufWrite, ZeroRunsEqualWrittenZeros) {
    const std::string a = temp_path("zeros_hole.gguf"), b = temp_path("zeros_dense.gguf");
    const float d[4] = {1, 2, 3, 4};
    const std::vector<uint8_t> z(40, 0);
    for (int hole = 0; hole < 2; ++hole) {
        writer w(hole ? a : b);
        w.add_tensor("t", dtype::f32, {6});
        w.add_tensor("u", dtype::f32, {10});
        w.write_header();
        w.write_tensor_data(d, 8);
        if (hole) w.write_tensor_zeros(8); else w.write_tensor_data(z.data(), 8);
        w.write_tensor_data(d + 2, 8);
        w.write_tensor_data(d, 4);
        if (hole) w.write_tensor_zeros(36); else w.write_tensor_data(z.data(), 36);
        EXPECT_THROW(w.write_tensor_zeros(1), fathom::error);  // every tensor is complete
        w.finish();
    }
    EXPECT_EQ(read_file(a), read_file(b));
    auto f = file::open(a);
    float v = 0;
    std::memcpy(&v, f->tensors()[1].data, 4);
    EXPECT_EQ(v, 1.0f);
}

TEST(GgufWrite, AlignmentKeyWrittenWhenNotDefault) {
    const std::string path = temp_path("align64.gguf");
    {
        writer w(path, 3, 64);
        w.add_tensor("t", dtype::f32, {3});
        w.write_header();
        const float d[3] = {1, 2, 3};
        w.write_tensor_data(d, sizeof d);
        w.finish();
    }
    builder e;
    e.header(3, 1, 1).str("general.alignment").u32(4).u32(64);
    e.str("t").u32(1).u64(3).u32(0).u64(0).pad_to(64).f32(1).f32(2).f32(3).pad_to(64);
    EXPECT_EQ(read_file(path), e.b);
    auto f = file::open(path);
    EXPECT_EQ(f->alignment(), 64u);
    EXPECT_EQ(f->data_offset() % 64, 0u);
}

// Every value type, with boundary values, written by the writer and read back.
TEST(GgufRoundTrip, EveryValueType) {
    const std::string path = temp_path("values.gguf");
    const std::string odd("a\0b\xff\xfe", 5);  // embedded NUL and invalid UTF-8: just bytes
    {
        writer w(path);
        w.set_u8("u8", 255);
        w.set_i8("i8", -128);
        w.set_u16("u16", 65535);
        w.set_i16("i16", -32768);
        w.set_u32("u32", 4294967295u);
        w.set_i32("i32", std::numeric_limits<int32_t>::min());
        w.set_u64("u64", std::numeric_limits<uint64_t>::max());
        w.set_i64("i64", std::numeric_limits<int64_t>::min());
        w.set_f32("f32", 1.5e-7f);
        w.set_f64("f64", -3.0e300);
        w.set_bool("t", true);
        w.set_bool("f", false);
        w.set_string("s", odd);
        w.set_string("empty", "");
        w.set_arr_str("as", {"x", "", odd});
        w.set_arr_i32("ai32", {-1, 0, 2147483647});
        w.set_arr_u32("au32", {0, 4294967295u});
        w.set_arr_i64("ai64", {std::numeric_limits<int64_t>::min(), 5});
        w.set_arr_f32("af32", {0.25f, -0.0f});
        w.set_arr_f64("af64", {1e-300});
        w.set_arr_bool("ab", {true, false, true});
        w.set_arr_f32("aempty", {});
        // Element types without typed setters, encoded by hand: u8, i8, u16, i16, u64 arrays.
        w.set_raw("au8", value_type::array, builder().u32(0).u64(2).u8(0).u8(255).b);
        w.set_raw("ai8", value_type::array, builder().u32(1).u64(1).u8(0x80).b);
        w.set_raw("au16", value_type::array, builder().u32(2).u64(1).u16(65535).b);
        w.set_raw("ai16", value_type::array, builder().u32(3).u64(1).u16(0x8000).b);
        w.set_raw("au64", value_type::array, builder().u32(10).u64(1).u64(1ull << 62).b);
        // Array of arrays: [[1,2],["z"]], parsed and skipped (only the outer length is kept).
        w.set_raw("nested", value_type::array,
                  builder().u32(9).u64(2).u32(4).u64(2).u32(1).u32(2).u32(8).u64(1).str("z").b);
        w.set_string("after", "still aligned");
        w.write_header();
        w.finish();
    }
    auto f = file::open(path);
    EXPECT_EQ(f->metadata().size(), 29u);
    EXPECT_EQ(f->get_int("u8"), 255);
    EXPECT_EQ(f->get_int("i8"), -128);
    EXPECT_EQ(f->get_int("u16"), 65535);
    EXPECT_EQ(f->get_int("i16"), -32768);
    EXPECT_EQ(f->get_u32("u32"), 4294967295u);
    EXPECT_EQ(f->get_int("i32"), std::numeric_limits<int32_t>::min());
    EXPECT_EQ(f->find("u64")->u, std::numeric_limits<uint64_t>::max());
    EXPECT_EQ(f->find("u64")->type, value_type::u64);
    EXPECT_EQ(f->get_int("i64"), std::numeric_limits<int64_t>::min());
    EXPECT_EQ(f->get_float("f32"), static_cast<double>(1.5e-7f));
    EXPECT_EQ(f->get_float("f64"), -3.0e300);
    EXPECT_TRUE(f->get_bool("t"));
    EXPECT_FALSE(f->get_bool("f"));
    EXPECT_EQ(f->get_string("s"), odd);
    EXPECT_EQ(f->get_string("empty"), "");
    EXPECT_EQ(f->get_string_array("as"), (std::vector<std::string_view>{"x", "", odd}));
    EXPECT_EQ(f->get_int_array("ai32"), (std::vector<int64_t>{-1, 0, 2147483647}));
    EXPECT_EQ(f->get_int_array("au32"), (std::vector<int64_t>{0, 4294967295ll}));
    EXPECT_EQ(f->get_int_array("ai64"), (std::vector<int64_t>{std::numeric_limits<int64_t>::min(), 5}));
    const auto af32 = f->get_float_array("af32");
    ASSERT_EQ(af32.size(), 2u);
    EXPECT_EQ(af32[0], 0.25);
    EXPECT_TRUE(std::signbit(af32[1]));
    EXPECT_EQ(f->get_float_array("af64"), (std::vector<double>{1e-300}));
    EXPECT_EQ(f->get_int_array("ab"), (std::vector<int64_t>{1, 0, 1}));
    EXPECT_EQ(f->find("ab")->elem_type, value_type::boolean);
    EXPECT_EQ(f->find("aempty")->arr_len, 0u);
    EXPECT_EQ(f->find("aempty")->elem_type, value_type::f32);
    EXPECT_EQ(f->get_int_array("au8"), (std::vector<int64_t>{0, 255}));
    EXPECT_EQ(f->get_int_array("ai8"), (std::vector<int64_t>{-128}));
    EXPECT_EQ(f->get_int_array("au16"), (std::vector<int64_t>{65535}));
    EXPECT_EQ(f->get_int_array("ai16"), (std::vector<int64_t>{-32768}));
    EXPECT_EQ(f->get_int_array("au64"), (std::vector<int64_t>{1ll << 62}));
    EXPECT_EQ(f->find("nested")->elem_type, value_type::array);
    EXPECT_EQ(f->find("nested")->arr_len, 2u);
    EXPECT_EQ(f->get_string("after"), "still aligned");
    // Metadata keeps file order.
    EXPECT_EQ(f->metadata().front().key, "u8");
    EXPECT_EQ(f->metadata().back().key, "after");
}

// Every tensor type with a known geometry: shape, size (from the hand table), placement and bytes.
TEST(GgufRoundTrip, EveryTensorType) {
    for (size_t alignment : {size_t{32}, size_t{64}, size_t{1}}) {
        const std::string path = temp_path("tensors.gguf");
        std::vector<bytes> payloads;
        {
            writer w(path, 3, alignment);
            for (const auto &[id, geo] : kGeometry) {
                // [2 blocks, 3, 1, 2]: exercises every dimension slot.
                w.add_tensor(type_tensor_name(id), static_cast<dtype>(id),
                             {2 * int64_t(geo.first), 3, 1, 2});
            }
            w.add_tensor("vec", dtype::f16, {5});
            w.write_header();
            for (const auto &[id, geo] : kGeometry) {
                bytes p(size_t(geo.second) * 2 * 3 * 2);
                for (size_t k = 0; k < p.size(); ++k) p[k] = static_cast<uint8_t>(k * 7 + id);
                w.write_tensor_data(p.data(), p.size());
                payloads.push_back(std::move(p));
            }
            const uint16_t h[5] = {1, 2, 3, 4, 5};
            w.write_tensor_data(h, sizeof h);
            w.finish();
        }
        auto f = file::open(path);
        ASSERT_EQ(f->tensors().size(), kGeometry.size() + 1);
        EXPECT_EQ(f->data_offset() % alignment, 0u);
        size_t k = 0;
        for (const auto &[id, geo] : kGeometry) {
            const auto &t = f->tensors()[k];
            EXPECT_EQ(t.name, type_tensor_name(id));
            EXPECT_EQ(static_cast<uint32_t>(t.type), id);
            EXPECT_EQ(t.n_dims, 4u);
            EXPECT_EQ(t.ne[0], 2 * int64_t(geo.first));
            EXPECT_EQ(t.ne[1], 3);
            EXPECT_EQ(t.ne[3], 2);
            EXPECT_EQ(t.nbytes, size_t(geo.second) * 12) << "type " << id;
            EXPECT_EQ(t.offset % alignment, 0u);
            EXPECT_EQ(bytes(t.data, t.data + t.nbytes), payloads[k]) << "type " << id;
            ++k;
        }
        const auto &v = f->tensor("vec");
        EXPECT_EQ(v.n_dims, 1u);
        EXPECT_EQ(v.nbytes, 10u);
        EXPECT_EQ(v.data[8], 5);
    }
}

TEST(GgufGetters, TypedErrorsNameTheKey) {
    builder b;
    b.header(3, 0, 7);
    b.str("s").u32(8).str("text");
    b.str("big").u32(10).u64(1ull << 63);
    b.str("neg").u32(5).u32(static_cast<uint32_t>(-5));
    b.str("u64small").u32(10).u64(77);
    b.str("flag").u32(7).u8(1);
    b.str("ints").u32(9).u32(5).u64(2).u32(3).u32(4);
    b.str("strs").u32(9).u32(8).u64(1).str("q");
    auto f = parse(b.b);
    auto msg = [&](auto fn) {
        try {
            fn();
        } catch (const fathom::error &e) {
            return std::string(e.what());
        }
        return std::string("no error");
    };
    EXPECT_EQ(msg([&] { f->get_int("s"); }), "mem.gguf: key 's' has type string, expected integer");
    EXPECT_EQ(msg([&] { f->get_int("missing"); }), "mem.gguf: key 'missing' not found");
    EXPECT_EQ(msg([&] { f->get_int("missing", 3); }), "no error");
    EXPECT_EQ(f->get_int("missing", 3), 3);
    EXPECT_EQ(msg([&] { f->get_int("s", 3); }), "mem.gguf: key 's' has type string, expected integer");
    EXPECT_NE(msg([&] { f->get_int("big"); }).find("does not fit in int64"), std::string::npos);
    EXPECT_NE(msg([&] { f->get_u32("neg"); }).find("value -5 does not fit in u32"), std::string::npos);
    EXPECT_NE(msg([&] { f->get_u32("big"); }).find("does not fit in u32"), std::string::npos);
    EXPECT_EQ(f->get_u32("u64small"), 77u);
    EXPECT_EQ(f->get_int("u64small"), 77);
    EXPECT_EQ(f->get_float("neg"), -5.0);
    EXPECT_EQ(msg([&] { f->get_bool("neg"); }), "mem.gguf: key 'neg' has type i32, expected bool");
    EXPECT_EQ(msg([&] { f->get_int("flag"); }), "mem.gguf: key 'flag' has type bool, expected integer");
    EXPECT_TRUE(f->get_bool("flag", false));
    EXPECT_FALSE(f->get_bool("nothing", false));
    EXPECT_EQ(f->get_string("nothing", "d"), "d");
    EXPECT_EQ(msg([&] { f->get_string("ints"); }),
              "mem.gguf: key 'ints' has type array[i32], expected string");
    EXPECT_EQ(msg([&] { f->get_string_array("ints"); }),
              "mem.gguf: key 'ints' has type array[i32], expected array[string]");
    EXPECT_EQ(f->get_float_array("ints"), (std::vector<double>{3, 4}));
    EXPECT_EQ(msg([&] { f->get_int_array("strs"); }),
              "mem.gguf: key 'strs' has type array[string], expected integer array");
    EXPECT_EQ(msg([&] { f->get_float("strs"); }),
              "mem.gguf: key 'strs' has type array[string], expected float");
    EXPECT_EQ(msg([&] { f->tensor("x"); }), "mem.gguf: tensor 'x' not found");
}

// ---- writer misuse ----

TEST(GgufWrite, RejectsMisuse) {
    const std::string path = temp_path("misuse.gguf");
    {
        writer w(path);
        w.set_u32("k", 1);
        EXPECT_THROW(w.set_string("k", "again"), fathom::error);
        EXPECT_THROW(w.set_u32("general.alignment", 64), fathom::error);  // writer alignment is 32
        EXPECT_THROW(w.add_tensor("bad", dtype::q4_0, {33}), fathom::error);
        EXPECT_THROW(w.add_tensor("bad", dtype::f32, {}), fathom::error);
        EXPECT_THROW(w.add_tensor("bad", dtype::f32, {1, 1, 1, 1, 1}), fathom::error);
        EXPECT_THROW(w.add_tensor("bad", dtype::f32, {4, 0}), fathom::error);
        EXPECT_THROW(w.add_tensor("bad", static_cast<dtype>(4), {4}), fathom::error);
        EXPECT_THROW(w.write_tensor_data("x", 1), fathom::error);  // before header
        w.add_tensor("t", dtype::f32, {2});
        EXPECT_THROW(w.add_tensor("t", dtype::f32, {2}), fathom::error);
        w.write_header();
        EXPECT_THROW(w.set_u32("late", 1), fathom::error);
        const float d[3] = {1, 2, 3};
        EXPECT_THROW(w.write_tensor_data(d, 12), fathom::error);  // tensor holds 8 bytes
        w.write_tensor_data(d, 4);
        EXPECT_THROW(w.finish(), fathom::error);  // 4 of 8 bytes
        EXPECT_TRUE(std::filesystem::exists(path));
    }
    // An unfinished writer removes its partial file.
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_THROW(writer(path, 1), fathom::error);
    EXPECT_THROW(writer(path, 3, 48), fathom::error);
}

// ---- open() ----

TEST(GgufOpen, FileErrors) {
    try {
        file::open(temp_path("does-not-exist.gguf"));
        FAIL();
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find("does-not-exist.gguf: cannot open"), std::string::npos)
            << e.what();
    }
    EXPECT_THROW(file::open(temp_dir().string()), fathom::error);
    const std::string empty = temp_path("empty.gguf");
    write_file(empty, {});
    try {
        file::open(empty);
        FAIL();
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find("truncated file at offset 0"), std::string::npos) << e.what();
    }
}

// ---- shared real-world files ----

TEST(GgufShared, TokenizerVocabFilesParse) {
    size_t n = 0;
    for (const auto &entry : std::filesystem::directory_iterator(FATHOM_SHARED_DIR "/tokenizer-tests")) {
        if (entry.path().extension() != ".gguf") continue;
        ++n;
        auto f = file::open(entry.path().string());
        EXPECT_EQ(f->version(), 3u);
        const auto &tokens = f->get_string_array("tokenizer.ggml.tokens");
        EXPECT_GT(tokens.size(), 1000u) << entry.path();
        EXPECT_EQ(f->tensors().size(), 0u);
    }
    EXPECT_EQ(n, 7u);
    // Facts from llama's published SentencePiece vocab: 32000 tokens, <unk>=0, <s>=1, </s>=2.
    auto spm = file::open(FATHOM_SHARED_DIR "/tokenizer-tests/ggml-vocab-llama-spm.gguf");
    const auto &tok = spm->get_string_array("tokenizer.ggml.tokens");
    ASSERT_EQ(tok.size(), 32000u);
    EXPECT_EQ(tok[0], "<unk>");
    EXPECT_EQ(tok[1], "<s>");
    EXPECT_EQ(tok[2], "</s>");
    EXPECT_EQ(spm->get_u32("tokenizer.ggml.bos_token_id"), 1u);
    EXPECT_EQ(spm->get_string("general.architecture"), "llama");
    EXPECT_EQ(spm->get_float_array("tokenizer.ggml.scores").size(), 32000u);
}

TEST(GgufShared, Ds4TinyModelsParse) {
    for (const char *name : {"ds4-tiny-a.gguf", "ds4-tiny-a-mtp.gguf", "ds4-tiny-a-mtp-ds4c.gguf"}) {
        auto f = file::open(std::string(FATHOM_SHARED_DIR "/golden/ds4-tiny/") + name);
        EXPECT_GT(f->tensors().size(), 0u) << name;
        EXPECT_EQ(f->get_string("general.architecture"), "deepseek4") << name;
        for (const auto &t : f->tensors()) {
            EXPECT_EQ(t.offset % f->alignment(), 0u);
            EXPECT_LE(f->data_offset() + t.offset + t.nbytes, f->size()) << t.name;
        }
    }
    // The README's configuration: vocab 512, hidden 128, 6 layers; weights F32, and the hash-routing
    // tables of the hash-routed layers 0-2 are I32 (token id -> expert ids).
    auto f = file::open(FATHOM_SHARED_DIR "/golden/ds4-tiny/ds4-tiny-a.gguf");
    EXPECT_EQ(f->get_u32("deepseek4.vocab_size"), 512u);
    EXPECT_EQ(f->get_u32("deepseek4.embedding_length"), 128u);
    EXPECT_EQ(f->get_u32("deepseek4.block_count"), 6u);
    size_t n_i32 = 0;
    for (const auto &t : f->tensors()) {
        const bool hash = t.name.find("tid2eid") != std::string_view::npos;
        EXPECT_EQ(t.type, hash ? dtype::i32 : dtype::f32) << t.name;
        n_i32 += hash;
    }
    EXPECT_EQ(n_i32, 3u);
    const auto &out = f->tensor("output.weight");
    EXPECT_EQ(out.ne[0], 128);
    EXPECT_EQ(out.ne[1], 512);
    // The last tensor ends inside the file.
    const auto &last = f->tensors().back();
    EXPECT_LE(f->data_offset() + last.offset + last.nbytes, f->size());
}

namespace {
// Removes this process's temp directory after the last test.
class temp_cleanup : public ::testing::Environment {
  public:
    void TearDown() override { std::filesystem::remove_all(temp_dir()); }
};
[[maybe_unused]] ::testing::Environment *const kTempCleanup =
    ::testing::AddGlobalTestEnvironment(new temp_cleanup);
}  // namespace
