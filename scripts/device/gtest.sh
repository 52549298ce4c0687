#!/usr/bin/env bash
# Runs one carried gtest binary (.cuda-carry/test_NAME; default test_cuda) with a filter on the device,
# the carry unpacked and its libraries on the path. Kernel benchmarks: kbench.sh (bench_cuda_kernels).
# Usage (device): bash scripts/device/gtest.sh 'gtest filter' [NAME]
set -u
carry_bin=test_${2:-cuda}
. "$(dirname "$0")/carry_env.sh"
export FATHOM_CUDA_VOCAB_DIR="$c/vocab"
timeout "${TEST_TIMEOUT:-300}" "$c/$carry_bin" --gtest_color=no --gtest_filter="$1"
