#!/usr/bin/env bash
# DSpark on one GPU in one device call: the DSpark and speculation suites (FILTER) while a reduced-layer
# DS4-Flash q2 file and its full-geometry DSpark drafter are generated, then bench_cuda_ds4 on that file at
# 8K: the one-row step, the rows of one sequence and of several, and the drafter's costs (--dspark: the
# decode step with the feature capture, one draft block, the observation of a window's rows); then the
# whole test_cuda suite with what time is left (WHOLE=0 skips it). SERVE=1: before the whole suite, `fathom serve
# --device cuda` on that file under bench/serve_load.py (TTFT of a 4096-token prompt while 16 streams decode, and
# an HTTP load test of LOAD clients for LOAD_S seconds; --logprobs: every token timed, not every text chunk:
# the synthetic model's byte soup holds text back).
# Usage (device): bash scripts/device/dspark_check.sh [layers=8]
# Env: FILTER, TEST_TIMEOUT (240), WHOLE (1), WHOLE_TIMEOUT (240), ROWS (2,4,5), SEQS (4,16), SERVE (0), LOAD (16,64),
# LOAD_S (30)
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
L=${1:-8}
m=/tmp/ds4flash-q2-$L.gguf d=/tmp/ds4flash-q2-$L-dspark.gguf
( [ -f "$m" ] || timeout 300 "$c/fathom-gguf" synth "$m.tmp" --preset flash --mix q2 --layers "$L" --sparse -q > "$out/synth.log" 2>&1 &&
      mv "$m.tmp" "$m"
  [ -f "$d" ] || timeout 300 "$c/fathom-gguf" synth "$d.tmp" --preset flash --mix q2 --layers "$L" --sparse --dspark -q >> "$out/synth.log" 2>&1 &&
      mv "$d.tmp" "$d" ) &
rc=0
f=${FILTER:-CudaDs4Dspark.*:CudaDs4Rollback.*:CudaDs4Mtp.*:CudaDs4Attn.Argmax*:CudaDs4Paged.*}
timeout "${TEST_TIMEOUT:-240}" "$c/test_cuda" --gtest_color=no --gtest_filter="$f" > "$out/test_dspark.log" 2>&1 || rc=1
echo "== targeted tests rc=$rc"
grep -E "^\[  FAILED|Failure|Expected|Which is|exception|feature-fed|end-to-end|feature err|drafted" "$out/test_dspark.log" | head -40
tail -3 "$out/test_dspark.log"
wait
if [ -f "$m" ] && [ -f "$d" ]; then
    echo "== bench ($L layers, 8K)"
    timeout 240 "$c/bench_cuda_ds4" "$m" --depths 8192 --n 32 --prefill "" --paged --rows "${ROWS:-2,4,5}" \
        --seqs "${SEQS:-4,16}" --dspark "$d" > "$out/bench.log" 2>&1
    echo "bench rc=$?"; grep -E "^ +8192|rows|sequences|dspark|roofline|bench_cuda_ds4" "$out/bench.log" | head -20; tail -3 "$out/bench.log"
else
    echo "no model files"; cat "$out/synth.log"
fi
if [ "${SERVE:-0}" = 1 ] && [ -f "$m" ]; then
    for C in $(echo "${LOAD:-16,64}" | tr , ' '); do
        echo "== serve_load: $C clients"
        timeout 200 python3 "$here/bench/serve_load.py" --fathom "$c/fathom" --model "$m" --levels none --no-ttft \
            $([ "$C" = 16 ] && echo --ttft-under-load 16 --prompt-tokens 4096 --decode-tokens 1024 --window 2 --idle-reps 2 --logprobs) \
            --load-test "$C" --duration "${LOAD_S:-30}" --max-tokens 128 --json "$out/load-$C.json" \
            --serve-args "--device cuda --parallel $((C + 1)) --ctx 8192" > "$out/load-$C.log" 2>&1
        echo "rc=$?"; tail -40 "$out/load-$C.log"
    done
fi
if [ "${WHOLE:-1}" = 1 ]; then
    timeout "${WHOLE_TIMEOUT:-240}" "$c/test_cuda" --gtest_color=no --gtest_filter='*:-*Bench*' > "$out/test_all.log" 2>&1
    r=$?
    echo "== whole test_cuda rc=$r"
    grep -E "^\[  FAILED|Failure" "$out/test_all.log" | head -20
    tail -3 "$out/test_all.log"
    [ $r -eq 0 ] || rc=1
fi
exit $rc
