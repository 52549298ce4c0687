#include "core/types.h"

#include <array>

namespace fathom {

namespace {
constexpr uint32_t kMaxId = 40;

constexpr std::array<dtype_traits, kMaxId> make_table() {
    std::array<dtype_traits, kMaxId> t{};
    for (auto &e : t) e = {"unknown", 0, 0, false, false};
    auto set = [&](dtype d, std::string_view n, uint32_t bs, uint32_t ts, bool compute) {
        t[static_cast<uint32_t>(d)] = {n, bs, ts, true, compute};
    };
    set(dtype::f32, "f32", 1, 4, true);
    set(dtype::f16, "f16", 1, 2, true);
    set(dtype::bf16, "bf16", 1, 2, true);
    set(dtype::q4_0, "q4_0", 32, 18, true);
    set(dtype::q4_1, "q4_1", 32, 20, true);
    set(dtype::q5_0, "q5_0", 32, 22, true);
    set(dtype::q5_1, "q5_1", 32, 24, true);
    set(dtype::q8_0, "q8_0", 32, 34, true);
    set(dtype::q8_1, "q8_1", 32, 36, false);
    set(dtype::q2_k, "q2_k", 256, 84, true);
    set(dtype::q3_k, "q3_k", 256, 110, true);
    set(dtype::q4_k, "q4_k", 256, 144, true);
    set(dtype::q5_k, "q5_k", 256, 176, true);
    set(dtype::q6_k, "q6_k", 256, 210, true);
    set(dtype::q8_k, "q8_k", 256, 292, true);
    set(dtype::iq2_xxs, "iq2_xxs", 256, 66, true);
    set(dtype::iq2_xs, "iq2_xs", 256, 74, false);
    set(dtype::iq3_xxs, "iq3_xxs", 256, 98, false);
    set(dtype::iq1_s, "iq1_s", 256, 50, false);
    set(dtype::iq4_nl, "iq4_nl", 32, 18, false);
    set(dtype::iq3_s, "iq3_s", 256, 110, false);
    set(dtype::iq2_s, "iq2_s", 256, 82, false);
    set(dtype::iq4_xs, "iq4_xs", 256, 136, false);
    set(dtype::i8, "i8", 1, 1, false);
    set(dtype::i16, "i16", 1, 2, false);
    set(dtype::i32, "i32", 1, 4, false);
    set(dtype::i64, "i64", 1, 8, false);
    set(dtype::f64, "f64", 1, 8, false);
    set(dtype::iq1_m, "iq1_m", 256, 56, false);
    set(dtype::tq1_0, "tq1_0", 256, 54, false);
    set(dtype::tq2_0, "tq2_0", 256, 66, false);
    set(dtype::mxfp4, "mxfp4", 32, 17, true);
    return t;
}
constexpr auto kTable = make_table();
const dtype_traits kUnknown{"unknown", 0, 0, false, false};
}  // namespace

const dtype_traits &dtype_info(uint32_t id) { return id < kMaxId ? kTable[id] : kUnknown; }

}  // namespace fathom
