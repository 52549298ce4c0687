// Loading of the dense family: common hyperparameters from `<arch>.*` GGUF keys, the per-family
// hook, and strict tensor validation (every tensor's dtype and shape checked against the
// hyperparameters, failing with the tensor's name). Weights are mapped through the backend.
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "models/dense.h"

namespace fathom {

namespace {

int32_t get_i32(const gguf::file &f, const std::string &key) {
    const int64_t v = f.get_int(key);
    if (v <= 0 || v > (int64_t{1} << 30)) throw error(f.path() + ": " + key + " = " + std::to_string(v) + " out of range");
    return static_cast<int32_t>(v);
}

int32_t get_i32(const gguf::file &f, const std::string &key, int32_t def) {
    return f.has(key) ? get_i32(f, key) : def;
}

// RoPE scaling from `<arch>.rope.scaling.*` (llama.cpp semantics: linear -> freq_scale = 1/factor,
// yarn -> freq_scale = 1/factor with extrapolation mixing over the correction range).
void read_rope_scaling(const gguf::file &f, const std::string &a, rope_params &r) {
    const std::string type(f.get_string(a + ".rope.scaling.type", "none"));
    float factor = static_cast<float>(f.get_float(a + ".rope.scaling.factor", 0.0));
    if (type == "none" || factor == 0.0f || factor == 1.0f) return;
    if (!(factor > 0.0f) || !std::isfinite(factor)) throw error(f.path() + ": " + a + ".rope.scaling.factor invalid");
    if (type == "linear") {
        r.freq_scale = 1.0f / factor;
    } else if (type == "yarn") {
        r.freq_scale = 1.0f / factor;
        r.ext_factor = 1.0f;
        r.attn_factor = static_cast<float>(f.get_float(a + ".rope.scaling.attn_factor", 1.0));
        r.beta_fast = static_cast<float>(f.get_float(a + ".rope.scaling.yarn_beta_fast", 32.0));
        r.beta_slow = static_cast<float>(f.get_float(a + ".rope.scaling.yarn_beta_slow", 1.0));
        r.n_ctx_orig = get_i32(f, a + ".rope.scaling.original_context_length");
    } else {
        throw error(f.path() + ": unsupported " + a + ".rope.scaling.type '" + type + "'");
    }
}

}  // namespace

bool dense_supports_arch(const std::string &arch) { return arch == "llama" || arch == "qwen3" || arch == "gemma3"; }

dense_hparams dense_load_hparams(const gguf::file &f) {
    dense_hparams hp;
    hp.arch = std::string(f.get_string("general.architecture"));
    if (!dense_supports_arch(hp.arch))
        throw error(f.path() + ": unsupported architecture '" + hp.arch + "' (dense family: llama, qwen3, gemma3)");
    const std::string &a = hp.arch;
    hp.n_ctx_train = get_i32(f, a + ".context_length");
    hp.n_embd = get_i32(f, a + ".embedding_length");
    hp.n_layer = get_i32(f, a + ".block_count");
    hp.n_ff = get_i32(f, a + ".feed_forward_length");
    hp.n_head = get_i32(f, a + ".attention.head_count");
    hp.n_head_kv = get_i32(f, a + ".attention.head_count_kv", hp.n_head);
    if (hp.n_embd % hp.n_head != 0 && !f.has(a + ".attention.key_length"))
        throw error(f.path() + ": " + a + ".embedding_length not divisible by head_count and no key_length");
    hp.head_dim = get_i32(f, a + ".attention.key_length", hp.n_embd / hp.n_head);
    const int32_t v_len = get_i32(f, a + ".attention.value_length", hp.head_dim);
    if (v_len != hp.head_dim) throw error(f.path() + ": value_length != key_length is not supported");
    if (hp.n_head % hp.n_head_kv != 0)
        throw error(f.path() + ": head_count " + std::to_string(hp.n_head) + " not a multiple of head_count_kv " +
                    std::to_string(hp.n_head_kv));
    hp.rms_eps = static_cast<float>(f.get_float(a + ".attention.layer_norm_rms_epsilon", 1e-5));
    if (!(hp.rms_eps > 0.0f) || !std::isfinite(hp.rms_eps))
        throw error(f.path() + ": " + a + ".attention.layer_norm_rms_epsilon invalid");

    hp.rope.n_rot = get_i32(f, a + ".rope.dimension_count", hp.head_dim);
    if (hp.rope.n_rot > hp.head_dim || hp.rope.n_rot % 2 != 0)
        throw error(f.path() + ": " + a + ".rope.dimension_count " + std::to_string(hp.rope.n_rot) + " invalid for head_dim " +
                    std::to_string(hp.head_dim));
    hp.rope.freq_base = static_cast<float>(f.get_float(a + ".rope.freq_base", 10000.0));
    if (!(hp.rope.freq_base > 1.0f) || !std::isfinite(hp.rope.freq_base))
        throw error(f.path() + ": " + a + ".rope.freq_base invalid");
    hp.rope.n_ctx_orig = hp.n_ctx_train;
    read_rope_scaling(f, a, hp.rope);
    hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
    hp.swa_layer.assign(static_cast<size_t>(hp.n_layer), false);

    if (a == "llama") dense_hparams_llama(f, hp);
    else if (a == "qwen3") dense_hparams_qwen3(f, hp);
    else dense_hparams_gemma3(f, hp);
    hp.rope_local.n_rot = hp.rope.n_rot;
    hp.rope_local.mode = hp.rope.mode;
    return hp;
}

namespace {

struct tensor_loader {
    const gguf::file &f;
    backend &be;
    uint64_t n_params = 0;
    size_t n_used = 0;

