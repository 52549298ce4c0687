#!/usr/bin/env python3
"""Load benchmark for `fathom serve` over plain HTTP (standard library only; a test-time tool).

Four measurements (each optional):

1. Aggregate decode throughput at several concurrency levels (--levels, 'none' skips): C clients
   each send R streaming /v1/completions requests back to back (greedy, max_tokens N, short distinct
   counting prompts that run to max_tokens). Reported per level: total generated tokens / wall time
   ("aggregate tok/s"), and the decode-only rate (tokens after each request's first / the span from
   the first first-token to the last token).

2. TTFT overhead of the HTTP path (--no-ttft skips): client-observed time to the first streamed
   token of a max_tokens=1 completion (prompt cache defeated by alternating two prompts that differ
   in their first word) against the scheduler's submit -> first token (/metrics) and the prefill
   time `fathom run --no-chat -n 1` reports for the same prompt in-process.

3. TTFT of a long prompt while C streams decode (--ttft-under-load C[,C...], issue 20: "chunked
   prefill must not stall decodes for more than one chunk's time"). First the idle TTFT of a fresh
   P-token prompt (--prompt-tokens; --idle-reps times, median). Then C streaming greedy completions
   (distinct prompts, --decode-tokens each; one that ends is replaced at once) run until every one
   has streamed its first token; after --window seconds a fresh P-token prompt is submitted
   (max_tokens 1), and --window seconds after its first token the C streams are closed. Prompts of
   P tokens are random token ids from the middle of the vocabulary (/props n_vocab): exact length,
   and no slot or disk prompt cache holds any prefix of them. Reported: the new request's TTFT
   (client and scheduler), against idle; the C streams' inter-token latencies (arrival differences
   of consecutive frames of one request) p50 / p99 / max in three windows: 'before' the submission,
   'prefill' (gaps overlapping submit -> its first token) and 'after'; next to each, the server's
   own token-gap histogram (fathom_token_latency_seconds) over the same window; and the longest
   stall beyond a normal step (prefill max - before p50) in idle prefill steps (idle scheduler TTFT /
   its scheduler steps, i.e. one chunk's time): ~1 when decodes wait for one chunk, ~P/chunk when
   they wait for the whole prompt. --logprobs times every token instead of every text chunk (the
   server then sends a frame per token, also for text it holds back, e.g. an incomplete UTF-8
   sequence: needed on random-weight test models such as ds4-tiny, whose byte soup holds back ~10 %
   of tokens).

4. HTTP load test (--load-test C --duration S): C clients send streaming completions back to back
   for S seconds (max_tokens between half and all of --max-tokens). Reported: requests, failures by
   kind (HTTP status, error frames in the stream, truncated streams without [DONE], connection
   errors), 503 retries, tok/s, ITL p50 / p99 / max over every stream and the stalls (gaps above
   --stall-s), TTFT, the /metrics counters over the run (finished, rejected, failed, generated
   tokens, which must agree with the client's counts), and, when the script spawned the server, its
   RSS (/proc/PID/status VmRSS every 0.25 s): start, peak, end and the quarters of the run.

Every request that gets 503 with Retry-After (the server's queue is full) is retried after the
seconds it gives and counted (retries_503). --json FILE writes every figure (and the arguments).
The exit status is 1 when any request failed or a load-test gap exceeded --stall-s.

The spawned server gets --parallel = the largest concurrency asked for (C decodes + 1 for the new
request in 3) and --ctx large enough for P and --decode-tokens; --parallel / --ctx inside
--serve-args replace these (for C concurrent decodes plus the new request, --parallel must be >= C+1,
else the new request queues).

Usage (spawns the server itself on a free loopback port):
  python3 bench/serve_load.py --fathom build/fathom \\
      --model models/SmolLM2-135M-Instruct.Q4_1.gguf --levels 1,4,16 --max-tokens 64
  python3 bench/serve_load.py --fathom build/fathom --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --threads 2 --levels none --no-ttft --ttft-under-load 4,8 --prompt-tokens 1024 \\
      --load-test 8 --duration 30 --json smollm2.json
On the GPU machine, DeepSeek V4 at C = 16 and 64 (CUDA build in build-cuda):
  python3 bench/serve_load.py --fathom build-cuda/fathom --model DS4.gguf --levels none --no-ttft \\
      --ttft-under-load 16,64 --prompt-tokens 4096 --decode-tokens 2048 --window 3 \\
      --load-test 64 --duration 120 --max-tokens 256 --json ds4_cuda_load.json \\
      --serve-args "--device cuda --parallel 65 --ctx 8192"
or against a running server: --url http://127.0.0.1:8080 (the TTFT comparison of 2 then needs
--fathom/--model; no RSS figures).
"""
import argparse
import http.client
import json
import math
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

