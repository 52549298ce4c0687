// Paged KV (src/kv/kv_pool.h, backend::kv_store_paged / attention_paged):
//   - block accounting: growth, sequence ids, exhaustion under a cap, fragmentation, reuse;
//   - block-table mapping: K/V stored through a scattered table read back row by row equal the
//     same values stored in a contiguous cache (bitwise);
//   - attention over a scattered table equals attention over the contiguous cache holding the same
//     K/V, bitwise, in every numerics mode (and both are close to a double-precision reference);
//   - the engine: sessions share one pool, free their blocks, and a session whose blocks are
//     scattered by other sessions gives the same logits as one alone (bitwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "fathom/engine.h"
#include "kv/kv_cache.h"
#include "kv/kv_pool.h"
#include "kv/paged_pool.h"

namespace fathom {
namespace {

std::unique_ptr<backend> cpu(bool exact = false, bool invariant = true) {
    cpu_options o;
    o.n_threads = 2;
    o.exact = exact;
    o.batch_invariant = invariant;
    return make_cpu_backend(o);
}

// ---- accounting ------------------------------------------------------------------------------

TEST(KvBlockPool, GrowthAndSequences) {
    kv_block_pool p(2, 16, 1);
    EXPECT_TRUE(p.reserve(0, 32));
    EXPECT_FALSE(p.reserve(0, 33));  // all or nothing: nothing taken
    EXPECT_EQ(p.held(0), 2);
    p.add_blocks(3);
    EXPECT_EQ(p.n_blocks(), 5);
    EXPECT_EQ(p.n_free(), 3);
    const int s1 = p.add_seq();
    EXPECT_EQ(s1, 1);
    EXPECT_TRUE(p.reserve(s1, 48));
    EXPECT_EQ(p.table(s1), (std::vector<int32_t>{2, 3, 4}));  // the new ids, lowest first
    p.check();
    p.release(0);
    // Freed blocks are handed out before never-used ones.
    p.shrink(s1, 16);
    EXPECT_TRUE(p.reserve(s1, 48));
    EXPECT_EQ(p.n_free(), 2);
    p.check();
    EXPECT_THROW(p.add_blocks(0), error);
}

TEST(KvPool, CapExhaustionAndFree) {
    auto be = cpu();
    kv_pool pool(*be, 2, 1, 16, dtype::f16, 8, 4, 6);  // arenas of 4 blocks, cap 6
    EXPECT_EQ(pool.n_blocks(), 0);                     // nothing allocated before the first use
    const int a = pool.seq_open(), b = pool.seq_open();
    EXPECT_NE(a, b);
    EXPECT_TRUE(pool.reserve(a, 20));  // 3 blocks: one arena of 4
    EXPECT_EQ(pool.n_blocks(), 4);
    EXPECT_EQ(pool.held(a), 3);
    EXPECT_FALSE(pool.reserve(b, 32));  // 4 more would exceed the cap of 6
    EXPECT_EQ(pool.held(b), 0);
    EXPECT_EQ(pool.n_blocks(), 4);     // and nothing was allocated for it
    EXPECT_TRUE(pool.reserve(b, 24));  // 3 blocks: the second arena is cut at the cap
    EXPECT_EQ(pool.n_blocks(), 6);
    EXPECT_EQ(pool.n_used(), 6);
    EXPECT_EQ(pool.n_available(), 0);
    pool.check();
    pool.shrink(a, 8);  // keep one block
    EXPECT_EQ(pool.n_used(), 4);
    pool.seq_close(b);  // closing frees its blocks
    EXPECT_EQ(pool.n_used(), 1);
    const int c = pool.seq_open();  // ids are reused
    EXPECT_EQ(c, b);
    EXPECT_EQ(pool.held(c), 0);
    EXPECT_THROW(pool.configure(16, 4, 0), error);  // a block is still in use
    pool.seq_close(a);
    pool.configure(16, 4, 0);  // now allowed: arenas released
    EXPECT_EQ(pool.n_blocks(), 0);
    EXPECT_EQ(pool.block_tokens(), 16);
    EXPECT_TRUE(pool.reserve(c, 1000));  // no cap: grows arena by arena
    EXPECT_EQ(pool.held(c), 63);
    EXPECT_EQ(pool.n_blocks(), 64);
    pool.check();
    EXPECT_THROW(pool.seq_close(a), error);                             // already closed
    EXPECT_THROW(kv_pool(*be, 2, 1, 16, dtype::f16, 12, 4, 0), error);  // not a power of two
    EXPECT_THROW(kv_pool(*be, 2, 1, 16, dtype::f16, 4, 4, 0), error);   // below 8
}

// Interleaved growth of several sequences scatters each one's blocks over the pool.
TEST(KvPool, FragmentedTablesStayConsistent) {
    auto be = cpu();
    kv_pool pool(*be, 1, 1, 8, dtype::f32, 8, 5, 40);
    std::vector<int> seqs;
    for (int i = 0; i < 4; ++i) seqs.push_back(pool.seq_open());
    std::mt19937 rng(7);
    std::vector<int64_t> len(4, 0);
    for (int step = 0; step < 400; ++step) {
        const int i = int(rng() % 4);
        if (rng() % 5 == 0)
            len[size_t(i)] = int64_t(rng() % (len[size_t(i)] + 1));  // truncate
        else
            len[size_t(i)] += int64_t(rng() % 13);
        if (pool.reserve(seqs[size_t(i)], len[size_t(i)]))
            pool.shrink(seqs[size_t(i)], len[size_t(i)]);
        else
            len[size_t(i)] = pool.held(seqs[size_t(i)]) * 8;  // pool full: keep what it has
        pool.check();
        int64_t used = 0;
        std::vector<int> owner(40, -1);
        for (int s = 0; s < 4; ++s) {
            const auto t = pool.table(seqs[size_t(s)]);
            EXPECT_EQ(int64_t(t.size()), (len[size_t(s)] + 7) / 8);
            for (int32_t blk : t) {
                ASSERT_GE(blk, 0);
                ASSERT_LT(blk, 40);
                EXPECT_EQ(owner[size_t(blk)], -1) << "block " << blk << " in two tables";
                owner[size_t(blk)] = s;
            }
            used += int64_t(t.size());
        }
        EXPECT_EQ(pool.n_used(), used);
        EXPECT_LE(pool.n_blocks(), 40);
    }
}

// ---- K/V through a scattered table vs a contiguous cache ---------------------------------------

struct kv_case {
    int32_t n_layer = 2, n_head = 4, n_head_kv = 2, hd = 64, block = 8;
    dtype type = dtype::f16;
};

// A sequence whose table is scattered: two other sequences grow in turns with it, then release.
struct scattered {
    std::unique_ptr<kv_pool> pool;
    int seq = -1;
    std::vector<uint8_t *> addrs;
    scattered(backend &be, const kv_case &c, int64_t n_pos) {
        pool = std::make_unique<kv_pool>(be, c.n_layer, c.n_head_kv, c.hd, c.type, c.block, 3, 0);
        const int o1 = pool->seq_open();
        seq = pool->seq_open();
        const int o2 = pool->seq_open();
        for (int64_t p = c.block; p < n_pos + c.block; p += c.block) {
            EXPECT_TRUE(pool->reserve(o1, p));
            EXPECT_TRUE(pool->reserve(seq, std::min(p, n_pos)));
            EXPECT_TRUE(pool->reserve(o2, 2 * p));
        }
        pool->seq_close(o1);
        pool->seq_close(o2);
        pool->block_addrs(seq, addrs);
        const auto t = pool->table(seq);
        bool ordered = true;
        for (size_t i = 1; i < t.size(); ++i) ordered = ordered && t[i] == t[i - 1] + 1;
        EXPECT_FALSE(ordered && t.size() > 1) << "table is not scattered";
    }
};

std::vector<float> random_rows(int64_t rows, int64_t cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(-1.5f, 1.5f);
    std::vector<float> v(size_t(rows * cols));
    for (float &x : v) x = d(rng);
    return v;
}

TEST(KvPaged, StoreMapsPositionsLikeAContiguousCache) {
    for (dtype type : {dtype::f16, dtype::f32}) {
        auto be = cpu();
        kv_case c;
        c.type = type;
        const int64_t n_pos = 53, KV = int64_t(c.n_head_kv) * c.hd;
        scattered sc(*be, c, n_pos);
        kv_cache ref(*be, c.n_layer, c.n_head_kv, c.hd, n_pos, type);
        // The sequence's blocks are distinct, non-overlapping ranges of one block's size.
        const size_t block_bytes = size_t(c.n_layer) * 2 * size_t(c.n_head_kv) * size_t(c.block) *
                                   size_t(c.hd) * (type == dtype::f16 ? 2 : 4);
        EXPECT_EQ(sc.pool->block_bytes(), block_bytes);
        for (size_t i = 0; i < sc.addrs.size(); ++i)
            for (size_t j = 0; j < i; ++j) {
                const uint8_t *a = sc.addrs[i], *b = sc.addrs[j];
                EXPECT_GE(size_t(a > b ? a - b : b - a), block_bytes)
                    << "blocks " << i << " and " << j << " overlap";
            }
        for (int32_t l = 0; l < c.n_layer; ++l) {
            // Stored in three calls of different sizes, as prefill chunks and decode steps would.
            std::vector<float> k = random_rows(n_pos, KV, 11 + uint32_t(l)),
                               v = random_rows(n_pos, KV, 99 + uint32_t(l));
            const kv_pages pg = sc.pool->pages(sc.addrs, l);
            for (auto [p0, n] : {std::pair<int64_t, int64_t>{0, 20}, {20, 1}, {21, 32}}) {
                const tensor ks = make_tensor(dtype::f32, KV, n, k.data() + p0 * KV);
                const tensor vs = make_tensor(dtype::f32, KV, n, v.data() + p0 * KV);
                be->kv_store_paged(ks, vs, pg, p0);
                be->kv_store(ks, ref.k[size_t(l)], c.n_head_kv, n_pos, p0);
                be->kv_store(vs, ref.v[size_t(l)], c.n_head_kv, n_pos, p0);
            }
            // Independent address arithmetic: the layout formula of kv_pool.h / docs/kv-cache.md,
            // block [n_layer][K, V][n_head_kv][block][head_dim].
            const size_t rb = size_t(c.hd) * (type == dtype::f16 ? 2 : 4);
            const size_t H = size_t(c.n_head_kv) * size_t(c.block) * rb;
            const size_t k_off = size_t(l) * 2 * H, v_off = k_off + H;
            for (int32_t h = 0; h < c.n_head_kv; ++h)
                for (int64_t p = 0; p < n_pos; ++p) {
                    const uint8_t *blk = sc.addrs[size_t(p / c.block)];
                    const uint8_t *kr = blk + k_off + size_t(h * c.block + p % c.block) * rb;
                    const uint8_t *vr = blk + v_off + size_t(h * c.block + p % c.block) * rb;
                    const uint8_t *kc =
                        static_cast<const uint8_t *>(ref.k[size_t(l)].data) + size_t(h * n_pos + p) * rb;
                    const uint8_t *vc =
                        static_cast<const uint8_t *>(ref.v[size_t(l)].data) + size_t(h * n_pos + p) * rb;
                    ASSERT_EQ(std::memcmp(kr, kc, rb), 0) << "K layer " << l << " head " << h << " pos " << p;
                    ASSERT_EQ(std::memcmp(vr, vc, rb), 0) << "V layer " << l << " head " << h << " pos " << p;
                }
        }
        std::vector<float> row(size_t(KV), 0.5f);
        const tensor one = make_tensor(dtype::f32, KV, 1, row.data());
        const int64_t end = int64_t(sc.addrs.size()) * c.block;
        EXPECT_NO_THROW(
            be->kv_store_paged(one, one, sc.pool->pages(sc.addrs, 0), end - 1));  // last row of the table
        EXPECT_THROW(be->kv_store_paged(one, one, sc.pool->pages(sc.addrs, 0), end),
                     error);  // past the table
    }
}

// IEEE half -> double (written here, independent of the backend's converters).
double half_to_double(uint16_t h) {
    const int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0    ? std::ldexp(double(m), -24)
               : e == 31 ? (m ? NAN : INFINITY)
                         : std::ldexp(double(1024 + m), e - 25);
    return sign ? -v : v;
}

// Double-precision causal attention over the contiguous cache (f16 entries widened exactly).
std::vector<double> reference_attention(const std::vector<float> &q, const kv_cache &kv, int32_t layer,
                                        const attn_params &p, int64_t n_tok) {
    const int64_t hd = p.head_dim, group = p.n_head / p.n_head_kv;
    auto elem = [&](const tensor &t, int64_t row, int64_t i) -> double {
        const uint8_t *r = static_cast<const uint8_t *>(t.data) + size_t(row) * t.nb1;
        if (t.type == dtype::f32) return reinterpret_cast<const float *>(r)[i];
        return half_to_double(reinterpret_cast<const uint16_t *>(r)[i]);
    };
    std::vector<double> out(size_t(n_tok * p.n_head * hd), 0.0);
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t h = 0; h < p.n_head; ++h) {
            const int64_t pos = p.n_past + t,
                          lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
            const int64_t base = (h / group) * p.n_ctx;
            std::vector<double> s(size_t(pos + 1), 0.0);
            double mx = -1e300, sum = 0;
            for (int64_t j = lo; j <= pos; ++j) {
                double d = 0;
                for (int64_t i = 0; i < hd; ++i)
                    d += q[size_t((t * p.n_head + h) * hd + i)] * elem(kv.k[size_t(layer)], base + j, i);
                d *= p.scale;
                if (p.softcap > 0) d = p.softcap * std::tanh(d / p.softcap);
                s[size_t(j)] = d;
                mx = std::max(mx, d);
            }
            for (int64_t j = lo; j <= pos; ++j) sum += (s[size_t(j)] = std::exp(s[size_t(j)] - mx));
            for (int64_t j = lo; j <= pos; ++j)
                for (int64_t i = 0; i < hd; ++i)
                    out[size_t((t * p.n_head + h) * hd + i)] +=
                        s[size_t(j)] / sum * elem(kv.v[size_t(layer)], base + j, i);
        }
    return out;
}

struct attn_case {
    bool exact, invariant;
    dtype type;
    int32_t hd, block;
    int64_t n_past, n_tok;
    int32_t window;
    float softcap;
};

TEST(KvPaged, AttentionOverScatteredTableIsBitIdentical) {
    std::vector<attn_case> cases;
    for (bool exact : {false, true})
        for (bool inv : {true, false})
            for (dtype type : {dtype::f16, dtype::f32})
                for (auto [n_past, n_tok] :
                     {std::pair<int64_t, int64_t>{0, 1}, {0, 37}, {45, 1}, {61, 6}, {100, 13}})
                    for (int32_t window : {0, 20})
                        cases.push_back({exact, inv, type, 64, 8, n_past, n_tok, window, 0.0f});
    // head_dim not a multiple of 16 (the KQV kernel's generic path), 32-token blocks, soft-capping.
    cases.push_back({false, true, dtype::f16, 40, 8, 70, 9, 0, 0.0f});
    cases.push_back({false, true, dtype::f16, 64, 32, 70, 9, 0, 30.0f});
    cases.push_back({false, false, dtype::f16, 64, 16, 90, 1, 33, 0.0f});
    for (const attn_case &ac : cases) {
        SCOPED_TRACE(::testing::Message()
                     << "exact " << ac.exact << " invariant " << ac.invariant << " f16 "
                     << (ac.type == dtype::f16) << " hd " << ac.hd << " block " << ac.block << " n_past "
                     << ac.n_past << " n_tok " << ac.n_tok << " window " << ac.window);
        auto be = cpu(ac.exact, ac.invariant);
        kv_case c;
        c.n_layer = 1;
        c.type = ac.type;
        c.hd = ac.hd;
        c.block = ac.block;
        const int64_t n_pos = ac.n_past + ac.n_tok, KV = int64_t(c.n_head_kv) * c.hd,
                      Q = int64_t(c.n_head) * c.hd;
        scattered sc(*be, c, n_pos);
        kv_cache ref(*be, 1, c.n_head_kv, c.hd, n_pos, ac.type);
        const std::vector<float> k = random_rows(n_pos, KV, 5), v = random_rows(n_pos, KV, 6),
                                 q = random_rows(ac.n_tok, Q, 7);
        const kv_pages pg = sc.pool->pages(sc.addrs, 0);
        be->kv_store_paged(make_tensor(dtype::f32, KV, n_pos, const_cast<float *>(k.data())),
                           make_tensor(dtype::f32, KV, n_pos, const_cast<float *>(v.data())), pg, 0);
        be->kv_store(make_tensor(dtype::f32, KV, n_pos, const_cast<float *>(k.data())), ref.k[0], c.n_head_kv,
                     n_pos, 0);
        be->kv_store(make_tensor(dtype::f32, KV, n_pos, const_cast<float *>(v.data())), ref.v[0], c.n_head_kv,
                     n_pos, 0);
        attn_params p;
        p.n_head = c.n_head;
        p.n_head_kv = c.n_head_kv;
        p.head_dim = c.hd;
        p.n_ctx = n_pos;
        p.n_past = ac.n_past;
        p.scale = 1.0f / std::sqrt(float(c.hd));
        p.softcap = ac.softcap;
        p.window = ac.window;
        std::vector<float> o_paged(size_t(ac.n_tok * Q), std::nanf("")),
            o_cont(size_t(ac.n_tok * Q), -7.0f);  // poisoned
        const tensor qt = make_tensor(dtype::f32, Q, ac.n_tok, const_cast<float *>(q.data()));
        be->attention_paged(qt, pg, p, make_tensor(dtype::f32, Q, ac.n_tok, o_paged.data()));
        be->attention(qt, ref.k[0], ref.v[0], p, make_tensor(dtype::f32, Q, ac.n_tok, o_cont.data()));
        ASSERT_EQ(std::memcmp(o_paged.data(), o_cont.data(), o_paged.size() * sizeof(float)), 0);
        const std::vector<double> want = reference_attention(q, ref, 0, p, ac.n_tok);
        // f16 fast mode rounds q and the probabilities through f16: a loose bound; exact/f32 tight.
        const double tol = ac.type == dtype::f32 && ac.exact ? 1e-5 : 2e-2;
        for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(o_paged[i], want[i], tol) << "element " << i;
    }
}

// Batched decode attention (backend::attention_paged_rows): one token per sequence, each at its
// own position in its own (interleaved, so scattered) table. Every row must equal a separate
// attention_paged call bit for bit, in every numerics mode, and be close to the double reference.
// Head layouts: GQA groups of 2 (the default), 3 (SmolLM2's 9 / 3) and 6 (more query heads per KV head
// than the batched kernel takes at once: its items split the group 4 + 2).
TEST(KvPaged, BatchedRowsEqualPerSequenceCalls) {
    const int64_t past[] = {0, 7, 8, 45, 90, 31};  // block boundaries, first position, longer rows
    const size_t n = std::size(past);
    for (auto [n_head, n_head_kv] : {std::pair{4, 2}, std::pair{9, 3}, std::pair{12, 2}})
        for (bool exact : {false, true})
            for (bool inv : {true, false})
                for (dtype type : {dtype::f16, dtype::f32})
                    for (auto [window, softcap] :
                         {std::pair<int32_t, float>{0, 0.0f}, {20, 0.0f}, {0, 30.0f}}) {
                        SCOPED_TRACE(::testing::Message()
                                     << n_head << " / " << n_head_kv << " heads, exact " << exact
                                     << " invariant " << inv << " f16 " << (type == dtype::f16) << " window "
                                     << window << " softcap " << softcap);
                        auto be = cpu(exact, inv);
                        kv_case c;
                        c.n_layer = 1;
                        c.type = type;
                        c.n_head = n_head;
                        c.n_head_kv = n_head_kv;
                        const int64_t KV = int64_t(c.n_head_kv) * c.hd, Q = int64_t(c.n_head) * c.hd;
                        kv_pool pool(*be, 1, c.n_head_kv, c.hd, type, c.block, 4, 0);
                        std::vector<int> seq(n);
                        for (size_t i = 0; i < n; ++i) seq[i] = pool.seq_open();
                        for (int64_t p = c.block; p <= 91 + c.block;
                             p += c.block)  // grow in turns: tables interleave
                            for (size_t i = 0; i < n; ++i)
                                ASSERT_TRUE(pool.reserve(seq[i], std::min(p, past[i] + 1)));
                        std::vector<std::vector<uint8_t *>> addrs(n);
                        std::vector<kv_pages> pages(n);
                        std::vector<std::unique_ptr<kv_cache>> refs;
                        for (size_t i = 0; i < n; ++i) {
                            const int64_t n_pos = past[i] + 1;
                            pool.block_addrs(seq[i], addrs[i]);
                            pages[i] = pool.pages(addrs[i], 0);
                            const std::vector<float> k = random_rows(n_pos, KV, 20 + uint32_t(i)),
                                                     v = random_rows(n_pos, KV, 40 + uint32_t(i));
                            const tensor kt =
                                make_tensor(dtype::f32, KV, n_pos, const_cast<float *>(k.data()));
                            const tensor vt =
                                make_tensor(dtype::f32, KV, n_pos, const_cast<float *>(v.data()));
                            be->kv_store_paged(kt, vt, pages[i], 0);
                            refs.push_back(
                                std::make_unique<kv_cache>(*be, 1, c.n_head_kv, c.hd, n_pos, type));
                            be->kv_store(kt, refs.back()->k[0], c.n_head_kv, n_pos, 0);
                            be->kv_store(vt, refs.back()->v[0], c.n_head_kv, n_pos, 0);
                        }
                        attn_params p;
                        p.n_head = c.n_head;
                        p.n_head_kv = c.n_head_kv;
                        p.head_dim = c.hd;
                        p.n_past = 12345;  // ignored: positions come per row
                        p.scale = 1.0f / std::sqrt(float(c.hd));
                        p.softcap = softcap;
                        p.window = window;
                        const std::vector<float> q = random_rows(int64_t(n), Q, 77);
                        const tensor qt =
                            make_tensor(dtype::f32, Q, int64_t(n), const_cast<float *>(q.data()));
                        std::vector<float> got(n * size_t(Q), std::nanf("")),
                            want(n * size_t(Q), -7.0f);  // poisoned
                        be->attention_paged_rows(qt, pages, std::vector<int64_t>(past, past + n), p,
                                                 make_tensor(dtype::f32, Q, int64_t(n), got.data()));
                        for (size_t i = 0; i < n; ++i) {
                            attn_params pi = p;
                            pi.n_past = past[i];
                            be->attention_paged(view_rows(qt, int64_t(i), 1), pages[i], pi,
                                                make_tensor(dtype::f32, Q, 1, want.data() + i * size_t(Q)));
                            ASSERT_EQ(std::memcmp(got.data() + i * size_t(Q), want.data() + i * size_t(Q),
                                                  size_t(Q) * sizeof(float)),
                                      0)
                                << "row " << i << " (position " << past[i] << ")";
                            pi.n_ctx = past[i] + 1;
                            const std::vector<float> qi(q.begin() + std::ptrdiff_t(i) * Q,
                                                        q.begin() + std::ptrdiff_t(i + 1) * Q);
                            const std::vector<double> ref = reference_attention(qi, *refs[i], 0, pi, 1);
                            const double tol = type == dtype::f32 && exact ? 1e-5 : 2e-2;
                            for (int64_t e = 0; e < Q; ++e)
                                ASSERT_NEAR(got[i * size_t(Q) + size_t(e)], ref[size_t(e)], tol)
                                    << "row " << i;
                        }
                        // Mismatched counts are rejected.
                        EXPECT_THROW(
                            be->attention_paged_rows(qt, std::span<const kv_pages>(pages.data(), n - 1),
                                                     std::vector<int64_t>(past, past + n), p,
                                                     make_tensor(dtype::f32, Q, int64_t(n), got.data())),
                            error);
                    }
}

// ---- the engine: one pool shared by its sessions ----------------------------------------------

std::string smollm2() {
    const std::string p = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    return std::filesystem::exists(p) ? p : std::string();
}

TEST(KvEngine, SessionsShareOnePoolAndScatteredBlocksGiveTheSameLogits) {
    const std::string path = smollm2();
    if (path.empty()) GTEST_SKIP() << "models/SmolLM2-135M-Instruct.Q4_1.gguf not installed";
    engine_options o;
    o.model_path = path;
    o.n_threads = 2;
    o.n_ctx = 256;
    o.n_batch = 16;
    auto eng = engine::load(o);
    ASSERT_TRUE(eng->kv_pool_configure(16, 64));
    EXPECT_EQ(eng->kv_pool().block_tokens, 16);
    EXPECT_EQ(eng->kv_pool().max_blocks, 64);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 70; ++i) prompt.push_back(int32_t(100 + (i * 37) % 5000));

