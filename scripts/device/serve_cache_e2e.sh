#!/usr/bin/env bash
# End to end on the GPU: the disk prompt cache of `fathom serve --device cuda` (docs/prompt-cache.md).
# The synthetic DS4-Flash file (generated if missing), a ~2,000-token /v1/completions request
# (greedy), the server stopped (SIGTERM) and started again on the same --prompt-cache directory, the
# same request: the second reply must report cached_tokens > 0, carry the same text, and the
# fathom_prompt_cache_disk_hits_total counter must be 1. Prints both replies' usage and wall times.
# Usage (device): bash scripts/device/serve_cache_e2e.sh   (MODEL=another GGUF, e.g. a dense one; CTX=context,
# default 16384; DEVICE=cuda:N or cpu)
set -u
carry_bin=fathom
. "$(dirname "$0")/carry_env.sh"
m=${MODEL:-/tmp/ds4flash-q2.gguf}
[ -f "$m" ] || timeout 240 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --sparse -q
dir=/tmp/fathom-pc-e2e
rm -rf "$dir"
port=18092
body=$(python3 -c "import json; print(json.dumps({'prompt': 'The quick brown fox jumps over the lazy dog. ' * 200, 'max_tokens': 16, 'temperature': 0}))")
http() {  # METHOD PATH [JSON body]: the response body on stdout (no curl on the device image)
    python3 - "$port" "$@" <<'PY'
import sys, urllib.request
port, method, path = sys.argv[1], sys.argv[2], sys.argv[3]
data = sys.argv[4].encode() if len(sys.argv) > 4 else None
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                             headers={"Content-Type": "application/json"})
sys.stdout.write(urllib.request.urlopen(req, timeout=600).read().decode())
PY
}
serve_once() {  # $1: run number
    "$c/fathom" serve -m "$m" --device ${DEVICE:-cuda} --port $port --ctx ${CTX:-16384} --prompt-cache "$dir" > "$out/serve-$1.log" 2>&1 &
    local pid=$! i
    for i in $(seq 1 240); do http GET /health > /dev/null 2>&1 && break; sleep 0.5; done
    local t0 t1
    t0=$(date +%s.%N)
    http POST /v1/completions "$body" > "$out/reply-$1.json"
    t1=$(date +%s.%N)
    sleep 1  # the save is written by the scheduler's I/O thread after the prompt
    http GET /metrics | grep -E '^fathom_prompt_cache' > "$out/metrics-$1.txt"
    kill -TERM $pid; wait $pid
    echo "run $1: $(python3 -c "import json,sys; r=json.load(open('$out/reply-$1.json')); print(json.dumps(r.get('usage')), repr(r['choices'][0]['text'][:40]) if 'choices' in r else r)") in $(python3 -c "print(round($t1 - $t0, 3))") s"
    grep -E 'disk_(hits|saves|misses)_total' "$out/metrics-$1.txt" | tr '\n' ' '; echo
}
serve_once 1
ls -la "$dir"
serve_once 2
python3 - "$out" <<'PY'
import json, sys
o = sys.argv[1]
a, b = (json.load(open(f"{o}/reply-{i}.json")) for i in (1, 2))
cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
same = a["choices"][0]["text"] == b["choices"][0]["text"]
hits = [l for l in open(f"{o}/metrics-2.txt") if l.startswith("fathom_prompt_cache_disk_hits_total")]
ok = cached > 0 and same and hits and hits[0].split()[1] == "1"
print(f"cached_tokens {cached} of {b['usage']['prompt_tokens']}, same text {same}, disk hits {hits[0].split()[1] if hits else '?'}: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
