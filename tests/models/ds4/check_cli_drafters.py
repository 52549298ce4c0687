#!/usr/bin/env python3
"""Black-box check of the DS4 drafters through the binaries (tests/models/ds4/tests.cmake, ctest ds4_cli_drafters):
  * `fathom logits --mtp` on ds4-tiny-a with both MTP file layouts, for the strict MTP goldens
    mtp.len67.no_qat (--qat off, chunked:7 and prefill) and mtp.len5.qat_full (--qat full): every row's
    golden top-8 within 1e-3, the last row's relative L2 <= 1e-4 (../shared/golden/ds4-tiny/README.md);
  * `fathom logits --dspark` for every end-to-end strict case of ../shared/golden/ds4-tiny-dspark
    (base and corrected top-8 within 1e-3, rows' relative L2 <= 1e-4, draft tokens equal, confidence
    and its logit within 1e-4: that README's strict tier);
  * `fathom-gguf synth --dspark`: a tiny drafter for a synthesised tiny target drafts finite blocks
    through `fathom logits --dspark`; a drafter for another vocabulary, a sparse (CUDA-only) drafter,
    or --dspark without --seed-token, is one clear error;
  * `fathom-gguf synth --mtp`: the target drafts for itself (`run --spec mtp` without --draft-model prints
    the plain run's text, `logits --mtp` on the file itself gives finite MTP logits); without --mtp,
    --spec mtp is the engine's clear error; --mtp with --dspark is refused.
Independent truth: the golden JSON, read with numpy; plain decoding's text."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def run(cmd, expect_ok=True, text=True):
    r = subprocess.run(cmd, capture_output=True, text=text)  # text=False: a random model's bytes (not UTF-8)
    if expect_ok and r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}\n{r.stderr}")
    if not expect_ok and r.returncode == 0:
        sys.exit(f"FAIL: expected an error from {' '.join(cmd)}")
    return r


def qat_of(c):
    return "full" if c["qat"]["kv_fp8_e4m3"] else "fp4only" if c["qat"]["indexer_fp4_e2m1"] else "off"


def write_tokens(path, toks):
    with open(path, "w") as f:
        f.write(" ".join(map(str, toks)))


def rel_l2(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


def top8_err(rows, top8):
    return max(abs(float(rows[p, i]) - g) for p, row in enumerate(top8) for i, g in row)


def check_mtp(a, gdir, td):
    cases = {json.loads(l)["name"]: json.loads(l) for l in open(os.path.join(gdir, "mtp_cases.jsonl")) if l.strip()}
    model = os.path.join(gdir, "ds4-tiny-a.gguf")
    for name, modes in (("mtp.len67.no_qat", ("chunked:7", "prefill")), ("mtp.len5.qat_full", ("decode",))):
        c = cases[name]
        toks = os.path.join(td, "mtp_toks.txt")
        write_tokens(toks, c["tokens"])
        for layout in ("gguf_mtp", "gguf_mtp_ds4_names"):
            for mode in modes:
                out = os.path.join(td, "mtp.bin")
                run([a.fathom, "logits", "-m", model, "--mtp", os.path.join(gdir, c[layout]), "--next-token",
                     str(c["next_token"]), "--tokens-file", toks, "--out", out, "--mode", mode, "--kv-type", "f32",
                     "--qat", qat_of(c), "-t", "2"])
                l = np.fromfile(out, dtype="<f4").reshape(len(c["tokens"]), -1)
                e = top8_err(l, c["top8"])
                r = rel_l2(l[-1], c["last_logits"])
                if e > 1e-3 or r > 1e-4:
                    sys.exit(f"FAIL: {name} {layout} {mode}: top-8 error {e:.3g}, last-row rel L2 {r:.3g}")
                print(f"ok: --mtp {name} ({layout}, {mode}): top-8 error {e:.2g}, last-row rel L2 {r:.2g}")


def check_dspark(a, ddir, td):
    target = os.path.join(ddir, "..", "ds4-tiny", "ds4-tiny-a.gguf")
    drafter = os.path.join(ddir, "ds4-tiny-a-dspark.gguf")
    n = 0
    for line in open(os.path.join(ddir, "dspark_cases.jsonl")):
        if not line.strip():
            continue
        c = json.loads(line)
        if c["end_to_end_tier"] != "strict":
            continue
        n += 1
        toks, out = os.path.join(td, "ds_toks.txt"), os.path.join(td, "ds.bin")
        write_tokens(toks, c["tokens"])
        r = run([a.fathom, "logits", "-m", target, "--dspark", drafter, "--seed-token", str(c["seed_token"]),
                 "--tokens-file", toks, "--out", out, "--kv-type", "f32", "--qat", qat_of(c), "-t", "2",
                 "--mode", "chunked:64"])
        s = json.loads(r.stdout)
        l = np.fromfile(out, dtype="<f4").reshape(2, 5, -1)
        why = []
        for k, rows in ((0, "base"), (1, "corrected")):
            e = top8_err(l[k], c[f"{rows}_top8"])
            rl = max(rel_l2(l[k][j], c[f"{rows}_logits"][j]) for j in range(5))
            if e > 1e-3 or rl > 1e-4:
                why.append(f"{rows}: top-8 error {e:.3g}, rel L2 {rl:.3g}")
        if s["draft_tokens"] != c["draft_tokens"] or s["block_input_ids"] != c["block_input_ids"]:
            why.append(f"draft tokens {s['draft_tokens']} != {c['draft_tokens']}")
        if s["ctx_positions"] != c["ctx_positions"] or s["seed_position"] != c["n_tokens"]:
            why.append("context positions differ")
        ce = max(abs(x - g) for x, g in zip(s["confidence_logit"], c["confidence_logit"]))
        cp = max(abs(x - g) for x, g in zip(s["confidence"], c["confidence"]))
        if ce > 1e-4 or cp > 1e-4:
            why.append(f"confidence logit off by {ce:.3g}, confidence by {cp:.3g}")
        if why:
            sys.exit(f"FAIL: --dspark {c['name']}: " + "; ".join(why))
        print(f"ok: --dspark {c['name']}: draft {s['draft_tokens']}, confidence-logit error {ce:.2g}")
    if n != 4:
        sys.exit(f"FAIL: expected 4 end-to-end strict DSpark cases, found {n}")


def check_synth(a, ddir, td):
    t, d = os.path.join(td, "t.gguf"), os.path.join(td, "d.gguf")
    run([a.fathom_gguf, "synth", t, "--preset", "tiny", "--seed", "4", "-q"])
    run([a.fathom_gguf, "synth", d, "--preset", "tiny", "--dspark", "--seed", "4", "-q"])
    toks, out = os.path.join(td, "s.txt"), os.path.join(td, "s.bin")
    write_tokens(toks, [0, 5, 9, 257, 2, 2, 7])
    r = run([a.fathom, "logits", "-m", t, "--dspark", d, "--seed-token", "11", "--tokens-file", toks, "--out", out,
             "-t", "2"])
    s = json.loads(r.stdout)
    l = np.fromfile(out, dtype="<f4")
    if l.size != 2 * 5 * 512 or not np.isfinite(l).all() or len(s["draft_tokens"]) != 5:
        sys.exit("FAIL: the synthesised drafter's block has the wrong shape or is not finite")
    print("ok: synth --dspark tiny drafter drafts through fathom logits --dspark")
    # A drafter for another vocabulary: one line naming the key.
    v = os.path.join(td, "v.gguf")
    run([a.fathom_gguf, "synth", v, "--preset", "tiny", "--vocab", "300", "-q"])
    r = run([a.fathom, "logits", "-m", v, "--dspark", os.path.join(ddir, "ds4-tiny-a-dspark.gguf"), "--seed-token",
             "3", "--tokens-file", toks, "--out", out], expect_ok=False)
    if "vocab_size" not in r.stderr:
        sys.exit(f"FAIL: vocabulary mismatch not named: {r.stderr}")
    r = run([a.fathom, "logits", "-m", t, "--dspark", d, "--tokens-file", toks, "--out", out], expect_ok=False)
    if "--seed-token" not in r.stderr:
        sys.exit(f"FAIL: missing --seed-token not named: {r.stderr}")
    sp = os.path.join(td, "sp.gguf")
    run([a.fathom_gguf, "synth", sp, "--preset", "tiny", "--dspark", "--sparse", "--seed", "4", "-q"])
    r = run([a.fathom, "logits", "-m", t, "--dspark", sp, "--seed-token", "3", "--tokens-file", toks, "--out", out],
            expect_ok=False)
    if "sparse" not in r.stderr:
        sys.exit(f"FAIL: sparse drafter not refused on the CPU: {r.stderr}")
    print("ok: a drafter for another vocabulary, a sparse drafter and a missing --seed-token are refused")


def check_synth_mtp(a, td):
    t, p = os.path.join(td, "tm.gguf"), os.path.join(td, "tp.gguf")
    run([a.fathom_gguf, "synth", t, "--preset", "tiny", "--mtp", "--seed", "4", "-q"])
    run([a.fathom_gguf, "synth", p, "--preset", "tiny", "--seed", "4", "-q"])
    toks, out = os.path.join(td, "m.txt"), os.path.join(td, "m.bin")
    write_tokens(toks, [0, 5, 9, 257, 2, 2, 7])
    run([a.fathom, "logits", "-m", t, "--mtp", t, "--next-token", "11", "--tokens-file", toks, "--out", out, "-t", "2"])
    l = np.fromfile(out, dtype="<f4")
    if l.size != 7 * 512 or not np.isfinite(l).all():
        sys.exit("FAIL: the synthesised MTP head's logits have the wrong shape or are not finite")
    args = [a.fathom, "run", "-m", t, "-p", "one two three one two", "-n", "24", "--temp", "0", "-t", "2"]
    plain, spec = run(args, text=False), run(args + ["--spec", "mtp", "--draft-max", "4"], text=False)
    if plain.stdout != spec.stdout or b"drafted" not in spec.stderr:
        sys.exit(f"FAIL: run --spec mtp on a synth --mtp file: {spec.stdout!r} vs plain {plain.stdout!r}; {spec.stderr[-300:]!r}")
    print("ok: synth --mtp tiny target: logits --mtp on the file itself, run --spec mtp prints the plain text")
    r = run([a.fathom, "run", "-m", p, "-p", "hi", "-n", "2", "--spec", "mtp"], expect_ok=False)
    if "no usable MTP head" not in r.stderr:
        sys.exit(f"FAIL: --spec mtp on a file without an MTP block: {r.stderr}")
    r = run([a.fathom_gguf, "synth", os.path.join(td, "x.gguf"), "--preset", "tiny", "--mtp", "--dspark", "-q"],
            expect_ok=False)
    if "MTP" not in r.stderr:
        sys.exit(f"FAIL: synth --mtp --dspark not refused clearly: {r.stderr}")
    print("ok: --spec mtp without an MTP block and synth --mtp --dspark are refused")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--fathom-gguf", required=True)
    ap.add_argument("--shared", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        check_mtp(a, os.path.join(a.shared, "golden", "ds4-tiny"), td)
        ddir = os.path.join(a.shared, "golden", "ds4-tiny-dspark")
        check_dspark(a, ddir, td)
        check_synth(a, ddir, td)
        check_synth_mtp(a, td)


if __name__ == "__main__":
    main()
