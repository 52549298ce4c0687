// DS4 loading: every `deepseek4.*` hyper-parameter and every tensor of the llama.cpp `deepseek4`
// layout (spec sections 1 and 9), bound to the GGUF mapping and validated with errors that name the
// offending key or tensor. Also owns the state constructors (their shapes follow the weights).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"

namespace fathom::ds4 {

namespace {

const std::string arch_prefix = "deepseek4.";

std::string where(const gguf::file &f) {
    return f.path() + ": ";
}

// Required positive integer hyper-parameter that fits an int.
int get_pos_int(const gguf::file &f, const std::string &key, int64_t max_value = 1 << 30) {
    const int64_t v = f.get_int(arch_prefix + key);
    if (v <= 0 || v > max_value)
        throw error(where(f) + "metadata key " + arch_prefix + key + " = " + std::to_string(v) +
                    " out of range [1, " + std::to_string(max_value) + "]");
    return static_cast<int>(v);
}

float get_pos_float(const gguf::file &f, const std::string &key) {
    const double v = f.get_float(arch_prefix + key);
    if (!(v > 0.0) || !std::isfinite(v))
        throw error(where(f) + "metadata key " + arch_prefix + key + " = " + std::to_string(v) +
                    " must be a positive finite number");
    return static_cast<float>(v);
}

void expect_int(const gguf::file &f, const std::string &key, int64_t want, int64_t got) {
    if (want != got)
        throw error(where(f) + "metadata key " + arch_prefix + key + " = " + std::to_string(got) +
                    ", expected " + std::to_string(want));
}

// Per-block float array (SwiGLU clamps): length must equal block_count; values positive.
std::vector<float> get_block_floats(const gguf::file &f, const std::string &key, size_t n_block) {
    const auto v = f.get_float_array(arch_prefix + key);
    if (v.size() != n_block)
        throw error(where(f) + "metadata key " + arch_prefix + key + " has " + std::to_string(v.size()) +
                    " entries, expected block_count = " + std::to_string(n_block));
    std::vector<float> out;
    for (double x : v) {
        if (!(x > 0.0) || !std::isfinite(x))
            throw error(where(f) + "metadata key " + arch_prefix + key + " holds " + std::to_string(x) +
                        ", expected positive finite values");
        out.push_back(static_cast<float>(x));
    }
    return out;
}

void load_shape_keys(const gguf::file &f, hparams &hp) {
    hp.n_embd = get_pos_int(f, "embedding_length");
    hp.n_vocab = get_pos_int(f, "vocab_size");
    hp.n_head = get_pos_int(f, "attention.head_count");
    expect_int(f, "attention.head_count_kv", 1, f.get_int(arch_prefix + "attention.head_count_kv"));
    hp.head_dim = get_pos_int(f, "attention.key_length");
    expect_int(f, "attention.value_length", hp.head_dim, f.get_int(arch_prefix + "attention.value_length"));
    hp.n_rot = get_pos_int(f, "rope.dimension_count");
    hp.q_lora = get_pos_int(f, "attention.q_lora_rank");
    hp.o_rank = get_pos_int(f, "attention.output_lora_rank");
    hp.o_groups = get_pos_int(f, "attention.output_group_count");
    hp.window = get_pos_int(f, "attention.sliding_window");
    hp.n_expert = get_pos_int(f, "expert_count");
    hp.n_expert_used = get_pos_int(f, "expert_used_count");
    hp.n_expert_shared = static_cast<int>(f.get_int(arch_prefix + "expert_shared_count"));
    hp.n_ff_exp = get_pos_int(f, "expert_feed_forward_length");
    hp.n_hash_layer = static_cast<int>(f.get_int(arch_prefix + "hash_layer_count"));
    hp.idx_head = get_pos_int(f, "attention.indexer.head_count");
    hp.idx_dim = get_pos_int(f, "attention.indexer.key_length");
    hp.idx_topk = get_pos_int(f, "attention.indexer.top_k");
    hp.n_hc = get_pos_int(f, "hyper_connection.count");
    hp.sinkhorn_iters = get_pos_int(f, "hyper_connection.sinkhorn_iterations");
    hp.hc_eps = get_pos_float(f, "hyper_connection.epsilon");
    hp.rms_eps = get_pos_float(f, "attention.layer_norm_rms_epsilon");
    hp.rope_base = get_pos_float(f, "rope.freq_base");
    hp.compress_rope_base = get_pos_float(f, "attention.compress_rope_freq_base");
    hp.yarn_factor = get_pos_float(f, "rope.scaling.factor");
    hp.yarn_beta_fast = get_pos_float(f, "rope.scaling.yarn_beta_fast");
    hp.yarn_beta_slow = get_pos_float(f, "rope.scaling.yarn_beta_slow");
    hp.yarn_orig_ctx = get_pos_int(f, "rope.scaling.original_context_length");
    hp.expert_weights_scale = get_pos_float(f, "expert_weights_scale");
}

// Structural constraints between keys (each message names the keys involved).
void check_shape_relations(const gguf::file &f, const hparams &hp) {
    auto fail = [&](const std::string &msg) { throw error(where(f) + msg); };
    if (hp.n_rot % 2 != 0 || hp.n_rot >= hp.head_dim || hp.n_rot > hp.idx_dim)
        fail("rope.dimension_count = " + std::to_string(hp.n_rot) +
             " must be even and below attention.key_length and <= attention.indexer.key_length");
    if ((hp.head_dim - hp.n_rot) % 64 != 0)
        fail("attention.key_length - rope.dimension_count = " + std::to_string(hp.head_dim - hp.n_rot) +
             " must be a multiple of 64 (FP8 KV blocks)");
    if (!std::has_single_bit(static_cast<unsigned>(hp.idx_dim)) || hp.idx_dim % 32 != 0)
        fail("attention.indexer.key_length = " + std::to_string(hp.idx_dim) +
             " must be a power of two >= 32 (Hadamard + FP4 blocks)");
    if (hp.n_head % hp.o_groups != 0)
        fail("attention.head_count = " + std::to_string(hp.n_head) +
             " is not a multiple of attention.output_group_count = " + std::to_string(hp.o_groups));
    if (hp.n_expert_used > hp.n_expert)
        fail("expert_used_count = " + std::to_string(hp.n_expert_used) +
             " exceeds expert_count = " + std::to_string(hp.n_expert));
    if (hp.n_expert_shared < 0 || hp.n_expert_shared > 1)
        fail("expert_shared_count = " + std::to_string(hp.n_expert_shared) + " unsupported (0 or 1)");
    if (hp.n_hash_layer < 0 || hp.n_hash_layer > hp.n_layer)
        fail("hash_layer_count = " + std::to_string(hp.n_hash_layer) + " out of range [0, " +
             std::to_string(hp.n_layer) + "]");
}

// Keys whose value is fixed by the architecture, validated when present.
void check_fixed_keys(const gguf::file &f) {
    if (!f.get_bool(arch_prefix + "expert_weights_norm"))
        throw error(where(f) + "metadata key deepseek4.expert_weights_norm must be true");
    if (f.has(arch_prefix + "expert_gating_func"))
        expect_int(f, "expert_gating_func", 4, f.get_int(arch_prefix + "expert_gating_func"));
    for (const char *k : {"expert_group_count", "expert_group_used_count"})
        if (f.has(arch_prefix + k) && f.get_int(arch_prefix + k) > 1)
            throw error(where(f) + "metadata key deepseek4." + k + " = " +
                        std::to_string(f.get_int(arch_prefix + k)) + " unsupported (expert groups)");
    if (f.has(arch_prefix + "rope.scaling.type") && f.get_string(arch_prefix + "rope.scaling.type") != "yarn")
        throw error(where(f) + "metadata key deepseek4.rope.scaling.type = '" +
                    std::string(f.get_string(arch_prefix + "rope.scaling.type")) + "', expected 'yarn'");
}

}  // namespace

hparams load_hparams(const gguf::file &f) {
    const std::string arch(f.get_string("general.architecture"));
    if (arch != "deepseek4")
        throw error(where(f) + "general.architecture = '" + arch + "', expected 'deepseek4'");
    hparams hp;
    const int n_block = get_pos_int(f, "block_count", 4096);
    hp.n_nextn = static_cast<int>(f.get_int(arch_prefix + "nextn_predict_layers", 0));
    if (hp.n_nextn < 0 || hp.n_nextn >= n_block)
        throw error(where(f) + "metadata key deepseek4.nextn_predict_layers = " + std::to_string(hp.n_nextn) +
                    " out of range for block_count = " + std::to_string(n_block));
    load_shape_keys(f, hp);
    check_fixed_keys(f);

    // llama.cpp layout: the nextn (MTP) blocks are counted in block_count and stored last.
    const auto ratios = f.get_int_array(arch_prefix + "attention.compress_ratios");
    const size_t n_arr = ratios.size();
    if (n_arr != static_cast<size_t>(n_block))
        throw error(where(f) + "metadata key deepseek4.attention.compress_ratios has " +
                    std::to_string(n_arr) + " entries, expected block_count = " + std::to_string(n_block));
    hp.n_layer = n_block - hp.n_nextn;
    for (size_t i = 0; i < n_arr; ++i) {
        const int64_t r = ratios[i];
        if (r < 0 || r == 1 || r > 65536)
            throw error(where(f) + "metadata key deepseek4.attention.compress_ratios[" + std::to_string(i) +
                        "] = " + std::to_string(r) + ", expected 0 or a ratio in [2, 65536]");
        hp.compress_ratio.push_back(static_cast<int>(r));
    }
    hp.clamp_exp = get_block_floats(f, "swiglu_clamp_exp", n_arr);
    hp.clamp_shexp = f.has(arch_prefix + "swiglu_clamp_shexp")
                         ? get_block_floats(f, "swiglu_clamp_shexp", n_arr)
                         : hp.clamp_exp;
    check_shape_relations(f, hp);
    if (f.has(arch_prefix + "embedding_length_out"))
        expect_int(f, "embedding_length_out", static_cast<int64_t>(hp.n_hc) * hp.n_embd,
                   f.get_int(arch_prefix + "embedding_length_out"));
    return hp;
}

// ---- tensors -----------------------------------------------------------------------------------

namespace {

std::string shape_str(const int64_t *ne, uint32_t n) {
    std::string s = "{";
    for (uint32_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "}";
}

void check_compute_type(const gguf::file &f, const gguf::tensor_info &t, int64_t cols) {
    const auto &ti = dtype_info(t.type);
    if (t.type != dtype::f32 && !ti.compute)
        throw error(where(f) + "tensor " + std::string(t.name) + " has unsupported type " +
                    std::string(ti.known ? ti.name : "unknown"));
    if (cols % ti.block_size != 0)
        throw error(where(f) + "tensor " + std::string(t.name) + ": row length " + std::to_string(cols) +
                    " is not a multiple of the " + std::string(ti.name) + " block size");
}

matrix as_matrix(const gguf::file &f, const gguf::tensor_info &t, int64_t cols, int64_t rows) {
    check_compute_type(f, t, cols);
    matrix m;
    m.type = t.type;
    m.data = t.data;
    m.rows = rows;
    m.cols = cols;
    m.row_bytes = dtype_row_bytes(t.type, cols);
    return m;
}

}  // namespace

// Shared with the DSpark loader (deepseek4_impl.h).
// The tensor `name` with exactly the shape `ne` (ggml order). Throws naming the tensor.
const gguf::tensor_info &tensor_shaped(const gguf::file &f, const std::string &name, std::vector<int64_t> ne) {
    const gguf::tensor_info *t = f.find_tensor(name);
    if (!t) throw error(where(f) + "missing tensor " + name);
    bool ok = t->n_dims == ne.size();
    for (size_t i = 0; ok && i < ne.size(); ++i) ok = t->ne[i] == ne[i];
    if (!ok)
        throw error(where(f) + "tensor " + name + " has shape " + shape_str(t->ne, t->n_dims) +
                    ", expected " + shape_str(ne.data(), static_cast<uint32_t>(ne.size())));
    return *t;
}

// 2-D weight, torch [rows, cols] = ggml {cols, rows}.
matrix tensor_matrix(const gguf::file &f, const std::string &name, int64_t cols, int64_t rows) {
    return as_matrix(f, tensor_shaped(f, name, {cols, rows}), cols, rows);
}

// Small parameter vector (norms, biases, HC bases/scales, sinks, APE) copied to f32.
std::vector<float> tensor_vector(const gguf::file &f, const std::string &name, std::vector<int64_t> ne) {
    const auto &t = tensor_shaped(f, name, ne);
    if (t.type != dtype::f32 && t.type != dtype::f16 && t.type != dtype::bf16)
        throw error(where(f) + "tensor " + name + " has type " + std::string(dtype_name(t.type)) +
                    ", expected f32, f16 or bf16");
    std::vector<float> v(static_cast<size_t>(t.nelements()));
    if (t.type == dtype::f32)
        std::memcpy(v.data(), t.data, v.size() * sizeof(float));
    else
        cpu::dequantize_row(t.type, t.data, v.data(), t.nelements());
    for (float x : v)
        if (!std::isfinite(x)) throw error(where(f) + "tensor " + name + " holds a non-finite value");
    return v;
}

namespace {

expert_bank get_experts(const gguf::file &f, const std::string &name, int64_t cols, int64_t rows, int64_t n) {
    const auto &t = tensor_shaped(f, name, {cols, rows, n});
    expert_bank b;
    b.first = as_matrix(f, t, cols, rows);
    b.n = n;
    b.expert_bytes = b.first.row_bytes * static_cast<size_t>(rows);
    return b;
}


hc_weights get_hc(const gguf::file &f, const std::string &stem, const hparams &hp, int64_t n_mix,
                  int64_t n_scale) {
    hc_weights w;
    w.fn = tensor_matrix(f, stem + "_fn.weight", static_cast<int64_t>(hp.n_hc) * hp.n_embd, n_mix);
    w.base = tensor_vector(f, stem + "_base.weight", {n_mix});
    w.scale = tensor_vector(f, stem + "_scale.weight", {n_scale});
    return w;
}

compressor_weights get_compressor(const gguf::file &f, const std::string &stem, const hparams &hp, int ratio,
                                  int dim) {
    compressor_weights c;
    c.ratio = ratio;
    c.dim = dim;
    const int64_t width = (ratio == 4 ? 2 : 1) * static_cast<int64_t>(dim);
    c.kv = tensor_matrix(f, stem + "_kv.weight", hp.n_embd, width);
    c.gate = tensor_matrix(f, stem + "_gate.weight", hp.n_embd, width);
    c.ape = tensor_vector(f, stem + "_ape.weight", {width, ratio});
    c.norm = tensor_vector(f, stem + "_norm.weight", {dim});
    return c;
}

std::vector<int32_t> get_tid2eid(const gguf::file &f, const std::string &name, const hparams &hp) {
    const auto &t = tensor_shaped(f, name, {hp.n_expert_used, hp.n_vocab});
    if (t.type != dtype::i32)
        throw error(where(f) + "tensor " + name + " has type " + std::string(dtype_name(t.type)) +
                    ", expected i32");
    std::vector<int32_t> v(static_cast<size_t>(t.nelements()));
    std::memcpy(v.data(), t.data, v.size() * sizeof(int32_t));
    for (size_t i = 0; i < v.size(); ++i)
        if (v[i] < 0 || v[i] >= hp.n_expert)
            throw error(where(f) + "tensor " + name + ": token " + std::to_string(i / hp.n_expert_used) +
                        " maps to expert " + std::to_string(v[i]) + ", outside [0, " +
                        std::to_string(hp.n_expert) + ")");
    return v;
}

void load_attention(const gguf::file &f, const hparams &hp, const std::string &p, layer_weights &l) {
    const int64_t D = hp.n_embd, d = hp.head_dim;
    l.attn_norm = tensor_vector(f, p + "attn_norm.weight", {D});
    l.q_a = tensor_matrix(f, p + "attn_q_a.weight", D, hp.q_lora);
    l.q_a_norm = tensor_vector(f, p + "attn_q_a_norm.weight", {hp.q_lora});
    l.q_b = tensor_matrix(f, p + "attn_q_b.weight", hp.q_lora, hp.n_head * d);
    l.kv = tensor_matrix(f, p + "attn_kv.weight", D, d);
    l.kv_norm = tensor_vector(f, p + "attn_kv_a_norm.weight", {d});
    l.sinks = tensor_vector(f, p + "attn_sinks.weight", {hp.n_head});
    l.out_a = tensor_matrix(f, p + "attn_output_a.weight", hp.n_head / hp.o_groups * d,
                         static_cast<int64_t>(hp.o_groups) * hp.o_rank);
    l.out_b = tensor_matrix(f, p + "attn_output_b.weight", static_cast<int64_t>(hp.o_groups) * hp.o_rank, D);
    if (l.ratio > 0) l.comp = get_compressor(f, p + "attn_compressor", hp, l.ratio, hp.head_dim);
    if (l.ratio == 4) {
        l.idx_q_b = tensor_matrix(f, p + "indexer.attn_q_b.weight", hp.q_lora,
                               static_cast<int64_t>(hp.idx_head) * hp.idx_dim);
        l.idx_proj = tensor_matrix(f, p + "indexer.proj.weight", D, hp.idx_head);
        l.idx_comp = get_compressor(f, p + "indexer_compressor", hp, 4, hp.idx_dim);
    }
}

void load_moe(const gguf::file &f, const hparams &hp, const std::string &p, layer_weights &l) {
    const int64_t D = hp.n_embd, F = hp.n_ff_exp, E = hp.n_expert;
    l.ffn_norm = tensor_vector(f, p + "ffn_norm.weight", {D});
    l.gate_inp = tensor_matrix(f, p + "ffn_gate_inp.weight", D, E);
    if (l.hash)
        l.tid2eid = get_tid2eid(f, p + "ffn_gate_tid2eid.weight", hp);
    else
        l.exp_bias = tensor_vector(f, p + "exp_probs_b.bias", {E});
    l.gate_exps = get_experts(f, p + "ffn_gate_exps.weight", D, F, E);
    l.up_exps = get_experts(f, p + "ffn_up_exps.weight", D, F, E);
    l.down_exps = get_experts(f, p + "ffn_down_exps.weight", F, D, E);
    if (hp.n_expert_shared == 1) {
        l.gate_sh = tensor_matrix(f, p + "ffn_gate_shexp.weight", D, F);
        l.up_sh = tensor_matrix(f, p + "ffn_up_shexp.weight", D, F);
        l.down_sh = tensor_matrix(f, p + "ffn_down_shexp.weight", F, D);
    }
}

}  // namespace

layer_weights load_layer(const gguf::file &f, const hparams &hp, const std::string &prefix, int ratio,
                         bool hash, float clamp, float clamp_sh) {
    layer_weights l;
    l.ratio = ratio;
    l.hash = hash;
    l.clamp = clamp;
    l.clamp_sh = clamp_sh;
    const int64_t n_mix = (2 + static_cast<int64_t>(hp.n_hc)) * hp.n_hc;
    l.hc_attn = get_hc(f, prefix + "hc_attn", hp, n_mix, 3);
    l.hc_ffn = get_hc(f, prefix + "hc_ffn", hp, n_mix, 3);
    load_attention(f, hp, prefix, l);
    load_moe(f, hp, prefix, l);
    return l;
}

std::unique_ptr<model> load_model(std::shared_ptr<const gguf::file> fp) {
    const gguf::file &f = *fp;
    auto m = std::make_unique<model>();
    m->hp = load_hparams(f);
    const hparams &hp = m->hp;
    m->tok_embd = tensor_matrix(f, "token_embd.weight", hp.n_embd, hp.n_vocab);
    m->output = tensor_matrix(f, "output.weight", hp.n_embd, hp.n_vocab);
    m->output_norm = tensor_vector(f, "output_norm.weight", {hp.n_embd});
    m->hc_head = get_hc(f, "output_hc", hp, hp.n_hc, 1);
    for (int il = 0; il < hp.n_layer; ++il) {
        const size_t i = static_cast<size_t>(il);
        m->layers.push_back(load_layer(f, hp, "blk." + std::to_string(il) + ".", hp.compress_ratio[i],
                                       il < hp.n_hash_layer, hp.clamp_exp[i], hp.clamp_shexp[i]));
    }
    m->file = std::move(fp);
    return m;
}

std::unique_ptr<model> load_model(const std::string &path) {
    return load_model(std::shared_ptr<const gguf::file>(gguf::file::open(path)));
}

// ---- state ---------------------------------------------------------------------------------------

void row_store::resize(int64_t n_rows) {
    n_rows_ = n_rows;
    const size_t n = static_cast<size_t>(n_rows * width_);
    if (prec_ == kv_precision::f32)
        f32_.resize(n, 0.0f);
    else
        f16_.resize(n, 0);
}

// f16 -> f32 of a KV row (read for every candidate row of every attended position): F16C, 8 at a
// time where the CPU has it. The conversion is exact, so it gives the bits of cpu::f16_to_f32.
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) static void f16_row_to_f32_f16c(const uint16_t *s, float *d, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i))));
    for (; i < n; ++i) d[i] = cpu::f16_to_f32(s[i]);
}
#endif

