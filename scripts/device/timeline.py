#!/usr/bin/env python3
"""Per-step critical-stream profile of replayed decode steps from nsys_step.sh's CSV (here, on the
fetched file): for the last steps of the run (a step ends with the argmax kernel), the main stream's
busy time, its idle gaps (a kernel starting after the previous one on the stream ended) and overlaps
(PDL: starting before it ended), and per kernel name the calls, mean duration and mean idle gap
before it. Usage: timeline.py trace_cuda_gpu_trace.csv [steps]"""
import csv, re, sys
from collections import defaultdict

rows = list(csv.DictReader(open(sys.argv[1])))
want = int(sys.argv[2]) if len(sys.argv) > 2 else 4
def col(r, *names):
    for n in names:
        for k in r:
            if k.startswith(n):
                return r[k]
    raise KeyError(names)
ks = []
for r in rows:
    name = col(r, 'Name')
    if not name or name.startswith('[CUDA'):
        continue
    ks.append((int(col(r, 'Start')), int(col(r, 'Duration')), col(r, 'Strm'), name))
ks.sort()
ends = [i for i, k in enumerate(ks) if 'argmax' in k[3]]
if len(ends) < want + 1:
    sys.exit('not enough steps (argmax kernels): %d' % len(ends))
def short(n):
    n = re.sub(r'\(.*', '', n)
    n = re.sub(r'<.*', '', n)
    return n.split('::')[-1][:40]
tot = defaultdict(lambda: [0, 0.0, 0.0])  # calls, duration, idle gap before
walls, busy, idle, over = [], [], [], []
for si in range(len(ends) - want, len(ends)):
    a, b = ends[si - 1] + 1, ends[si] + 1
    step = ks[a:b]
    count = defaultdict(int)
    for k in step:
        count[k[2]] += 1
    main = max(count, key=count.get)
    w0 = min(k[0] for k in step); w1 = max(k[0] + k[1] for k in step)
    walls.append((w1 - w0) / 1e3)
    prev_end = None; b_ = i_ = o_ = 0.0
    for k in step:
        if k[2] != main:
            continue
        g = 0.0 if prev_end is None else (k[0] - prev_end) / 1e3
        t = tot[short(k[3])]
        t[0] += 1; t[1] += k[1] / 1e3; t[2] += max(g, 0.0)
        b_ += k[1] / 1e3
        if g > 0: i_ += g
        else: o_ += -g
        prev_end = max(prev_end or 0, k[0] + k[1])
    busy.append(b_); idle.append(i_); over.append(o_)
n = want
print('steps %d: wall %.1f us per step; main stream: kernels %.1f us, idle gaps %.1f us, overlaps %.1f us'
      % (n, sum(walls) / n, sum(busy) / n, sum(idle) / n, sum(over) / n))
print('%-42s %7s %9s %9s %10s' % ('kernel (main stream)', 'calls', 'us/call', 'us/step', 'idle/step'))
for name, (c, d, g) in sorted(tot.items(), key=lambda x: -x[1][1] - x[1][2]):
    print('%-42s %7.1f %9.2f %9.1f %10.1f' % (name, c / n, d / c, d / n, g / n))
