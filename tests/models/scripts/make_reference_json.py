#!/usr/bin/env python3
"""Condense a dense_reference.py logits dump into a small JSON golden file for tests/models.

For every position it keeps the top-8 ids with their logits plus a fixed sample of 24 ids
(same for every position), and the logits' L2 norm, so the test can check selected entries
and the argmax without storing [n_tokens x n_vocab] floats.

usage: make_reference_json.py LOGITS.npy OUT.json MODEL_NAME TOKEN [TOKEN ...]
"""
import json
import sys

import numpy as np


def main():
    logits = np.load(sys.argv[1]).astype(np.float64)
    out, name = sys.argv[2], sys.argv[3]
    toks = [int(t) for t in sys.argv[4:]]
    assert logits.shape[0] == len(toks)
    rng = np.random.default_rng(1234)
    sample = sorted(int(i) for i in rng.choice(logits.shape[1], 24, replace=False))
    positions = []
    for p in range(len(toks)):
        row = logits[p]
        top = [int(i) for i in np.argsort(-row)[:8]]
        ids = top + [i for i in sample if i not in top]
        positions.append({"ids": ids, "logits": [float(row[i]) for i in ids], "norm": float(np.linalg.norm(row))})
    json.dump({"model": name, "generator": "tests/models/scripts/dense_reference.py (gguf-py dequantize, float64 numpy)",
               "tokens": toks, "n_vocab": int(logits.shape[1]), "positions": positions}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
