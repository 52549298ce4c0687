// DS4 attention-sublayer decode kernels on CUDA (src/backend/cuda/ds4_attn.cu, ds4_indexer.cu; contract
// ds4_attn_kernels.h) against the CPU reference functions of src/models (rms_norm, rope_apply,
// rope_plain / rope_yarn, fp8_round_trip, fp4_round_trip, hadamard_normalised, compressor_push,
// indexer_select, attend_with_sink, row_store) on random inputs. Device outputs are NaN-poisoned (or
// filled with 0xFF bytes) first, and buffers a kernel must not touch are checked byte for byte
// afterwards. All tests skip without a CUDA device. The kernels' timings at DS4-Flash shapes (graph
// replay): bench/cuda/bench_ds4_attn.cpp (bench_cuda_kernels).
//
// Tolerances: the element-wise kernels repeat the CPU's f32 operations (only block-wide double sums
// differ in order), so their outputs are expected bit-identical; the check allows 1e-6 of the
// vector's largest magnitude (f16-stored rows: 1e-3, one f16 step) and prints the bit-exact share.
// Attention accumulates in f32 where the CPU uses double: relative L2 <= 1e-5. Selections (indexer
// top-k, argmax) must be identical.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "core/error.h"
#include "models/deepseek4_impl.h"
#include "models/deepseek4_qat.h"
#include "cuda_test_util.h"
#include "ds4_attn_fixture.h"

namespace fathom {
namespace {

using namespace cuda_test::ds4_attn_suite;

namespace cd = cuda::ds4;

using cuda_test::randn;
using cuda_test::rel_l2;

// Largest |got - ref| over n elements relative to max |ref| (NaN or inf in got: +inf), and how many
// elements are bit-identical.
struct diff {
    double worst = 0;
    size_t exact = 0, n = 0;
};
diff compare(const float *got, const float *ref, size_t n) {
    diff d;
    d.n = n;
    double amax = 0;
    for (size_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<double>(ref[i])));
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(got[i])) {
            d.worst = INFINITY;
            continue;
        }
        if (std::memcmp(&got[i], &ref[i], 4) == 0) ++d.exact;
        const double e = std::fabs(static_cast<double>(got[i]) - ref[i]) / std::max(amax, 1e-30);
        d.worst = std::max(d.worst, e);
    }
    return d;
}

// Values as an f16 store would return them.
std::vector<float> f16_rounded(std::vector<float> v) {
    for (float &x : v) x = cpu::f16_to_f32(cpu::f32_to_f16(x));
    return v;
}

// Rows [n, width] as stored at `f16` precision, row_stride bytes apart (padding bytes 0xFF).
std::vector<uint8_t> pack_rows(const std::vector<float> &v, int64_t width, bool f16, size_t stride) {
    const int64_t n = static_cast<int64_t>(v.size()) / width;
    std::vector<uint8_t> b(static_cast<size_t>(n) * stride, 0xFF);
    for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < width; ++i) {
            uint8_t *p = b.data() + static_cast<size_t>(r) * stride;
            if (f16) {
                const uint16_t h = cpu::f32_to_f16(v[static_cast<size_t>(r * width + i)]);
                std::memcpy(p + 2 * i, &h, 2);
            } else {
                std::memcpy(p + 4 * i, &v[static_cast<size_t>(r * width + i)], 4);
            }
        }
    return b;
}
// Row r of a packed buffer as floats.
std::vector<float> unpack_row(const std::vector<uint8_t> &b, int64_t r, int64_t width, bool f16,
                              size_t stride) {
    std::vector<float> out(static_cast<size_t>(width));
    const uint8_t *p = b.data() + static_cast<size_t>(r) * stride;
    for (int64_t i = 0; i < width; ++i) {
        if (f16) {
            uint16_t h;
            std::memcpy(&h, p + 2 * i, 2);
            out[static_cast<size_t>(i)] = cpu::f16_to_f32(h);
        } else {
            std::memcpy(&out[static_cast<size_t>(i)], p + 4 * i, 4);
        }
    }
    return out;
}

ds4::rope_table plain_table(int n_rot) {
    return ds4::rope_plain(10000.0f, n_rot);
}

// The CPU's QAT round trip of one row of n dims (last n_rot RoPE dims) for a kind.
void cpu_qat(float *x, int n, int n_rot, cd::qat_kind k) {
    if (k == cd::qat_kind::fp8_nope) {
        ds4::fp8_round_trip(x, n - n_rot);
    } else if (k == cd::qat_kind::hadamard_fp4) {
        ds4::hadamard_normalised(x, n);
        ds4::fp4_round_trip(x, n);
    }
}
const char *qat_name(cd::qat_kind k) {
    return k == cd::qat_kind::none ? "none" : k == cd::qat_kind::fp8_nope ? "fp8" : "hadamard+fp4";
}

// ---- query heads -----------------------------------------------------------------------------------

