// The staged q8 gate/up kernel (ds4_moe.cu moe_gate_up_staged_kernel: weight slabs copied into shared
// memory by cp.async, set_moe_staged modes 1 / 2 / 3) against the direct kernel (mode 0), BIT FOR
// BIT: both run the same per-row arithmetic, so every h value (and the down kernel's y fed by it)
// must have identical bits. Outputs are NaN-poisoned first (an unwritten element keeps its poison,
// a row written by one kernel only differs in bits). Shapes: the DS4-Flash layer (D 4096, F 2048,
// 256 experts, 6 used + the q8_0 shared expert) and odd ones that hit the slab edges: F not a
// multiple of the slab rows (routed slabs of 16, 8 or 2 rows; a shared slab of 3 rows with a partial
// last slab), repeated ids, ids out of range (error flag, rows left), no ids / no weights, an h row
// offset; the K-quants (q3_k .. q6_k, the q4 files' experts) on both kernels too. A captured
// launch_moe_ffn graph is replayed with ids changing between replays.
//   CudaDs4MoeStaged.*       correctness (needs a device)
// The benchmark (direct vs staged time per layer-token with a cold-ish L2, 8 layers' distinct banks
// rotated): bench/cuda/bench_ds4_moe_staged.cpp (bench_cuda_kernels).
// Weights: random bytes with every block's f16 scales overwritten by finite values of about
// 1 / sqrt(D) per weight (any bit pattern is a valid code otherwise), so outputs are finite.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_kernels_testing.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "ds4_moe_staged_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_moe_staged_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::time_graph;

// rows x cols weights of type t (iq2_xxs, q2_k, q8_0 or a K-quant) as random bytes with sane block scales.
std::vector<uint8_t> rand_rows(dtype t, int64_t cols, int64_t rows, uint64_t seed) {
    const size_t bytes = dtype_row_bytes(t, cols) * static_cast<size_t>(rows);
    std::vector<uint8_t> q((bytes + 7) / 8 * 8);
    uint64_t z = seed;
    for (size_t i = 0; i < q.size(); i += 8) {  // splitmix64
        z += 0x9E3779B97F4A7C15ull;
        uint64_t v = z;
        v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
        v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
        v ^= v >> 31;
        std::memcpy(&q[i], &v, 8);
    }
    q.resize(bytes);
    std::mt19937 rng(static_cast<unsigned>(seed));
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    const float inv = 1.0f / std::sqrt(static_cast<float>(cols));
    auto put16 = [&](size_t off, float f) {
        const uint16_t h = cpu::f32_to_f16(f);
        std::memcpy(&q[off], &h, 2);
    };
    if (t == dtype::iq2_xxs) {
        for (size_t off = 0; off < bytes; off += 66) put16(off, ud(rng) * inv / 12.0f);
    } else if (t == dtype::q2_k) {
        for (size_t off = 0; off < bytes; off += 84) {
            put16(off + 80, ud(rng) * inv / 15.0f);
            put16(off + 82, ud(rng) * inv / 30.0f);
        }
    } else if (t == dtype::q8_0) {
        for (size_t off = 0; off < bytes; off += 34) put16(off, ud(rng) * inv / 74.0f);
    } else if (t == dtype::q3_k) {  // |scale| <= 32, |q| <= 4
        for (size_t off = 0; off < bytes; off += 110) put16(off + 108, ud(rng) * inv / 64.0f);
    } else if (t == dtype::q4_k || t == dtype::q5_k) {  // scale, min <= 63, q <= 15 / 31
        for (size_t off = 0; off < bytes; off += (t == dtype::q4_k ? 144 : 176)) {
            put16(off, ud(rng) * inv / (t == dtype::q4_k ? 470.0f : 950.0f));
            put16(off + 2, ud(rng) * inv / 950.0f);
        }
    } else if (t == dtype::q6_k) {  // |scale| <= 128, |q| <= 32
        for (size_t off = 0; off < bytes; off += 210) put16(off + 208, ud(rng) * inv / 2000.0f);
    } else {
        throw error("test: rand_rows handles iq2_xxs, q2_k, q8_0 and q3_k .. q6_k");
    }
    return q;
}

// Index of the first element whose bits differ, or -1.
int64_t first_diff(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) return 0;
    for (size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], 4) != 0) return static_cast<int64_t>(i);
    return -1;
}

