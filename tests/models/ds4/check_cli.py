#!/usr/bin/env python3
"""Black-box check of DS4 through the binaries (tests/models/ds4/tests.cmake):
  * `fathom logits` on ds4-tiny-a in prefill, decode and chunked:7 modes, --kv-type f32, for the
    golden cases len67.no_qat (--qat off) and len67.qat_fp4only (--qat fp4only): every position's
    golden top-8 logits within 1e-3 (the strict tier of ../shared/golden/ds4-tiny/README.md), and the
    three modes bit-identical;
  * `fathom-gguf synth --preset tiny` twice with one seed: identical bytes; `fathom logits` on it:
    finite logits of the right shape.
Independent truth: the golden JSON (official model.py), read with numpy."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}\n{r.stderr}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--fathom-gguf", required=True)
    ap.add_argument("--shared", required=True)
    a = ap.parse_args()
    gdir = os.path.join(a.shared, "golden", "ds4-tiny")
    cases = {json.loads(l)["name"]: json.loads(l) for l in open(os.path.join(gdir, "cases.jsonl")) if l.strip()}
    model = os.path.join(gdir, "ds4-tiny-a.gguf")
    with tempfile.TemporaryDirectory() as td:
        for name, qat in (("len67.no_qat", "off"), ("len67.qat_fp4only", "fp4only")):
            c = cases[name]
            toks = os.path.join(td, "toks.txt")
            with open(toks, "w") as f:
                f.write(" ".join(map(str, c["tokens"])))
            outs = []
            for mode in ("prefill", "decode", "chunked:7"):
                out = os.path.join(td, f"l_{mode.replace(':', '_')}.bin")
                run([a.fathom, "logits", "-m", model, "--tokens-file", toks, "--out", out, "--mode", mode,
                     "--kv-type", "f32", "--qat", qat, "-t", "2"])
                l = np.fromfile(out, dtype=np.float32).reshape(len(c["tokens"]), -1)
                worst = max(abs(float(l[p, i]) - g) for p, row in enumerate(c["top8"]) for i, g in row)
                if worst > 1e-3:
                    sys.exit(f"FAIL: {name} {mode}: max top-8 deviation {worst:.3g} > 1e-3")
                outs.append(l)
            for l in outs[1:]:
                if not np.array_equal(l, outs[0]):
                    sys.exit(f"FAIL: {name}: evaluation modes differ")
            print(f"ok: {name} prefill/decode/chunked:7 within 1e-3 of the golden, bit-identical")
        s1, s2 = os.path.join(td, "s1.gguf"), os.path.join(td, "s2.gguf")
        for s in (s1, s2):
            run([a.fathom_gguf, "synth", s, "--preset", "tiny", "--seed", "9", "-q"])
        if open(s1, "rb").read() != open(s2, "rb").read():
            sys.exit("FAIL: synth is not deterministic for a seed")
        toks = os.path.join(td, "t.txt")
        with open(toks, "w") as f:
            f.write("0 5 9 300 2 2 7")
        out = os.path.join(td, "s.bin")
        run([a.fathom, "logits", "-m", s1, "--tokens-file", toks, "--out", out, "--mode", "decode", "-t", "2"])
        l = np.fromfile(out, dtype=np.float32)
        if l.size != 7 * 512 or not np.isfinite(l).all():
            sys.exit("FAIL: synth model logits have the wrong shape or are not finite")
        print("ok: synth tiny deterministic, loads and evaluates")


if __name__ == "__main__":
    main()
