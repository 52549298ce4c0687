#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct Q4_1 (98 MB) through `fathom --device cuda` on the device machine.
# The device tool carries at most 64 MiB per call (working tree included), so the file travels in two
# halves over consecutive calls while the machine stays warm, and is reassembled and SHA-256 checked:
#   here:   split -n 2 -d models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/p. &&
#           mkdir -p .smol-a .smol-b && mv /tmp/p.00 .smol-a/part0 && mv /tmp/p.01 .smol-b/part1
#           (.smol-a/ and .smol-b/ listed in .git/info/exclude; binaries from pack_cuda.sh)
#   call 1 (carry .cuda-carry): bash scripts/device/real_smollm2.sh bins   (after the test run)
#   call 2 (carry .smol-a):     bash scripts/device/real_smollm2.sh part0
#   call 3 (carry .smol-b):     bash scripts/device/real_smollm2.sh run <sha256 of the whole file>
# `run` compares logits of 48 fixed token ids, CUDA (prefill, decode, chunked:7) against the CPU in
# exact and default mode (relative L2, greedy argmax per position), compares greedy generated text
# (CUDA vs CPU exact), and benchmarks with the roofline line. Logs go to $OUT.
set -u
stage=/tmp/fathom-real
out="${OUT:-$PWD/cuda-out}"
mkdir -p "$stage" "$out"
case "${1:-}" in
bins) rm -rf "$stage/carry" && cp -r .cuda-carry "$stage/carry" && echo "binaries staged" ;;
part0) cp .smol-a/part0 "$stage/part0" && echo "part0 staged" ;;
run)
    [ -f "$stage/part0" ] && [ -x "$stage/carry/fathom" ] || { echo "stage missing (machine not warm?)"; exit 1; }
    m="$stage/smollm2.gguf"
    cat "$stage/part0" .smol-b/part1 > "$m"
    got=$(sha256sum "$m" | cut -d' ' -f1)
    [ "$got" = "${2:-}" ] || { echo "sha256 mismatch: $got"; exit 1; }
    echo "reassembled, sha256 ok"
    export LD_LIBRARY_PATH="$stage/carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    . "$(dirname "${BASH_SOURCE[0]}")/cuda_libs.sh"
    cuda_libs "$stage/carry/fathom"
    f="$stage/carry/fathom"
    python3 -c "import random; random.seed(5); print(' '.join(str(random.randrange(49152)) for _ in range(48)))" > "$stage/ids.txt"
    $f logits -m "$m" --tokens-file "$stage/ids.txt" --out "$stage/cpu_exact.f32" --exact 2>/dev/null
    $f logits -m "$m" --tokens-file "$stage/ids.txt" --out "$stage/cpu_fast.f32" 2>/dev/null
    for mode in prefill decode chunked:7; do
        $f logits -m "$m" --tokens-file "$stage/ids.txt" --out "$stage/cuda_${mode%%:*}.f32" --mode "$mode" --device cuda 2>/dev/null
    done
    python3 - "$stage" <<'PY' | tee "$out/real_smollm2.log"
import sys, numpy as np
d = sys.argv[1]
ld = lambda n: np.fromfile(f"{d}/{n}.f32", dtype=np.float32).reshape(48, -1).astype(np.float64)
ref = ld("cpu_exact")
rel = lambda a: np.linalg.norm(a - ref) / np.linalg.norm(ref)
am = ref.argmax(1)
print(f"SmolLM2-135M Q4_1 (real), 48 tokens, rel L2 vs CPU exact:")
for n in ["cpu_fast", "cuda_prefill", "cuda_decode", "cuda_chunked"]:
    a = ld(n)
    print(f"  {n}: rel L2 {rel(a):.3e}, greedy argmax equal at {int((a.argmax(1) == am).sum())}/48 positions")
PY
    $f run -m "$m" --temp 0 -n 32 -p "What is the capital of France?" --exact 2>/dev/null > "$stage/g_cpu.txt"
    $f run -m "$m" --temp 0 -n 32 -p "What is the capital of France?" --device cuda 2>"$stage/g_cuda.err" > "$stage/g_cuda.txt"
    echo "greedy text CPU exact: $(tr '\n' ' ' < "$stage/g_cpu.txt")" | tee -a "$out/real_smollm2.log"
    echo "greedy text CUDA:      $(tr '\n' ' ' < "$stage/g_cuda.txt")" | tee -a "$out/real_smollm2.log"
    cmp -s "$stage/g_cpu.txt" "$stage/g_cuda.txt" && echo "greedy text equal" | tee -a "$out/real_smollm2.log"
    tail -1 "$stage/g_cuda.err" | tee -a "$out/real_smollm2.log"
    for extra in "" "--no-cuda-graph" "--ctx 1024"; do
        echo "== fathom bench --device cuda -p 512 -n 128 $extra" | tee -a "$out/real_smollm2.log"
        $f bench -m "$m" --device cuda -p 512 -n 128 --reps 3 $extra 2>&1 | grep -v '^rep ' | tee -a "$out/real_smollm2.log"
    done
    ;;
*) echo "usage: real_smollm2.sh bins | part0 | run SHA256"; exit 2 ;;
esac
