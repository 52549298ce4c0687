#!/usr/bin/env python3
"""Fathom vs llama.cpp on the same GGUF, same thread count, same run.

llama.cpp is driven through the `llama-cpp-python` PyPI package (test-time only; install it with
`pip install llama-cpp-python`). Prefill: a P-token prompt evaluated in one batch; decode: N tokens one at a
time (greedy). Each side runs R repetitions, alternating, and the best (max tok/s) and median are reported.

Usage: python3 bench/compare_llamacpp.py -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2 [-p 512] [-n 128] [-r 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def llamacpp_run(llm, prompt_tokens, n_gen):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt_tokens)
    t1 = time.perf_counter()
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t2 = time.perf_counter()
    for _ in range(n_gen):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t3 = time.perf_counter()
    return len(prompt_tokens) / (t1 - t0), n_gen / (t3 - t2)


def fathom_run(exe, model, threads, p, n):
    out = subprocess.run([exe, "bench", "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n),
                          "--reps", "1", "--json"], check=True, capture_output=True, text=True).stdout
    d = json.loads(out.strip().splitlines()[-1])
    return d["prefill"]["best_tok_s"], d["decode"]["best_tok_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--fathom", default=os.path.join(os.path.dirname(__file__), "..", "build", "fathom"))
    args = ap.parse_args()

    from llama_cpp import Llama
    import llama_cpp
    # logits_all=False: llama.cpp computes only the last position's logits, as a server would.
    llm = Llama(model_path=args.model, n_ctx=args.prompt + args.gen + 16, n_batch=args.prompt + args.gen + 16,
                n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
    rng = np.random.default_rng(0)
    n_vocab = llm.n_vocab()
    prompt = [int(x) for x in rng.integers(100, min(n_vocab, 30000), size=args.prompt)]

    lp, ld, fp, fd = [], [], [], []
    for _ in range(args.reps):
        a, b = llamacpp_run(llm, prompt, args.gen)
        lp.append(a); ld.append(b)
        c, d = fathom_run(args.fathom, args.model, args.threads, args.prompt, args.gen)
        fp.append(c); fd.append(d)

    res = {
        "model": os.path.basename(args.model), "threads": args.threads, "prompt": args.prompt, "gen": args.gen,
        "llama_cpp_version": llama_cpp.__version__,
        "llamacpp_prefill_best": max(lp), "llamacpp_decode_best": max(ld),
        "fathom_prefill_best": max(fp), "fathom_decode_best": max(fd),
        "llamacpp_prefill_median": statistics.median(lp), "llamacpp_decode_median": statistics.median(ld),
        "fathom_prefill_median": statistics.median(fp), "fathom_decode_median": statistics.median(fd),
    }
    res["prefill_ratio_best"] = res["fathom_prefill_best"] / res["llamacpp_prefill_best"]
    res["decode_ratio_best"] = res["fathom_decode_best"] / res["llamacpp_decode_best"]
    res["prefill_ratio_median"] = res["fathom_prefill_median"] / res["llamacpp_prefill_median"]
    res["decode_ratio_median"] = res["fathom_decode_median"] / res["llamacpp_decode_median"]
    print(f"{'':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   (best of {args.reps}; median in brackets)")
    print(f"{'llama.cpp':10s} {max(lp):14.1f} {max(ld):13.1f}   [{statistics.median(lp):.1f} / {statistics.median(ld):.1f}]")
    print(f"{'fathom':10s} {max(fp):14.1f} {max(fd):13.1f}   [{statistics.median(fp):.1f} / {statistics.median(fd):.1f}]")
    print(f"{'ratio':10s} {res['prefill_ratio_best']:14.2f} {res['decode_ratio_best']:13.2f}   "
          f"[{res['prefill_ratio_median']:.2f} / {res['decode_ratio_median']:.2f}]")
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
