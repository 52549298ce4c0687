#!/usr/bin/env bash
# The whole carried test_cuda suite (benchmarks aside) on the device, DS4 goldens and dense vocabularies
# linked: the final-tree check of a session. Usage (device): bash scripts/device/test_all.sh [filter]
# Env: TEST_TIMEOUT (seconds, 330). Output: $OUT/test_all.log, its failures and last lines printed.
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
timeout "${TEST_TIMEOUT:-330}" "$c/test_cuda" --gtest_color=no --gtest_filter="${1:-*:-*Bench*}" > "$out/test_all.log" 2>&1
rc=$?
grep -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests from .* ran" "$out/test_all.log" | head -30
grep -c "^\[       OK" "$out/test_all.log" | sed 's/^/OK: /'
echo "rc=$rc"
exit $rc
