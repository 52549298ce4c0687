#!/usr/bin/env bash
# One device call after a change of the DS4 state layout: the DS4 model suites, then the decode step of the
# carried old build (.cuda-carry/bench_old) and the new one, paged, at 8K and 128K, alternated ROUNDS times.
# Usage (device): bash scripts/device/check_rows_layout.sh [rounds=1]
set -u
. "$(dirname "$0")/carry_env.sh"
sh=$(grep -ao -E '/[[:alnum:]_/.-]*/\.\./shared' "$c/test_cuda" | head -1)
[ -n "$sh" ] && mkdir -p "${sh%/../shared}" && ln -sfn "$c/shared" "$(cd "${sh%/../shared}/.." && pwd)/shared"
m=/tmp/ds4flash-q2-30.gguf
(timeout 200 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --layers 30 --sparse -q > "$out/synth.log" 2>&1) &
timeout 200 "$c/test_cuda" --gtest_color=no \
    --gtest_filter='CudaDs4Model.*:CudaDs4State.*:CudaDs4Rollback.*:CudaDs4Paged.*:CudaDs4Mtp.*:CudaDs4Devices.*:CudaDs4Branches.*' \
    > "$out/test_cuda.log" 2>&1; rc=$?
echo "== tests rc=$rc"; grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/test_cuda.log" | head -20; tail -2 "$out/test_cuda.log"
wait
for r in $(seq 1 "${1:-1}"); do
    for b in old cuda_ds4; do
        printf "round %s %-9s " "$r" "$b"
        timeout 100 "$c/bench_$b" "$m" --depths 8192,131072 --n 32 --prefill "" --paged 2>&1 | tee -a "$out/bench-$b.log" |
            awk '/^ +[0-9]+ +[0-9.]+ +[0-9.]+/ {printf "%s: %s tok/s  ", $1, $2} END {print ""}'
    done
done
exit $rc
