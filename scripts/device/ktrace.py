#!/usr/bin/env python3
"""One decode step's kernel timeline from bench_cuda_ds4 --ktrace (a FATHOM_KTRACE build,
src/backend/cuda/ktrace.h). Input lines "kernel,block,start,end,sm,grid" (ns, %globaltimer; grid: the
launch's %gridid), one per block of every instrumented kernel, in completion order.

Launches: the records of one (kernel, grid) pair (launches of one kernel may run at once on the
step's parallel branches). For each launch: first block start, last block end (us from the
step's first record). Printed: the launches in start order (name, blocks, start, end, span, the gap
since the previous launch's end in start order); per kernel: launches, summed spans, mean span; the
step's length and the time no instrumented kernel ran (idle: launch latency, uninstrumented kernels).
Usage: ktrace.py ktrace.csv [--summary]"""
import sys
from collections import defaultdict


def launches(rows):
    by_launch = {}
    for name, block, start, end, sm, grid in rows:
        l = by_launch.setdefault((name, grid), [name, 0, start, end])
        l[1] += 1
        l[2] = min(l[2], start)
        l[3] = max(l[3], end)
    return sorted(by_launch.values(), key=lambda l: l[2])


def main():
    rows = []
    with open(sys.argv[1]) as f:
        for line in f:
            n, b, s, e, sm, g = line.strip().split(",")
            rows.append((n, int(b), int(s), int(e), int(sm), int(g)))
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