// Attention queries (norm, plain and YaRN RoPE, no QAT), indexer queries (no norm, YaRN, Hadamard +
// FP4) and an FP8 variant, at positions from 0 to the 1M context edge.
TEST_F(CudaDs4Attn, HeadNormRopeMatchesCpu) {
    struct cfg {
        int n_head, hd, n_rot;
        bool norm, yarn;
        cd::qat_kind qat;
    };
    const cfg cfgs[] = {{64, 512, 64, true, false, cd::qat_kind::none},
                        {64, 512, 64, true, true, cd::qat_kind::none},
                        {64, 128, 64, false, true, cd::qat_kind::hadamard_fp4},
                        {8, 512, 64, true, true, cd::qat_kind::fp8_nope},
                        {16, 64, 16, true, true, cd::qat_kind::hadamard_fp4},  // one dim pair per lane
                        {5, 192, 64, true, true, cd::qat_kind::fp8_nope}};     // not 64 x 2^k: block path
    for (const cfg &c : cfgs) {
        const ds4::rope_table tab = c.yarn ? yarn_table(c.n_rot) : plain_table(c.n_rot);
        const cd::rope_args rope = dev_rope(tab, c.n_rot);
        const size_t n = static_cast<size_t>(c.n_head) * c.hd;
        for (int64_t pos : {int64_t{0}, int64_t{7}, int64_t{1000}, int64_t{65537}, int64_t{1048575}}) {
            SCOPED_TRACE(std::to_string(c.n_head) + "x" + std::to_string(c.hd) + " qat " + qat_name(c.qat) +
                         (c.yarn ? " yarn" : " plain") + " pos " + std::to_string(pos));
            const auto x = randn(n, rng_, 3.0f);
            auto ref = x;
            for (int h = 0; h < c.n_head; ++h) {
                float *xh = ref.data() + static_cast<size_t>(h) * c.hd;
                if (c.norm) ds4::rms_norm(xh, c.hd, nullptr, kEps, xh);
                ds4::rope_apply(xh + c.hd - c.n_rot, tab, pos, false);
                cpu_qat(xh, c.hd, c.n_rot, c.qat);
            }
            float *xd = up(x);
            set_pos(pos);
            cd::launch_head_norm_rope(xd, c.n_head, c.hd, c.norm, kEps, rope, c.qat, pos_, s_);
            const auto got = down(xd, n);
            const diff d = compare(got.data(), ref.data(), n);
            EXPECT_LE(d.worst, 1e-6);
            if (pos == 1000)
                std::printf("  head_norm_rope %dx%d %s: %zu/%zu bit-exact, worst %.3g\n", c.n_head, c.hd,
                            qat_name(c.qat), d.exact, d.n, d.worst);
        }
    }
}

// ---- KV row into the raw ring --------------------------------------------------------------------------

// f16 and f32 rings (rows padded past their data), QAT none and FP8, positions before and after the
// ring wraps: the finished row in place and in ring row pos mod window; every other byte untouched.
TEST_F(CudaDs4Attn, KvFinishStoreMatchesCpuAndWritesOneRow) {
    const int d = 512, nr = 64, W = 128;
    const ds4::rope_table tab = yarn_table(nr);
    const cd::rope_args rope = dev_rope(tab, nr);
    const auto norm_w = randn(d, rng_, 0.2f, 1.0f);
    const float *norm_d = up(norm_w);
    for (bool f16 : {true, false}) {
        for (cd::qat_kind qat : {cd::qat_kind::none, cd::qat_kind::fp8_nope}) {
            const size_t stride = static_cast<size_t>(d) * (f16 ? 2 : 4) + 64;
            std::vector<uint8_t> mirror(stride * W, 0xFF);  // what the ring must hold
            uint8_t *ring = up(mirror);
            for (int64_t pos :
                 {int64_t{0}, int64_t{5}, int64_t{127}, int64_t{128}, int64_t{300}, int64_t{1048575}}) {
                SCOPED_TRACE(std::string(f16 ? "f16" : "f32") + " qat " + qat_name(qat) + " pos " +
                             std::to_string(pos));
                const auto kv = randn(d, rng_, 2.0f);
                auto ref = kv;
                ds4::rms_norm(ref.data(), d, norm_w.data(), kEps, ref.data());
                ds4::rope_apply(ref.data() + d - nr, tab, pos, false);
                cpu_qat(ref.data(), d, nr, qat);
                float *kvd = up(kv);
                set_pos(pos);
                cd::launch_kv_finish_store(kvd, d, norm_d, kEps, rope, qat, ring, f16, stride, W, pos_, s_);
                const auto got = down(kvd, d);
                const diff dk = compare(got.data(), ref.data(), d);
                EXPECT_LE(dk.worst, 1e-6);
                const auto rb = down(ring, mirror.size());
                const int64_t slot = pos % W;
                const auto row = unpack_row(rb, slot, d, f16, stride);
                const auto ref_row = f16 ? f16_rounded(ref) : ref;
                const diff dr = compare(row.data(), ref_row.data(), d);
                EXPECT_LE(dr.worst, f16 ? 1e-3 : 1e-6);
                // the row's data bytes are the kernel's; everything else must be as before
                std::memcpy(mirror.data() + static_cast<size_t>(slot) * stride,
                            rb.data() + static_cast<size_t>(slot) * stride,
                            static_cast<size_t>(d) * (f16 ? 2 : 4));
                ASSERT_EQ(rb, mirror) << "bytes outside ring row " << slot << " changed";
                if (pos == 300)
                    std::printf(
                        "  kv_finish_store %s %s: kv %zu/%d bit-exact (worst %.3g), ring row %zu/%d\n",
                        f16 ? "f16" : "f32", qat_name(qat), dk.exact, d, dk.worst, dr.exact, d);
            }
        }
    }
}

