#!/usr/bin/env python3
"""Black-box check of `--procs` (ranks 1.. as child processes joined over TCP, src/dist/rank_procs.h)
through the `fathom` binary, on the ds4-tiny golden model. Prints PASS / FAIL per case; exits non-zero
when any case failed.

CPU (default; tests/dist/tests.cmake, ctest dist_procs_cli):
  * `fathom run --temp 0 --devices cpu,cpu[,cpu] --procs` (pipeline) and `--devices cpu,cpu --layout tp
    --procs` print the same greedy text as the in-process `--devices` run and as one device; stderr names
    the rank processes;
  * `fathom logits` (prefill and decode modes) with --procs: bit-identical to the in-process ranks (pipeline
    2 and 3 ranks; tp 2 ranks) and, for the pipeline, to one device;
  * `fathom serve --devices cpu,cpu --procs` answers a chat completion identically to the in-process
    server; two sessions (--parallel 2) interleaved, and both requests at once (the sessions in flight over
    the processes), give the single-session answers; then the child rank is
    SIGKILLed: the server exits non-zero within 5 s with the one line
    `error: dist: rank 1 (pid N) exited: killed by signal 9 (Killed)`, and no rank process is left; with
    three ranks, killing the middle one gives that line for it (not for its neighbour, which also stops);
  * SIGKILLing the server leaves no rank process (PR_SET_PDEATHSIG);
  * `--procs-local 2` with three ranks prints the command for rank 2 (with rank 0's `--rank-layers` and
    `--ctx`), which joins when run by hand (the two-host launch, on one host) and the text is the same;
  * `--micro-batch 2` (prompt micro-batches down the pipeline, in-process and --procs) prints the same text;
  * `fathom rank` given bad `--rank-layers` (a gap, the wrong count, not a range) fails with one line
    before joining; --procs without --devices is refused;
  * no `fathom rank` process survives any of the runs above.

CUDA (`--cuda [cuda:N]`; scripts/device/run_procs_cuda.sh on one GPU: every CUDA entry is that device, so
two or three processes share it): the same shape with the device lists switched:
  * `run`: `--devices D,D` and `D,D,D` with --procs and in-process, and `D,D --procs --no-cuda-graph`, print
    the one-device (`--device D`) text;
    `cpu,D` and `D,cpu` with --procs print the in-process text of the same list (the same code per stage);
    `--procs-local 2` with `D,D,D`: the printed command (rank 2 uploads its own blocks) joins, same text;
  * `logits` (prefill, decode): --procs bit-identical to the in-process ranks for D,D / cpu,D / D,cpu;
  * `serve --devices D,D --procs`: answers as the in-process server; SIGKILL of the child ends it within
    5 s with the one line; no rank process left;
  * `--layout tp` with a CUDA entry and --procs is refused with one line; `fathom rank` with CUDA entries
    and no `--rank-layers` fails with one line."""
import argparse
import array
import concurrent.futures
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


class Failed(Exception):
    pass


def fail(msg):
    raise Failed(msg)


def run(cmd, timeout=120):
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    if r.returncode != 0:
        fail(f"{' '.join(cmd)} exited {r.returncode}\n{r.stderr}")
    return r


def expect_one_line_error(cmd, needle, timeout=60):
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    err = r.stderr.strip()
    if r.returncode == 0:
        fail(f"{' '.join(cmd)} succeeded; expected one line containing {needle!r}")
    if needle not in err or "\n" in err:
        fail(f"{' '.join(cmd)}: expected one line containing {needle!r}, got:\n{err}")
    return err


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
        fail(f"{what}: rank process(es) {left} still running")


class Server:
    """`fathom serve` started in the background; killed on leaving the `with` block if still running."""

    def __init__(self, cmd):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        err = []
        deadline = time.time() + 90
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            err.append(line)
            m = re.search(r"listening on (http://[^ ]+)", line or "")
            if m:
                self.url, self.err = m.group(1), "".join(err)
                return
        self.proc.kill()
        self.proc.wait()
        fail(f"{' '.join(cmd)} did not start:\n{''.join(err)}{self.proc.stderr.read()}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc.stderr.close()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


def chat(url, content, max_tokens=12):
    req = urllib.request.Request(url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"messages": [{"role": "user", "content": content}],
                                                  "temperature": 0, "max_tokens": max_tokens}).encode())
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["message"]["content"]


