// vec_kernels::round_f16 (the f16 rounding of attention inputs) on every kernel set against the
// scalar reference conversion f32_to_f16 (itself checked against hand-worked cases in test_quant):
// ties to even, subnormals, overflow to infinity, and lengths that leave a scalar tail.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cpu/vec.h"

using namespace fathom::cpu;

TEST(VecRound, F16RoundingMatchesScalarReference) {
    std::vector<float> x;
    // Exact ties between neighbouring f16 values (1 + 2^-11 lies halfway between 1 and 1 + 2^-10),
    // subnormal f16 range, the largest finite f16 and beyond, signed zeros.
    for (float v : {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 0x1p-25f, 3 * 0x1p-26f, 0x1p-24f * 1.5f, 65504.0f,
                    65520.0f, 70000.0f, -0.0f, 0.0f, -1.0f - 0x1p-11f, 1e-8f})
        x.push_back(v);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> e(-30.0f, 17.0f);
    for (int i = 0; i < 1000; ++i) x.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(e(rng)));
    x.push_back(0.5f);  // odd length: exercises the scalar tail
    std::vector<const vec_kernels *> sets = {&vec_generic()};
    if (vec_avx2()) sets.push_back(vec_avx2());
    for (float s : {1.0f, 0.37f}) {
        for (const vec_kernels *k : sets) {
            std::vector<float> y(x.size());
            k->round_f16(static_cast<int64_t>(x.size()), x.data(), s, y.data());
            for (size_t i = 0; i < x.size(); ++i) {
                const float want = f16_to_f32(f32_to_f16(x[i] * s));
                ASSERT_EQ(std::memcmp(&y[i], &want, 4), 0) << "x=" << x[i] << " s=" << s << ": " << y[i] << " vs " << want;
            }
        }
    }
    // In place.
    std::vector<float> z = {1.0f + 0x1p-11f, 2.0f};
    vec().round_f16(2, z.data(), 1.0f, z.data());
    EXPECT_EQ(z[0], 1.0f);
    EXPECT_EQ(z[1], 2.0f);
}

// kqv_lanes_f16 must equal axpy_f16 applied cell by cell in increasing j (its definition), bit for
// bit, on every kernel set, for partial lanes (j0, j1 not multiples of 8) and any query count.
TEST(VecRound, KqvLanesMatchCellByCellAxpy) {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<const vec_kernels *> sets = {&vec_generic()};
    if (vec_avx2()) sets.push_back(vec_avx2());
    for (int64_t hd : {64, 24, 32, 48, 128}) {  // every register-chunk variant and the generic path
        const int64_t n_cells = 45;
        std::vector<uint16_t> v(static_cast<size_t>(n_cells * hd));
        for (auto &x : v) x = f32_to_f16(nd(rng));
        std::vector<std::vector<float>> p(4, std::vector<float>(n_cells));
        for (auto &row : p)
            for (auto &x : row) x = f16_to_f32(f32_to_f16(std::fabs(nd(rng)) * 0.1f));
        for (const vec_kernels *k : sets)
            for (int nq = 1; nq <= 4; ++nq)
                for (auto [j0, j1] : {std::pair<int64_t, int64_t>{0, 44}, {3, 29}, {9, 9}}) {
                    std::vector<std::vector<float>> got(4, std::vector<float>(8 * hd)), want = got;
                    for (int q = 0; q < 4; ++q)
                        for (int64_t i = 0; i < 8 * hd; ++i) got[q][i] = want[q][i] = nd(rng);
                    const float *pq[4];
                    float *lq[4];
                    for (int q = 0; q < nq; ++q) {
                        pq[q] = p[q].data();
                        lq[q] = got[q].data();
                    }
                    k->kqv_lanes_f16(hd, j0, j1, v.data(), hd, pq, nq, lq);
                    for (int64_t j = j0; j <= j1; ++j)
                        for (int q = 0; q < nq; ++q) k->axpy_f16(hd, p[q][j], v.data() + j * hd, want[q].data() + (j & 7) * hd);
                    for (int q = 0; q < 4; ++q)
                        ASSERT_EQ(std::memcmp(got[q].data(), want[q].data(), got[q].size() * 4), 0)
                            << "hd=" << hd << " nq=" << nq << " q=" << q << " j0=" << j0 << " j1=" << j1;
                }
    }
}

// dot_f16_lanes_rows must give, row by row, dot_f16_lanes's bits on every kernel set: row counts
// that use the 8- and 4-row blocks and the single-row tail, lengths with a scalar tail, and a row
// stride larger than the row.
TEST(VecRound, DotRowsMatchSingleRowDots) {
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<const vec_kernels *> sets = {&vec_generic()};
    if (vec_avx2()) sets.push_back(vec_avx2());
    for (int64_t n : {64, 40, 13})
        for (int64_t nr : {1, 3, 4, 7, 8, 13, 21}) {
            const int64_t stride = n + 5;
            std::vector<uint16_t> a(static_cast<size_t>(nr * stride));
            for (auto &x : a) x = f32_to_f16(nd(rng));
            std::vector<float> b(static_cast<size_t>(n));
            for (auto &x : b) x = nd(rng);
            for (const vec_kernels *k : sets) {
                std::vector<float> got(static_cast<size_t>(nr) + 1,
                                       -7.0f);  // one poisoned element past the end
                k->dot_f16_lanes_rows(n, a.data(), stride, nr, b.data(), got.data());
                for (int64_t r = 0; r < nr; ++r) {
                    const float want = k->dot_f16_lanes(n, a.data() + r * stride, b.data());
                    ASSERT_EQ(std::memcmp(&got[size_t(r)], &want, 4), 0)
                        << "n=" << n << " nr=" << nr << " r=" << r;
                    double ref = 0;  // and close to the exact dot (independent of the kernels)
                    for (int64_t i = 0; i < n; ++i)
                        ref += double(f16_to_f32(a[size_t(r * stride + i)])) * b[size_t(i)];
                    ASSERT_NEAR(got[size_t(r)], ref, 1e-4 * (1 + std::fabs(ref)));
                }
                ASSERT_EQ(got[size_t(nr)], -7.0f);
            }
        }
}
