// The `eval niah --plot` chart (src/pflash/plot.h): atomic writes into bad paths, XML escaping, the
// layout, and the SVG's bars against the values. The independent parse of the written files is
// tests/pflash/check_plot_svg.py (ctest pflash_plot_svg).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
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

TEST(pflash_plot, atomic_write_and_bad_paths) {
    temp_dir d;
    const std::string bytes("\x01\x02\x03\xfa", 4);
    const std::string good = (d.path / "out.svg").string();
    write_file_atomic(good, bytes);
    write_file_atomic(good, bytes);  // overwriting an existing file works
    std::ifstream in(good, std::ios::binary);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), bytes);
    EXPECT_FALSE(fs::exists(good + ".tmp"));

    // Missing directory: an error naming the path, nothing created.
    const std::string missing = (d.path / "no-such-dir" / "out.svg").string();
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
        EXPECT_THROW(write_file_atomic((ro / "out.svg").string(), bytes), error);
        EXPECT_THROW(check_plot_path((ro / "out.svg").string()), error);
        EXPECT_TRUE(fs::is_empty(ro));
    }
    EXPECT_NO_THROW(check_plot_path(good));
    EXPECT_NO_THROW(check_plot_path("relative-name.svg"));  // the current directory
    EXPECT_THROW(check_plot_path(""), error);
    // Only the good file is left in the directory.
    size_t n = 0;
    for (const auto &e : fs::directory_iterator(d.path)) n += e.is_regular_file();
    EXPECT_EQ(n, 1u);
}

niah_plot_summary sample() {
    niah_plot_summary s{4096, 5, 3, "mixed", {}};
    s.rows = {{"full", 93.3, 2.41, 0}, {"keep 0.1", 60, 0.62, 0.31}, {"keep 0.2", 86.7, 0.85, 0.33},
              {"keep 0.5", 100, 1.52, 0.32}};
    return s;
}

// The rects of class `cls` in `svg`, in document order: {x, y, width, height} each.
std::vector<std::array<double, 4>> rects_of(const std::string &svg, const std::string &cls) {
    std::vector<std::array<double, 4>> out;
    const std::string key = "<rect class=\"" + cls + "\" ";
    for (size_t at = svg.find(key); at != std::string::npos; at = svg.find(key, at + 1)) {
        std::array<double, 4> r{};
        EXPECT_EQ(std::sscanf(svg.c_str() + at + key.size(),
                              "x=\"%lf\" y=\"%lf\" width=\"%lf\" height=\"%lf\"", &r[0], &r[1], &r[2], &r[3]),
                  4);
        out.push_back(r);
    }
    return out;
}

// Bar i of panel p: columns [x0, x1), standing on base_y, `h` tall (to 0.01, the SVG's precision).
void expect_rect(const std::array<double, 4> &r, const niah_plot_panel &p, size_t i, double y_top, double h) {
    EXPECT_NEAR(r[0], p.bar_x0[i], 0.01);
    EXPECT_NEAR(r[2], p.bar_x1[i] - p.bar_x0[i], 0.01);
    EXPECT_NEAR(r[1], y_top, 0.01);
    EXPECT_NEAR(r[3], h, 0.01);
}

