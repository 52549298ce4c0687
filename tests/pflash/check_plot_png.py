#!/usr/bin/env python3
"""Independent decode of the PNGs that src/pflash/plot.cpp writes (`fathom eval niah --plot`), with only
Python's zlib and struct: signature, every chunk's CRC, IHDR fields, the zlib stream (zlib checks the
Adler-32) and its stored-block boundaries, scanline count and length, filter bytes. Then the content:
test patterns must match their formula pixel for pixel, and in the charts the pixels where a bar must be
(its height computed here from the values and the chart's axis) have the bar colour while the pixels
above it do not. Finally a write into a missing directory must fail with one line, exit != 0 and leave
nothing behind. The files come from tests/pflash/plot_tool.cpp (pflash_plot_tool)."""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import zlib

ACCURACY_BAR = (52, 101, 164)  # the colours of src/pflash/plot.h
TARGET_BAR = (204, 102, 0)
DRAFTER_BAR = (115, 210, 22)

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def stored_blocks(z):
    """Lengths of the stored deflate blocks in zlib stream z (after the 2-byte header)."""
    lens, at, final = [], 2, False
    while not final:
        hdr = z[at]
        final = bool(hdr & 1)
        if (hdr >> 1) & 3 != 0:
            raise ValueError("block type %d, expected stored" % ((hdr >> 1) & 3))
        ln, nln = struct.unpack("<HH", z[at + 1:at + 5])
        if ln ^ 0xFFFF != nln:
            raise ValueError("LEN/NLEN mismatch")
        lens.append(ln)
        at += 5 + ln
    if at + 4 != len(z):
        raise ValueError("trailing bytes after the final block")
    return lens


def decode(path):
    """(width, height, rows of (r, g, b) tuples, stored block lengths) of the RGB8 PNG at path."""
    data = open(path, "rb").read()
    if not check(data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: bad signature"):
        return None
    at, chunks = 8, []
    while at < len(data):
        (ln,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + ln]
        (crc,) = struct.unpack(">I", data[at + 8 + ln:at + 12 + ln])
        check(crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"{path}: bad CRC in {kind!r}")
        chunks.append((kind, body))
        at += 12 + ln
    check(at == len(data), f"{path}: truncated chunk")
    kinds = [k for k, _ in chunks]
    check(kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, f"{path}: chunk order {kinds}")
    w, h, depth, colour, comp, filt, inter = struct.unpack(">IIBBBBB", chunks[0][1])
    check((depth, colour, comp, filt, inter) == (8, 2, 0, 0, 0), f"{path}: IHDR {depth, colour, comp, filt, inter}")
    z = b"".join(b for k, b in chunks if k == b"IDAT")
    check(z[0] & 0x0F == 8 and (z[0] * 256 + z[1]) % 31 == 0, f"{path}: bad zlib header")
    lens = stored_blocks(z)
    check(all(n <= 65535 for n in lens) and all(n == 65535 for n in lens[:-1]), f"{path}: block lengths {lens}")
    raw = zlib.decompress(z)  # verifies the Adler-32 too
    stride = 1 + 3 * w
    if not check(len(raw) == h * stride, f"{path}: {len(raw)} raw bytes, expected {h} x {stride}"):
        return None
    rows = []
    for y in range(h):
        line = raw[y * stride:(y + 1) * stride]
        check(line[0] == 0, f"{path}: row {y} filter {line[0]}")
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(w)])
    return w, h, rows, lens


def check_pattern(tool, tmp, w, h, want_blocks):
    path = os.path.join(tmp, f"pattern_{w}x{h}.png")
    r = subprocess.run([tool, "pattern", path, str(w), str(h)], capture_output=True, text=True)
    if not check(r.returncode == 0, f"pattern {w}x{h}: {r.stderr.strip()}"):
        return
    d = decode(path)
    if d is None:
        return
    dw, dh, rows, lens = d
    check((dw, dh) == (w, h), f"pattern: size {dw}x{dh}, expected {w}x{h}")
    check(lens == want_blocks, f"pattern {w}x{h}: blocks {lens}, expected {want_blocks}")
    bad = [(x, y) for y in range(h) for x in range(w)
           if rows[y][x] != ((7 * x + 3 * y) % 256, (x ^ y) % 256, (x * y) % 251)]
    check(not bad, f"pattern {w}x{h}: {len(bad)} wrong pixels, first {bad[:3]}")


