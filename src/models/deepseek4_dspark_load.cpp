// DSpark drafter loading (see deepseek4_dspark.h): lucebox's `deepseek4-dflash-draft` GGUF, every key
// and tensor checked against the target, errors of one line naming the key or tensor.
#include <cmath>

#include "core/error.h"
#include "gguf/gguf.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_impl.h"

namespace fathom::ds4 {

namespace {

const std::string arch_name = "deepseek4-dflash-draft";
const std::string kp = arch_name + ".";  // key prefix

// Reads `<prefix><key>` values with messages naming the file and the full key.
struct key_reader {
    const gguf::file &f;
    std::string where() const { return f.path() + ": "; }
    [[noreturn]] void fail(const std::string &key, const std::string &msg) const {
        throw error(where() + "metadata key " + kp + key + " " + msg);
    }
    int pos_int(const std::string &key, int64_t max_value = 1 << 30) const {
        if (!f.has(kp + key)) fail(key, "is missing");
        const int64_t v = f.get_int(kp + key);
        if (v <= 0 || v > max_value)
            fail(key, "= " + std::to_string(v) + " out of range [1, " + std::to_string(max_value) + "]");
        return static_cast<int>(v);
    }
    int64_t any_int(const std::string &key) const {
        if (!f.has(kp + key)) fail(key, "is missing");
        return f.get_int(kp + key);
    }
    float pos_float(const std::string &key) const {
        if (!f.has(kp + key)) fail(key, "is missing");
        const double v = f.get_float(kp + key);
        if (!(v > 0.0) || !std::isfinite(v))
            fail(key, "= " + std::to_string(v) + " must be positive and finite");
        return static_cast<float>(v);
    }
    void expect(const std::string &key, int64_t got, int64_t want, const std::string &why) const {
        if (got != want)
            fail(key, "= " + std::to_string(got) + ", expected " + std::to_string(want) + " (" + why + ")");
    }
};

// The stages' geometry from the drafter's keys. D, vocab and HC streams must be the target's: the
// block input is the target's embedding, the base logits its output head.
hparams read_stage_hparams(const key_reader &k, const hparams &target) {
    hparams hp;
    hp.n_embd = k.pos_int("embedding_length");
    k.expect("embedding_length", hp.n_embd, target.n_embd, "the target's embedding_length");
    hp.n_vocab = k.pos_int("vocab_size");
    k.expect("vocab_size", hp.n_vocab, target.n_vocab, "the target's vocab_size");
    hp.n_hc = k.pos_int("hyper_connection.count");
    k.expect("hyper_connection.count", hp.n_hc, target.n_hc, "the target's hyper_connection.count");
    hp.n_head = k.pos_int("attention.head_count");
    k.expect("attention.head_count_kv", k.any_int("attention.head_count_kv"), 1, "one shared K=V row");
    hp.head_dim = k.pos_int("attention.key_length");
    k.expect("attention.value_length", k.any_int("attention.value_length"), hp.head_dim, "K = V");
    hp.n_rot = k.pos_int("rope.dimension_count");
    hp.q_lora = k.pos_int("attention.q_lora_rank");
    hp.o_rank = k.pos_int("attention.output_lora_rank");
    hp.o_groups = k.pos_int("attention.output_group_count");
    hp.window = k.pos_int("attention.sliding_window");
    hp.n_expert = k.pos_int("expert_count");
    hp.n_expert_used = k.pos_int("expert_used_count");
    hp.n_expert_shared = static_cast<int>(k.any_int("expert_shared_count"));
    hp.n_ff_exp = k.pos_int("expert_feed_forward_length");
    hp.sinkhorn_iters = k.pos_int("hyper_connection.sinkhorn_iterations");
    hp.hc_eps = k.pos_float("hyper_connection.epsilon");
    hp.rms_eps = k.pos_float("attention.layer_norm_rms_epsilon");
    hp.rope_base = k.pos_float("rope.freq_base");
    hp.expert_weights_scale = k.pos_float("expert_weights_scale");
    // Structural constraints of the stage body (same rules as the target loader).
    if (hp.n_rot % 2 != 0 || hp.n_rot >= hp.head_dim || (hp.head_dim - hp.n_rot) % 64 != 0)
        k.fail("rope.dimension_count",
               "= " + std::to_string(hp.n_rot) +
                   ": must be even, below attention.key_length, and leave a multiple of 64 dims");
    if (hp.n_head % hp.o_groups != 0)
        k.fail("attention.output_group_count",
               "= " + std::to_string(hp.o_groups) + " does not divide the heads");
    if (hp.n_expert_used > hp.n_expert) k.fail("expert_used_count", "exceeds expert_count");
    if (hp.n_expert_shared < 0 || hp.n_expert_shared > 1)
        k.fail("expert_shared_count", "unsupported (0 or 1)");
    if (k.f.has(kp + "hash_layer_count"))
        k.expect("hash_layer_count", k.any_int("hash_layer_count"), 0, "learned routing");
    if (k.f.has(kp + "expert_gating_func"))
        k.expect("expert_gating_func", k.any_int("expert_gating_func"), 4, "sqrt-softplus");
    if (k.f.has(kp + "expert_weights_norm") && !k.f.get_bool(kp + "expert_weights_norm"))
        k.fail("expert_weights_norm", "must be true");
    return hp;
}

dspark_config read_config(const key_reader &k, const hparams &hp, const hparams &target) {
    dspark_config c;
    c.n_stages = k.pos_int("block_count", 64);
    c.block_size = k.pos_int("dflash.block_size", 64);
    c.window = hp.window;
    const int64_t noise = k.any_int("dflash.mask_token_id");
    if (noise < 0 || noise >= hp.n_vocab)
        k.fail("dflash.mask_token_id", "= " + std::to_string(noise) + " outside the vocabulary [0, " +
                                           std::to_string(hp.n_vocab) + ")");
    c.noise_token = static_cast<int32_t>(noise);
    if (k.f.has(kp + "dflash.dspark.enabled"))
        k.expect("dflash.dspark.enabled", k.any_int("dflash.dspark.enabled"), 1, "a DSpark head");
    if (k.f.has(kp + "dflash.head_hc_enabled"))
        k.expect("dflash.head_hc_enabled", k.any_int("dflash.head_hc_enabled"), 1, "HC head");
    c.markov_rank = k.pos_int("dflash.dspark.markov_rank");
    if (k.f.has(kp + "dflash.dspark.vocab_size"))
        k.expect("dflash.dspark.vocab_size", k.any_int("dflash.dspark.vocab_size"), hp.n_vocab, "vocab_size");
    if (k.f.has(kp + "dflash.dspark.confidence_dim"))
        k.expect("dflash.dspark.confidence_dim", k.any_int("dflash.dspark.confidence_dim"),
                 int64_t{hp.n_embd} + c.markov_rank, "embedding_length + markov_rank");
    if (!k.f.has(kp + "dflash.capture_layer_ids")) k.fail("dflash.capture_layer_ids", "is missing");
    for (int64_t l : k.f.get_int_array(kp + "dflash.capture_layer_ids")) {
        if (l < 0 || l >= target.n_layer)
            k.fail("dflash.capture_layer_ids", "holds layer " + std::to_string(l) +
                                                   ", outside the target's " +
                                                   std::to_string(target.n_layer) + " layers");
        c.target_layers.push_back(static_cast<int>(l));
    }
    if (c.target_layers.empty()) k.fail("dflash.capture_layer_ids", "is empty");
    if (k.f.has(kp + "dflash.n_target_layers"))
        k.expect("dflash.n_target_layers", k.any_int("dflash.n_target_layers"),
                 static_cast<int64_t>(c.target_layers.size()), "entries of dflash.capture_layer_ids");
    if (k.f.has(kp + "attention.compress_ratios"))
        for (int64_t r : k.f.get_int_array(kp + "attention.compress_ratios"))
            if (r != 0)
                k.fail("attention.compress_ratios",
                       "holds " + std::to_string(r) + ": DSpark stages are window-only (0)");
    return c;
}

// SwiGLU clamp: lucebox stores one F32 scalar; a per-stage array of n_stages values is accepted too.
std::vector<float> read_clamps(const key_reader &k, int n_stages) {
    const std::string key = "swiglu_clamp_exp";
    const gguf::value *v = k.f.find(kp + key);
    if (!v) k.fail(key, "is missing");
    std::vector<double> vals;
    if (v->type == gguf::value_type::array) {
        vals = k.f.get_float_array(kp + key);
        if (vals.size() != static_cast<size_t>(n_stages))
            k.fail(key, "has " + std::to_string(vals.size()) +
                            " entries, expected 1 (scalar) or block_count = " + std::to_string(n_stages));
    } else {
        vals.assign(static_cast<size_t>(n_stages), k.f.get_float(kp + key));
    }
    std::vector<float> out;
    for (double x : vals) {
        if (!(x > 0.0) || !std::isfinite(x))
            k.fail(key, "holds " + std::to_string(x) + ", expected positive values");
        out.push_back(static_cast<float>(x));
    }
    return out;
}

// ---- tensors (deepseek4_impl.h: tensor_shaped / tensor_matrix / tensor_vector, the main loader's) ------

void load_head_tensors(const gguf::file &f, dspark_weights &w) {
    const hparams &hp = w.hp;
    const int64_t D = hp.n_embd, V = hp.n_vocab, r = w.cfg.markov_rank;
    w.fc = tensor_matrix(f, "dflash.fc.weight", w.feature_dim(), D);
    w.hidden_norm = tensor_vector(f, "dflash.hidden_norm.weight", {D});
    w.hc_head.fn = tensor_matrix(f, "output_hc_fn.weight", int64_t{hp.n_hc} * D, hp.n_hc);
    w.hc_head.base = tensor_vector(f, "output_hc_base.weight", {hp.n_hc});
    w.hc_head.scale = tensor_vector(f, "output_hc_scale.weight", {1});
    w.output_norm = tensor_vector(f, "output_norm.weight", {D});
    // Both Markov tensors are torch [V, r] (ggml {r, V}): a transposed one fails the shape check,
    // since r differs from V (and D) in every real and test file.
    w.markov_w1 = tensor_matrix(f, "dflash.dspark.markov.w1", r, V);
    w.markov_w2 = tensor_matrix(f, "dflash.dspark.markov.w2", r, V);
    w.conf_w = tensor_vector(f, "dflash.dspark.confidence.weight", {D + r, 1});
    if (f.find_tensor("dflash.dspark.confidence.bias"))
        w.conf_bias = tensor_vector(f, "dflash.dspark.confidence.bias", {1})[0];
}

}  // namespace

std::unique_ptr<dspark_weights> load_dspark(const model &target, std::shared_ptr<const gguf::file> fp) {
    const gguf::file &f = *fp;
    const std::string arch(f.get_string("general.architecture", ""));
    if (arch != arch_name)
        throw error(f.path() + ": general.architecture = '" + arch + "', expected '" + arch_name +
                    "' (a DSpark drafter file)");
    const key_reader k{f};
    auto w = std::make_unique<dspark_weights>();
    w->hp = read_stage_hparams(k, target.hp);
    w->cfg = read_config(k, w->hp, target.hp);
    const std::vector<float> clamps = read_clamps(k, w->cfg.n_stages);
    // Per-stage arrays of the hparams (read by the block code only through layer_weights).
    w->hp.n_layer = w->cfg.n_stages;
    w->hp.compress_ratio.assign(static_cast<size_t>(w->cfg.n_stages), 0);
    w->hp.clamp_exp = clamps;
    w->hp.clamp_shexp = clamps;
    for (int s = 0; s < w->cfg.n_stages; ++s) {
        const float c = clamps[static_cast<size_t>(s)];
        w->stages.push_back(load_layer(f, w->hp, "blk." + std::to_string(s) + ".", 0, false, c, c));
    }
    load_head_tensors(f, *w);
    w->file = std::move(fp);
    return w;
}

std::unique_ptr<dspark_weights> load_dspark(const model &target, const std::string &path) {
    return load_dspark(target, std::shared_ptr<const gguf::file>(gguf::file::open(path)));
}

}  // namespace fathom::ds4
