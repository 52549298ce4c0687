// Inline AVX2 helpers shared by quants_avx2*.cpp and quants_avx512*.cpp (included only from files
// compiled with -mavx2 -mfma -mf16c). Horizontal sums, nibble/bit unpacking, f16 loads.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace fathom::cpu::detail::avx2 {
namespace {  // internal linkage: this header is compiled under different -m flags per TU

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float hsum(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline uint16_t ld16(const uint8_t *p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

inline float ldf16(const uint8_t *p) { return _cvtsh_ss(ld16(p)); }

inline int32_t ld32(const uint8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// 16 packed bytes -> 32 bytes: elements 0..15 = low nibbles, 16..31 = high nibbles (ggml order).
inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, byte j = 0x10 if bit j is set (the q5 high bit, already shifted to place).
inline __m256i bits32_x16(const uint8_t *p) {
    uint32_t x;
    std::memcpy(&x, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));  // all ones iff bit (j % 8) set
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Sum of products u8 x s8 over 32 bytes -> 8 x i32 (pairs of maddubs lanes).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Sum of products s8 x s8 (sign moved onto the second operand; -128 never occurs in q8 data).
inline __m256i dot_s8s8(__m256i a, __m256i b) { return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }

// Reduces four 8 x i32 vectors to [sum(v0), sum(v1), sum(v2), sum(v3)] split over the two 128-bit
// halves: lane i and lane i + 4 together hold the total of v_i.
inline __m256i reduce4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
}

// [a0 a1 a2 a3 | a0 a1 a2 a3] + [b...] -> a + b per row: folds the two halves of a reduce4 layout.
inline __m128 fold_halves(__m256 v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }

}  // namespace
}  // namespace fathom::cpu::detail::avx2
