#!/usr/bin/env bash
# End to end on the GPU: `fathom serve --device cuda` with DeepSeek V4 (ds4-tiny-a, paged state, the
# scheduler's batched steps) answering N concurrent greedy /v1/completions, each compared with the same
# request sent alone first (identical text: batch invariance through the server), then /metrics' KV gauges.
# Usage (device): bash scripts/device/serve_ds4_batch.sh [N=8]
set -u
carry_bin=fathom
. "$(dirname "$0")/carry_env.sh"
m="$c/shared/golden/ds4-tiny/ds4-tiny-a.gguf"
port=18093
"$c/fathom" serve -m "$m" --device ${DEVICE:-cuda} --port $port --ctx 2048 --parallel 4 > "$out/serve-batch.log" 2>&1 &
pid=$!
python3 - "$port" "${1:-8}" <<'PY'
import json, sys, time, urllib.error, urllib.request, concurrent.futures as cf
port, n = sys.argv[1], int(sys.argv[2])
def http(method, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode() if body else None,
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=300).read().decode()
    except urllib.error.HTTPError as e:  # the server's error message, then fail
        print(f"{method} {path}: HTTP {e.code}: {e.read().decode()[:400]}", file=sys.stderr)
        raise
for _ in range(240):
    try:
        http("GET", "/health"); break
    except Exception:
        time.sleep(0.5)
reqs = [{"prompt": f"Request {i}: " + "the quick brown fox " * (3 + 5 * i), "max_tokens": 24 + 4 * i, "temperature": 0}
        for i in range(n)]
alone = [json.loads(http("POST", "/v1/completions", r))["choices"][0]["text"] for r in reqs]
t0 = time.time()
with cf.ThreadPoolExecutor(n) as ex:
    together = [json.loads(x)["choices"][0]["text"] for x in ex.map(lambda r: http("POST", "/v1/completions", r), reqs)]
dt = time.time() - t0
same = sum(a == b for a, b in zip(alone, together))
print(f"{n} concurrent requests in {dt:.2f} s; identical to alone: {same}/{n}")
print("\n".join(l for l in http("GET", "/metrics").splitlines() if l.startswith(("fathom_kv", "fathom_requests"))))
sys.exit(0 if same == n else 1)
PY
rc=$?
kill -TERM $pid; wait $pid
tail -3 "$out/serve-batch.log"
exit $rc
