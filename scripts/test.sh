#!/usr/bin/env bash
# Set up (idempotent), build, and run every test suite with ctest.
#   scripts/test.sh            # all suites, including the slow ones
#   scripts/test.sh --fast     # skip suites labelled "slow"
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
"$repo/scripts/setup.sh"
args=()
[ "${1:-}" = "--fast" ] && args+=(-LE slow)
ctest --test-dir build --output-on-failure -j"$(nproc)" "${args[@]}"
