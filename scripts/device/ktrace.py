#!/usr/bin/env python3
"""One decode step's kernel timeline from bench_cuda_ds4 --ktrace (a FATHOM_KTRACE build,
src/backend/cuda/ktrace.h). Input lines "kernel,block,start,end,sm" (ns, %globaltimer), one per block
of every instrumented kernel, in completion order.

Launches: a kernel's records sorted by start; a block index seen again starts a new launch (every
launch numbers its blocks from 0). For each launch: first block start, last block end (us from the
step's first record). Printed: the launches in start order (name, blocks, start, end, span, the gap
since the previous launch's end in start order); per kernel: launches, summed spans, mean span; the
step's length and the time no instrumented kernel ran (idle: launch latency, uninstrumented kernels).
Usage: ktrace.py ktrace.csv [--summary]"""
import sys
from collections import defaultdict


def launches(rows):
    by_kernel = defaultdict(list)
    for name, block, start, end, sm in rows:
        by_kernel[name].append((start, end, block))
    out = []
    for name, recs in by_kernel.items():
        recs.sort()
        seen, cur = set(), None
        for start, end, block in recs:
            if cur is None or block in seen:
                if cur:
                    out.append(cur)
                cur = [name, 0, start, end]
                seen = set()
            seen.add(block)
            cur[1] += 1
            cur[2] = min(cur[2], start)
            cur[3] = max(cur[3], end)
        out.append(cur)
    out.sort(key=lambda l: l[2])
    return out


def main():
    rows = []
    with open(sys.argv[1]) as f:
        for line in f:
            n, b, s, e, sm = line.strip().split(",")
            rows.append((n, int(b), int(s), int(e), int(sm)))
    if not rows:
        print("no records")
        return
    t0 = min(r[2] for r in rows)
    ls = launches(rows)
    us = lambda ns: (ns - t0) / 1e3
    if "--summary" not in sys.argv:
        print("%5s %-16s %6s %9s %9s %8s %8s" % ("#", "kernel", "blocks", "start", "end", "span", "gap"))
        prev_end = None
        for i, (name, nb, s, e) in enumerate(ls):
            gap = (us(s) - prev_end) if prev_end is not None else 0.0
            print("%5d %-16s %6d %9.2f %9.2f %8.2f %8.2f" % (i, name, nb, us(s), us(e), (e - s) / 1e3, gap))
            prev_end = max(prev_end or 0.0, us(e))
    agg = defaultdict(lambda: [0, 0.0])
    for name, nb, s, e in ls:
        agg[name][0] += 1
        agg[name][1] += (e - s) / 1e3
    print("%-16s %8s %10s %8s" % ("kernel", "launches", "sum us", "mean us"))
    for name, (n, tot) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print("%-16s %8d %10.1f %8.2f" % (name, n, tot, tot / n))
    # union of launch intervals: time covered by at least one instrumented kernel
    iv = sorted((s, e) for _, _, s, e in ls)
    covered, cs, ce = 0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > ce:
            covered += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    covered += ce - cs
    total = max(e for _, _, _, e in ls) - t0
    print("step %.1f us: %d launches, instrumented kernels running %.1f us, none running %.1f us" %
          (total / 1e3, len(ls), covered / 1e3, (total - covered) / 1e3))


if __name__ == "__main__":
    main()