static void f16_row_to_f32(const uint16_t *s, float *d, int64_t n) {
#if defined(__x86_64__)
    static const bool f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    if (f16c) return f16_row_to_f32_f16c(s, d, n);
#endif
    for (int64_t i = 0; i < n; ++i) d[i] = cpu::f16_to_f32(s[i]);
}

void row_store::set(int64_t r, const float *src) {
    const size_t o = static_cast<size_t>(r * width_);
    if (prec_ == kv_precision::f32)
        std::memcpy(f32_.data() + o, src, static_cast<size_t>(width_) * sizeof(float));
    else
        for (int64_t i = 0; i < width_; ++i) f16_[o + static_cast<size_t>(i)] = cpu::f32_to_f16(src[i]);
}

void row_store::push(const float *src) {
    resize(n_rows_ + 1);
    set(n_rows_ - 1, src);
}

void row_store::get(int64_t r, float *dst) const {
    const size_t o = static_cast<size_t>(r * width_);
    if (prec_ == kv_precision::f32)
        std::memcpy(dst, f32_.data() + o, static_cast<size_t>(width_) * sizeof(float));
    else
        f16_row_to_f32(f16_.data() + o, dst, width_);
}

std::span<const uint8_t> row_store::bytes() const {
    if (prec_ == kv_precision::f32)
        return {reinterpret_cast<const uint8_t *>(f32_.data()), f32_.size() * sizeof(float)};
    return {reinterpret_cast<const uint8_t *>(f16_.data()), f16_.size() * sizeof(uint16_t)};
}

