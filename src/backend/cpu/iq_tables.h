// Lookup tables of the i-quant formats (format constants, generated: see iq_tables.cpp).
#pragma once
#include <cstdint>

namespace fathom::cpu {

extern const uint8_t iq2xxs_grid[256][8];  // IQ2_XXS grid: 8 magnitudes per index
extern const uint8_t ksigns_iq2xs[128];    // 7-bit sign code -> 8 sign bits (even parity)

inline const uint8_t *iq2xxs_grid_bytes(uint32_t i) { return iq2xxs_grid[i]; }

}  // namespace fathom::cpu
