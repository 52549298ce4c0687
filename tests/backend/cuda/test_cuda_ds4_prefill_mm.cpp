// DS4 prefill matrix products and chunked MoE on CUDA (src/backend/cuda/ds4_gemm.cu, ds4_moe_prefill.cu;
// interface ds4_prefill.h) against host references, every device output NaN-poisoned (or filled with a
// sentinel) first so an unwritten element fails.
//   CudaDs4PrefillMm.Matmul*      gemm_runner per weight type (f32, f16, bf16, q8_0 GGUF rows, q8_0
//                                 repacked by gemv_prepare, iq2_xxs, q2_k, mxfp4, q3_k .. q6_k);
//                                 n_tok 1, 7, 300;
//                                 203 rows (not a multiple of the 37-row tiles a tiny max_w_elems
//                                 forces); ldx > cols, ldy > rows (the gap keeps its sentinel);
//                                 accumulate; grouped (whole-group tiles and tiles inside a group).
//   CudaDs4PrefillMm.Route*       launch_moe_route_batch vs per-token launch_moe_route: identical bits.
//   CudaDs4PrefillMm.Moe*         moe_prefill vs the decode chain launch_moe_ffn per token and vs the CPU
//                                 moe_forward_batch; bad hash ids and tokens set the error bits.
// Tolerances. bf16 precision is held to rel L2 <= 1e-5 against a double reference computed from the
// SAME bf16-rounded operands (host round-to-nearest-even of x and of the CPU-dequantised weights): only
// f32 accumulation differs, so a wrong scale, layout or row/column mapping fails by orders of
// magnitude; and to <= 1e-2 against the unrounded double reference. Weights and activations that are
// small integers (exact in bf16) must give exactly the integer results. f32 precision: <= 1e-5 against
// the unrounded reference. MoE: bf16 products vs the decode chain's q8 activations (~1e-2 each) <=
// 2e-2, vs the f32 CPU reference <= 1e-2 (K-quant experts included).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_gemv.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "cuda_test_util.h"
#include "models/cuda/ds4_host_util.h"
#include "ds4_prefill_mm_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_prefill_mm_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;

// The CPU's dequantisation of every row (the values the device decoders must reproduce bit for bit).
std::vector<float> host_dequant(dtype t, const std::vector<uint8_t> &q, int64_t rows, int64_t cols) {
    const size_t rb = dtype_row_bytes(t, cols);
    std::vector<float> w(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) cpu::dequantize_row(t, q.data() + rb * r, w.data() + r * cols, cols);
    return w;
}

// ref[t * rows + r] = sum_c W[r, c] x[t * ldx + c] in double; round: both operands rounded to bf16
// first (what the bf16 path multiplies). Grouped: row r reads x + (r / rpg) * cols.
std::vector<double> host_matmul(const std::vector<float> &w, int64_t rows, int64_t cols, const std::vector<float> &x,
                                int64_t ldx, int64_t n_tok, bool round, int64_t rpg = 0) {
    std::vector<double> ref(static_cast<size_t>(n_tok * rows));
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = 0; r < rows; ++r) {
            const float *xr = x.data() + t * ldx + (rpg ? (r / rpg) * cols : 0);
            const float *wr = w.data() + r * cols;
            double acc = 0;
            for (int64_t c = 0; c < cols; ++c) {
                const float a = round ? bf16_round(wr[c]) : wr[c], b = round ? bf16_round(xr[c]) : xr[c];
                acc += static_cast<double>(a) * b;
            }
            ref[static_cast<size_t>(t * rows + r)] = acc;
        }
    return ref;
}

struct type_case {
    dtype t;
    bool repack;
};
const type_case kTypes[] = {{dtype::f32, false},     {dtype::f16, false},  {dtype::bf16, false},
                            {dtype::q8_0, false},    {dtype::q8_0, true},  {dtype::iq2_xxs, false},
                            {dtype::q2_k, false},    {dtype::mxfp4, false}, {dtype::q3_k, false},
                            {dtype::q4_k, false},    {dtype::q5_k, false}, {dtype::q6_k, false}};
