#!/usr/bin/env python3
"""llama.cpp reference logits for Fathom's synthetic qwen3 (and gemma3) GGUFs (run once, output committed).

No real Qwen3 checkpoint is installable here, so the test model is a small random-weight qwen3 that
Fathom's own GGUF writer produces deterministically (`fathom-gguf synth-dense`, src/models/dense_synth.h):
the real Qwen2-family tokenizer (tokens, types, merges, pre=qwen2) copied from
../shared/tokenizer-tests/ggml-vocab-qwen2.gguf, and seeded random weights (f32 norms; f32, f16,
q8_0 and q4_k matrices; q4_0 embeddings, q8_0 output; or f32/f16 only with --float-weights). The test regenerates the file at run time,
checks its SHA-256 against the one recorded here, and compares its logits with these.

Reference: llama.cpp through the `llama-cpp-python` PyPI package (test-time only; CI does not have
it), CPU, n_threads 2, flash attention off, f16 KV cache (llama.cpp's default), logits_all, one
batched evaluation of the whole text (n_batch 512). The text is tokenized by llama.cpp.

Output (OUT_PREFIX.json + OUT_PREFIX.f32, little-endian float32):
  * json: generator arguments and the file's sha256, llama-cpp-python version, the text and its
    token ids, `sample_ids` (512 fixed vocabulary ids drawn with numpy seed 1234), and per
    position: the top-32 ids (descending, stable), the full row's L2 norm and maximum;
  * f32: for each position 32 top logits then 512 sample-id logits ([n_pos x 544]), then the full
    logit row of the last position ([n_vocab]).

Usage:
  python3 scripts/goldens/gen_qwen3_goldens.py --fathom-gguf build/tools/fathom-gguf \
      [--arch qwen3|gemma3] [--seed 1] [--float-weights] [--out tests/models/data/<arch>_synth[_float]_llamacpp]

The committed goldens (tests/models/test_dense_synth_llamacpp.cpp) are the four combinations of
--arch qwen3/gemma3 with and without --float-weights (f32/f16 matrices only), seed 1:
  for a in qwen3 gemma3; do for f in "" --float-weights; do
    python3 scripts/goldens/gen_qwen3_goldens.py --fathom-gguf build/tools/fathom-gguf --arch $a $f; done; done
The gemma3 files reuse the Qwen2 tokenizer (only token ids matter for logits; no Gemma vocab is in
../shared): 6 layers, sliding window 32 on layers 0-4, tied q8_0 (float: f16) embeddings.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import llama_cpp
from llama_cpp import Llama

TEXT = (
    "The lighthouse keeper woke before dawn, as he had every morning for thirty-one years. "
    "He climbed the spiral stairs, counting each of the 117 steps out of habit rather than need, "
    "and checked the lamp, the lens and the small brass clock that had never once been wrong. "
    "Outside, the sea was grey and restless; a fishing boat was making its way back to the harbour, "
    "its engine coughing in the cold air. He wrote in the logbook: \"Wind north-east, force 5. "
    "Visibility moderate. One vessel inbound.\" Then he made tea, strong and sweet, and sat by the "
    "window to watch the light change. In the afternoon a letter arrived from the coastal authority. "
    "The lighthouse, it said, would be automated by the end of the year; a keeper would no longer be "
    "required. He read it twice, folded it carefully, and placed it under the clock. That evening he "
    "lit the lamp as usual, and for a long time he stood on the gallery, listening to the waves break "
    "against the rocks below, thinking about the ships he had guided home and the ones he had not."
)
N_TOP = 32
N_SAMPLE = 512


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom-gguf", required=True, help="path of the built fathom-gguf tool")
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "gemma3"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--float-weights", action="store_true", help="only f32/f16 matrices (no quantised types)")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap.add_argument("--vocab", default=os.path.join(root, "..", "shared", "tokenizer-tests", "ggml-vocab-qwen2.gguf"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    suffix = "_float" if args.float_weights else ""
    out = args.out or os.path.join(root, "tests", "models", "data", f"{args.arch}_synth{suffix}_llamacpp")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"synth_{args.arch}.gguf")
        subprocess.check_call([args.fathom_gguf, "synth-dense", "--arch", args.arch, "--vocab", args.vocab,
                               "--seed", str(args.seed), "-o", path] + (["--float-weights"] if args.float_weights else []))
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        size = os.path.getsize(path)
        llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=args.threads, logits_all=True,
                    flash_attn=False, verbose=False, seed=0)
        n_vocab = llm.n_vocab()
        toks = llm.tokenize(TEXT.encode("utf-8"), add_bos=True, special=False)
        assert 200 <= len(toks) <= 512, len(toks)
        llm.reset()
        llm.eval(toks)
        scores = np.array(llm.scores[: len(toks)], dtype=np.float32)  # [n_pos, n_vocab]
        del llm

    sample_ids = np.sort(np.random.default_rng(1234).choice(n_vocab, N_SAMPLE, replace=False))
    positions, rows = [], []
    for p in range(len(toks)):
        row = scores[p]
        top = np.argsort(-row, kind="stable")[:N_TOP]
        positions.append({"top_ids": [int(i) for i in top],
                          "norm": float(np.linalg.norm(row.astype(np.float64))),
                          "max": float(row.max())})
        rows.append(np.concatenate([row[top], row[sample_ids]]))
    meta = {
        "reference": "llama.cpp via llama-cpp-python " + llama_cpp.__version__,
        "generator": {"tool": "fathom-gguf synth-dense", "arch": args.arch, "seed": args.seed,
                      "float_weights": args.float_weights, "vocab": "ggml-vocab-qwen2.gguf"},
        "gguf_sha256": sha,
        "gguf_bytes": size,
        "threads": args.threads,
        "flash_attn": False,
        "kv_type": "f16",
        "n_vocab": n_vocab,
        "text": TEXT,
        "tokens": [int(t) for t in toks],
        "n_top": N_TOP,
        "sample_ids": [int(i) for i in sample_ids],
        "logits_file": os.path.basename(out) + ".f32",
        "logits_note": "float32: [n_pos x (n_top top-id logits, then sample-id logits)], then the last position's full row",
        "positions": positions,
    }
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=0)
    with open(out + ".f32", "wb") as f:
        np.stack(rows).astype("<f4").tofile(f)
        scores[-1].astype("<f4").tofile(f)
    print(f"{args.arch}: {len(toks)} tokens, sha256 {sha}, {size} bytes -> {out}.json/.f32", file=sys.stderr)


if __name__ == "__main__":
    main()
