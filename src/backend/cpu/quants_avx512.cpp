// AVX-512 overrides (placeholder table: filled below once kernels exist).
#include "backend/cpu/quants_impl.h"
namespace fathom::cpu::detail {
void fill_avx512(kernel_table &) {}
}  // namespace fathom::cpu::detail
