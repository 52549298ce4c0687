#!/usr/bin/env python3
"""N-gram (prompt-lookup) speculative decoding: Fathom vs llama.cpp, same GGUF, same prompts, same run.

llama.cpp through `llama-cpp-python` (test-time only: `pip install llama-cpp-python`): plain greedy decoding
and `draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K)`. Fathom: `fathom run --no-chat --temp 0` plain
and `--spec ngram --draft-max K`. Raw-text prompts (no chat template), so both engines see the same tokens.
Decode rate: generated tokens after the first / time after the first (llama.cpp), the stats line's decode
rate (Fathom). R repetitions alternating, median reported.

Usage: python3 bench/spec_vs_llamacpp.py --fathom build/fathom -m models/gemma-3-270m-q4_k_m.gguf [-t 2] [-n 128]
"""
import argparse
import re
import statistics
import subprocess
import sys
import time

PROMPTS = {
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
            "def div(a, b):\n    return a / b\n\ndef add3(a, b, c):\n    return a + b + c\n\ndef sub3(a, b, c):\n",
    "list": "1. apple\n2. banana\n3. cherry\n4. apple\n5. banana\n6. cherry\n7. apple\n8. banana\n9.",
    "prose": "The history of the lighthouse begins in the ancient world, where fires were lit on hills to guide ships.",
}


def fathom(exe, model, threads, n, prompt, spec, k):
    args = [exe, "run", "--no-chat", "-m", model, "-t", str(threads), "-n", str(n), "--temp", "0", "-p", prompt]
    if spec:
        args += ["--spec", "ngram", "--draft-max", str(k)]
    p = subprocess.run(args, capture_output=True, text=True, errors="replace", check=True)
    m = re.search(r"decode: (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\)", p.stderr)
    return float(m.group(3)), int(m.group(1))


def llamacpp(llm, prompt_tokens, n):
    llm.reset()
    t_first = None
    count = 0
    t0 = time.perf_counter()
    for tok in llm.generate(prompt_tokens, temp=0.0, top_k=1, reset=True):
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
        if tok == llm.token_eos() or count >= n:
            break
    t1 = time.perf_counter()
    return (count - 1) / (t1 - t_first) if count > 1 else 0.0, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", default="build/fathom")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-k", "--draft-max", type=int, default=8)
    a = ap.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    plain = Llama(model_path=a.model, n_ctx=2048, n_threads=a.threads, n_batch=512, verbose=False)
    lookup = Llama(model_path=a.model, n_ctx=2048, n_threads=a.threads, n_batch=512, verbose=False,
                   draft_model=LlamaPromptLookupDecoding(num_pred_tokens=a.draft_max))
    print("| prompt | llama.cpp plain | llama.cpp lookup | speed-up | fathom plain | fathom ngram | speed-up | "
          "fathom ngram / llama.cpp lookup |")
    print("|---|---|---|---|---|---|---|---|")
    for name, text in PROMPTS.items():
        toks = plain.tokenize(text.encode(), add_bos=True)
        r = {"lp": [], "ll": [], "fp": [], "fs": []}
        for _ in range(a.reps):
            r["lp"].append(llamacpp(plain, toks, a.n)[0])
            r["ll"].append(llamacpp(lookup, toks, a.n)[0])
            r["fp"].append(fathom(a.fathom, a.model, a.threads, a.n, text, False, a.draft_max)[0])
            r["fs"].append(fathom(a.fathom, a.model, a.threads, a.n, text, True, a.draft_max)[0])
        m = {k: statistics.median(v) for k, v in r.items()}
        print(f"| {name} | {m['lp']:.1f} | {m['ll']:.1f} | {m['ll'] / m['lp']:.2f}x | {m['fp']:.1f} | {m['fs']:.1f} | "
              f"{m['fs'] / m['fp']:.2f}x | **{m['fs'] / m['ll']:.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
