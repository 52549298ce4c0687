// Code point flag lookup over the generated range table, and UTF-8 decode/encode.
#include "tokenizer/unicode.h"

#include <algorithm>
#include <array>

namespace fathom::unicode {

namespace {

// Flags of U+0000..U+00FF resolved once: the hot path of Latin text never searches the range table.
std::array<uint8_t, 256> build_latin1() {
    std::array<uint8_t, 256> t{};
    size_t r = 0;
    for (uint32_t c = 0; c < 256; ++c) {
        while (r + 1 < k_cpt_ranges_count && k_cpt_ranges[r + 1].first <= c) ++r;
        t[c] = k_cpt_ranges[r].flags;
    }
    return t;
}

}  // namespace

uint8_t cpt_flags(uint32_t cpt) {
    static const std::array<uint8_t, 256> latin1 = build_latin1();
    if (cpt < 256) return latin1[cpt];
    if (cpt > 0x10FFFF) return 0;
    // Last range whose first code point is <= cpt.
    const cpt_range *end = k_cpt_ranges + k_cpt_ranges_count;
    const cpt_range *it = std::upper_bound(k_cpt_ranges, end, cpt,
                                           [](uint32_t v, const cpt_range &r) { return v < r.first; });
    return (it - 1)->flags;
}

utf8_unit utf8_decode(std::string_view s, size_t pos) {
    const auto *p = reinterpret_cast<const uint8_t *>(s.data()) + pos;
    const size_t avail = s.size() - pos;
    const uint8_t c = p[0];
    if (c < 0x80) return {c, 1};
    auto cont = [&](size_t i) { return i < avail && (p[i] & 0xC0) == 0x80; };
    if (c >= 0xC2 && c <= 0xDF) {
        if (cont(1)) return {static_cast<uint32_t>(c & 0x1F) << 6 | (p[1] & 0x3F), 2};
    } else if (c >= 0xE0 && c <= 0xEF) {
        if (cont(1) && cont(2)) {
            const uint32_t v = static_cast<uint32_t>(c & 0x0F) << 12 | static_cast<uint32_t>(p[1] & 0x3F) << 6 |
                               (p[2] & 0x3F);
            if (v >= 0x800 && (v < 0xD800 || v > 0xDFFF)) return {v, 3};
        }
    } else if (c >= 0xF0 && c <= 0xF4) {
        if (cont(1) && cont(2) && cont(3)) {
            const uint32_t v = static_cast<uint32_t>(c & 0x07) << 18 | static_cast<uint32_t>(p[1] & 0x3F) << 12 |
                               static_cast<uint32_t>(p[2] & 0x3F) << 6 | (p[3] & 0x3F);
            if (v >= 0x10000 && v <= 0x10FFFF) return {v, 4};
        }
    }
    return {k_invalid_cpt, 1};
}

void utf8_append(std::string &out, uint32_t cpt) {
    if (cpt < 0x80) {
        out += static_cast<char>(cpt);
    } else if (cpt < 0x800) {
        out += static_cast<char>(0xC0 | (cpt >> 6));
        out += static_cast<char>(0x80 | (cpt & 0x3F));
    } else if (cpt < 0x10000) {
        out += static_cast<char>(0xE0 | (cpt >> 12));
        out += static_cast<char>(0x80 | ((cpt >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cpt & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cpt >> 18));
        out += static_cast<char>(0x80 | ((cpt >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cpt >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cpt & 0x3F));
    }
}

}  // namespace fathom::unicode
