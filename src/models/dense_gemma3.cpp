// Family rules for `gemma3` (text decoder), following llama.cpp's gemma3 graph:
//  * embeddings scaled by sqrt(n_embd);
//  * RMSNorm weights are stored as (1 + w) by llama.cpp's converter, so they are used as stored;
//  * pre- and post-norms around attention and FFN (attn_norm, post_attention_norm, ffn_norm,
//    post_ffw_norm), per-head q/k RMSNorm, NeoX RoPE, GeGLU (tanh approximation);
//  * sliding-window layers interleaved with global ones: pattern 6 (every 6th layer global) unless
//    the file says otherwise, window from attention.sliding_window; local layers use RoPE base
//    10000 (or rope.freq_base_swa) without scaling, global layers rope.freq_base and its scaling;
//  * q.k scaled by 1/sqrt(query_pre_attn_scalar): head_dim, except the 27B model (62 layers)
//    where it is n_embd/n_head — as llama.cpp hard-codes it; an explicit
//    attention.query_pre_attn_scalar key overrides;
//  * optional final_logit_softcapping / attn_logit_softcapping keys.
#include <cmath>
#include <string>

#include "core/error.h"
#include "models/dense.h"

namespace fathom {

void dense_hparams_gemma3(const gguf::file &f, dense_hparams &hp) {
    const std::string a = hp.arch;
    hp.rope.mode = rope_mode::neox;
    hp.qk_norm = true;
    hp.post_norms = true;
    hp.embed_scale = true;
    hp.act = glu_kind::geglu;

    hp.n_swa = static_cast<int32_t>(f.get_int(a + ".attention.sliding_window", 0));
    if (hp.n_swa < 0) throw error(f.path() + ": " + a + ".attention.sliding_window negative");
    const std::string pat_key = a + ".attention.sliding_window_pattern";
    const gguf::value *pat = f.find(pat_key);
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        bool swa;
        if (pat && pat->type == gguf::value_type::array) {
            const auto v = f.get_int_array(pat_key);
            if (v.size() != static_cast<size_t>(hp.n_layer)) throw error(f.path() + ": " + pat_key + " length != block_count");
            swa = v[static_cast<size_t>(il)] != 0;
        } else {
            const int64_t period = pat ? f.get_int(pat_key) : 6;
            if (period <= 0) throw error(f.path() + ": " + pat_key + " must be positive");
            swa = (il % period) < period - 1;
        }
        hp.swa_layer[static_cast<size_t>(il)] = swa && hp.n_swa > 0;
    }

    hp.rope_local.freq_base = static_cast<float>(f.get_float(a + ".rope.freq_base_swa", 10000.0));
    hp.rope_local.freq_scale = 1.0f;

    float qpas = hp.n_layer == 62 ? static_cast<float>(hp.n_embd / hp.n_head) : static_cast<float>(hp.head_dim);
    qpas = static_cast<float>(f.get_float(a + ".attention.query_pre_attn_scalar", qpas));
    if (!(qpas > 0.0f)) throw error(f.path() + ": " + a + ".attention.query_pre_attn_scalar must be positive");
    hp.attn_scale = 1.0f / std::sqrt(qpas);
    hp.scale_q = true;  // llama.cpp's gemma3 graph scales Qcur after RoPE, then attends with scale 1
    hp.final_softcap = static_cast<float>(f.get_float(a + ".final_logit_softcapping", 0.0));
    hp.attn_softcap = static_cast<float>(f.get_float(a + ".attn_logit_softcapping", 0.0));
    if (hp.final_softcap < 0 || hp.attn_softcap < 0) throw error(f.path() + ": negative soft-capping value");
}

}  // namespace fathom
