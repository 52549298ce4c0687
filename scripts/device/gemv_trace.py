#!/usr/bin/env python3
"""Per-launch timeline of the q8x GEMVs of one replayed decode step, from bench_cuda_ds4 --gemv-trace
(a FATHOM_Q8X_TRACE build). Lines "launch,block,start,waited,x_ready,end,sm" (ns, globaltimer).
Prints, relative to the step's first GEMV block start (us): each launch's blocks, first block start,
median PDL release (waited), median x ready, median and last block end, the span from the median
x ready to the last end, and the gap from the previous launch's last end to this one's median x ready
(the kernels between them on the critical path, or the release latency when they are adjacent).
Usage: gemv_trace.py trace.csv [--summary]"""
import sys
from collections import defaultdict


def main():
    rows = defaultdict(list)
    with open(sys.argv[1]) as f:
        for line in f:
            l, b, st, wt, xr, en, sm = (int(v) for v in line.split(","))
            rows[l].append((st, wt, xr, en, sm))
    t0 = min(r[0] for v in rows.values() for r in v)
    us = lambda ns: (ns - t0) / 1e3
    def med(v):
        v = sorted(v)
        return v[len(v) // 2]
    prev_end = None
    span_sum = gap_sum = 0.0
    print("%4s %6s %8s %8s %8s %8s %8s %7s %7s" % ("#", "blocks", "start0", "wait50", "xrdy50", "end50", "endmax", "span", "gap"))
    for l in sorted(rows):
        v = rows[l]
        st0 = us(min(r[0] for r in v))
        w50 = us(med([r[1] for r in v]))
        x50 = us(med([r[2] for r in v]))
        e50 = us(med([r[3] for r in v]))
        emax = us(max(r[3] for r in v))
        span = emax - x50
        gap = x50 - prev_end if prev_end is not None else 0.0
        span_sum += span
        gap_sum += gap
        if "--summary" not in sys.argv:
            print("%4d %6d %8.2f %8.2f %8.2f %8.2f %8.2f %7.2f %7.2f" % (l, len(v), st0, w50, x50, e50, emax, span, gap))
        prev_end = emax
    total = prev_end
    print("launches %d, first start -> last end %.1f us; sum of spans (x ready -> last end) %.1f us, "
          "sum of gaps %.1f us" % (len(rows), total, span_sum, gap_sum))


if __name__ == "__main__":
    main()