def run_clients(client, n):
    """Runs client(0) .. client(n - 1) on n threads at once; the wall time until all have returned."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def start_server(fathom, model, parallel, threads, ctx, extra):
    """Spawns `fathom serve` on a free loopback port; --parallel / --ctx given in `extra` win."""
    cmd = [fathom, "serve", "-m", model, "--port", "0"]
    if "--parallel" not in extra:
        cmd += ["--parallel", str(parallel)]
    if "--ctx" not in extra:
        cmd += ["--ctx", str(ctx)]
    if threads:
        cmd += ["-t", str(threads)]
    cmd += extra
    print("server: " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 600
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


class Stream:
    """What the client saw of one streamed /v1/completions request (times: time.perf_counter())."""

    def __init__(self):
        self.t_submit = self.t_first = self.t_end = None
        self.times = []            # arrival time of every streamed chunk carrying text
        self.n_tokens = 0          # usage.completion_tokens (0 when the stream ended before usage)
        self.prompt_tokens = 0     # usage.prompt_tokens
        self.status = None         # the last HTTP status
        self.retries_503 = 0       # 503 (queue full) answers retried after their Retry-After
        self.error_kind = None     # None, "http" (non-200 other than a retried 503), "frame" (an error
        self.error = None          # frame in the stream), "truncated" (no [DONE]) or "exception"
        self.finish_reason = None
        self.cancelled = False     # closed by the client (stop event), not an error

    def gaps(self):
        """Inter-token latencies: (arrival of the earlier chunk, of the later one) for consecutive chunks."""
        return list(zip(self.times, self.times[1:]))


def _open_stream(url, body, st, timeout, stop):
    """POSTs until the answer is not a 503 with Retry-After (sleeping what it asks, counting each)."""
    u = urllib.parse.urlparse(url)
    while True:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        st.status = resp.status
        retry = resp.getheader("Retry-After")
        if resp.status != 503 or retry is None or (stop is not None and stop.is_set()):
            return conn, resp
        resp.read()
        conn.close()
        st.retries_503 += 1
        time.sleep(float(retry))


def stream_completion(url, prompt, max_tokens, timeout=600, stop=None, on_first=None, logprobs=False):
    """One greedy streamed completion (prompt: text or token ids) -> Stream. Never raises for a
    failed request: the failure is recorded in error_kind / error. Setting `stop` closes the
    connection at the next frame (the server cancels the generation); on_first() is called at the
    first text chunk. logprobs: ask for each token's logprob, which makes the server send a frame
    for every token, also one whose text it holds back (an incomplete UTF-8 sequence, a possible
    stop string): Stream.times then has one arrival per token instead of per text chunk."""
    st = Stream()
    req = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    if logprobs:
        req["logprobs"] = 1
    body = json.dumps(req)
    st.t_submit = time.perf_counter()
    conn = None
    try:
        conn, resp = _open_stream(url, body, st, timeout, stop)
        if resp.status != 200:
            st.error_kind, st.error = "http", "HTTP %d: %s" % (resp.status, resp.read()[:200])
            return st
        done = False
        for raw in resp:  # SSE: "data: {...}" frames, ": comment" keepalives, blank separators
            now = time.perf_counter()
            if stop is not None and stop.is_set():
                st.cancelled = True
                break
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                st.error_kind, st.error = "frame", json.dumps(obj["error"])[:200]
            choices = obj.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("logprobs") or {}).get("tokens")):
                st.times.append(now)
                if st.t_first is None:
                    st.t_first = now
                    if on_first:
                        on_first()
            if choices and choices[0].get("finish_reason"):
                st.finish_reason = choices[0]["finish_reason"]
            if obj.get("usage"):
                st.n_tokens = obj["usage"]["completion_tokens"]
                st.prompt_tokens = obj["usage"]["prompt_tokens"]
        if not done and not st.cancelled and st.error_kind is None:
            st.error_kind, st.error = "truncated", "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - a reset / timeout is one of the counted failures
        st.error_kind, st.error = "exception", "%s: %s" % (type(e).__name__, e)
    finally:
        st.t_end = time.perf_counter()
        if st.t_first is None:
            st.t_first = st.t_end
        if conn is not None:
            conn.close()
    return st


def get_json(url, path):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", path)
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


def metrics(url):
    """GET /metrics -> {"name{labels}": value} (Prometheus text, comments skipped)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def metric_delta(m0, m1, name):
    return m1.get(name, 0.0) - m0.get(name, 0.0)