// The K-quants' decoded values (up to 6 + 4 bits of scale times a 4..6-bit code) are not exact in
// bf16, so MatmulExactSmallIntegers leaves them out; MatmulMatchesHostReferencePerType holds them to
// 1e-5 against the bf16-rounded CPU dequantisation (a wrong element or scale moves a 512-term dot by
// ~1/sqrt(512), far beyond that).
bool has_exact_form(dtype t) {
    return t != dtype::q3_k && t != dtype::q4_k && t != dtype::q5_k && t != dtype::q6_k;
}
std::string name_of(const type_case &c) {
    return std::string(dtype_name(c.t)) + (c.repack ? " (repacked)" : "");
}

// Per type and n_tok: bf16 (tight vs rounded operands, loose vs exact), f32 precision, ldx > cols,
// ldy > rows with the gap untouched, several row tiles (203 rows, 37-row tiles), then accumulate.
TEST_F(CudaDs4PrefillMm, MatmulMatchesHostReferencePerType) {
    const int64_t rows = 203, cols = 512, ldx = cols + 3, ldy = rows + 5;
    cd::gemm_runner g(s_, size_t{1} << 20, static_cast<size_t>(37 * cols));
    for (const type_case &c : kTypes) {
        SCOPED_TRACE(name_of(c));
        const auto q = make_weight(c.t, rows, cols, rng_, false);
        const auto wf = host_dequant(c.t, q, rows, cols);
        dev_weight d;
        upload(d, c.t, q, rows, cols, c.repack);
        ASSERT_TRUE(cd::gemm_runner::supported(d.w));
        for (int64_t n_tok : {1, 7, 300}) {
            SCOPED_TRACE("n_tok " + std::to_string(n_tok));
            const auto x = randn(static_cast<size_t>(n_tok * ldx), rng_);
            float *xd = up(x);
            float *yd = up(filled(static_cast<size_t>(n_tok * ldy), kSentinel));
            const auto ref = host_matmul(wf, rows, cols, x, ldx, n_tok, false);
            const auto ref_r = host_matmul(wf, rows, cols, x, ldx, n_tok, true);
            auto compact = [&](const std::vector<float> &y, std::vector<float> *gap) {
                std::vector<float> o;
                for (int64_t t = 0; t < n_tok; ++t)
                    for (int64_t r = 0; r < ldy; ++r)
                        (r < rows ? o : *gap).push_back(y[static_cast<size_t>(t * ldy + r)]);
                return o;
            };
            // bf16 precision
            g.matmul(d.w, xd, ldx, n_tok, yd, ldy);
            std::vector<float> gap;
            const auto y = compact(down(yd, static_cast<size_t>(n_tok * ldy)), &gap);
            const double e_r = rel_l2(y, ref_r), e = rel_l2(y, ref);
            EXPECT_LE(e_r, 1e-5);
            EXPECT_LE(e, 1e-2);
            for (float v : gap) ASSERT_EQ(v, kSentinel) << "a row past `rows` within ldy was written";
            // accumulate onto y0 (the same product again: y = y0 + W x)
            const auto y0 = randn(static_cast<size_t>(n_tok * ldy), rng_);
            put(yd, y0);
            g.matmul(d.w, xd, ldx, n_tok, yd, ldy, cd::gemm_precision::bf16, true);
            const auto ya = down(yd, static_cast<size_t>(n_tok * ldy));
            std::vector<double> ref_a(ref_r);
            std::vector<float> ya_c;
            for (int64_t t = 0; t < n_tok; ++t)
                for (int64_t r = 0; r < rows; ++r) {
                    ref_a[static_cast<size_t>(t * rows + r)] += y0[static_cast<size_t>(t * ldy + r)];
                    ya_c.push_back(ya[static_cast<size_t>(t * ldy + r)]);
                }
            EXPECT_LE(rel_l2(ya_c, ref_a), 1e-5);
            // f32 precision
            put(yd, filled(static_cast<size_t>(n_tok * ldy), kSentinel));
            g.matmul(d.w, xd, ldx, n_tok, yd, ldy, cd::gemm_precision::f32);
            std::vector<float> gap32;
            const auto y32 = compact(down(yd, static_cast<size_t>(n_tok * ldy)), &gap32);
            const double e32 = rel_l2(y32, ref);
            EXPECT_LE(e32, 1e-5);
            for (float v : gap32) ASSERT_EQ(v, kSentinel);
            if (n_tok == 300)
                std::printf("  %-18s n_tok %3lld: bf16 rel L2 %.3g (rounded operands %.3g), f32 %.3g\n", name_of(c).c_str(),
                            static_cast<long long>(n_tok), e, e_r, e32);
        }
    }
}

