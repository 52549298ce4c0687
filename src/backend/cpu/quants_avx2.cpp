// AVX2 (+FMA, F16C, BMI2) kernel table: the x86 kernels of quants_x86_q32.h and
// quants_x86_kquants.h instantiated in this -mavx2 translation unit. q3_k keeps the scalar kernel
// (no model we target uses it on a hot path); iq2_xxs is added by quants_iq2_avx2.cpp.
#include "backend/cpu/quants_x86_kquants.h"
#include "backend/cpu/quants_x86_q32.h"

namespace fathom::cpu::detail {

void fill_avx2(kernel_table &t) {
    fill_x86_q32(t);
    fill_x86_kquants(t);
}

}  // namespace fathom::cpu::detail
