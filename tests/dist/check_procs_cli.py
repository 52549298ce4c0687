#!/usr/bin/env python3
"""Black-box check of `--procs` (ranks 1.. as child processes joined over TCP, src/dist/rank_procs.h)
through the `fathom` binary (tests/dist/tests.cmake, ctest dist_procs_cli), on the ds4-tiny golden model:
  * `fathom run --temp 0 --devices cpu,cpu[,cpu] --procs` (pipeline) and `--devices cpu,cpu --layout tp
    --procs` print the same greedy text as the in-process `--devices` run and as one device; stderr names
    the rank processes;
  * `fathom logits` (prefill and decode modes) with --procs: bit-identical to the in-process ranks (pipeline
    2 and 3 ranks; tp 2 ranks) and, for the pipeline, to one device;
  * `fathom serve --devices cpu,cpu --procs` answers a chat completion identically to the in-process
    server; two sessions (--parallel 2) interleaved give the single-session answers; then the child rank is
    SIGKILLed: the server exits non-zero within 5 s with the one line
    `error: dist: rank 1 (pid N) exited: killed by signal 9 (Killed)`, and no rank process is left; with
    three ranks, killing the middle one gives that line for it (not for its neighbour, which also stops);
  * SIGKILLing the server leaves no rank process (PR_SET_PDEATHSIG);
  * `--procs-local 2` with three ranks prints the command for rank 2, which joins when run by hand (the
    two-host launch, on one host) and the text is the same;
  * `--micro-batch 2` (prompt micro-batches down the pipeline, in-process and --procs) prints the same text;
  * no `fathom rank` process survives any of the runs above; --procs without --devices is refused."""
import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}\n{r.stderr}")
    return r


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent reaps it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(stderr):
    m = re.search(r"; processes: (.*)$", stderr, re.M)
    if not m:
        return []
    return [int(x) for x in re.findall(r"rank \d+ pid (\d+)", m.group(1))]


def no_rank_left(pids, what):
    deadline = time.time() + 3
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    if left:
        for p in left:
            os.kill(p, signal.SIGKILL)
        sys.exit(f"FAIL: {what}: rank process(es) {left} still running")


def start_server(cmd):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    err = []
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        err.append(line)
        m = re.search(r"listening on (http://[^ ]+)", line or "")
        if m:
            return proc, m.group(1), "".join(err)
    proc.kill()
    sys.exit(f"FAIL: {' '.join(cmd)} did not start:\n{''.join(err)}{proc.stderr.read()}")


def chat(url, content, max_tokens=12):
    req = urllib.request.Request(url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"messages": [{"role": "user", "content": content}],
                                                  "temperature": 0, "max_tokens": max_tokens}).encode())
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["message"]["content"]