// ---- compressor ------------------------------------------------------------------------------------------

struct comp_cfg {
    int ratio, dim, n_rot;
    cd::qat_kind qat;
    bool f16;
};

// 3.5 blocks of tokens through one compressor: every emitted row against compressor_push + RMSNorm +
// RoPE at the block start + QAT; the final frontier (kv, scores) identical; the last row lands past
// max_rows (err bit, guard row untouched); row padding untouched.
class CudaDs4AttnComp : public CudaDs4Attn {
  protected:
    void run(const comp_cfg &c) {
        SCOPED_TRACE("ratio " + std::to_string(c.ratio) + " dim " + std::to_string(c.dim) + " qat " +
                     qat_name(c.qat) + (c.f16 ? " f16" : " f32"));
        const int R = c.ratio, dp = c.dim, nr = c.n_rot;
        const bool overlap = R == 4;
        const int width = (overlap ? 2 : 1) * dp, slots = overlap ? 2 * R : R;
        const int64_t n_pos = 3 * R + R / 2, n_emit = n_pos / R;
        const ds4::rope_table tab = yarn_table(nr);
        ds4::compressor_weights w;
        w.ratio = R;
        w.dim = dp;
        w.ape = randn(static_cast<size_t>(R * width), rng_, 0.5f);
        w.norm = randn(static_cast<size_t>(dp), rng_, 0.2f, 1.0f);
        // Both frontiers position-indexed with the rollback slack (the CPU's layout on the device too).
        const int n_slots = slots + static_cast<int>(ds4::max_rollback);
        ds4::compressor_state st;
        st.ratio = R;
        st.dim = dp;
        st.kv.assign(static_cast<size_t>(n_slots * width), 0.0f);
        st.score.assign(static_cast<size_t>(n_slots * width), -INFINITY);
        const std::vector<float> fresh_kv(static_cast<size_t>(n_slots * width), 0.0f),
            fresh_score(static_cast<size_t>(n_slots * width), -INFINITY);

        cd::compressor_args a;
        a.ratio = R;
        a.dim = dp;
        a.ape = up(w.ape);
        a.norm_w = up(w.norm);
        a.eps = kEps;
        a.rope = dev_rope(tab, nr);
        a.qat = c.qat;
        a.slots = n_slots;
        a.state_kv = up(fresh_kv);
        a.state_score = up(fresh_score);
        const size_t stride = static_cast<size_t>(dp) * (c.f16 ? 2 : 4) + 32;
        std::vector<uint8_t> rows_host(stride * static_cast<size_t>(n_emit), 0xFF);  // last row: guard
        uint8_t *rows = up(rows_host);
        a.rows = rows;
        a.rows_f16 = c.f16;
        a.row_stride = stride;
        a.max_rows = n_emit - 1;
        float *ca = dev<float>(static_cast<size_t>(width)), *cg = dev<float>(static_cast<size_t>(width));
        std::vector<float> pooled(static_cast<size_t>(dp));
        size_t exact = 0, total = 0;
        double worst = 0;
        for (int64_t pos = 0; pos < n_pos; ++pos) {
            const auto av = randn(static_cast<size_t>(width), rng_),
                       gv = randn(static_cast<size_t>(width), rng_);
            put(ca, av);
            put(cg, gv);
            set_pos(pos);
            cd::launch_compressor_step(a, ca, cg, pos_, err_, s_);
            if (!ds4::compressor_push(st, w, av.data(), gv.data(), pos, pooled.data())) continue;
            ds4::rms_norm(pooled.data(), dp, w.norm.data(), kEps, pooled.data());
            ds4::rope_apply(pooled.data() + dp - nr, tab, pos + 1 - R, false);
            cpu_qat(pooled.data(), dp, nr, c.qat);
            const int64_t b = (pos + 1) / R - 1;
            const uint32_t e = take_err();
            if (b >= a.max_rows) {
                EXPECT_EQ(e, cd::err_comp_row) << "row " << b << " past max_rows";
                continue;
            }
            EXPECT_EQ(e, 0u);
            const auto rb = down(rows, rows_host.size());
            const auto row = unpack_row(rb, b, dp, c.f16, stride);
            const auto ref = c.f16 ? f16_rounded(pooled) : pooled;
            const diff d = compare(row.data(), ref.data(), static_cast<size_t>(dp));
            EXPECT_LE(d.worst, c.f16 ? 1e-3 : 1e-6) << "row " << b;
            worst = std::max(worst, d.worst);
            exact += d.exact;
            total += d.n;
            std::memcpy(rows_host.data() + static_cast<size_t>(b) * stride,
                        rb.data() + static_cast<size_t>(b) * stride,
                        static_cast<size_t>(dp) * (c.f16 ? 2 : 4));
        }
        EXPECT_EQ(total, static_cast<size_t>((n_emit - 1) * dp));
        // nothing but the emitted rows' data was written (padding and the guard row keep 0xFF)
        EXPECT_EQ(down(rows, rows_host.size()), rows_host);
        // frontier: copies and one f32 add each, identical to the CPU's
        const std::vector<float> &cpu_kv = st.kv, &cpu_sc = st.score;
        ASSERT_EQ(cpu_kv.size(), fresh_kv.size());
        const auto kv = down(a.state_kv, fresh_kv.size()), sc = down(a.state_score, fresh_score.size());
        EXPECT_EQ(std::memcmp(kv.data(), cpu_kv.data(), kv.size() * 4), 0) << "frontier kv differs";
        EXPECT_EQ(std::memcmp(sc.data(), cpu_sc.data(), sc.size() * 4), 0) << "frontier scores differ";
        std::printf("  compressor R=%d dim=%d %s %s: %lld rows, %zu/%zu bit-exact, worst %.3g\n", R, dp,
                    qat_name(c.qat), c.f16 ? "f16" : "f32", static_cast<long long>(n_emit - 1), exact, total,
                    worst);
    }
};