def server_itl(m0, m1):
    """The server's own inter-token latencies between two /metrics snapshots (the
    fathom_token_latency_seconds histogram): count, mean, and the bucket bound the largest lies under
    (a cross-check of the client's figures, which see streamed chunks, not tokens)."""
    name = "fathom_token_latency_seconds"
    n = metric_delta(m0, m1, name + "_count")
    bound = None
    for key in sorted((k for k in m1 if k.startswith(name + '_bucket{le="')),
                      key=lambda k: float(k.split('"')[1])):
        if metric_delta(m0, m1, key) >= n:
            bound = key.split('"')[1]
            break
    return {"n": n, "mean_ms": 1000 * metric_delta(m0, m1, name + "_sum") / n if n else None, "max_under_s": bound}


def percentile(xs, q):
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(math.ceil(q / 100.0 * len(xs))) - 1))]


def latency_summary(values_s):
    """{"n", "p50_ms", "p99_ms", "max_ms"} of latencies in seconds (None figures when empty)."""
    if not values_s:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(values_s), "p50_ms": 1000 * percentile(values_s, 50),
            "p99_ms": 1000 * percentile(values_s, 99), "max_ms": 1000 * max(values_s)}


def fmt_lat(s):
    if not s["n"]:
        return "no gaps"
    return "p50 %.1f / p99 %.1f / max %.1f ms (%d gaps)" % (s["p50_ms"], s["p99_ms"], s["max_ms"], s["n"])


def run_level(url, clients, per_client, max_tokens):
    results, errors = [], []
    lock = threading.Lock()

    def client(ci):
        for r in range(per_client):
            # Counting continues greedily until max_tokens (no early end of generation), and every
            # client starts elsewhere, so no two prompts share more than the opening word.
            k = 10 + 37 * (ci * per_client + r)
            prompt = "Count: %d, %d, %d," % (k, k + 1, k + 2)
            res = stream_completion(url, prompt, max_tokens)
            with lock:
                (errors if res.error_kind else results).append(res)

    wall = run_clients(client, clients)
    if not results:
        return {"clients": clients, "requests": 0, "errors": len(errors), "tokens": 0, "wall_s": wall,
                "aggregate_tok_s": 0.0, "decode_tok_s": 0.0, "steady_tok_s": float("nan"),
                "ttft_median_ms": float("nan")}
    n = sum(r.n_tokens for r in results)
    first = min(r.t_first for r in results)
    last = max(r.t_end for r in results)
    dec_tokens = sum(max(r.n_tokens - 1, 0) for r in results)
    # Steady state: the window in which every request of the level was past its first token and
    # none had finished (all C sequences decoding together); streamed chunks inside it per second.
    w0, w1 = max(r.t_first for r in results), min(r.t_end for r in results)
    in_window = sum(1 for r in results for t in r.times if w0 < t <= w1)
    steady = in_window / (w1 - w0) if w1 - w0 > 0.5 and per_client == 1 else float("nan")
    return {"clients": clients, "requests": len(results), "errors": len(errors), "tokens": n,
            "wall_s": wall, "aggregate_tok_s": n / wall if wall > 0 else 0.0,
            "decode_tok_s": dec_tokens / (last - first) if last > first else 0.0, "steady_tok_s": steady,
            "ttft_median_ms": 1000 * statistics.median(r.t_first - r.t_submit for r in results)}


WORDS = ("Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliet Kilo Lima Mike November Oscar "
         "Papa Quebec Romeo Sierra Tango Uniform Victor Whiskey Xray Yankee Zulu Red Green Blue Orange").split()


def ttft_metric_sum(url):
    return metrics(url)["fathom_time_to_first_token_seconds_sum"]


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
        st = stream_completion(url, prompts[i % len(prompts)], 1)
        if st.error_kind:
            raise RuntimeError("TTFT request failed: %s" % st.error)
        http_ttft.append(st.t_first - st.t_submit)
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


