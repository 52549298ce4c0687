#!/usr/bin/env bash
# Two-GPU DS4 run in ONE device call (kind nvidia-h200-x2): the NCCL pipeline tests (run_x2.sh: CPU and
# CUDA stages bit for bit, dead-peer detection), then DS4-Flash at full geometry from sparse synthetic
# files: the q2 mix on one GPU with a 128K context, the 4-bit (MXFP4) experts refused on one GPU and split
# over both with `--devices cuda:0,cuda:1` and a 128K context (`fathom bench`, in-process pipeline).
# Binaries: scripts/device/pack_x2.sh, plus fathom and fathom-gguf (stripped) and their libraries in .x2-carry/.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
carry="$here/.x2-carry"
out="${OUT:-$here/x2-out}"
mkdir -p "$out"
bash "$here/scripts/device/run_x2.sh" >/dev/null 2>&1
cat "$out/summary.txt"
export LD_LIBRARY_PATH="$carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
. "$(dirname "${BASH_SOURCE[0]}")/cuda_libs.sh"
cuda_libs "$carry/fathom"
log="$out/ds4_x2.log"
m2=/tmp/ds4flash-q2.gguf m4=/tmp/ds4flash-mxfp4.gguf
timeout 150 "$carry/fathom-gguf" synth "$m2" --preset flash --mix q2 --sparse -q 2>&1 | tee -a "$log"
timeout 150 "$carry/fathom-gguf" synth "$m4" --preset flash --mix mxfp4 --sparse -q 2>&1 | tee -a "$log"
ls -ls "$m2" "$m4" | tee -a "$log"
b() { echo "== fathom bench $*" | tee -a "$log"; timeout 240 "$carry/fathom" bench "$@" 2>&1 | grep -v '^rep ' | tail -6 | tee -a "$log"; }
b -m "$m2" --device cuda:0 -p 32 -n 32 --reps 1 --ctx 131072
b -m "$m4" --device cuda:0 -p 32 -n 32 --reps 1 --ctx 131072
b -m "$m4" --devices cuda:0,cuda:1 -p 32 -n 32 --reps 1 --ctx 131072
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv | tee -a "$log"
