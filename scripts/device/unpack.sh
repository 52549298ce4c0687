# Sourced on the device before the other scripts: unpacks .cuda-pack/carry.tzst (zstd --long, which
# shares the common code of several carried builds: ~2.5x smaller than gzip) with the carried zstd
# (.cuda-pack/zstd.tgz) when the image has none; carry.tgz as before otherwise.
_r=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [ -f "$_r/.cuda-pack/carry.tzst" ] && [ ! -d "$_r/.cuda-carry" ]; then
    if command -v zstd > /dev/null; then _z=zstd
    else tar -C /tmp -xzf "$_r/.cuda-pack/zstd.tgz"; _z="env LD_LIBRARY_PATH=/tmp/zs /tmp/zs/zstd"; fi
    $_z -d --long=28 -c "$_r/.cuda-pack/carry.tzst" | tar -C "$_r" -xf -
elif [ ! -d "$_r/.cuda-carry" ]; then
    tar -C "$_r" -xzf "$_r/.cuda-pack/carry.tgz"
fi
