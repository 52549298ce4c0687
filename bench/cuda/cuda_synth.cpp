// cuda_synth ARCH OUT [N_LAYER] [WEIGHT_TYPE]: writes a synthetic dense model with a real geometry
// (dense_geometry.h: llama = SmolLM2-135M, qwen3 = Qwen3-0.6B, gemma3 = Gemma3-270M) for
// `fathom bench --device cuda` on the device machine, where the real files cannot be carried.
// WEIGHT_TYPE gives every matrix one type (e.g. q8_0, how Qwen3-0.6B is released) instead of the
// tests' f32-heavy mix.
// Vocab files come from $FATHOM_CUDA_VOCAB_DIR (else FATHOM_SHARED_DIR/tokenizer-tests).
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "core/error.h"
#include "models/cuda/dense_geometry.h"

int main(int argc, char **argv) {
    if (argc < 3 || argc > 5) {
        std::fprintf(stderr, "usage: cuda_synth llama|qwen3|gemma3 OUT.gguf [N_LAYER (0 = the real count)] "
                             "[WEIGHT_TYPE: f32|f16|q8_0|q4_0|q4_k, default the test mix]\n");
        return 2;
    }
    const fathom::cuda_test::family *f = fathom::cuda_test::find_family(argv[1]);
    if (!f) {
        std::fprintf(stderr, "cuda_synth: unknown arch '%s' (llama, qwen3, gemma3)\n", argv[1]);
        return 2;
    }
    const std::string vocab_dir = fathom::cuda_test::vocab_dir();
    try {
        std::optional<fathom::dtype> wt;
        if (argc == 5) {
            const std::string name = argv[4];
            for (fathom::dtype t : {fathom::dtype::f32, fathom::dtype::f16, fathom::dtype::q8_0, fathom::dtype::q4_0,
                                    fathom::dtype::q4_k})
                if (name == fathom::dtype_name(t)) wt = t;
            if (!wt) {
                std::fprintf(stderr, "cuda_synth: unknown weight type '%s'\n", argv[4]);
                return 2;
            }
        }
        fathom::cuda_test::write_family_model(*f, vocab_dir, argv[2], argc >= 4 ? std::atoi(argv[3]) : 0, -1, wt);
    } catch (const fathom::error &e) {
        std::fprintf(stderr, "cuda_synth: %s\n", e.what());
        return 1;
    }
    std::printf("%s\n", argv[2]);
    return 0;
}
