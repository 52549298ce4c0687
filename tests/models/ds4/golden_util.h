// Golden-case loading and the two comparison tiers of ../shared/golden/ds4-tiny/README.md
// ("How a test should compare"), shared by the main-model and MTP golden tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "models/deepseek4.h"

namespace ds4_test {

inline std::string golden_dir() {
    return std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny";
}

struct golden_case {
    std::string name;
    fathom::ds4::qat_mode qat = fathom::ds4::qat_mode::full;
    std::vector<int32_t> tokens;
    std::vector<int32_t> mtp_tokens;                       // MTP cases only
    std::vector<std::vector<std::pair<int, float>>> top8;  // [n][8] (id, logit)
    std::vector<float> top2_gap;                           // [n]
    std::vector<float> last_logits;                        // [n_vocab]
    nlohmann::json tol;
};

inline std::vector<golden_case> load_cases(const std::string &file) {
    std::ifstream in(golden_dir() + "/" + file);
    if (!in) throw std::runtime_error("cannot open " + golden_dir() + "/" + file);
    std::vector<golden_case> out;
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        const auto j = nlohmann::json::parse(line);
        golden_case c;
        c.name = j["name"];
        const bool fp8 = j["qat"]["kv_fp8_e4m3"], fp4 = j["qat"]["indexer_fp4_e2m1"];
        c.qat = fp8   ? fathom::ds4::qat_mode::full
                : fp4 ? fathom::ds4::qat_mode::fp4only
                      : fathom::ds4::qat_mode::off;
        c.tokens = j["tokens"].get<std::vector<int32_t>>();
        if (j.contains("mtp_tokens")) c.mtp_tokens = j["mtp_tokens"].get<std::vector<int32_t>>();
        for (const auto &pos : j["top8"]) {
            std::vector<std::pair<int, float>> v;
            for (const auto &e : pos) v.emplace_back(e[0].get<int>(), e[1].get<float>());
            c.top8.push_back(std::move(v));
        }
        c.top2_gap = j["top2_gap"].get<std::vector<float>>();
        c.last_logits = j["last_logits"].get<std::vector<float>>();
        c.tol = j["tolerance"];
        out.push_back(std::move(c));
    }
    return out;
}

// Outcome of comparing logits [n, V] with a golden case; `ok` false carries a one-line reason.
struct verdict {
    bool ok = true;
    std::string why;
    double max_e = 0, median_e = 0;
};

inline verdict compare(const golden_case &c, const std::vector<float> &logits, int V) {
    verdict v;
    const size_t n = c.top8.size();
    if (logits.size() != n * static_cast<size_t>(V)) return {false, "logit count mismatch"};
    std::vector<double> e(n);
    auto fail = [&](const std::string &why) {
        if (v.ok) v.why = why;
        v.ok = false;
    };
    const bool strict = c.tol["tier"] == "strict";
    const double gap_min = c.tol["top1_must_match_if_gap_gt"];
    for (size_t p = 0; p < n; ++p) {
        const float *lp = &logits[p * static_cast<size_t>(V)];
        for (const auto &[id, g] : c.top8[p])
            e[p] = std::max(e[p], std::fabs(static_cast<double>(lp[id]) - g));
        const int top1 = static_cast<int>(std::max_element(lp, lp + V) - lp);
        if (c.top2_gap[p] > gap_min && top1 != c.top8[p][0].first)
            fail("top-1 " + std::to_string(top1) + " != golden " + std::to_string(c.top8[p][0].first) +
                 " at position " + std::to_string(p));
        if (strict && e[p] > c.tol["top8_abs_max"].get<double>())
            fail("e_p = " + std::to_string(e[p]) + " at position " + std::to_string(p));
    }
    v.max_e = *std::max_element(e.begin(), e.end());
    std::vector<double> s = e;
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n / 2), s.end());
    v.median_e = s[n / 2];
    if (n % 2 == 0) {  // median of an even count: mean of the two middle values
        const double lo = *std::max_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n / 2));
        v.median_e = 0.5 * (lo + v.median_e);
    }
    if (!strict) {
        if (v.median_e > c.tol["median_top8_abs_max"].get<double>())
            fail("median e_p = " + std::to_string(v.median_e));
        const double frac =
            static_cast<double>(std::count_if(e.begin(), e.end(), [](double x) { return x <= 0.05; })) /
            static_cast<double>(n);
        if (frac < c.tol["frac_top8_abs_le_0.05_min"].get<double>())
            fail("fraction of e_p <= 0.05 is " + std::to_string(frac));
    }
    double num = 0, den = 0;
    const float *last = &logits[(n - 1) * static_cast<size_t>(V)];
    for (int i = 0; i < V; ++i) {
        const double d = static_cast<double>(last[i]) - c.last_logits[static_cast<size_t>(i)];
        num += d * d;
        den += static_cast<double>(c.last_logits[static_cast<size_t>(i)]) *
               c.last_logits[static_cast<size_t>(i)];
    }
    const double rel = std::sqrt(num / den);
    if (rel > c.tol["last_logits_rel_l2_max"].get<double>())
        fail("last-position relative L2 = " + std::to_string(rel));
    return v;
}

}  // namespace ds4_test
