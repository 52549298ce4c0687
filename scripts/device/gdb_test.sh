#!/usr/bin/env bash
# A crashing test_cuda case under gdb (cuda-gdb when there is no gdb): the backtrace of the fault.
# Usage (device): bash scripts/device/gdb_test.sh FILTER
set -u
. "$(dirname "$0")/carry_env.sh"
link_shared
g=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null | head -1)
[ -n "$g" ] || { echo "no gdb"; exit 1; }
timeout 240 "$g" -q -batch -ex run -ex bt -ex "info registers rip" --args "$c/test_cuda" --gtest_color=no --gtest_filter="$1" 2>&1 |
    grep -vE "^\[New Thread|^\[Thread|^\[Detaching|libthread_db" | tail -40
