// DS4 synthetic GGUF writer (see deepseek4_synth.h). Tensor list, names and shapes follow
// ds4::load_model (llama.cpp `deepseek4` layout); value distributions follow ds4-tiny-a's README:
// linear N(0, 1/fan_in), embedding N(0, 1), norms 1+U(-0.1, 0.1), HC mixers N(0, 1/(4 D)) (variance),
// HC bases 0.5 U(-1, 1), HC scales 1+U(-0.1, 0.1), sinks U(0, 2), compressor APE 0.5 U(-1, 1),
// router biases 0.1 U(-1, 1), hash table = distinct random experts per token id.
// Every tensor has its own random stream (seed mixed with the tensor name), so a file is a pure
// function of (geometry, mix, seed, pool_rows).
#include "models/deepseek4_synth.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <numbers>
#include <numeric>

#include "backend/cpu/quants.h"
#include "core/error.h"
#include "gguf/gguf.h"

namespace fathom::ds4 {

namespace {

// splitmix64: small, fast, well-mixed; the stream is part of the file format of synth outputs.
struct rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
    double normal() {  // Box-Muller (one value per call; simplicity over speed)
        const double u1 = 1.0 - uniform(), u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    }
};

uint64_t name_hash(const std::string &s) {  // FNV-1a
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

enum class init { linear, embed, norm, hc_fn, hc_base, hc_scale, sinks, ape, bias, tid2eid, zero };

struct tensor_spec {
    std::string name;
    dtype type = dtype::f32;
    std::vector<int64_t> ne;  // ggml order, ne[0] = row length
    init kind = init::linear;
};

// Weight classes of the quantised mixes (head: the output projection, a projection except in the
// K-quant mixes).
enum class wclass { expert_gu, expert_down, projection, head, small_matrix, embed, vector };

dtype fit(dtype want, int64_t row) {
    for (dtype t : {want, dtype::q8_0, dtype::f16}) {
        const auto &ti = dtype_info(t);
        if (row % ti.block_size == 0 && row % dtype_info(cpu::vec_dot_type(t)).block_size == 0) return t;
    }
    return dtype::f32;
}

// The K-quant mixes, shaped after llama.cpp's K-quant files of DS4 (the q4 files most users run):
//   q4k (Q4_K_M-like): routed gate/up Q4_K, routed down Q6_K, attention projections, the shared
//        expert and the embedding Q4_K, output head Q6_K;
//   q3k (Q3_K-like): routed gate/up Q3_K, routed down Q5_K, attention projections, the shared expert
//        and the embedding Q3_K, output head Q6_K.
// HC mixers, compressors, indexer projection and router stay F16 (as in every mix). Rows whose length
// is not a multiple of 256 fall back to Q8_0 / F16 (fit).
dtype type_for_kquant(const std::string &mix, wclass c, int64_t row) {
    const bool q3 = mix == "q3k";
    switch (c) {
        case wclass::expert_gu: return fit(q3 ? dtype::q3_k : dtype::q4_k, row);
        case wclass::expert_down: return fit(q3 ? dtype::q5_k : dtype::q6_k, row);
        case wclass::projection:
        case wclass::embed: return fit(q3 ? dtype::q3_k : dtype::q4_k, row);
        case wclass::head: return fit(dtype::q6_k, row);
        default: return dtype::f16;
    }
}

dtype type_for(const std::string &mix, wclass c, int64_t row) {
    if (c == wclass::vector) return dtype::f32;
    if (mix == "f32") return dtype::f32;
    if (mix == "f16") return dtype::f16;
    if (mix == "q8_0") return fit(dtype::q8_0, row);
    if (mix == "q4k" || mix == "q3k") return type_for_kquant(mix, c, row);
    if (mix != "q2" && mix != "q2k" && mix != "mxfp4")
        throw error("synth: unknown weight mix '" + mix + "' (expected q2, q2k, mxfp4, q4k, q3k, q8_0, f16 or f32)");
    switch (c) {
        case wclass::expert_gu:
            return fit(mix == "q2" ? dtype::iq2_xxs : mix == "mxfp4" ? dtype::mxfp4 : dtype::q2_k, row);
        case wclass::expert_down: return fit(mix == "mxfp4" ? dtype::mxfp4 : dtype::q2_k, row);
        case wclass::projection:
        case wclass::head: return fit(dtype::q8_0, row);
        default: return dtype::f16;
    }
}

using tensor_adder = std::function<void(const std::string &, wclass, std::vector<int64_t>, init)>;

// The tensors of one block `p` ("blk.N.") with compression ratio r, hash or learned routing.
void layer_tensors(const tensor_adder &add, std::vector<tensor_spec> &out, const hparams &hp,
                   const std::string &p, int r, bool hash) {
    const int64_t D = hp.n_embd, d = hp.head_dim, F = hp.n_ff_exp, E = hp.n_expert, S = int64_t{hp.n_hc} * D;
    const int64_t n_mix = (2 + int64_t{hp.n_hc}) * hp.n_hc;
    add(p + "attn_norm.weight", wclass::vector, {D}, init::norm);
    add(p + "ffn_norm.weight", wclass::vector, {D}, init::norm);
    for (const char *hc : {"hc_attn", "hc_ffn"}) {
        add(p + hc + "_fn.weight", wclass::small_matrix, {S, n_mix}, init::hc_fn);
        add(p + hc + "_base.weight", wclass::vector, {n_mix}, init::hc_base);
        add(p + hc + "_scale.weight", wclass::vector, {3}, init::hc_scale);
    }
    add(p + "attn_sinks.weight", wclass::vector, {hp.n_head}, init::sinks);
    add(p + "attn_q_a.weight", wclass::projection, {D, hp.q_lora}, init::linear);
    add(p + "attn_q_a_norm.weight", wclass::vector, {hp.q_lora}, init::norm);
    add(p + "attn_q_b.weight", wclass::projection, {hp.q_lora, hp.n_head * d}, init::linear);
    add(p + "attn_kv.weight", wclass::projection, {D, d}, init::linear);
    add(p + "attn_kv_a_norm.weight", wclass::vector, {d}, init::norm);
    add(p + "attn_output_a.weight", wclass::projection,
        {hp.n_head / hp.o_groups * d, int64_t{hp.o_groups} * hp.o_rank}, init::linear);
    add(p + "attn_output_b.weight", wclass::projection, {int64_t{hp.o_groups} * hp.o_rank, D}, init::linear);
    add(p + "ffn_gate_inp.weight", wclass::small_matrix, {D, E}, init::linear);
    if (hash)
        out.push_back(
            {p + "ffn_gate_tid2eid.weight", dtype::i32, {hp.n_expert_used, hp.n_vocab}, init::tid2eid});
    else
        add(p + "exp_probs_b.bias", wclass::vector, {E}, init::bias);
    add(p + "ffn_gate_exps.weight", wclass::expert_gu, {D, F, E}, init::linear);
    add(p + "ffn_down_exps.weight", wclass::expert_down, {F, D, E}, init::linear);
    add(p + "ffn_up_exps.weight", wclass::expert_gu, {D, F, E}, init::linear);
    if (hp.n_expert_shared == 1) {
        add(p + "ffn_gate_shexp.weight", wclass::projection, {D, F}, init::linear);
        add(p + "ffn_down_shexp.weight", wclass::projection, {F, D}, init::linear);
        add(p + "ffn_up_shexp.weight", wclass::projection, {D, F}, init::linear);
    }
    auto compressor = [&](const std::string &stem, int64_t dim) {
        const int64_t w = (r == 4 ? 2 : 1) * dim;
        add(p + stem + "_ape.weight", wclass::vector, {w, r}, init::ape);
        add(p + stem + "_kv.weight", wclass::small_matrix, {D, w}, init::linear);
        add(p + stem + "_gate.weight", wclass::small_matrix, {D, w}, init::linear);
        add(p + stem + "_norm.weight", wclass::vector, {dim}, init::norm);
    };
    if (r > 0) compressor("attn_compressor", d);
    if (r == 4) {
        add(p + "indexer.attn_q_b.weight", wclass::projection, {hp.q_lora, int64_t{hp.idx_head} * hp.idx_dim},
            init::linear);
        add(p + "indexer.proj.weight", wclass::small_matrix, {D, hp.idx_head}, init::linear);
        compressor("indexer_compressor", hp.idx_dim);
    }
}

// The final norm, the output head (target files only: a drafter uses the target's) and the HC head
// collapse (output_hc_*), in the order the target files have always had.
void head_tensors(const tensor_adder &add, const hparams &hp, bool output_head) {
    const int64_t D = hp.n_embd, S = int64_t{hp.n_hc} * D;
    add("output_norm.weight", wclass::vector, {D}, init::norm);
    if (output_head) add("output.weight", wclass::head, {D, hp.n_vocab}, init::linear);
    add("output_hc_fn.weight", wclass::small_matrix, {S, hp.n_hc}, init::hc_fn);
    add("output_hc_base.weight", wclass::vector, {hp.n_hc}, init::hc_base);
    add("output_hc_scale.weight", wclass::vector, {1}, init::hc_scale);
}

tensor_adder adder_for(std::vector<tensor_spec> &out, const std::string &mix) {
    return [&out, mix](const std::string &name, wclass c, std::vector<int64_t> ne, init kind) {
        const dtype t = type_for(mix, c, ne[0]);
        out.push_back({name, t, std::move(ne), kind});
    };
}

// The MTP (nextn) block in llama.cpp's layout (ds4::load_mtp), after every other tensor: blk.<n_layer>.*
// as a window-only block with learned routing + bias, then its input projection and norms. eh_proj
// {2D, D}: input columns 0..D-1 take the embedding, D..2D-1 an HC stream (load_mtp splits each row at
// column D, so the type is chosen for a row of D); initialised N(0, 1/(2D)), its fan-in.
void mtp_tensors(std::vector<tensor_spec> &out, const hparams &hp, const std::string &mix) {
    const tensor_adder add = adder_for(out, mix);
    const int64_t D = hp.n_embd;
    const std::string p = "blk." + std::to_string(hp.n_layer) + ".";
    layer_tensors(add, out, hp, p, 0, false);
    out.push_back({p + "nextn.eh_proj.weight", type_for(mix, wclass::projection, D), {2 * D, D}, init::linear});
    add(p + "nextn.enorm.weight", wclass::vector, {D}, init::norm);
    add(p + "nextn.hnorm.weight", wclass::vector, {D}, init::norm);
    add(p + "nextn.shared_head_norm.weight", wclass::vector, {D}, init::norm);
}

std::vector<tensor_spec> tensor_list(const hparams &hp, const std::string &mix) {
    std::vector<tensor_spec> out;
    const tensor_adder add = adder_for(out, mix);
    add("token_embd.weight", wclass::embed, {hp.n_embd, hp.n_vocab}, init::embed);
    for (int il = 0; il < hp.n_layer; ++il)
        layer_tensors(add, out, hp, "blk." + std::to_string(il) + ".",
                      hp.compress_ratio[static_cast<size_t>(il)], il < hp.n_hash_layer);
    head_tensors(add, hp, true);
    return out;
}

// DSpark drafter tensors (lucebox names; torch [out, in] = ggml {in, out}): the window-only,
// learned-routing stages, the feature projection and norm, the HC head and final norm, the Markov
// tables [V, r] and the confidence head [1, D + r] with its (zero) bias.
std::vector<tensor_spec> dspark_tensor_list(const hparams &hp, const dspark_synth &d,
                                            const std::string &mix) {
    std::vector<tensor_spec> out;
    const tensor_adder add = adder_for(out, mix);
    const int64_t D = hp.n_embd, V = hp.n_vocab, r = d.markov_rank;
    for (int k = 0; k < d.n_stages; ++k)
        layer_tensors(add, out, hp, "blk." + std::to_string(k) + ".", 0, false);
    add("dflash.fc.weight", wclass::projection, {static_cast<int64_t>(d.capture_layers.size()) * D, D},
        init::linear);
    add("dflash.hidden_norm.weight", wclass::vector, {D}, init::norm);
    head_tensors(add, hp, false);
    add("dflash.dspark.markov.w1", wclass::embed, {r, V}, init::embed);
    add("dflash.dspark.markov.w2", wclass::projection, {r, V}, init::linear);
    add("dflash.dspark.confidence.weight", wclass::vector, {D + r, 1}, init::linear);
    add("dflash.dspark.confidence.bias", wclass::vector, {1}, init::zero);
    return out;
}

// One row of float values of kind k (row length n, fan_in = n for linear maps).
void fill_row(rng &g, init k, int64_t n, const hparams &hp, float *v) {
    const double lin_sd = 1.0 / std::sqrt(static_cast<double>(n));
    const double hc_sd = 1.0 / std::sqrt(4.0 * hp.n_embd);
    for (int64_t i = 0; i < n; ++i) {
        double x = 0;
        switch (k) {
            case init::linear: x = g.normal() * lin_sd; break;
            case init::embed: x = g.normal(); break;
            case init::norm: x = 1.0 + 0.1 * (2 * g.uniform() - 1); break;
            case init::hc_fn: x = g.normal() * hc_sd; break;
            case init::hc_base: x = 0.5 * (2 * g.uniform() - 1); break;
            case init::hc_scale: x = 1.0 + 0.1 * (2 * g.uniform() - 1); break;
            case init::sinks: x = 2 * g.uniform(); break;
            case init::ape: x = 0.5 * (2 * g.uniform() - 1); break;
            case init::bias: x = 0.1 * (2 * g.uniform() - 1); break;
            case init::tid2eid:
            case init::zero: break;
        }
        v[i] = static_cast<float>(x);
    }
}

// Streams one tensor's bytes into the writer in chunks of about 4 MiB.
class tensor_streamer {
  public:
    tensor_streamer(gguf::writer &w, uint64_t &done) : w_(w), done_(done) {}
    void put(const uint8_t *p, size_t n) {
        buf_.insert(buf_.end(), p, p + n);
        if (buf_.size() >= (size_t{4} << 20)) flush();
    }
    void zeros(uint64_t n) {
        flush();
        w_.write_tensor_zeros(n);
        done_ += n;
    }
    void flush() {
        if (buf_.empty()) return;
        w_.write_tensor_data(buf_.data(), buf_.size());
        done_ += buf_.size();
        buf_.clear();
    }

  private:
    gguf::writer &w_;
    uint64_t &done_;
    std::vector<uint8_t> buf_;
};

void write_tid2eid(const hparams &hp, rng &g, tensor_streamer &out) {
    std::vector<int32_t> experts(static_cast<size_t>(hp.n_expert));
    for (int t = 0; t < hp.n_vocab; ++t) {
        std::iota(experts.begin(), experts.end(), 0);
        for (int j = 0; j < hp.n_expert_used; ++j) {  // partial Fisher-Yates: distinct experts
            const auto pick = static_cast<size_t>(j + static_cast<int64_t>(g.next() % static_cast<uint64_t>(hp.n_expert - j)));
            std::swap(experts[static_cast<size_t>(j)], experts[pick]);
        }
        out.put(reinterpret_cast<const uint8_t *>(experts.data()), static_cast<size_t>(hp.n_expert_used) * sizeof(int32_t));
    }
}

void write_tensor(const tensor_spec &t, const hparams &hp, const synth_options &o, tensor_streamer &out) {
    rng g{o.seed ^ name_hash(t.name)};
    if (t.kind == init::tid2eid) {
        write_tid2eid(hp, g, out);
        out.flush();
        return;
    }
    const int64_t row = t.ne[0];
    int64_t rows = 1;
    for (size_t i = 1; i < t.ne.size(); ++i) rows *= t.ne[i];
    const size_t rb = dtype_row_bytes(t.type, row);
    std::vector<float> v(static_cast<size_t>(row));
    std::vector<uint8_t> q(rb);
    const bool pooled = o.pool_rows > 0 && rows > o.pool_rows;
    if (!pooled) {
        for (int64_t r = 0; r < rows; ++r) {
            fill_row(g, t.kind, row, hp, v.data());
            cpu::quantize_row(t.type, v.data(), q.data(), row);
            out.put(q.data(), rb);
        }
    } else {
        std::vector<uint8_t> pool(rb * static_cast<size_t>(o.pool_rows));
        for (int64_t r = 0; r < o.pool_rows; ++r) {
            fill_row(g, t.kind, row, hp, v.data());
            cpu::quantize_row(t.type, v.data(), pool.data() + static_cast<size_t>(r) * rb, row);
        }
        if (o.sparse) {  // rows 0..P-1 = the pool, the rest a hole (replicated on the device)
            out.put(pool.data(), pool.size());
            out.flush();
            out.zeros(static_cast<uint64_t>(rows - o.pool_rows) * rb);
            return;
        }
        for (int64_t r = 0; r < rows; ++r)
            out.put(pool.data() + static_cast<size_t>(g.next() % static_cast<uint64_t>(o.pool_rows)) * rb, rb);
    }
    out.flush();
}

// gpt2 byte-level alphabet: printable Latin-1 bytes map to themselves, the rest to U+0100 + n.
std::vector<std::string> byte_tokens() {
    std::vector<std::string> out(256);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
        const bool self = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        const uint32_t cp = self ? static_cast<uint32_t>(b) : 256u + static_cast<uint32_t>(extra++);
        std::string s;
        if (cp < 0x80) {
            s += static_cast<char>(cp);
        } else {
            s += static_cast<char>(0xC0 | (cp >> 6));
            s += static_cast<char>(0x80 | (cp & 0x3F));
        }
        out[static_cast<size_t>(b)] = s;
    }
    return out;
}

void write_metadata(gguf::writer &w, const hparams &hp, const synth_options &o) {
    const std::string a = "deepseek4.";
    w.set_string("general.architecture", "deepseek4");
    w.set_string("general.name", o.name.empty() ? "ds4-synth" : o.name);
    if (o.sparse) w.set_u64("fathom.synth.replicate_rows", static_cast<uint64_t>(o.pool_rows));
    w.set_u32(a + "context_length", static_cast<uint32_t>(std::min<double>(
                                        4294967295.0, static_cast<double>(hp.yarn_orig_ctx) * hp.yarn_factor)));
    w.set_u32(a + "embedding_length", static_cast<uint32_t>(hp.n_embd));
    // llama.cpp's MTP layout: the nextn blocks counted in block_count (and in the per-block arrays)
    w.set_u32(a + "block_count", static_cast<uint32_t>(hp.n_layer + hp.n_nextn));
    if (hp.n_nextn > 0) w.set_u32(a + "nextn_predict_layers", static_cast<uint32_t>(hp.n_nextn));
    w.set_u32(a + "attention.head_count", static_cast<uint32_t>(hp.n_head));
    w.set_u32(a + "attention.head_count_kv", 1);
    w.set_u32(a + "attention.key_length", static_cast<uint32_t>(hp.head_dim));
    w.set_u32(a + "attention.value_length", static_cast<uint32_t>(hp.head_dim));
    w.set_u32(a + "rope.dimension_count", static_cast<uint32_t>(hp.n_rot));
    w.set_f32(a + "rope.freq_base", hp.rope_base);
    w.set_string(a + "rope.scaling.type", "yarn");
    w.set_f32(a + "rope.scaling.factor", hp.yarn_factor);
    w.set_u32(a + "rope.scaling.original_context_length", static_cast<uint32_t>(hp.yarn_orig_ctx));
    w.set_f32(a + "rope.scaling.yarn_beta_fast", hp.yarn_beta_fast);
    w.set_f32(a + "rope.scaling.yarn_beta_slow", hp.yarn_beta_slow);
    w.set_f32(a + "attention.layer_norm_rms_epsilon", hp.rms_eps);
    w.set_u32(a + "vocab_size", static_cast<uint32_t>(hp.n_vocab));
    w.set_u32(a + "expert_count", static_cast<uint32_t>(hp.n_expert));
    w.set_u32(a + "expert_used_count", static_cast<uint32_t>(hp.n_expert_used));
    w.set_u32(a + "expert_gating_func", 4);
    w.set_u32(a + "attention.q_lora_rank", static_cast<uint32_t>(hp.q_lora));
    w.set_u32(a + "attention.sliding_window", static_cast<uint32_t>(hp.window));
    w.set_u32(a + "expert_feed_forward_length", static_cast<uint32_t>(hp.n_ff_exp));
    w.set_u32(a + "expert_shared_count", static_cast<uint32_t>(hp.n_expert_shared));
    w.set_f32(a + "expert_weights_scale", hp.expert_weights_scale);
    w.set_bool(a + "expert_weights_norm", true);
    w.set_arr_f32(a + "swiglu_clamp_exp", hp.clamp_exp);
    w.set_arr_f32(a + "swiglu_clamp_shexp", hp.clamp_shexp);
    w.set_u32(a + "attention.indexer.head_count", static_cast<uint32_t>(hp.idx_head));
    w.set_u32(a + "attention.indexer.key_length", static_cast<uint32_t>(hp.idx_dim));
    w.set_u32(a + "attention.indexer.top_k", static_cast<uint32_t>(hp.idx_topk));
    w.set_u32(a + "attention.output_group_count", static_cast<uint32_t>(hp.o_groups));
    w.set_u32(a + "attention.output_lora_rank", static_cast<uint32_t>(hp.o_rank));
    w.set_arr_i32(a + "attention.compress_ratios", std::vector<int32_t>(hp.compress_ratio.begin(), hp.compress_ratio.end()));
    w.set_f32(a + "attention.compress_rope_freq_base", hp.compress_rope_base);
    w.set_u32(a + "hyper_connection.count", static_cast<uint32_t>(hp.n_hc));
    w.set_u32(a + "hyper_connection.sinkhorn_iterations", static_cast<uint32_t>(hp.sinkhorn_iters));
    w.set_f32(a + "hyper_connection.epsilon", hp.hc_eps);
    w.set_u32(a + "hash_layer_count", static_cast<uint32_t>(hp.n_hash_layer));
    w.set_u32(a + "embedding_length_out", static_cast<uint32_t>(hp.n_hc * hp.n_embd));
    // Tokenizer: BOS/EOS, the 256 byte tokens, then unused control tokens up to vocab_size; no merges.
    std::vector<std::string> toks = {"<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",
                                     "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"};
    for (auto &b : byte_tokens()) toks.push_back(b);
    std::vector<int32_t> types(toks.size(), 1);
    types[0] = types[1] = 3;
    for (int i = static_cast<int>(toks.size()); i < hp.n_vocab; ++i) {
        toks.push_back("<\xEF\xBD\x9C" "synth_" + std::to_string(i) + "\xEF\xBD\x9C>");
        types.push_back(3);
    }
    w.set_string("tokenizer.ggml.model", "gpt2");
    w.set_string("tokenizer.ggml.pre", "default");
    w.set_arr_str("tokenizer.ggml.tokens", toks);
    w.set_arr_i32("tokenizer.ggml.token_type", types);
    w.set_arr_str("tokenizer.ggml.merges", {});
    w.set_u32("tokenizer.ggml.bos_token_id", 0);
    w.set_u32("tokenizer.ggml.eos_token_id", 1);
    w.set_bool("tokenizer.ggml.add_bos_token", true);
}

// DSpark drafter metadata: the keys lucebox's loader reads (prefix `deepseek4-dflash-draft.`), with the
// types of the golden drafter file (../shared/golden/ds4-tiny-dspark/README.md, "Metadata").
void write_dspark_metadata(gguf::writer &w, const hparams &hp, const dspark_synth &d,
                           const synth_options &o) {
    const std::string a = "deepseek4-dflash-draft.";
    const auto u = [](int v) { return static_cast<uint32_t>(v); };
    w.set_string("general.architecture", "deepseek4-dflash-draft");
    w.set_string("general.name", o.name.empty() ? "ds4-synth-dspark" : o.name);
    if (o.sparse) w.set_u64("fathom.synth.replicate_rows", static_cast<uint64_t>(o.pool_rows));
    w.set_u32(a + "block_count", u(d.n_stages));
    w.set_u32(a + "embedding_length", u(hp.n_embd));
    w.set_u32(a + "vocab_size", u(hp.n_vocab));
    w.set_u32(a + "attention.head_count", u(hp.n_head));
    w.set_u32(a + "attention.head_count_kv", 1);
    w.set_u32(a + "attention.key_length", u(hp.head_dim));
    w.set_u32(a + "attention.value_length", u(hp.head_dim));
    w.set_u32(a + "rope.dimension_count", u(hp.n_rot));
    w.set_u32(a + "attention.q_lora_rank", u(hp.q_lora));
    w.set_u32(a + "attention.output_lora_rank", u(hp.o_rank));
    w.set_u32(a + "attention.output_group_count", u(hp.o_groups));
    w.set_u32(a + "expert_count", u(hp.n_expert));
    w.set_u32(a + "expert_used_count", u(hp.n_expert_used));
    w.set_u32(a + "expert_shared_count", u(hp.n_expert_shared));
    w.set_u32(a + "expert_feed_forward_length", u(hp.n_ff_exp));
    w.set_u32(a + "expert_gating_func", 4);
    w.set_bool(a + "expert_weights_norm", true);
    w.set_f32(a + "expert_weights_scale", hp.expert_weights_scale);
    w.set_u32(a + "hash_layer_count", 0);
    w.set_u32(a + "attention.sliding_window", u(d.window));
    w.set_u32(a + "hyper_connection.count", u(hp.n_hc));
    w.set_u32(a + "hyper_connection.sinkhorn_iterations", u(hp.sinkhorn_iters));
    w.set_f32(a + "hyper_connection.epsilon", hp.hc_eps);
    w.set_f32(a + "attention.layer_norm_rms_epsilon", hp.rms_eps);
    w.set_f32(a + "rope.freq_base", hp.rope_base);
    w.set_f32(a + "swiglu_clamp_exp", hp.clamp_exp.back());  // lucebox: one F32 scalar
    w.set_arr_i32(a + "attention.compress_ratios", std::vector<int32_t>(static_cast<size_t>(d.n_stages), 0));
    w.set_u32(a + "dflash.n_target_layers", u(static_cast<int>(d.capture_layers.size())));
    w.set_u32(a + "dflash.block_size", u(d.block_size));
    w.set_u32(a + "dflash.mask_token_id", static_cast<uint32_t>(d.noise_token));
    w.set_u32(a + "dflash.head_hc_enabled", 1);
    w.set_arr_i32(a + "dflash.capture_layer_ids",
                  std::vector<int32_t>(d.capture_layers.begin(), d.capture_layers.end()));
    w.set_u32(a + "dflash.dspark.enabled", 1);
    w.set_u32(a + "dflash.dspark.markov_rank", u(d.markov_rank));
    w.set_u32(a + "dflash.dspark.vocab_size", u(hp.n_vocab));
    w.set_u32(a + "dflash.dspark.confidence_dim", u(hp.n_embd + d.markov_rank));
    w.set_u32(a + "dflash.dspark.n_stages", u(d.n_stages));
}

// Header, then every tensor's seeded values, streamed; returns the tensor-data bytes written.
uint64_t write_file(const std::string &path, const std::vector<tensor_spec> &specs, const hparams &hp,
                    const synth_options &o, const std::function<void(gguf::writer &)> &metadata) {
    if (o.pool_rows < 0) throw error("synth: pool rows must be >= 0, got " + std::to_string(o.pool_rows));
    if (o.sparse && o.pool_rows == 0) throw error("synth: a sparse file needs a row pool (pool rows > 0)");
    gguf::writer w(path);
    metadata(w);
    uint64_t total = 0;
    for (const auto &t : specs) {
        w.add_tensor(t.name, t.type, t.ne);
        int64_t rows = 1;
        for (size_t i = 1; i < t.ne.size(); ++i) rows *= t.ne[i];
        total += dtype_row_bytes(t.type, t.ne[0]) * static_cast<uint64_t>(rows);
    }
    w.write_header();
    uint64_t done = 0;
    tensor_streamer out(w, done);
    for (const auto &t : specs) {
        write_tensor(t, hp, o, out);
        if (o.on_progress) o.on_progress(done, total);
    }
    w.finish();
    return done;
}

}  // namespace