    // A tensor of exactly ne0 x ne1 (1-D tensors: ne1 == 1). Norm weights must be f32.
    tensor get(const std::string &name, int64_t ne0, int64_t ne1, bool need_f32 = false, bool optional = false) {
        const gguf::tensor_info *ti = f.find_tensor(name);
        if (!ti) {
            if (optional) return tensor{};
            throw error(f.path() + ": missing tensor " + name);
        }
        if (ti->ne[0] != ne0 || ti->ne[1] != ne1 || ti->ne[2] != 1 || ti->ne[3] != 1)
            throw error(f.path() + ": tensor " + name + " has shape [" + std::to_string(ti->ne[0]) + ", " +
                        std::to_string(ti->ne[1]) + ", " + std::to_string(ti->ne[2]) + ", " + std::to_string(ti->ne[3]) +
                        "], expected [" + std::to_string(ne0) + ", " + std::to_string(ne1) + "]");
        const auto &info = dtype_info(ti->type);
        if (!info.compute) throw error(f.path() + ": tensor " + name + " has unsupported type " + std::string(info.name));
        if (need_f32 && ti->type != dtype::f32)
            throw error(f.path() + ": tensor " + name + " must be f32, got " + std::string(info.name));
        if (ne0 % info.block_size != 0)
            throw error(f.path() + ": tensor " + name + " row of " + std::to_string(ne0) + " not a multiple of the " +
                        std::string(info.name) + " block");
        ++n_used;
        tensor t = make_tensor(ti->type, ne0, ne1, nullptr);
        t.data = be.map_weights(ti->data, ti->nbytes);
        if (!need_f32) be.prepare_weight(t);  // repacked layouts built at load, not in the first prefill
        return t;
    }
};

}  // namespace

std::unique_ptr<dense_model> dense_load(const gguf::file &f, backend &be) {
    auto m = std::make_unique<dense_model>();
    m->hp = dense_load_hparams(f);
    dense_hparams &hp = m->hp;
    tensor_loader L{f, be};

    const gguf::tensor_info &te = f.tensor("token_embd.weight");
    if (te.ne[1] <= 0 || te.ne[1] > (int64_t{1} << 30)) throw error(f.path() + ": token_embd.weight has bad vocab size");
    hp.n_vocab = static_cast<int32_t>(te.ne[1]);
    if (f.has(hp.arch + ".vocab_size") && f.get_int(hp.arch + ".vocab_size") != hp.n_vocab)
        throw error(f.path() + ": " + hp.arch + ".vocab_size disagrees with token_embd.weight");
    const int64_t E = hp.n_embd, Q = int64_t{hp.n_head} * hp.head_dim, KV = int64_t{hp.n_head_kv} * hp.head_dim;
    m->tok_embd = L.get("token_embd.weight", E, hp.n_vocab);
    m->output_norm = L.get("output_norm.weight", E, 1, true);
    m->output = L.get("output.weight", E, hp.n_vocab, false, true);
    if (!m->output.data) m->output = m->tok_embd;  // tied embeddings

    if (const gguf::tensor_info *rf = f.find_tensor("rope_freqs.weight")) {
        tensor t = L.get("rope_freqs.weight", hp.rope.n_rot / 2, 1, true);
        m->rope_freq_factors.resize(static_cast<size_t>(hp.rope.n_rot / 2));
        std::memcpy(m->rope_freq_factors.data(), rf->data, m->rope_freq_factors.size() * sizeof(float));
        (void)t;
    }

    m->layers.resize(static_cast<size_t>(hp.n_layer));
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        dense_layer &ly = m->layers[static_cast<size_t>(il)];
        const std::string p = "blk." + std::to_string(il) + ".";
        ly.attn_norm = L.get(p + "attn_norm.weight", E, 1, true);
        ly.wq = L.get(p + "attn_q.weight", E, Q);
        ly.wk = L.get(p + "attn_k.weight", E, KV);
        ly.wv = L.get(p + "attn_v.weight", E, KV);
        ly.wo = L.get(p + "attn_output.weight", Q, E);
        ly.bq = L.get(p + "attn_q.bias", Q, 1, true, true);
        ly.bk = L.get(p + "attn_k.bias", KV, 1, true, true);
        ly.bv = L.get(p + "attn_v.bias", KV, 1, true, true);
        ly.bo = L.get(p + "attn_output.bias", E, 1, true, true);
        if (hp.qk_norm) {
            ly.attn_q_norm = L.get(p + "attn_q_norm.weight", hp.head_dim, 1, true);
            ly.attn_k_norm = L.get(p + "attn_k_norm.weight", hp.head_dim, 1, true);
        }
        if (hp.post_norms) ly.post_attn_norm = L.get(p + "post_attention_norm.weight", E, 1, true);
        ly.ffn_norm = L.get(p + "ffn_norm.weight", E, 1, true);
        ly.ffn_gate = L.get(p + "ffn_gate.weight", E, hp.n_ff);
        ly.ffn_up = L.get(p + "ffn_up.weight", E, hp.n_ff);
        ly.ffn_down = L.get(p + "ffn_down.weight", hp.n_ff, E);
        if (hp.post_norms) ly.post_ffn_norm = L.get(p + "post_ffw_norm.weight", E, 1, true);
    }
    // Every tensor in the file must have been consumed: an unknown tensor means a model variant
    // this code would silently compute wrongly.
    if (L.n_used != f.tensors().size()) {
        for (const auto &ti : f.tensors()) {
            const std::string n(ti.name);
            bool known = n == "token_embd.weight" || n == "output_norm.weight" || n == "output.weight" ||
                         n == "rope_freqs.weight";
            if (!known && n.rfind("blk.", 0) == 0) {
                const size_t dot = n.find('.', 4);
                const std::string rest = dot == std::string::npos ? "" : n.substr(dot + 1);
                static const char *kNames[] = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                               "attn_output.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                                               "attn_output.bias", "ffn_norm.weight", "ffn_gate.weight",
                                               "ffn_up.weight", "ffn_down.weight"};
                for (const char *k : kNames) known |= rest == k;
                if (hp.qk_norm) known |= rest == "attn_q_norm.weight" || rest == "attn_k_norm.weight";
                if (hp.post_norms) known |= rest == "post_attention_norm.weight" || rest == "post_ffw_norm.weight";
            }
            if (!known) throw error(f.path() + ": unexpected tensor " + n + " for architecture " + hp.arch);
        }
        throw error(f.path() + ": tensor count mismatch (layer index beyond block_count?)");
    }
    for (const auto &ti : f.tensors()) m->n_params += static_cast<uint64_t>(ti.nelements());
    if (!m->rope_freq_factors.empty()) hp.rope.freq_factors = m->rope_freq_factors.data();
    return m;
}

}  // namespace fathom