    // Alone: a contiguous run of blocks.
    std::vector<float> alone;
    {
        auto s = eng->new_session();
        s->sync(prompt);
        alone.assign(s->logits().begin(), s->logits().end());
        EXPECT_EQ(s->kv_blocks(), 5);  // ceil(70 / 16)
        EXPECT_EQ(eng->kv_pool().n_used, 5);
    }
    EXPECT_EQ(eng->kv_pool().n_used, 0);  // a destroyed session gives its blocks back

    // Interleaved with another session chunk by chunk: each one's table alternates blocks.
    auto a = eng->new_session(), b = eng->new_session();
    std::vector<int32_t> other(prompt.rbegin(), prompt.rend());
    for (size_t end = 16; end <= 80; end += 16) {
        a->sync(std::span<const int32_t>(prompt.data(), std::min<size_t>(end, prompt.size())));
        b->sync(std::span<const int32_t>(other.data(), std::min<size_t>(end, other.size())));
    }
    ASSERT_EQ(a->n_past(), 70);
    EXPECT_EQ(eng->kv_pool().n_used, 10);
    ASSERT_EQ(a->logits().size(), alone.size());
    EXPECT_EQ(std::memcmp(a->logits().data(), alone.data(), alone.size() * sizeof(float)), 0);

    // Decoding through the batched step reads the scattered tables too.
    auto c = eng->new_session();
    c->sync(prompt);
    std::vector<session *> ss = {a.get(), b.get()};
    const std::vector<int32_t> next = {42, 43};
    eng->decode_step(ss, next);
    c->eval(std::span<const int32_t>(next.data(), 1));
    EXPECT_EQ(std::memcmp(a->logits().data(), c->logits().data(), alone.size() * sizeof(float)), 0);