def check_run(a, model):
    base = [a.fathom, "run", "-m", model, "-t", "2", "--temp", "0", "-n", "40", "-p", "The capital of France is"]
    want = run(base).stdout
    if not want.strip():
        sys.exit("FAIL: the one-device run printed no text")
    for extra in (["--devices", "cpu,cpu"], ["--devices", "cpu,cpu,cpu"], ["--devices", "cpu,cpu", "--layout", "tp"]):
        inproc = run(base + extra).stdout
        r = run(base + extra + ["--procs"])
        if r.stdout != want or inproc != want:
            sys.exit(f"FAIL: run {' '.join(extra)} --procs printed {r.stdout!r}, in-process {inproc!r}, one device {want!r}")
        pids = rank_pids(r.stderr)
        if len(pids) != int(extra[1].count(",")):
            sys.exit(f"FAIL: run {' '.join(extra)} --procs: stderr does not name the rank processes:\n{r.stderr}")
        no_rank_left(pids, f"run {' '.join(extra)} --procs")
    print("ok: fathom run --procs (pipeline 2 and 3 ranks, tp 2 ranks) prints the in-process and one-device text")

    # Micro-batches (--micro-batch 2: the prompt goes down the pipeline 2 tokens at a time, back to back;
    # over the rank processes one control message announces all of them): the same text.
    for extra in (["--devices", "cpu,cpu,cpu", "--micro-batch", "2"], ["--devices", "cpu,cpu,cpu", "--micro-batch", "2", "--procs"]):
        r = run(base + extra)
        if r.stdout != want:
            sys.exit(f"FAIL: run {' '.join(extra)} printed {r.stdout!r}, one device {want!r}")
    print("ok: fathom run --micro-batch 2 (in-process and --procs, 3 ranks) prints the one-device text")

    # The two-host launch on one host: rank 2 is not spawned; rank 0 prints its command and waits for it.
    proc = subprocess.Popen(base + ["--devices", "cpu,cpu,cpu", "--procs", "--procs-local", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    line = proc.stderr.readline()
    m = re.match(r"dist: waiting for rank 2: start it with: (.*)$", line.strip())
    if not m or "--parent-pid" in m.group(1):
        proc.kill()
        sys.exit(f"FAIL: --procs-local 2: expected the command for rank 2 on stderr, got {line!r}")
    rank2 = subprocess.run(shlex.split(m.group(1)), capture_output=True, text=True, timeout=60)
    out, err = proc.communicate(timeout=60)
    if proc.returncode != 0 or rank2.returncode != 0 or out != want or "rank 2 joined" not in err:
        sys.exit(f"FAIL: --procs-local 2: rc {proc.returncode} / rank 2 rc {rank2.returncode} {rank2.stderr!r}, "
                 f"printed {out!r} (want {want!r}), stderr {err!r}")
    print("ok: a rank started by hand (--procs-local, the printed command) joins and the text is the same")


def check_logits(a, model, gdir):
    cases = {json.loads(l)["name"]: json.loads(l) for l in open(os.path.join(gdir, "cases.jsonl")) if l.strip()}
    c = cases["len67.no_qat"]
    with tempfile.TemporaryDirectory() as td:
        toks = os.path.join(td, "toks.txt")
        with open(toks, "w") as f:
            f.write(" ".join(map(str, c["tokens"])))

        def logits(mode, extra):
            out = os.path.join(td, "l.bin")
            run([a.fathom, "logits", "-m", model, "--tokens-file", toks, "--out", out, "--mode", mode,
                 "--kv-type", "f32", "--qat", "off", "-t", "2"] + extra)
            return np.fromfile(out, dtype=np.float32).reshape(len(c["tokens"]), -1)

        for mode in ("prefill", "decode"):
            one = logits(mode, [])
            for extra in (["--devices", "cpu,cpu"], ["--devices", "cpu,cpu,cpu"], ["--devices", "cpu,cpu", "--layout", "tp"]):
                inproc = logits(mode, extra)
                procs = logits(mode, extra + ["--procs"])
                if not np.array_equal(procs, inproc):
                    sys.exit(f"FAIL: logits {mode} {' '.join(extra)} --procs differs from the in-process ranks "
                             f"(max |diff| {float(np.max(np.abs(procs - inproc))):.3g})")
                if "tp" not in extra and not np.array_equal(procs, one):
                    sys.exit(f"FAIL: logits {mode} {' '.join(extra)} --procs differs from one device")
    print("ok: fathom logits --procs bit-identical to the in-process ranks (and the pipeline to one device)")


def check_serve(a, model):
    base = [a.fathom, "serve", "-m", model, "-t", "2", "--port", "0", "--ctx", "1024", "--parallel", "2",
            "--devices", "cpu,cpu"]
    prompts = ["Hi", "The capital of France is"]
    srv, url, _ = start_server(base)
    want = [chat(url, p) for p in prompts]
    srv.send_signal(signal.SIGTERM)
    srv.wait(timeout=30)

    srv, url, err = start_server(base + ["--procs"])
    pids = rank_pids(err)
    if len(pids) != 1:
        srv.kill()
        sys.exit(f"FAIL: serve --procs: stderr does not name the rank process:\n{err}")
    got = [chat(url, p) for p in prompts]
    got += [chat(url, p) for p in reversed(prompts)]  # the slots' sessions take turns in the children
    if got != want + list(reversed(want)):
        srv.kill()
        sys.exit(f"FAIL: serve --procs answered {got!r}, the in-process server {want!r}")
    print("ok: fathom serve --procs answers chat completions as the in-process server")

    os.kill(pids[0], signal.SIGKILL)
    t0 = time.time()
    try:
        rc = srv.wait(timeout=10)
    except subprocess.TimeoutExpired:
        srv.kill()
        sys.exit("FAIL: serve --procs still running 10 s after its rank process was killed")
    took = time.time() - t0
    rest = srv.stderr.read().strip().splitlines()
    want_line = f"error: dist: rank 1 (pid {pids[0]}) exited: killed by signal 9 (Killed)"
    if rc == 0 or took > 5 or not rest or rest[-1] != want_line:
        sys.exit(f"FAIL: serve after its rank died: rc {rc} after {took:.2f} s, stderr tail {rest[-3:]!r}; "
                 f"expected a non-zero exit within 5 s with {want_line!r}")
    no_rank_left(pids, "serve after a rank died")
    print(f"ok: serve exits {rc} {took:.2f} s after its rank process is SIGKILLed: {rest[-1]}")

    # Three ranks, the middle one killed while idle: its neighbour notices too (and exits with the "a peer
    # failed first" status), but the server's line names the killed rank.
    srv, url, err = start_server(base[:-1] + ["cpu,cpu,cpu", "--procs"])
    pids = rank_pids(err)
    if len(pids) != 2 or chat(url, prompts[0]) != want[0]:
        srv.kill()
        sys.exit(f"FAIL: serve --devices cpu,cpu,cpu --procs: no rank pids or a different answer:\n{err}")
    os.kill(pids[0], signal.SIGKILL)
    try:
        rc = srv.wait(timeout=10)
    except subprocess.TimeoutExpired:
        srv.kill()
        sys.exit("FAIL: serve (3 ranks) still running 10 s after rank 1 was killed")
    rest = srv.stderr.read().strip().splitlines()
    want_line = f"error: dist: rank 1 (pid {pids[0]}) exited: killed by signal 9 (Killed)"
    if rc == 0 or not rest or rest[-1] != want_line:
        sys.exit(f"FAIL: serve (3 ranks) after rank 1 died: rc {rc}, stderr tail {rest[-3:]!r}; expected {want_line!r}")
    no_rank_left(pids, "serve (3 ranks) after rank 1 died")
    print("ok: serve with 3 rank processes names the killed middle rank, not its neighbour")

    # The parent killed outright: its children die with it (PR_SET_PDEATHSIG).
    srv, url, err = start_server(base[:-1] + ["cpu,cpu,cpu", "--procs"])
    pids = rank_pids(err)
    if len(pids) != 2:
        srv.kill()
        sys.exit(f"FAIL: serve --devices cpu,cpu,cpu --procs: no rank pids on stderr:\n{err}")
    srv.kill()
    srv.wait(timeout=10)
    no_rank_left(pids, "serve SIGKILLed")
    print("ok: a SIGKILLed serve leaves no rank process")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--shared", required=True)
    a = ap.parse_args()
    gdir = os.path.join(a.shared, "golden", "ds4-tiny")
    model = os.path.join(gdir, "ds4-tiny-a.gguf")
    check_run(a, model)
    check_logits(a, model, gdir)
    check_serve(a, model)
    r = subprocess.run([a.fathom, "run", "-m", model, "-n", "1", "-p", "hi", "--procs"], capture_output=True, text=True)
    if r.returncode == 0 or "--procs requires --devices" not in r.stderr:
        sys.exit(f"FAIL: --procs without --devices: rc {r.returncode}, {r.stderr!r}")
    print("ok: --procs without --devices is refused")


if __name__ == "__main__":
    main()