// ---- routed gate/up (launch_moe_gate_up) -----------------------------------------------------------

struct gu_case {
    dtype t;
    int64_t D, F;
    int E, n_slot, s0;
    bool with_ids, with_wts;
    std::vector<int32_t> ids;  // empty: random in [0, E)
};

// h of case c in `mode` (h has s0 + n_slot + 1 rows of F: rows before s0 and the last must keep
// their poison), with the error word.
std::vector<float> run_gate_up(CudaDs4MoeStaged &f, int mode, const cd::expert_bank &g, const cd::expert_bank &u,
                               const int32_t *ids, const float *wts, const gu_case &c, const float *x, uint32_t *err,
                               uint32_t &err_out) {
    cd::set_moe_staged(mode);
    const size_t n = static_cast<size_t>((c.s0 + c.n_slot + 1) * c.F);
    float *h = f.poisoned(n);
    cd::launch_moe_gate_up(g, u, ids, wts, c.n_slot, c.s0, x, 1.0f, h, err, f.s_);
    auto out = f.down(h, n);
    err_out = f.down(err, 1)[0];
    cudaMemset(err, 0, 4);
    return out;
}

TEST_F(CudaDs4MoeStaged, GateUpRoutedBitExact) {
    const std::vector<gu_case> cases = {
        // the DS4-Flash routed gate/up: 16-row slabs, F = 128 slabs per slot
        {dtype::iq2_xxs, 4096, 2048, 256, 6, 0, true, true, {}},
        // F = 333: the last 16-row slab has 13 rows (warp 6 one row, warp 7 none); ids repeated
        {dtype::iq2_xxs, 2048, 333, 5, 9, 1, true, true, {3, 3, 0, 4, 3, 1, 1, 2, 0}},
        // q2_k 16-row slabs, F = 37 (last slab 5 rows), no routing weights
        {dtype::q2_k, 1024, 37, 3, 4, 0, true, false, {}},
        // q8_0 at D = 4352: 4624-byte rows, 2-row slabs (warp 0 only), 136 units per row; no ids
        {dtype::q8_0, 4352, 45, 2, 3, 2, false, true, {}},
        // q8_0 at D = 2048: 8-row slabs, F = 1001, many slots (several slabs per block)
        {dtype::q8_0, 2048, 1001, 7, 40, 0, true, true, {}},
        // K-quants (q4 / Q4_K_M files): q4_k 1152-byte rows, F = 333, repeated ids; q5_k F = 37;
        // q6_k 3360-byte rows (4-row slabs); q3_k 1760-byte rows (2-byte aligned blocks)
        {dtype::q4_k, 2048, 333, 5, 9, 1, true, true, {3, 3, 0, 4, 3, 1, 1, 2, 0}},
        {dtype::q5_k, 1024, 37, 3, 4, 0, true, false, {}},
        {dtype::q6_k, 4096, 100, 4, 6, 0, true, true, {}},
        {dtype::q3_k, 4096, 64, 3, 3, 2, false, true, {}},
    };
    for (const auto &c : cases) {
        SCOPED_TRACE(std::string(dtype_name(c.t)) + " D " + std::to_string(c.D) + " F " + std::to_string(c.F));
        const auto g = dev_bank(c.t, rand_rows(c.t, c.D, c.F * c.E, rng_()), c.F, c.D, c.E);
        const auto u = dev_bank(c.t, rand_rows(c.t, c.D, c.F * c.E, rng_()), c.F, c.D, c.E);
        std::vector<int32_t> ids = c.ids;
        if (ids.empty()) {
            std::vector<int32_t> p(static_cast<size_t>(c.E));
            std::iota(p.begin(), p.end(), 0);
            std::shuffle(p.begin(), p.end(), rng_);
            for (int s = 0; s < c.n_slot; ++s) ids.push_back(p[static_cast<size_t>(s % c.E)]);
        }
        const int32_t *ids_d = c.with_ids ? up(ids) : nullptr;
        const float *wts_d = c.with_wts ? up(randn(static_cast<size_t>(c.n_slot), rng_, 0.5f)) : nullptr;
        const float *x = up(randn(static_cast<size_t>(c.D), rng_));
        uint32_t e0 = 0;
        const auto ref = run_gate_up(*this, 0, g, u, ids_d, wts_d, c, x, err_, e0);
        EXPECT_EQ(e0, 0u);
        const size_t F = static_cast<size_t>(c.F), lo = static_cast<size_t>(c.s0) * F,
                     hi = lo + static_cast<size_t>(c.n_slot) * F;
        for (size_t i = 0; i < ref.size(); ++i)
            ASSERT_EQ(std::isnan(ref[i]), i < lo || i >= hi) << "direct kernel, element " << i;
        for (int mode : {1, 2, 3}) {
            SCOPED_TRACE("mode " + std::to_string(mode));
            uint32_t e = 0;
            const uint64_t n0 = cd::moe_staged_launches();
            const auto got = run_gate_up(*this, mode, g, u, ids_d, wts_d, c, x, err_, e);
            EXPECT_EQ(cd::moe_staged_launches() - n0, 1u) << "the staged kernel did not run";
            EXPECT_EQ(e, 0u);
            const int64_t d = first_diff(got, ref);
            EXPECT_EQ(d, -1) << "first differing element " << d << ": " << (d >= 0 ? got[d] : 0.0f) << " vs "
                             << (d >= 0 ? ref[d] : 0.0f);
        }
    }
}