TEST_F(CudaDs4AttnComp, Ratio4MatchesCpu) {
    run({4, 512, 64, cd::qat_kind::fp8_nope, true});
    run({4, 512, 64, cd::qat_kind::none, false});
    run({4, 128, 64, cd::qat_kind::hadamard_fp4, false});  // the indexer's compressor
    run({4, 128, 64, cd::qat_kind::hadamard_fp4, true});
}

TEST_F(CudaDs4AttnComp, Ratio128MatchesCpu) {
    run({128, 512, 64, cd::qat_kind::fp8_nope, true});
    run({128, 512, 64, cd::qat_kind::none, false});
    run({128, 128, 64, cd::qat_kind::hadamard_fp4, true});
}

TEST_F(CudaDs4AttnComp, SmallRatioMatchesCpu) {
    run({8, 64, 16, cd::qat_kind::hadamard_fp4, false});
    run({8, 128, 64, cd::qat_kind::fp8_nope, false});
    run({2, 64, 16, cd::qat_kind::none, true});
    run({4, 192, 64, cd::qat_kind::fp8_nope, true});  // not 64 x 2^k: the row finished block-wide
    run({32, 256, 64, cd::qat_kind::fp8_nope, false});  // 32 candidates: 2 chunks of exps, each computed twice
}

// ---- indexer top-k -------------------------------------------------------------------------------------

// Device-counted rows n = (pos + 1) / 4 from 1 to 3000, below, at and above top-k 512; duplicated rows
// give exact score ties (lower row wins). Identical selections; n_sel = min(n, 512); sel entries past
// n_sel untouched.
TEST_F(CudaDs4Attn, IndexerTopkMatchesCpu) {
    const int H = 64, Dh = 128, topk = 512, ratio = 4;
    const int64_t max_n = 3000;
    const float w_scale = static_cast<float>(1.0 / std::sqrt(128.0 * 64.0));
    for (bool f16 : {true, false}) {
        auto rows = randn(static_cast<size_t>(max_n * Dh), rng_);
        for (int64_t c = 1; c < max_n; c += 7)
            std::copy_n(rows.begin() + (c - 1) * Dh, Dh, rows.begin() + c * Dh);
        if (f16) rows = f16_rounded(rows);
        ds4::row_store rs(Dh, f16 ? kv_precision::f16 : kv_precision::f32);
        rs.resize(max_n);
        for (int64_t c = 0; c < max_n; ++c) rs.set(c, rows.data() + c * Dh);
        const size_t stride = static_cast<size_t>(Dh) * (f16 ? 2 : 4);
        const uint8_t *rd = up(pack_rows(rows, Dh, f16, stride));
        float *score = poisoned(static_cast<size_t>(max_n));
        int32_t *sel = dev<int32_t>(topk), *n_sel = dev<int32_t>(1);
        for (int64_t pos : {int64_t{0}, int64_t{3}, int64_t{101}, int64_t{2047}, int64_t{2051}, int64_t{5002},
                            int64_t{11999}}) {
            const int64_t n = (pos + 1) / ratio;
            SCOPED_TRACE(std::string(f16 ? "f16" : "f32") + " pos " + std::to_string(pos) + " n " +
                         std::to_string(n));
            const auto q = randn(static_cast<size_t>(H * Dh), rng_);
            const auto w = randn(static_cast<size_t>(H), rng_);
            std::vector<float> ws(w.size());
            for (size_t h = 0; h < w.size(); ++h) ws[h] = w[h] * w_scale;  // the CPU's scaled weights
            const auto ref = ds4::indexer_select(q.data(), ws.data(), rs, n, H, Dh, topk);
            put(sel, std::vector<int32_t>(topk, -7));
            put(n_sel, std::vector<int32_t>{-1});
            set_pos(pos);
            cd::launch_indexer_topk(up(q), up(w), w_scale, rd, f16, stride, ratio, max_n, H, Dh, topk, pos_,
                                    score, sel, n_sel, s_);
            const int32_t m = down(n_sel, 1)[0];
            ASSERT_EQ(m, static_cast<int32_t>(std::min<int64_t>(n, topk)));
            const auto got = down(sel, topk);
            EXPECT_EQ(std::vector<int64_t>(got.begin(), got.begin() + m), ref);
            for (int i = m; i < topk; ++i)
                ASSERT_EQ(got[static_cast<size_t>(i)], -7) << "sel[" << i << "] written";
        }
    }
    std::printf("  indexer top-k: n = 0 .. 3000 from the device position, f16 and f32 rows: identical\n");
}

// ---- sparse sink attention -------------------------------------------------------------------------------

struct attn_case {
    cd::comp_mode mode;
    bool ring_f16, comp_f16;
    int ratio;
    int64_t max_comp, n_comp_rows, pos;
    size_t ring_pad = 16;  // bytes past each ring row (2 or 4: rows not aligned to a dim pair)
};

