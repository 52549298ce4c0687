#!/usr/bin/env python3
"""Generate quantisation reference data and format tables from the gguf PyPI package (gguf-py).

gguf-py's numpy code (gguf/quants.py) is an implementation of the GGML block formats that is
independent of Fathom's C++ kernels, so it serves as the truth for test_quant (tests/backend/cpu).

  python3 scripts/gen_quant_ref.py refs       # -> tests/backend/cpu/data/*.bin   (pip install gguf numpy)
  python3 scripts/gen_quant_ref.py iq-tables  # -> src/backend/cpu/iq_tables.cpp
  python3 scripts/gen_quant_ref.py iq2-cover  # -> tests/backend/cpu/data/deq_iq2_xxs_cover.bin

Reference file layout (little-endian): magic b"FQRF", u32 kind (0 = dequant, 1 = quant), u32 ggml
type id, u32 n (elements), then
  kind 0: n/block*type_size bytes of random VALID blocks, then n f32 = gguf.quants.dequantize(blocks)
  kind 1: n f32 inputs, then the bytes gguf.quants.quantize(inputs) produced.
q8_1 and q8_K have no gguf-py quantiser; their expected bytes come from the numpy transcriptions of
ggml's reference quantisers below (quantize_q8_1 / quantize_q8_k), which follow ggml-quants.c's
quantize_row_q8_1_ref / quantize_row_q8_K_ref line by line.
"""
import os
import struct
import sys

import numpy as np

from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "backend", "cpu", "data")

# Byte offsets of the f16 scale fields of each block type (d, and dmin/m where present).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ2_XXS: [0],
}
POSITIVE_ONLY = {T.Q2_K, T.Q4_K, T.Q5_K}  # d/dmin of these are non-negative in real files


def random_blocks(rng, t, n_blocks):
    """Random bytes with every scale replaced by a finite, moderate value."""
    bs, ts = GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in F16_FIELDS.get(t, []):
        mag = rng.uniform(1e-3, 0.1, size=n_blocks)
        sign = 1.0 if t in POSITIVE_ONLY else rng.choice([-1.0, 1.0], size=n_blocks)
        b[:, off:off + 2] = (mag * sign).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if t == T.MXFP4:
        b[:, 0] = rng.integers(0, 256, size=n_blocks)  # E8M0 exponents across the range
        b[:, 0] = np.minimum(b[:, 0], 160)  # keep products with activations finite
        b[0, 0], b[1, 0] = 0, 1  # the subnormal half-scales
    return b


def write_ref(name, kind, t, n, payload_a, payload_b):
    with open(os.path.join(DATA, name), "wb") as f:
        f.write(b"FQRF" + struct.pack("<III", kind, int(t), n))
        f.write(payload_a.tobytes())
        f.write(payload_b.tobytes())


def quantize_q8_1(x):
    """ggml quantize_row_q8_1_ref: d = amax/127, q = roundf(x/d) (half away from zero), s = d*sum(q)."""
    x = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        idv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = quants.np_roundf(x * idv).astype(np.int8)
    s = (q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32) * d).astype(np.float32)
    return np.concatenate([d.astype(np.float16).view(np.uint8), s.astype(np.float16).view(np.uint8),
                           q.view(np.uint8)], axis=1)


def quantize_q8_k(x):
    """ggml quantize_row_q8_K_ref: iscale = -127/max (max = signed value of largest |x|, first one),
    q = min(127, nearest_int(iscale*x)) with round-half-even, d = 1/iscale, bsums = 16-sums of q."""
    out = []
    for blk in x.reshape(-1, 256).astype(np.float32):
        amax_i = int(np.argmax(np.abs(blk)))
        mx = blk[amax_i]
        if mx == 0:
            out.append(np.zeros(292, dtype=np.uint8))
            continue
        iscale = np.float32(-127.0) / mx
        q = np.minimum(np.rint(iscale * blk).astype(np.int32), 127).astype(np.int8)
        d = np.float32(1.0) / iscale
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        out.append(np.concatenate([np.array([d], np.float32).view(np.uint8), q.view(np.uint8),
                                   bsums.view(np.uint8)]))
    return np.stack(out)