std::span<uint8_t> row_store::bytes() {
    if (prec_ == kv_precision::f32)
        return {reinterpret_cast<uint8_t *>(f32_.data()), f32_.size() * sizeof(float)};
    return {reinterpret_cast<uint8_t *>(f16_.data()), f16_.size() * sizeof(uint16_t)};
}

double kv_bytes_per_token(const hparams &hp, kv_precision kv, int64_t n_ctx) {
    if (n_ctx <= 0) throw error("kv_bytes_per_token: n_ctx must be positive, got " + std::to_string(n_ctx));
    const double elt = kv == kv_precision::f16 ? 2.0 : 4.0;
    double per_token = 0;  // elements of compressed + indexer rows per token of context
    for (int il = 0; il < hp.n_layer; ++il) {
        const int r = hp.compress_ratio[static_cast<size_t>(il)];
        if (r > 0) per_token += static_cast<double>(hp.head_dim) / r;
        if (r == 4) per_token += static_cast<double>(hp.idx_dim) / r;
    }
    // elements, fixed: the raw ring with its rollback rows
    const double ring = static_cast<double>(hp.n_layer) * static_cast<double>(hp.window + max_rollback) * hp.head_dim;
    return elt * (per_token + ring / static_cast<double>(n_ctx));
}

static compressor_state new_compressor_state(int ratio, int dim) {
    compressor_state s;
    s.ratio = ratio;
    s.dim = dim;
    const bool overlap = ratio == 4;
    const size_t slots = static_cast<size_t>((overlap ? 2 * ratio : ratio) + max_rollback);
    const size_t width = static_cast<size_t>((overlap ? 2 : 1) * dim);
    s.kv.assign(slots * width, 0.0f);
    s.score.assign(slots * width, -INFINITY);
    return s;
}

