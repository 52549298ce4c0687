# Sourced by the device scripts: $here (repo root), $out ($OUT or cuda-out, created), the carried
# binaries unpacked into $c (.cuda-carry, from .cuda-pack/carry.tzst or carry.tgz when not there yet) with their
# libraries on LD_LIBRARY_PATH (cuda_libs on the binary named by $carry_bin, default test_cuda).
here=$(cd "$(dirname "$0")/../.." && pwd)
out="${OUT:-$here/cuda-out}"
mkdir -p "$out"
. "$here/scripts/device/unpack.sh"
c="$here/.cuda-carry"
export LD_LIBRARY_PATH="$c/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
. "$here/scripts/device/cuda_libs.sh"
cuda_libs "$c/${carry_bin:-test_cuda}"