hparams synth_preset(const std::string &name) {
    hparams hp;
    hp.n_hc = 4;
    hp.sinkhorn_iters = 20;
    hp.hc_eps = 1e-6f;
    hp.rms_eps = 1e-6f;
    hp.rope_base = 10000.0f;
    hp.compress_rope_base = 160000.0f;
    hp.yarn_factor = 16.0f;
    hp.yarn_beta_fast = 32.0f;
    hp.yarn_beta_slow = 1.0f;
    hp.expert_weights_scale = 1.5f;
    hp.n_expert_shared = 1;
    hp.n_rot = 64;
    hp.idx_dim = 128;
    float clamp = 0;
    if (name == "tiny") {  // ds4-tiny-a (../shared/golden/ds4-tiny/README.md)
        hp.n_layer = 6, hp.n_embd = 128, hp.n_vocab = 512, hp.n_head = 4, hp.head_dim = 192, hp.q_lora = 64;
        hp.o_groups = 2, hp.o_rank = 32, hp.window = 32, hp.n_expert = 8, hp.n_expert_used = 2, hp.n_ff_exp = 48;
        hp.idx_head = 16, hp.idx_topk = 16, hp.yarn_orig_ctx = 1024;
        clamp = 1.5f;
    } else if (name == "flash") {  // DeepSeek-V4-Flash (spec section 1)
        hp.n_layer = 43, hp.n_embd = 4096, hp.n_vocab = 129280, hp.n_head = 64, hp.head_dim = 512;
        hp.q_lora = 1024, hp.o_groups = 8, hp.o_rank = 1024, hp.window = 128, hp.n_expert = 256;
        hp.n_expert_used = 6, hp.n_ff_exp = 2048, hp.idx_head = 64, hp.idx_topk = 512, hp.yarn_orig_ctx = 65536;
        clamp = 10.0f;
    } else {
        throw error("synth: unknown preset '" + name + "' (expected tiny or flash)");
    }
    synth_fix_layers(hp, clamp);
    return hp;
}

