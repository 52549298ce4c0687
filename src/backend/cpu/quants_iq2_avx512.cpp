// AVX-512 (F, BW, VL, DQ, VNNI) build of the IQ2_XXS kernels: the same code as the AVX2 table
// (quants_x86_iq2.h) compiled with EVEX encodings and 32 vector registers, hence the same float
// order and bits. Checked by test_quant wherever the CPU has AVX-512 (force_isa on every level).
// GCC 12's avx512fintrin.h self-initialises "undefined" vectors, which -Wuninitialized reports at
// inlined uses; the values are never read (see quants_avx512.cpp). Silenced for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "backend/cpu/quants_iq2.h"
#include "backend/cpu/quants_x86_iq2.h"

namespace fathom::cpu::detail {

void fill_avx512_iq2(kernel_table &t) { fill_x86_iq2(t); }

}  // namespace fathom::cpu::detail
