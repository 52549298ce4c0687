// The `fathom eval niah --plot` chart (plot.h): layout, SVG text, atomic file write.
#include "pflash/plot.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "fathom/error.h"

namespace fathom::pflash {

std::string xml_escape(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    for (char c : text) {
        switch (c) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&quot;";
                break;
            case '\'':
                out += "&apos;";
                break;
            default:
                out += c;
        }
    }
    return out;
}

void write_file_atomic(const std::string &path, std::string_view bytes) {
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

namespace {

constexpr int32_t k_font = 14;        // px; labels, ticks, values
constexpr int32_t k_title_font = 16;  // px; the chart title
constexpr double k_char_w = 8.5;      // estimated advance of a k_font character (layout only)
constexpr int32_t k_line_h = 20;      // one text line
constexpr int32_t k_margin = 16;
constexpr int32_t k_title_y = 28;                               // baseline of the title
constexpr int32_t k_panel_title_y = k_title_y + 32;             // baseline of the panel titles
constexpr int32_t k_plot_top = k_panel_title_y + 2 * k_line_h;  // room for a value above a full bar
constexpr int32_t k_plot_h = 300;
constexpr int32_t k_axis_label_w = 60;  // tick labels of up to 6 characters
constexpr int32_t k_panel_pad = 12;     // plot area padding left and right of the bars
constexpr int32_t k_panel_gap = 40;     // between the two panels
constexpr int32_t k_n_ticks = 5;

constexpr const char *k_text = "#282828";
constexpr const char *k_axis = "#5a5a5a";
constexpr const char *k_grid = "#e1e1e1";
constexpr const char *k_target_legend = "target prefill + 1st token";

// Estimated width of `s` at k_font (code points x k_char_w): for the layout only, the viewer measures.
double text_width(std::string_view s) {
    size_t n = 0;
    for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return static_cast<double>(n) * k_char_w;
}

// Axis top for the TTFT panel: the smallest {1, 2, 2.5, 3, 4, 5} x 10^k step with k_n_ticks steps >= `m`.
double nice_axis_max(double m) {
    if (!(m > 0) || !std::isfinite(m)) return 1.0;
    const double raw = m / k_n_ticks;
    const double mag = std::pow(10.0, std::floor(std::log10(raw)));
    for (double f : {1.0, 2.0, 2.5, 3.0, 4.0, 5.0, 10.0})
        if (f * mag * k_n_ticks >= m) return f * mag * k_n_ticks;
    return 10.0 * mag * k_n_ticks;
}

// Bar height of value `v` on an axis [0, axis_max] spanning k_plot_h (0 for NaN and v <= 0).
double bar_height(double v, double axis_max) {
    if (!std::isfinite(v) || v <= 0) return 0;
    return std::min(v, axis_max) / axis_max * k_plot_h;
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

// A coordinate or length: two decimals, enough for any screen.
std::string num(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return buf;
}

int32_t slot_width(const niah_plot_summary &s) {
    double w = 72;
    for (const niah_plot_row &r : s.rows) w = std::max(w, text_width(r.mode) + 28);
    return static_cast<int32_t>(std::ceil(w));
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

// <text> at (x, y) (baseline), anchored start | middle | end.
std::string svg_text(double x, double y, std::string_view s, const char *anchor) {
    return "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" text-anchor=\"" + anchor + "\">" + xml_escape(s) +
           "</text>\n";
}

std::string svg_rect(const char *cls, double x, double y, double w, double h, const char *fill) {
    return "<rect class=\"" + std::string(cls) + "\" x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" +
           num(w) + "\" height=\"" + num(h) + "\" fill=\"" + fill + "\"/>\n";
}

std::string svg_line(double x1, double y1, double x2, double y2, const char *stroke) {
    return "<line x1=\"" + num(x1) + "\" y1=\"" + num(y1) + "\" x2=\"" + num(x2) + "\" y2=\"" + num(y2) +
           "\" stroke=\"" + stroke + "\"/>\n";
}

// One panel: title, grid, ticks, axes, bars (class `cls`; stacked drafter + target when `stacked`),
// values above the bars and mode labels below. `value(i)` = the bar's total, `lower(i)` = its drafter part.
template <class Value, class Lower>
std::string panel_svg(const niah_plot_panel &p, const niah_plot_summary &s, const char *title, bool percent,
                      const char *cls, const char *fill, bool stacked, Value value, Lower lower) {
    std::string out = "<g class=\"panel\">\n" + svg_text(p.left, k_panel_title_y, title, "start");
    for (int32_t t = 0; t <= k_n_ticks; ++t) {
        const double tv = p.axis_max * t / k_n_ticks;
        const double y = p.base_y - bar_height(tv, p.axis_max);
        if (t > 0) out += svg_line(p.left, y, p.right, y, k_grid);
        out += svg_line(p.left - 6, y, p.left, y, k_axis);
        char buf[32];
        std::snprintf(buf, sizeof buf, "%g", tv);
        out += svg_text(p.left - 10, y + 5, buf, "end");
    }
    out += svg_line(p.left, p.top_y, p.left, p.base_y, k_axis);    // y axis
    out += svg_line(p.left, p.base_y, p.right, p.base_y, k_axis);  // x axis
    for (size_t i = 0; i < s.rows.size(); ++i) {
        const double x0 = p.bar_x0[i], w = p.bar_x1[i] - p.bar_x0[i];
        const double v = value(i);
        const double h = bar_height(v, p.axis_max);
        const double d = lower(i);
        const double hd =
            stacked && std::isfinite(d) ? std::min(h, bar_height(std::min(d, v), p.axis_max)) : 0;
        out += svg_rect(cls, x0, p.base_y - h, w, h - hd, fill);
        if (stacked) out += svg_rect("drafter", x0, p.base_y - hd, w, hd, k_plot_drafter_bar);
        const double cx = x0 + w / 2;
        out += svg_text(cx, p.base_y - h - 6, format_value(v, percent), "middle");
        out += svg_text(cx, p.base_y + k_line_h, s.rows[i].mode, "middle");
    }
    return out + "</g>\n";
}

// Legend of the stacked TTFT bars, under the right panel's mode labels, one line each.
std::string legend_svg(const niah_plot_panel &p) {
    std::string out;
    double y = p.base_y + 2 * k_line_h + 8;
    const std::pair<const char *, const char *> items[] = {{k_plot_drafter_bar, "drafter + selection"},
                                                           {k_plot_target_bar, k_target_legend}};
    for (const auto &[c, name] : items) {
        out += svg_rect("legend", p.left, y - 11, 12, 12, c);
        out += svg_text(p.left + 18, y, name, "start");
        y += k_line_h;
    }
    return out;
}

}  // namespace

niah_plot_layout niah_plot_compute_layout(const niah_plot_summary &s) {
    niah_plot_layout l;
    const int32_t n = static_cast<int32_t>(s.rows.size());
    const int32_t slot = slot_width(s);
    const int32_t bar_w = std::max(16, slot * 3 / 5);
    // Wide enough for the panel title and the legend even with a single bar.
    const int32_t plot_w = std::max(std::max(n, 1) * slot + 2 * k_panel_pad, 240);
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
    const double title_w = text_width(title_of(s)) * k_title_font / k_font * 1.1;  // bold
    const double legend_w = l.ttft.left + 18 + text_width(k_target_legend);
    l.width = static_cast<int32_t>(
        std::ceil(std::max({double(l.ttft.right + k_margin), title_w + 2 * k_margin, legend_w + k_margin})));
    l.height = l.ttft.base_y + 4 * k_line_h + 8 + k_margin;
    return l;
}

std::string niah_plot_svg(const niah_plot_summary &s) {
    const niah_plot_layout l = niah_plot_compute_layout(s);
    const std::string w = std::to_string(l.width), h = std::to_string(l.height), title = title_of(s);
    std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
    out += "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" + w + "\" height=\"" + h +
           "\" viewBox=\"0 0 " + w + " " + h + "\" font-family=\"sans-serif\" font-size=\"" +
           std::to_string(k_font) + "\" fill=\"" + k_text + "\">\n";
    out += "<title>" + xml_escape(title) + "</title>\n";
    out += "<rect class=\"background\" width=\"" + w + "\" height=\"" + h + "\" fill=\"#ffffff\"/>\n";
    out += "<text x=\"" + std::to_string(k_margin) + "\" y=\"" + std::to_string(k_title_y) +
           "\" font-size=\"" + std::to_string(k_title_font) + "\" font-weight=\"bold\">" + xml_escape(title) +
           "</text>\n";
    out += panel_svg(
        l.accuracy, s, "accuracy %", true, "accuracy", k_plot_accuracy_bar, false,
        [&](size_t i) { return s.rows[i].accuracy; }, [](size_t) { return 0.0; });
    const bool stacked = has_drafter_time(s);
    out += panel_svg(
        l.ttft, s, "TTFT s", false, "target", k_plot_target_bar, stacked,
        [&](size_t i) { return s.rows[i].ttft_s; }, [&](size_t i) { return s.rows[i].drafter_s; });
    if (stacked) out += legend_svg(l.ttft);
    return out + "</svg>\n";
}

void write_niah_plot(const niah_plot_summary &s, const std::string &path) {
    write_file_atomic(path, niah_plot_svg(s));
}

void check_plot_path(const std::string &path) {
    namespace fs = std::filesystem;
    if (path.empty()) throw error("cannot write the plot: empty path");
    std::error_code ec;
    if (fs::is_directory(path, ec)) throw error("cannot write " + path + ": is a directory");
    fs::path dir = fs::path(path).parent_path();
    if (dir.empty()) dir = ".";
    if (!fs::is_directory(dir, ec))
        throw error("cannot write " + path + ": directory " + dir.string() + " does not exist");
    if (::access(dir.c_str(), W_OK) != 0)
        throw error("cannot write " + path + ": directory " + dir.string() + " is not writable");
}

}  // namespace fathom::pflash
