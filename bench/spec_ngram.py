#!/usr/bin/env python3
"""N-gram speculative decoding vs plain decoding, same binary, same run (docs/speculative.md).

For each prompt, `fathom run` decodes -n tokens plainly and with `--spec ngram`, alternating, R times; the
texts must be identical (greedy), and the decode rates (from the stats line) are reported: best and median,
their ratio, and the share of drafted tokens kept.

Usage: python3 bench/spec_ngram.py --fathom build/fathom -m smollm2 [-t 2] [-n 160] [-r 3] [--draft-max 8]
"""
import argparse
import re
import statistics
import subprocess
import sys

PROMPTS = {
    "repeat": "Repeat the following paragraph exactly, word for word: The quick brown fox jumps over the lazy "
              "dog. The lazy dog sleeps in the warm sun while the quick brown fox runs across the green field "
              "toward the old wooden fence near the river, where the farmer keeps his three black horses.",
    "code-edit": "Here is a Python function:\n\ndef total(items):\n    result = 0\n    for item in items:\n"
                 "        result = result + item.price * item.quantity\n    return result\n\n"
                 "Rewrite it with the variable `result` renamed to `amount`. Output only the code.",
    "list": "List the numbers from 1 to 30 in words, one per line, like: one, two, three.",
    "open": "Tell me a short story about a lighthouse keeper.",
}


def run(exe, args):
    p = subprocess.run([exe, "run"] + args, capture_output=True, text=True, errors="replace", check=True)
    m = re.search(r"decode: (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\)", p.stderr)
    acc = re.search(r"spec: (\d+) forwards, (\d+) drafted, (\d+) accepted", p.stderr)
    return p.stdout, float(m.group(3)), int(m.group(1)), (tuple(int(x) for x in acc.groups()) if acc else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", default="build/fathom")
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=8)
    a = ap.parse_args()
    base = ["-m", a.model, "-t", str(a.threads), "-n", str(a.n), "--temp", "0"]
    print(f"| prompt | tokens | plain tok/s (best / median) | ngram tok/s (best / median) | ratio (median) | forwards | kept / drafted |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for name, prompt in PROMPTS.items():
        plain, spec = [], []
        for _ in range(a.reps):
            t1, r1, n1, _ = run(a.fathom, base + ["-p", prompt])
            t2, r2, n2, acc = run(a.fathom, base + ["-p", prompt, "--spec", "ngram", "--draft-max", str(a.draft_max)])
            if t1 != t2:
                print(f"{name}: texts differ", file=sys.stderr)
                ok = False
            plain.append(r1)
            spec.append(r2)
        mp, ms = statistics.median(plain), statistics.median(spec)
        print(f"| {name} | {n1} | {max(plain):.1f} / {mp:.1f} | {max(spec):.1f} / {ms:.1f} | {ms / mp:.2f}x | "
              f"{acc[0]} | {acc[2]} / {acc[1]} ({100.0 * acc[2] / max(acc[1], 1):.0f}%) |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
