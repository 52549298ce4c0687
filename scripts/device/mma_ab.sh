#!/usr/bin/env bash
# One device call: the DS4 suites named by FILTER on the carried build, then the multi-row step's cost with the
# tensor-core GEMV's units per block-wide meeting at each of SLOTS (1 = a meeting per unit), alternated ROUNDS
# times in one build (bench_cuda_ds4 --mma-slots S --rows ROWS --seqs SEQS at 8K, paged), then, with SPEC (acceptances),
# speculation at controlled acceptance over SPEC_TOKENS tokens (the MTP head paid: a long run shows the
# adaptive width's steady state, not its first probes).
# Usage (device): bash scripts/device/mma_ab.sh [layers=8]; env FILTER ("none": no tests; TEST_TIMEOUT 200),
# SLOTS (1,4), OLD (0), ROUNDS (2), ROWS (2,4), SEQS (4,16), SPEC (0,90; "none": skip), SPEC_TOKENS (512), NCU (0).
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
L=${1:-8}
m=/tmp/ds4flash-q2-$L-mtp.gguf
( [ -f "$m" ] || timeout 240 "$c/fathom-gguf" synth "$m.tmp" --preset flash --mix q2 --layers "$L" --sparse --mtp -q \
      > "$out/synth-ds4.log" 2>&1 && mv "$m.tmp" "$m" ) &
rc=0
f=${FILTER:-CudaDs4Gemv.*:CudaDs4Mtp.*:CudaDs4Rollback.*:CudaDs4Model.*:CudaDs4Paged.*}
if [ "$f" != none ]; then
    timeout "${TEST_TIMEOUT:-200}" "$c/test_cuda" --gtest_color=no --gtest_filter="$f" > "$out/test_ds4.log" 2>&1 || rc=1
    echo "== DS4 tests ($f) rc=$rc"
    grep -E "^\[  FAILED|Failure|Expected|Which is|exception" "$out/test_ds4.log" | head -20; tail -3 "$out/test_ds4.log"
fi
wait
[ -f "$m" ] || { echo "no DS4 file"; cat "$out/synth-ds4.log"; exit 1; }
# OLD=1: instead of the slots, this build against the carried bench_old (BENCH_OLD= at pack time), alternated
runs=(); if [ "${OLD:-0}" = 1 ]; then runs=("bench_cuda_ds4:" "bench_old:"); else
    for p in $(echo "${SLOTS:-1,4}" | tr , ' '); do runs+=("bench_cuda_ds4:--mma-slots $p"); done; fi
for r in $(seq "${ROUNDS:-2}"); do
    for run in "${runs[@]}"; do
        b=${run%%:*} extra=${run#*:} tag=$(echo "${run}" | tr -c 'a-z0-9\n' _)
        timeout 120 "$c/$b" "$m" --depths 8192 --n 32 --prefill "" --paged --rows "${ROWS:-2,4}" \
            --seqs "${SEQS:-4,16}" $extra > "$out/bench-$tag-r$r.log" 2>&1
        echo "== round $r, $b $extra: rc=$?"
        grep -E "^ +8192 |rows +[0-9]+ of|sequences, one row" "$out/bench-$tag-r$r.log" | sed -e 's/; logits bit-identical.*//' -e 's/; a new composition.*//'
    done
done
if [ "${SPEC:-0,90}" != none ]; then
    timeout 240 "$c/bench_cuda_ds4" "$m" --depths 8192 --n 16 --prefill "" --paged --spec-accept "${SPEC:-0,90}" \
        --spec-tokens "${SPEC_TOKENS:-512}" > "$out/bench-spec.log" 2>&1
    echo "== speculation rc=$?"; grep -E "speculation|a = " "$out/bench-spec.log"
fi
# NCU=1: the tensor-core kernel's own durations in a ROWS_NCU-row step (4) at each of SLOTS (Nsight Compute)
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ "${NCU:-0}" = 1 ] && [ -n "$ncu" ]; then
    for run in "${runs[@]}"; do
        b=${run%%:*} extra=${run#*:} p=$(echo "${run}" | tr -c 'a-z0-9\n' _)
        timeout 100 "$ncu" --clock-control none --profile-from-start off --kernel-name regex:'q8x_mma' --launch-count 8 \
            --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv --page raw \
            "$c/$b" "$m" --depths 8192 --n 2 --prefill "" --paged --profile rows --rows "${ROWS_NCU:-4}" \
            $extra > "$out/ncu-slots$p.csv" 2> "$out/ncu-slots$p.err"
        echo "== ncu $b $extra rc=$? (us, DRAM %):"
        python3 - "$out/ncu-slots$p.csv" <<'PY'
import csv, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
rows = list(csv.reader(lines[next(i for i, l in enumerate(lines) if l.startswith('"ID"')):]))
ix = {h: j for j, h in enumerate(rows[0])}
num = lambda v: float(v.replace(",", ""))
scale = 1e-3 if rows[1][ix["gpu__time_duration.sum"]] in ("ns", "nsecond") else 1.0
print("  " + "  ".join(f"{num(r[ix['gpu__time_duration.sum']]) * scale:.1f} us {r[ix['Grid Size']]} "
                       f"({num(r[ix['dram__throughput.avg.pct_of_peak_sustained_elapsed']]):.0f} % DRAM)"
                       for r in rows[2:] if len(r) == len(rows[0])))
PY
    done
fi
exit $rc