class CudaDs4AttnSparse : public CudaDs4Attn {
  protected:
    // Ring and compressed rows random except those the token must not see (never-written ring slots,
    // compressed rows not visible or not selected): NaN, so reading one poisons the output.
    void run(const attn_case &c) {
        const int H = 64, d = 512, nr = 64, W = 128;
        const char *mode = c.mode == cd::comp_mode::none  ? "none"
                           : c.mode == cd::comp_mode::all ? "all"
                                                          : "list";
        SCOPED_TRACE(std::string(mode) + " pos " + std::to_string(c.pos) +
                     (c.ring_f16 ? " ring f16" : " ring f32") + (c.comp_f16 ? " comp f16" : " comp f32"));
        const ds4::rope_table tab = c.mode == cd::comp_mode::none ? plain_table(nr) : yarn_table(nr);
        const int64_t first = std::max<int64_t>(0, c.pos - W + 1);
        auto ring = randn(static_cast<size_t>(W * d), rng_);
        if (c.ring_f16) ring = f16_rounded(ring);
        for (int64_t slot = c.pos + 1; slot < W; ++slot)  // pos < W: slots never written yet
            std::fill_n(ring.begin() + slot * d, d, std::nanf(""));
        std::vector<float> rows_cpu;  // the candidate list in the CPU's order
        for (int64_t p = first; p <= c.pos; ++p)
            rows_cpu.insert(rows_cpu.end(), ring.begin() + (p % W) * d, ring.begin() + (p % W + 1) * d);
        std::vector<float> comp;
        std::vector<int32_t> sel;
        if (c.mode != cd::comp_mode::none) {
            comp = randn(static_cast<size_t>(c.n_comp_rows * d), rng_);
            if (c.comp_f16) comp = f16_rounded(comp);
            std::vector<char> used(static_cast<size_t>(c.n_comp_rows), 0);
            if (c.mode == cd::comp_mode::all) {
                const int64_t n = std::min<int64_t>((c.pos + 1) / c.ratio, c.max_comp);
                for (int64_t r = 0; r < n; ++r) used[static_cast<size_t>(r)] = 1;
            } else {  // a sorted random choice of min(max_comp, visible) rows, as the indexer gives
                const int64_t vis = (c.pos + 1) / c.ratio;
                std::vector<int32_t> all(static_cast<size_t>(vis));
                std::iota(all.begin(), all.end(), 0);
                std::shuffle(all.begin(), all.end(), rng_);
                all.resize(static_cast<size_t>(std::min<int64_t>(vis, c.max_comp)));
                std::sort(all.begin(), all.end());
                sel = all;
                for (int32_t r : sel) used[static_cast<size_t>(r)] = 1;
            }
            for (int64_t r = 0; r < c.n_comp_rows; ++r)
                if (!used[static_cast<size_t>(r)]) std::fill_n(comp.begin() + r * d, d, std::nanf(""));
            if (c.mode == cd::comp_mode::all) {
                for (int64_t r = 0; r < c.n_comp_rows; ++r)
                    if (used[static_cast<size_t>(r)])
                        rows_cpu.insert(rows_cpu.end(), comp.begin() + r * d, comp.begin() + (r + 1) * d);
            } else {
                for (int32_t r : sel)
                    rows_cpu.insert(rows_cpu.end(), comp.begin() + r * d, comp.begin() + (r + 1) * d);
            }
        }
        const int64_t n_rows = static_cast<int64_t>(rows_cpu.size()) / d;
        const auto q = randn(static_cast<size_t>(H * d), rng_);
        auto sinks = randn(H, rng_, 1.0f);
        sinks[0] = 6.0f;  // a sink that dominates its head
        const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
        std::vector<float> ref(static_cast<size_t>(H * d));
        ds4::attend_with_sink(q.data(), rows_cpu.data(), n_rows, sinks.data(), H, d, scale, ref.data());
        for (int h = 0; h < H; ++h)
            ds4::rope_apply(ref.data() + static_cast<size_t>(h) * d + d - nr, tab, c.pos, true);

        cd::sparse_attn_args a;
        a.n_head = H;
        a.d = d;
        a.scale = scale;
        a.sinks = up(sinks);
        a.ring_f16 = c.ring_f16;
        a.ring_stride = static_cast<size_t>(d) * (c.ring_f16 ? 2 : 4) + c.ring_pad;
        a.ring = up(pack_rows(ring, d, c.ring_f16, a.ring_stride));
        a.window = W;
        a.mode = c.mode;
        if (c.mode != cd::comp_mode::none) {
            a.comp_f16 = c.comp_f16;
            a.comp_stride = static_cast<size_t>(d) * (c.comp_f16 ? 2 : 4);
            a.comp = up(pack_rows(comp, d, c.comp_f16, a.comp_stride));
            a.ratio = c.ratio;
            a.max_comp = c.max_comp;
        }
        if (c.mode == cd::comp_mode::list) {
            std::vector<int32_t> sel_buf(static_cast<size_t>(c.max_comp),
                                         -1);  // -1 past n_sel: must not be read
            std::copy(sel.begin(), sel.end(), sel_buf.begin());
            a.sel = up(sel_buf);
            a.n_sel = up(std::vector<int32_t>{static_cast<int32_t>(sel.size())});
        }
        a.rope = dev_rope(tab, nr);
        float *part = poisoned(cd::attn_part_floats(a)), *o = poisoned(static_cast<size_t>(H * d));
        set_pos(c.pos);
        cd::launch_sparse_sink_attention(a, up(q), pos_, part, o, s_);
        const auto got = down(o, static_cast<size_t>(H * d));
        const double e = rel_l2(got.data(), ref.data(), got.size());
        const diff dd = compare(got.data(), ref.data(), got.size());
        EXPECT_LE(e, 1e-5);
        EXPECT_LE(dd.worst, 1e-5);
        std::printf("  attention %s pos %lld: %lld rows, rel L2 %.3g, worst %.3g\n", mode,
                    static_cast<long long>(c.pos), static_cast<long long>(n_rows), e, dd.worst);
    }
};

