// The `fathom eval niah --plot` chart (plot.h): checksums, PNG encoder, bitmap font, chart drawing.
#include "pflash/plot.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "fathom/error.h"

namespace fathom::pflash {

// =====================================================================================================
// Checksums
// =====================================================================================================

namespace {

// crc_table[b] = CRC register after shifting byte b through the reflected polynomial 0xEDB88320.
constexpr std::array<uint32_t, 256> make_crc_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
        uint32_t c = n;
        for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[n] = c;
    }
    return t;
}
constexpr std::array<uint32_t, 256> k_crc_table = make_crc_table();

}  // namespace

uint32_t png_crc32(const uint8_t *data, size_t n, uint32_t crc) {
    uint32_t c = crc ^ 0xFFFFFFFFu;  // undo the previous final xor (or start from all ones)
    for (size_t i = 0; i < n; ++i) c = k_crc_table[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

uint32_t png_adler32(const uint8_t *data, size_t n, uint32_t adler) {
    constexpr uint32_t k_mod = 65521;  // largest prime below 2^16
    // 5552 = the most bytes whose sums cannot overflow 32 bits before the modulo (RFC 1950's NMAX).
    constexpr size_t k_nmax = 5552;
    uint32_t a = adler & 0xFFFFu, b = adler >> 16;
    while (n > 0) {
        const size_t m = std::min(n, k_nmax);
        for (size_t i = 0; i < m; ++i) {
            a += data[i];
            b += a;
        }
        a %= k_mod, b %= k_mod;
        data += m, n -= m;
    }
    return (b << 16) | a;
}

// =====================================================================================================
// Image and PNG encoder
// =====================================================================================================

image_rgb::image_rgb(int32_t w, int32_t h, rgb fill) : width(w), height(h) {
    if (w <= 0 || h <= 0) throw error("image: size must be positive");
    pixels.resize(static_cast<size_t>(w) * static_cast<size_t>(h) * 3);
    for (size_t i = 0; i < pixels.size(); i += 3) pixels[i] = fill.r, pixels[i + 1] = fill.g, pixels[i + 2] = fill.b;
}

rgb image_rgb::at(int32_t x, int32_t y) const {
    const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3;
    return rgb{pixels[i], pixels[i + 1], pixels[i + 2]};
}

void image_rgb::fill_rect(int32_t x0, int32_t y0, int32_t x1, int32_t y1, rgb c) {
    x0 = std::max(x0, 0), y0 = std::max(y0, 0);
    x1 = std::min(x1, width), y1 = std::min(y1, height);
    for (int32_t y = y0; y < y1; ++y)
        for (int32_t x = x0; x < x1; ++x) {
            const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3;
            pixels[i] = c.r, pixels[i + 1] = c.g, pixels[i + 2] = c.b;
        }
}

namespace {

void put_be32(std::vector<uint8_t> &out, uint32_t v) {
    out.push_back(static_cast<uint8_t>(v >> 24));
    out.push_back(static_cast<uint8_t>(v >> 16));
    out.push_back(static_cast<uint8_t>(v >> 8));
    out.push_back(static_cast<uint8_t>(v));
}

// One chunk: length (of data, big-endian), 4-byte type, data, CRC-32 over type + data.
void put_chunk(std::vector<uint8_t> &out, const char type[4], const std::vector<uint8_t> &data) {
    put_be32(out, static_cast<uint32_t>(data.size()));
    const size_t type_at = out.size();
    out.insert(out.end(), type, type + 4);
    out.insert(out.end(), data.begin(), data.end());
    put_be32(out, png_crc32(out.data() + type_at, 4 + data.size()));
}

// zlib stream (RFC 1950) of `raw` as stored deflate blocks (RFC 1951 BTYPE 00): header 0x78 0x01
// (deflate, 32K window, no dictionary; 0x7801 % 31 == 0), then per block of <= 65535 bytes a header
// byte (BFINAL in bit 0, BTYPE 00; stored blocks are byte-aligned, so the rest of the byte is padding),
// LEN and NLEN = ~LEN little-endian, the bytes; then Adler-32 of `raw` big-endian.
std::vector<uint8_t> zlib_stored(const std::vector<uint8_t> &raw) {
    constexpr size_t k_block = 65535;
    const size_t n_blocks = std::max<size_t>(1, (raw.size() + k_block - 1) / k_block);
    std::vector<uint8_t> z;
    z.reserve(raw.size() + n_blocks * 5 + 6);
    z.push_back(0x78);
    z.push_back(0x01);
    for (size_t b = 0; b < n_blocks; ++b) {
        const size_t at = b * k_block;
        const size_t len = std::min(k_block, raw.size() - at);  // an empty `raw` gives one empty final block
        z.push_back(b + 1 == n_blocks ? 1 : 0);
        z.push_back(static_cast<uint8_t>(len));
        z.push_back(static_cast<uint8_t>(len >> 8));
        z.push_back(static_cast<uint8_t>(~len));
        z.push_back(static_cast<uint8_t>(~len >> 8));
        z.insert(z.end(), raw.begin() + static_cast<std::ptrdiff_t>(at),
                 raw.begin() + static_cast<std::ptrdiff_t>(at + len));
    }
    put_be32(z, png_adler32(raw.data(), raw.size()));
    return z;
}

}  // namespace

std::vector<uint8_t> png_encode(const image_rgb &img) {
    if (img.width <= 0 || img.height <= 0 ||
        img.pixels.size() != static_cast<size_t>(img.width) * static_cast<size_t>(img.height) * 3)
        throw error("png: image size and pixel buffer disagree");
    const size_t row = static_cast<size_t>(img.width) * 3;
    // One IDAT chunk must stay below 2^31 bytes; charts are a few MB at most.
    if ((row + 1) * static_cast<size_t>(img.height) > (size_t{1} << 30)) throw error("png: image too large");
    // Scanlines: filter type 0 (None) byte, then the row's RGB bytes: [height, 1 + width * 3].
    std::vector<uint8_t> raw;
    raw.reserve((row + 1) * static_cast<size_t>(img.height));
    for (int32_t y = 0; y < img.height; ++y) {
        raw.push_back(0);
        const auto first = img.pixels.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(y) * row);
        raw.insert(raw.end(), first, first + static_cast<std::ptrdiff_t>(row));
    }
    std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
    std::vector<uint8_t> ihdr;
    put_be32(ihdr, static_cast<uint32_t>(img.width));
    put_be32(ihdr, static_cast<uint32_t>(img.height));
    ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // bit depth 8, colour type 2 (RGB), deflate, filter 0, no interlace
    put_chunk(out, "IHDR", ihdr);
    put_chunk(out, "IDAT", zlib_stored(raw));
    put_chunk(out, "IEND", {});
    return out;
}

void write_file_atomic(const std::string &path, const std::vector<uint8_t> &bytes) {
    const std::string tmp = path + ".tmp";
    auto fail = [&](const char *what, int err) {
        std::remove(tmp.c_str());
        throw error("cannot write " + path + ": " + what + ": " + std::strerror(err));
    };
    FILE *f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw error("cannot write " + path + ": cannot create " + tmp + ": " + std::strerror(errno));
    const size_t wrote = std::fwrite(bytes.data(), 1, bytes.size(), f);
    const int write_err = errno;
    const bool flushed = std::fflush(f) == 0;
    const int flush_err = errno;
    if (std::fclose(f) != 0 && wrote == bytes.size() && flushed) fail("close failed", errno);
    if (wrote != bytes.size()) fail("write failed", write_err);
    if (!flushed) fail("write failed", flush_err);
    if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("rename failed", errno);
}

// =====================================================================================================
// Bitmap font
// =====================================================================================================

namespace {

// One glyph per entry: 8 rows of 5 columns ('#' = ink), rows separated by a space. Rows 0-6 hold
// capitals and digits, lowercase letters sit on rows 2-6 with ascenders from row 0, row 7 is the
// descender row (g j p q y ,).
struct glyph_src {
    char ch;
    const char *rows;
};
constexpr glyph_src k_glyphs[] = {
    {'0', ".###. #...# #..## #.#.# ##..# #...# .###. ....."},
    {'1', "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###. ....."},
    {'2', ".###. #...# ....# ...#. ..#.. .#... ##### ....."},
    {'3', "##### ...#. ..#.. ...#. ....# #...# .###. ....."},
    {'4', "...#. ..##. .#.#. #..#. ##### ...#. ...#. ....."},
    {'5', "##### #.... ####. ....# ....# #...# .###. ....."},
    {'6', "..##. .#... #.... ####. #...# #...# .###. ....."},
    {'7', "##### ....# ...#. ..#.. .#... .#... .#... ....."},
    {'8', ".###. #...# #...# .###. #...# #...# .###. ....."},
    {'9', ".###. #...# #...# .#### ....# ...#. .##.. ....."},
    {'A', ".###. #...# #...# ##### #...# #...# #...# ....."},
    {'B', "####. #...# #...# ####. #...# #...# ####. ....."},
    {'C', ".###. #...# #.... #.... #.... #...# .###. ....."},
    {'D', "###.. #..#. #...# #...# #...# #..#. ###.. ....."},
    {'E', "##### #.... #.... ####. #.... #.... ##### ....."},
    {'F', "##### #.... #.... ####. #.... #.... #.... ....."},
    {'G', ".###. #...# #.... #.### #...# #...# .#### ....."},
    {'H', "#...# #...# #...# ##### #...# #...# #...# ....."},
    {'I', ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###. ....."},
    {'J', "..### ...#. ...#. ...#. ...#. #..#. .##.. ....."},
    {'K', "#...# #..#. #.#.. ##... #.#.. #..#. #...# ....."},
    {'L', "#.... #.... #.... #.... #.... #.... ##### ....."},
    {'M', "#...# ##.## #.#.# #.#.# #...# #...# #...# ....."},
    {'N', "#...# #...# ##..# #.#.# #..## #...# #...# ....."},
    {'O', ".###. #...# #...# #...# #...# #...# .###. ....."},
    {'P', "####. #...# #...# ####. #.... #.... #.... ....."},
    {'Q', ".###. #...# #...# #...# #.#.# #..#. .##.# ....."},
    {'R', "####. #...# #...# ####. #.#.. #..#. #...# ....."},
    {'S', ".#### #.... #.... .###. ....# ....# ####. ....."},
    {'T', "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ....."},
    {'U', "#...# #...# #...# #...# #...# #...# .###. ....."},
    {'V', "#...# #...# #...# #...# #...# .#.#. ..#.. ....."},
    {'W', "#...# #...# #...# #.#.# #.#.# #.#.# .#.#. ....."},
    {'X', "#...# #...# .#.#. ..#.. .#.#. #...# #...# ....."},
    {'Y', "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#.. ....."},
    {'Z', "##### ....# ...#. ..#.. .#... #.... ##### ....."},
    {'a', "..... ..... .###. ....# .#### #...# .#### ....."},
    {'b', "#.... #.... ####. #...# #...# #...# ####. ....."},
    {'c', "..... ..... .###. #.... #.... #...# .###. ....."},
    {'d', "....# ....# .#### #...# #...# #...# .#### ....."},
    {'e', "..... ..... .###. #...# ##### #.... .###. ....."},
    {'f', "..##. .#..# .#... ###.. .#... .#... .#... ....."},
    {'g', "..... ..... .#### #...# #...# .#### ....# .###."},
    {'h', "#.... #.... #.##. ##..# #...# #...# #...# ....."},
    {'i', "..#.. ..... .##.. ..#.. ..#.. ..#.. .###. ....."},
    {'j', "...#. ..... ..##. ...#. ...#. ...#. #..#. .##.."},
    {'k', "#.... #.... #..#. #.#.. ##... #.#.. #..#. ....."},
    {'l', ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###. ....."},
    {'m', "..... ..... ##.#. #.#.# #.#.# #.#.# #.#.# ....."},
    {'n', "..... ..... #.##. ##..# #...# #...# #...# ....."},
    {'o', "..... ..... .###. #...# #...# #...# .###. ....."},
    {'p', "..... ..... ####. #...# #...# ####. #.... #...."},
    {'q', "..... ..... .#### #...# #...# .#### ....# ....#"},
    {'r', "..... ..... #.##. ##..# #.... #.... #.... ....."},
    {'s', "..... ..... .#### #.... .###. ....# ####. ....."},
    {'t', ".#... .#... ###.. .#... .#... .#..# ..##. ....."},
    {'u', "..... ..... #...# #...# #...# #..## .##.# ....."},
    {'v', "..... ..... #...# #...# #...# .#.#. ..#.. ....."},
    {'w', "..... ..... #...# #...# #.#.# #.#.# .#.#. ....."},
    {'x', "..... ..... #...# .#.#. ..#.. .#.#. #...# ....."},
    {'y', "..... ..... #...# #...# #...# .#### ....# .###."},
    {'z', "..... ..... ##### ...#. ..#.. .#... ##### ....."},
    {' ', "..... ..... ..... ..... ..... ..... ..... ....."},
    {'.', "..... ..... ..... ..... ..... .##.. .##.. ....."},
    {',', "..... ..... ..... ..... ..... .##.. ..#.. .#..."},
    {'%', "##... ##..# ...#. ..#.. .#... #..## ...## ....."},
    {'(', "...#. ..#.. .#... .#... .#... ..#.. ...#. ....."},
    {')', ".#... ..#.. ...#. ...#. ...#. ..#.. .#... ....."},
    {':', "..... .##.. .##.. ..... .##.. .##.. ..... ....."},
    {'-', "..... ..... ..... ##### ..... ..... ..... ....."},
    {'=', "..... ..... ##### ..... ##### ..... ..... ....."},
    {'/', "..... ....# ...#. ..#.. .#... #.... ..... ....."},
    {'?', ".###. #...# ....# ...#. ..#.. ..... ..#.. ....."},
    {'+', "..... ..#.. ..#.. ##### ..#.. ..#.. ..... ....."},
    {'_', "..... ..... ..... ..... ..... ..... ##### ....."},
    {'\'', "..#.. ..#.. .#... ..... ..... ..... ..... ....."},
};

// Bitmaps by ASCII code: rows[r] bit (4 - x) = ink at column x; `present` marks defined glyphs.
struct font_table {
    std::array<std::array<uint8_t, k_font_h>, 128> rows{};
    std::array<bool, 128> present{};
};

font_table build_font() {
    font_table t;
    for (const glyph_src &g : k_glyphs) {
        const auto code = static_cast<unsigned char>(g.ch);
        for (int32_t r = 0; r < k_font_h; ++r) {
            uint8_t bits = 0;
            for (int32_t x = 0; x < k_font_w; ++x)
                if (g.rows[r * (k_font_w + 1) + x] == '#') bits |= static_cast<uint8_t>(1u << (k_font_w - 1 - x));
            t.rows[code][static_cast<size_t>(r)] = bits;
        }
        t.present[code] = true;
    }
    return t;
}

const font_table &font() {
    static const font_table t = build_font();
    return t;
}

// The hollow box drawn for characters without a glyph (rows 0-6).
constexpr std::array<uint8_t, k_font_h> k_box = {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F, 0x00};

}  // namespace

bool font_has_glyph(char ch) {
    const auto code = static_cast<unsigned char>(ch);
    return code < 128 && font().present[code];
}

int32_t text_width(std::string_view s, int32_t scale) {
    if (s.empty()) return 0;
    return (static_cast<int32_t>(s.size()) * k_font_advance - (k_font_advance - k_font_w)) * scale;
}

void draw_text(image_rgb &img, int32_t x, int32_t y, std::string_view s, int32_t scale, rgb c) {
    const font_table &f = font();
    for (size_t i = 0; i < s.size(); ++i) {
        const auto code = static_cast<unsigned char>(s[i]);
        const auto &rows = (code < 128 && f.present[code]) ? f.rows[code] : k_box;
        const int32_t gx = x + static_cast<int32_t>(i) * k_font_advance * scale;
        for (int32_t r = 0; r < k_font_h; ++r)
            for (int32_t col = 0; col < k_font_w; ++col)
                if (rows[static_cast<size_t>(r)] & (1u << (k_font_w - 1 - col)))
                    img.fill_rect(gx + col * scale, y + r * scale, gx + (col + 1) * scale, y + (r + 1) * scale, c);
    }
}

// =====================================================================================================
// The niah chart
// =====================================================================================================

namespace {

constexpr int32_t k_scale = 2;                        // text scale: 12 px advance, 14 px cap height
constexpr int32_t k_cap_h = 7 * k_scale;              // height of digits and capitals
constexpr int32_t k_line_h = k_font_h * k_scale + 4;  // one text line including the descender
constexpr int32_t k_margin = 16;
constexpr int32_t k_title_y = 12;
constexpr int32_t k_panel_title_y = k_title_y + k_line_h + 12;
constexpr int32_t k_plot_top = k_panel_title_y + k_line_h + k_line_h + 8;  // room for a label above a full bar
constexpr int32_t k_plot_h = 300;
constexpr int32_t k_axis_label_w = 6 * k_font_advance * k_scale + 10;  // tick labels of up to 6 characters
constexpr int32_t k_panel_pad = 12;   // plot area padding left and right of the bars
constexpr int32_t k_panel_gap = 40;   // between the two panels
constexpr int32_t k_n_ticks = 5;

constexpr rgb k_text{40, 40, 40};
constexpr rgb k_axis{90, 90, 90};
constexpr rgb k_grid{225, 225, 225};

// Axis top for the TTFT panel: the smallest {1, 2, 2.5, 3, 4, 5} x 10^k step with k_n_ticks steps >= `m`.
double nice_axis_max(double m) {
    if (!(m > 0) || !std::isfinite(m)) return 1.0;
    const double raw = m / k_n_ticks;
    const double mag = std::pow(10.0, std::floor(std::log10(raw)));
    for (double f : {1.0, 2.0, 2.5, 3.0, 4.0, 5.0, 10.0})
        if (f * mag * k_n_ticks >= m) return f * mag * k_n_ticks;
    return 10.0 * mag * k_n_ticks;
}

// Bar height in pixels of value `v` on an axis [0, axis_max] spanning `plot_h` pixels (0 for NaN).
int32_t bar_height(double v, double axis_max) {
    if (!std::isfinite(v) || v <= 0) return 0;
    return static_cast<int32_t>(std::lround(std::min(v, axis_max) / axis_max * k_plot_h));
}

std::string format_value(double v, bool percent) {
    if (!std::isfinite(v)) return "n/a";
    char buf[32];
    if (percent) std::snprintf(buf, sizeof buf, "%.1f", v);
    else if (v < 10) std::snprintf(buf, sizeof buf, "%.2f", v);
    else if (v < 100) std::snprintf(buf, sizeof buf, "%.1f", v);
    else std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
}

int32_t slot_width(const niah_plot_summary &s) {
    int32_t w = 72;
    for (const niah_plot_row &r : s.rows) w = std::max(w, text_width(r.mode, k_scale) + 28);
    return w;
}

std::string title_of(const niah_plot_summary &s) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "NIAH: %lld tokens, %d needles, %d trials", static_cast<long long>(s.n_tokens),
                  s.n_needles, s.trials);
    std::string t = buf;
    if (!s.filler.empty()) t += ", " + s.filler + " filler";
    return t;
}

bool has_drafter_time(const niah_plot_summary &s) {
    for (const niah_plot_row &r : s.rows)
        if (std::isfinite(r.drafter_s) && r.drafter_s > 0) return true;
    return false;
}

// Draws one panel: title, grid, ticks, axes, bars (stacked drafter + target when `stacked`), values
// above the bars and mode labels below. `value(i)` = the bar's total, `lower(i)` = its drafter part.
template <class Value, class Lower>
void draw_panel(image_rgb &img, const niah_plot_panel &p, const niah_plot_summary &s, const char *title,
                bool percent, rgb bar, bool stacked, Value value, Lower lower) {
    draw_text(img, p.left, k_panel_title_y, title, k_scale, k_text);
    for (int32_t t = 0; t <= k_n_ticks; ++t) {
        const double tv = p.axis_max * t / k_n_ticks;
        const int32_t y = p.base_y - bar_height(tv, p.axis_max);
        if (t > 0) img.fill_rect(p.left, y, p.right, y + 1, k_grid);
        img.fill_rect(p.left - 6, y, p.left, y + 1, k_axis);
        char buf[32];
        std::snprintf(buf, sizeof buf, "%g", tv);
        draw_text(img, p.left - 10 - text_width(buf, k_scale), y - k_cap_h / 2, buf, k_scale, k_text);
    }
    img.fill_rect(p.left - 1, p.top_y, p.left, p.base_y + 1, k_axis);  // y axis
    img.fill_rect(p.left - 1, p.base_y, p.right, p.base_y + 2, k_axis);  // x axis (2 px, below the bars)
    for (size_t i = 0; i < s.rows.size(); ++i) {
        const int32_t x0 = p.bar_x0[i], x1 = p.bar_x1[i];
        const double v = value(i);
        const int32_t h = bar_height(v, p.axis_max);
        img.fill_rect(x0, p.base_y - h, x1, p.base_y, bar);
        if (stacked) {
            const double d = std::min(lower(i), v);
            const int32_t hd = std::min(h, bar_height(d, p.axis_max));
            img.fill_rect(x0, p.base_y - hd, x1, p.base_y, k_plot_drafter_bar);
        }
        const std::string label = format_value(v, percent);
        const int32_t cx = (x0 + x1) / 2;
        draw_text(img, cx - text_width(label, k_scale) / 2, p.base_y - h - 6 - k_cap_h, label, k_scale, k_text);
        const std::string &mode = s.rows[i].mode;
        draw_text(img, cx - text_width(mode, k_scale) / 2, p.base_y + 10, mode, k_scale, k_text);
    }
}

// Legend of the stacked TTFT bars, under the right panel's mode labels.
void draw_legend(image_rgb &img, const niah_plot_panel &p) {
    int32_t y = p.base_y + 10 + k_line_h + 8;
    const std::pair<rgb, const char *> items[] = {{k_plot_drafter_bar, "drafter + selection"},
                                                  {k_plot_target_bar, "target prefill + 1st token"}};
    for (const auto &[c, name] : items) {  // one line each: the panel may be only a few bars wide
        img.fill_rect(p.left, y, p.left + k_cap_h, y + k_cap_h, c);
        draw_text(img, p.left + k_cap_h + 6, y, name, k_scale, k_text);
        y += k_line_h;
    }
}

}  // namespace

niah_plot_layout niah_plot_compute_layout(const niah_plot_summary &s) {
    niah_plot_layout l;
    const int32_t n = static_cast<int32_t>(s.rows.size());
    const int32_t slot = slot_width(s);
    const int32_t bar_w = std::max(16, slot * 3 / 5);
    // Wide enough for the panel title and the legend even with a single bar.
    const int32_t plot_w = std::max(std::max(n, 1) * slot + 2 * k_panel_pad, 21 * k_font_advance * k_scale);
    double max_ttft = 0;
    for (const niah_plot_row &r : s.rows)
        if (std::isfinite(r.ttft_s)) max_ttft = std::max(max_ttft, r.ttft_s);
    int32_t x = k_margin;
    for (niah_plot_panel *p : {&l.accuracy, &l.ttft}) {
        p->left = x + k_axis_label_w;
        p->right = p->left + plot_w;
        p->top_y = k_plot_top;
        p->base_y = k_plot_top + k_plot_h;
        p->axis_max = p == &l.accuracy ? 100.0 : nice_axis_max(max_ttft);
        for (int32_t i = 0; i < n; ++i) {
            const int32_t slot_x = p->left + k_panel_pad + i * slot;
            p->bar_x0.push_back(slot_x + (slot - bar_w) / 2);
            p->bar_x1.push_back(slot_x + (slot - bar_w) / 2 + bar_w);
        }
        x = p->right + k_panel_gap;
    }
    // Wide enough for the title and the legend; tall enough for the mode labels and two legend lines.
    l.width = std::max({l.ttft.right + k_margin + 8, text_width(title_of(s), k_scale) + 2 * k_margin,
                        l.ttft.left + k_cap_h + 6 + text_width("target prefill + 1st token", k_scale) + k_margin});
    l.height = l.ttft.base_y + 10 + k_line_h + 8 + 2 * k_line_h + k_margin;
    return l;
}

image_rgb niah_plot_render(const niah_plot_summary &s) {
    const niah_plot_layout l = niah_plot_compute_layout(s);
    image_rgb img(l.width, l.height, k_plot_background);
    draw_text(img, k_margin, k_title_y, title_of(s), k_scale, k_text);
    draw_panel(img, l.accuracy, s, "accuracy %", true, k_plot_accuracy_bar, false,
               [&](size_t i) { return s.rows[i].accuracy; }, [](size_t) { return 0.0; });
    const bool stacked = has_drafter_time(s);
    draw_panel(img, l.ttft, s, "TTFT s", false, k_plot_target_bar, stacked,
               [&](size_t i) { return s.rows[i].ttft_s; }, [&](size_t i) { return s.rows[i].drafter_s; });
    if (stacked) draw_legend(img, l.ttft);
    return img;
}

void write_niah_plot(const niah_plot_summary &s, const std::string &path) {
    write_file_atomic(path, png_encode(niah_plot_render(s)));
}

void check_plot_path(const std::string &path) {
    namespace fs = std::filesystem;
    if (path.empty()) throw error("cannot write the plot: empty path");
    std::error_code ec;
    if (fs::is_directory(path, ec)) throw error("cannot write " + path + ": is a directory");
    fs::path dir = fs::path(path).parent_path();
    if (dir.empty()) dir = ".";
    if (!fs::is_directory(dir, ec)) throw error("cannot write " + path + ": directory " + dir.string() + " does not exist");
    if (::access(dir.c_str(), W_OK) != 0)
        throw error("cannot write " + path + ": directory " + dir.string() + " is not writable");
}

}  // namespace fathom::pflash
