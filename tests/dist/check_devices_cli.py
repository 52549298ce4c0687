#!/usr/bin/env python3
"""Black-box check of `--devices` (DS4 split over several devices of one process) through the
`fathom` binary (tests/dist/tests.cmake, ctest dist_devices_cli), on the ds4-tiny golden model:
  * `fathom run --temp 0` (greedy, chat template and --no-chat) prints the same text with
    --devices cpu,cpu and cpu,cpu,cpu as without, and stderr names each device's blocks;
  * `fathom logits --devices cpu,cpu,cpu` in prefill and decode modes: bit-identical to the one-device
    run, and every position's golden top-8 logits within 1e-3 (strict tier of
    ../shared/golden/ds4-tiny/README.md; independent truth: the official model.py, read with numpy);
  * `--layout tp` (tensor + expert parallel, src/dist/tp.h): `run --devices cpu,cpu --layout tp` prints the
    one-device greedy text and names each rank's heads and experts; `logits` within 1e-3 of the golden top-8
    and within f32 rounding (max |diff| <= 1e-4) of the one-device logits (tp is not bit-identical);
  * bad inputs exit non-zero with a one-line error: malformed lists, more devices than blocks, --device
    together with --devices, CUDA entries in a build or machine without that device, a dense model,
    a tp rank count that does not divide the heads, --layout without --devices."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}\n{r.stderr}")
    return r


def expect_error(cmd, needle):
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    err = r.stderr.strip()
    if r.returncode == 0:
        sys.exit(f"FAIL: {' '.join(cmd)} succeeded; expected an error containing {needle!r}")
    if needle not in err or "\n" in err:
        sys.exit(f"FAIL: {' '.join(cmd)}: expected one line containing {needle!r}, got:\n{err}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--dense", required=True, help="a dense-family GGUF (refused with --devices)")
    a = ap.parse_args()
    gdir = os.path.join(a.shared, "golden", "ds4-tiny")
    model = os.path.join(gdir, "ds4-tiny-a.gguf")
    base = [a.fathom, "run", "-m", model, "-t", "2", "--temp", "0", "-n", "40"]

    layouts = {"cpu,cpu": "devices: pipeline: cpu blocks 0-2 | cpu blocks 3-5",
               "cpu,cpu,cpu": "devices: pipeline: cpu blocks 0-1 | cpu blocks 2-3 | cpu blocks 4-5"}
    for extra in ([], ["--no-chat"]):
        prompt = ["-p", "The capital of France is"]
        want = run(base + prompt + extra).stdout
        if len(want.strip()) == 0:
            sys.exit("FAIL: the one-device run printed no text")
        for devices, layout in layouts.items():
            r = run(base + prompt + extra + ["--devices", devices])
            if r.stdout != want:
                sys.exit(f"FAIL: run --devices {devices} {' '.join(extra)} printed {r.stdout!r}, one device {want!r}")
            if layout not in r.stderr.splitlines():
                sys.exit(f"FAIL: run --devices {devices}: no line {layout!r} on stderr:\n{r.stderr}")
    print("ok: fathom run --devices cpu,cpu and cpu,cpu,cpu print the one-device greedy text")

    tp_layout = "devices: tp: cpu heads 0-1 experts 0-3 | cpu heads 2-3 experts 4-7"
    prompt = ["-p", "The capital of France is"]
    want = run(base + prompt).stdout
    r = run(base + prompt + ["--devices", "cpu,cpu", "--layout", "tp"])
    if r.stdout != want:
        sys.exit(f"FAIL: run --devices cpu,cpu --layout tp printed {r.stdout!r}, one device {want!r}")
    if tp_layout not in r.stderr.splitlines():
        sys.exit(f"FAIL: run --layout tp: no line {tp_layout!r} on stderr:\n{r.stderr}")
    print("ok: fathom run --devices cpu,cpu --layout tp prints the one-device greedy text")

    cases = {json.loads(l)["name"]: json.loads(l) for l in open(os.path.join(gdir, "cases.jsonl")) if l.strip()}
    c = cases["len67.no_qat"]
    with tempfile.TemporaryDirectory() as td:
        toks = os.path.join(td, "toks.txt")
        with open(toks, "w") as f:
            f.write(" ".join(map(str, c["tokens"])))
        for mode in ("prefill", "decode"):
            outs = []
            for devices in ([], ["--devices", "cpu,cpu,cpu"]):
                out = os.path.join(td, f"l_{mode}_{len(devices)}.bin")
                run([a.fathom, "logits", "-m", model, "--tokens-file", toks, "--out", out, "--mode", mode,
                     "--kv-type", "f32", "--qat", "off", "-t", "2"] + devices)
                outs.append(np.fromfile(out, dtype=np.float32).reshape(len(c["tokens"]), -1))
            if not np.array_equal(outs[0], outs[1]):
                sys.exit(f"FAIL: logits {mode}: --devices cpu,cpu,cpu differs from one device")
            worst = max(abs(float(outs[1][p, i]) - g) for p, row in enumerate(c["top8"]) for i, g in row)
            if worst > 1e-3:
                sys.exit(f"FAIL: logits {mode} --devices cpu,cpu,cpu: max top-8 deviation {worst:.3g} > 1e-3")
            out = os.path.join(td, f"l_{mode}_tp.bin")
            run([a.fathom, "logits", "-m", model, "--tokens-file", toks, "--out", out, "--mode", mode,
                 "--kv-type", "f32", "--qat", "off", "-t", "2", "--devices", "cpu,cpu", "--layout", "tp"])
            tp = np.fromfile(out, dtype=np.float32).reshape(len(c["tokens"]), -1)
            diff = float(np.max(np.abs(tp - outs[0])))
            if diff > 1e-4:
                sys.exit(f"FAIL: logits {mode} --layout tp: max |diff| to one device {diff:.3g} > 1e-4")
            worst = max(abs(float(tp[p, i]) - g) for p, row in enumerate(c["top8"]) for i, g in row)
            if worst > 1e-3:
                sys.exit(f"FAIL: logits {mode} --layout tp: max top-8 deviation {worst:.3g} > 1e-3")
            print(f"ok: logits {mode} --layout tp: max |diff| to one device {diff:.3g}, to the golden top-8 {worst:.3g}")
    print("ok: fathom logits --devices cpu,cpu,cpu bit-identical to one device, within 1e-3 of the golden")

    short = [a.fathom, "run", "-m", model, "-t", "1", "-n", "2", "-p", "hi"]
    expect_error(short + ["--devices", "cpu,,cpu"], "expected a comma-separated list of cpu, cuda or cuda:N")
    expect_error(short + ["--devices", "gpu0"], "entry 'gpu0'")
    expect_error(short + ["--devices", ",".join(["cpu"] * 7)], "7 devices for a model of 6 blocks")
    expect_error(short + ["--devices", "cpu,cpu", "--device", "cpu"], "excludes")
    expect_error(short + ["--devices", "cpu,cuda:99"], "entry 2: device 'cuda:99'")
    expect_error([a.fathom, "run", "-m", a.dense, "-t", "1", "-n", "2", "-p", "hi", "--devices", "cpu,cpu"],
                 "supported for DeepSeek V4 (deepseek4) only")
    expect_error(short + ["--devices", "cpu,cpu,cpu", "--layout", "tp"], "the attention heads (4) not divisible by 3")
    expect_error(short + ["--layout", "tp"], "--layout requires --devices")
    print("ok: bad --devices inputs give one-line errors")


if __name__ == "__main__":
    main()