// Small-integer weights and activations: every product and sum is exact in bf16 / f32, so both
// precisions must return the integer results bit for bit (a scale or layout error cannot hide).
TEST_F(CudaDs4PrefillMm, MatmulExactSmallIntegers) {
    const int64_t rows = 67, cols = 512;
    cd::gemm_runner g(s_, size_t{1} << 20, static_cast<size_t>(16 * cols));
    std::uniform_int_distribution<int> xi(-4, 4);
    for (const type_case &c : kTypes) {
        if (!has_exact_form(c.t)) continue;
        SCOPED_TRACE(name_of(c));
        const auto q = make_weight(c.t, rows, cols, rng_, true);
        const auto wf = host_dequant(c.t, q, rows, cols);
        for (float v : wf) ASSERT_EQ(v, bf16_round(v)) << "test weight not exact in bf16";
        dev_weight d;
        upload(d, c.t, q, rows, cols, c.repack);
        for (int64_t n_tok : {7, 300}) {
            std::vector<float> x(static_cast<size_t>(n_tok * cols));
            for (auto &v : x) v = static_cast<float>(xi(rng_));
            const auto ref = host_matmul(wf, rows, cols, x, cols, n_tok, false);
            float *xd = up(x), *yd = poisoned(static_cast<size_t>(n_tok * rows));
            for (auto prec : {cd::gemm_precision::bf16, cd::gemm_precision::f32}) {
                poison(yd, static_cast<size_t>(n_tok * rows));
                g.matmul(d.w, xd, cols, n_tok, yd, rows, prec);
                const auto y = down(yd, static_cast<size_t>(n_tok * rows));
                int bad = 0;
                for (size_t i = 0; i < ref.size(); ++i)
                    if (static_cast<double>(y[i]) != ref[i] && bad++ < 3)
                        ADD_FAILURE() << "element " << i << ": " << y[i] << " != " << ref[i]
                                      << (prec == cd::gemm_precision::f32 ? " (f32)" : " (bf16)");
                EXPECT_EQ(bad, 0);
            }
        }
    }
}

// Grouped products (output projection A): 5 groups of 24 rows; tiles of all groups, of 2 groups (5 =
// 2 + 2 + 1) and of 10 rows inside a group; bf16 weights in place.
TEST_F(CudaDs4PrefillMm, MatmulGrouped) {
    const int64_t rpg = 24, G = 5, rows = rpg * G, cols = 512, ldx = G * cols + 8, ldy = rows + 3;
    const type_case cases[] = {{dtype::q8_0, true}, {dtype::q8_0, false}, {dtype::f16, false}, {dtype::bf16, false}};
    for (size_t max_w : {size_t{1} << 20, static_cast<size_t>(2 * rpg * cols), static_cast<size_t>(10 * cols)}) {
        cd::gemm_runner g(s_, size_t{1} << 22, max_w);
        for (const type_case &c : cases) {
            SCOPED_TRACE(name_of(c) + " max_w " + std::to_string(max_w));
            const auto q = make_weight(c.t, rows, cols, rng_, false);
            const auto wf = host_dequant(c.t, q, rows, cols);
            dev_weight d;
            upload(d, c.t, q, rows, cols, c.repack);
            for (int64_t n_tok : {7, 300}) {
                const auto x = randn(static_cast<size_t>(n_tok * ldx), rng_);
                float *yd = up(filled(static_cast<size_t>(n_tok * ldy), kSentinel));
                g.matmul_grouped(d.w, rpg, up(x), ldx, n_tok, yd, ldy);
                const auto y = down(yd, static_cast<size_t>(n_tok * ldy));
                std::vector<float> yc;
                for (int64_t t = 0; t < n_tok; ++t)
                    for (int64_t r = 0; r < ldy; ++r) {
                        const float v = y[static_cast<size_t>(t * ldy + r)];
                        if (r < rows) yc.push_back(v);
                        else ASSERT_EQ(v, kSentinel);
                    }
                EXPECT_LE(rel_l2(yc, host_matmul(wf, rows, cols, x, ldx, n_tok, true, rpg)), 1e-5);
                EXPECT_LE(rel_l2(yc, host_matmul(wf, rows, cols, x, ldx, n_tok, false, rpg)), 1e-2);
            }
        }
    }
}

