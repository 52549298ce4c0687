// Internal constants and helpers shared by the GGUF reader and writer (not part of the API).
// On-disk layout: docs/formats/gguf.md.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "gguf/gguf.h"

namespace fathom::gguf::detail {

// Every multi-byte field is little-endian; we load with memcpy, which is only correct on an LE host.
static_assert(std::endian::native == std::endian::little, "the GGUF code assumes a little-endian host");

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr size_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
// Nested arrays (arrays of arrays) are parsed and skipped up to this depth; deeper input is rejected
// so that hostile files cannot exhaust the stack.
constexpr int kMaxArrayDepth = 8;
// ggml type ids below this bound that were removed from ggml (their geometry is no longer defined).
constexpr uint32_t kGgmlTypeCount = 40;

// Encoded size of a fixed-size scalar value type; 0 for string/array (variable size) and bad ids.
inline size_t scalar_size(value_type t) {
    switch (t) {
        case value_type::u8:
        case value_type::i8:
        case value_type::boolean:
            return 1;
        case value_type::u16:
        case value_type::i16:
            return 2;
        case value_type::u32:
        case value_type::i32:
        case value_type::f32:
            return 4;
        case value_type::u64:
        case value_type::i64:
        case value_type::f64:
            return 8;
        default:
            return 0;
    }
}

inline bool valid_value_type(uint32_t id) {
    return id <= static_cast<uint32_t>(value_type::f64);
}

// Name of a ggml type id that ggml once defined and later removed, or empty.
inline std::string_view removed_ggml_type_name(uint32_t id) {
    switch (id) {
        case 4:
            return "q4_2";
        case 5:
            return "q4_3";
        case 31:
            return "q4_0_4_4";
        case 32:
            return "q4_0_4_8";
        case 33:
            return "q4_0_8_8";
        case 36:
            return "iq4_nl_4_4";
        case 37:
            return "iq4_nl_4_8";
        case 38:
            return "iq4_nl_8_8";
        default:
            return {};
    }
}

// Quote arbitrary file bytes (keys and tensor names are not guaranteed printable) so that an error
// message stays on one line: non-printable bytes become \xNN, and long names are cut.
inline std::string quote(std::string_view s) {
    static const char *hex = "0123456789abcdef";
    std::string out = "'";
    size_t n = 0;
    for (unsigned char c : s) {
        if (++n > 200) {
            out += "...";
            break;
        }
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            out += static_cast<char>(c);
        } else {
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    out += "'";
    return out;
}

// a + b and a * b with overflow detection (false on overflow).
inline bool add_ok(uint64_t a, uint64_t b, uint64_t &r) {
    return !__builtin_add_overflow(a, b, &r);
}
inline bool mul_ok(uint64_t a, uint64_t b, uint64_t &r) {
    return !__builtin_mul_overflow(a, b, &r);
}

}  // namespace fathom::gguf::detail
