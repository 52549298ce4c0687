// The DSpark drafter's golden cases (../shared/golden/ds4-tiny-dspark/dspark_cases.jsonl) and the strict
// comparison tier of its README ("Compare"), shared by the CPU drafter's tests (test_ds4_dspark.cpp) and the
// CUDA drafter's (tests/models/cuda/test_cuda_ds4_dspark.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"

namespace ds4_test {

inline std::string dspark_dir() {
    return std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny-dspark";
}

struct dspark_case {
    std::string name;
    fathom::ds4::qat_mode qat = fathom::ds4::qat_mode::full;
    bool end_to_end = false;  // end_to_end_tier == strict
    std::vector<int32_t> tokens;
    int32_t seed = 0;
    std::vector<int64_t> ctx_positions;
    std::vector<float> main_hidden;  // [|C|, 384]
    std::vector<int32_t> markov_prev, draft_tokens, block_input_ids;
    std::vector<std::vector<std::pair<int, float>>> base_top8, corrected_top8;  // [B][8]
    std::vector<float> base_gap, corrected_gap;                                 // [B]
    std::vector<float> base_logits, corrected_logits;                           // [B, V]
    std::vector<float> conf_logit, conf;                                        // [B]
    nlohmann::json tol;
};

inline std::vector<std::vector<std::pair<int, float>>> top8_of(const nlohmann::json &j) {
    std::vector<std::vector<std::pair<int, float>>> out;
    for (const auto &row : j) {
        std::vector<std::pair<int, float>> v;
        for (const auto &e : row) v.emplace_back(e[0].get<int>(), e[1].get<float>());
        out.push_back(std::move(v));
    }
    return out;
}

inline std::vector<float> flat(const nlohmann::json &rows) {
    std::vector<float> out;
    for (const auto &r : rows)
        for (const auto &v : r) out.push_back(v.get<float>());
    return out;
}

inline std::vector<dspark_case> load_dspark_cases() {
    std::ifstream in(dspark_dir() + "/dspark_cases.jsonl");
    if (!in) throw std::runtime_error("cannot open " + dspark_dir() + "/dspark_cases.jsonl");
    std::vector<dspark_case> out;
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        const auto j = nlohmann::json::parse(line);
        dspark_case c;
        c.name = j["name"];
        c.qat = j["qat"]["kv_fp8_e4m3"]        ? fathom::ds4::qat_mode::full
                : j["qat"]["indexer_fp4_e2m1"] ? fathom::ds4::qat_mode::fp4only
                                               : fathom::ds4::qat_mode::off;
        c.end_to_end = j["end_to_end_tier"] == "strict";
        c.tokens = j["tokens"].get<std::vector<int32_t>>();
        c.seed = j["seed_token"];
        c.ctx_positions = j["ctx_positions"].get<std::vector<int64_t>>();
        c.main_hidden = flat(j["main_hidden"]);
        c.markov_prev = j["markov_prev_tokens"].get<std::vector<int32_t>>();
        c.draft_tokens = j["draft_tokens"].get<std::vector<int32_t>>();
        c.block_input_ids = j["block_input_ids"].get<std::vector<int32_t>>();
        c.base_top8 = top8_of(j["base_top8"]);
        c.corrected_top8 = top8_of(j["corrected_top8"]);
        c.base_gap = j["base_top2_gap"].get<std::vector<float>>();
        c.corrected_gap = j["corrected_top2_gap"].get<std::vector<float>>();
        c.base_logits = flat(j["base_logits"]);
        c.corrected_logits = flat(j["corrected_logits"]);
        c.conf_logit = j["confidence_logit"].get<std::vector<float>>();
        c.conf = j["confidence"].get<std::vector<float>>();
        c.tol = j["tolerance"];
        out.push_back(std::move(c));
    }
    return out;
}

// The strict tier of the README ("Compare"): one-line reason when a check fails.
struct dspark_verdict {
    bool ok = true;
    std::string why;
    double max_top8 = 0, max_conf = 0;
};

inline void check_rows(const dspark_case &c, const char *what, const std::vector<float> &got,
                const std::vector<std::vector<std::pair<int, float>>> &top8, const std::vector<float> &gap,
                const std::vector<float> &golden, int V, dspark_verdict &v) {
    auto fail = [&](const std::string &why) {
        if (v.ok) v.why = std::string(what) + ": " + why;
        v.ok = false;
    };
    for (size_t j = 0; j < top8.size(); ++j) {
        const float *row = &got[j * static_cast<size_t>(V)];
        const float *gold = &golden[j * static_cast<size_t>(V)];
        double e = 0, num = 0, den = 0;
        for (const auto &[id, g] : top8[j]) e = std::max(e, std::fabs(static_cast<double>(row[id]) - g));
        v.max_top8 = std::max(v.max_top8, e);
        if (e > c.tol["top8_abs_max"].get<double>())
            fail("row " + std::to_string(j) + " top-8 deviation " + std::to_string(e));
        const int top1 = static_cast<int>(std::max_element(row, row + V) - row);
        if (gap[j] > c.tol["top1_must_match_if_gap_gt"].get<double>() && top1 != top8[j][0].first)
            fail("row " + std::to_string(j) + " argmax " + std::to_string(top1) +
                 " != " + std::to_string(top8[j][0].first));
        for (int i = 0; i < V; ++i) {
            num += (static_cast<double>(row[i]) - gold[i]) * (static_cast<double>(row[i]) - gold[i]);
            den += static_cast<double>(gold[i]) * gold[i];
        }
        if (std::sqrt(num / den) > c.tol["rows_rel_l2_max"].get<double>())
            fail("row " + std::to_string(j) + " relative L2 " + std::to_string(std::sqrt(num / den)));
    }
}

inline dspark_verdict compare(const dspark_case &c, const fathom::ds4::dspark_block &b, int V) {
    dspark_verdict v;
    check_rows(c, "base", b.base_logits, c.base_top8, c.base_gap, c.base_logits, V, v);
    check_rows(c, "corrected", b.corrected_logits, c.corrected_top8, c.corrected_gap, c.corrected_logits, V,
               v);
    auto fail = [&](const std::string &why) {
        if (v.ok) v.why = why;
        v.ok = false;
    };
    for (size_t j = 0; j < c.conf.size(); ++j) {
        const double el = std::fabs(b.confidence_logit[j] - c.conf_logit[j]),
                     ec = std::fabs(b.confidence[j] - c.conf[j]);
        v.max_conf = std::max(v.max_conf, el);
        if (el > c.tol["confidence_logit_abs_max"].get<double>() ||
            ec > c.tol["confidence_abs_max"].get<double>())
            fail("row " + std::to_string(j) + " confidence logit off by " + std::to_string(el));
    }
    if (b.draft_tokens != c.draft_tokens) fail("draft tokens differ");
    if (b.markov_prev != c.markov_prev) fail("Markov inputs differ");
    return v;
}

}  // namespace ds4_test
