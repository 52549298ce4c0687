// `fathom-gguf synth` subcommand (options and progress line) over ds4::synth_write. Header-only so
// that only the fathom-gguf binary (which links CLI11) compiles it; fathom_gguf.cpp calls
// setup_synth_command(app, rc) once.
//
//   fathom-gguf synth OUT.gguf [--preset tiny|flash] [--layers N] [--dim D] [--experts E]
//       [--experts-used K] [--ff F] [--vocab V] [--heads H] [--q-lora R] [--window W]
//       [--mix q2|q2k|mxfp4|q4k|q3k|q8_0|f16|f32] [--seed S] [--pool-rows N] [--name NAME] [--sparse]
//       [--mtp | --dspark]
#pragma once
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "models/deepseek4_synth.h"

namespace fathom::ds4 {

struct synth_cli_args {
    std::string out, preset = "tiny";
    int layers = 0, dim = 0, experts = 0, experts_used = 0, ff = 0, vocab = 0, heads = 0, q_lora = 0, window = 0;
    synth_options opt;
    bool dspark = false;  // write the preset's DSpark drafter for this geometry instead of the target
    bool quiet = false;
};

inline int run_synth_command(const synth_cli_args &a) {
    hparams hp = synth_preset(a.preset);
    const float clamp = hp.clamp_exp.front();
    auto over = [](int v, int &field) {
        if (v > 0) field = v;
    };
    over(a.dim, hp.n_embd);
    over(a.experts, hp.n_expert);
    over(a.experts_used, hp.n_expert_used);
    over(a.ff, hp.n_ff_exp);
    over(a.vocab, hp.n_vocab);
    over(a.heads, hp.n_head);
    over(a.q_lora, hp.q_lora);
    over(a.window, hp.window);
    if (a.layers > 0) {
        hp.n_layer = a.layers;
        synth_fix_layers(hp, clamp);
    }
    synth_options o = a.opt;
    int last = -1;
    if (!a.quiet)
        o.on_progress = [&last](uint64_t done, uint64_t total) {
            const int pct = total ? static_cast<int>(done * 100 / total) : 100;
            if (pct != last) std::fprintf(stderr, "\rsynth: %3d%%", pct);
            last = pct;
        };
    if (a.dspark) {
        const dspark_synth d = synth_dspark_preset(a.preset, hp);
        const uint64_t bytes = synth_write_dspark(a.out, hp, d, o);
        if (!a.quiet) std::fprintf(stderr, "\n");
        std::printf(
            "wrote %s: DSpark drafter for a %d-layer target (D %d, vocab %d): %d stages, block %d, "
            "noise %d, Markov rank %d, window %d, capture layers %d..%d, mix %s, seed %llu, "
            "%llu tensor bytes\n",
            a.out.c_str(), hp.n_layer, hp.n_embd, hp.n_vocab, d.n_stages, d.block_size, d.noise_token,
            d.markov_rank, d.window, d.capture_layers.front(), d.capture_layers.back(), o.mix.c_str(),
            static_cast<unsigned long long>(o.seed), static_cast<unsigned long long>(bytes));
        return 0;
    }
    const uint64_t bytes = synth_write(a.out, hp, o);
    if (!a.quiet) std::fprintf(stderr, "\n");
    std::printf("wrote %s: %d layers%s, D %d, %d experts (%d used), vocab %d, mix %s, seed %llu, %llu tensor bytes\n",
                a.out.c_str(), hp.n_layer, o.mtp ? " + 1 MTP block" : "", hp.n_embd, hp.n_expert, hp.n_expert_used,
                hp.n_vocab, o.mix.c_str(),
                static_cast<unsigned long long>(o.seed), static_cast<unsigned long long>(bytes));
    return 0;
}

inline void setup_synth_command(CLI::App &app, int &rc) {
    auto a = std::make_shared<synth_cli_args>();
    CLI::App *s = app.add_subcommand("synth", "Write a DeepSeek-V4 (deepseek4) GGUF with seeded random weights");
    s->add_option("out", a->out, "Output GGUF path")->required();
    s->add_option("--preset", a->preset, "Base geometry: tiny (ds4-tiny-a) or flash (DeepSeek-V4-Flash)")
        ->capture_default_str()
        ->check(CLI::IsMember({"tiny", "flash"}));
    const auto pos = CLI::PositiveNumber;
    s->add_option("--layers", a->layers, "Main-model blocks (ratios follow the Flash rule 0,0,4,128,4,...)")->check(pos);
    s->add_option("--dim", a->dim, "Hidden size D")->check(pos);
    s->add_option("--experts", a->experts, "Routed experts")->check(pos);
    s->add_option("--experts-used", a->experts_used, "Experts per token")->check(pos);
    s->add_option("--ff", a->ff, "Expert FFN width")->check(pos);
    s->add_option("--vocab", a->vocab, "Vocabulary size (>= 258)")->check(pos);
    s->add_option("--heads", a->heads, "Attention heads")->check(pos);
    s->add_option("--q-lora", a->q_lora, "Query low rank")->check(pos);
    s->add_option("--window", a->window, "Raw sliding window")->check(pos);
    s->add_option("--mix", a->opt.mix, "Weight types: q2 (IQ2_XXS/Q2_K experts, Q8_0 projections, F16 small), q2k (all experts Q2_K), "
                  "mxfp4 (4-bit MXFP4 routed experts), q4k (Q4_K_M-like: Q4_K gate/up, Q6_K down and head, Q4_K "
                  "projections), q3k (Q3_K gate/up and projections, Q5_K down, Q6_K head), q8_0, f16, f32")
        ->capture_default_str()
        ->check(CLI::IsMember({"q2", "q2k", "mxfp4", "q4k", "q3k", "q8_0", "f16", "f32"}));
    s->add_option("--seed", a->opt.seed, "Random seed")->capture_default_str();
    s->add_option("--pool-rows", a->opt.pool_rows,
                  "Tensors with more rows draw them from a pool of this many random rows (0 = all rows fresh)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    s->add_option("--name", a->opt.name, "general.name");
    s->add_flag("--sparse", a->opt.sparse,
                "Store each pooled tensor's pool once and leave the rest as a file hole; the CUDA loader "
                "replicates the pool on the device (device-scale benchmarks; the CPU refuses such files)");
    s->add_flag("--mtp", a->opt.mtp,
                "Also write one MTP (nextn) block in llama.cpp's layout (nextn_predict_layers = 1, the block as "
                "blk.<layers>.*, ratio 0, learned routing; its HC collapse is the main model's output_hc_*): "
                "the file then drafts itself with --spec mtp");
    s->add_flag(
        "--dspark", a->dspark,
        "Write a DSpark drafter (deepseek4-dflash-draft) for this target geometry instead: 3 stages, "
        "block 5, the last 3 target layers, the target's window; tiny: Markov rank 32, noise id "
        "vocab-1; flash: rank 256, noise id 128799");
    s->add_flag("-q,--quiet", a->quiet, "No progress line");
    s->callback([a, &rc] { rc = run_synth_command(*a); });
}

}  // namespace fathom::ds4