# ---------------------------------------------------------------------------------------------------
# TTFT of a long prompt while C streams decode, and the decodes' inter-token latency around it
# ---------------------------------------------------------------------------------------------------

TTFT_SUM = "fathom_time_to_first_token_seconds_sum"
STEPS = "fathom_scheduler_steps_total"


def fresh_prompt(rng, n_vocab, n_tokens):
    """n_tokens random token ids from the middle of the vocabulary (clear of the special tokens that
    sit at either end): a prompt whose first token already differs from anything a slot or the disk
    prompt cache holds, so all of it is prefilled, and whose length is exact whatever the tokenizer."""
    lo, hi = n_vocab // 8, max(n_vocab * 7 // 8, n_vocab // 8 + 1)
    return [rng.randrange(lo, hi) for _ in range(n_tokens)]


def idle_ttft(url, n_vocab, p_tokens, reps, rng):
    """TTFT of fresh P-token prompts with nothing else running: client-observed, the scheduler's own
    (the /metrics TTFT histogram sum's delta) and the scheduler steps the prefill took."""
    out = []
    for _ in range(reps):
        m0 = metrics(url)
        st = stream_completion(url, fresh_prompt(rng, n_vocab, p_tokens), 1)
        m1 = metrics(url)
        if st.error_kind:
            raise RuntimeError("idle TTFT request failed: %s" % st.error)
        out.append({"ttft_ms": 1000 * (st.t_first - st.t_submit), "prompt_tokens": st.prompt_tokens,
                    "sched_ttft_ms": 1000 * metric_delta(m0, m1, TTFT_SUM), "steps": metric_delta(m0, m1, STEPS)})
    return out


def start_decoders(url, c, max_tokens, stop, logprobs):
    """C threads, each streaming greedy counting completions of max_tokens (distinct prompts) until
    `stop` is set; a decode that ends first (end of generation: a random-weight test model samples
    its EOS sooner or later) is followed at once by another request with another prompt, so C streams
    keep decoding. Returns (threads, per_thread_streams, first_token_events)."""
    streams, firsts = [[] for _ in range(c)], [threading.Event() for _ in range(c)]
    salt = random.randrange(1000)

    def run(i):
        short = 0
        for seq in range(1000000):
            k = 1000 + 97 * i + 7919 * salt + 100003 * seq
            st = stream_completion(url, "Count: %d, %d, %d," % (k, k + 1, k + 2), max_tokens,
                                   stop=stop, on_first=firsts[i].set, logprobs=logprobs)
            streams[i].append(st)
            short = short + 1 if len(st.times) < 2 else 0
            if st.cancelled or st.error_kind or stop.is_set() or short >= 3:
                break
        firsts[i].set()  # a stream that failed before its first token must not block the wait

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(c)]
    for t in threads:
        t.start()
    return threads, streams, firsts


def itl_windows(streams, n_decoders, t_start, t_submit, t_first_new, t_end):
    """The decodes' inter-token gaps (a, b) = arrivals of consecutive chunks of one stream, in three
    windows: 'prefill' takes every gap that overlaps (t_submit, t_first_new] (a stalled step's gap
    straddles the submission, and its chunk may arrive just after the new request's first token),
    'before' those ending by t_submit, 'after' those starting from t_first_new up to t_end. Gaps
    starting before t_start (when not every stream was decoding yet) are left out."""
    win = {"before": [], "prefill": [], "after": []}
    for st in streams:
        for a, b in st.gaps():
            if a < t_start or b > t_end:
                continue
            key = "before" if b <= t_submit else "after" if a >= t_first_new else "prefill"
            win[key].append(b - a)
    spans = {"before": t_submit - t_start, "prefill": t_first_new - t_submit, "after": t_end - t_first_new}
    return {k: dict(latency_summary(win[k]), span_s=spans[k],
                    chunks_per_stream=len(win[k]) / max(n_decoders, 1),
                    agg_chunks_s=len(win[k]) / spans[k] if spans[k] > 0 else 0.0) for k in win}


