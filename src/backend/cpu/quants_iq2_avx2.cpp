// AVX2 (+FMA, F16C) IQ2_XXS x Q8_K dot product and GEMM tile: quants_x86_iq2.h instantiated in this
// -mavx2 translation unit.
#include "backend/cpu/quants_iq2.h"
#include "backend/cpu/quants_x86_iq2.h"

namespace fathom::cpu::detail {

void fill_avx2_iq2(kernel_table &t) { fill_x86_iq2(t); }

}  // namespace fathom::cpu::detail
