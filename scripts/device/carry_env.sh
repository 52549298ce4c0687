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
# The test binary reads the goldens at the build machine's <repo>/../shared (compiled in): that path made to
# point at the carried copy (.cuda-carry/shared). Called by the scripts that run DS4 tests.
link_shared() {
    local sh
    sh=$(grep -ao -E '/[[:alnum:]_/.-]*/\.\./shared' "$c/test_cuda" | head -1)
    [ -n "$sh" ] && mkdir -p "${sh%/../shared}" && ln -sfn "$c/shared" "$(cd "${sh%/../shared}/.." && pwd)/shared"
}
