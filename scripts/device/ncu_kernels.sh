#!/usr/bin/env bash
# Nsight Compute on the device: profiles the kernels matching a regex while kernel benchmarks (bench_cuda_kernels)
# or tests run, and writes the details page and the SASS source page (per-instruction stall samples) of the
# first matching launches to $OUT. Unpacks .cuda-pack/carry.tzst like the other scripts; NCU_TEST names the
# carried binary (default bench_cuda_kernels: the first argument names benchmarks; a test_* binary: a gtest filter).
# Usage (device): bash scripts/device/ncu_kernels.sh 'benchmarks|gtest filter' 'kernel regex' [launch count] [launch skip]
set -u
carry_bin=${NCU_TEST:-bench_cuda_kernels}
. "$(dirname "$0")/carry_env.sh"
case $carry_bin in test_*) select="--gtest_filter=$1" ;; *) select=$1 ;; esac
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }
timeout "${NCU_TIMEOUT:-300}" "$ncu" --clock-control none -k "regex:$2" \
    --launch-count "${3:-2}" --launch-skip "${4:-0}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SourceCounters --section InstructionStats -f -o "$out/prof" \
    "$c/$carry_bin" --gtest_color=no "$select" > "$out/ncu.log" 2>&1
echo "ncu rc=$?"; tail -5 "$out/ncu.log"
"$ncu" --import "$out/prof.ncu-rep" --page details > "$out/details.txt" 2>&1
"$ncu" --import "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
ls -la "$out"
grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Memory Throughput|Compute \(SM\)|DRAM Throughput|Warp Cycles Per Issued|Theoretical Occupancy|Executed Instructions  " "$out/details.txt" | head -60