// Ids out of range (E and -1) set err_expert_id and leave those slots' rows poisoned, exactly as
// the direct kernel; the other slots are computed.
TEST_F(CudaDs4MoeStaged, GateUpBadIdsFlagged) {
    const gu_case c{dtype::iq2_xxs, 2048, 100, 4, 5, 0, true, true, {}};
    const auto g = dev_bank(c.t, rand_rows(c.t, c.D, c.F * c.E, rng_()), c.F, c.D, c.E);
    const auto u = dev_bank(c.t, rand_rows(c.t, c.D, c.F * c.E, rng_()), c.F, c.D, c.E);
    const std::vector<int32_t> ids = {1, 4, 2, -1, 1};
    const int32_t *ids_d = up(ids);
    const float *wts_d = up(randn(5, rng_, 0.5f));
    const float *x = up(randn(static_cast<size_t>(c.D), rng_));
    uint32_t e0 = 0, e1 = 0;
    const uint64_t n0 = cd::moe_staged_launches();
    const auto ref = run_gate_up(*this, 0, g, u, ids_d, wts_d, c, x, err_, e0);
    EXPECT_EQ(cd::moe_staged_launches(), n0);
    const auto got = run_gate_up(*this, 1, g, u, ids_d, wts_d, c, x, err_, e1);
    EXPECT_EQ(cd::moe_staged_launches() - n0, 1u);
    EXPECT_EQ(e0, static_cast<uint32_t>(cd::err_expert_id));
    EXPECT_EQ(e1, static_cast<uint32_t>(cd::err_expert_id));
    EXPECT_EQ(first_diff(got, ref), -1);
    for (int s = 0; s < 5; ++s)
        for (int64_t r = 0; r < c.F; ++r)
            ASSERT_EQ(std::isnan(got[static_cast<size_t>(s * c.F + r)]), s == 1 || s == 3) << s << " " << r;
}

// ---- routed down (launch_moe_down) ------------------------------------------------------------------

