#!/usr/bin/env python3
"""Independent float64 numpy reference forward for the dense GGUF family (llama, qwen3, gemma3).

Weights are dequantised with gguf-py (gguf.quants.dequantize), not with Fathom's kernels, and every
formula is written from the architecture descriptions (llama.cpp graphs), so the output is an
independent truth for tests/models. Prints/saves the logits of every position.

usage: dense_reference.py MODEL.gguf OUT.npy TOKEN [TOKEN ...]
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def main():
    path, out = sys.argv[1], sys.argv[2]
    toks = [int(t) for t in sys.argv[3:]]
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    T = {t.name: t for t in r.tensors}

    def W(name):
        t = T[name]
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        return a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a

    E = field(r, f"{arch}.embedding_length")
    L = field(r, f"{arch}.block_count")
    H = field(r, f"{arch}.attention.head_count")
    Hkv = field(r, f"{arch}.attention.head_count_kv", H)
    hd = field(r, f"{arch}.attention.key_length", E // H)
    eps = field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    base = field(r, f"{arch}.rope.freq_base", 10000.0)
    n_rot = field(r, f"{arch}.rope.dimension_count", hd)
    neox = arch in ("qwen3", "gemma3")
    gemma = arch == "gemma3"
    n_swa = field(r, f"{arch}.attention.sliding_window", 0) if gemma else 0

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x, pos, b):  # x [n, heads, hd]
        half = n_rot // 2
        inv = b ** (-2.0 * np.arange(half) / n_rot)
        th = np.outer(pos, inv)  # [n, half]
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        y = x.copy()
        if neox:
            a, bb = x[..., :half], x[..., half:n_rot]
            y[..., :half] = a * c - bb * s
            y[..., half:n_rot] = a * s + bb * c
        else:
            a, bb = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            y[..., 0:n_rot:2] = a * c - bb * s
            y[..., 1:n_rot:2] = a * s + bb * c
        return y

    n = len(toks)
    pos = np.arange(n, dtype=np.float64)
    emb = W("token_embd.weight")
    x = emb[toks]
    if gemma:
        x = x * np.sqrt(np.float32(E))
    scale = 1.0 / np.sqrt(hd)
    for il in range(L):
        p = f"blk.{il}."
        swa = gemma and n_swa > 0 and (il % 6) < 5
        h = rms(x, W(p + "attn_norm.weight"))
        q = (h @ W(p + "attn_q.weight").T).reshape(n, H, hd)
        k = (h @ W(p + "attn_k.weight").T).reshape(n, Hkv, hd)
        v = (h @ W(p + "attn_v.weight").T).reshape(n, Hkv, hd)
        if p + "attn_q_norm.weight" in T:
            q = rms(q, W(p + "attn_q_norm.weight"))
            k = rms(k, W(p + "attn_k_norm.weight"))
        b = (10000.0 if swa else base)
        q, k = rope(q, pos, b), rope(k, pos, b)
        g = H // Hkv
        o = np.zeros((n, H, hd))
        for hh in range(H):
            s = (q[:, hh, :] @ k[:, hh // g, :].T) * scale  # [n, n]
            i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
            mask = j > i
            if swa:
                mask |= (i - j) >= n_swa
            s[mask] = -np.inf
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            o[:, hh, :] = s @ v[:, hh // g, :]
        a = o.reshape(n, H * hd) @ W(p + "attn_output.weight").T
        if gemma:
            a = rms(a, W(p + "post_attention_norm.weight"))
        x = x + a
        h = rms(x, W(p + "ffn_norm.weight"))
        gt = h @ W(p + "ffn_gate.weight").T
        up = h @ W(p + "ffn_up.weight").T
        if gemma:
            act = 0.5 * gt * (1 + np.tanh(np.sqrt(2 / np.pi) * (gt + 0.044715 * gt ** 3)))
        else:
            act = gt / (1 + np.exp(-gt))
        f = (act * up) @ W(p + "ffn_down.weight").T
        if gemma:
            f = rms(f, W(p + "post_ffw_norm.weight"))
        x = x + f
    x = rms(x, W("output_norm.weight"))
    out_w = W("output.weight") if "output.weight" in T else emb
    logits = x @ out_w.T
    np.save(out, logits.astype(np.float32))
    print("argmax per position:", logits.argmax(axis=1).tolist())


if __name__ == "__main__":
    main()
