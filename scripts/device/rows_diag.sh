#!/usr/bin/env bash
# Why a multi-row DS4 step costs what it does, in the time one device call has left (meant as
# dense_vs_llamacpp.sh's EXTRA, while llama.cpp builds): the DS4 suites named by FILTER, the wall times of
# rows / sequences, the DSpark drafter's costs and speculation at controlled acceptance (bench_cuda_ds4 --rows
# --seqs --dspark --spec-accept, at DEPTHS: 8192,131072), Nsight Compute's
# per-kernel durations of a ROWS-row step and a one-row step (step-rows.csv, step-decode.csv;
# scripts/device/step_table.py reads them), and ncu's sections (occupancy, warp stalls, launch stats) for
# the multi-row dense GEMV (gemv_q8x_cols_kernel) and the rows MoE kernels of that step (sections-rows.txt).
# Usage (device): bash scripts/device/rows_diag.sh [layers=8]; env FILTER ("none": no tests; TEST_TIMEOUT 150), ROWS (4),
# BUDGET_S (330: what is left is skipped), SPEC (acceptances, 0,60,80,90), SPEC_TOKENS (64), NCU (0: no profiles),
# MTP (1: the target synthesised with its MTP block, fathom-gguf synth --mtp, so --spec-accept adds the "MTP paid"
# runs: the head's chained drafts and rows costed; its own file name, /tmp/ds4flash-q2-L-mtp.gguf).
# OLD_SPEC (1: the carried bench_old runs --spec-accept too, the A/B of a drafting change), SPEC_SEQS (a,b: also
# speculation inside batches of a, b sequences, --spec-seqs).
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
t0=$(date +%s)
left() { echo $(( ${BUDGET_S:-330} - ($(date +%s) - t0) )); }
L=${1:-8}
mtp=(); [ "${MTP:-0}" = 1 ] && mtp=(--mtp)
m=/tmp/ds4flash-q2-$L${mtp:+-mtp}.gguf d=/tmp/ds4flash-q2-$L-dspark.gguf
( [ -f "$m" ] || timeout 240 "$c/fathom-gguf" synth "$m.tmp" --preset flash --mix q2 --layers "$L" --sparse "${mtp[@]}" -q > "$out/synth-ds4.log" 2>&1 &&
      mv "$m.tmp" "$m"
  [ -f "$d" ] || timeout 200 "$c/fathom-gguf" synth "$d.tmp" --preset flash --mix q2 --layers "$L" --sparse --dspark -q >> "$out/synth-ds4.log" 2>&1 &&
      mv "$d.tmp" "$d" ) &
rc=0
f=${FILTER:-CudaDs4Dspark.*:CudaDs4Rollback.*}
if [ "$f" != none ]; then
    timeout ${TEST_TIMEOUT:-150} "$c/test_cuda" --gtest_color=no --gtest_filter="$f" > "$out/test_ds4.log" 2>&1 || rc=1
    echo "== DS4 tests ($f) rc=$rc"
    grep -E "^\[  FAILED|Failure|Expected|Which is|exception" "$out/test_ds4.log" | head -20; tail -2 "$out/test_ds4.log"
fi
wait
[ -f "$m" ] || { echo "no DS4 file"; cat "$out/synth-ds4.log"; exit 1; }
ds=(); [ -f "$d" ] && ds=(--dspark "$d")
timeout ${BENCH_TIMEOUT:-$([ ${#mtp[@]} -gt 0 ] && echo 260 || echo 200)} "$c/bench_cuda_ds4" "$m" --depths "${DEPTHS:-8192,131072}" --n 32 --prefill "" --paged --rows 2,3,4,5 --seqs 4,16 "${ds[@]}" \
    --spec-accept "${SPEC:-0,60,80,90}" --spec-tokens "${SPEC_TOKENS:-64}" ${SPEC_SEQS:+--spec-seqs "$SPEC_SEQS"} > "$out/bench-rows.log" 2>&1
echo "== bench rows rc=$? ($L layers, 8K)"; grep -E "^ +[0-9]+ |rows|sequences|dspark|DSpark|mtp|MTP|draft|observe|capture|a = |speculation" "$out/bench-rows.log" | head -64
if [ -x "$c/bench_old" ]; then  # the carried old build (BENCH_OLD=): the same step sizes, for the A/B
    old_spec=(); [ "${OLD_SPEC:-0}" = 1 ] && old_spec=(--spec-accept "${SPEC:-0,60,80,90}" --spec-tokens "${SPEC_TOKENS:-64}")
    timeout $([ ${#old_spec[@]} -gt 0 ] && echo 200 || echo 90) "$c/bench_old" "$m" --depths 8192 --n 32 --prefill "" --paged \
        --rows 4 --seqs 16 "${old_spec[@]}" > "$out/bench-rows-old.log" 2>&1
    echo "== bench_old rows rc=$?"; grep -E "^ +[0-9]+ |rows|sequences|mtp|MTP|a = |speculation" "$out/bench-rows-old.log" | head -24
fi
[ "${NCU:-1}" = 0 ] && exit $rc  # NCU=0: no profiles
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for what in ${NCU_WHAT:-rows decode}; do  # NCU_WHAT: any of rows decode seqs (a step of SEQS sequences)
    [ "$(left)" -gt 60 ] || { echo "skip ncu $what (budget)"; continue; }
    timeout $(( $(left) - 20 )) "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --profile-from-start off --launch-count 20000 --csv --page raw \
        "$c/bench_cuda_ds4" "$m" --depths 8192 --n 2 --prefill "" --paged --profile "$what" \
        $([ "$what" = rows ] && echo --rows "${ROWS:-4}") $([ "$what" = seqs ] && echo --seqs "${SEQS:-16}") \
        > "$out/step-$what.csv" 2> "$out/step-$what.err"
    echo "ncu $what rc=$? rows $(wc -l < "$out/step-$what.csv")"; tail -1 "$out/step-$what.err"
    # the table here too (the device tool brings back only a few files)
    python3 "$here/scripts/device/step_table.py" "$out/step-$what.csv" 2>&1 | head -24 > "$out/table-$what.txt"
    cat "$out/table-$what.txt"
done
if [ "$(left)" -gt 45 ]; then
    timeout $(( $(left) - 10 )) "$ncu" --clock-control none --profile-from-start off \
        --kernel-name regex:'q8x_mma|rows_staged' --launch-count 6 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        "$c/bench_cuda_ds4" "$m" --depths 8192 --n 2 --prefill "" --paged --profile rows --rows "${ROWS:-4}" \
        > "$out/sections-rows.txt" 2>&1
    echo "ncu sections rc=$? lines $(wc -l < "$out/sections-rows.txt")"
fi
exit $rc
