#!/usr/bin/env python3
"""Black-box check of `fathom plan` on ds4-tiny-a.gguf: the per-device weight bytes of the JSON plan
equal the tensor bytes that gguf-py (an independent GGUF reader) reports for the device's blocks plus
the embedding (first device) or the output head (last device); the KV bytes follow the DS4 KV layout
written out here; overrides and errors exit 1 with a one-line message."""
import argparse
import json
import re
import subprocess
import sys

from gguf import GGUFReader


def run(fathom, *args):
    return subprocess.run([fathom, "plan", *args], capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--shared", required=True)
    a = ap.parse_args()
    model = a.shared + "/golden/ds4-tiny/ds4-tiny-a.gguf"
    r = GGUFReader(model)
    nbytes = {t.name: int(t.n_bytes) for t in r.tensors}
    field = lambda k: r.fields["deepseek4." + k].parts[-1].tolist()
    n_layer = int(field("block_count")[0])
    ratios = [int(x) for x in r.fields["deepseek4.attention.compress_ratios"].contents()]
    window, d = int(field("attention.sliding_window")[0]), int(field("attention.key_length")[0])
    di = int(field("attention.indexer.key_length")[0])
    block = [sum(b for n, b in nbytes.items() if n.startswith(f"blk.{i}.")) for i in range(n_layer)]
    ctx = 4096

    def kv(i):  # f16 rows; f32 compressor frontiers (value + score)
        b = window * d * 2
        if ratios[i] > 0:
            b += ctx // ratios[i] * d * 2 + (8 * 2 * d if ratios[i] == 4 else ratios[i] * d) * 8
        if ratios[i] == 4:
            b += ctx // 4 * di * 2 + 8 * 2 * di * 8
        return b

    failures = []
    p = run(a.fathom, "-m", model, "--devices", "cuda:0,cuda:1", "--ctx", str(ctx), "--mem-gib", "2,2",
            "--layers", "0-1,2-5", "--json")
    if p.returncode != 0:
        print(p.stderr)
        return 1
    j = json.loads(p.stdout)
    head = sum(b for n, b in nbytes.items() if not n.startswith("blk.") and n != "token_embd.weight")
    want = [nbytes["token_embd.weight"] + sum(block[0:2]), head + sum(block[2:6])]
    for k, dev in enumerate(j["devices"]):
        if dev["weight_bytes"] != want[k]:
            failures.append(f"device {k}: weight_bytes {dev['weight_bytes']} != {want[k]}")
        lo, hi = dev["first_layer"], dev["last_layer"]
        if dev["kv_bytes"] != sum(kv(i) for i in range(lo, hi + 1)):
            failures.append(f"device {k}: kv_bytes {dev['kv_bytes']} != expected")
        if dev["left_bytes"] != dev["free_bytes"] - dev["used_bytes"]:
            failures.append(f"device {k}: left_bytes inconsistent")
    if [(d_["first_layer"], d_["last_layer"]) for d_ in j["devices"]] != [(0, 1), (2, 5)]:
        failures.append("override ranges not honoured")
    # Text form names both devices; errors are one line on stderr, exit 1.
    t = run(a.fathom, "-m", model, "--devices", "cuda:0,cuda:1", "--ctx", str(ctx), "--mem-gib", "2,2")
    if t.returncode != 0 or not re.search(r"^cuda:1 +3-5 ", t.stdout, re.M):
        failures.append("text plan: " + t.stdout + t.stderr)
    for args, pattern in [(["--mem-gib", "0.5,0.5"], r"plan: does not fit: cuda:"),
                          (["--mem-gib", "2,2", "--layers", "0-2,4-5"], r"layer range 1"),
                          (["--mem-gib", "2"], r"--mem-gib has 1 entries for 2 devices")]:
        e = run(a.fathom, "-m", model, "--devices", "cuda:0,cuda:1", "--ctx", str(ctx), *args)
        if e.returncode != 1 or not re.search(pattern, e.stderr) or e.stderr.count("\n") != 1:
            failures.append(f"{args}: rc {e.returncode} stderr {e.stderr!r}")
    for f in failures:
        print("FAIL:", f)
    print("plan cli:", "ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