TEST(pflash_plot, xml_escape) {
    EXPECT_EQ(xml_escape("keep 0.2"), "keep 0.2");
    EXPECT_EQ(xml_escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
    EXPECT_EQ(xml_escape("\xc3\xbc"), "\xc3\xbc");  // UTF-8 passes through
}

TEST(pflash_plot, bars_follow_values) {
    const niah_plot_summary s = sample();
    const niah_plot_layout l = niah_plot_compute_layout(s);
    const std::string svg = niah_plot_svg(s);
    EXPECT_EQ(svg.rfind("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg ", 0), 0u);
    EXPECT_NE(
        svg.find("width=\"" + std::to_string(l.width) + "\" height=\"" + std::to_string(l.height) + "\""),
        std::string::npos);
    EXPECT_EQ(l.accuracy.axis_max, 100.0);
    EXPECT_EQ(l.ttft.axis_max, 2.5);  // 2.41 s -> ticks of 0.5
    EXPECT_LT(l.accuracy.right, l.ttft.left);
    EXPECT_LE(l.ttft.right, l.width);
    const auto acc = rects_of(svg, "accuracy"), target = rects_of(svg, "target"),
               drafter = rects_of(svg, "drafter");
    ASSERT_EQ(acc.size(), s.rows.size());
    ASSERT_EQ(target.size(), s.rows.size());
    ASSERT_EQ(drafter.size(), s.rows.size());
    const double plot_h = l.accuracy.base_y - l.accuracy.top_y;
    for (size_t i = 0; i < s.rows.size(); ++i) {
        if (i + 1 < s.rows.size()) EXPECT_LT(l.accuracy.bar_x1[i], l.accuracy.bar_x0[i + 1]);
        const double ha = s.rows[i].accuracy / 100.0 * plot_h;
        expect_rect(acc[i], l.accuracy, i, l.accuracy.base_y - ha, ha);
        const double ht = s.rows[i].ttft_s / 2.5 * plot_h, hd = s.rows[i].drafter_s / 2.5 * plot_h;
        expect_rect(target[i], l.ttft, i, l.ttft.base_y - ht, ht - hd);
        expect_rect(drafter[i], l.ttft, i, l.ttft.base_y - hd, hd);
        EXPECT_NE(svg.find(">" + s.rows[i].mode + "</text>"), std::string::npos) << s.rows[i].mode;
    }
    EXPECT_NE(svg.find("NIAH: 4096 tokens, 5 needles, 3 trials, mixed filler"), std::string::npos);
}

TEST(pflash_plot, odd_values_and_sizes) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    niah_plot_summary s{100000, 16, 1, "<x&y>", {}};
    s.rows = {{"full", nan, inf, 0}, {"keep 0.125 with a long label", 150, -1, 5}, {"k~", -5, 0.004, nan}};
    const niah_plot_layout l = niah_plot_compute_layout(s);
    EXPECT_GT(l.ttft.axis_max, 0.004 - 1e-12);
    EXPECT_LE(l.ttft.axis_max, 0.005 + 1e-12);
    const std::string svg = niah_plot_svg(s);
    EXPECT_NE(svg.find("&lt;x&amp;y&gt; filler"), std::string::npos);
    EXPECT_EQ(svg.find("<x&y>"), std::string::npos);
    // NaN / negative: no bar; over 100 %: clamped to the full height; the long label widens the slots.
    const auto acc = rects_of(svg, "accuracy"), target = rects_of(svg, "target");
    ASSERT_EQ(acc.size(), 3u);
    const double plot_h = l.accuracy.base_y - l.accuracy.top_y;
    expect_rect(acc[0], l.accuracy, 0, l.accuracy.base_y, 0);
    expect_rect(acc[1], l.accuracy, 1, l.accuracy.top_y, plot_h);
    expect_rect(acc[2], l.accuracy, 2, l.accuracy.base_y, 0);
    expect_rect(target[0], l.ttft, 0, l.ttft.base_y, 0);
    expect_rect(target[1], l.ttft, 1, l.ttft.base_y, 0);
    EXPECT_GT(l.accuracy.bar_x0[1] - l.accuracy.bar_x0[0], 28 * 8);
    EXPECT_NE(svg.find(">n/a</text>"), std::string::npos);
    // No rows at all still gives a valid (empty) chart; full prefill only: no drafter bars, no legend.
    s.rows.clear();
    EXPECT_TRUE(rects_of(niah_plot_svg(s), "accuracy").empty());
    s.rows = {{"full", 50, 1, 0}};
    const std::string one = niah_plot_svg(s);
    EXPECT_EQ(rects_of(one, "target").size(), 1u);
    EXPECT_TRUE(rects_of(one, "drafter").empty());
    EXPECT_EQ(one.find("drafter + selection"), std::string::npos);
}

TEST(pflash_plot, write_niah_plot_file) {
    temp_dir d;
    const std::string path = (d.path / "niah.svg").string();
    write_niah_plot(sample(), path);
    std::ifstream in(path, std::ios::binary);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), niah_plot_svg(sample()));
    EXPECT_THROW(write_niah_plot(sample(), (d.path / "missing" / "x.svg").string()), error);
    EXPECT_FALSE(fs::exists(d.path / "missing"));
}

}  // namespace
}  // namespace fathom::pflash