// The staged down kernel (modes 1-3) vs the direct one (mode 0): rows not a multiple of the block's
// 16 (last block partial, a warp with one row), an id out of range (flagged, slot skipped), a
// repeated id, accumulation onto a given y, an h row offset, no ids, lanes looping over steps.
TEST_F(CudaDs4MoeStaged, DownRoutedBitExact) {
    struct dn_case {
        dtype t;
        int64_t rows, F;
        int E;
        std::vector<int32_t> ids;  // empty: ids = null (expert 0), n_slot 5
        int s0;
        bool accumulate;
    };
    const std::vector<dn_case> cases = {
        {dtype::q2_k, 333, 1024, 4, {0, 1, 3, 1, 2, 4, 0}, 1, true},
        {dtype::q8_0, 77, 768, 3, {}, 0, false},
        {dtype::iq2_xxs, 50, 2048, 2, {1, 0, 1}, 2, true},
        // F = 4352: 68 steps per row, lanes loop 3 times; 148 KB of staged rows (1 block per SM)
        {dtype::q8_0, 40, 4352, 2, {1, 1}, 0, true},
        // K-quants: q6_k at the DS4 F = 2048 (1680-byte rows, 134 KB staged), q4_k F = 768 (12 steps),
        // q3_k (2-byte aligned blocks), q5_k F = 4096 (lanes loop twice)
        {dtype::q6_k, 333, 2048, 4, {0, 1, 3, 1, 2}, 1, true},
        {dtype::q4_k, 77, 768, 3, {}, 0, false},
        {dtype::q3_k, 50, 2048, 2, {1, 0, 1}, 2, true},
        {dtype::q5_k, 40, 4096, 2, {1, 1}, 0, true},
    };
    for (const auto &c : cases) {
        SCOPED_TRACE(std::string(dtype_name(c.t)) + " rows " + std::to_string(c.rows));
        const int n_slot = c.ids.empty() ? 5 : static_cast<int>(c.ids.size());
        const auto d = dev_bank(c.t, rand_rows(c.t, c.F, c.rows * c.E, rng_()), c.rows, c.F, c.E);
        const int32_t *ids_d = c.ids.empty() ? nullptr : up(c.ids);
        const float *h = up(randn(static_cast<size_t>((c.s0 + n_slot) * c.F), rng_));
        const auto y0 = randn(static_cast<size_t>(c.rows), rng_);
        float *y = dev<float>(static_cast<size_t>(c.rows + 1));
        std::vector<float> ref;
        uint32_t e_ref = 0;
        for (int mode : {0, 1, 2, 3}) {
            SCOPED_TRACE("mode " + std::to_string(mode));
            cd::set_moe_staged(mode);
            auto init = y0;
            init.push_back(std::nanf(""));  // y[rows] must keep its poison
            if (!c.accumulate)
                for (size_t i = 0; i < y0.size(); ++i) init[i] = std::nanf("");
            put(y, init);
            const uint64_t n0 = cd::moe_staged_launches();
            cd::launch_moe_down(d, ids_d, n_slot, c.s0, h, c.accumulate, y, err_, s_);
            EXPECT_EQ(cd::moe_staged_launches() - n0, mode == 0 ? 0u : 1u);
            const auto got = down(y, static_cast<size_t>(c.rows + 1));
            const uint32_t e = take_err();
            ASSERT_TRUE(std::isnan(got.back()));
            if (mode == 0) {
                ref = got;
                e_ref = e;
                for (int64_t r = 0; r < c.rows; ++r) ASSERT_FALSE(std::isnan(got[static_cast<size_t>(r)])) << r;
                const bool bad = std::find(c.ids.begin(), c.ids.end(), c.E) != c.ids.end();
                EXPECT_EQ(e, bad ? static_cast<uint32_t>(cd::err_expert_id) : 0u);
                continue;
            }
            EXPECT_EQ(e, e_ref);
            EXPECT_EQ(first_diff(got, ref), -1);
        }
    }
}

// ---- whole chain (launch_moe_ffn: routed + shared gate/up fused, then down) --------------------------

// A device MoE layer with random router, hash table (tokens 0 .. n_vocab) and bias.
struct ffn_layer {
    cd::moe_layer l;
    int64_t D = 0, F = 0;
};
ffn_layer make_layer(CudaDs4MoeStaged &f, std::mt19937 &rng, int64_t D, int64_t F, int E, int k, dtype tgu,
                     dtype tdn, dtype tsh, bool hash, const std::vector<int32_t> &tid2eid, int n_vocab) {
    ffn_layer m;
    m.D = D;
    m.F = F;
    auto &l = m.l;
    auto mk = [&](dtype t, int64_t rows, int64_t cols, int64_t n) {
        return f.dev_bank(t, rand_rows(t, cols, rows * n, rng()), rows, cols, n);
    };
    l.gate_inp_type = dtype::f32;
    l.gate_inp = f.up(randn(static_cast<size_t>(E * D), rng, 2.0f / std::sqrt(static_cast<float>(D))));
    l.gate_inp_row_bytes = static_cast<size_t>(D) * 4;
    l.exp_bias = hash ? nullptr : f.up(randn(static_cast<size_t>(E), rng, 0.3f));
    l.tid2eid = hash ? f.up(tid2eid) : nullptr;
    l.n_vocab = hash ? n_vocab : 0;
    l.n_expert = E;
    l.n_used = k;
    l.weights_scale = 1.5f;
    l.clamp = 1.0f;  // small clamps: both SwiGLU clamps are hit
    l.clamp_sh = 1.25f;
    l.gate = mk(tgu, F, D, E);
    l.up = mk(tgu, F, D, E);
    l.down = mk(tdn, D, F, E);
    l.gate_sh = mk(tsh, F, D, 1);
    l.up_sh = mk(tsh, F, D, 1);
    l.down_sh = mk(tsh, D, F, 1);
    return m;
}

