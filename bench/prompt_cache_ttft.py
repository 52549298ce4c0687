#!/usr/bin/env python3
"""Time to first token with the disk prompt cache (docs/prompt-cache.md), standard library only.

For a long prompt (token ids, default 2000, sent to /v1/completions as a token list so its length is
exact) this measures, each on a freshly started `fathom serve --prompt-cache DIR` with the same DIR:

  cold   first request on an empty cache directory: the whole prompt is evaluated
  disk   after a restart (SIGTERM, new process): the prompt comes from the entry the cold run saved
  ram    a second request on that same server: the slot's session still holds it (for reference)

TTFT is the client-observed time from sending the request to the first streamed token (greedy,
max_tokens 1 for cold, disk and ram: the same work after the prefill). Each case runs --reps times
(a new cache directory and server per cold run; a restart per disk run) and the medians are printed,
with the entry's size and the server's own load / save times from /metrics. --evict drops the entry
file's pages from the page cache before the restart (posix_fadvise DONTNEED on the fsync'd file), so
the disk case reads the storage device instead of memory.

  python3 bench/prompt_cache_ttft.py --fathom build/fathom --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --tokens 2000 --threads 2 --reps 3 [--zstd 3] [--evict]
"""
import argparse
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time


def start_server(args, cache_dir):
    cmd = [args.fathom, "serve", "-m", args.model, "--port", "0", "--ctx", str(args.ctx), "-t", str(args.threads),
           "--prompt-cache", cache_dir, "--prompt-cache-zstd", str(args.zstd)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("fathom serve exited with %s" % proc.returncode)
        m = re.search(r"listening on http://([^:]+):(\d+)", line or "")
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, (m.group(1), int(m.group(2)))
    proc.kill()
    raise RuntimeError("fathom serve did not start")


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def ttft(addr, prompt):
    conn = http.client.HTTPConnection(addr[0], addr[1], timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, cached = None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and chunk.get("choices"):
            first = time.perf_counter() - t0
        if chunk.get("usage"):
            cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    conn.close()
    return first, cached


def metric(addr, name):
    conn = http.client.HTTPConnection(addr[0], addr[1], timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", default="build/fathom")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--zstd", type=int, default=0)
    ap.add_argument("--evict", action="store_true", help="drop the entry from the page cache before the restart")
    args = ap.parse_args()
    prompt = [300 + (i * 53) % 4000 for i in range(args.tokens)]
    cold, disk, ram, sizes, loads, saves = [], [], [], [], [], []
    for rep in range(args.reps):
        cache_dir = tempfile.mkdtemp(prefix="fathom_ttft_")
        try:
            proc, addr = start_server(args, cache_dir)
            t, c = ttft(addr, prompt)
            cold.append(t)
            assert c == 0, c
            while metric(addr, "fathom_prompt_cache_disk_saves_total") < 1:
                time.sleep(0.05)
            saves.append(metric(addr, "fathom_prompt_cache_disk_save_seconds_sum"))
            stop_server(proc)
            sizes.append(sum(os.path.getsize(os.path.join(cache_dir, f)) for f in os.listdir(cache_dir)))
            if args.evict:
                for f in os.listdir(cache_dir):
                    fd = os.open(os.path.join(cache_dir, f), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            proc, addr = start_server(args, cache_dir)
            t, c = ttft(addr, prompt)
            disk.append(t)
            assert c == args.tokens - 1, c
            loads.append(metric(addr, "fathom_prompt_cache_disk_load_seconds_sum"))
            t, c = ttft(addr, prompt)
            ram.append(t)
            stop_server(proc)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
        print("rep %d: cold %.3f s  disk %.3f s  ram %.3f s" % (rep, cold[-1], disk[-1], ram[-1]), flush=True)
    med = statistics.median
    print("prompt %d tokens, %d threads, zstd %d%s, %d reps (medians)" %
          (args.tokens, args.threads, args.zstd, ", entry evicted from the page cache" if args.evict else "", args.reps))
    print("  TTFT cold (evaluate the prompt): %.3f s" % med(cold))
    print("  TTFT disk (restart, load entry): %.3f s   (server load time %.4f s)" % (med(disk), med(loads)))
    print("  TTFT ram  (slot still holds it): %.3f s" % med(ram))
    print("  entry size %.1f MiB, save time %.4f s (after the request, off its path)" % (med(sizes) / 2**20, med(saves)))


if __name__ == "__main__":
    main()
