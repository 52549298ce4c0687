#!/usr/bin/env python3
"""Per-kernel table of one decode step from an ncu csv (ncu_step.sh's step.csv; run here, on the fetched file).

One step: the rows between the first embedding lookup (get_rows_kernel) and the argmax(es) ending the first
step are one replayed step (a multi-row step's rows each end with one).
--diff A B N (dense_step_table.sh): the kernels of profile B minus those of profile A, divided by N: the
kernels of N decode steps that B ran beyond A, whatever the prefill and set-up (they cancel).
Kernels are grouped by name (template arguments and namespaces dropped) with their call count, mean and
summed duration (us), largest sum first.
Usage: python3 scripts/device/step_table.py step.csv
       python3 scripts/device/step_table.py --diff a.csv b.csv N
"""
import collections
import csv
import re
import sys


def load(path):
    """[(kernel name, duration us)] in launch order."""
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    ix = {h: j for j, h in enumerate(rows[0])}
    out = []
    for r in rows[2:]:  # rows[1]: units
        if len(r) != len(rows[0]):
            continue
        n = r[ix["Kernel Name"]].replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
        n = re.sub(r"<.*", "", re.sub(r"\(.*", "", n)).replace("void ", "").split("::")[-1]
        out.append((n, float(r[ix["gpu__time_duration.sum"]].replace(",", "")) / 1000.0))  # ns -> us
    return out


def group(kernels):
    agg = collections.defaultdict(lambda: [0.0, 0.0])
    for n, d in kernels:
        agg[n][0] += 1
        agg[n][1] += d
    return agg


def table(title, agg):
    rows = sorted(((n, c, d) for n, (c, d) in agg.items() if c > 0), key=lambda x: -x[2])
    print(f"{title}: {sum(r[1] for r in rows):.0f} kernels, {sum(r[2] for r in rows):.1f} us in sum")
    print("| kernel | calls | us per call | us in sum |\n| --- | --- | --- | --- |")
    for n, c, d in rows:
        print(f"| {n} | {c:g} | {d / c:.2f} | {d:.1f} |")


def one_step(path):
    k = load(path)
    names = [n for n, _ in k]
    st = names.index("get_rows_kernel") if "get_rows_kernel" in names else 0
    en = names.index("argmax_kernel", st) if "argmax_kernel" in names[st:] else len(names) - 1
    while en + 1 < len(names) and names[en + 1] == "argmax_kernel":  # a multi-row step: one argmax per row
        en += 1
    table("one step", group(k[st:en + 1]))


def diff(path_a, path_b, n):
    a, b = group(load(path_a)), group(load(path_b))
    agg = {k: [(b[k][0] - a[k][0]) / n, (b[k][1] - a[k][1]) / n] for k in set(a) | set(b)}
    table(f"one decode step (difference of the two profiles / {n})", agg)


if __name__ == "__main__":
    if sys.argv[1] == "--diff":
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        one_step(sys.argv[1])
