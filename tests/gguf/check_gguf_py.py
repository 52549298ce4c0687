#!/usr/bin/env python3
"""Cross-check Fathom's GGUF reader against gguf-py (the llama.cpp project's Python reader).

For every shared GGUF (tokenizer vocabularies, ds4-tiny models) and every file written by Fathom's
writer (gguf_samples), compares `fathom-gguf info --json FILE` with gguf.GGUFReader's view of the same
file: version, alignment, data offset, metadata keys in order, value types, scalar values, array lengths
and leading elements, and the tensor table (names, type ids, shapes, absolute data offsets, byte sizes).

Exit codes: 0 all files agree, 1 a mismatch, 77 gguf-py missing (ctest reports a skip; under CI=true a
missing gguf-py is a failure instead).
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import gguf  # type: ignore
    from gguf import GGUFReader, GGUFValueType  # type: ignore
except ImportError:
    print("gguf-py is not installed (pip install gguf)", file=sys.stderr)
    sys.exit(1 if os.environ.get("CI") else 77)

Q8_1 = 9

TYPE_NAMES = {
    GGUFValueType.UINT8: "u8", GGUFValueType.INT8: "i8", GGUFValueType.UINT16: "u16",
    GGUFValueType.INT16: "i16", GGUFValueType.UINT32: "u32", GGUFValueType.INT32: "i32",
    GGUFValueType.FLOAT32: "f32", GGUFValueType.BOOL: "bool", GGUFValueType.STRING: "string",
    GGUFValueType.ARRAY: "array", GGUFValueType.UINT64: "u64", GGUFValueType.INT64: "i64",
    GGUFValueType.FLOAT64: "f64",
}


def same_number(ours, theirs):
    if isinstance(theirs, float):
        if ours is None:  # JSON has no NaN/inf: nlohmann writes null
            return math.isnan(theirs) or math.isinf(theirs)
        return float(ours) == theirs
    return ours == theirs


def field_string(part):
    return bytes(part).decode("utf-8", errors="replace")


def compare_value(key, ours, field, errors):
    types = field.types
    main = TYPE_NAMES[types[0]]
    if ours["type"] != main:
        errors.append(f"{key}: type {ours['type']} vs gguf-py {main}")
        return
    if main == "array":
        # parts[3] / parts[4] are the array header (element type, length), after the key length, key
        # and value type. field.types and field.data are not usable for this: gguf-py flattens
        # nested arrays and omits the element type of an empty array there.
        elem = TYPE_NAMES[GGUFValueType(int(field.parts[3][0]))]
        length = int(field.parts[4][0])
        if ours["elem_type"] != elem:
            errors.append(f"{key}: element type {ours['elem_type']} vs gguf-py {elem}")
            return
        if ours["len"] != length:
            errors.append(f"{key}: length {ours['len']} vs gguf-py {length}")
            return
        if elem == "array":
            return  # nested arrays: Fathom keeps only the outer length
        head = ours["head"]
        if elem == "string":
            theirs = [field_string(field.parts[i]) for i in field.data[:len(head)]]
        else:
            theirs = [field.parts[i].tolist()[0] for i in field.data[:len(head)]]
        for k, (a, b) in enumerate(zip(head, theirs)):
            if elem == "string":
                ok = a == b
            elif elem == "bool":
                ok = bool(a) == bool(b)
            else:
                ok = same_number(a, b)
            if not ok:
                errors.append(f"{key}[{k}]: {a!r} vs gguf-py {b!r}")
                return
        return
    if main == "string":
        theirs = field_string(field.parts[-1])
        ok = ours["value"] == theirs
    elif main == "bool":
        theirs = bool(field.parts[-1].tolist()[0])
        ok = ours["value"] == theirs
    else:
        theirs = field.parts[-1].tolist()[0]
        ok = same_number(ours["value"], theirs)
    if not ok:
        errors.append(f"{key}: value {ours['value']!r} vs gguf-py {theirs!r}")


def check_file(tool, path):
    out = subprocess.run([tool, "info", "--json", path], capture_output=True, text=True)
    if out.returncode != 0:
        return [f"fathom-gguf failed: {out.stderr.strip()}"]
    ours = json.loads(out.stdout)
    reader = GGUFReader(path)
    errors = []

    version = reader.fields["GGUF.version"].parts[-1].tolist()[0]
    if ours["version"] != version:
        errors.append(f"version {ours['version']} vs gguf-py {version}")
    if ours["alignment"] != reader.alignment:
        errors.append(f"alignment {ours['alignment']} vs gguf-py {reader.alignment}")
    if reader.tensors and ours["data_offset"] != reader.data_offset:
        errors.append(f"data offset {ours['data_offset']} vs gguf-py {reader.data_offset}")

    fields = [(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    our_keys = [m["key"] for m in ours["metadata"]]
    if our_keys != [k for k, _ in fields]:
        errors.append(f"keys differ: {our_keys[:5]}... vs gguf-py {[k for k, _ in fields][:5]}...")
        return errors
    for m, (key, field) in zip(ours["metadata"], fields):
        compare_value(key, m, field, errors)

    if len(ours["tensors"]) != len(reader.tensors):
        errors.append(f"tensor count {len(ours['tensors'])} vs gguf-py {len(reader.tensors)}")
        return errors
    for t, r in zip(ours["tensors"], reader.tensors):
        theirs = {
            "name": r.name,
            "type_id": int(r.tensor_type),
            "shape": [int(x) for x in r.shape],  # gguf-py keeps the file's ne order (innermost first)
            "abs_offset": int(r.data_offset),
            "nbytes": int(r.n_bytes),
        }
        mine = {
            "name": t["name"],
            "type_id": t["type_id"],
            "shape": t["shape"],
            "abs_offset": ours["data_offset"] + t["offset"],
            "nbytes": t["nbytes"],
        }
        if t["type_id"] == Q8_1 and theirs["nbytes"] == mine["nbytes"] // 36 * 40:
            # gguf-py's GGML_QUANT_SIZES still lists q8_1 as 40 bytes per block (two f32 scales);
            # ggml's block_q8_1 is 36 bytes (two f16, static_assert in ggml-common.h).
            theirs["nbytes"] = mine["nbytes"]
        if mine != theirs:
            errors.append(f"tensor {t['name']}: {mine} vs gguf-py {theirs}")
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tool", required=True, help="path to fathom-gguf")
    ap.add_argument("--samples", required=True, help="path to gguf_samples (Fathom writer)")
    ap.add_argument("--shared", required=True, help="shared data directory")
    ap.add_argument("--all", action="store_true",
                    help="also check the large vocabularies (gguf-py needs minutes for them)")
    args = ap.parse_args()

    files = sorted(glob.glob(os.path.join(args.shared, "tokenizer-tests", "*.gguf")))
    files += sorted(glob.glob(os.path.join(args.shared, "golden", "ds4-tiny", "*.gguf")))
    if not files:
        print(f"no shared GGUF files under {args.shared}", file=sys.stderr)
        return 1
    # GGUFReader builds a numpy view per array element: a 100k-token vocabulary takes it 10-60 s on
    # the CI machine, so by default only vocabularies under ~1 MiB (llama-spm, phi-3) are compared;
    # the ds4-tiny models have few, small arrays and are always compared. --all checks everything.
    if not args.all:
        big = [f for f in files if "tokenizer-tests" in f and os.path.getsize(f) > (1 << 20)]
        for f in big:
            print(f"skip {os.path.basename(f)} ({os.path.getsize(f)} bytes; use --all)")
        files = [f for f in files if f not in big]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([args.samples, tmp], check=True)
        samples = sorted(glob.glob(os.path.join(tmp, "*.gguf")))
        if len(samples) < 4:
            print(f"gguf_samples wrote {len(samples)} files, expected 4", file=sys.stderr)
            return 1
        passed = failed = 0
        for path in files + samples:
            errors = check_file(args.tool, path)
            name = os.path.basename(path)
            if errors:
                failed += 1
                print(f"FAIL {name}")
                for e in errors[:20]:
                    print(f"  {e}")
            else:
                passed += 1
                print(f"ok   {name}")
    try:
        from importlib.metadata import version
        gguf_version = version("gguf")
    except Exception:  # noqa: BLE001 - only used in the summary line
        gguf_version = "?"
    print(f"gguf-py {gguf_version} cross-check: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
