#!/usr/bin/env bash
# Where a multi-row step's time goes: the DS4 suites named by FILTER (while a reduced-layer DS4-Flash file
# is generated), then Nsight Compute over one decode step, one 16-sequence step and one 4-row step of that
# file at 8K (bench_cuda_ds4 --profile decode|seqs|rows: each kernel's duration alone, ncu_step.sh), the
# wall times of rows and sequences (bench_cuda_ds4 --rows WALL_ROWS --seqs WALL_SEQS; the carried old build's
# too, .cuda-carry/bench_old, packed with BENCH_OLD=), then the paged capacity at CAPS.
# Writes $OUT/step-{decode,seqs,rows}.csv (scripts/device/step_table.py reads them here).
# Usage (device): bash scripts/device/profile_rows.sh [layers=8]
# Env: STEPS (of "tests prof cap"; default all), FILTER, CAPS (131072), TEST_TIMEOUT (300), SEQS (16), ROWS (4),
# PROF_WHAT (of "decode seqs rows"), WALL_ROWS (2,4), WALL_SEQS (4,16)
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
L=${1:-8}
m=/tmp/ds4flash-q2-$L.gguf
[ -f "$m" ] || (timeout 300 "$c/fathom-gguf" synth "$m.tmp" --preset flash --mix q2 --layers "$L" --sparse -q > "$out/synth.log" 2>&1 &&
    mv "$m.tmp" "$m") &
rc=0
steps=" ${STEPS:-tests prof cap} "
if [[ $steps == *" tests "* ]]; then
    f=${FILTER:-CudaDs4Paged.*:CudaDs4Rollback.*:CudaDs4Model.*:CudaVmm.*}
    timeout "${TEST_TIMEOUT:-300}" "$c/test_cuda" --gtest_color=no --gtest_filter="$f" > "$out/test_cuda.log" 2>&1 || rc=1
    echo "== tests rc=$rc"; grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/test_cuda.log" | head -30; tail -2 "$out/test_cuda.log"
fi
wait
ls "$m" >/dev/null 2>&1 || { echo "no model file"; cat "$out/synth.log"; exit 1; }
if [[ $steps == *" prof "* ]]; then
    for b in $([ -x "$c/bench_old" ] && echo old) cuda_ds4; do
        echo "== $b: wall times ($L layers, 8K)"
        timeout 200 "$c/bench_$b" "$m" --depths 8192 --n 32 --prefill "" --paged --rows "${WALL_ROWS:-2,4}" \
            --seqs "${WALL_SEQS:-4,16}" 2>&1 | tee "$out/wall-$b.log" | grep -E "^ +8192|rows|sequences" | head -8
    done
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for what in ${PROF_WHAT:-decode seqs rows}; do
        timeout 240 "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
            --profile-from-start off --launch-count 20000 --csv --page raw \
            "$c/bench_cuda_ds4" "$m" --depths 8192 --n 2 --prefill "" --paged --profile "$what" \
            $([ "$what" = seqs ] && echo --seqs "${SEQS:-16}") $([ "$what" = rows ] && echo --rows "${ROWS:-4}") \
            > "$out/step-$what.csv" 2> "$out/step-$what.err"
        echo "ncu $what rc=$? rows $(wc -l < "$out/step-$what.csv")"; tail -2 "$out/step-$what.err"
    done
    command -v nsys >/dev/null && echo "nsys: $(command -v nsys)"
fi
if [[ $steps == *" cap "* ]]; then
    echo "== capacity ($L layers)"
    timeout 240 "$c/bench_cuda_ds4" "$m" --depths 8192 --n 8 --prefill "" --paged --capacity "${CAPS:-131072}" 2>&1 |
        tee "$out/cap.log" | grep -E "capacity|KB|B per" | tail -6
fi
exit $rc
