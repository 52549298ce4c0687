// Paged DS4 state on the device (backend/cuda/cuda_vmm.h, ds4::cuda_make_state_pool): physical blocks of
// one pool mapped behind each sequence's reserved row ranges as it grows.
//  - the block pool / regions alone: data written across block boundaries reads back (the blocks of a
//    region are one contiguous range), grow() is all or nothing at the capacity, shrink() and the
//    destructor give blocks back, and given-back blocks are reused;
//  - DS4 sequences on a shared pool against sequences that own their rows (the reference: the unpaged
//    allocation every other test checks against the CPU), bit for bit: a chunked prefill, decode steps,
//    multi-row steps of several paged sequences, rollback, a saved state loaded into a paged sequence;
//  - the pool exhausted: the evaluation that cannot map its rows throws a clear error before anything
//    runs, the sequence and its neighbours are unchanged, and a reset() of a neighbour frees the blocks;
//  - reserve(): grows all or nothing, shrinks to what is held, and the pool's count follows.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_vmm.h"
#include "cache/cache_test_util.h"
#include "core/error.h"
#include "backend/cuda/cuda_test_util.h"
#include "ds4_host_util.h"
#include "models/cuda/deepseek4_cuda.h"
#include "models/deepseek4.h"

namespace fathom {
namespace {

using cuda_test::tokens_of;
using CudaVmm = cuda_test::cuda_device_test;
using CudaDs4Paged = cuda_test::cuda_device_test;

const std::string &model_path() {
    static const std::string path = cuda_test::write_quant_tiny_model("fathom_cuda_ds4_paged_q2.gguf");
    return path;
}

bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_F(CudaVmm, RegionsAreContiguousAllOrNothingAndReuseBlocks) {
    auto pool = std::make_shared<cuda::block_pool>(0, 0);  // rounded up to one block
    const size_t B = pool->block_bytes();
    ASSERT_GE(B, size_t{4096});
    pool = std::make_shared<cuda::block_pool>(0, 5 * B);
    ASSERT_EQ(pool->capacity(), 5);
    {
        cuda::vm_regions r(pool);
        auto *a = static_cast<uint8_t *>(r.add(3 * B + 1));  // 4 blocks reserved
        auto *b = static_cast<uint8_t *>(r.add(2 * B));
        EXPECT_EQ(r.mapped_bytes(), 0u);
        // 3 blocks of a and 1 of b: 4 of 5
        ASSERT_TRUE(r.grow(std::vector<size_t>{2 * B + 7, 1}));
        EXPECT_EQ(pool->used(), 4);
        EXPECT_EQ(r.mapped_bytes(), 4 * B);
        // 2 more are needed, 1 is left: nothing changes
        EXPECT_EQ(r.blocks_needed(std::vector<size_t>{4 * B, 2 * B}), 2);
        EXPECT_FALSE(r.grow(std::vector<size_t>{4 * B, 2 * B}));
        EXPECT_EQ(pool->used(), 4);
        EXPECT_EQ(r.mapped_bytes(), 4 * B);
        // a pattern across both block boundaries of a reads back whole
        std::vector<uint8_t> pat(3 * B);
        for (size_t i = 0; i < pat.size(); ++i) pat[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
        ASSERT_EQ(cudaMemcpy(a, pat.data(), pat.size(), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemset(b, 0x5a, B), cudaSuccess);
        std::vector<uint8_t> back(pat.size());
        ASSERT_EQ(cudaMemcpy(back.data(), a, back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(back, pat);
        // shrink a to one block: 2 back; the freed blocks serve b's growth
        r.shrink(std::vector<size_t>{1, 2 * B});
        EXPECT_EQ(pool->used(), 2);
        ASSERT_TRUE(r.grow(std::vector<size_t>{B, 2 * B}));
        EXPECT_EQ(pool->used(), 3);
        ASSERT_EQ(cudaMemcpy(back.data(), a, B, cudaMemcpyDeviceToHost), cudaSuccess);  // a's first block kept its data
        EXPECT_EQ(0, std::memcmp(back.data(), pat.data(), B));
        std::vector<uint8_t> bb(B);
        ASSERT_EQ(cudaMemcpy(bb.data(), b, B, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(bb, std::vector<uint8_t>(B, 0x5a));
        // a second owner takes the rest
        cuda::vm_regions r2(pool);
        r2.add(4 * B);
        EXPECT_FALSE(r2.grow(std::vector<size_t>{3 * B}));
        ASSERT_TRUE(r2.grow(std::vector<size_t>{2 * B}));
        EXPECT_EQ(pool->used(), 5);
    }
    EXPECT_EQ(pool->used(), 0);  // destructors gave every block back
    EXPECT_THROW(cuda::vm_regions(nullptr), error);
}

TEST_F(CudaDs4Paged, SequencesOnASharedPoolEqualOwnRowsBitForBit) {
    auto m = ds4::load_model(model_path());
    const size_t V = static_cast<size_t>(m->hp.n_vocab);
    const int64_t n_ctx = 1024;
    const auto w = ds4::cuda_upload(*m, {});
    auto pool = ds4::cuda_make_state_pool(*w);
    ds4::cuda_sequence ref(w, n_ctx, true, 64), own2(w, n_ctx, true, 64);
    ds4::cuda_sequence a(w, n_ctx, true, 64, {}, pool), b(w, n_ctx, true, 64, {}, pool);
    ASSERT_TRUE(a.paged());
    ASSERT_FALSE(ref.paged());
    EXPECT_EQ(a.row_bytes(), 0u);
    EXPECT_EQ(pool->used(), 0);
    const auto toks = tokens_of(700, m->hp.n_vocab, 5), other = tokens_of(300, m->hp.n_vocab, 9);
    const std::span<const int32_t> prompt(toks.data(), 600);
    std::vector<float> lr(V), la(V);
    ref.eval(prompt, lr);
    a.eval(prompt, la);
    ASSERT_TRUE(same_bits(lr, la)) << "chunked prefill";
    EXPECT_GT(a.row_bytes(), 0u);
    EXPECT_EQ(static_cast<int64_t>(a.row_bytes()), pool->used() * static_cast<int64_t>(pool->block_bytes()));
    own2.eval(std::span<const int32_t>(other.data(), 200), {});
    b.eval(std::span<const int32_t>(other.data(), 200), {});
    // multi-row steps of both paged sequences (3 + 2 rows), against their unpaged twins
    for (int step = 0; step < 20; ++step) {
        const size_t i = 600 + 3 * static_cast<size_t>(step) % 90, j = 200 + 2 * static_cast<size_t>(step);
        std::vector<int32_t> rows = {toks[i], toks[i + 1], toks[i + 2], other[j], other[j + 1]};
        ds4::cuda_sequence *paged[] = {&a, &b}, *own[] = {&ref, &own2};
        const int counts[] = {3, 2};
        std::vector<float> lp(5 * V), lo(5 * V);
        ds4::cuda_sequence::step_batch(paged, counts, rows, lp);
        ds4::cuda_sequence::step_batch(own, counts, rows, lo);
        ASSERT_TRUE(same_bits(lp, lo)) << "step " << step;
        // reject the last row of a (rollback), keep b's
        a.truncate(a.n_past() - 1);
        ref.truncate(ref.n_past() - 1);
    }
    // decode steps and a saved state loaded into a fresh paged sequence
    std::vector<float> lr2(V), la2(V);
    ref.eval(std::span<const int32_t>(toks.data() + 650, 1), lr2);
    a.eval(std::span<const int32_t>(toks.data() + 650, 1), la2);
    ASSERT_TRUE(same_bits(lr2, la2));
    cache_test::vector_writer wr;
    a.save_state(wr);
    ds4::cuda_sequence c(w, n_ctx, true, 64, {}, pool);
    cache_test::vector_reader rd(wr.bytes);
    c.load_state(rd, a.n_past());
    EXPECT_GT(c.row_bytes(), 0u);
    for (size_t k = 0; k < 40; ++k) {
        const std::span<const int32_t> t(toks.data() + 660 + k, 1);
        ref.eval(t, lr);
        c.eval(t, la);
        ASSERT_TRUE(same_bits(lr, la)) << "after load, token " << k;
    }
}

TEST_F(CudaDs4Paged, ExhaustedPoolFailsCleanlyAndResetFreesBlocks) {
    auto m = ds4::load_model(model_path());
    const size_t V = static_cast<size_t>(m->hp.n_vocab);
    const auto w = ds4::cuda_upload(*m, {});
    // The tiny model has 3 compressed layers (ratios 4, 128, 4): 3 row regions (the ratio-4 layers'
    // compressed rows, the ratio-128 layer's, the ratio-4 layers' indexer rows, each interleaved over its
    // layers). A region maps the rows its positions complete (n / ratio), no spare row: 3 tokens map
    // nothing, 4 map a block in each ratio-4 region, 128 one in each region (256 tokens of the tiny
    // model fit one block per region).
    auto probe = ds4::cuda_make_state_pool(*w);
    const int64_t per_seq = [&] {
        ds4::cuda_sequence s(w, 256, true, 0, {}, probe);
        EXPECT_TRUE(s.reserve(3));
        EXPECT_EQ(probe->used(), 0);
        EXPECT_TRUE(s.reserve(4));
        EXPECT_EQ(probe->used(), 2);
        EXPECT_TRUE(s.reserve(127));
        EXPECT_EQ(probe->used(), 2);
        EXPECT_TRUE(s.reserve(128));
        return probe->used();
    }();
    ASSERT_EQ(per_seq, 3);
    ASSERT_EQ(per_seq, ds4::cuda_row_regions(m->hp));
    EXPECT_EQ(probe->used(), 0);
    auto pool = ds4::cuda_make_state_pool(*w, static_cast<size_t>(per_seq) * probe->block_bytes());
    ds4::cuda_sequence a(w, 256, true, 0, {}, pool), b(w, 256, true, 0, {}, pool), ref(w, 256, true, 0);
    const auto toks = tokens_of(256, m->hp.n_vocab, 3);
    std::vector<float> la(V), lr(V);
    const std::span<const int32_t> prompt(toks.data(), 128);
    a.eval(prompt, la);
    ref.eval(prompt, lr);
    ASSERT_TRUE(same_bits(la, lr));
    EXPECT_EQ(pool->used(), per_seq);
    // b's first 3 tokens complete no row; its 4th needs a block the pool no longer has
    b.eval(std::span<const int32_t>(toks.data(), 3), {});
    EXPECT_EQ(b.n_past(), 3);
    try {
        b.eval(std::span<const int32_t>(toks.data() + 3, 1), {});
        FAIL() << "expected the pool to be exhausted";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("state pool is exhausted"), std::string::npos) << e.what();
    }
    EXPECT_EQ(b.n_past(), 3);
    EXPECT_FALSE(b.reserve(10));
    // a batched step naming b fails before anything runs: a is unchanged
    ds4::cuda_sequence *both[] = {&a, &b};
    const int counts[] = {1, 2};
    EXPECT_THROW(ds4::cuda_sequence::step_batch(both, counts, std::vector<int32_t>{toks[128], toks[3], toks[4]}, {}), error);
    EXPECT_EQ(a.n_past(), 128);
    EXPECT_EQ(b.n_past(), 3);
    for (size_t k = 128; k < 168; ++k) {
        a.eval(std::span<const int32_t>(toks.data() + k, 1), la);
        ref.eval(std::span<const int32_t>(toks.data() + k, 1), lr);
        ASSERT_TRUE(same_bits(la, lr)) << "a after b's failures, token " << k;
    }
    // reserve shrinks to what is held, never below
    EXPECT_TRUE(a.reserve(0));
    EXPECT_EQ(pool->used(), per_seq);
    a.reset();
    EXPECT_EQ(pool->used(), 0);
    EXPECT_EQ(a.row_bytes(), 0u);
    EXPECT_TRUE(b.reserve(100));  // b's 3 tokens held; 100 map the ratio-4 regions
    EXPECT_EQ(pool->used(), 2);
    EXPECT_TRUE(b.reserve(200));
    EXPECT_EQ(pool->used(), per_seq);
    b.eval(std::span<const int32_t>(toks.data() + 3, 1), {});
    EXPECT_EQ(b.n_past(), 4);
}

}  // namespace
}  // namespace fathom
