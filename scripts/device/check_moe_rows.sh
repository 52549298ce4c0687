#!/usr/bin/env bash
# One device call after a change of the multi-row step: the DS4 and MoE suites (while a reduced-layer
# DS4-Flash file is generated), the decode step of the carried old build (.cuda-carry/bench_old, packed
# with BENCH_OLD=) and the new one at 8K and 128K (paged, alternated ROUNDS times), then both builds'
# multi-row costs (rows of one sequence, several sequences) at 8K, then the new build's capacity.
# Usage (device): bash scripts/device/check_moe_rows.sh [layers=30] [rounds=2]
# Env: STEPS (of "tests ab rows serve cap"; default all; serve: scripts/device/serve_ds4_batch.sh 8), FILTER, ROWS (2,3,4,5), SEQS (2,4,8,16),
# CAPS (8192,32768,131072), TEST_TIMEOUT (300).
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
m=/tmp/ds4flash-q2-${1:-30}.gguf
(timeout 300 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --layers "${1:-30}" --sparse -q > "$out/synth.log" 2>&1) &
rc=0
steps=" ${STEPS:-tests ab rows serve cap} "
if [[ $steps == *" tests "* ]]; then
    f=${FILTER:-CudaDs4MoeStaged.*:CudaDs4HcFused.*:CudaDs4Model.*:CudaDs4State.*:CudaDs4Rollback.*:CudaDs4Paged.*:CudaDs4Mtp.*:CudaDs4Devices.*:CudaDs4Branches.*:CudaDs4Gemv.Rows*}
    timeout "${TEST_TIMEOUT:-300}" "$c/test_cuda" --gtest_color=no --gtest_filter="$f" > "$out/test_cuda.log" 2>&1 || rc=1
    echo "== tests rc=$rc"; grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/test_cuda.log" | head -30; tail -2 "$out/test_cuda.log"
fi
wait
ls "$m" >/dev/null 2>&1 || { echo "no model file"; cat "$out/synth.log"; exit 1; }
[[ $steps == *" ab "* ]] && for r in $(seq 1 "${2:-2}"); do
    for b in old cuda_ds4; do
        printf "round %s %-9s " "$r" "$b"
        timeout 100 "$c/bench_$b" "$m" --depths 8192,131072 --n 32 --prefill "" --paged 2>&1 | tee -a "$out/bench-$b.log" |
            awk '/^ +[0-9]+ +[0-9.]+ +[0-9.]+/ {printf "%s: %s tok/s  ", $1, $2} END {print ""}'
    done
done
[[ $steps == *" rows "* ]] && for b in old cuda_ds4; do
    echo "== $b: rows ${ROWS:-2,3,4,5}, sequences ${SEQS:-2,4,8,16} at 8K"
    timeout 200 "$c/bench_$b" "$m" --depths 8192 --n 32 --prefill "" --paged --rows "${ROWS:-2,3,4,5}" \
        --seqs "${SEQS:-2,4,8,16}" 2>&1 | tee "$out/rows-$b.log" | grep -Ei "rows|seq|x " | grep -Ev "^ +[a-z_].* ms +[0-9.]+%$" | tail -24
done
if [[ $steps == *" serve "* ]]; then
    echo "== serve: 8 concurrent DS4 requests vs each alone"
    timeout 150 bash "$(dirname "$0")/serve_ds4_batch.sh" 8 > "$out/serve.txt" 2>&1 || rc=1
    tail -12 "$out/serve.txt"
fi
if [[ $steps == *" cap "* ]]; then
    echo "== capacity"
    timeout 200 "$c/bench_cuda_ds4" "$m" --depths 8192 --n 8 --prefill "" --paged --capacity "${CAPS:-8192,32768,131072}" 2>&1 |
        tee "$out/cap.log" | grep -E "capacity|KB" | tail -6
fi
exit $rc