struct ffn_out {
    std::vector<float> h, y;
    uint32_t err = 0;
};
// One launch_moe_ffn of token *tok_d in `mode` (h and y poisoned first).
ffn_out run_ffn(CudaDs4MoeStaged &f, int mode, const ffn_layer &m, const float *x, const int32_t *tok_d,
                const cd::moe_scratch &sc, float *y, uint32_t *err) {
    cd::set_moe_staged(mode);
    const size_t nh = static_cast<size_t>((m.l.n_used + 1) * m.F), ny = static_cast<size_t>(m.D);
    f.poison(sc.h, nh);
    f.poison(y, ny);
    cd::launch_moe_ffn(m.l, x, tok_d, sc, y, err, f.s_);
    ffn_out o;
    o.h = f.down(sc.h, nh);
    o.y = f.down(y, ny);
    o.err = f.down(err, 1)[0];
    cudaMemset(err, 0, 4);
    return o;
}

TEST_F(CudaDs4MoeStaged, FfnBitExact) {
    struct ffn_case {
        int64_t D, F;
        int E, k;
        dtype tgu, tdn, tsh;
        bool hash;
    };
    const std::vector<ffn_case> cases = {
        // DS4-Flash: iq2_xxs gate/up, q2_k down, q8_0 shared (4-row shared slabs), learned routing
        {4096, 2048, 256, 6, dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, false},
        // q8_0 everywhere at D = 4352: 3-row shared slabs, F = 224 leaves a 2-row last one (warps 4-7
        // idle there), 2-row routed slabs; hash routing
        {4352, 224, 4, 3, dtype::q8_0, dtype::q8_0, dtype::q8_0, true},
        // q2_k gate/up with the q8_0 shared expert, D = 1024
        {1024, 256, 8, 2, dtype::q2_k, dtype::q2_k, dtype::q8_0, false},
        // all iq2_xxs (shared of the routed type), D = 2048
        {2048, 512, 16, 4, dtype::iq2_xxs, dtype::iq2_xxs, dtype::iq2_xxs, true},
    };
    for (const auto &c : cases) {
        SCOPED_TRACE(std::string(dtype_name(c.tgu)) + " D " + std::to_string(c.D) + " F " + std::to_string(c.F));
        const int n_vocab = 5;
        std::vector<int32_t> tid2eid(static_cast<size_t>(n_vocab * c.k));
        for (auto &e : tid2eid) e = static_cast<int32_t>(rng_() % c.E);
        const auto m = make_layer(*this, rng_, c.D, c.F, c.E, c.k, c.tgu, c.tdn, c.tsh, c.hash, tid2eid, n_vocab);
        const cd::moe_scratch sc = dev_moe_scratch(c.E, c.k, c.F);
        float *y = dev<float>(static_cast<size_t>(c.D));
        const float *x = up(randn(static_cast<size_t>(c.D), rng_));
        const int32_t *tok = up(std::vector<int32_t>{3});
        const auto ref = run_ffn(*this, 0, m, x, tok, sc, y, err_);
        ASSERT_EQ(ref.err, 0u);
        for (float v : ref.h) ASSERT_FALSE(std::isnan(v));
        for (float v : ref.y) ASSERT_FALSE(std::isnan(v));
        for (int mode : {1, 2, 3}) {
            SCOPED_TRACE("mode " + std::to_string(mode));
            const uint64_t n0 = cd::moe_staged_launches();
            const auto got = run_ffn(*this, mode, m, x, tok, sc, y, err_);
            EXPECT_GE(cd::moe_staged_launches() - n0, 1u) << "no staged kernel ran";
            EXPECT_EQ(got.err, 0u);
            EXPECT_EQ(first_diff(got.h, ref.h), -1);
            EXPECT_EQ(first_diff(got.y, ref.y), -1);
        }
    }
}