def max_abs_diff(a, b):
    x, y = array.array("f", a), array.array("f", b)
    if len(x) != len(y):
        return float("inf")
    return max((abs(p - q) for p, q in zip(x, y)), default=0.0)


class Checks:
    def __init__(self, a, model, gdir):
        self.a, self.model, self.gdir = a, model, gdir
        self.gpu = a.cuda  # None: CPU lists; "cuda:N": every CUDA entry
        self.base_run = [a.fathom, "run", "-m", model, "-t", "2", "--temp", "0", "-n", "40", "-p",
                         "The capital of France is"]
        self._want = None

    def want(self):
        """The one-device greedy text (on the CPU, or on the GPU with --cuda)."""
        if self._want is None:
            one = ["--device", self.gpu] if self.gpu else []
            self._want = run(self.base_run + one).stdout
            if not self._want.strip():
                fail("the one-device run printed no text")
        return self._want

    def procs_run(self, extra, want, what):
        """`run` with --procs: prints `want`, stderr names the ranks, none is left."""
        r = run(self.base_run + extra + ["--procs"])
        if r.stdout != want:
            fail(f"run {' '.join(extra)} --procs printed {r.stdout!r}, {what} {want!r}")
        pids = rank_pids(r.stderr)
        if len(pids) != extra[1].count(","):
            fail(f"run {' '.join(extra)} --procs: stderr does not name the rank processes:\n{r.stderr}")
        no_rank_left(pids, f"run {' '.join(extra)} --procs")

    # ---- CPU ------------------------------------------------------------------------------------

    def cpu_run(self):
        want = self.want()
        for extra in (["--devices", "cpu,cpu"], ["--devices", "cpu,cpu,cpu"], ["--devices", "cpu,cpu", "--layout", "tp"]):
            inproc = run(self.base_run + extra).stdout
            if inproc != want:
                fail(f"run {' '.join(extra)} (in-process) printed {inproc!r}, one device {want!r}")
            self.procs_run(extra, want, "one device")
        return "fathom run --procs (pipeline 2 and 3 ranks, tp 2 ranks) prints the in-process and one-device text"

    def cpu_micro_batch(self):
        # Micro-batches (--micro-batch 2: the prompt goes down the pipeline 2 tokens at a time, back to back;
        # over the rank processes one control message announces all of them): the same text.
        want = self.want()
        for extra in (["--devices", "cpu,cpu,cpu", "--micro-batch", "2"],
                      ["--devices", "cpu,cpu,cpu", "--micro-batch", "2", "--procs"]):
            r = run(self.base_run + extra)
            if r.stdout != want:
                fail(f"run {' '.join(extra)} printed {r.stdout!r}, one device {want!r}")
        return "fathom run --micro-batch 2 (in-process and --procs, 3 ranks) prints the one-device text"

    def hand_started(self, devices):
        """The two-host launch on one host: rank 2 is not spawned; rank 0 prints its command (with its block
        ranges and context) and waits for it."""
        want = self.want()
        proc = subprocess.Popen(self.base_run + ["--devices", devices, "--procs", "--procs-local", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        try:
            line = proc.stderr.readline()
            m = re.match(r"dist: waiting for rank 2: start it with: (.*)$", line.strip())
            if not m or "--parent-pid" in m.group(1):
                fail(f"--procs-local 2: expected the command for rank 2 on stderr, got {line!r}")
            argv = shlex.split(m.group(1))
            if "--rank-layers" not in argv or "--ctx" not in argv:
                fail(f"--procs-local 2: the printed command lacks --rank-layers / --ctx: {m.group(1)!r}")
            rank2 = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=90)
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0 or rank2.returncode != 0 or out != want or "rank 2 joined" not in err:
            fail(f"--procs-local 2: rc {proc.returncode} / rank 2 rc {rank2.returncode} {rank2.stderr!r}, "
                 f"printed {out!r} (want {want!r}), stderr {err!r}")
        return (f"--devices {devices}: a rank started by hand (--procs-local, the printed command with "
                f"--rank-layers and --ctx) joins and the text is the same")

    def logits(self, td, mode, extra):
        c = self.case
        toks = os.path.join(td, "toks.txt")
        with open(toks, "w") as f:
            f.write(" ".join(map(str, c["tokens"])))
        out = os.path.join(td, "l.bin")
        # CPU: the golden's f32 KV without QAT; CUDA: its default numerics (only compared with itself).
        num = [] if self.gpu else ["--kv-type", "f32", "--qat", "off"]
        run([self.a.fathom, "logits", "-m", self.model, "--tokens-file", toks, "--out", out, "--mode", mode,
             "-t", "2"] + num + extra)
        with open(out, "rb") as f:
            data = f.read()
        if len(data) == 0 or len(data) % (4 * len(c["tokens"])) != 0:
            fail(f"logits {mode} {' '.join(extra)}: {len(data)} bytes for {len(c['tokens'])} tokens")
        return data

    def load_case(self):
        cases = {json.loads(l)["name"]: json.loads(l)
                 for l in open(os.path.join(self.gdir, "cases.jsonl")) if l.strip()}
        self.case = cases["len67.no_qat"]

    def compare_logits(self, lists, one_device):
        """--procs bit for bit against the in-process ranks (memcmp of the raw f32 files); `one_device`:
        the lists whose logits must also equal the one-device run's."""
        self.load_case()
        with tempfile.TemporaryDirectory() as td:
            for mode in ("prefill", "decode"):
                one = self.logits(td, mode, []) if one_device else None
                for extra in lists:
                    inproc = self.logits(td, mode, extra)
                    procs = self.logits(td, mode, extra + ["--procs"])
                    if procs != inproc:
                        fail(f"logits {mode} {' '.join(extra)} --procs differs from the in-process ranks "
                             f"(max |diff| {max_abs_diff(procs, inproc):.3g})")
                    if " ".join(extra) in one_device and procs != one:
                        fail(f"logits {mode} {' '.join(extra)} --procs differs from one device "
                             f"(max |diff| {max_abs_diff(procs, one):.3g})")

    def cpu_logits(self):
        self.compare_logits((["--devices", "cpu,cpu"], ["--devices", "cpu,cpu,cpu"],
                             ["--devices", "cpu,cpu", "--layout", "tp"]),
                            one_device=("--devices cpu,cpu", "--devices cpu,cpu,cpu"))
        return "fathom logits --procs bit-identical to the in-process ranks (and the pipeline to one device)"

    def serve_kill(self, devices):
        """serve --procs answers as the in-process server, then its rank 1 is SIGKILLed: exit non-zero within
        5 s with the one line, no rank left."""
        base = [self.a.fathom, "serve", "-m", self.model, "-t", "2", "--port", "0", "--ctx", "1024",
                "--parallel", "2", "--devices", devices]
        prompts = ["Hi", "The capital of France is"]
        with Server(base) as srv:
            want = [chat(srv.url, p) for p in prompts]
            srv.stop()
        with Server(base + ["--procs"]) as srv:
            pids = rank_pids(srv.err)
            if len(pids) != devices.count(","):
                fail(f"serve --devices {devices} --procs: stderr does not name the rank processes:\n{srv.err}")
            got = [chat(srv.url, p) for p in prompts]
            got += [chat(srv.url, p) for p in reversed(prompts)]  # the slots' sessions take turns in the children
            if got != want + list(reversed(want)):
                fail(f"serve --devices {devices} --procs answered {got!r}, the in-process server {want!r}")
            # Both at once: the scheduler steps the two slots together, their forwards in flight over the
            # processes (rank_procs::with_sessions); each answer is still its own.
            for _ in range(2):
                with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
                    both = list(ex.map(lambda p: chat(srv.url, p), prompts))
                if both != want:
                    fail(f"serve --devices {devices} --procs, concurrent requests answered {both!r}, want {want!r}")
            os.kill(pids[0], signal.SIGKILL)
            t0 = time.time()
            try:
                rc = srv.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                fail(f"serve --devices {devices} --procs still running 10 s after rank 1 was killed")
            took = time.time() - t0
            rest = srv.proc.stderr.read().strip().splitlines()
        want_line = f"error: dist: rank 1 (pid {pids[0]}) exited: killed by signal 9 (Killed)"
        if rc == 0 or took > 5 or not rest or rest[-1] != want_line:
            fail(f"serve --devices {devices} after rank 1 died: rc {rc} after {took:.2f} s, stderr tail "
                 f"{rest[-3:]!r}; expected a non-zero exit within 5 s with {want_line!r}")
        no_rank_left(pids, f"serve --devices {devices} after rank 1 died")
        return (f"serve --devices {devices} --procs answers as the in-process server, exits {rc} {took:.2f} s "
                f"after rank 1 is SIGKILLed: {rest[-1]}")

    def cpu_serve_middle(self):
        # Three ranks, the middle one killed while idle: its neighbour notices too (and exits with the "a peer
        # failed first" status), but the server's line names the killed rank.
        base = [self.a.fathom, "serve", "-m", self.model, "-t", "2", "--port", "0", "--ctx", "1024",
                "--parallel", "2", "--devices", "cpu,cpu,cpu", "--procs"]
        with Server(base) as srv:
            pids = rank_pids(srv.err)
            if len(pids) != 2:
                fail(f"serve --devices cpu,cpu,cpu --procs: no rank pids:\n{srv.err}")
            chat(srv.url, "Hi")
            os.kill(pids[0], signal.SIGKILL)
            try:
                rc = srv.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                fail("serve (3 ranks) still running 10 s after rank 1 was killed")
            rest = srv.proc.stderr.read().strip().splitlines()
        want_line = f"error: dist: rank 1 (pid {pids[0]}) exited: killed by signal 9 (Killed)"
        if rc == 0 or not rest or rest[-1] != want_line:
            fail(f"serve (3 ranks) after rank 1 died: rc {rc}, stderr tail {rest[-3:]!r}; expected {want_line!r}")
        no_rank_left(pids, "serve (3 ranks) after rank 1 died")
        return "serve with 3 rank processes names the killed middle rank, not its neighbour"

    def cpu_serve_parent_killed(self):
        # The parent killed outright: its children die with it (PR_SET_PDEATHSIG).
        base = [self.a.fathom, "serve", "-m", self.model, "-t", "2", "--port", "0", "--ctx", "1024",
                "--devices", "cpu,cpu,cpu", "--procs"]
        with Server(base) as srv:
            pids = rank_pids(srv.err)
            if len(pids) != 2:
                fail(f"serve --devices cpu,cpu,cpu --procs: no rank pids on stderr:\n{srv.err}")
            srv.proc.kill()
            srv.proc.wait(timeout=10)
        no_rank_left(pids, "serve SIGKILLed")
        return "a SIGKILLed serve leaves no rank process"

    def rank_cmd(self, devices, layers):
        cmd = [self.a.fathom, "rank", "--rank", "1", "--world", str(devices.count(",") + 1), "--join",
               "0000@127.0.0.1:1", "-m", self.model, "--devices", devices]
        return cmd + (["--rank-layers", layers] if layers is not None else [])

    def cpu_bad_rank_layers(self):
        # Checked after the model load, before the join (the bogus --join is never reached).
        for layers, needle in (("0-2,4-5", "rank: --rank-layers '0-2,4-5': layer range 1"),
                               ("0-5", "rank: --rank-layers '0-5': 1 ranges for the 2 devices"),
                               ("0-2,3-9", "rank: --rank-layers '0-2,3-9': layer range 1"),
                               ("0-x", "rank: --rank-layers '0-x': layer ranges '0-x'")):
            expect_one_line_error(self.rank_cmd("cpu,cpu", layers), needle)
        return "fathom rank with bad --rank-layers (gap, count, past the end, malformed) fails with one line"

    def cpu_procs_needs_devices(self):
        r = subprocess.run([self.a.fathom, "run", "-m", self.model, "-n", "1", "-p", "hi", "--procs"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0 or "--procs requires --devices" not in r.stderr:
            fail(f"--procs without --devices: rc {r.returncode}, {r.stderr!r}")
        return "--procs without --devices is refused"

    # ---- CUDA (--cuda) --------------------------------------------------------------------------

    def cuda_run_same_device(self):
        want, g = self.want(), self.gpu
        for devices in (f"{g},{g}", f"{g},{g},{g}"):
            # --procs against in-process first (this feature), then in-process against one device.
            inproc = run(self.base_run + ["--devices", devices]).stdout
            self.procs_run(["--devices", devices], inproc, "in-process")
            if inproc != want:
                fail(f"run --devices {devices}: in-process and --procs printed {inproc!r}, one device {want!r}")
        # --no-cuda-graph reaches the rank processes (eager decode steps there too): the same text.
        self.procs_run(["--devices", f"{g},{g}", "--no-cuda-graph"], want, "one device (graphs)")
        return (f"run --devices {g},{g}[,{g}] --procs (and {g},{g} --no-cuda-graph) prints the in-process and "
                f"one-device ({g}) text")

    def cuda_run_mixed(self):
        g = self.gpu
        for devices in (f"cpu,{g}", f"{g},cpu"):
            inproc = run(self.base_run + ["--devices", devices]).stdout
            if not inproc.strip():
                fail(f"run --devices {devices} (in-process) printed no text")
            self.procs_run(["--devices", devices], inproc, "in-process")
        return f"run --devices cpu,{g} and {g},cpu with --procs print the in-process text"

    def cuda_logits(self):
        g = self.gpu
        self.compare_logits((["--devices", f"{g},{g}"], ["--devices", f"cpu,{g}"], ["--devices", f"{g},cpu"]),
                            one_device=())
        return f"logits (prefill, decode) --procs bit-identical to the in-process ranks ({g},{g}; cpu,{g}; {g},cpu)"

    def cuda_refusals(self):
        g = self.gpu
        expect_one_line_error(self.base_run + ["--devices", f"{g},{g}", "--layout", "tp", "--procs"],
                              "layout tp runs on CPU devices only")
        expect_one_line_error(self.rank_cmd(f"{g},{g}", None), "the block ranges (--rank-layers, given by rank 0)")
        return "tp with a CUDA entry and --procs, and a CUDA rank without --rank-layers, fail with one line"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--cuda", nargs="?", const="cuda:0", default=None,
                    help="run the CUDA cases, every CUDA entry being this device (default cuda:0)")
    a = ap.parse_args()
    gdir = os.path.join(a.shared, "golden", "ds4-tiny")
    c = Checks(a, os.path.join(gdir, "ds4-tiny-a.gguf"), gdir)
    if a.cuda:
        g = a.cuda
        cases = [("run same device", c.cuda_run_same_device), ("run mixed", c.cuda_run_mixed),
                 ("hand-started rank", lambda: c.hand_started(f"{g},{g},{g}")), ("logits", c.cuda_logits),
                 ("serve + kill", lambda: c.serve_kill(f"{g},{g}")), ("refusals", c.cuda_refusals)]
    else:
        cases = [("run", c.cpu_run), ("micro-batch", c.cpu_micro_batch),
                 ("hand-started rank", lambda: c.hand_started("cpu,cpu,cpu")), ("logits", c.cpu_logits),
                 ("serve + kill", lambda: c.serve_kill("cpu,cpu")), ("serve middle rank", c.cpu_serve_middle),
                 ("serve killed", c.cpu_serve_parent_killed), ("bad --rank-layers", c.cpu_bad_rank_layers),
                 ("--procs needs --devices", c.cpu_procs_needs_devices)]
    failed = 0
    for name, fn in cases:
        t0 = time.time()
        try:
            what = fn()
            print(f"PASS: {name} ({time.time() - t0:.1f} s): {what}", flush=True)
        except Exception as e:  # Failed, a timeout, an HTTP error: this case fails, the next one runs
            failed += 1
            print(f"FAIL: {name} ({time.time() - t0:.1f} s): {type(e).__name__}: {e}", flush=True)
    print(f"{len(cases) - failed}/{len(cases)} cases passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
