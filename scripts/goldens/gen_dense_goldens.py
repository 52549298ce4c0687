#!/usr/bin/env python3
"""Produce llama.cpp reference data for Fathom's dense-model tests (run once, output committed).

Reference: llama.cpp through the `llama-cpp-python` PyPI package (test-time only), CPU, on the same GGUF.
For each prompt it records:
  * the prompt's token ids as llama.cpp tokenizes them (special tokens parsed, BOS per the model's metadata);
  * 32 greedy tokens (argmax of llama.cpp's logits, evaluated token by token after a batched prompt prefill),
    with llama.cpp's top-1 minus top-2 logit gap at every step (near-tie rule: after a step whose gap is
    < 0.05, the continuation may legitimately differ);
  * the full logit vector at the last prompt position (the first generated position), stored as float16
    in <name>.logits.f16 (n_prompts x n_vocab, little endian).

Usage: python3 scripts/goldens/gen_dense_goldens.py MODEL.gguf OUT_PREFIX [--threads 2]
Writes OUT_PREFIX.json and OUT_PREFIX.logits.f16.
"""
import argparse
import json
import sys

import numpy as np
from llama_cpp import Llama
import llama_cpp

PROMPTS_TEXT = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Here is a list of the planets in our solar system:\n1.",
    "import numpy as np\n\n# Compute the mean of an array\n",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "Les fleurs du jardin sont",
    "Question: What is 12 times 7?\nAnswer:",
    "{\"name\": \"Alice\", \"age\": 30, \"city\":",
]

CHATML = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
GEMMA_TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
CHAT_QUESTIONS = ["What is the tallest mountain in the world?", "Write a haiku about autumn."]

N_GEN = 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat", choices=["chatml", "gemma", "none"], default="none")
    args = ap.parse_args()

    llm = Llama(model_path=args.model, n_ctx=512, n_batch=512, n_threads=args.threads,
                logits_all=True, verbose=False, seed=0)
    n_vocab = llm.n_vocab()
    add_bos = bool(llm._model.add_bos_token()) if hasattr(llm._model, "add_bos_token") else None
    prompts = list(PROMPTS_TEXT)
    if args.chat == "chatml":
        prompts += [CHATML.format(q) for q in CHAT_QUESTIONS]
    elif args.chat == "gemma":
        prompts += [GEMMA_TURN.format(q) for q in CHAT_QUESTIONS]

    cases = []
    first_logits = np.zeros((len(prompts), n_vocab), dtype=np.float16)
    for i, text in enumerate(prompts):
        toks = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        llm.eval(toks)
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        first_logits[i] = logits.astype(np.float16)
        gen, gaps = [], []
        for _ in range(N_GEN):
            srt = np.argsort(-logits, kind="stable")
            top1, top2 = int(srt[0]), int(srt[1])
            gaps.append(float(logits[top1] - logits[top2]))
            gen.append(top1)
            llm.eval([top1])
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        cases.append({"prompt": text, "tokens": toks, "greedy": gen, "top2_gap": gaps,
                      "min_gap": min(gaps)})
        print(f"[{i}] {len(toks)} prompt tokens, min gap {min(gaps):.4f}: "
              f"{llm.detokenize(gen).decode('utf-8', 'replace')!r}", file=sys.stderr)

    meta = {
        "reference": "llama.cpp via llama-cpp-python " + llama_cpp.__version__,
        "model": args.model.split("/")[-1],
        "n_vocab": n_vocab,
        "threads": args.threads,
        "n_gen": N_GEN,
        "near_tie_gap": 0.05,
        "logits_file": args.out.split("/")[-1] + ".logits.f16",
        "logits_note": "float16 [n_cases x n_vocab], logits at the last prompt position",
        "cases": cases,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    first_logits.tofile(args.out + ".logits.f16")


if __name__ == "__main__":
    main()
