// Registration of the x86 IQ2_XXS kernels (quants_x86_iq2.h) into the per-ISA kernel tables: each
// function overrides the iq2_xxs dot and gemm entries of a table that quants.cpp has already filled
// for that ISA level. Private to the quant kernels, like quants_impl.h.
#pragma once
#include "backend/cpu/quants_impl.h"

namespace fathom::cpu::detail {

void fill_avx2_iq2(kernel_table &t);    // quants_iq2_avx2.cpp
void fill_avx512_iq2(kernel_table &t);  // quants_iq2_avx512.cpp

}  // namespace fathom::cpu::detail
