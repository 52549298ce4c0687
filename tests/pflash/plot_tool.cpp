// Writer side of tests/pflash/check_plot_png.py, which decodes the PNGs with Python's zlib + struct as an
// independent reader. Two modes:
//   pflash_plot_tool chart OUT.png LAYOUT.json N_TOKENS NEEDLES TRIALS FILLER [MODE ACC TTFT DRAFTER]...
//       write_niah_plot() of the given rows, and the chart geometry (niah_plot_compute_layout) as JSON.
//   pflash_plot_tool pattern OUT.png W H
//       png_encode() of a W x H image whose every pixel follows a formula the checker recomputes:
//       (r, g, b) = ((7x + 3y) % 256, (x ^ y) % 256, (x * y) % 251).
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
        std::fprintf(stderr, "usage: chart OUT.png LAYOUT.json N_TOKENS NEEDLES TRIALS FILLER [MODE ACC TTFT DRAFTER]...\n");
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

int pattern(int argc, char **argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: pattern OUT.png W H\n");
        return 2;
    }
    image_rgb img(std::atoi(argv[3]), std::atoi(argv[4]), rgb{});
    for (int32_t y = 0; y < img.height; ++y)
        for (int32_t x = 0; x < img.width; ++x) {
            uint8_t *p = &img.pixels[(static_cast<size_t>(y) * static_cast<size_t>(img.width) + static_cast<size_t>(x)) * 3];
            p[0] = static_cast<uint8_t>((7 * x + 3 * y) % 256);
            p[1] = static_cast<uint8_t>((x ^ y) % 256);
            p[2] = static_cast<uint8_t>((x * y) % 251);
        }
    write_file_atomic(argv[2], png_encode(img));
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    try {
        const std::string mode = argc > 1 ? argv[1] : "";
        if (mode == "chart") return chart(argc, argv);
        if (mode == "pattern") return pattern(argc, argv);
        std::fprintf(stderr, "usage: pflash_plot_tool chart|pattern ...\n");
        return 2;
    } catch (const fathom::error &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
