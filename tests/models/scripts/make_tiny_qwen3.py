#!/usr/bin/env python3
"""Write a tiny random qwen3 GGUF (f32/f16 weights, untied output, head_dim != n_embd/n_head)
and its float64 reference logits (dense_reference.py) as the golden JSON used by test_models.

usage: make_tiny_qwen3.py OUT_DIR
"""
import os
import subprocess
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType


def main():
    out_dir = sys.argv[1]
    path = os.path.join(out_dir, "tiny_qwen3.gguf")
    rng = np.random.default_rng(7)
    E, L, H, Hkv, hd, F, V = 32, 2, 4, 2, 16, 48, 64
    w = GGUFWriter(path, "qwen3")
    w.add_context_length(128)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)

    def t(name, *shape, f16=False, scale=0.3, center=0.0):
        a = (center + scale * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, a.astype(np.float16) if f16 else a,
                     raw_dtype=GGMLQuantizationType.F16 if f16 else None)

    t("token_embd.weight", V, E, scale=1.0)
    t("output_norm.weight", E, scale=0.1, center=1.0)
    t("output.weight", V, E, f16=True)
    for i in range(L):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", E, scale=0.1, center=1.0)
        t(p + "attn_q.weight", H * hd, E)
        t(p + "attn_k.weight", Hkv * hd, E)
        t(p + "attn_v.weight", Hkv * hd, E, f16=True)
        t(p + "attn_q_norm.weight", hd, scale=0.1, center=1.0)
        t(p + "attn_k_norm.weight", hd, scale=0.1, center=1.0)
        t(p + "attn_output.weight", E, H * hd)
        t(p + "ffn_norm.weight", E, scale=0.1, center=1.0)
        t(p + "ffn_gate.weight", F, E)
        t(p + "ffn_up.weight", F, E)
        t(p + "ffn_down.weight", E, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    toks = [str(x) for x in [3, 17, 42, 8, 8, 63, 0, 25, 11, 5]]
    here = os.path.dirname(os.path.abspath(__file__))
    npy = os.path.join(out_dir, "tiny_qwen3_logits.npy")
    subprocess.check_call([sys.executable, os.path.join(here, "dense_reference.py"), path, npy] + toks)
    subprocess.check_call([sys.executable, os.path.join(here, "make_reference_json.py"), npy,
                           os.path.join(out_dir, "tiny_qwen3_reference.json"), "tiny_qwen3.gguf"] + toks)
    os.remove(npy)


if __name__ == "__main__":
    main()
