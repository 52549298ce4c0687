#!/usr/bin/env python3
"""Independent read of the SVG charts that src/pflash/plot.cpp writes (`fathom eval niah --plot`), with
Python's XML parser: the file must be well-formed XML whose root is an SVG element of the layout's size,
with the title (labels XML-escaped: the parser gives back the text as given) and every mode label as
text. The bars are checked against the values: per mode one rect of class "accuracy" and one of class
"target" (plus one of class "drafter" under it when some mode has drafter time), standing on the panel's
base line at the layout's columns, their heights computed here from the values and the axis. Finally a
write into a missing directory must fail with one line, exit != 0 and leave nothing behind. The files
come from tests/pflash/plot_tool.cpp (pflash_plot_tool)."""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
ACCURACY_BAR, TARGET_BAR, DRAFTER_BAR = "#3465a4", "#cc6600", "#73d216"  # the fills of src/pflash/plot.h

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def bar_height(value, axis_max, plot_h):
    if not math.isfinite(value) or value <= 0:
        return 0.0
    return min(value, axis_max) / axis_max * plot_h


def rects(root, cls):
    return [r for r in root.iter(SVG + "rect") if r.get("class") == cls]


def check_rect(name, r, x0, x1, y_top, height, fill):
    got = [float(r.get(k)) for k in ("x", "y", "width", "height")]
    want = [x0, y_top, x1 - x0, height]
    check(all(abs(g - w) <= 0.01 for g, w in zip(got, want)) and r.get("fill") == fill,
          f"{name}: rect {got} fill {r.get('fill')}, expected {want} fill {fill}")


def check_chart(tool, tmp, title, rows_in, want_axis_ttft):
    path, layout_path = os.path.join(tmp, "chart.svg"), os.path.join(tmp, "chart.json")
    args = [tool, "chart", path, layout_path, *title]
    for mode, acc, ttft, drafter in rows_in:
        args += [mode, repr(acc), repr(ttft), repr(drafter)]
    r = subprocess.run(args, capture_output=True, text=True)
    if not check(r.returncode == 0, f"chart: {r.stderr.strip()}"):
        return
    layout = json.load(open(layout_path))
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        check(False, f"chart: not well-formed XML: {e}")
        return
    check(root.tag == SVG + "svg", f"chart: root element {root.tag}")
    w, h = layout["width"], layout["height"]
    check((root.get("width"), root.get("height"), root.get("viewBox")) == (str(w), str(h), f"0 0 {w} {h}"),
          f"chart: size {root.get('width')}x{root.get('height')} viewBox {root.get('viewBox')} vs layout {w}x{h}")
    texts = ["".join(t.itertext()) for t in root.iter(SVG + "text")]
    want_title = f"NIAH: {title[0]} tokens, {title[1]} needles, {title[2]} trials" + \
        (f", {title[3]} filler" if title[3] else "")
    check(want_title in texts, f"chart: title {want_title!r} not among the texts {texts[:3]}")
    for mode, *_ in rows_in:
        check(texts.count(mode) == 2, f"chart: mode label {mode!r} once per panel")
    acc, tt = layout["accuracy"], layout["ttft"]
    check(acc["axis_max"] == 100, "accuracy axis must end at 100 %")
    check(abs(tt["axis_max"] - want_axis_ttft) < 1e-9, f"TTFT axis {tt['axis_max']}, expected {want_axis_ttft}")
    check(acc["right"] < tt["left"] and tt["right"] <= w, "panels overlap or leave the image")
    has_drafter = any(dr > 0 for _, _, _, dr in rows_in)
    bars_acc, bars_target, bars_drafter = rects(root, "accuracy"), rects(root, "target"), rects(root, "drafter")
    n = len(rows_in)
    if not check((len(bars_acc), len(bars_target), len(bars_drafter)) == (n, n, n if has_drafter else 0),
                 f"chart: bar counts {len(bars_acc), len(bars_target), len(bars_drafter)} for {n} modes"):
        return
    for i, (mode, a, t, dr) in enumerate(rows_in):
        plot_h = acc["base_y"] - acc["top_y"]
        ha = bar_height(a, 100.0, plot_h)
        check_rect(f"accuracy {mode}", bars_acc[i], *acc["bars"][i], acc["base_y"] - ha, ha, ACCURACY_BAR)
        ht = bar_height(t, tt["axis_max"], plot_h)
        hd = min(ht, bar_height(min(dr, t), tt["axis_max"], plot_h)) if has_drafter else 0.0
        check_rect(f"ttft {mode}", bars_target[i], *tt["bars"][i], tt["base_y"] - ht, ht - hd, TARGET_BAR)
        if has_drafter:
            check_rect(f"drafter {mode}", bars_drafter[i], *tt["bars"][i], tt["base_y"] - hd, hd, DRAFTER_BAR)


def check_bad_path(tool, tmp):
    missing = os.path.join(tmp, "no-such-dir", "out.svg")
    r = subprocess.run([tool, "chart", missing, os.path.join(tmp, "x.json"), "512", "1", "1", "prose",
                        "full", "50", "1", "0"], capture_output=True, text=True)
    check(r.returncode != 0, "write into a missing directory must fail")
    lines = r.stderr.strip().splitlines()
    check(len(lines) == 1 and lines[0].startswith("error: cannot write " + missing), f"bad-path stderr: {r.stderr!r}")
    check(not os.path.exists(os.path.dirname(missing)), "bad path: something was created")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [("full", 93.3, 2.41, 0.0), ("keep 0.1", 60.0, 0.62, 0.31), ("keep 0.2", 86.7, 0.85, 0.33),
                ("keep 0.5", 100.0, 1.52, 0.32)]
        check_chart(a.tool, tmp, ["4096", "5", "3", "mixed"], rows, 2.5)
        check_chart(a.tool, tmp, ["8192", "5", "2", ""], [("full", 40.0, 13.7, 0.0)], 15.0)  # steps of 3
        check_chart(a.tool, tmp, ["1024", "3", "1", "code"],
                    [("keep 0.05", 33.3, 0.004, 0.0031), ("keep 1", 0.0, 0.0071, 0.001)], 0.01)
        # Markup characters in the labels and the title are escaped (the parser returns them as given);
        # NaN and out-of-range values draw no bar or a full one.
        check_chart(a.tool, tmp, ["512", "1", "1", "<json & \"quotes\">"],
                    [("a<b>&'c'", float("nan"), 0.5, 0.0), ("über", 150.0, float("inf"), 0.0)], 0.5)
        check_bad_path(a.tool, tmp)
    for f in failures:
        print("FAIL:", f)
    print("check_plot_svg: %s" % ("ok" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
