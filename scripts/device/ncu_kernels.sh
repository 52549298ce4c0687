#!/usr/bin/env bash
# Nsight Compute on the device: profiles the kernels matching a regex while one gtest (usually a
# FATHOM_DS4_BENCH benchmark) runs, and writes the details page and the SASS source page (per-instruction
# stall samples) of the first matching launches to $OUT. Unpacks .cuda-pack/carry.tzst like the other scripts;
# NCU_TEST names the carried test binary (default test_cuda).
# Usage (device): bash scripts/device/ncu_kernels.sh 'gtest filter' 'kernel regex' [launch count] [launch skip]
set -u
. "$(dirname "$0")/carry_env.sh"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }
FATHOM_DS4_BENCH=1 timeout "${NCU_TIMEOUT:-300}" "$ncu" --clock-control none -k "regex:$2" \
    --launch-count "${3:-2}" --launch-skip "${4:-0}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SourceCounters --section InstructionStats -f -o "$out/prof" \
    "$c/${NCU_TEST:-test_cuda}" --gtest_color=no --gtest_filter="$1" > "$out/ncu.log" 2>&1
echo "ncu rc=$?"; tail -5 "$out/ncu.log"
"$ncu" --import "$out/prof.ncu-rep" --page details > "$out/details.txt" 2>&1
"$ncu" --import "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/sass.csv" 2>&1
ls -la "$out"
grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Memory Throughput|Compute \(SM\)|DRAM Throughput|Warp Cycles Per Issued|Theoretical Occupancy|Executed Instructions  " "$out/details.txt" | head -60
