#!/usr/bin/env bash
# DS4 chunked prefill + device sampling in ONE device call: unpacks .cuda-pack/carry.tzst (pack_cuda.sh's
# .cuda-carry, tarred to fit the carry limit), runs the DS4 / sampling CUDA suites while the full
# DS4-Flash sparse synthetic file is generated, then bench_cuda_ds4 (chunked prefill per interval,
# decode at the given depths). Logs go to $OUT.
# Usage (device): bash scripts/device/run_ds4_prefill.sh [gtest filter|none] [prefill list|none] [decode depths|none]
# Optional environment: KBENCH='NAME[:NAME...]' runs those kernel benchmarks (bench_cuda_kernels; names or
# GoogleTest patterns, log kbench.log); PFLASH=32768,131072 runs bench_pflash_cuda (DS4 target above +
# the Qwen3-0.6B-geometry synthetic drafter, keep ${PFLASH_KEEP:-0.05}, drafter weights ${PFLASH_TYPES:-q8_0};
# logs pflash-TYPE.log).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:-$here/cuda-out}"
mkdir -p "$out"
filter="${1:-CudaDs4*:CudaSample*}"
prefill="${2:-2048,8192,32768}"
depths="${3:-8192}"
. "$here/scripts/device/unpack.sh"
c="$here/.cuda-carry"
export LD_LIBRARY_PATH="$c/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
. "$here/scripts/device/cuda_libs.sh"
cuda_libs "$c/test_cuda"
shared=$(grep -ao -E '/[[:alnum:]_/.-]*/\.\./shared' "$c/test_cuda" | head -1)
if [ -n "$shared" ] && [ ! -e "$shared/golden/ds4-tiny/cases.jsonl" ]; then
    mkdir -p "${shared%/../shared}" && ln -sfn "$c/shared" "$(cd "${shared%/../shared}/.." && pwd)/shared"
fi
m=/tmp/ds4flash-q2.gguf
[ -f "$m" ] || (timeout 240 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --sparse -q > "$out/synth.log" 2>&1; echo "synth rc=$?" >> "$out/synth.log") &
rc=0
if [ "$filter" != "none" ]; then
    timeout "${TEST_TIMEOUT:-280}" "$c/test_cuda" --gtest_color=no --gtest_filter="$filter" > "$out/tests.log" 2>&1 || rc=1
    grep -E "^\[  FAILED|^\[  PASSED|Failure|Expected|Which is|actual|  [a-z].*(median|identical|max e_p|rows differ)|rc=" "$out/tests.log" | head -120
    tail -3 "$out/tests.log"
fi
wait
cat "$out/synth.log" 2>/dev/null
[ "$prefill" = none ] && prefill=""
if [ "$depths" != none ]; then
    timeout "${BENCH_TIMEOUT:-200}" "$c/bench_cuda_ds4" "$m" --depths "$depths" --n 32 --prefill "$prefill" 2>&1 | tee "$out/bench.log" | grep -v "^  [a-z]"
fi
if [ -n "${KBENCH:-}" ]; then
    timeout "${KBENCH_TIMEOUT:-120}" "$c/bench_cuda_kernels" --gtest_color=no "$KBENCH" > "$out/kbench.log" 2>&1 || rc=1
    grep -Ev "^\[ RUN|^\[       OK|^$" "$out/kbench.log" | tail -40
fi
if [ -n "${PFLASH:-}" ]; then
    export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
    for t in ${PFLASH_TYPES:-q8_0}; do  # drafter weights: q8_0 (as Qwen3-0.6B is released) or mix (tests' f32 mix)
        d=/tmp/q3-$t.gguf
        if [ "$t" = mix ]; then [ -f $d ] || "$c/cuda_synth" qwen3 $d > "$out/q3synth-$t.log" 2>&1
        else [ -f $d ] || "$c/cuda_synth" qwen3 $d 0 $t > "$out/q3synth-$t.log" 2>&1; fi
        echo "drafter weights: $t"
        timeout "${PFLASH_TIMEOUT:-300}" "$c/bench_pflash_cuda" "$m" $d --lengths "$PFLASH" \
            --keep "${PFLASH_KEEP:-0.05}" 2>&1 | tee "$out/pflash-$t.log" | tail -8
    done
fi
exit $rc
