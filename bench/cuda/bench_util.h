// Small helpers shared by the device benchmark programs (bench_cuda_ds4, bench_pflash_cuda).
#pragma once
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace fathom::bench_util {

// Monotonic wall clock in seconds.
inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// "a,b,c" -> {a, b, c} (empty items skipped; std::stoll throws on a bad number).
inline std::vector<int64_t> parse_list(const std::string &s) {
    std::vector<int64_t> v;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ','))
        if (!item.empty()) v.push_back(std::stoll(item));
    return v;
}

}  // namespace fathom::bench_util
