// The `eval niah --plot` chart (src/pflash/plot.h): checksum known-answer vectors, the PNG byte layout
// (chunks, zlib header, stored-block boundaries at exactly 65535 raw bytes and one past), atomic writes
// into bad paths, the font's coverage, and the bars' pixels against the values. The independent decode
// of the written files is tests/pflash/check_plot_png.py (ctest pflash_plot_png).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>

#include "fathom/error.h"
#include "pflash/plot.h"

namespace fathom::pflash {
namespace {

namespace fs = std::filesystem;

uint32_t crc_of(const std::string &s) { return png_crc32(reinterpret_cast<const uint8_t *>(s.data()), s.size()); }
uint32_t adler_of(const std::string &s) { return png_adler32(reinterpret_cast<const uint8_t *>(s.data()), s.size()); }

uint32_t be32(const std::vector<uint8_t> &b, size_t at) {
    return (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | uint32_t{b[at + 3]};
}

// A fresh empty directory under the system temp dir, removed at scope exit.
struct temp_dir {
    fs::path path;
    temp_dir() {
        path = fs::temp_directory_path() / ("fathom_plot_" + std::to_string(::getpid()) + "_" +
                                            ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(path);
        fs::create_directories(path);
    }
    ~temp_dir() {
        std::error_code ec;
        fs::permissions(path, fs::perms::owner_all, ec);
        fs::remove_all(path, ec);
    }
};

TEST(pflash_plot, crc32_known_vectors) {
    EXPECT_EQ(crc_of("123456789"), 0xCBF43926u);
    EXPECT_EQ(crc_of(""), 0u);
    EXPECT_EQ(crc_of("IEND"), 0xAE426082u);  // the CRC every PNG ends with
    EXPECT_EQ(crc_of("The quick brown fox jumps over the lazy dog"), 0x414FA339u);
    // Continuing from a previous result equals one pass over the concatenation.
    const std::string a = "12345", b = "6789";
    EXPECT_EQ(png_crc32(reinterpret_cast<const uint8_t *>(b.data()), b.size(), crc_of(a)), 0xCBF43926u);
}

TEST(pflash_plot, adler32_known_vectors) {
    EXPECT_EQ(adler_of("Wikipedia"), 0x11E60398u);
    EXPECT_EQ(adler_of(""), 1u);
    EXPECT_EQ(adler_of("a"), 0x00620062u);
    // Long input of 0xFF bytes (the worst case for the deferred modulo) against a per-byte modulo.
    std::vector<uint8_t> big(200003, 0xFF);
    for (size_t i = 0; i < big.size(); i += 7) big[i] = static_cast<uint8_t>(i);
    uint32_t a = 1, b = 0;
    for (uint8_t v : big) a = (a + v) % 65521, b = (b + a) % 65521;
    EXPECT_EQ(png_adler32(big.data(), big.size()), (b << 16) | a);
    EXPECT_EQ(png_adler32(big.data() + 70000, big.size() - 70000, png_adler32(big.data(), 70000)), (b << 16) | a);
}

// Splits a PNG into chunks, checking each CRC; returns (type, data) pairs.
std::vector<std::pair<std::string, std::vector<uint8_t>>> chunks_of(const std::vector<uint8_t> &png) {
    const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
    EXPECT_TRUE(png.size() >= 8 && std::equal(sig, sig + 8, png.begin()));
    std::vector<std::pair<std::string, std::vector<uint8_t>>> out;
    size_t at = 8;
    while (at + 12 <= png.size()) {
        const uint32_t len = be32(png, at);
        EXPECT_LE(at + 12 + len, png.size());
        if (at + 12 + len > png.size()) break;
        EXPECT_EQ(be32(png, at + 8 + len), png_crc32(png.data() + at + 4, 4 + len)) << "chunk at " << at;
        out.emplace_back(std::string(png.begin() + static_cast<long>(at + 4), png.begin() + static_cast<long>(at + 8)),
                         std::vector<uint8_t>(png.begin() + static_cast<long>(at + 8),
                                              png.begin() + static_cast<long>(at + 8 + len)));
        at += 12 + len;
    }
    EXPECT_EQ(at, png.size());
    return out;
}

// Walks the stored blocks of a zlib stream; returns the payload and the block lengths.
std::vector<uint8_t> unstore(const std::vector<uint8_t> &z, std::vector<size_t> &lens) {
    EXPECT_EQ(z.at(0), 0x78);
    EXPECT_EQ((z.at(0) * 256 + z.at(1)) % 31, 0);
    std::vector<uint8_t> raw;
    size_t at = 2;
    for (bool final = false; !final;) {
        final = z.at(at) & 1;
        EXPECT_EQ(z.at(at) & 6, 0) << "BTYPE must be stored";
        const size_t len = z.at(at + 1) | (z.at(at + 2) << 8);
        const size_t nlen = z.at(at + 3) | (z.at(at + 4) << 8);
        EXPECT_EQ(len ^ 0xFFFF, nlen);
        raw.insert(raw.end(), z.begin() + static_cast<long>(at + 5), z.begin() + static_cast<long>(at + 5 + len));
        lens.push_back(len);
        at += 5 + len;
    }
    EXPECT_EQ(at + 4, z.size());
    EXPECT_EQ(be32(z, at), png_adler32(raw.data(), raw.size()));
    return raw;
}

image_rgb pattern(int32_t w, int32_t h) {
    image_rgb img(w, h, rgb{});
    for (int32_t y = 0; y < h; ++y)
        for (int32_t x = 0; x < w; ++x)
            img.fill_rect(x, y, x + 1, y + 1, rgb{uint8_t(x * 7 + y), uint8_t(x ^ y), uint8_t(x * y % 251)});
    return img;
}

// Encodes a w x h pattern, checks the file structure and that the scanlines round-trip.
std::vector<size_t> check_roundtrip(int32_t w, int32_t h) {
    const image_rgb img = pattern(w, h);
    const auto chunks = chunks_of(png_encode(img));
    EXPECT_EQ(chunks.size(), 3u);
    if (chunks.size() != 3) return {};
    EXPECT_EQ(chunks[0].first, "IHDR");
    EXPECT_EQ(chunks[1].first, "IDAT");
    EXPECT_EQ(chunks[2].first, "IEND");
    EXPECT_TRUE(chunks[2].second.empty());
    const auto &ihdr = chunks[0].second;
    EXPECT_EQ(ihdr.size(), 13u);
    EXPECT_EQ(be32(ihdr, 0), static_cast<uint32_t>(w));
    EXPECT_EQ(be32(ihdr, 4), static_cast<uint32_t>(h));
    EXPECT_EQ(std::vector<uint8_t>(ihdr.begin() + 8, ihdr.end()), (std::vector<uint8_t>{8, 2, 0, 0, 0}));
    std::vector<size_t> lens;
    const std::vector<uint8_t> raw = unstore(chunks[1].second, lens);
    const size_t row = 1 + 3 * static_cast<size_t>(w);
    EXPECT_EQ(raw.size(), row * static_cast<size_t>(h));
    for (int32_t y = 0; y < h && raw.size() == row * static_cast<size_t>(h); ++y) {
        EXPECT_EQ(raw[static_cast<size_t>(y) * row], 0) << "filter byte of row " << y;
        const auto *src = &img.pixels[static_cast<size_t>(y) * (row - 1)];
        EXPECT_TRUE(std::equal(src, src + row - 1, raw.begin() + static_cast<long>(static_cast<size_t>(y) * row + 1)))
            << "row " << y;
    }
    return lens;
}

TEST(pflash_plot, png_layout_and_stored_block_boundaries) {
    EXPECT_EQ(check_roundtrip(3, 2), (std::vector<size_t>{20}));
    EXPECT_EQ(check_roundtrip(1, 1), (std::vector<size_t>{4}));
    // 771 rows of 1 + 28 * 3 = 85 bytes = 65535: exactly one full block; one more row spills 85 bytes.
    EXPECT_EQ(check_roundtrip(28, 771), (std::vector<size_t>{65535}));
    EXPECT_EQ(check_roundtrip(28, 772), (std::vector<size_t>{65535, 85}));
    EXPECT_EQ(check_roundtrip(28, 1542), (std::vector<size_t>{65535, 65535}));  // two full blocks, no empty third
    EXPECT_THROW(png_encode(image_rgb{}), error);
}

TEST(pflash_plot, atomic_write_and_bad_paths) {
    temp_dir d;
    const std::vector<uint8_t> bytes = {1, 2, 3, 250};
    const std::string good = (d.path / "out.png").string();
    write_file_atomic(good, bytes);
    write_file_atomic(good, bytes);  // overwriting an existing file works
    std::ifstream in(good, std::ios::binary);
    EXPECT_EQ(std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {}), bytes);
    EXPECT_FALSE(fs::exists(good + ".tmp"));

    // Missing directory: an error naming the path, nothing created.
    const std::string missing = (d.path / "no-such-dir" / "out.png").string();
    try {
        write_file_atomic(missing, bytes);
        ADD_FAILURE() << "expected an error";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("cannot write " + missing), std::string::npos) << e.what();
    }
    EXPECT_THROW(check_plot_path(missing), error);
    // The target is a directory: the temporary is written, the rename fails, the temporary is removed.
    const std::string dir_target = (d.path / "adir").string();
    fs::create_directories(dir_target);
    EXPECT_THROW(write_file_atomic(dir_target, bytes), error);
    EXPECT_FALSE(fs::exists(dir_target + ".tmp"));
    EXPECT_THROW(check_plot_path(dir_target), error);
    // A read-only directory (permission bits do not bind root, so only checked for other users).
    if (::geteuid() != 0) {
        const fs::path ro = d.path / "ro";
        fs::create_directories(ro);
        fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
        EXPECT_THROW(write_file_atomic((ro / "out.png").string(), bytes), error);
        EXPECT_THROW(check_plot_path((ro / "out.png").string()), error);
        EXPECT_TRUE(fs::is_empty(ro));
    }
    EXPECT_NO_THROW(check_plot_path(good));
    EXPECT_NO_THROW(check_plot_path("relative-name.png"));  // the current directory
    EXPECT_THROW(check_plot_path(""), error);
    // Only the good file is left in the directory.
    size_t n = 0;
    for (const auto &e : fs::directory_iterator(d.path)) n += e.is_regular_file();
    EXPECT_EQ(n, 1u);
}

TEST(pflash_plot, font_covers_chart_text) {
    for (char ch : std::string("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,%():-=/?+_'"))
        EXPECT_TRUE(font_has_glyph(ch)) << ch;
    EXPECT_FALSE(font_has_glyph('~'));
    EXPECT_FALSE(font_has_glyph('\x80'));
    EXPECT_EQ(text_width("", 2), 0);
    EXPECT_EQ(text_width("a", 1), 5);
    EXPECT_EQ(text_width("ab", 3), 33);
    // '1' at scale 2 sets exactly the pixels of its bitmap: column 2 of row 0 is ink, column 0 is not.
    image_rgb img(20, 20, k_plot_background);
    draw_text(img, 3, 4, "1~", 2, rgb{0, 0, 0});
    EXPECT_EQ(img.at(3 + 4, 4), (rgb{0, 0, 0}));
    EXPECT_EQ(img.at(3 + 5, 5), (rgb{0, 0, 0}));
    EXPECT_EQ(img.at(3, 4), k_plot_background);
    EXPECT_EQ(img.at(3 + 4, 4 + 2 * 7), k_plot_background);  // row 7 of '1' is empty
    EXPECT_EQ(img.at(3 + 12, 4), (rgb{0, 0, 0}));            // the box of '~' (no glyph), clipped at x = 20
}

niah_plot_summary sample() {
    niah_plot_summary s{4096, 5, 3, "mixed", {}};
    s.rows = {{"full", 93.3, 2.41, 0}, {"keep 0.1", 60, 0.62, 0.31}, {"keep 0.2", 86.7, 0.85, 0.33},
              {"keep 0.5", 100, 1.52, 0.32}};
    return s;
}

// Bar i of panel p in column x: the rows [base - h, base) have `c` (lower rows `lower` for hd rows), the
// rows above up to the plot top never have a bar colour.
void expect_bar(const image_rgb &img, const niah_plot_panel &p, size_t i, double v, double lo, rgb c) {
    const int32_t plot_h = p.base_y - p.top_y;
    const int32_t h = static_cast<int32_t>(std::floor(v / p.axis_max * plot_h + 0.5));
    const int32_t hd = static_cast<int32_t>(std::floor(lo / p.axis_max * plot_h + 0.5));
    for (int32_t x : {p.bar_x0[i], (p.bar_x0[i] + p.bar_x1[i]) / 2, p.bar_x1[i] - 1}) {
        for (int32_t y = p.base_y - h; y < p.base_y; ++y)
            ASSERT_EQ(img.at(x, y), y >= p.base_y - hd ? k_plot_drafter_bar : c) << "bar " << i << " x " << x << " y " << y;
        for (int32_t y = p.top_y - 30; y < p.base_y - h; ++y) {
            const rgb got = img.at(x, y);
            ASSERT_FALSE(got == c || got == k_plot_drafter_bar) << "bar " << i << " x " << x << " y " << y;
        }
    }
    // Columns just outside the bar are not bar-coloured at the bar's middle height.
    const int32_t mid = p.base_y - std::max(h, 1) / 2 - 1;
    EXPECT_FALSE(img.at(p.bar_x0[i] - 1, mid) == c);
    EXPECT_FALSE(img.at(p.bar_x1[i], mid) == c);
}

TEST(pflash_plot, bars_follow_values) {
    const niah_plot_summary s = sample();
    const niah_plot_layout l = niah_plot_compute_layout(s);
    const image_rgb img = niah_plot_render(s);
    ASSERT_EQ(img.width, l.width);
    ASSERT_EQ(img.height, l.height);
    EXPECT_EQ(l.accuracy.axis_max, 100.0);
    EXPECT_EQ(l.ttft.axis_max, 2.5);  // 2.41 s -> ticks of 0.5
    EXPECT_LT(l.accuracy.right, l.ttft.left);
    EXPECT_LE(l.ttft.right, l.width);
    for (size_t i = 0; i < s.rows.size(); ++i) {
        if (i + 1 < s.rows.size()) {
            EXPECT_LT(l.accuracy.bar_x1[i], l.accuracy.bar_x0[i + 1]);
        }
        expect_bar(img, l.accuracy, i, s.rows[i].accuracy, 0, k_plot_accuracy_bar);
        expect_bar(img, l.ttft, i, s.rows[i].ttft_s, s.rows[i].drafter_s, k_plot_target_bar);
    }
}

TEST(pflash_plot, odd_values_and_sizes) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    niah_plot_summary s{100000, 16, 1, "", {}};
    s.rows = {{"full", nan, inf, 0}, {"keep 0.125 with a long label", 150, -1, 5}, {"k~", -5, 0.004, nan}};
    const niah_plot_layout l = niah_plot_compute_layout(s);
    EXPECT_GT(l.ttft.axis_max, 0.004 - 1e-12);
    EXPECT_LE(l.ttft.axis_max, 0.005 + 1e-12);
    const image_rgb img = niah_plot_render(s);
    // NaN / negative: no bar; over 100 %: clamped to the full height; the long label widens the slots.
    expect_bar(img, l.accuracy, 0, 0, 0, k_plot_accuracy_bar);
    expect_bar(img, l.accuracy, 1, 100, 0, k_plot_accuracy_bar);
    expect_bar(img, l.accuracy, 2, 0, 0, k_plot_accuracy_bar);
    expect_bar(img, l.ttft, 2, 0.004, 0, k_plot_target_bar);
    EXPECT_GE(l.accuracy.bar_x0[1] - l.accuracy.bar_x0[0], text_width(s.rows[1].mode, 2));
    // No rows at all still gives a valid (empty) chart; a single row too.
    s.rows.clear();
    EXPECT_EQ(chunks_of(png_encode(niah_plot_render(s))).size(), 3u);
    s.rows = {{"full", 50, 1, 0}};
    const niah_plot_layout l1 = niah_plot_compute_layout(s);
    const image_rgb one = niah_plot_render(s);
    expect_bar(one, l1.ttft, 0, 1, 0, k_plot_target_bar);
    // Full prefill only: no drafter colour anywhere (no legend either).
    for (size_t i = 0; i < one.pixels.size(); i += 3)
        ASSERT_FALSE((rgb{one.pixels[i], one.pixels[i + 1], one.pixels[i + 2]}) == k_plot_drafter_bar);
}

TEST(pflash_plot, write_niah_plot_file) {
    temp_dir d;
    const std::string path = (d.path / "niah.png").string();
    write_niah_plot(sample(), path);
    std::ifstream in(path, std::ios::binary);
    const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), {}};
    EXPECT_EQ(bytes, png_encode(niah_plot_render(sample())));
    EXPECT_THROW(write_niah_plot(sample(), (d.path / "missing" / "x.png").string()), error);
    EXPECT_FALSE(fs::exists(d.path / "missing"));
}

}  // namespace
}  // namespace fathom::pflash