// Shape and type validation: clear errors instead of wrong results.
TEST_F(CudaDs4PrefillMm, MatmulRejectsBadShapes) {
    cd::gemm_runner g(s_, 4096, 4096);
    float *x = dev<float>(8192), *y = dev<float>(8192);
    auto q = make_weight(dtype::q2_k, 4, 256, rng_, false);
    uint8_t *qd = static_cast<uint8_t *>(raw(q.size() + 16));
    cd::gemm_weight w;
    w.type = dtype::q2_k;
    w.p = qd;
    w.row_bytes = dtype_row_bytes(dtype::q2_k, 256);
    w.rows = 4;
    w.cols = 256;
    EXPECT_TRUE(cd::gemm_runner::supported(w));
    cd::gemm_weight bad = w;
    bad.cols = 288;  // not whole q2_k blocks
    EXPECT_FALSE(cd::gemm_runner::supported(bad));
    EXPECT_THROW(g.matmul(bad, x, 288, 1, y, 4), error);
    bad = w;
    bad.p = qd + 2;  // q2_k rows need 4-byte alignment
    EXPECT_THROW(g.matmul(bad, x, 256, 1, y, 4), error);
    bad = w;
    bad.type = dtype::iq4_xs;  // no decoder for it
    EXPECT_FALSE(cd::gemm_runner::supported(bad));
    EXPECT_THROW(g.matmul(w, x, 256, 17, y, 4), error);  // 17 x 256 activations > max_x_elems 4096
    EXPECT_THROW(g.matmul(w, x, 256, 1, y, 3), error);   // ldy < rows
    EXPECT_THROW(g.matmul(w, x, 100, 1, y, 4), error);   // ldx < cols
    EXPECT_THROW(g.matmul_grouped(w, 3, x, 1024, 1, y, 4), error);  // 4 rows not groups of 3
    cd::gemm_runner tiny(s_, 4096, 512);
    cd::gemm_weight wide = w;
    wide.cols = 1024;
    wide.row_bytes = dtype_row_bytes(dtype::q2_k, 1024);
    wide.rows = 1;
    EXPECT_THROW(tiny.matmul(wide, x, 1024, 1, y, 1), error);  // one row does not fit the tile
    cd::gemm_weight none = w;
    none.p = nullptr;
    EXPECT_THROW(g.matmul(none, x, 256, 1, y, 4), error);
}

// ---- routing ---------------------------------------------------------------------------------------

