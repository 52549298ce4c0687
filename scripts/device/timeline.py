#!/usr/bin/env python3
"""Wall-time view of one step from an Nsight Systems GPU trace (`nsys stats --report cuda_gpu_trace --format
csv`, graph nodes traced: scripts/device/mma_ab.sh NSYS=1).

Per-kernel sums (ncu, step_table.py) overstate what a step with parallel lanes costs: kernels on different
streams overlap. Here the step's span is cut at every kernel start and end; each piece of time is shared
equally by the kernels running in it (attributed time: the kernels' shares add up to the busy time), and the
pieces with no kernel running are the gaps (launch latency, dependency waits, host work). Printed: span,
busy, gaps, the mean number of kernels in flight while busy, then the kernels by attributed time (calls, sum
of their own durations, attributed share), then the streams.

Usage: timeline.py TRACE.csv [top=24]
"""
import csv
import sys
from collections import defaultdict


def col(header, *keys):
    for i, h in enumerate(header):
        if any(k.lower() in h.lower() for k in keys):
            return i
    raise SystemExit(f"no column among {keys} in {header}")


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    hi = next(i for i, r in enumerate(rows) if any("Start" in c for c in r))
    header, body = rows[hi], rows[hi + 1:]
    c_start, c_dur = col(header, "Start"), col(header, "Duration")
    c_name, c_strm = col(header, "Name"), col(header, "Strm", "Stream")
    c_grid = col(header, "GrdX", "Grid")
    ev = []  # (start, end, name, stream) of kernels only
    for r in body:
        if len(r) <= max(c_start, c_dur, c_name, c_strm, c_grid) or not r[c_grid].strip():
            continue  # memcpy / memset rows have no grid
        s, d = float(r[c_start]), float(r[c_dur])
        name = r[c_name]
        bare = name.replace("(anonymous namespace)::", "").replace("void ", "", 1)
        short = bare.split("(")[0].split("<")[0].strip().split("::")[-1] or name[:60]
        ev.append((s, s + d, short, r[c_strm]))
    if not ev:
        raise SystemExit("no kernels in the trace")
    t0, t1 = min(e[0] for e in ev), max(e[1] for e in ev)
    cuts = sorted({e[0] for e in ev} | {e[1] for e in ev})
    order = sorted(range(len(ev)), key=lambda i: ev[i][0])
    attributed, calls, own = defaultdict(float), defaultdict(int), defaultdict(float)
    for s, e, n, _ in ev:
        calls[n] += 1
        own[n] += e - s
    busy = gaps = inflight = 0.0
    active, nxt = set(), 0
    ends = sorted(range(len(ev)), key=lambda i: ev[i][1])
    ne = 0
    for a, b in zip(cuts, cuts[1:]):
        while nxt < len(order) and ev[order[nxt]][0] <= a:
            active.add(order[nxt])
            nxt += 1
        while ne < len(ends) and ev[ends[ne]][1] <= a:
            active.discard(ends[ne])
            ne += 1
        piece = b - a
        if not active:
            gaps += piece
            continue
        busy += piece
        inflight += piece * len(active)
        for i in active:
            attributed[ev[i][2]] += piece / len(active)
    span = t1 - t0
    print(f"{len(ev)} kernels; span {span / 1e3:.1f} us, busy {busy / 1e3:.1f} us ({100 * busy / span:.1f} %), "
          f"gaps {gaps / 1e3:.1f} us, {inflight / busy:.2f} kernels in flight while busy")
    print(f"{'kernel':44s} {'calls':>5s} {'own us':>9s} {'wall us':>9s} {'wall %':>7s}")
    for n in sorted(attributed, key=attributed.get, reverse=True)[:top]:
        print(f"{n[:44]:44s} {calls[n]:5d} {own[n] / 1e3:9.1f} {attributed[n] / 1e3:9.1f} {100 * attributed[n] / span:7.1f}")
    per_stream = defaultdict(lambda: [0, 0.0])
    for s, e, _, st in ev:
        per_stream[st][0] += 1
        per_stream[st][1] += e - s
    print("streams: " + ", ".join(f"{st}: {n} kernels {d / 1e3:.0f} us" for st, (n, d) in
                                  sorted(per_stream.items(), key=lambda kv: -kv[1][1])))


if __name__ == "__main__":
    main()