    // Reservation, truncation and reset free exactly the blocks beyond what is held.
    const int64_t used0 = eng->kv_pool().n_used;
    EXPECT_TRUE(a->kv_reserve(160));  // 71 held -> 10 blocks
    EXPECT_EQ(a->kv_blocks(), 10);
    EXPECT_EQ(eng->kv_pool().n_used, used0 + 5);
    a->truncate(20);  // the reservation stays
    EXPECT_EQ(a->n_past(), 20);
    EXPECT_EQ(a->kv_blocks(), 10);
    EXPECT_TRUE(a->kv_reserve(0));  // drop it: blocks for the 20 held tokens remain
    EXPECT_EQ(a->kv_blocks(), 2);
    EXPECT_FALSE(a->kv_reserve(64 * 16));  // more than the cap leaves: nothing changes
    EXPECT_EQ(a->kv_blocks(), 2);
    a->reset();
    EXPECT_EQ(a->kv_blocks(), 0);
    EXPECT_THROW(eng->kv_pool_configure(16, 8), error);  // sessions still hold blocks

    // The cap is enforced on evaluation: a session cannot grow past it.
    b->reset();
    c->reset();
    auto big = eng->new_session();
    std::vector<int32_t> longp(255, 200);
    ASSERT_TRUE(eng->kv_pool_configure(16, 8));  // 128 positions
    EXPECT_THROW(big->sync(longp), error);
    big->reset();
    EXPECT_EQ(eng->kv_pool().n_used, 0);
}

}  // namespace
}  // namespace fathom