def bar_rows(value, axis_max, plot_h):
    if not math.isfinite(value) or value <= 0:
        return 0
    return int(math.floor(min(value, axis_max) / axis_max * plot_h + 0.5))


def check_bar(name, rows, panel, i, value, lower, colour):
    """Column-wise: rows [base - h, base) are the bar (lower hd rows DRAFTER_BAR), rows above are not."""
    base, top = panel["base_y"], panel["top_y"]
    h = bar_rows(value, panel["axis_max"], base - top)
    hd = min(h, bar_rows(min(lower, value), panel["axis_max"], base - top))
    x0, x1 = panel["bars"][i]
    for x in (x0, (x0 + x1) // 2, x1 - 1):
        # One pixel of slack at each colour edge: the rounding of a value exactly at a half pixel may differ.
        for y in range(base - h + 1, base):
            want = DRAFTER_BAR if y >= base - hd + 1 else colour if y < base - hd - 1 else None
            if want is not None and not check(rows[y][x] == want, f"{name} bar {i}: ({x},{y}) {rows[y][x]} != {want}"):
                return
        for y in range(top - 30, base - h - 1):
            if not check(rows[y][x] not in (colour, DRAFTER_BAR), f"{name} bar {i}: bar colour above the bar at ({x},{y})"):
                return


def check_chart(tool, tmp, title, rows_in, want_axis_ttft):
    path, layout_path = os.path.join(tmp, "chart.png"), os.path.join(tmp, "chart.json")
    args = [tool, "chart", path, layout_path, *title]
    for mode, acc, ttft, drafter in rows_in:
        args += [mode, repr(acc), repr(ttft), repr(drafter)]
    r = subprocess.run(args, capture_output=True, text=True)
    if not check(r.returncode == 0, f"chart: {r.stderr.strip()}"):
        return
    layout = json.load(open(layout_path))
    d = decode(path)
    if d is None:
        return
    w, h, rows, lens = d
    check((w, h) == (layout["width"], layout["height"]), f"chart: size {w}x{h} vs layout")
    check(len(lens) > 1, "chart: expected several stored blocks (> 65535 raw bytes)")
    acc, tt = layout["accuracy"], layout["ttft"]
    check(acc["axis_max"] == 100, "accuracy axis must end at 100 %")
    check(abs(tt["axis_max"] - want_axis_ttft) < 1e-9, f"TTFT axis {tt['axis_max']}, expected {want_axis_ttft}")
    check(acc["right"] < tt["left"] and tt["right"] <= w, "panels overlap or leave the image")
    for i, (mode, a, t, dr) in enumerate(rows_in):
        check_bar("accuracy", rows, acc, i, a, 0.0, ACCURACY_BAR)
        check_bar("ttft", rows, tt, i, t, dr, TARGET_BAR)
    # The chart shows the drafter colour only when some mode has drafter time.
    has_drafter = any(dr > 0 for _, _, _, dr in rows_in)
    seen = any(DRAFTER_BAR in row for row in rows)
    check(seen == has_drafter, f"drafter colour present {seen}, expected {has_drafter}")


def check_bad_path(tool, tmp):
    missing = os.path.join(tmp, "no-such-dir", "out.png")
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
        check_pattern(a.tool, tmp, 3, 2, [20])
        check_pattern(a.tool, tmp, 28, 771, [65535])        # exactly one full stored block
        check_pattern(a.tool, tmp, 28, 772, [65535, 85])    # one byte-row past it
        check_pattern(a.tool, tmp, 301, 97, [65535, 22153])  # 97 x 904 = 87688 raw bytes
        rows = [("full", 93.3, 2.41, 0.0), ("keep 0.1", 60.0, 0.62, 0.31), ("keep 0.2", 86.7, 0.85, 0.33),
                ("keep 0.5", 100.0, 1.52, 0.32)]
        check_chart(a.tool, tmp, ["4096", "5", "3", "mixed"], rows, 2.5)
        check_chart(a.tool, tmp, ["8192", "5", "2", ""], [("full", 40.0, 13.7, 0.0)], 15.0)  # steps of 3
        check_chart(a.tool, tmp, ["1024", "3", "1", "code"],
                    [("keep 0.05", 33.3, 0.004, 0.0031), ("keep 1", 0.0, 0.0071, 0.001)], 0.01)
        check_bad_path(a.tool, tmp)
    for f in failures:
        print("FAIL:", f)
    print("check_plot_png: %s" % ("ok" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
