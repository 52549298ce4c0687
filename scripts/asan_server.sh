#!/usr/bin/env bash
# ASan + LSan (+ UBSan) check of the server: builds `fathom`, `test_server` and `test_cache` with
# -DFATHOM_SANITIZE=ON in build-asan-server/ (RelWithDebInfo-ish: -O1, so the build stays short),
# runs the model-free server suite (with the hardening tests: slow clients, body limits, origins)
# and the prompt cache's model-free suites, then the reliability load test in CI mode against the
# sanitized `fathom serve` (64 clients, random cancellations, 8 hostile clients trickling headers
# and bodies or sending oversized chunked bodies; memory
# check off because ASan's quarantine holds freed memory), then a shorter one with the disk prompt cache on (a 20 MiB cap, so
# the I/O thread saves, loads and evicts entries all the time while the worker serves). Any sanitizer
# report, leak at exit, 5xx other than 503, or unclean exit fails the script. Aim: under ~10 minutes
# on 2 cores (most of it is the build).
#
#   scripts/asan_server.sh [LOAD_SECONDS]     (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"
build="${FATHOM_ASAN_BUILD:-build-asan-server}"
model="models/SmolLM2-135M-Instruct.Q4_1.gguf"
start=$(date +%s)
say() { echo "=== [$(( $(date +%s) - start ))s] $*"; }

say "configure $build (ASan+UBSan, -O1)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFATHOM_SANITIZE=ON \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" >/dev/null
say "build fathom test_server test_cache"
cmake --build "$build" --target fathom test_server test_cache -j"${FATHOM_JOBS:-2}"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="report_objects=0"

say "test_server under ASan/UBSan"
# The real-model BatchDecode tests take minutes under ASan; the load test below drives the same
# batched decode path (several slots decoding at once) through the sanitized server.
"$build/tests/test_server" --gtest_brief=1 --gtest_filter='-BatchDecode.*'
say "test_cache (model-free: entry format, damage, directory, killed writer) under ASan/UBSan"
"$build/tests/test_cache" --gtest_brief=1 --gtest_filter='CacheEntry.*:CacheDir.*'

if [ ! -f "$model" ]; then
    echo "asan_server: $model missing (scripts/install-models.sh); load test skipped" >&2
    exit 1
fi
say "load test, ${secs} s, 64 clients, against the sanitized server"
python3 tests/server/load_test.py --fathom "$build/fathom" --model "$model" \
        --duration "$secs" --warmup 5 --no-rss --parallel 4 --ctx 512
cache_dir="$(mktemp -d)"
trap 'rm -rf "$cache_dir"' EXIT
say "load test with the disk prompt cache, $(( (secs + 1) / 2 )) s"
python3 tests/server/load_test.py --fathom "$build/fathom" --model "$model" \
        --duration "$(( (secs + 1) / 2 ))" --warmup 5 --no-rss --parallel 4 --ctx 512 \
        --serve-args "--prompt-cache $cache_dir --prompt-cache-max-gib 0.02 --prompt-cache-min-tokens 8"
say "asan_server: OK"