void synth_fix_layers(hparams &hp, float clamp) {
    if (hp.n_layer < 1) throw error("synth: layers must be >= 1, got " + std::to_string(hp.n_layer));
    hp.n_nextn = 0;
    hp.compress_ratio.clear();
    for (int il = 0; il < hp.n_layer; ++il) hp.compress_ratio.push_back(il < 2 ? 0 : il % 2 == 0 ? 4 : 128);
    hp.clamp_exp.assign(static_cast<size_t>(hp.n_layer), clamp);
    hp.clamp_shexp = hp.clamp_exp;
    hp.n_hash_layer = std::min(3, hp.n_layer);
}

void synth_check(const hparams &hp) {
    auto need = [](bool ok, const std::string &msg) {
        if (!ok) throw error("synth: " + msg);
    };
    for (auto [v, n] : {std::pair{hp.n_embd, "dim"}, {hp.n_vocab, "vocab"}, {hp.n_head, "heads"},
                        {hp.n_expert, "experts"}, {hp.n_expert_used, "experts-used"}, {hp.n_ff_exp, "ff"},
                        {hp.q_lora, "q-lora"}, {hp.window, "window"}, {hp.o_groups, "output groups"}})
        need(v > 0 && v <= (1 << 24), std::string(n) + " = " + std::to_string(v) + " out of range [1, 2^24]");
    need(hp.n_vocab >= 258, "vocab must be >= 258 (BOS, EOS and 256 byte tokens), got " + std::to_string(hp.n_vocab));
    need(hp.n_expert_used <= hp.n_expert, "experts-used exceeds experts");
    need(hp.n_head % hp.o_groups == 0, "heads must be a multiple of the output groups");
    need((hp.head_dim - hp.n_rot) % 64 == 0 && hp.n_rot < hp.head_dim, "head dim - RoPE dims must be a positive multiple of 64");
    need(std::has_single_bit(static_cast<unsigned>(hp.idx_dim)) && hp.idx_dim >= 32 && hp.n_rot <= hp.idx_dim,
         "indexer key length must be a power of two >= 32 and >= the RoPE dims");
    need(hp.n_nextn == 0, "the geometry counts MTP blocks (n_nextn); ask for one with the mtp option instead");
    need(static_cast<int>(hp.compress_ratio.size()) == hp.n_layer && static_cast<int>(hp.clamp_exp.size()) == hp.n_layer,
         "per-layer arrays do not match the layer count");
}