def wait_idle(url, timeout=60.0):
    """Waits until no slot is busy and nothing is queued (closed streams' cancellations take up to
    ~100 ms to land), so one measurement's tail does not leak into the next one's counters."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        m = metrics(url)
        if not m.get("fathom_slots_busy") and not m.get("fathom_queue_depth"):
            return True
        time.sleep(0.05)
    return False


def ttft_under_load(url, c, p_tokens, decode_tokens, window, idle_reps, rng, logprobs):
    """Measurement 3 (issue 20): the TTFT of a fresh P-token prompt submitted while C streams decode,
    against the same with the server idle, and the running streams' ITL before / during / after its
    prefill. Returns a dict of every figure."""
    props = get_json(url, "/props")
    n_vocab = props["model"]["n_vocab"]
    if props.get("parallel", c + 1) < c + 1:
        print("warning: the server has %d slots; %d decodes and the new request need %d (the rest queue)"
              % (props["parallel"], c, c + 1), flush=True)
    wait_idle(url)
    idle = idle_ttft(url, n_vocab, p_tokens, idle_reps, rng)
    stop = threading.Event()
    m0 = metrics(url)
    threads, streams, firsts = start_decoders(url, c, decode_tokens, stop, logprobs)
    t0 = time.perf_counter()
    for e in firsts:
        e.wait(timeout=max(0.0, 900 - (time.perf_counter() - t0)))
    t_all_first = time.perf_counter()
    m_start = metrics(url)
    time.sleep(window)                      # the 'before' window
    m_sub = metrics(url)
    new = stream_completion(url, fresh_prompt(rng, n_vocab, p_tokens), 1)
    m_first = metrics(url)
    time.sleep(window)                      # the 'after' window
    m_after = metrics(url)
    t_after = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(timeout=120)
    wait_idle(url)
    m1 = metrics(url)
    per_thread, streams = streams, [s for lst in streams for s in lst]
    if new.error_kind:
        raise RuntimeError("the request under load failed: %s" % new.error)
    # Decoders not decoding through to the end of the 'after' window (their last request did not
    # run until the client closed it) and requests that replaced an ended one.
    not_through = [lst for lst in per_thread if not lst or not lst[-1].cancelled]
    res = {"clients": c, "prompt_tokens": p_tokens, "decode_max_tokens": decode_tokens, "window_s": window,
           "idle": idle, "idle_ttft_median_ms": statistics.median(r["ttft_ms"] for r in idle),
           "idle_sched_ttft_median_ms": statistics.median(r["sched_ttft_ms"] for r in idle),
           "idle_steps_median": statistics.median(r["steps"] for r in idle),
           "ttft_ms": 1000 * (new.t_first - new.t_submit), "new_prompt_tokens": new.prompt_tokens,
           "new_retries_503": new.retries_503,
           "sched_ttft_ms": 1000 * metric_delta(m_sub, m_first, TTFT_SUM),
           "steps_during_prefill": metric_delta(m_sub, m_first, STEPS),
           "server_itl": {"before": server_itl(m_start, m_sub), "prefill": server_itl(m_sub, m_first),
                          "after": server_itl(m_first, m_after)},
           "wait_all_first_s": t_all_first - t0,
           "decoders": len(per_thread), "decoders_failed": sum(1 for s in streams if s.error_kind),
           "decoders_not_through": len(not_through), "decoder_restarts": len(streams) - len(per_thread),
           "generated_tokens_metric": metric_delta(m0, m1, "fathom_generated_tokens_total"),
           "streamed_chunks": sum(len(s.times) for s in streams) + len(new.times)}
    res["ttft_vs_idle"] = res["ttft_ms"] / res["idle_ttft_median_ms"] if res["idle_ttft_median_ms"] > 0 else None
    # One idle prefill step (one chunk alone): what a decode step should grow by, at most, while
    # the new prompt is prefilled (issue 20: "must not stall decodes for more than one chunk's time").
    res["idle_ms_per_prefill_step"] = res["idle_sched_ttft_median_ms"] / max(res["idle_steps_median"], 1)
    res["itl"] = itl_windows(streams, len(per_thread), t_all_first, new.t_submit, new.t_first, t_after)
    pre, before = res["itl"]["prefill"], res["itl"]["before"]
    # The longest stall beyond a normal step, in idle prefill steps: ~1 when a decode waited for one
    # chunk, ~(chunks of P) when it waited for the whole prompt.
    res["stall_excess_ms"] = pre["max_ms"] - before["p50_ms"] if pre["n"] and before["n"] else None
    res["stall_in_chunks"] = (res["stall_excess_ms"] / res["idle_ms_per_prefill_step"]
                              if res["stall_excess_ms"] is not None and res["idle_ms_per_prefill_step"] > 0 else None)
    return res


def print_ttft_under_load(r):
    print("TTFT under load, C=%d decoding, new prompt %d tokens (server counted %d):"
          % (r["clients"], r["prompt_tokens"], r["new_prompt_tokens"]))
    print("  idle: TTFT median %.1f ms (scheduler %.1f ms, %g steps, %.1f ms per prefill step) over %d"
          % (r["idle_ttft_median_ms"], r["idle_sched_ttft_median_ms"], r["idle_steps_median"],
             r["idle_ms_per_prefill_step"], len(r["idle"])))
    print("  under load: TTFT %.1f ms (scheduler %.1f ms, %g steps) = %.2fx idle"
          % (r["ttft_ms"], r["sched_ttft_ms"], r["steps_during_prefill"], r["ttft_vs_idle"] or float("nan")))
    for k in ("before", "prefill", "after"):
        w = r["itl"][k]
        print("  decodes' ITL %-7s (%5.2f s, %5.1f chunks/stream, %7.1f chunks/s): %s"
              % (k, w["span_s"], w["chunks_per_stream"], w["agg_chunks_s"], fmt_lat(w)))
        sv = r["server_itl"][k]
        if sv["n"]:
            print("  %-40s server /metrics: %d token gaps, mean %.1f ms, max <= %s s"
                  % ("", sv["n"], sv["mean_ms"], sv["max_under_s"]))
    if r["stall_excess_ms"] is not None:
        print("  longest decode stall beyond a normal step (prefill max - before p50): %.1f ms = %.2f idle prefill "
              "steps (the prompt took %g idle steps)" % (r["stall_excess_ms"], r["stall_in_chunks"], r["idle_steps_median"]))
    print("  %d decoders (all first tokens after %.2f s): %d requests failed, %d restarted after an end of "
          "generation, %d not decoding to the end; chunks streamed %d, server generated_tokens %+g"
          % (r["decoders"], r["wait_all_first_s"], r["decoders_failed"], r["decoder_restarts"],
             r["decoders_not_through"], r["streamed_chunks"], r["generated_tokens_metric"]), flush=True)


# ---------------------------------------------------------------------------------------------------
# HTTP load test: C clients for a duration; errors, stalls, the server's RSS
# ---------------------------------------------------------------------------------------------------

def read_rss_kib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class RssSampler:
    """Samples a process's VmRSS every `period` seconds on a thread until stop()."""

    def __init__(self, pid, period=0.25):
        self.pid, self.period, self.samples = pid, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            v = read_rss_kib(self.pid)
            if v is not None:
                self.samples.append((time.perf_counter(), v))
            self._stop.wait(self.period)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        v = read_rss_kib(self.pid)
        if v is not None:
            self.samples.append((time.perf_counter(), v))
        if not self.samples:
            return None
        t0, s = self.samples[0][0], [v for _, v in self.samples]
        # The run in quarters (RSS at 25/50/75 % of the samples): a plateau vs a steady climb.
        return {"start_mib": s[0] / 1024, "peak_mib": max(s) / 1024, "end_mib": s[-1] / 1024, "samples": len(s),
                "quarters_mib": [s[len(s) * q // 4] / 1024 for q in (1, 2, 3)],
                "series": [(round(t - t0, 2), v) for t, v in self.samples]}


def load_test(url, c, duration, max_tokens, pid, stall_s, logprobs):
    """Measurement 4: C clients send streaming completions back to back for `duration` seconds
    (distinct counting prompts, max_tokens varied between half and all of `max_tokens` so requests
    end at different steps). Counts failures by kind, 503 retries, the longest gap between two
    chunks of any stream, and samples the server's RSS when its pid is known."""
    results, lock = [], threading.Lock()
    wait_idle(url)
    deadline = time.perf_counter() + duration
    rss = RssSampler(pid) if pid else None
    if rss:
        rss.start()
    m0 = metrics(url)

    def client(ci):
        r = 0
        while time.perf_counter() < deadline:
            k = 20000 + 131 * ci + 7 * r
            n = max_tokens // 2 + (ci * 7 + r * 3) % (max_tokens - max_tokens // 2 + 1)
            st = stream_completion(url, "Count: %d, %d, %d," % (k, k + 1, k + 2), max(n, 1), logprobs=logprobs)
            with lock:
                results.append(st)
            r += 1
            if st.error_kind == "exception":
                time.sleep(0.1)  # a refused or reset connection: do not spin on a dead server

    wall = run_clients(client, c)
    try:
        wait_idle(url)
        time.sleep(1.0)  # memory settles after the last requests
        m1 = metrics(url)
    except OSError as e:  # the server died: report what the clients saw
        print("load test: /metrics unreachable after the run (%s)" % e)
        m1 = m0
    mem = rss.stop() if rss else None
    kinds = {}
    for st in results:
        if st.error_kind:
            key = "http_%d" % st.status if st.error_kind == "http" else st.error_kind
            kinds[key] = kinds.get(key, 0) + 1
    gaps = [b - a for st in results for a, b in st.gaps()]
    ok = [st for st in results if not st.error_kind]
    worst = max(results, key=lambda st: max([b - a for a, b in st.gaps()] or [0.0]), default=None)
    return {"clients": c, "duration_s": duration, "wall_s": wall, "max_tokens": max_tokens,
            "requests": len(results), "ok": len(ok), "failures": kinds,
            "http_errors": sum(v for k, v in kinds.items() if k.startswith("http_")),
            "error_frames": kinds.get("frame", 0), "truncated": kinds.get("truncated", 0),
            "exceptions": kinds.get("exception", 0), "retries_503": sum(st.retries_503 for st in results),
            "tokens": sum(st.n_tokens for st in ok), "chunks": sum(len(st.times) for st in results),
            "tok_s": sum(st.n_tokens for st in ok) / wall if wall > 0 else 0.0,
            "itl": latency_summary(gaps), "stall_s": stall_s, "stalls": sum(1 for g in gaps if g > stall_s),
            "worst_gap_stream_tokens": len(worst.times) if worst else 0,
            "ttft": latency_summary([st.t_first - st.t_submit for st in ok]),
            "metrics": {"finished": metric_delta(m0, m1, "fathom_requests_finished_total"),
                        "rejected": metric_delta(m0, m1, "fathom_requests_rejected_total"),
                        "failed": metric_delta(m0, m1, "fathom_requests_failed_total"),
                        "cancelled": metric_delta(m0, m1, "fathom_requests_cancelled_total"),
                        "generated_tokens": metric_delta(m0, m1, "fathom_generated_tokens_total"),
                        "slots_busy_after": m1.get("fathom_slots_busy"),
                        "queue_depth_after": m1.get("fathom_queue_depth")},
            "rss": mem}


def print_load_test(r):
    print("load test, C=%d for %.0f s: %d requests, %d ok, %d tokens (%.1f tok/s); failures %s; "
          "503 retries %d" % (r["clients"], r["wall_s"], r["requests"], r["ok"], r["tokens"], r["tok_s"],
                              r["failures"] or "none", r["retries_503"]))
    print("  ITL %s; stalls (gap > %g s) %d; TTFT %s" % (fmt_lat(r["itl"]), r["stall_s"], r["stalls"],
                                                        fmt_lat(r["ttft"])))
    m = r["metrics"]
    print("  server /metrics: finished %+g, rejected %+g, failed %+g, cancelled %+g, generated tokens %+g; "
          "after: slots busy %s, queue %s" % (m["finished"], m["rejected"], m["failed"], m["cancelled"],
                                              m["generated_tokens"], m["slots_busy_after"], m["queue_depth_after"]))
    if r["rss"]:
        m = r["rss"]
        print("  server RSS: start %.1f MiB, peak %.1f MiB, end %.1f MiB (at 25/50/75 %% of the run: %s; %d samples)"
              % (m["start_mib"], m["peak_mib"], m["end_mib"], " / ".join("%.1f" % q for q in m["quarters_mib"]),
                 m["samples"]))
    print(flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (else --fathom and --model: the script spawns one)")
    ap.add_argument("--fathom")
    ap.add_argument("--model")
    ap.add_argument("--levels", default="1,4,16", help="throughput concurrency levels; 'none' skips them")
    ap.add_argument("--per-client", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (levels; load test's maximum)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=1024, help="server --ctx (raised to fit --prompt-tokens and "
                    "--decode-tokens when --ttft-under-load is given)")
    ap.add_argument("--ttft-reps", type=int, default=20)
    ap.add_argument("--no-ttft", action="store_true", help="skip the HTTP-path TTFT overhead measurement")
    ap.add_argument("--ttft-under-load", default="", metavar="C[,C...]",
                    help="TTFT of a fresh --prompt-tokens prompt while C streams decode (each C in turn)")
    ap.add_argument("--prompt-tokens", type=int, default=2048, metavar="P", help="the new request's prompt length")
    ap.add_argument("--decode-tokens", type=int, default=1024,
                    help="max_tokens of the decoding streams (they are closed after the 'after' window)")
    ap.add_argument("--window", type=float, default=2.0, help="seconds of the 'before' and 'after' ITL windows")
    ap.add_argument("--idle-reps", type=int, default=3, help="idle-server TTFT repetitions (median taken)")
    ap.add_argument("--load-test", type=int, default=0, metavar="C", help="HTTP load test with C clients")
    ap.add_argument("--duration", type=float, default=60.0, help="load test duration (seconds)")
    ap.add_argument("--stall-s", type=float, default=5.0, help="a gap between two chunks above this is a stall")
    ap.add_argument("--logprobs", action="store_true",
                    help="time every token, not every text chunk (requests ask for logprobs: a frame per token)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the random prompts (default: time)")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--serve-args", default="", help="extra `fathom serve` arguments (e.g. '--device cuda'); "
                    "a --parallel or --ctx here replaces the script's own")
    return ap


def spawn_for(args, levels, under_load):
    """Starts the server sized for every measurement asked for: --parallel = the most concurrent
    requests (C decodes + the new request), --ctx = enough for the long prompt and the decodes."""
    parallel = max(levels + [c + 1 for c in under_load] + [args.load_test, 1])
    ctx = args.ctx
    if under_load:
        ctx = max(ctx, args.prompt_tokens + 64, args.decode_tokens + 64)
    return start_server(args.fathom, args.model, parallel, args.threads, ctx, args.serve_args.split())


def run_levels(url, levels, args, out):
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
    out["levels"] = rows
    return sum(r["errors"] for r in rows)


def run_ttft_overhead(url, args, out):
    t = ttft_compare(url, args.fathom, args.model, args.threads, args.ctx, args.ttft_reps)
    out["ttft_overhead"] = t
    print("TTFT over %d requests: HTTP median %.2f ms, scheduler (submit -> first token) median %.2f ms, "
          "HTTP-path overhead median %.2f ms" % (t["reps"], t["http_ttft_median_ms"],
                                                t["sched_ttft_median_ms"], t["overhead_vs_sched_ms"]))
    if "run_prefill_median_ms" in t:
        print("`fathom run` prefill median %.2f ms: HTTP TTFT - run prefill = %.2f ms" %
              (t["run_prefill_median_ms"], t["overhead_vs_run_ms"]))


def main():
    args = parse_args().parse_args()
    levels = [] if args.levels in ("", "none") else [int(x) for x in args.levels.split(",")]
    under_load = [int(x) for x in args.ttft_under_load.split(",") if x]
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())
    proc, url = None, args.url
    if not url:
        if not (args.fathom and args.model):
            sys.exit("serve_load.py: --url or --fathom and --model")
        proc, url = spawn_for(args, levels, under_load)
    out = {"args": vars(args), "url": url, "props": None}
    failures = 0
    try:
        stream_completion(url, "Hello", 4)  # warm-up (page-in of the weights)
        props = get_json(url, "/props")
        out["props"] = {k: props.get(k) for k in ("model", "n_ctx", "parallel", "queue_capacity")}
        failures += run_levels(url, levels, args, out)
        if not args.no_ttft:
            run_ttft_overhead(url, args, out)
        out["ttft_under_load"] = []
        for c in under_load:
            r = ttft_under_load(url, c, args.prompt_tokens, args.decode_tokens, args.window, args.idle_reps, rng,
                                args.logprobs)
            out["ttft_under_load"].append(r)
            print_ttft_under_load(r)
            failures += r["decoders_failed"]
        if args.load_test:
            r = load_test(url, args.load_test, args.duration, args.max_tokens, proc.pid if proc else None,
                          args.stall_s, args.logprobs)
            out["load_test"] = r
            print_load_test(r)
            failures += r["requests"] - r["ok"] + r["stalls"]
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