// launch_moe_ffn captured once with the staged kernel (hash routing: the token read from device
// memory picks the ids), replayed with the token changed between replays: every replay must equal
// the direct kernel's eager run for that token, bit for bit, including a token whose ids repeat one
// expert and one whose table row holds an id out of range (route flags it, every slot is skipped).
TEST_F(CudaDs4MoeStaged, GraphReplayIdsChange) {
    const int64_t D = 4096, F = 512;
    const int E = 32, k = 6, n_vocab = 4;
    std::vector<int32_t> tid2eid(static_cast<size_t>(n_vocab * k));
    for (auto &e : tid2eid) e = static_cast<int32_t>(rng_() % E);
    for (int j = 0; j < k; ++j) tid2eid[static_cast<size_t>(k + j)] = 7;  // token 1: expert 7 six times
    tid2eid[static_cast<size_t>(3 * k + 2)] = E;                          // token 3: an id out of range
    const auto m = make_layer(*this, rng_, D, F, E, k, dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, true, tid2eid,
                              n_vocab);
    const cd::moe_scratch sc = dev_moe_scratch(E, k, F);
    float *y = dev<float>(static_cast<size_t>(D));
    const float *x = up(randn(static_cast<size_t>(D), rng_));
    int32_t *tok = dev<int32_t>(1);
    const std::vector<int> order = {0, 1, 2, 3, 0, 2, 1};
    std::vector<ffn_out> ref(static_cast<size_t>(n_vocab));
    for (int t = 0; t < n_vocab; ++t) {
        put(tok, std::vector<int32_t>{t});
        ref[static_cast<size_t>(t)] = run_ffn(*this, 0, m, x, tok, sc, y, err_);
    }
    EXPECT_EQ(ref[0].err, 0u);
    EXPECT_NE(ref[3].err, 0u);
    cd::set_moe_staged(1);
    CK(cudaStreamSynchronize(s_));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    cd::launch_moe_ffn(m.l, x, tok, sc, y, err_, s_);
    CK(cudaStreamEndCapture(s_, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const size_t nh = static_cast<size_t>((k + 1) * F);
    for (int t : order) {
        SCOPED_TRACE("token " + std::to_string(t));
        put(tok, std::vector<int32_t>{t});
        poison(sc.h, nh);
        poison(y, static_cast<size_t>(D));
        CK(cudaGraphLaunch(exec, s_));
        const auto h = down(sc.h, nh), yv = down(y, static_cast<size_t>(D));
        const uint32_t e = down(err_, 1)[0];
        cudaMemset(err_, 0, 4);
        const auto &r = ref[static_cast<size_t>(t)];
        EXPECT_EQ(e, r.err);
        EXPECT_EQ(first_diff(h, r.h), -1);
        EXPECT_EQ(first_diff(yv, r.y), -1);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
}

// launch_moe_ffn_rows (the multi-row step's MoE: one chain for n rows; its direct and its staged
// kernels) against launch_moe_ffn on each row alone (the decode step's chain), bit for bit: every row's
// h rows and y, and the error word. Rows
// share experts (few experts: most ids repeat across rows), one row's table repeats one expert six
// times, one row's table holds an id out of range (flagged; its routed slots are skipped, as alone).
TEST_F(CudaDs4MoeStaged, RowsEqualEachRowAloneBitForBit) {
    struct rows_case {
        int64_t D, F;
        int E, k;
        dtype tgu, tdn, tsh;
        bool hash;
        std::vector<int> ns;
    };
    const std::vector<rows_case> cases = {
        {4096, 2048, 256, 6, dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, false, {1, 4, 16}},  // DS4-Flash, learned
        {4352, 224, 8, 6, dtype::q8_0, dtype::q8_0, dtype::q8_0, true, {5, 16}},            // hash, odd F
        {1024, 256, 8, 2, dtype::q2_k, dtype::q2_k, dtype::q8_0, false, {3, 9}},
        {2048, 512, 16, 4, dtype::iq2_xxs, dtype::iq2_xxs, dtype::iq2_xxs, true, {2, 7}},
    };
    for (const auto &c : cases) {
        const int n_vocab = 6;
        std::vector<int32_t> tid2eid(static_cast<size_t>(n_vocab * c.k));
        for (auto &e : tid2eid) e = static_cast<int32_t>(rng_() % c.E);
        for (int j = 0; j < c.k; ++j) tid2eid[static_cast<size_t>(c.k + j)] = 7 % c.E;  // token 1: one expert
        tid2eid[static_cast<size_t>(3 * c.k + 1)] = c.E;                                 // token 3: out of range
        const auto m = make_layer(*this, rng_, c.D, c.F, c.E, c.k, c.tgu, c.tdn, c.tsh, c.hash, tid2eid, n_vocab);
        ASSERT_TRUE(cd::moe_rows_supported(m.l));
        const int nmax = *std::max_element(c.ns.begin(), c.ns.end());
        const size_t D = static_cast<size_t>(c.D), nh = static_cast<size_t>((c.k + 1) * c.F);
        const cd::moe_scratch sc1 = dev_moe_scratch(c.E, c.k, c.F);
        cd::moe_rows_scratch sc;
        sc.logits = dev<float>(static_cast<size_t>(nmax * c.E));
        sc.ids = dev<int32_t>(static_cast<size_t>(nmax * c.k));
        sc.weights = dev<float>(static_cast<size_t>(nmax * c.k));
        sc.h = dev<float>(static_cast<size_t>(nmax) * nh);
        sc.xq = raw(cd::moe_rows_q8_bytes(nmax, c.D));
        sc.hq = raw(cd::moe_rows_q8_bytes(static_cast<int64_t>(nmax) * (c.k + 1), c.F));
        float *y1 = dev<float>(D), *y = dev<float>(static_cast<size_t>(nmax) * D);
        const float *x = up(randn(static_cast<size_t>(nmax) * D, rng_));
        std::vector<int32_t> toks(static_cast<size_t>(nmax));
        for (size_t r = 0; r < toks.size(); ++r) toks[r] = static_cast<int32_t>(r % 2 == 0 ? rng_() % n_vocab : (r / 2) % n_vocab);
        const int32_t *tok = up(toks);
        for (int n : c.ns) {
            SCOPED_TRACE(std::string(dtype_name(c.tgu)) + " D " + std::to_string(c.D) + " F " + std::to_string(c.F) +
                         " rows " + std::to_string(n));
            uint32_t err_ref = 0;
            std::vector<ffn_out> ref;
            for (int r = 0; r < n; ++r) {
                ref.push_back(run_ffn(*this, 1, m, x + r * D, tok + r, sc1, y1, err_));
                err_ref |= ref.back().err;
            }
            for (int mode : {0, 1}) {  // the direct rows kernels, the staged ones
                SCOPED_TRACE(mode ? "staged" : "direct");
                cd::set_moe_staged(mode);
                poison(sc.h, static_cast<size_t>(n) * nh);
                poison(y, static_cast<size_t>(n) * D);
                const uint64_t n0 = cd::moe_staged_launches();
                cd::launch_moe_ffn_rows(m.l, n, x, c.D, tok, sc, y, c.D, err_, s_);
                const auto h = down(sc.h, static_cast<size_t>(n) * nh), yv = down(y, static_cast<size_t>(n) * D);
                const uint32_t e = down(err_, 1)[0];
                cudaMemset(err_, 0, 4);
                if (mode) EXPECT_GE(cd::moe_staged_launches() - n0, 1u) << "no staged rows kernel ran";
                else EXPECT_EQ(cd::moe_staged_launches() - n0, 0u) << "a staged kernel ran in the direct mode";
                EXPECT_EQ(e, err_ref);
                for (int r = 0; r < n; ++r) {
                    SCOPED_TRACE("row " + std::to_string(r));
                    const auto r_ = static_cast<size_t>(r);
                    EXPECT_EQ(first_diff(std::vector<float>(h.begin() + r_ * nh, h.begin() + (r_ + 1) * nh), ref[r_].h), -1);
                    EXPECT_EQ(first_diff(std::vector<float>(yv.begin() + r_ * D, yv.begin() + (r_ + 1) * D), ref[r_].y), -1);
                }
            }
            cd::set_moe_staged(1);
        }
    }
}

}  // namespace
}  // namespace fathom