TEST_F(CudaDs4AttnSparse, WindowOnlyMatchesCpu) {
    run({cd::comp_mode::none, true, true, 0, 0, 0, 0});
    run({cd::comp_mode::none, true, true, 0, 0, 0, 37});
    run({cd::comp_mode::none, false, true, 0, 0, 0, 127});
    run({cd::comp_mode::none, false, true, 0, 0, 0, 1000});  // ring wrapped
    run({cd::comp_mode::none, true, true, 0, 0, 0, 1048575});
    run({cd::comp_mode::none, true, true, 0, 0, 0, 300, 2});    // f16 rows 2-byte aligned: element loads
    run({cd::comp_mode::none, false, true, 0, 0, 0, 301, 4});   // f32 rows 4-byte aligned
}

TEST_F(CudaDs4AttnSparse, AllCompressedRowsMatchCpu) {
    run({cd::comp_mode::all, true, true, 128, 8192, 64, 100});        // no compressed row visible yet
    run({cd::comp_mode::all, true, true, 128, 8192, 64, 127});        // the first row, pos < window
    run({cd::comp_mode::all, false, false, 128, 8192, 64, 5000});     // 39 rows, ring wrapped
    run({cd::comp_mode::all, true, true, 128, 8192, 8192, 1048575});  // 8192 rows: every split busy
    run({cd::comp_mode::all, true, false, 4, 1024, 1024, 2050});      // ratio 4 rows, all 512 visible
}

TEST_F(CudaDs4AttnSparse, SelectedRowsMatchCpu) {
    run({cd::comp_mode::list, true, true, 4, 512, 64, 60});        // 15 rows, pos < window
    run({cd::comp_mode::list, false, true, 4, 512, 800, 3000});    // 512 of 750
    run({cd::comp_mode::list, true, false, 4, 512, 4096, 16383});  // 512 of 4096
}

// ---- grouped GEMV, argmax --------------------------------------------------------------------------------

TEST_F(CudaDs4Attn, GemvGroupedMatchesCpu) {
    const int64_t K = 512, rpg = 96;
    const int groups = 8;
    for (dtype t : {dtype::q8_0, dtype::f16}) {
        SCOPED_TRACE(std::string(dtype_name(t)));
        const int64_t rows = rpg * groups;
        const auto wf = randn(static_cast<size_t>(rows * K), rng_, 0.05f);
        const size_t rb = dtype_row_bytes(t, K);
        std::vector<uint8_t> wq(rb * static_cast<size_t>(rows));
        for (int64_t r = 0; r < rows; ++r) cpu::quantize_row(t, wf.data() + r * K, wq.data() + rb * r, K);
        const auto x = randn(static_cast<size_t>(groups * K), rng_);
        const ds4::matrix m{t, wq.data(), rows, K, rb};
        std::vector<float> ref(static_cast<size_t>(rows));
        for (int g = 0; g < groups; ++g)
            ds4::matmul_rows(m, g * rpg, (g + 1) * rpg, x.data() + g * K, 1, ref.data() + g * rpg);
        float *y = poisoned(static_cast<size_t>(rows));
        cd::launch_gemv_grouped(t, up(wq), rb, K, rpg, groups, up(x), y, s_);
        const auto got = down(y, static_cast<size_t>(rows));
        const double e = rel_l2(got.data(), ref.data(), got.size());
        EXPECT_LE(e, 1e-5);
        std::printf("  grouped gemv %s: rel L2 %.3g\n", std::string(dtype_name(t)).c_str(), e);
    }
}

