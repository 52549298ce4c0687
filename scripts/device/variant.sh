#!/usr/bin/env bash
# A/B builds for the device (run here, no GPU needed): recompiles the given CUDA sources of the CUDA
# build (sm_90a only) with extra defines into a copy of libfathom_cuda.a and links bench_cuda_ds4 (and,
# with TESTS=1, test_cuda and bench_cuda_kernels) against it as .cuda-carry/bench_NAME (test_NAME,
# bench_cuda_kernels_NAME), so one device call can
# alternate several builds (scripts/device/run_ab.sh). Then re-pack the carry:
#   tar -C <repo> -I 'zstd -12 --long=28 -T2' -cf .cuda-pack/carry.tzst .cuda-carry
# Usage: scripts/device/variant.sh NAME "-DSOME_MACRO=1 ..." src/backend/cuda/file.cu|.cpp [...]
# Build dir: $FATHOM_CUDA_BUILD (default <repo>/build-cuda, built by pack_cuda.sh first).
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
b="${FATHOM_CUDA_BUILD:-$root/build-cuda}"
name=$1; defs=$2; shift 2
v=$(mktemp -d /tmp/fathom-variant-$name.XXXX)
cp "$b/src/libfathom_cuda.a" "$v/lib.a"
for f in "$@"; do
    o=$(basename "$f").o  # the archive member of the same name is replaced
    case "$f" in
    *.cu) /usr/local/cuda/bin/nvcc -DFATHOM_HAVE_CUDA=1 -I"$root/include" -I"$root/src" -O3 -DNDEBUG -Xcompiler=-fPIC \
              -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++20 $defs -x cu -c "$root/$f" -o "$v/$o" ;;
    *) c++ -DFATHOM_HAVE_CUDA=1 -I"$root/include" -I"$root/src" -isystem /usr/local/cuda/include -O3 -DNDEBUG -fPIC \
           -std=c++20 $defs -c "$root/$f" -o "$v/$o" ;;
    esac
    (cd "$v" && ar r lib.a "$o")
done
link() {  # link target $1 (bench/cuda/bench_cuda_ds4) as $2
    local cmd
    cmd=$(cd "$b" && ninja -t commands "$1" | tail -1 | sed "s# src/libfathom_cuda.a # $v/lib.a #g; s#-o $1 #-o $v/$2 #")
    (cd "$b" && eval "$cmd")
    strip -o "$root/.cuda-carry/$2_$name" "$v/$2"
}
link bench/cuda/bench_cuda_ds4 bench
if [ "${TESTS:-0}" = 1 ]; then
    link tests/test_cuda test
    link bench/cuda/bench_cuda_kernels bench_cuda_kernels
fi
rm -rf "$v"
ls -la "$root/.cuda-carry/"*_"$name"
