// PNG chart of a `fathom eval niah` summary (`--plot out.png`): accuracy and time to first token side by
// side, one bar per mode (full prefill, then each PFlash keep ratio). Everything is written here, with no
// image library: an RGB8 canvas, a built-in 5x7 bitmap font drawn at integer scale, and a PNG encoder
// whose zlib stream is made of stored (uncompressed) deflate blocks. The file format is described in
// docs/formats/png.md; the chart in docs/pflash.md section 8.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fathom::pflash {

// ---- checksums (exposed for the tests' known-answer vectors) ----

// CRC-32 of PNG chunks (ISO-HDLC: reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF).
// `crc` continues a previous call's result; crc32("123456789") = 0xCBF43926.
uint32_t png_crc32(const uint8_t *data, size_t n, uint32_t crc = 0);
// Adler-32 of zlib streams (RFC 1950, modulus 65521); adler32("Wikipedia") = 0x11E60398.
uint32_t png_adler32(const uint8_t *data, size_t n, uint32_t adler = 1);

// ---- image ----

struct rgb {
    uint8_t r = 0, g = 0, b = 0;
    bool operator==(const rgb &o) const { return r == o.r && g == o.g && b == o.b; }
};

// Row-major RGB8 image; pixels[(y * width + x) * 3 + c], y = 0 at the top.
struct image_rgb {
    int32_t width = 0, height = 0;
    std::vector<uint8_t> pixels;  // [height, width, 3]
    image_rgb() = default;
    image_rgb(int32_t w, int32_t h, rgb fill);
    rgb at(int32_t x, int32_t y) const;
    // Rectangle [x0, x1) x [y0, y1), clipped to the image.
    void fill_rect(int32_t x0, int32_t y0, int32_t x1, int32_t y1, rgb c);
};

// PNG file bytes of `img`: signature, IHDR (8-bit truecolour, no interlace), one IDAT holding a zlib
// stream of stored deflate blocks (<= 65535 bytes each) over the filter-0 scanlines, IEND.
std::vector<uint8_t> png_encode(const image_rgb &img);

// Writes `bytes` to `path` through `path` + ".tmp" and a rename, so a failed write leaves neither a
// half-written `path` nor the temporary behind. Throws fathom::error naming the path and the reason.
void write_file_atomic(const std::string &path, const std::vector<uint8_t> &bytes);

// ---- text ----

// Glyph cell of the built-in font: 5x7 pixels (plus one descender row) and one column of spacing,
// times `scale`. Characters without a glyph draw as a hollow box.
constexpr int32_t k_font_w = 5, k_font_h = 8, k_font_advance = 6;
int32_t text_width(std::string_view s, int32_t scale);  // pixels (no trailing spacing)
// Draws `s` with its top-left corner at (x, y).
void draw_text(image_rgb &img, int32_t x, int32_t y, std::string_view s, int32_t scale, rgb c);
// True when `ch` has a glyph (tests check every label's characters).
bool font_has_glyph(char ch);

// ---- the niah chart ----

struct niah_plot_row {
    std::string mode;       // bar label: "full", "keep 0.2", ...
    double accuracy = 0;    // exact-match accuracy in percent, [0, 100]
    double ttft_s = 0;      // mean time to first token in seconds (drafter + target)
    double drafter_s = 0;   // the part of ttft_s spent in the drafter's scoring and selection (0 for full)
};

struct niah_plot_summary {
    int64_t n_tokens = 0;   // requested prompt length in target tokens
    int32_t n_needles = 0;
    int32_t trials = 0;
    std::string filler;     // haystack filler name, shown in the title when not empty
    std::vector<niah_plot_row> rows;
};

// Geometry of one panel and its bars (pixels), computed from the summary: a bar of value v is
// round(v / axis_max * (base_y - top_y)) pixels tall, its bottom row base_y - 1.
struct niah_plot_panel {
    int32_t left = 0, top_y = 0, base_y = 0, right = 0;  // plot area [left, right) x [top_y, base_y)
    double axis_max = 0;                                  // value at top_y
    std::vector<int32_t> bar_x0, bar_x1;                  // per row: bar columns [x0, x1)
};

struct niah_plot_layout {
    int32_t width = 0, height = 0;
    niah_plot_panel accuracy, ttft;
};

// Colours of the chart (the tests look for them).
constexpr rgb k_plot_background{255, 255, 255};
constexpr rgb k_plot_accuracy_bar{52, 101, 164};  // accuracy bars
constexpr rgb k_plot_target_bar{204, 102, 0};     // TTFT: target prefill + first token
constexpr rgb k_plot_drafter_bar{115, 210, 22};   // TTFT: PFlash drafter scoring + selection

niah_plot_layout niah_plot_compute_layout(const niah_plot_summary &s);
image_rgb niah_plot_render(const niah_plot_summary &s);
// Renders the chart and writes it as PNG to `path` (atomically; throws fathom::error on failure).
void write_niah_plot(const niah_plot_summary &s, const std::string &path);
// Throws fathom::error unless `path`'s directory exists and is writable (checked before long runs).
void check_plot_path(const std::string &path);

}  // namespace fathom::pflash