TEST_F(CudaDs4Attn, ArgmaxLowestIndexOnTies) {
    auto host_argmax = [](const std::vector<float> &x) {  // first largest, NaN never wins
        int64_t best = -1;
        for (size_t i = 0; i < x.size(); ++i)
            if (!std::isnan(x[i]) && (best < 0 || x[i] > x[static_cast<size_t>(best)]))
                best = static_cast<int64_t>(i);
        return best < 0 ? 0 : best;
    };
    std::vector<std::vector<float>> cases;
    auto big = randn(129280, rng_, 3.0f);
    for (size_t i : {size_t{90000}, size_t{77}, size_t{5000}, size_t{129279}})
        big[i] = 40.0f;  // ties: 77 wins
    cases.push_back(big);
    auto nan_big = randn(129280, rng_, 3.0f);
    nan_big[12] = std::nanf("");
    nan_big[1000] = 50.0f;
    cases.push_back(nan_big);
    cases.push_back({-1.0f});
    cases.push_back(std::vector<float>(1000, 2.5f));     // all equal: 0
    cases.push_back(std::vector<float>(33, -INFINITY));  // all -inf: 0
    auto last = randn(4097, rng_);
    last.back() = 100.0f;
    cases.push_back(last);
    int32_t *out = dev<int32_t>(1);
    for (size_t k = 0; k < cases.size(); ++k) {
        put(out, std::vector<int32_t>{-5});
        cd::launch_argmax(up(cases[k]), static_cast<int64_t>(cases[k].size()), out, s_);
        EXPECT_EQ(down(out, 1)[0], host_argmax(cases[k])) << "case " << k;
    }
    // Rows form: the first two cases' rows (129280 each) 129290 floats apart, plus a third row of the
    // first with its tie moved: one launch, each row's own answer.
    const int64_t n = 129280, ld = 129290;
    std::vector<float> rows(3 * ld, 1e30f);  // the gaps between rows hold values no row may pick
    std::copy(cases[0].begin(), cases[0].end(), rows.begin());
    std::copy(cases[1].begin(), cases[1].end(), rows.begin() + ld);
    std::vector<float> third = cases[0];
    third[77] = 0.0f;  // 5000 is now the first 40
    std::copy(third.begin(), third.end(), rows.begin() + 2 * ld);
    int32_t *outs = dev<int32_t>(3);
    put(outs, std::vector<int32_t>{-5, -5, -5});
    cd::launch_argmax_rows(up(rows), n, 3, ld, outs, s_);
    EXPECT_EQ(down(outs, 3), (std::vector<int32_t>{77, 1000, 5000}));
    EXPECT_THROW(cd::launch_argmax_rows(up(rows), n, 3, n - 1, outs, s_), error);
}

TEST_F(CudaDs4Attn, RejectsUnsupportedGeometry) {
    cd::sparse_attn_args a;
    a.n_head = 64;
    a.d = 500;  // not a multiple of 32
    a.window = 128;
    EXPECT_THROW(cd::launch_sparse_sink_attention(a, nullptr, pos_, nullptr, nullptr, s_), error);
    cd::rope_args r;
    r.n_rot = 64;
    r.freq = dev<float>(32);
    EXPECT_THROW(
        cd::launch_head_norm_rope(nullptr, 4, 96, true, kEps, r, cd::qat_kind::hadamard_fp4, pos_, s_),
        error);
    cd::compressor_args c;
    c.ratio = 4;
    c.dim = 1024;  // > 512
    EXPECT_THROW(cd::launch_compressor_step(c, nullptr, nullptr, pos_, err_, s_), error);
}

// The attention launchers pick their kernels from current_device_caps (cuda_device.h): its cached values
// must be the device's own attributes, the same entry for every call and thread on the device, and no
// CUDA error may be left behind.
TEST_F(CudaDs4Attn, DeviceCapsMatchDirectQueries) {
    int dev = -1;
    CK(cudaGetDevice(&dev));
    const cuda::device_caps *c = cuda::current_device_caps();
    ASSERT_NE(c, nullptr);
    int sms = 0, major = 0, minor = 0, optin = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    EXPECT_EQ(c->ordinal, dev);
    EXPECT_EQ(c->sm_count, sms);
    EXPECT_EQ(c->cc_major, major);
    EXPECT_EQ(c->cc_minor, minor);
    EXPECT_EQ(c->smem_optin, optin);
    EXPECT_GT(c->sm_count, 0);
    EXPECT_EQ(cuda::current_device_caps(), c);  // cached: the same entry
    const cuda::device_caps *seen[4] = {};
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t)
        ts.emplace_back([&seen, t, dev] {
            if (cudaSetDevice(dev) == cudaSuccess) seen[t] = cuda::current_device_caps();
        });
    for (std::thread &t : ts) t.join();
    for (int t = 0; t < 4; ++t) EXPECT_EQ(seen[t], c) << "thread " << t;
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// ---- CUDA graph replay -----------------------------------------------------------------------------------

