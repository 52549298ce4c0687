#!/usr/bin/env python3
"""Load benchmark for `fathom serve` over plain HTTP (standard library only).

Two measurements:

1. Aggregate decode throughput at several concurrency levels: C clients each send R streaming
   /v1/completions requests back to back (greedy, max_tokens N, short distinct counting prompts
   that run to max_tokens). Reported
   per level: total generated tokens / wall time ("aggregate tok/s"), and the decode-only rate
   (tokens after each request's first / the span from the first first-token to the last token).

2. TTFT overhead of the HTTP path: client-observed time to the first streamed token of a
   max_tokens=1 completion (prompt cache defeated by alternating two prompts that differ in their
   first word) against the prefill time `fathom run --no-chat -n 1` reports for the same prompt
   in-process. Overhead = median(HTTP TTFT) - median(run prefill).

Usage (spawns the server itself on a free loopback port):
  python3 bench/serve_load.py --fathom build/fathom \\
      --model models/SmolLM2-135M-Instruct.Q4_1.gguf --levels 1,4,16 --max-tokens 64
or against a running server: --url http://127.0.0.1:8080 (TTFT comparison then needs --fathom/--model).
"""
import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

def start_server(fathom, model, parallel, threads, ctx, extra):
    cmd = [fathom, "serve", "-m", model, "--port", "0", "--parallel", str(parallel), "--ctx", str(ctx)]
    if threads:
        cmd += ["-t", str(threads)]
    cmd += extra
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError("fathom serve exited with %s" % proc.returncode)
            continue
        m = re.search(r"listening on http://([^:]+):(\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, "http://%s:%s" % (m.group(1), m.group(2))
    proc.kill()
    raise RuntimeError("fathom serve did not start")


def stream_completion(url, prompt, max_tokens, timeout=600):
    """Returns (t_start, t_first_token, t_end, n_tokens, token_times) for one streamed completion."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError("HTTP %d: %s" % (resp.status, resp.read()[:200]))
    t_first, n_tok, times = None, 0, []
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if obj.get("choices") and obj["choices"][0].get("text"):
            times.append(time.perf_counter())
            if t_first is None:
                t_first = times[-1]
        if obj.get("usage"):
            n_tok = obj["usage"]["completion_tokens"]
    t_end = time.perf_counter()
    conn.close()
    return t0, t_first if t_first is not None else t_end, t_end, n_tok, times


def run_level(url, clients, per_client, max_tokens):
    results, errors = [], []
    lock = threading.Lock()

    def client(ci):
        for r in range(per_client):
            # Counting continues greedily until max_tokens (no early end of generation), and every
            # client starts elsewhere, so no two prompts share more than the opening word.
            k = 10 + 37 * (ci * per_client + r)
            prompt = "Count: %d, %d, %d," % (k, k + 1, k + 2)
            try:
                res = stream_completion(url, prompt, max_tokens)
                with lock:
                    results.append(res)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    n = sum(r[3] for r in results)
    first = min(r[1] for r in results)
    last = max(r[2] for r in results)
    dec_tokens = sum(max(r[3] - 1, 0) for r in results)
    # Steady state: the window in which every request of the level was past its first token and
    # none had finished (all C sequences decoding together); streamed chunks inside it per second.
    w0, w1 = max(r[1] for r in results), min(r[2] for r in results)
    in_window = sum(1 for r in results for t in r[4] if w0 < t <= w1)
    steady = in_window / (w1 - w0) if w1 - w0 > 0.5 and per_client == 1 else float("nan")
    return {"clients": clients, "requests": len(results), "errors": len(errors), "tokens": n,
            "wall_s": wall, "aggregate_tok_s": n / wall if wall > 0 else 0.0,
            "decode_tok_s": dec_tokens / (last - first) if last > first else 0.0, "steady_tok_s": steady,
            "ttft_median_ms": 1000 * statistics.median(r[1] - r[0] for r in results)}


WORDS = ("Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliet Kilo Lima Mike November Oscar "
         "Papa Quebec Romeo Sierra Tango Uniform Victor Whiskey Xray Yankee Zulu Red Green Blue Orange").split()


def ttft_metric_sum(url):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    m = re.search(r"^fathom_time_to_first_token_seconds_sum (\S+)$", text, re.M)
    return float(m.group(1))


def ttft_compare(url, fathom, model, threads, ctx, reps):
    """HTTP TTFT of a fully prefilled prompt (each request starts with another word, so no slot's
    cache can serve it) vs (a) the scheduler's own submit->first-token time of the same request
    (from the /metrics histogram sum, requests run one at a time) and (b) the prefill time
    `fathom run` reports for the same prompts."""
    base = (" Summarise the following in one sentence: the committee met on Tuesday to review the budget, "
            "the schedule for the new bridge, and complaints about noise from the harbour.")
    prompts = [w + "." + base for w in WORDS]
    http_ttft, sched_ttft = [], []
    stream_completion(url, "Warm-up." + base, 1)
    for i in range(reps):
        before = ttft_metric_sum(url)
        t0, t1, _, _, _ = stream_completion(url, prompts[i % len(prompts)], 1)
        http_ttft.append(t1 - t0)
        sched_ttft.append(ttft_metric_sum(url) - before)
    res = {"http_ttft_median_ms": 1000 * statistics.median(http_ttft), "reps": reps,
           "sched_ttft_median_ms": 1000 * statistics.median(sched_ttft),
           "overhead_vs_sched_ms": 1000 * statistics.median(h - s for h, s in zip(http_ttft, sched_ttft))}
    run_prefill = []
    if fathom and model:
        for i in range(reps):
            cmd = [fathom, "run", "-m", model, "--no-chat", "-n", "1", "--temp", "0", "--ctx", str(ctx),
                   "-p", prompts[i % len(prompts)]]
            if threads:
                cmd += ["-t", str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            m = re.search(r"prefill: \d+ tokens.*? in ([0-9.]+) s", out.stderr)
            if m:
                run_prefill.append(float(m.group(1)))
    if run_prefill:
        res["run_prefill_median_ms"] = 1000 * statistics.median(run_prefill)
        res["overhead_vs_run_ms"] = res["http_ttft_median_ms"] - res["run_prefill_median_ms"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--fathom")
    ap.add_argument("--model")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--per-client", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--ttft-reps", type=int, default=20)
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--serve-args", default="", help="extra `fathom serve` arguments")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    proc, url = None, args.url
    if not url:
        if not (args.fathom and args.model):
            ap.error("--url or --fathom and --model")
        proc, url = start_server(args.fathom, args.model, max(levels), args.threads, args.ctx,
                                 args.serve_args.split())
    try:
        stream_completion(url, "Hello", 4)  # warm-up (page-in of the weights)
        rows = []
        for c in levels:
            row = run_level(url, c, args.per_client, args.max_tokens)
            rows.append(row)
            print("concurrency %3d: %3d requests, %5d tokens in %6.2f s -> aggregate %7.1f tok/s, decode %7.1f tok/s,"
                  " steady-state decode %7.1f tok/s, TTFT median %7.1f ms, errors %d"
                  % (c, row["requests"], row["tokens"], row["wall_s"], row["aggregate_tok_s"], row["decode_tok_s"],
                     row["steady_tok_s"], row["ttft_median_ms"], row["errors"]), flush=True)
        if len(rows) > 1 and rows[0]["aggregate_tok_s"] > 0:
            print("speed-up at %d vs %d: aggregate %.2fx, steady-state decode %.2fx"
                  % (rows[-1]["clients"], rows[0]["clients"], rows[-1]["aggregate_tok_s"] / rows[0]["aggregate_tok_s"],
                     rows[-1]["steady_tok_s"] / rows[0]["steady_tok_s"]))
        if not args.no_ttft:
            t = ttft_compare(url, args.fathom, args.model, args.threads, args.ctx, args.ttft_reps)
            print("TTFT over %d requests: HTTP median %.2f ms, scheduler (submit -> first token) median %.2f ms, "
                  "HTTP-path overhead median %.2f ms" % (t["reps"], t["http_ttft_median_ms"],
                                                        t["sched_ttft_median_ms"], t["overhead_vs_sched_ms"]))
            if "run_prefill_median_ms" in t:
                print("`fathom run` prefill median %.2f ms: HTTP TTFT - run prefill = %.2f ms" %
                      (t["run_prefill_median_ms"], t["overhead_vs_run_ms"]))
        if any(r["errors"] for r in rows):
            sys.exit(1)
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
