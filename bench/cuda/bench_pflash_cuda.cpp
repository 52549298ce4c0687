// PFlash on one GPU against full prefill (not a ctest; run on the device):
//   bench_pflash_cuda TARGET.gguf DRAFTER.gguf [--lengths 32768,131072] [--keep 0.05] [--window 512]
// TARGET is the DS4 synthetic file (fathom-gguf synth --preset flash --sparse: byte-level tokenizer),
// DRAFTER a dense model (cuda_synth qwen3: the Qwen3-0.6B geometry with the Qwen2 vocabulary). The
// prompt of each length is random decimal digits, one target (byte) token each, which the Qwen2
// tokenizer also splits into one token per digit: the drafter reads as many tokens as the target.
// For each length, on one engine session (reset between runs):
//   full   : sync(prompt) + the first token (device sampler)             -> TTFT_full
//   pflash : compress (drafter on the GPU, loaded beforehand) + sync(kept) + first token -> TTFT_pflash
// and the drafter's share. Synthetic weights make the kept spans meaningless; only time is measured.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "fathom/engine.h"
#include "fathom/error.h"
#include "fathom/pflash.h"
#include "fathom/sampling.h"

using namespace fathom;

using bench_util::now_s;
using bench_util::parse_list;

int main(int argc, char **argv) try {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s TARGET.gguf DRAFTER.gguf [--lengths a,b] [--keep R] [--window W]\n", argv[0]);
        return 2;
    }
    std::vector<int64_t> lengths = {32768, 131072};
    double keep = 0.05;
    int window = 512;
    for (int i = 3; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--lengths" && i + 1 < argc) lengths = parse_list(argv[++i]);
        else if (a == "--keep" && i + 1 < argc) keep = std::atof(argv[++i]);
        else if (a == "--window" && i + 1 < argc) window = std::atoi(argv[++i]);
        else throw error("unknown argument " + a);
    }
    const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
    engine_options eo;
    eo.model_path = argv[1];
    eo.device = "cuda";
    eo.n_ctx = static_cast<int>(max_len + 64);
    double t0 = now_s();
    auto eng = engine::load(eo);
    std::printf("target %s on %s, n_ctx %d, loaded in %.1f s\n", argv[1], eng->info().device.c_str(), eo.n_ctx,
                now_s() - t0);
    pflash::options po;
    po.drafter_path = argv[2];
    po.drafter_device = "cuda";
    po.keep_ratio = keep;
    po.residency = pflash::drafter_residency::keep;
    po.drafter_window = window;
    po.verbatim_last_user = false;
    // drafter_batch: the default (4096 tokens per drafter forward on a GPU)
    t0 = now_s();
    auto comp = pflash::compressor::create(po);
    std::printf("drafter %s on cuda, loaded in %.1f s; keep %.3f, window %d\n", argv[2], now_s() - t0, keep, window);
    // Byte tokens of the synthetic target: id = 2 + byte value (after BOS, EOS).
    std::mt19937 rng(7);
    std::vector<int32_t> prompt(static_cast<size_t>(max_len));
    for (auto &t : prompt) t = 2 + '0' + static_cast<int32_t>(rng() % 10);
    sampling_params sp;
    sp.temperature = 0.0f;
    sampler smp(sp);
    auto sess = eng->new_session();
    {  // warm-up: both paths on a short prompt (graphs, cuBLAS, the drafter's first forward)
        const auto warm = std::span(prompt).first(4096);
        sess->sync(warm);
        (void)sess->sample(smp, {});
        sess->reset();
        const auto r = comp->compress(*eng, warm);
        sess->sync(r.tokens);
        (void)sess->sample(smp, {});
        sess->reset();
    }
    std::printf("%9s %12s %12s %10s %12s %12s %12s %9s\n", "tokens", "full TTFT s", "pflash s", "kept", "drafter s",
                "target s", "select s", "speed-up");
    for (int64_t n : lengths) {
        const auto p = std::span(prompt).first(static_cast<size_t>(n));
        sess->reset();
        t0 = now_s();
        sess->sync(p);
        (void)sess->sample(smp, {});
        const double full = now_s() - t0;
        sess->reset();
        t0 = now_s();
        const pflash::result r = comp->compress(*eng, p);
        const double t1 = now_s();
        sess->sync(r.tokens);
        (void)sess->sample(smp, {});
        const double pf = now_s() - t0, target = now_s() - t1;
        std::printf("%9lld %12.3f %12.3f %10lld %12.3f %12.3f %12.3f %8.1fx\n", static_cast<long long>(n), full, pf,
                    static_cast<long long>(r.n_effective), r.score_s, target, r.select_s, full / pf);
        std::printf("          drafter: %lld tokens, prefill %.3f s, queries %.3f s, scoring %.3f s\n",
                    static_cast<long long>(r.n_drafter_tokens), r.drafter_prefill_s, r.drafter_query_s,
                    r.drafter_attend_s);
    }
    return 0;
} catch (const std::exception &e) {
    std::fprintf(stderr, "bench_pflash_cuda: %s\n", e.what());
    return 1;
}
