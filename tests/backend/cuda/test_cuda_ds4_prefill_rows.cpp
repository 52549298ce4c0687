// DS4 chunked-prefill element-wise launchers on CUDA (ds4_prefill.h: launch_hc_pre_batch,
// launch_hc_post_batch, launch_head_norm_rope_batch, launch_kv_finish_batch, launch_ring_store_tail,
// launch_compressor_chunk) against the per-token decode launchers (ds4_kernels.h,
// ds4_attn_kernels.h) called token by token at positions *pos + t on identical inputs. The contract is
// bit identity, so every comparison is a memcmp: outputs, in-place rows, ring and row buffers (padding
// and guard rows included), frontier state and error words. Batch outputs are NaN- or 0xFF-poisoned
// first, so an element a kernel fails to write shows up. Per-token positions come from a device array
// of positions (pos + t), so the reference loop needs no host synchronisation. All tests skip without
// a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_attn_kernels.h"
#include "backend/cuda/ds4_kernels.h"
#include "backend/cuda/ds4_prefill.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "models/deepseek4_impl.h"

namespace fathom {
namespace {

namespace cd = cuda::ds4;
using cuda_test::randn;

constexpr float kEps = 1e-6f;

// Whether two host vectors hold the same bytes (sizes equal too).
template <class T>
bool same_bytes(const std::vector<T> &a, const std::vector<T> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Index of the first differing element (or -1), for failure messages.
template <class T>
long first_diff(const std::vector<T> &a, const std::vector<T> &b) {
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<long>(i);
    return a.size() == b.size() ? -1 : static_cast<long>(std::min(a.size(), b.size()));
}

#define EXPECT_SAME(a, b, what) \
    EXPECT_TRUE(same_bytes(a, b)) << what << ": first difference at element " << first_diff(a, b)

const char *qat_name(cd::qat_kind k) {
    return k == cd::qat_kind::none ? "none" : k == cd::qat_kind::fp8_nope ? "fp8" : "hadamard+fp4";
}

struct comp_cfg {
    int ratio, dim, n_rot;
    cd::qat_kind qat;
    bool f16;
};
// A run of the sequence: n tokens by single decode steps, or one chunk of n tokens.
struct seg {
    bool chunk;
    int64_t n;
};

// cuda_fixture plus an error word and a device array of positions; run_comp is the compressor check.
class CudaDs4PrefillRows : public cuda_test::cuda_fixture {
  protected:
    void SetUp() override {
        cuda_fixture::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        err_ = dev<uint32_t>(2);
    }
    // Device positions first, first + 1, ..., first + n - 1.
    int64_t *positions(int64_t first, int64_t n) {
        std::vector<int64_t> v(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
        return up(v);
    }
    cd::rope_args rope(int n_rot, bool yarn) {
        const ds4::rope_table t = yarn ? ds4::rope_yarn(160000.0f, n_rot, 16.0f, 65536, 32.0f, 1.0f)
                                       : ds4::rope_plain(10000.0f, n_rot);
        cd::rope_args r;
        r.freq = up(t.freq);
        r.n_rot = n_rot;
        return r;
    }
    void run_comp(const comp_cfg &c, const std::vector<seg> &sched);
    std::vector<uint8_t> random_bytes(size_t n) {
        std::vector<uint8_t> v(n);
        for (auto &b : v) b = static_cast<uint8_t>(rng_() & 0xFF);
        return v;
    }

    uint32_t *err_ = nullptr;
    std::mt19937 rng_{20261201};
};

// ---- hyper-connections ---------------------------------------------------------------------------------

// HCPre of n_tok tokens in one launch against n_tok decode launches: mix, u, post, comb identical; then
// HCPost on those outputs identical. f32 and f16 mixers, n_hc 4, a DS4-like and an odd width.
TEST_F(CudaDs4PrefillRows, HcPreAndPostBatchMatchDecode) {
    const int n = 4, n_mix = (2 + n) * n;
    for (int64_t D : {int64_t{512}, int64_t{131}}) {
        const int64_t S = n * D;
        for (dtype ft : {dtype::f32, dtype::f16}) {
            const size_t rb = dtype_row_bytes(ft, S);
            const auto fn =
                randn(static_cast<size_t>(n_mix * S), rng_, 4.0f / std::sqrt(static_cast<float>(S)));
            std::vector<uint8_t> fnb(rb * n_mix);
            for (int r = 0; r < n_mix; ++r) cpu::quantize_row(ft, fn.data() + r * S, fnb.data() + r * rb, S);
            const uint8_t *fnd = up(fnb);
            const float *base = up(randn(static_cast<size_t>(n_mix), rng_, 0.5f));
            const float *scale = up(randn(3, rng_, 1.0f));
            const cd::hc_params p{n, D, 20, 1e-6f, 1e-6f};
            for (int64_t T : {int64_t{1}, int64_t{5}, int64_t{64}}) {
                SCOPED_TRACE(std::string(dtype_name(ft)) + " D " + std::to_string(D) + " n_tok " +
                             std::to_string(T));
                const size_t nm = static_cast<size_t>(T) * (n_mix + 1), nu = static_cast<size_t>(T * D),
                             np = static_cast<size_t>(T * n), nc = static_cast<size_t>(T * n * n),
                             nx = static_cast<size_t>(T * S);
                const float *x = up(randn(nx, rng_, 2.0f));
                float *mix_r = poisoned(nm), *u_r = poisoned(nu), *post_r = poisoned(np),
                      *comb_r = poisoned(nc);
                for (int64_t t = 0; t < T; ++t)
                    cd::launch_hc_pre(p, ft, fnd, rb, base, scale, x + t * S, mix_r + t * (n_mix + 1),
                                      u_r + t * D, post_r + t * n, comb_r + t * n * n, s_);
                float *mix_b = poisoned(nm), *u_b = poisoned(nu), *post_b = poisoned(np),
                      *comb_b = poisoned(nc);
                cd::launch_hc_pre_batch(p, ft, fnd, rb, base, scale, x, T, mix_b, u_b, post_b, comb_b, s_);
                EXPECT_SAME(down(mix_b, nm), down(mix_r, nm), "mix");
                EXPECT_SAME(down(u_b, nu), down(u_r, nu), "u");
                EXPECT_SAME(down(post_b, np), down(post_r, np), "post");
                EXPECT_SAME(down(comb_b, nc), down(comb_r, nc), "comb");
                const auto u_host = down(u_r, nu);
                for (float v : u_host) ASSERT_TRUE(std::isfinite(v)) << "reference u not finite";

                const float *y = up(randn(nu, rng_));
                float *xn_r = poisoned(nx), *xn_b = poisoned(nx);
                for (int64_t t = 0; t < T; ++t)
                    cd::launch_hc_post(n, D, y + t * D, x + t * S, post_r + t * n, comb_r + t * n * n,
                                       xn_r + t * S, s_);
                cd::launch_hc_post_batch(n, D, T, y, x, post_r, comb_r, xn_b, s_);
                EXPECT_SAME(down(xn_b, nx), down(xn_r, nx), "hc_post x_new");
            }
        }
    }
}

// ---- query heads ---------------------------------------------------------------------------------------

// Warp-row widths (512, 128) and block-path widths (192, 1024, an odd 100), with and without the norm,
// QAT none / fp8 / hadamard_fp4, chunks starting at several positions.
TEST_F(CudaDs4PrefillRows, HeadNormRopeBatchMatchesDecode) {
    struct cfg {
        int n_head, hd, n_rot;
        bool norm, yarn;
        cd::qat_kind qat;
    };
    const cfg cfgs[] = {{5, 512, 64, true, false, cd::qat_kind::none},
                        {3, 512, 64, false, true, cd::qat_kind::hadamard_fp4},
                        {4, 128, 64, false, true, cd::qat_kind::hadamard_fp4},
                        {3, 192, 64, true, true, cd::qat_kind::fp8_nope},
                        {2, 1024, 64, false, true, cd::qat_kind::hadamard_fp4},
                        {3, 100, 16, true, false, cd::qat_kind::none}};
    for (const cfg &c : cfgs) {
        const cd::rope_args r = rope(c.n_rot, c.yarn);
        for (int64_t first : {int64_t{0}, int64_t{1021}, int64_t{1048560}}) {
            for (int64_t T : {int64_t{1}, int64_t{7}, int64_t{33}}) {
                SCOPED_TRACE(std::to_string(c.n_head) + "x" + std::to_string(c.hd) + " norm " +
                             std::to_string(c.norm) + " qat " + qat_name(c.qat) + " first " +
                             std::to_string(first) + " n_tok " + std::to_string(T));
                const size_t per = static_cast<size_t>(c.n_head) * c.hd, nx = per * static_cast<size_t>(T);
                const auto x = randn(nx, rng_, 3.0f);
                float *xr = up(x), *xb = up(x);
                const int64_t *pos = positions(first, T);
                for (int64_t t = 0; t < T; ++t)
                    cd::launch_head_norm_rope(xr + t * per, c.n_head, c.hd, c.norm, kEps, r, c.qat, pos + t,
                                              s_);
                cd::launch_head_norm_rope_batch(xb, T, c.n_head, c.hd, c.norm, kEps, r, c.qat, pos, s_);
                const auto got = down(xb, nx), ref = down(xr, nx);
                EXPECT_SAME(got, ref, "heads");
                EXPECT_FALSE(same_bytes(got, x)) << "nothing changed";
            }
        }
    }
}

// ---- KV rows and the ring ------------------------------------------------------------------------------

// Chunk rows (and the in-place kv) against the ring rows n_tok decode steps write: the reference ring
// is large enough (window >= first + n_tok) that ring row p is position p. f16 and f32 rows with a
// padded stride (padding must stay 0xFF), QAT none / fp8_nope, warp path (512) and block path (192).
// At d = 512 the decode stores run the split kernel (one 64-dim slice per warp) and the batch of 6 or 45
// the one-warp-per-token kernel: the two must agree bit for bit.
TEST_F(CudaDs4PrefillRows, KvFinishBatchMatchesDecodeRing) {
    const int nr = 64;
    const cd::rope_args r = rope(nr, true);
    for (int d : {512, 192}) {
        const float *norm_w = up(randn(static_cast<size_t>(d), rng_, 0.2f, 1.0f));
        for (bool f16 : {true, false}) {
            for (cd::qat_kind qat : {cd::qat_kind::none, cd::qat_kind::fp8_nope}) {
                for (int64_t T : {int64_t{1}, int64_t{6}, int64_t{45}}) {
                    const int64_t first = 1000;
                    const int W = static_cast<int>(first + T);
                    SCOPED_TRACE("d " + std::to_string(d) + (f16 ? " f16" : " f32") + " qat " +
                                 qat_name(qat) + " n_tok " + std::to_string(T));
                    const size_t elem = f16 ? 2 : 4, row_bytes = static_cast<size_t>(d) * elem,
                                 stride = row_bytes + 48, nkv = static_cast<size_t>(T) * d;
                    const auto kv = randn(nkv, rng_, 2.0f);
                    float *kvr = up(kv), *kvb = up(kv);
                    uint8_t *ring = up(std::vector<uint8_t>(stride * W, 0xFF));
                    uint8_t *rows = up(std::vector<uint8_t>(stride * T, 0xFF));
                    const int64_t *pos = positions(first, T);
                    for (int64_t t = 0; t < T; ++t)
                        cd::launch_kv_finish_store(kvr + t * d, d, norm_w, kEps, r, qat, ring, f16, stride, W,
                                                   pos + t, s_);
                    cd::launch_kv_finish_batch(kvb, T, d, norm_w, kEps, r, qat, rows, f16, stride, pos, s_);
                    EXPECT_SAME(down(kvb, nkv), down(kvr, nkv), "kv in place");
                    const auto ring_h = down(ring, stride * W);
                    const std::vector<uint8_t> expect(ring_h.begin() + static_cast<long>(stride * first),
                                                      ring_h.end());
                    EXPECT_SAME(down(rows, stride * T), expect, "chunk rows (with padding) vs ring rows");
                }
            }
        }
    }
}

// Ring rows after a chunk against a host replay of n_tok ring stores (row p mod window = chunk row of
// p, in order): n_tok below, at and above the window, starts on and off a multiple of it, 2- and
// 4-byte elements, padded strides (bytes past a row's data must stay).
TEST_F(CudaDs4PrefillRows, RingStoreTailMatchesSequentialStores) {
    const int W = 16, d = 40;
    for (int elem : {2, 4}) {
        const size_t row_bytes = static_cast<size_t>(d) * elem, rstride = row_bytes + 8,
                     gstride = row_bytes + 24;
        for (int64_t first : {int64_t{0}, int64_t{7}, int64_t{32}, int64_t{1000003}}) {
            for (int64_t T : {int64_t{1}, int64_t{5}, int64_t{16}, int64_t{40}}) {
                SCOPED_TRACE("elem " + std::to_string(elem) + " first " + std::to_string(first) + " n_tok " +
                             std::to_string(T));
                const auto rows_h = random_bytes(rstride * T);
                auto ring_h = random_bytes(gstride * W);
                const uint8_t *rows = up(rows_h);
                uint8_t *ring = up(ring_h);
                for (int64_t t = 0; t < T; ++t)
                    std::memcpy(ring_h.data() + static_cast<size_t>((first + t) % W) * gstride,
                                rows_h.data() + static_cast<size_t>(t) * rstride, row_bytes);
                const int64_t *pos = positions(first, 1);
                cd::launch_ring_store_tail(rows, rstride, T, d, elem, ring, gstride, W, pos, s_);
                EXPECT_SAME(down(ring, ring_h.size()), ring_h, "ring");
            }
        }
    }
}

// ---- compressor ----------------------------------------------------------------------------------------

// Two compressors from the same empty frontier over the same projections: A by decode steps only, B by
// the schedule's mix of steps and chunks. After every segment B's frontier (kv, scores), row buffer
// (padding and guard rows included) and error word must equal A's. max_rows is one below the rows the
// sequence emits, so the last emitted row is refused (err_comp_row, not written) in both.
void CudaDs4PrefillRows::run_comp(const comp_cfg &c, const std::vector<seg> &sched) {
    int64_t N = 0;
    std::string desc;
    for (const seg &s : sched) {
        N += s.n;
        desc += (s.chunk ? " C" : " s") + std::to_string(s.n);
    }
    SCOPED_TRACE("ratio " + std::to_string(c.ratio) + " dim " + std::to_string(c.dim) + " qat " +
                 qat_name(c.qat) + (c.f16 ? " f16" : " f32") + " schedule" + desc);
    CK(cudaMemset(err_, 0, 2 * sizeof(uint32_t)));  // a previous run's refused row set the bit
    const int R = c.ratio, dp = c.dim;
    const bool overlap = R == 4;
    // position-indexed frontier with the sequences' rollback slack
    const int width = (overlap ? 2 : 1) * dp, slots = (overlap ? 2 * R : R) + static_cast<int>(ds4::max_rollback);
    const int64_t n_rows = N / R;
    const size_t n_state = static_cast<size_t>(slots) * width;
    const size_t stride = static_cast<size_t>(dp) * (c.f16 ? 2 : 4) + 32;
    const size_t rows_bytes = stride * static_cast<size_t>(n_rows + 2);

    cd::compressor_args a;
    a.ratio = R;
    a.dim = dp;
    a.slots = slots;
    a.ape = up(randn(static_cast<size_t>(R) * width, rng_, 0.5f));
    a.norm_w = up(randn(static_cast<size_t>(dp), rng_, 0.2f, 1.0f));
    a.eps = kEps;
    a.rope = rope(c.n_rot, true);
    a.qat = c.qat;
    a.rows_f16 = c.f16;
    a.row_stride = stride;
    a.max_rows = n_rows - 1;
    const std::vector<float> kv0(n_state, 0.0f), sc0(n_state, -INFINITY);
    cd::compressor_args A = a, B = a;
    A.state_kv = up(kv0);
    A.state_score = up(sc0);
    A.rows = up(std::vector<uint8_t>(rows_bytes, 0xFF));
    B.state_kv = up(kv0);
    B.state_score = up(sc0);
    B.rows = up(std::vector<uint8_t>(rows_bytes, 0xFF));
    uint32_t *errA = err_, *errB = err_ + 1;

    // projections of every position (scores spread wide enough that the softmax is not flat)
    const float *ca = up(randn(static_cast<size_t>(N) * width, rng_));
    const float *cg = up(randn(static_cast<size_t>(N) * width, rng_, 2.0f));
    const int64_t *pos = positions(0, N);
    int64_t p = 0;
    for (const seg &s : sched) {
        for (int64_t t = 0; t < s.n; ++t)
            cd::launch_compressor_step(A, ca + (p + t) * width, cg + (p + t) * width, pos + p + t, errA, s_);
        if (s.chunk)
            cd::launch_compressor_chunk(B, ca + p * width, cg + p * width, s.n, pos + p, errB, s_);
        else
            for (int64_t t = 0; t < s.n; ++t)
                cd::launch_compressor_step(B, ca + (p + t) * width, cg + (p + t) * width, pos + p + t, errB,
                                           s_);
        p += s.n;
        SCOPED_TRACE("after position " + std::to_string(p));
        const auto e = down(err_, 2);
        EXPECT_EQ(e[1], e[0]) << "error words";
        EXPECT_EQ(e[0], p / R > a.max_rows ? cd::err_comp_row : 0u) << "reference error word";
        EXPECT_SAME(down(B.state_kv, n_state), down(A.state_kv, n_state), "frontier kv");
        EXPECT_SAME(down(B.state_score, n_state), down(A.state_score, n_state), "frontier scores");
        const auto rb = down(static_cast<uint8_t *>(B.rows), rows_bytes),
                   ra = down(static_cast<uint8_t *>(A.rows), rows_bytes);
        EXPECT_SAME(rb, ra, "emitted rows");
        if (HasFailure()) return;  // one failing segment is enough detail
    }
    // the rows were really written (a sanity check on the reference): row 0 is not all 0xFF
    const auto ra = down(static_cast<uint8_t *>(A.rows), stride);
    if (n_rows >= 2) {
        EXPECT_NE(ra[0] & ra[1] & ra[2] & ra[3], 0xFF);
    }
}

// Schedules: a long chunk from position 0; chunks starting mid-block and at the emitting phase, chunks
// of 1, 3, 4 tokens, long chunks after single steps.
std::vector<std::vector<seg>> schedules(int R) {
    std::vector<std::vector<seg>> v;
    v.push_back({{true, 600}});
    v.push_back(
        {{false, 3}, {true, 130}, {true, 1}, {true, 3}, {true, 4}, {false, 5}, {true, 600}, {true, 3}});
    v.push_back({{false, 1},
                 {true, 1},
                 {true, 1},
                 {true, 1},
                 {true, 1},
                 {true, 2},
                 {true, 7},
                 {false, 2},
                 {true, 130}});
    // reach the emitting phase (p0 mod R = R - 1), then a 1-token chunk that emits, then a partial block
    v.push_back(
        {{false, R - 1}, {true, 1}, {false, R - 1}, {true, 1}, {true, R - 2}, {true, 3}, {true, R + 1}});
    return v;
}

TEST_F(CudaDs4PrefillRows, CompressorRatio4Dim512Fp8) {
    for (const auto &s : schedules(4)) run_comp({4, 512, 64, cd::qat_kind::fp8_nope, true}, s);
}

TEST_F(CudaDs4PrefillRows, CompressorRatio4Dim128HadamardFp4) {
    for (const auto &s : schedules(4)) {
        run_comp({4, 128, 64, cd::qat_kind::hadamard_fp4, true}, s);
        run_comp({4, 128, 64, cd::qat_kind::hadamard_fp4, false}, s);
    }
}

TEST_F(CudaDs4PrefillRows, CompressorRatio4BlockPathAndNoQat) {
    const std::vector<seg> s = {{false, 2}, {true, 130}, {true, 3}, {true, 600}};
    run_comp({4, 192, 64, cd::qat_kind::fp8_nope, true}, s);  // not 64 x 2^k: the row finished block-wide
    run_comp({4, 512, 64, cd::qat_kind::none, false}, s);
}

TEST_F(CudaDs4PrefillRows, CompressorRatio128Dim512) {
    for (const auto &s : schedules(128)) run_comp({128, 512, 64, cd::qat_kind::fp8_nope, true}, s);
    run_comp({128, 512, 64, cd::qat_kind::none, false}, {{false, 100}, {true, 600}, {true, 200}});
    // several blocks in one chunk, starting mid-block
    run_comp({128, 512, 64, cd::qat_kind::fp8_nope, true}, {{false, 60}, {true, 700}});
}

TEST_F(CudaDs4PrefillRows, CompressorSmallRatiosAndWidths) {
    run_comp({8, 64, 16, cd::qat_kind::hadamard_fp4, false}, schedules(8)[1]);
    run_comp({2, 64, 16, cd::qat_kind::none, true}, schedules(2)[1]);
    run_comp({32, 256, 64, cd::qat_kind::fp8_nope, false}, schedules(32)[1]);
}

// The chunk launch at DS4-Flash shapes over 4096 tokens: its rows against the per-token steps.
TEST_F(CudaDs4PrefillRows, CompressorLongChunk) {
    run_comp({4, 512, 64, cd::qat_kind::fp8_nope, true}, {{false, 1}, {true, 4096}});
}

TEST_F(CudaDs4PrefillRows, RejectsBadArguments) {
    cd::compressor_args c;
    EXPECT_THROW(cd::launch_compressor_chunk(c, nullptr, nullptr, 4, nullptr, err_, s_), error);
    const cd::hc_params p{4, 64, 20, 1e-6f, 1e-6f};
    EXPECT_THROW(cd::launch_hc_pre_batch(p, dtype::f32, nullptr, 4 * 64 * 4, nullptr, nullptr, nullptr, 0,
                                         nullptr, nullptr, nullptr, nullptr, s_),
                 error);
    EXPECT_THROW(cd::launch_ring_store_tail(nullptr, 8, 1, 2, 3, nullptr, 8, 4, nullptr, s_), error);
}

}  // namespace
}  // namespace fathom
