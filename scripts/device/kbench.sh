#!/usr/bin/env bash
# Runs CUDA kernel benchmarks of the carried bench_cuda_kernels (bench/cuda; default the packed build,
# VARIANT: .cuda-carry/bench_cuda_kernels_VARIANT from variant.sh) on the device, the carry unpacked and
# its libraries on the path.
# Usage (device): bash scripts/device/kbench.sh 'NAME[:NAME...]' [VARIANT]
#   NAME: a benchmark (Suite.Name, bench_cuda_kernels --list) or a GoogleTest pattern ('CudaDs4GemvBench.*').
set -u
carry_bin=bench_cuda_kernels${2:+_$2}
. "$(dirname "$0")/carry_env.sh"
timeout "${KBENCH_TIMEOUT:-300}" "$c/$carry_bin" --gtest_color=no "$1"
