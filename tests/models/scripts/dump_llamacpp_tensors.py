#!/usr/bin/env python3
"""Dump every named f32 intermediate of llama.cpp's graph for one golden prompt (test-time tool).

Runs llama.cpp through llama-cpp-python's low-level API with an eval callback (cb_eval) and saves
each contiguous f32 node as OUT/<name>#<k>.npy (k = occurrence of that name in the graph, shape
[ne3, ne2, ne1, ne0]). Compare with fathom's dense trace (the dense_trace callback of dense_forward, models/dense.h), which uses
the same names for the main tensors (llama.cpp's ffn_out = fathom's ffn_down, ffn_post_norm =
fathom's ffn_out, sa_out = fathom's ffn_inp).

Usage: dump_llamacpp_tensors.py MODEL.gguf GOLDEN.json CASE OUT_DIR [--threads 2]
"""
import argparse
import ctypes
import json
import os

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("golden")
    ap.add_argument("case", type=int)
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    toks = json.load(open(a.golden))["cases"][a.case]["tokens"]

    base = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    base.ggml_get_name.restype = ctypes.c_char_p
    base.ggml_get_name.argtypes = [ctypes.c_void_p]
    base.ggml_get_data.restype = ctypes.c_void_p
    base.ggml_get_data.argtypes = [ctypes.c_void_p]
    base.ggml_nbytes.restype = ctypes.c_size_t
    base.ggml_nbytes.argtypes = [ctypes.c_void_p]
    base.ggml_is_contiguous.restype = ctypes.c_bool
    base.ggml_is_contiguous.argtypes = [ctypes.c_void_p]

    seen = {}

    # struct ggml_tensor: enum type at offset 0, buffer pointer at 8, int64 ne[4] at 16.
    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
    def cb(t, ask, _user):
        if ask:
            return True
        if ctypes.c_int32.from_address(t).value != 0 or not base.ggml_is_contiguous(t):  # f32 only
            return True
        data = base.ggml_get_data(t)
        if not data:
            return True
        name = base.ggml_get_name(t).decode()
        ne = [ctypes.c_int64.from_address(t + 16 + 8 * i).value for i in range(4)]
        k = seen.get(name, 0)
        seen[name] = k + 1
        arr = np.frombuffer(ctypes.string_at(data, base.ggml_nbytes(t)), dtype=np.float32)
        np.save(os.path.join(a.out, f"{name}#{k}.npy"), arr.reshape(ne[3], ne[2], ne[1], ne[0]))
        return True

    L.llama_backend_init()
    model = L.llama_model_load_from_file(a.model.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = 512
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = a.threads
    if hasattr(cp, "flash_attn_type"):  # the goldens use flash attention off (auto may turn it on)
        cp.flash_attn_type = 0
    else:
        cp.flash_attn = False
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    ctx = L.llama_init_from_model(model, cp)
    arr = (L.llama_token * len(toks))(*toks)
    if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(toks))) != 0:
        raise SystemExit("llama_decode failed")
    print(f"{len(seen)} tensor names written to {a.out}")


if __name__ == "__main__":
    main()