// The batched route kernel against the per-token launcher on the same logits: ids and weights
// bit-identical for biased and hash routing (ties included), and the same error handling for a hash
// table row with an id outside the bank and a token outside the table.
TEST_F(CudaDs4PrefillMm, RouteBatchBitIdenticalToPerToken) {
    const int E = 256, k = 6, n_vocab = 97;
    const int64_t n_tok = 50;
    std::vector<int32_t> tid2eid(static_cast<size_t>(n_vocab * k));
    for (int t = 0; t < n_vocab; ++t) {
        std::vector<int32_t> p(E);
        std::iota(p.begin(), p.end(), 0);
        std::shuffle(p.begin(), p.end(), rng_);
        std::copy(p.begin(), p.begin() + k, tid2eid.begin() + t * k);
    }
    tid2eid[static_cast<size_t>(5 * k + 2)] = E;  // token 5: a bad id
    int32_t *tab = up(tid2eid);
    for (bool hash : {false, true}) {
        SCOPED_TRACE(hash ? "hash" : "biased");
        auto logits = randn(static_cast<size_t>(n_tok * E), rng_, 3.0f);
        for (int e = 10; e < 30; ++e) logits[static_cast<size_t>(3 * E + e)] = 7.0f;  // ties in token 3
        auto bias = randn(static_cast<size_t>(E), rng_, 0.5f);
        for (int e = 10; e < 30; ++e) bias[static_cast<size_t>(e)] = 0.0f;
        std::vector<int32_t> toks(static_cast<size_t>(n_tok));
        for (auto &t : toks) t = static_cast<int32_t>(rng_() % n_vocab);
        toks[7] = 5;
        if (hash) toks[9] = n_vocab;  // outside the table
        float *ld = up(logits), *bd = hash ? nullptr : up(bias);
        int32_t *td = up(toks);
        int32_t *ids_b = dev<int32_t>(static_cast<size_t>(n_tok * k)), *ids_1 = dev<int32_t>(static_cast<size_t>(n_tok * k));
        float *w_b = poisoned(static_cast<size_t>(n_tok * k)), *w_1 = poisoned(static_cast<size_t>(n_tok * k));
        cd::launch_moe_route_batch(ld, E, bd, tab, n_vocab, td, n_tok, k, 1.5f, ids_b, w_b, err_, s_);
        const uint32_t eb = take_err();
        for (int64_t t = 0; t < n_tok; ++t)
            cd::launch_moe_route(ld + t * E, E, bd, tab, n_vocab, td + t, k, 1.5f, ids_1 + t * k, w_1 + t * k, err_, s_);
        const uint32_t e1 = take_err();
        EXPECT_EQ(eb, e1);
        EXPECT_EQ(eb, hash ? static_cast<uint32_t>(cd::err_expert_id | cd::err_token_id) : 0u);
        const auto ib = down(ids_b, static_cast<size_t>(n_tok * k)), i1 = down(ids_1, static_cast<size_t>(n_tok * k));
        const auto wb = down(w_b, static_cast<size_t>(n_tok * k)), w1 = down(w_1, static_cast<size_t>(n_tok * k));
        EXPECT_EQ(ib, i1);
        EXPECT_EQ(std::memcmp(wb.data(), w1.data(), wb.size() * 4), 0) << "weights differ in bits";
        if (hash) {
            EXPECT_EQ(ib[static_cast<size_t>(7 * k)], -1);
        }
    }
}

// ---- MoE -------------------------------------------------------------------------------------------

