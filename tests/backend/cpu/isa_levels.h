// Shared by the test_quant suites: every ISA level this CPU can run (each kernel is checked on all
// of them), and a guard that restores the detected level when a test leaves its scope.
#pragma once
#include <vector>

#include "backend/cpu/quants.h"

namespace fathom::cpu::test {

inline std::vector<isa> isas() {
    std::vector<isa> v{isa::scalar};
    if (detected_isa() >= isa::avx2) v.push_back(isa::avx2);
    if (detected_isa() >= isa::avx512) v.push_back(isa::avx512);
    return v;
}

struct isa_guard {
    ~isa_guard() { force_isa(detected_isa()); }
};

}  // namespace fathom::cpu::test