layer_state new_layer_state(const hparams &hp, int ratio, kv_precision kv) {
    layer_state s;
    s.raw = row_store(hp.head_dim, kv);
    s.raw.resize(hp.window + max_rollback);
    if (ratio > 0) {
        s.comp = new_compressor_state(ratio, static_cast<int>(hp.head_dim));
        s.comp_rows = row_store(hp.head_dim, kv);
    }
    if (ratio == 4) {
        s.idx_comp = new_compressor_state(ratio, static_cast<int>(hp.idx_dim));
        s.idx_rows = row_store(hp.idx_dim, kv);
    }
    return s;
}

layer_state new_layer_state(const hparams &hp, const layer_weights &lw, kv_precision kv) {
    if ((lw.ratio > 0 && lw.comp.dim != hp.head_dim) || (lw.ratio == 4 && lw.idx_comp.dim != hp.idx_dim))
        throw error("ds4: compressor widths differ from head_dim / idx_dim");
    return new_layer_state(hp, lw.ratio, kv);
}

state new_state(const model &m, qat_mode qat, kv_precision kv) {
    state st;
    st.qat = qat;
    st.kv = kv;
    for (const auto &l : m.layers) st.layers.push_back(new_layer_state(m.hp, l, kv));
    return st;
}

}  // namespace fathom::ds4
