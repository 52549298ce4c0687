#!/usr/bin/env bash
# A/B decode benchmark of several carried bench_cuda_ds4 builds in ONE device call: each binary
# .cuda-carry/bench_NAME runs in turn (NAME from the list; "cuda_ds4" is the packed build), ROUNDS
# times over, at the given depths, on the synthetic DS4-Flash file (generated here if missing).
# Alternating the binaries spreads clock and thermal drift over all of them.
# Usage (device): bash scripts/device/run_ab.sh "base new new+--serial-step ..." [depths] [rounds] [n]
# (an entry NAME+--flag runs bench_NAME with --flag; several flags: NAME+--a+--b).
# Optional: TESTS="NAME:gtest filter;NAME:filter" runs .cuda-carry/test_NAME with that filter first
# (while the model file is generated); KBENCH="NAME:benchmarks;..." runs kernel benchmarks afterwards
# (bench_cuda_kernels with those names or patterns: NAME "cuda" the packed build, else variant.sh's
# bench_cuda_kernels_NAME).
set -u
first=$(echo "$1" | awk '{print $1}')
carry_bin=${CARRY_BIN:-bench_${first%%+*}}
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
shared=$(cat "$c"/test_* 2>/dev/null | grep -ao -E '/[[:alnum:]_/.-]*/\.\./shared' | head -1)
if [ -n "$shared" ] && [ ! -e "$shared/golden/ds4-tiny/cases.jsonl" ]; then
    mkdir -p "${shared%/../shared}" && ln -sfn "$c/shared" "$(cd "${shared%/../shared}/.." && pwd)/shared"
fi
m=/tmp/ds4flash-q2.gguf
[ -f "$m" ] || (timeout 240 "$c/fathom-gguf" synth "$m" --preset flash --mix q2 --sparse -q > "$out/synth.log" 2>&1) &
rc=0
IFS=';' read -ra tests <<< "${TESTS:-}"
for t in "${tests[@]}"; do
    name=${t%%:*}; filter=${t#*:}
    timeout "${TEST_TIMEOUT:-280}" "$c/test_$name" --gtest_color=no --gtest_filter="$filter" > "$out/tests-$name.log" 2>&1 || rc=1
    echo "== test_$name ($filter)"; grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/tests-$name.log" | head -30; tail -1 "$out/tests-$name.log"
done
wait
for r in $(seq 1 "${3:-3}"); do
    for b in $1; do  # NAME, or NAME+--flag+... (bench_NAME with those flags, e.g. new+--serial-step)
        bin=${b%%+*}; flags=""
        [ "$bin" != "$b" ] && flags=$(echo "${b#*+}" | tr '+' ' ')
        printf "round %s %-24s " "$r" "$b"
        timeout "${BENCH_TIMEOUT:-120}" "$c/bench_$bin" "$m" --depths "${2:-8192}" --n "${4:-32}" --prefill "" $flags 2>&1 |
            tee -a "$out/bench-$(echo "$b" | tr -c '[:alnum:]_\n-' '_').log" |
            awk '/^ +[0-9]+ +[0-9.]+ +[0-9.]+/ {printf "%s: %s tok/s  ", $1, $2} END {print ""}'
    done
done
IFS=';' read -ra kb <<< "${KBENCH:-}"
for t in "${kb[@]}"; do
    name=${t%%:*}; filter=${t#*:}
    kb="$c/bench_cuda_kernels"; [ "$name" != cuda ] && kb="$c/bench_cuda_kernels_$name"
    echo "== kbench $(basename "$kb") ($filter)"
    timeout "${KBENCH_TIMEOUT:-120}" "$kb" --gtest_color=no "$filter" 2>&1 |
        grep -Ev "^\[ RUN|^\[       OK|^$|^\[---|^\[===|Global test" | tail -30
done
exit $rc
