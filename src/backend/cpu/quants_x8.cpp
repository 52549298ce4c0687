// Entry points of the row-interleaved q4_1 / q8_0 kernels (quants_x8.h): argument checks, the
// (scalar, ISA-independent) packing, and dispatch to the AVX2 / AVX-512 kernels (quants_x8_avx2.cpp,
// quants_x8_avx512.cpp).
#include "backend/cpu/quants_x8.h"

#include <cstring>
#include <string>

#include "backend/cpu/quants.h"
#include "core/error.h"

namespace fathom::cpu {

namespace {

constexpr int64_t kQk = 32;
constexpr size_t kQ41Group = 160;  // bytes per block of 8 rows: d[8], m[8] f16 + 128 B nibbles
constexpr size_t kQ80Group = 272;  // d[8] f16 + 256 B quants

size_t group_block_bytes(dtype t) {
    if (t == dtype::q4_1) return kQ41Group;
    if (t == dtype::q8_0 || t == dtype::q5_0) return kQ80Group;  // q5_0 is stored as exact q8_0 blocks
    throw error("x8: no interleaved layout for dtype " + std::string(dtype_name(t)));
}

void check_k(const char *op, int64_t K) {
    if (K <= 0 || K % kQk != 0) throw error(std::string(op) + ": K=" + std::to_string(K) + " is not a positive multiple of 32");
}

// 4-bit element e (0..31) of a q4_1 block's 16 quant bytes: low nibbles hold 0..15, high 16..31.
inline uint8_t nibble(const uint8_t *qs, int e) { return e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4; }

// A q5_0 block {f16 d, u8 qh[4], u8 qs[16]} (x = d * (q - 16), q = nibble | high bit << 4) as the q8_0
// block {f16 d, s8 q - 16}: the same values and scale. ggml's AVX2 q5_0 and q8_0 dot products are
// the same code once the quants are in int8 form (d_w * d_x, maddubs sign trick, one fma per block,
// hsum_float_8), so the q8_0 kernels give bit-identical results for q5_0 weights.
void q5_0_as_q8_0(const uint8_t *b, uint8_t *o) {
    std::memcpy(o, b, 2);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int e = 0; e < 32; ++e) {
        const int q = nibble(b + 6, e) | static_cast<int>((qh >> e) & 1u) << 4;
        o[2 + e] = static_cast<uint8_t>(static_cast<int8_t>(q - 16));
    }
}

}  // namespace

bool x8_supported(dtype t) {
    return (t == dtype::q4_1 || t == dtype::q8_0 || t == dtype::q5_0) && active_isa() != isa::scalar;
}

size_t x8_bytes(dtype t, int64_t K, int64_t n_groups) {
    check_k("x8_bytes", K);
    if (n_groups < 0) throw error("x8_bytes: negative group count");
    return group_block_bytes(t) * static_cast<size_t>(K / kQk) * static_cast<size_t>(n_groups);
}

void x8_pack(dtype t, int64_t K, const void *W, size_t w_stride, int64_t g0, int64_t g1, void *dst) {
    check_k("x8_pack", K);
    const size_t gb = group_block_bytes(t);
    if (g0 < 0 || g1 < g0) throw error("x8_pack: bad group range");
    const int64_t nb = K / kQk;
    const auto *w = static_cast<const uint8_t *>(W);
    if (t == dtype::q5_0) {  // convert each block of the group's 8 rows to q8_0, pack that
        uint8_t tmp[8 * 34];
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t b = 0; b < nb; ++b) {
                for (int r = 0; r < 8; ++r)
                    q5_0_as_q8_0(w + static_cast<size_t>(8 * g + r) * w_stride + static_cast<size_t>(b) * 22, tmp + 34 * r);
                x8_pack(dtype::q8_0, kQk, tmp, 34, 0, 1,
                        static_cast<uint8_t *>(dst) + (static_cast<size_t>(g) * static_cast<size_t>(nb) + b) * kQ80Group);
            }
        return;
    }
    if (x8_supported(t)) {  // same bytes as the scalar loop below (tested), ~10x faster
        detail::x8_pack_avx2(t == dtype::q4_1, nb, w, w_stride, g0, g1, static_cast<uint8_t *>(dst));
        return;
    }
    for (int64_t g = g0; g < g1; ++g) {
        auto *o = static_cast<uint8_t *>(dst) + static_cast<size_t>(g) * static_cast<size_t>(nb) * gb;
        for (int64_t b = 0; b < nb; ++b, o += gb) {
            for (int r = 0; r < 8; ++r) {
                const uint8_t *blk = w + static_cast<size_t>(8 * g + r) * w_stride;
                if (t == dtype::q4_1) {
                    blk += b * 20;                 // {f16 d, f16 m, u8 qs[16]}
                    std::memcpy(o + 2 * r, blk, 2);
                    std::memcpy(o + 16 + 2 * r, blk + 2, 2);
                    for (int k = 0; k < 4; ++k)    // register k: groups L = 2k (low) and 2k+1 (high)
                        for (int j = 0; j < 4; ++j)
                            o[32 + 32 * k + 4 * r + j] =
                                static_cast<uint8_t>(nibble(blk + 4, 8 * k + j) | nibble(blk + 4, 8 * k + 4 + j) << 4);
                } else {
                    blk += b * 34;                 // {f16 d, s8 qs[32]}
                    std::memcpy(o + 2 * r, blk, 2);
                    for (int L = 0; L < 8; ++L) std::memcpy(o + 16 + 32 * L + 4 * r, blk + 2 + 4 * L, 4);
                }
            }
        }
    }
}

void x8_gemm(dtype t, int64_t K, const void *P, int64_t g0, int64_t g1, const void *X, size_t x_stride, int64_t M,
             float *y, int64_t ldy) {
    check_k("x8_gemm", K);
    if (!x8_supported(t)) throw error("x8_gemm: no interleaved kernel for " + std::string(dtype_name(t)) + " on this CPU");
    if (g0 < 0 || g1 < g0 || M < 0 || (M > 1 && ldy < 8 * g1)) throw error("x8_gemm: bad tile");
    const auto *p = static_cast<const uint8_t *>(P);
    const auto *x = static_cast<const uint8_t *>(X);
    const bool q4 = t == dtype::q4_1;  // otherwise q8_0, and q5_0 as q8_0
    if (active_isa() == isa::avx512) {
        if (q4)
            detail::x8_gemm_q4_1_avx512(K / kQk, p, g0, g1, x, x_stride, M, y, ldy);
        else
            detail::x8_gemm_q8_0_avx512(K / kQk, p, g0, g1, x, x_stride, M, y, ldy);
        return;
    }
    if (q4)
        detail::x8_gemm_q4_1_avx2(K / kQk, p, g0, g1, x, x_stride, M, y, ldy);
    else
        detail::x8_gemm_q8_0_avx2(K / kQk, p, g0, g1, x, x_stride, M, y, ldy);
}

}  // namespace fathom::cpu
