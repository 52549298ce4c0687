// Placement planner (src/dist/planner.*). Expected numbers are computed here from the spec's tensor
// shapes (ds4-architecture.md sections 4 and 9) and the DS4 KV layout, written out per layer kind,
// never through the planner's own functions: the tiny synthetic geometry read from a real GGUF, and
// the DeepSeek-V4-Flash full geometry (q2 mix and 4-bit experts) from a tensor directory, on
// 2 x 141 GiB with a 128K context.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <memory>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "dist/planner.h"
#include "gguf/gguf.h"
#include "models/deepseek4_synth.h"

namespace {

using namespace fathom;
using u64 = uint64_t;
constexpr u64 GiB = u64{1} << 30;

// ---- independent expectations ----------------------------------------------------------------------

// Pipeline choice by brute force over every split point (two devices): minimise the larger of
// used/free; the planner must pick the same split and report the same bytes.
struct two_way {
    int cut = -1;  // device 0 holds blocks [0, cut)
    u64 used0 = 0, used1 = 0;
};
two_way brute_force_2(const std::vector<u64> &block, u64 first_extra, u64 last_extra, u64 reserve, u64 free0,
                      u64 free1) {
    two_way best;
    double best_ratio = std::numeric_limits<double>::infinity();
    const int L = static_cast<int>(block.size());
    for (int cut = 1; cut < L; ++cut) {
        u64 a = first_extra + reserve, b = last_extra + reserve;
        for (int i = 0; i < L; ++i) (i < cut ? a : b) += block[static_cast<size_t>(i)];
        const double r = std::max(static_cast<double>(a) / free0, static_cast<double>(b) / free1);
        if (r < best_ratio) best_ratio = r, best = {cut, a, b};
    }
    return best;
}

// ---- tiny synthetic geometry (synth preset "tiny", every tensor f32) -----------------------------------

// Bytes of block il of the tiny geometry, from the shapes: D 128, n_hc 4 (HC width 512, 24 mixes),
// H 4, d 192, q_lora 64, G 2 x r 32, E 8 (2 used, 1 shared), F 48, indexer 16 heads x 128,
// vocab 512; ratios 0,0,4,128,4,128; hash routing on blocks 0..2.
u64 tiny_block_bytes(int il) {
    const int ratio[6] = {0, 0, 4, 128, 4, 128};
    u64 e = 2 * 128                              // attn_norm, ffn_norm
            + 2 * (512 * 24 + 24 + 3)            // hc_attn, hc_ffn: fn, base, scale
            + 4                                  // sinks
            + 128 * 64 + 64                      // q_a, q_a_norm
            + 64 * (4 * 192)                     // q_b
            + 128 * 192 + 192                    // kv, kv_norm
            + (2 * 192) * (2 * 32)               // output_a: (H/G) d -> G r
            + (2 * 32) * 128                     // output_b
            + 128 * 8                            // router
            + 3 * 128 * 48 * 8                   // routed experts gate, up, down
            + 3 * 128 * 48;                      // shared expert
    e += il < 3 ? 2 * 512 : 8;                   // tid2eid (i32) or router bias
    if (ratio[il] == 4)
        e += 4 * 384 + 2 * 128 * 384 + 192       // attention compressor (overlap: width 2d)
             + 64 * (16 * 128) + 128 * 16        // indexer q_b, proj
             + 4 * 256 + 2 * 128 * 256 + 128;    // indexer compressor (width 2 x 128)
    if (ratio[il] == 128) e += 128 * 192 + 2 * 128 * 192 + 192;
    return 4 * e;
}

// KV + compressor frontier bytes of block il for n tokens, f32 rows: ring 32 x 192; ratio 4: n/4 rows
// of 192 and n/4 indexer rows of 128, frontiers 8 slots x (2 x width) floats (kv + score);
// ratio 128: n/128 rows of 192, frontier 128 slots x 192 x 2.
u64 tiny_kv_bytes(int il, u64 n) {
    const int ratio[6] = {0, 0, 4, 128, 4, 128};
    u64 b = 32 * 192 * 4;
    if (ratio[il] == 4) b += (n / 4) * 192 * 4 + 8 * 384 * 2 * 4 + (n / 4) * 128 * 4 + 8 * 256 * 2 * 4;
    if (ratio[il] == 128) b += (n / 128) * 192 * 4 + 128 * 192 * 2 * 4;
    return b;
}

// Documented activation estimate (planner.h) for the tiny geometry: chunk tokens, n context.
u64 tiny_activation(u64 chunk, u64 n) {
    const u64 per_token = 2 * 512 + 2 * 4 * 192 + 2 * 32 + 4 * 128 + 3 * 48 * (2 + 1) + 4 * (32 + 16 + n / 128) + n / 4;
    return 4 * (chunk * per_token + 512);
}

// The tiny geometry as a real GGUF (per-process file, unlinked once mapped).
const gguf::file &tiny_file() {
    static const std::unique_ptr<gguf::file> f = [] {
        const std::string path = (std::filesystem::temp_directory_path() /
                                  ("dist_planner_tiny_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::synth_options o;
        o.mix = "f32";
        ds4::synth_write(path, ds4::synth_preset("tiny"), o);
        auto opened = gguf::file::open(path);
        std::filesystem::remove(path);
        return opened;
    }();
    return *f;
}

TEST(dist_planner, tiny_inventory_from_gguf) {
    const auto inv = dist::inventory_from_gguf(tiny_file());
    ASSERT_EQ(inv.layer.size(), 6u);
    for (int il = 0; il < 6; ++il) EXPECT_EQ(inv.layer[static_cast<size_t>(il)], tiny_block_bytes(il)) << il;
    EXPECT_EQ(inv.embed, u64{4} * 512 * 128);
    EXPECT_EQ(inv.output, u64{4} * 512 * 128);
    EXPECT_EQ(inv.head, u64{4} * (128 + 512 * 4 + 4 + 1));  // output_norm, output_hc fn/base/scale
    EXPECT_EQ(inv.experts[3], u64{4} * 3 * 128 * 48 * 8);
    for (int il = 0; il < 6; ++il) EXPECT_EQ(dist::layer_kv_bytes(inv.hp, il, 1000, kv_precision::f32), tiny_kv_bytes(il, 1000));
}

TEST(dist_planner, tiny_pipeline_plans) {
    const auto inv = dist::inventory_from_gguf(tiny_file());
    const u64 n = 1000, chunk = 16, reserve_fixed = 4096;
    std::vector<u64> block(6);
    for (int il = 0; il < 6; ++il) block[static_cast<size_t>(il)] = tiny_block_bytes(il) + tiny_kv_bytes(il, n);
    const u64 embed = 4 * 512 * 128, last_extra = 4 * 512 * 128 + 4 * (128 + 512 * 4 + 4 + 1);
    const u64 reserve = reserve_fixed + tiny_activation(chunk, n);
    dist::plan_options o;
    o.n_ctx = static_cast<int64_t>(n);
    o.kv = kv_precision::f32;
    o.chunk = static_cast<int64_t>(chunk);
    o.reserve_bytes = reserve_fixed;
    // Equal devices, then device 1 three times device 0.
    for (u64 free1 : {u64{8} << 20, u64{24} << 20}) {
        const u64 free0 = u64{8} << 20;
        const auto want = brute_force_2(block, embed, last_extra, reserve, free0, free1);
        const auto p = dist::make_plan(inv, {{"cuda:0", free0}, {"cuda:1", free1}}, o);
        ASSERT_EQ(p.devices.size(), 2u);
        EXPECT_EQ(p.devices[0].layers.first, 0);
        EXPECT_EQ(p.devices[0].layers.last, want.cut) << "free1 " << free1;
        EXPECT_EQ(p.devices[1].layers.last, 6);
        EXPECT_EQ(p.devices[0].used(), want.used0);
        EXPECT_EQ(p.devices[1].used(), want.used1);
        EXPECT_EQ(p.devices[0].reserve, reserve);
        EXPECT_EQ(p.devices[0].left(), static_cast<int64_t>(free0) - static_cast<int64_t>(want.used0));
    }
    // Hand check of the objective (block costs 1.20, 1.20, 2.69, 1.67, 2.68, 1.67 MiB with KV):
    // equal 8 MiB devices split 3 + 3 (fill 0.70 / 0.82); 8 + 24 MiB split 2 + 4 (fill 0.36 / 0.38).
    EXPECT_EQ(brute_force_2(block, embed, last_extra, reserve, 8 << 20, 8 << 20).cut, 3);
    EXPECT_EQ(brute_force_2(block, embed, last_extra, reserve, 8 << 20, 24 << 20).cut, 2);
    // User override 0-1,2-5 is taken as given.
    o.ranges = dist::parse_layer_ranges("0-1,2-5");
    const auto p = dist::make_plan(inv, {{"a", 16 << 20}, {"b", 16 << 20}}, o);
    EXPECT_EQ(p.devices[0].layers.last, 2);
    EXPECT_EQ(p.devices[0].weights, embed + tiny_block_bytes(0) + tiny_block_bytes(1));
    EXPECT_EQ(p.devices[0].kv, tiny_kv_bytes(0, n) + tiny_kv_bytes(1, n));
    // Too little memory: one line naming the device and the shortfall.
    o.ranges.clear();
    try {
        dist::make_plan(inv, {{"cuda:0", 1 << 20}, {"cuda:1", 1 << 20}}, o);
        FAIL() << "expected a does-not-fit error";
    } catch (const error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("plan: does not fit: cuda:"), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos);
    }
    EXPECT_THROW(dist::make_plan(inv, std::vector<dist::device_spec>(7, {"d", 1ull << 30}), o), error);  // 7 > 6 layers
    o.ranges = dist::parse_layer_ranges("0-2,4-5");  // gap
    EXPECT_THROW(dist::make_plan(inv, {{"a", 1ull << 30}, {"b", 1ull << 30}}, o), error);
}

TEST(dist_planner, parse_layer_ranges) {
    const auto r = dist::parse_layer_ranges("0-21,22-42");
    ASSERT_EQ(r.size(), 2u);
    EXPECT_EQ(r[0].first, 0);
    EXPECT_EQ(r[0].last, 22);
    EXPECT_EQ(r[1].first, 22);
    EXPECT_EQ(r[1].last, 43);
    EXPECT_EQ(dist::parse_layer_ranges("5")[0].last, 6);
    for (const char *bad : {"", "0-", "-3", "3-1", "a-b", "0-21,,22-42", "0-21;22-42", "1-2-3"})
        EXPECT_THROW(dist::parse_layer_ranges(bad), error) << bad;
}

// ---- DeepSeek-V4-Flash full geometry -------------------------------------------------------------------

// Stored bytes of a row of n weights: Q8_0 34 B / 32, IQ2_XXS 66 B / 256, Q2_K 84 B / 256,
// Q4_K 144 B / 256, F16 2 B, F32 and I32 4 B.
enum class ty { q8_0, iq2_xxs, q2_k, q4_k, f16, f32 };
u64 row_bytes(ty t, u64 n) {
    switch (t) {
        case ty::q8_0: return n / 32 * 34;
        case ty::iq2_xxs: return n / 256 * 66;
        case ty::q2_k: return n / 256 * 84;
        case ty::q4_k: return n / 256 * 144;
        case ty::f16: return 2 * n;
        case ty::f32: return 4 * n;
    }
    return 0;
}

// Tensor directory of Flash (spec section 9 names and shapes; ne0 = row length, then rows, experts):
// routed experts in `gu` (gate, up) and `dn` (down), dense projections Q8_0, HC/compressor/indexer
// projection/router/embedding F16, vectors F32 -- the q2 mix of fathom-gguf synth.
std::vector<dist::tensor_bytes> flash_directory(const ds4::hparams &hp, ty gu, ty dn) {
    std::vector<dist::tensor_bytes> t;
    auto add = [&](const std::string &name, ty type, u64 ne0, u64 rows) { t.push_back({name, row_bytes(type, ne0) * rows}); };
    add("token_embd.weight", ty::f16, 4096, 129280);
    for (int il = 0; il < 43; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        const int r = hp.compress_ratio[static_cast<size_t>(il)];
        add(p + "attn_norm.weight", ty::f32, 4096, 1);
        add(p + "ffn_norm.weight", ty::f32, 4096, 1);
        for (const char *hc : {"hc_attn", "hc_ffn"}) {
            add(p + hc + "_fn.weight", ty::f16, 16384, 24);
            add(p + hc + "_base.weight", ty::f32, 24, 1);
            add(p + hc + "_scale.weight", ty::f32, 3, 1);
        }
        add(p + "attn_sinks.weight", ty::f32, 64, 1);
        add(p + "attn_q_a.weight", ty::q8_0, 4096, 1024);
        add(p + "attn_q_a_norm.weight", ty::f32, 1024, 1);
        add(p + "attn_q_b.weight", ty::q8_0, 1024, 32768);
        add(p + "attn_kv.weight", ty::q8_0, 4096, 512);
        add(p + "attn_kv_a_norm.weight", ty::f32, 512, 1);
        add(p + "attn_output_a.weight", ty::q8_0, 4096, 8192);
        add(p + "attn_output_b.weight", ty::q8_0, 8192, 4096);
        add(p + "ffn_gate_inp.weight", ty::f16, 4096, 256);
        if (il < 3)
            add(p + "ffn_gate_tid2eid.weight", ty::f32, 6, 129280);  // i32, 4 bytes
        else
            add(p + "exp_probs_b.bias", ty::f32, 256, 1);
        add(p + "ffn_gate_exps.weight", gu, 4096, 2048 * 256);
        add(p + "ffn_up_exps.weight", gu, 4096, 2048 * 256);
        add(p + "ffn_down_exps.weight", dn, 2048, 4096 * 256);
        add(p + "ffn_gate_shexp.weight", ty::q8_0, 4096, 2048);
        add(p + "ffn_up_shexp.weight", ty::q8_0, 4096, 2048);
        add(p + "ffn_down_shexp.weight", ty::q8_0, 2048, 4096);
        if (r > 0) {
            const u64 w = r == 4 ? 1024 : 512;
            add(p + "attn_compressor_kv.weight", ty::f16, 4096, w);
            add(p + "attn_compressor_gate.weight", ty::f16, 4096, w);
            add(p + "attn_compressor_ape.weight", ty::f32, w, static_cast<u64>(r));
            add(p + "attn_compressor_norm.weight", ty::f32, 512, 1);
        }
        if (r == 4) {
            add(p + "indexer.attn_q_b.weight", ty::q8_0, 1024, 8192);
            add(p + "indexer.proj.weight", ty::f16, 4096, 64);
            add(p + "indexer_compressor_kv.weight", ty::f16, 4096, 256);
            add(p + "indexer_compressor_gate.weight", ty::f16, 4096, 256);
            add(p + "indexer_compressor_ape.weight", ty::f32, 256, 4);
            add(p + "indexer_compressor_norm.weight", ty::f32, 128, 1);
        }
    }
    add("output_norm.weight", ty::f32, 4096, 1);
    add("output.weight", ty::q8_0, 4096, 129280);
    add("output_hc_fn.weight", ty::f16, 16384, 4);
    add("output_hc_base.weight", ty::f32, 4, 1);
    add("output_hc_scale.weight", ty::f32, 1, 1);
    return t;
}

// Per-block bytes of Flash written as sums per block kind (not through the directory above).
// Dense part common to every block (Q8_0 = 34/32 bytes per weight, F16 2, F32 4):
u64 flash_dense_common() {
    const u64 q8 = (4096 * 1024 + 1024 * 32768 + 4096 * 512 + 4096 * 8192 + 8192 * 4096 + 3 * 4096 * 2048) / 32 * 34;
    const u64 f16 = 2 * (2 * 24 * 16384 + 256 * 4096);
    const u64 f32 = 4 * (2 * 4096 + 2 * (24 + 3) + 64 + 1024 + 512);
    return q8 + f16 + f32;
}
u64 flash_block_bytes(int il, u64 expert_bytes_per_block) {
    const int r = il < 2 ? 0 : il % 2 == 0 ? 4 : 128;
    u64 b = flash_dense_common() + expert_bytes_per_block + (il < 3 ? 4 * 6 * 129280 : 4 * 256);
    if (r == 4)
        b += 2 * 2 * 4096 * 1024 + 4 * 4 * 1024 + 4 * 512       // attention compressor (width 1024)
             + 1024 * 8192 / 32 * 34 + 2 * 4096 * 64            // indexer q_b, proj
             + 2 * 2 * 4096 * 256 + 4 * 4 * 256 + 4 * 128;      // indexer compressor (width 256)
    if (r == 128) b += 2 * 2 * 4096 * 512 + 4 * 128 * 512 + 4 * 512;
    return b;
}
// KV at 128K context, f16 rows: ring 128 x 512; ratio 4: 32768 rows of 512 + 32768 indexer rows of
// 128, frontiers 8 x 1024 and 8 x 256 (f32 value + score); ratio 128: 1024 rows of 512, frontier
// 128 x 512 (f32 value + score).
u64 flash_kv_128k(int il) {
    const int r = il < 2 ? 0 : il % 2 == 0 ? 4 : 128;
    u64 b = 128 * 512 * 2;
    if (r == 4) b += 32768 * 512 * 2 + 8 * 1024 * 8 + 32768 * 128 * 2 + 8 * 256 * 8;
    if (r == 128) b += 1024 * 512 * 2 + 128 * 512 * 8;
    return b;
}
// Activation estimate (planner.h formula) for Flash, chunk 512, 128K, one sequence:
// 2*16384 + 2*64*512 + 8*1024 + 4*4096 + 3*2048*7 + 64*(128 + 512 + 1024) + 32768 floats per token.
constexpr u64 flash_activation = 4 * (512 * (32768 + 65536 + 8192 + 16384 + 43008 + 106496 + 32768) + 129280);

struct flash_case {
    const char *name;
    ty gu, dn;
    u64 expert_bytes;  // per block: 256 experts x (2 x [2048 x 4096] gate/up + [4096 x 2048] down)
};

TEST(dist_planner, flash_full_geometry_on_two_h200) {
    const ds4::hparams hp = ds4::synth_preset("flash");
    const u64 embed = 2ull * 4096 * 129280, output = 129280ull * 4096 / 32 * 34;
    const u64 head = 4 * 4096 + 2 * 16384 * 4 + 4 * 5;
    const flash_case cases[] = {
        {"q2", ty::iq2_xxs, ty::q2_k, 256ull * 2048 * 4096 / 256 * (66 + 66 + 84)},
        {"4-bit experts", ty::q4_k, ty::q4_k, 256ull * 2048 * 4096 / 256 * (3 * 144)},
    };
    dist::plan_options o;
    o.n_ctx = 131072;
    o.kv = kv_precision::f16;
    for (const auto &c : cases) {
        SCOPED_TRACE(c.name);
        const auto inv = dist::make_inventory(hp, flash_directory(hp, c.gu, c.dn));
        std::vector<u64> block(43);
        u64 total = embed + output + head;
        for (int il = 0; il < 43; ++il) {
            ASSERT_EQ(inv.layer[static_cast<size_t>(il)], flash_block_bytes(il, c.expert_bytes)) << il;
            EXPECT_EQ(dist::layer_kv_bytes(hp, il, 131072, kv_precision::f16), flash_kv_128k(il)) << il;
            block[static_cast<size_t>(il)] = flash_block_bytes(il, c.expert_bytes) + flash_kv_128k(il);
            total += flash_block_bytes(il, c.expert_bytes);
        }
        EXPECT_EQ(inv.total(), total);
        const u64 reserve = o.reserve_bytes + flash_activation;
        const u64 free = 141 * GiB;
        const auto want = brute_force_2(block, embed, output + head, reserve, free, free);
        const auto p = dist::make_plan(inv, {{"cuda:0", free}, {"cuda:1", free}}, o);
        EXPECT_EQ(p.devices[0].layers.last, want.cut);
        EXPECT_EQ(p.devices[0].used(), want.used0);
        EXPECT_EQ(p.devices[1].used(), want.used1);
        EXPECT_GT(p.devices[0].left(), 0);
        EXPECT_GT(p.devices[1].left(), 0);
        std::printf("  %-14s weights %.2f GiB (%.1f GB), KV@128K %.3f GiB; 2 x 141 GiB pipeline: blocks 0-%d | %d-42, "
                    "left %.2f / %.2f GiB\n",
                    c.name, double(total) / GiB, double(total) / 1e9, double(p.devices[0].kv + p.devices[1].kv) / GiB,
                    want.cut - 1, want.cut, double(p.devices[0].left()) / GiB, double(p.devices[1].left()) / GiB);
        // Tensor + expert parallel: 128 experts each; heads, groups, shared expert, indexer heads,
        // embedding and output rows halved; the rest and the whole KV replicated.
        o.kind = dist::layout::tp;
        const auto q = dist::make_plan(inv, {{"cuda:0", free}, {"cuda:1", free}}, o);
        u64 w = embed / 2 + output / 2 + head, kv = 0;
        for (int il = 0; il < 43; ++il) {
            const int r = il < 2 ? 0 : il % 2 == 0 ? 4 : 128;
            const u64 split = (1024 * 32768 + 4096 * 8192 + 8192 * 4096 + 3 * 4096 * 2048) / 32 * 34 +
                              (r == 4 ? 1024 * 8192 / 32 * 34 + 2 * 4096 * 64 : 0);
            w += flash_block_bytes(il, c.expert_bytes) - c.expert_bytes - split + split / 2 + c.expert_bytes / 2;
            kv += flash_kv_128k(il);
        }
        for (int r = 0; r < 2; ++r) {
            EXPECT_EQ(q.devices[static_cast<size_t>(r)].weights, w);
            EXPECT_EQ(q.devices[static_cast<size_t>(r)].kv, kv);
            EXPECT_EQ(q.devices[static_cast<size_t>(r)].experts_first, 128 * r);
            EXPECT_EQ(q.devices[static_cast<size_t>(r)].experts_count, 128);
        }
        o.kind = dist::layout::pipeline;
    }
    // One H200: the q2 mix fits with 128K, 4-bit experts do not.
    const auto q2 = dist::make_inventory(hp, flash_directory(hp, ty::iq2_xxs, ty::q2_k));
    EXPECT_NO_THROW(dist::make_plan(q2, {{"cuda:0", 141 * GiB}}, o));
    const auto q4 = dist::make_inventory(hp, flash_directory(hp, ty::q4_k, ty::q4_k));
    EXPECT_THROW(dist::make_plan(q4, {{"cuda:0", 141 * GiB}}, o), error);
    // tp over 3 devices cannot split 64 heads / 8 output groups evenly.
    o.kind = dist::layout::tp;
    EXPECT_THROW(dist::make_plan(q4, std::vector<dist::device_spec>(3, {"d", 141 * GiB}), o), error);
}

TEST(dist_planner, json_report) {
    dist::plan_options o;
    o.n_ctx = 256;
    o.reserve_bytes = 1 << 20;
    const auto p = dist::make_plan(dist::inventory_from_gguf(tiny_file()), {{"cuda:0", 1ull << 30}, {"cuda:1", 1ull << 30}}, o);
    const auto j = nlohmann::json::parse(dist::plan_json(p));
    EXPECT_EQ(j["layout"], "pipeline");
    ASSERT_EQ(j["devices"].size(), 2u);
    EXPECT_EQ(j["devices"][0]["first_layer"], 0);
    EXPECT_EQ(j["devices"][1]["last_layer"], 5);
    EXPECT_EQ(j["devices"][0]["used_bytes"].get<u64>(),
              j["devices"][0]["weight_bytes"].get<u64>() + j["devices"][0]["kv_bytes"].get<u64>() +
                  j["devices"][0]["reserve_bytes"].get<u64>());
    EXPECT_NE(dist::plan_text(p).find("cuda:1"), std::string::npos);
}

}  // namespace
