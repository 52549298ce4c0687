// Helpers for the GGUF tests: a hand-written byte builder that encodes GGUF fields straight from the
// spec (independent of the writer under test), temp files, and field locators for byte patching.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "gguf/gguf.h"

namespace gguf_test {

using bytes = std::vector<uint8_t>;

// Appends little-endian fields byte by byte (explicit shifts: no reliance on host layout).
struct builder {
    bytes b;
    builder &u8(uint8_t v) {
        b.push_back(v);
        return *this;
    }
    builder &u16(uint16_t v) { return u8(v & 0xff).u8(v >> 8); }
    builder &u32(uint32_t v) { return u16(v & 0xffff).u16(v >> 16); }
    builder &u64(uint64_t v) { return u32(static_cast<uint32_t>(v)).u32(static_cast<uint32_t>(v >> 32)); }
    builder &f32(float f) {
        uint32_t v;
        std::memcpy(&v, &f, 4);
        return u32(v);
    }
    builder &f64(double f) {
        uint64_t v;
        std::memcpy(&v, &f, 8);
        return u64(v);
    }
    builder &str(const std::string &s) {
        u64(s.size());
        for (char c : s) b.push_back(static_cast<uint8_t>(c));  // (no range insert: GCC 12 false positive)
        return *this;
    }
    builder &raw(const bytes &x) {
        for (uint8_t c : x) b.push_back(c);
        return *this;
    }
    builder &pad_to(size_t align) {
        while (b.size() % align) b.push_back(0);
        return *this;
    }
    // "GGUF", version, n_tensors, n_kv.
    builder &header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
        return u8('G').u8('G').u8('U').u8('F').u32(version).u64(n_tensors).u64(n_kv);
    }
};

inline std::filesystem::path temp_dir() {
    static const std::filesystem::path dir = [] {
        auto d = std::filesystem::temp_directory_path() / ("fathom_gguf_test_" + std::to_string(getpid()));
        std::filesystem::create_directories(d);
        return d;
    }();
    return dir;
}

inline std::string temp_path(const std::string &name) {
    return (temp_dir() / name).string();
}

inline bytes read_file(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    return bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_file(const std::string &path, const bytes &b) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char *>(b.data()), static_cast<std::streamsize>(b.size()));
}

inline std::unique_ptr<fathom::gguf::file> parse(const bytes &b, const std::string &name = "mem.gguf") {
    return fathom::gguf::file::from_memory(b.data(), b.size(), name);
}

// Parses and returns the error message ("" if parsing succeeded). Checks the message shape.
inline std::string parse_error(const bytes &b) {
    try {
        parse(b);
    } catch (const fathom::error &e) {
        const std::string m = e.what();
        EXPECT_EQ(m.rfind("mem.gguf: ", 0), 0u) << m;
        EXPECT_EQ(m.find('\n'), std::string::npos) << m;
        return m;
    }
    return "";
}

#define EXPECT_PARSE_ERROR(buf, substr)                                         \
    do {                                                                        \
        const std::string msg_ = gguf_test::parse_error(buf);                   \
        EXPECT_NE(msg_, "") << "parse succeeded, expected: " << (substr);       \
        EXPECT_NE(msg_.find(substr), std::string::npos) << "message: " << msg_; \
    } while (0)

// Byte positions of one tensor directory entry, found through a successful parse of `b`.
struct tensor_fields {
    size_t name_len;  // u64 name length
    size_t n_dims;    // u32
    size_t ne;        // first u64 of ne
    size_t type;      // u32
    size_t offset;    // u64
};

inline tensor_fields locate_tensor(const bytes &b, const std::string &name) {
    auto f = parse(b);
    const auto &t = f->tensor(name);
    const size_t name_pos = static_cast<size_t>(reinterpret_cast<const uint8_t *>(t.name.data()) - b.data());
    tensor_fields r{};
    r.name_len = name_pos - 8;
    r.n_dims = name_pos + t.name.size();
    r.ne = r.n_dims + 4;
    r.type = r.ne + 8 * t.n_dims;
    r.offset = r.type + 4;
    return r;
}

// Position of the value-type field of a key (the value follows 4 bytes later).
inline size_t locate_key_type(const bytes &b, const std::string &key) {
    auto f = parse(b);
    for (const auto &e : f->metadata()) {
        if (e.key == key)
            return static_cast<size_t>(reinterpret_cast<const uint8_t *>(e.key.data()) - b.data()) +
                   key.size();
    }
    ADD_FAILURE() << "key not found: " << key;
    return 0;
}

inline void patch_u32(bytes &b, size_t pos, uint32_t v) {
    for (int i = 0; i < 4; ++i) b[pos + i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void patch_u64(bytes &b, size_t pos, uint64_t v) {
    for (int i = 0; i < 8; ++i) b[pos + i] = static_cast<uint8_t>(v >> (8 * i));
}

}  // namespace gguf_test