def gen_refs():
    os.makedirs(DATA, exist_ok=True)
    rng = np.random.default_rng(20261129)
    dequant_types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.Q2_K, T.Q3_K, T.Q4_K,
                     T.Q5_K, T.Q6_K, T.IQ2_XXS]
    for t in dequant_types:
        bs, _ = GGML_QUANT_SIZES[t]
        n = 4096 if bs == 256 else 2048
        blocks = random_blocks(rng, t, n // bs)
        deq = quants.dequantize(blocks.reshape(1, -1), t).astype(np.float32).reshape(-1)
        assert deq.size == n and np.all(np.isfinite(deq)), t.name
        write_ref(f"deq_{t.name.lower()}.bin", 0, t, n, blocks, deq)
    # bf16 / f16: random bit patterns that are finite.
    for t, view in [(T.BF16, np.uint16), (T.F16, np.uint16)]:
        bits = rng.integers(0, 65536, size=1024, dtype=np.uint32).astype(np.uint16)
        if t == T.BF16:
            bits = bits[(bits & 0x7F80) != 0x7F80][:512]
            deq = quants.dequantize(bits.view(np.uint8), t).astype(np.float32)
        else:
            bits = bits[(bits & 0x7C00) != 0x7C00][:512]
            deq = bits.view(np.float16).astype(np.float32)
        write_ref(f"deq_{t.name.lower()}.bin", 0, t, bits.size, bits, deq)

    quant_types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.BF16, T.F16]
    for t in quant_types + [T.Q8_1, T.Q8_K]:
        n = 2048
        x = rng.standard_normal(n).astype(np.float32) * rng.uniform(0.01, 3.0, size=n // 256).repeat(256).astype(np.float32)
        x[:256] = 0.0                 # an all-zero block: d must be 0, not NaN
        x[300] = 40.0                 # an outlier block
        x[512:544] = np.float32(0.5) * np.arange(-16, 16, dtype=np.float32)  # exact grid: rounding ties
        if t == T.Q8_1:
            q = quantize_q8_1(x)
        elif t == T.Q8_K:
            q = quantize_q8_k(x)
        elif t == T.F16:
            q = x.astype(np.float16).view(np.uint8)
        else:
            q = quants.quantize(x.reshape(1, -1), t)
        write_ref(f"quant_{t.name.lower()}.bin", 1, t, n, x, np.ascontiguousarray(q).view(np.uint8))
    total = sum(os.path.getsize(os.path.join(DATA, f)) for f in os.listdir(DATA))
    print(f"wrote {len(os.listdir(DATA))} files, {total} bytes to {DATA}")


def gen_iq2_cover():
    """IQ2_XXS blocks that use every grid index, every 7-bit sign code and every 4-bit scale (kind 0 file):
    8 blocks x 32 indices = the 256 grid indices once each (shuffled), sign codes 0..127 twice, scales
    0..15 four times, random f16 d of both signs."""
    rng = np.random.default_rng(20261206)
    n_blocks = 8
    idx = rng.permutation(256)
    codes = np.concatenate([rng.permutation(128), rng.permutation(128)])
    scales = rng.permutation(np.tile(np.arange(16), 4))
    blocks = np.zeros((n_blocks, 66), dtype=np.uint8)
    for b in range(n_blocks):
        d = rng.uniform(1e-3, 0.1) * rng.choice([-1.0, 1.0])
        blocks[b, 0:2] = np.array([d], dtype=np.float16).view(np.uint8)
        for g in range(8):
            k = 8 * b + g  # group number
            grid = np.array(idx[4 * k:4 * k + 4], dtype=np.uint32)
            sg = np.uint32(0)
            for j in range(4):
                sg |= np.uint32(codes[4 * k + j]) << np.uint32(7 * j)
            sg |= np.uint32(scales[k]) << np.uint32(28)
            blocks[b, 2 + 8 * g:6 + 8 * g] = grid.astype(np.uint8)
            blocks[b, 6 + 8 * g:10 + 8 * g] = np.array([sg], dtype=np.uint32).view(np.uint8)
    n = n_blocks * 256
    deq = quants.dequantize(blocks.reshape(1, -1), T.IQ2_XXS).astype(np.float32).reshape(-1)
    assert deq.size == n and np.all(np.isfinite(deq))
    write_ref("deq_iq2_xxs_cover.bin", 0, T.IQ2_XXS, n, blocks, deq)
    print(f"wrote {os.path.join(DATA, 'deq_iq2_xxs_cover.bin')}")


def gen_iq_tables():
    q = quants.IQ2_XXS
    q.init_grid()
    grid = np.asarray(q.grid, dtype=np.float32).reshape(256, 8).astype(np.uint8)
    signs = np.frombuffer(q.ksigns, dtype=np.uint8)
    assert signs.size == 128
    lines = [
        "// GENERATED by scripts/gen_quant_ref.py iq-tables from the gguf PyPI package (gguf/quants.py,",
        "// IQ2_XXS.grid_hex and IQ2_XXS.ksigns). These are format constants of the GGUF IQ2_XXS type:",
        "// do not edit by hand, re-run the script.",
        '#include "backend/cpu/iq_tables.h"',
        "",
        "namespace fathom::cpu {",
        "",
        "// 256 grid points of 8 magnitudes each, values in {8, 25, 43}.",
        "alignas(64) const uint8_t iq2xxs_grid[256][8] = {",
    ]
    for i in range(0, 256, 4):
        row = " ".join("{" + ", ".join(str(int(v)) for v in grid[j]) + "}," for j in range(i, i + 4))
        lines.append("    " + row)
    lines += ["};", "", "// 7-bit sign code -> 8 sign bits (bit 7 makes the number of minus signs even).",
              "alignas(64) const uint8_t ksigns_iq2xs[128] = {"]
    for i in range(0, 128, 16):
        lines.append("    " + " ".join(f"{int(v)}," for v in signs[i:i + 16]))
    lines += ["};", "", "}  // namespace fathom::cpu", ""]
    path = os.path.join(ROOT, "src", "backend", "cpu", "iq_tables.cpp")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "refs":
        gen_refs()
    elif what == "iq-tables":
        gen_iq_tables()
    elif what == "iq2-cover":
        gen_iq2_cover()
    else:
        sys.exit("usage: gen_quant_ref.py refs|iq-tables|iq2-cover")
