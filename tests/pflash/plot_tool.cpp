// Writer side of tests/pflash/check_plot_svg.py, which parses the SVGs with Python's XML parser as an
// independent reader:
//   pflash_plot_tool chart OUT.svg LAYOUT.json N_TOKENS NEEDLES TRIALS FILLER [MODE ACC TTFT DRAFTER]...
//       write_niah_plot() of the given rows, and the chart geometry (niah_plot_compute_layout) as JSON.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fathom/error.h"
#include "pflash/plot.h"

using namespace fathom::pflash;

namespace {

void print_panel(FILE *f, const char *name, const niah_plot_panel &p, bool last) {
    std::fprintf(f, "  \"%s\": {\"left\": %d, \"right\": %d, \"top_y\": %d, \"base_y\": %d, \"axis_max\": %.17g, \"bars\": [",
                 name, p.left, p.right, p.top_y, p.base_y, p.axis_max);
    for (size_t i = 0; i < p.bar_x0.size(); ++i)
        std::fprintf(f, "%s[%d, %d]", i ? ", " : "", p.bar_x0[i], p.bar_x1[i]);
    std::fprintf(f, "]}%s\n", last ? "" : ",");
}

int chart(int argc, char **argv) {
    if (argc < 8 || (argc - 8) % 4 != 0) {
        std::fprintf(
            stderr,
            "usage: chart OUT.svg LAYOUT.json N_TOKENS NEEDLES TRIALS FILLER [MODE ACC TTFT DRAFTER]...\n");
        return 2;
    }
    niah_plot_summary s;
    s.n_tokens = std::atoll(argv[4]);
    s.n_needles = std::atoi(argv[5]);
    s.trials = std::atoi(argv[6]);
    s.filler = argv[7];
    for (int i = 8; i + 3 < argc; i += 4)
        s.rows.push_back({argv[i], std::strtod(argv[i + 1], nullptr), std::strtod(argv[i + 2], nullptr),
                          std::strtod(argv[i + 3], nullptr)});
    write_niah_plot(s, argv[2]);
    const niah_plot_layout l = niah_plot_compute_layout(s);
    FILE *f = std::fopen(argv[3], "w");
    if (!f) return 1;
    std::fprintf(f, "{\n  \"width\": %d, \"height\": %d,\n", l.width, l.height);
    print_panel(f, "accuracy", l.accuracy, false);
    print_panel(f, "ttft", l.ttft, true);
    std::fprintf(f, "}\n");
    return std::fclose(f) == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
    try {
        const std::string mode = argc > 1 ? argv[1] : "";
        if (mode == "chart") return chart(argc, argv);
        std::fprintf(stderr, "usage: pflash_plot_tool chart ...\n");
        return 2;
    } catch (const fathom::error &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
