// SVG chart of a `fathom eval niah` summary (`--plot out.svg`): accuracy and time to first token side by
// side, one bar per mode (full prefill, then each PFlash keep ratio). SVG needs no image library and
// serves the reader best: it opens in any browser, scales without blur, and its text is real text
// (selectable, searchable, in the viewer's font). The chart is described in docs/pflash.md section 8.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fathom::pflash {

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

// Geometry of one panel and its bars (SVG user units = CSS pixels), computed from the summary: a bar of
// value v (clamped to [0, axis_max]; none for NaN or v <= 0) is v / axis_max * (base_y - top_y) tall and
// stands on base_y.
struct niah_plot_panel {
    int32_t left = 0, top_y = 0, base_y = 0, right = 0;  // plot area [left, right) x [top_y, base_y)
    double axis_max = 0;                                  // value at top_y
    std::vector<int32_t> bar_x0, bar_x1;                  // per row: bar columns [x0, x1)
};

struct niah_plot_layout {
    int32_t width = 0, height = 0;
    niah_plot_panel accuracy, ttft;
};

// The bars are <rect class="..."> elements of these classes and fills (the tests look for them).
inline constexpr const char *k_plot_accuracy_bar = "#3465a4";  // class "accuracy": accuracy bars
inline constexpr const char *k_plot_target_bar =
    "#cc6600";  // class "target": TTFT, target prefill + 1st token
inline constexpr const char *k_plot_drafter_bar =
    "#73d216";  // class "drafter": TTFT, PFlash drafter + selection

niah_plot_layout niah_plot_compute_layout(const niah_plot_summary &s);
// The chart as a standalone SVG 1.1 document (UTF-8; labels XML-escaped).
std::string niah_plot_svg(const niah_plot_summary &s);
// Renders the chart and writes it as SVG to `path` (atomically; throws fathom::error on failure).
void write_niah_plot(const niah_plot_summary &s, const std::string &path);
// Throws fathom::error unless `path`'s directory exists and is writable (checked before long runs).
void check_plot_path(const std::string &path);

// `text` with &, <, >, " and ' replaced by XML entities (labels and the title come from the user).
std::string xml_escape(std::string_view text);

// Writes `bytes` to `path` through `path` + ".tmp" and a rename, so a failed write leaves neither a
// half-written `path` nor the temporary behind. Throws fathom::error naming the path and the reason.
void write_file_atomic(const std::string &path, std::string_view bytes);

}  // namespace fathom::pflash
