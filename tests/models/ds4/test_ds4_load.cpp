// DS4 loader: the golden model's hyper-parameters are read as published (README table), and files
// with one key or tensor broken (written with gguf::writer from the golden file) are rejected with
// a message naming that key or tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <numeric>

#include "core/error.h"
#include "gguf/gguf.h"
#include "golden_util.h"
#include "models/deepseek4.h"
#include "rewrite_util.h"

namespace {

using namespace fathom;

TEST(ds4_load, tiny_hparams) {
    const auto m = ds4::load_model(ds4_test::golden_dir() + "/ds4-tiny-a.gguf");
    const ds4::hparams &hp = m->hp;
    EXPECT_EQ(hp.n_layer, 6);
    EXPECT_EQ(hp.n_embd, 128);
    EXPECT_EQ(hp.n_vocab, 512);
    EXPECT_EQ(hp.n_head, 4);
    EXPECT_EQ(hp.head_dim, 192);
    EXPECT_EQ(hp.n_rot, 64);
    EXPECT_EQ(hp.q_lora, 64);
    EXPECT_EQ(hp.o_groups, 2);
    EXPECT_EQ(hp.o_rank, 32);
    EXPECT_EQ(hp.window, 32);
    EXPECT_EQ(hp.idx_head, 16);
    EXPECT_EQ(hp.idx_dim, 128);
    EXPECT_EQ(hp.idx_topk, 16);
    EXPECT_EQ(hp.n_expert, 8);
    EXPECT_EQ(hp.n_expert_used, 2);
    EXPECT_EQ(hp.n_ff_exp, 48);
    EXPECT_EQ(hp.n_hash_layer, 3);
    EXPECT_EQ(hp.n_hc, 4);
    EXPECT_EQ(hp.sinkhorn_iters, 20);
    EXPECT_EQ(hp.compress_ratio, (std::vector<int>{0, 0, 4, 128, 4, 128}));
    EXPECT_FLOAT_EQ(hp.compress_rope_base, 160000);
    EXPECT_EQ(hp.yarn_orig_ctx, 1024);
    EXPECT_FLOAT_EQ(hp.clamp_exp[3], 1.5f);
    EXPECT_TRUE(m->layers[2].hash);
    EXPECT_FALSE(m->layers[3].hash);
    EXPECT_EQ(m->layers[2].idx_comp.dim, 128);
    EXPECT_EQ(m->layers[3].comp.ape.size(), 128u * 192u);
}

// ---- broken files ----------------------------------------------------------------------------------

struct tensor_edit {
    std::vector<int64_t> ne;                           // empty: keep
    int type = -1;                                     // -1: keep
    std::function<void(std::vector<uint8_t> &)> data;  // optional in-place edit
    bool drop = false;
};

struct variant {
    ds4_test::key_edits keys;  // replace (null fn: drop)
    std::map<std::string, tensor_edit> tensors;
};

std::string write_variant(const std::string &name, const variant &var) {
    return ds4_test::rewrite_tiny(name, var.keys, [&](const gguf::tensor_info &t) {
        ds4_test::tensor_out o = ds4_test::copy_tensor(t);
        const auto it = var.tensors.find(std::string(t.name));
        if (it == var.tensors.end()) return o;
        const tensor_edit &e = it->second;
        o.drop = e.drop;
        if (!e.ne.empty()) o.ne = e.ne;
        if (e.type >= 0) o.type = static_cast<dtype>(e.type);
        const int64_t n = std::accumulate(o.ne.begin(), o.ne.end(), int64_t{1}, std::multiplies<>());
        if (dtype_row_bytes(o.type, n) != o.bytes.size()) o.bytes.assign(dtype_row_bytes(o.type, n), 0);
        if (e.data) e.data(o.bytes);
        return o;
    });
}

void expect_rejected(const std::string &name, const variant &var, const std::string &needle) {
    const std::string path = write_variant(name, var);
    try {
        ds4::load_model(path);
        ADD_FAILURE() << name << ": loaded although broken";
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
            << name << ": message '" << e.what() << "' does not name '" << needle << "'";
    }
    std::filesystem::remove(path);
}

TEST(ds4_load, rewritten_copy_loads) {  // control: the rewrite itself is faithful
    const std::string path = write_variant("control", {});
    EXPECT_NO_THROW(ds4::load_model(path));
    std::filesystem::remove(path);
}

TEST(ds4_load, rejects_broken_keys) {
    variant v;
    v.keys["deepseek4.attention.indexer.top_k"] = nullptr;
    expect_rejected("missing_key", v, "deepseek4.attention.indexer.top_k");

    v = {};
    v.keys["deepseek4.attention.compress_ratios"] = [](gguf::writer &w) {
        w.set_arr_i32("deepseek4.attention.compress_ratios", {0, 0, 4, 128, 4});
    };
    expect_rejected("ratio_len", v, "deepseek4.attention.compress_ratios");

    v = {};
    v.keys["deepseek4.attention.compress_ratios"] = [](gguf::writer &w) {
        w.set_arr_i32("deepseek4.attention.compress_ratios", {0, 0, 4, 1, 4, 128});
    };
    expect_rejected("ratio_value", v, "compress_ratios[3]");

    v = {};
    v.keys["deepseek4.expert_weights_norm"] = [](gguf::writer &w) {
        w.set_bool("deepseek4.expert_weights_norm", false);
    };
    expect_rejected("weights_norm", v, "deepseek4.expert_weights_norm");

    v = {};
    v.keys["deepseek4.attention.head_count_kv"] = [](gguf::writer &w) {
        w.set_u32("deepseek4.attention.head_count_kv", 2);
    };
    expect_rejected("kv_heads", v, "deepseek4.attention.head_count_kv");

    v = {};
    v.keys["deepseek4.swiglu_clamp_exp"] = [](gguf::writer &w) {
        w.set_arr_f32("deepseek4.swiglu_clamp_exp", {1.5f});
    };
    expect_rejected("clamp_len", v, "deepseek4.swiglu_clamp_exp");

    v = {};
    v.keys["general.architecture"] = [](gguf::writer &w) { w.set_string("general.architecture", "llama"); };
    expect_rejected("arch", v, "general.architecture");
}

TEST(ds4_load, rejects_broken_tensors) {
    variant v;
    v.tensors["blk.2.attn_kv.weight"].ne = {128, 191};
    expect_rejected("shape", v, "blk.2.attn_kv.weight");

    v = {};
    v.tensors["blk.4.indexer.proj.weight"].drop = true;
    expect_rejected("missing_tensor", v, "blk.4.indexer.proj.weight");

    v = {};
    v.tensors["blk.3.attn_compressor_ape.weight"].ne = {384, 128};  // ratio-4 width on a ratio-128 layer
    expect_rejected("ape", v, "blk.3.attn_compressor_ape.weight");

    v = {};
    v.tensors["blk.1.ffn_gate_tid2eid.weight"].type = static_cast<int>(dtype::f32);
    expect_rejected("hash_type", v, "blk.1.ffn_gate_tid2eid.weight");

    v = {};
    v.tensors["blk.0.ffn_gate_tid2eid.weight"].data = [](std::vector<uint8_t> &b) {
        const int32_t bad = 8;  // expert_count = 8 -> out of range
        std::memcpy(b.data() + 4 * 7, &bad, 4);
    };
    expect_rejected("hash_range", v, "blk.0.ffn_gate_tid2eid.weight");

    v = {};
    v.tensors["blk.5.exp_probs_b.bias"].drop = true;
    expect_rejected("bias", v, "blk.5.exp_probs_b.bias");
}

}  // namespace
