#!/usr/bin/env bash
# One device call: the CUDA suite, then the paged-state benchmarks on a reduced-layer DS4-Flash file.
#   1. test_cuda with FILTER (default: everything but the Bench* tests), while the file is generated;
#   2. bench_cuda_ds4 at DEPTHS: sequences owning their rows vs paged (--paged) in turn, ROUNDS times;
#   3. once, paged: --capacity CAPS (sequences that fit per context length), --rows ROWS, --seqs SEQS.
# Usage (device): bash scripts/device/run_paged.sh [layers=30] [depths=8192,131072] [rounds=1]
# Env: STEPS (the steps to run, of "tests ab extra"; default all), FILTER, CAPS (8192,32768,131072),
# ROWS (2,4), SEQS (4,16), TEST_TIMEOUT (420).
set -u
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
sh=$(grep -ao -E '/[[:alnum:]_/.-]*/\.\./shared' "$c/test_cuda" | head -1)
if [ -n "$sh" ]; then
    mkdir -p "${sh%/../shared}" && ln -sfn "$c/shared" "$(cd "${sh%/../shared}/.." && pwd)/shared"
    mkdir -p "$c/shared/tokenizer-tests" && cp "$c"/vocab/*.gguf "$c/shared/tokenizer-tests/" 2>/dev/null
fi
layers=${1:-30}
m=/tmp/ds4flash-q2-$layers.gguf
(timeout 300 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --layers "$layers" --sparse -q > "$out/synth.log" 2>&1) &
rc=0
steps=" ${STEPS:-tests ab extra} "
if [[ $steps == *" tests "* ]]; then
    timeout "${TEST_TIMEOUT:-420}" "$c/test_cuda" --gtest_color=no --gtest_filter="${FILTER:-*:-*Bench*}" > "$out/test_cuda.log" 2>&1 || rc=1
    echo "== test_cuda (${FILTER:-*:-*Bench*}) rc=$rc"
    grep -E "^\[  FAILED|Failure|Expected|Which is|error" "$out/test_cuda.log" | head -40
    tail -3 "$out/test_cuda.log"
fi
wait
ls -la "$m" >/dev/null 2>&1 || { echo "no model file"; cat "$out/synth.log"; exit 1; }
[[ $steps == *" ab "* ]] && for r in $(seq 1 "${3:-1}"); do
    for mode in own paged; do
        flags=""; [ $mode = paged ] && flags=--paged
        printf "round %s %-6s " "$r" "$mode"
        timeout 150 "$c/bench_cuda_ds4" "$m" --depths "${2:-8192,131072}" --n 64 --prefill "" $flags 2>&1 |
            tee -a "$out/bench-$mode.log" | awk '/^ +[0-9]+ +[0-9.]+ +[0-9.]+/ {printf "%s: %s tok/s  ", $1, $2} END {print ""}'
    done
done
[[ $steps == *" extra "* ]] || exit $rc
echo "== paged: capacity, rows, sequences"
timeout 400 "$c/bench_cuda_ds4" "$m" --depths "${2:-8192,131072}" --n 32 --prefill "" --paged --capacity "${CAPS:-8192,32768,131072}" \
    --rows "${ROWS:-2,4}" --seqs "${SEQS:-4,16}" 2>&1 | tee "$out/bench-extra.log" | grep -Ev "^ +[a-z_].* ms +[0-9.]+%$" | tail -40
exit $rc
