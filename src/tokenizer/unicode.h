// Unicode helpers for the tokenizers: code point category flags (from the generated unicode_tables.cpp),
// UTF-8 decoding that never fails (invalid bytes become one-byte units), and UTF-8 encoding.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fathom::unicode {

// Category flags of a code point. L/N/P/S/M/Z/C are the Unicode general-category major classes (\p{L} ...);
// ws is the White_Space property, i.e. what regex \s matches.
enum cpt_flag : uint8_t {
    flag_l = 1, flag_n = 2, flag_p = 4, flag_s = 8, flag_m = 16, flag_z = 32, flag_c = 64, flag_ws = 128,
};

struct cpt_range {
    uint32_t first;  // first code point of the range; the range ends where the next one starts
    uint8_t flags;
};
extern const cpt_range k_cpt_ranges[];
extern const size_t k_cpt_ranges_count;
extern const char k_unicode_version[];

// Flags of a code point (0 for values above U+10FFFF).
uint8_t cpt_flags(uint32_t cpt);

// One decoded unit of a UTF-8 string: a code point, or a single invalid byte (cpt = k_invalid_cpt).
inline constexpr uint32_t k_invalid_cpt = 0xFFFFFFFFu;
struct utf8_unit {
    uint32_t cpt;
    uint32_t len;  // bytes in the source (1..4)
};

// Decode the unit starting at s[pos] (pos < s.size()). Overlong forms, surrogates, values above U+10FFFF and
// truncated sequences decode as one invalid byte, so every input byte belongs to exactly one unit.
utf8_unit utf8_decode(std::string_view s, size_t pos);

void utf8_append(std::string &out, uint32_t cpt);

}  // namespace fathom::unicode
