# Sourced by the device scripts: cuda_libs BINARY adds to LD_LIBRARY_PATH the folders of the CUDA 13
# runtime / cuBLAS libraries that BINARY does not resolve (on the device image they may live only in
# a Python wheel, e.g. PyTorch's).
cuda_libs() {
    local lib d
    for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
        if ! ldd "$1" | grep "$lib" | grep -q "=> /"; then
            d=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
            [ -n "$d" ] && export LD_LIBRARY_PATH="$(dirname "$d"):$LD_LIBRARY_PATH"
        fi
    done
}