uint64_t synth_write(const std::string &path, const hparams &hp, const synth_options &o) {
    synth_check(hp);
    std::vector<tensor_spec> specs = tensor_list(hp, o.mix);
    hparams fh = hp;  // the file's keys: with the MTP block, block_count and the per-block arrays grow by one
    if (o.mtp) {
        fh.n_nextn = 1;
        fh.compress_ratio.push_back(0);
        fh.clamp_exp.push_back(hp.clamp_exp.back());
        fh.clamp_shexp.push_back(hp.clamp_shexp.back());
        mtp_tensors(specs, hp, o.mix);
    }
    return write_file(path, specs, hp, o, [&](gguf::writer &w) { write_metadata(w, fh, o); });
}

dspark_synth synth_dspark_preset(const std::string &name, const hparams &target) {
    dspark_synth d;
    d.window = target.window;  // the stages see the target's raw window of context rows
    for (int l = std::max(0, target.n_layer - 3); l < target.n_layer; ++l) d.capture_layers.push_back(l);
    if (name == "tiny") {  // as ../shared/golden/ds4-tiny-dspark: rank 32, noise = the last id
        d.markov_rank = 32;
        d.noise_token = target.n_vocab - 1;
    } else if (name == "flash") {  // DeepSeek-V4-Flash-DSpark (spec sections 1 and 7)
        d.markov_rank = 256;
        d.noise_token = target.n_vocab > 128799 ? 128799 : target.n_vocab - 1;
    } else {
        throw error("synth: unknown DSpark preset '" + name + "' (expected tiny or flash)");
    }
    return d;
}

uint64_t synth_write_dspark(const std::string &path, const hparams &target, const dspark_synth &d,
                            const synth_options &o) {
    synth_check(target);
    if (o.mtp) throw error("synth: an MTP block belongs to a target file, not to a DSpark drafter");
    if (d.n_stages < 1 || d.block_size < 1 || d.markov_rank < 1 || d.window < 1 || d.capture_layers.empty())
        throw error(
            "synth: a DSpark drafter needs stages, block size, Markov rank, window and capture layers >= 1");
    if (d.noise_token < 0 || d.noise_token >= target.n_vocab)
        throw error("synth: DSpark noise token " + std::to_string(d.noise_token) + " outside the vocabulary");
    for (int l : d.capture_layers)
        if (l < 0 || l >= target.n_layer)
            throw error("synth: DSpark capture layer " + std::to_string(l) + " outside the target's layers");
    // Own random streams: the stages' tensor names are the target's block names.
    synth_options od = o;
    od.seed = o.seed ^ 0x64737061726b0000ull;  // "dspark"
    return write_file(path, dspark_tensor_list(target, d, o.mix), target, od,
                      [&](gguf::writer &w) { write_dspark_metadata(w, target, d, o); });
}

}  // namespace fathom::ds4
