#!/usr/bin/env bash
# test_cuda with a filter on the device, the failures and the last lines of the log printed.
# Usage (device): bash scripts/device/gtest_ds4.sh FILTER [timeout=300]
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
timeout "${2:-300}" "$c/test_cuda" --gtest_color=no --gtest_filter="$1" > "$out/gtest.log" 2>&1; rc=$?
echo "== rc=$rc"; grep -E "^\[  FAILED|Failure|Expected|Which is|exception" "$out/gtest.log" | head -30; tail -15 "$out/gtest.log"
exit $rc
