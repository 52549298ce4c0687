#!/usr/bin/env bash
# Set up (idempotent), build, and run the test suites with ctest.
#   scripts/test.sh            # every suite except those labelled "heavy" (what CI runs)
#   scripts/test.sh --fast     # also skip suites labelled "slow" (real-model and server integration)
#   scripts/test.sh --all      # everything, including "heavy" end-to-end evals (tens of minutes)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
"$repo/scripts/setup.sh"
args=(-LE heavy)
case "${1:-}" in
    --fast) args=(-LE "slow|heavy") ;;
    --all) args=() ;;
    "") ;;
    *) echo "usage: scripts/test.sh [--fast|--all]" >&2; exit 2 ;;
esac
ctest --test-dir build --output-on-failure -j"$(nproc)" "${args[@]}"
