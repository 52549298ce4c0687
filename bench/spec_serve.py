#!/usr/bin/env python3
"""`fathom serve` with and without --spec ngram on the same model, same run (docs/speculative.md).

Three chat requests (160 tokens, temperature 0) one after another, then the three at once, against
`serve --parallel 3 -t 2`; prints tok/s, the concurrent wall time, the spec counters from /metrics, and
whether the texts are identical. Usage: python3 bench/spec_serve.py build/fathom gemma3
"""
import json, subprocess, sys, time, urllib.request, re, concurrent.futures
exe, model = sys.argv[1], sys.argv[2]
prompts = ["Repeat the following paragraph exactly, word for word: The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun while the quick brown fox runs across the green field.",
           "List the numbers from 1 to 30 in words, one per line.",
           "Tell me a short story about a lighthouse keeper."]
def serve(extra, port):
    p = subprocess.Popen([exe, "serve", "-m", model, "--port", str(port), "-t", "2", "--parallel", "3"] + extra, stderr=subprocess.PIPE, text=True)
    while True:
        line = p.stderr.readline()
        if "listening" in line: return p
        if not line and p.poll() is not None: raise SystemExit("server died")
def chat(port, c):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"messages": [{"role": "user", "content": c}], "temperature": 0, "max_tokens": 160}).encode())
    return json.loads(urllib.request.urlopen(req, timeout=300).read())
res = {}
for name, extra, port in (("plain", [], 18481), ("spec", ["--spec", "ngram"], 18482)):
    p = serve(extra, port)
    try:
        chat(port, "hi")
        t0 = time.time(); seq = [chat(port, c) for c in prompts]; t_seq = time.time() - t0
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(3) as ex: conc = list(ex.map(lambda c: chat(port, c), prompts))
        t_conc = time.time() - t0
        m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        spec = {k: v for k, v in re.findall(r"^(fathom_spec_\w+) ([\d.e+]+)", m, re.M)}
        toks = sum(r["usage"]["completion_tokens"] for r in seq)
        res[name] = ([r["choices"][0]["message"]["content"] for r in seq], [r["choices"][0]["message"]["content"] for r in conc])
        print(f"{name}: sequential {toks} tokens in {t_seq:.2f} s ({toks/t_seq:.1f} tok/s); 3 concurrent in {t_conc:.2f} s; {spec}")
    finally:
        p.terminate(); p.wait()
print("same text (sequential):", res["plain"][0] == res["spec"][0], " (concurrent):", res["plain"][1] == res["spec"][1], " seq==conc:", res["plain"][0] == res["plain"][1])
