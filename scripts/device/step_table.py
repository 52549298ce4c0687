#!/usr/bin/env python3
"""Per-kernel table of one decode step from ncu_step.sh's step.csv (run here, on the fetched file).

The rows between the first embedding lookup (get_rows_kernel) and the argmax(es) ending the first step are one
replayed step (a multi-row step's rows each end with one); kernels are grouped by name (template arguments and namespaces dropped) with their call
count, mean and summed duration (us), largest sum first.
Usage: python3 scripts/device/step_table.py step.csv
"""
import collections
import csv
import re
import sys


def main(path):
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    ix = {h: j for j, h in enumerate(rows[0])}
    names, durs = [], []
    for r in rows[2:]:  # rows[1]: units
        if len(r) != len(rows[0]):
            continue
        n = r[ix["Kernel Name"]].replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
        n = re.sub(r"<.*", "", re.sub(r"\(.*", "", n)).replace("void ", "").split("::")[-1]
        names.append(n)
        durs.append(float(r[ix["gpu__time_duration.sum"]].replace(",", "")) / 1000.0)  # ns -> us
    st = names.index("get_rows_kernel") if "get_rows_kernel" in names else 0
    en = names.index("argmax_kernel", st) if "argmax_kernel" in names[st:] else len(names) - 1
    while en + 1 < len(names) and names[en + 1] == "argmax_kernel":  # a multi-row step: one argmax per row
        en += 1
    agg = collections.defaultdict(lambda: [0, 0.0])
    for n, d in zip(names[st:en + 1], durs[st:en + 1]):
        agg[n][0] += 1
        agg[n][1] += d
    print(f"one step: {en - st + 1} kernels, {sum(durs[st:en + 1]):.1f} us in sum")
    print("| kernel | calls | us per call | us in sum |\n| --- | --- | --- | --- |")
    for n, (c, d) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"| {n} | {c} | {d / c:.1f} | {d:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