// moe_prefill vs the decode chain and the CPU reference over several mixes, routings and chunk sizes;
// a second run must give the same bits (deterministic).
TEST_F(CudaDs4PrefillMm, MoeMatchesDecodeChainAndCpu) {
    const moe_case cases[] = {
        {dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, dtype::f16, false, true, 512, 256, 16, 4},
        {dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, dtype::f32, true, true, 512, 256, 16, 4},
        {dtype::mxfp4, dtype::mxfp4, dtype::mxfp4, dtype::f32, false, true, 256, 128, 16, 4},
        {dtype::q8_0, dtype::q8_0, dtype::q8_0, dtype::f32, true, false, 256, 128, 16, 4},
        // K-quant experts (the q4 / Q4_K_M-style files)
        {dtype::q4_k, dtype::q6_k, dtype::q4_k, dtype::f16, false, true, 512, 256, 16, 4},
        {dtype::q3_k, dtype::q5_k, dtype::q8_0, dtype::f32, true, true, 512, 256, 16, 4},
        {dtype::q6_k, dtype::q4_k, dtype::q5_k, dtype::f32, false, false, 256, 512, 16, 4},
    };
    for (const moe_case &c : cases) {
        SCOPED_TRACE(std::string(dtype_name(c.gu)) + "/" + std::string(dtype_name(c.dn)) + "/" +
                     std::string(dtype_name(c.sh)) + (c.hash ? " hash" : " biased") + (c.shared ? "" : " no shared"));
        moe_model m;
        build(m, c);
        cd::gemm_runner g(s_, size_t{1} << 16);
        cd::moe_prefill moe(g, 64, c.D, c.F, c.E, c.k);
        for (int64_t n_tok : {1, 37}) {
            SCOPED_TRACE("n_tok " + std::to_string(n_tok));
            const auto x = randn(static_cast<size_t>(n_tok * c.D), rng_);
            std::vector<int32_t> toks(static_cast<size_t>(n_tok));
            for (auto &t : toks) t = static_cast<int32_t>(rng_() % 97);
            float *xd = up(x);
            int32_t *td = up(toks);
            float *yd = poisoned(static_cast<size_t>(n_tok * c.D));
            moe.forward(m.d, xd, td, n_tok, yd, err_);
            const auto y = down(yd, static_cast<size_t>(n_tok * c.D));
            EXPECT_EQ(take_err(), 0u);
            poison(yd, static_cast<size_t>(n_tok * c.D));
            moe.forward(m.d, xd, td, n_tok, yd, err_);
            const auto y2 = down(yd, static_cast<size_t>(n_tok * c.D));
            EXPECT_EQ(std::memcmp(y.data(), y2.data(), y.size() * 4), 0) << "not deterministic";
            const auto yd_chain = decode_chain(m, xd, td, n_tok);
            EXPECT_EQ(take_err(), 0u);
            std::vector<float> ref(static_cast<size_t>(n_tok * c.D));
            ds4::moe_forward_batch(m.hp, m.l, x.data(), std::span<const int32_t>(toks.data(), toks.size()), ref.data());
            const double e_dec = rel_l2(y, yd_chain), e_cpu = rel_l2(y, ref);
            EXPECT_LE(e_dec, 2e-2);
            EXPECT_LE(e_cpu, 1e-2);
            std::printf("  moe prefill %s/%s/%s%s n_tok %2lld: rel L2 %.3g vs decode chain, %.3g vs CPU (decode vs CPU %.3g)\n",
                        dtype_name(c.gu).data(), dtype_name(c.dn).data(), dtype_name(c.sh).data(), c.hash ? " hash" : "",
                        static_cast<long long>(n_tok), e_dec, e_cpu, rel_l2(yd_chain, ref));
        }
    }
}

// Hash routing with a bad table entry (token 5) and a token outside the table: the error bits of the
// decode chain, those tokens get the shared expert only (as the decode chain), the others are intact.
TEST_F(CudaDs4PrefillMm, MoeBadHashIdsSetErrorAndSkip) {
    const moe_case c{dtype::iq2_xxs, dtype::q2_k, dtype::q8_0, dtype::f32, true, true, 512, 256, 16, 4};
    moe_model m;
    build(m, c);
    m.tid2eid[static_cast<size_t>(5 * c.k + 1)] = c.E;  // out of range
    put(const_cast<int32_t *>(m.d.tid2eid), m.tid2eid);
    cd::gemm_runner g(s_, size_t{1} << 16);
    cd::moe_prefill moe(g, 16, c.D, c.F, c.E, c.k);
    const int64_t n_tok = 9;
    std::vector<int32_t> toks = {1, 5, 2, 97, 3, 5, 4, 6, 7};
    const auto x = randn(static_cast<size_t>(n_tok * c.D), rng_);
    float *xd = up(x);
    int32_t *td = up(toks);
    float *yd = poisoned(static_cast<size_t>(n_tok * c.D));
    moe.forward(m.d, xd, td, n_tok, yd, err_);
    const auto y = down(yd, static_cast<size_t>(n_tok * c.D));
    EXPECT_EQ(take_err(), static_cast<uint32_t>(cd::err_expert_id | cd::err_token_id));
    const auto ref = decode_chain(m, xd, td, n_tok);
    EXPECT_EQ(take_err(), static_cast<uint32_t>(cd::err_expert_id | cd::err_token_id));
    EXPECT_LE(rel_l2(y, ref), 2e-2);
    for (int64_t t : {1, 3, 5}) {  // shared expert only: compare that token alone
        const size_t o = static_cast<size_t>(t * c.D);
        EXPECT_LE(rel_l2(y.data() + o, ref.data() + o, static_cast<size_t>(c.D)), 2e-2) << "token " << t;
    }
    EXPECT_THROW(moe.forward(m.d, xd, td, 17, yd, err_), error);  // over max_tok
}

}  // namespace
}  // namespace fathom