// One decode step of a ratio-4 layer whose attention uses every compressed row (query finish, KV
// finish + ring store, compressor, sparse attention) captured once and replayed at positions 0..99
// (the 16-row ring wraps, 24 compressed rows are emitted), against the same launches made eagerly
// on a second set of buffers: identical outputs and state at every step. The graph's attention takes
// the fused-combine path (sparse_attn_args::fused_combine), the eager one the two launches.
TEST_F(CudaDs4Attn, GraphReplayMatchesEagerAtEveryPosition) {
    const int H = 16, d = 512, nr = 64, W = 16, R = 4, width = 2 * d;
    const int64_t max_comp = 32, n_pos = 100;
    const ds4::rope_table tab = yarn_table(nr);
    const cd::rope_args rope = dev_rope(tab, nr);
    const auto norm_w = randn(d, rng_, 0.2f, 1.0f), comp_norm = randn(d, rng_, 0.2f, 1.0f);
    const auto ape = randn(static_cast<size_t>(R * width), rng_, 0.5f), sinks = randn(H, rng_);
    struct step_bufs {
        int64_t *pos;
        float *q, *kv, *ca, *cg, *part, *o;
        void *ring, *rows;
        cd::compressor_args comp;
        cd::sparse_attn_args attn;
    };
    auto make = [&]() {
        step_bufs b;
        b.pos = dev<int64_t>(1);
        b.q = dev<float>(static_cast<size_t>(H * d));
        b.kv = dev<float>(d);
        b.ca = dev<float>(width);
        b.cg = dev<float>(width);
        b.ring = up(std::vector<uint8_t>(static_cast<size_t>(W * d) * 2, 0));
        b.rows = up(std::vector<uint8_t>(static_cast<size_t>(max_comp * d) * 2, 0));
        b.comp.ratio = R;
        b.comp.dim = d;
        b.comp.ape = up(ape);
        b.comp.norm_w = up(comp_norm);
        b.comp.eps = kEps;
        b.comp.rope = rope;
        b.comp.qat = cd::qat_kind::fp8_nope;
        b.comp.slots = 2 * R;  // no rollback slack: the minimum a block reads
        b.comp.state_kv = up(std::vector<float>(static_cast<size_t>(2 * R * width), 0.0f));
        b.comp.state_score = up(std::vector<float>(static_cast<size_t>(2 * R * width), -INFINITY));
        b.comp.rows = b.rows;
        b.comp.rows_f16 = true;
        b.comp.row_stride = static_cast<size_t>(d) * 2;
        b.comp.max_rows = max_comp;
        b.attn.n_head = H;
        b.attn.d = d;
        b.attn.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
        b.attn.sinks = up(sinks);
        b.attn.ring = b.ring;
        b.attn.ring_f16 = true;
        b.attn.ring_stride = static_cast<size_t>(d) * 2;
        b.attn.window = W;
        b.attn.mode = cd::comp_mode::all;
        b.attn.comp = b.rows;
        b.attn.comp_f16 = true;
        b.attn.comp_stride = static_cast<size_t>(d) * 2;
        b.attn.ratio = R;
        b.attn.max_comp = max_comp;
        b.attn.rope = rope;
        b.part = poisoned(cd::attn_part_floats(b.attn));
        b.o = poisoned(static_cast<size_t>(H * d));
        return b;
    };
    step_bufs eager = make(), graph = make();
    // the graph's attention folds the combine into its split kernel (one PDL launch right after the
    // compressor, which writes the rows it reads): the same bits as the eager two launches
    graph.attn.fused_combine = true;
    CK(cudaMemset(graph.part, 0, cd::attn_part_sync_bytes()));  // its counters start at zero
    const float *norm_d = up(norm_w);
    auto enqueue = [&](const step_bufs &b) {
        cd::launch_head_norm_rope(b.q, H, d, true, kEps, rope, cd::qat_kind::none, b.pos, s_);
        cd::launch_kv_finish_store(b.kv, d, norm_d, kEps, rope, cd::qat_kind::fp8_nope, b.ring, true,
                                   static_cast<size_t>(d) * 2, W, b.pos, s_);
        cd::launch_compressor_step(b.comp, b.ca, b.cg, b.pos, err_, s_);
        cd::launch_sparse_sink_attention(b.attn, b.q, b.pos, b.part, b.o, s_);
    };
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    CK(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    enqueue(graph);
    CK(cudaStreamEndCapture(s_, &g));
    CK(cudaGraphInstantiate(&exec, g, 0));
    int compared = 0;
    for (int64_t pos = 0; pos < n_pos; ++pos) {
        const auto q = randn(static_cast<size_t>(H * d), rng_), kv = randn(d, rng_);
        const auto ca = randn(width, rng_), cg = randn(width, rng_);
        for (const step_bufs *b : {&eager, &graph}) {
            CK(cudaMemcpyAsync(b->pos, &pos, sizeof(pos), cudaMemcpyHostToDevice, s_));
            CK(cudaMemcpyAsync(b->q, q.data(), q.size() * 4, cudaMemcpyHostToDevice, s_));
            CK(cudaMemcpyAsync(b->kv, kv.data(), kv.size() * 4, cudaMemcpyHostToDevice, s_));
            CK(cudaMemcpyAsync(b->ca, ca.data(), ca.size() * 4, cudaMemcpyHostToDevice, s_));
            CK(cudaMemcpyAsync(b->cg, cg.data(), cg.size() * 4, cudaMemcpyHostToDevice, s_));
            CK(cudaStreamSynchronize(s_));  // host vectors are pageable and reused
            if (b == &eager)
                enqueue(eager);
            else
                CK(cudaGraphLaunch(exec, s_));
        }
        const auto oe = down(eager.o, static_cast<size_t>(H * d)),
                   og = down(graph.o, static_cast<size_t>(H * d));
        for (float v : oe) ASSERT_TRUE(std::isfinite(v)) << "pos " << pos;
        ASSERT_EQ(std::memcmp(oe.data(), og.data(), oe.size() * 4), 0)
            << "graph output differs at pos " << pos;
        ++compared;
    }
    EXPECT_EQ(down(static_cast<uint8_t *>(eager.ring), static_cast<size_t>(W * d) * 2),
              down(static_cast<uint8_t *>(graph.ring), static_cast<size_t>(W * d) * 2));
    EXPECT_EQ(down(static_cast<uint8_t *>(eager.rows), static_cast<size_t>(max_comp * d) * 2),
              down(static_cast<uint8_t *>(graph.rows), static_cast<size_t>(max_comp * d) * 2));
    EXPECT_EQ(take_err(), 0u);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    std::printf("  graph replay: %d positions identical to eager launches\n", compared);
}

}  // namespace
}  // namespace fathom
