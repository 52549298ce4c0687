# Sourced by the ncu_*.sh scripts (device): $here (repo root), $out ($OUT or cuda-out), the carried
# binaries unpacked into $c (.cuda-carry, from .cuda-pack/carry.tgz) with their libraries on the path,
# and $ncu (Nsight Compute; the script exits when there is none).
here=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:-$here/cuda-out}"
mkdir -p "$out"
[ -d "$here/.cuda-carry" ] || tar -C "$here" -xzf "$here/.cuda-pack/carry.tgz"
c="$here/.cuda-carry"
export LD_LIBRARY_PATH="$c/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
. "$here/scripts/device/cuda_libs.sh"
cuda_libs "$c/test_cuda"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }
