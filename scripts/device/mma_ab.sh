#!/usr/bin/env bash
# One device call: the DS4 suites named by FILTER on the carried build, then the multi-row step's cost with the
# tensor-core GEMV's L2 hints at each of PREFETCH (rounds ahead; 0 = none), alternated ROUNDS times in one
# build (bench_cuda_ds4 --mma-prefetch P --rows ROWS --seqs SEQS at 8K, paged), then, with SPEC (acceptances),
# speculation at controlled acceptance over SPEC_TOKENS tokens (the MTP head paid: a long run shows the
# adaptive width's steady state, not its first probes).
# Usage (device): bash scripts/device/mma_ab.sh [layers=8]; env FILTER ("none": no tests; TEST_TIMEOUT 200),
# PREFETCH (0,2,4), ROUNDS (2), ROWS (2,4), SEQS (4,16), SPEC (0,90; "none": skip), SPEC_TOKENS (512), NSYS (0).
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
for r in $(seq "${ROUNDS:-2}"); do
    for p in $(echo "${PREFETCH:-0,2,4}" | tr , ' '); do
        timeout 120 "$c/bench_cuda_ds4" "$m" --depths 8192 --n 32 --prefill "" --paged --rows "${ROWS:-2,4}" \
            --seqs "${SEQS:-4,16}" --mma-prefetch "$p" > "$out/bench-p$p-r$r.log" 2>&1
        echo "== round $r, mma prefetch $p: rc=$?"
        grep -E "^ +8192 |rows +[0-9]+ of|sequences, one row" "$out/bench-p$p-r$r.log" | sed -e 's/; logits bit-identical.*//' -e 's/; a new composition.*//'
    done
done
if [ "${SPEC:-0,90}" != none ]; then
    timeout 240 "$c/bench_cuda_ds4" "$m" --depths 8192 --n 16 --prefill "" --paged --spec-accept "${SPEC:-0,90}" \
        --spec-tokens "${SPEC_TOKENS:-512}" > "$out/bench-spec.log" 2>&1
    echo "== speculation rc=$?"; grep -E "speculation|a = " "$out/bench-spec.log"
fi
# NSYS=1: the timeline of one step of ROWS_TL rows (4) and of SEQS_TL sequences (16), every kernel with its
# stream, start and end (nsys, graph nodes traced): tl-rows.csv / tl-seqs.csv (scripts/device/timeline.py).
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
if [ "${NSYS:-0}" = 1 ] && [ -n "$nsys" ]; then
    for what in rows seqs; do
        timeout 120 "$nsys" profile -o "/tmp/tl-$what" --force-overwrite true --stats=false --capture-range=cudaProfilerApi \
            --cuda-graph-trace=node "$c/bench_cuda_ds4" "$m" --depths 8192 --n 4 --prefill "" --paged --profile "$what" \
            $([ "$what" = rows ] && echo --rows "${ROWS_TL:-4}") $([ "$what" = seqs ] && echo --seqs "${SEQS_TL:-16}") \
            > "$out/nsys-$what.log" 2>&1
        timeout 90 "$nsys" stats -q --report cuda_gpu_trace --format csv "/tmp/tl-$what.nsys-rep" > "$out/tl-$what.csv" 2>/dev/null
        echo "== nsys $what: $(wc -l < "$out/tl-$what.csv") lines"
        python3 "$here/scripts/device/timeline.py" "$out/tl-$what.csv" 2>&1 | head -30
    done
elif [ "${NSYS:-0}" = 1 ]; then echo "(no nsys)"; fi
exit $rc
