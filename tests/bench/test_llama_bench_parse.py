#!/usr/bin/env python3
"""Parsing in bench/llama_bench.py, on recorded outputs (no llama.cpp download or build: CI runs this).

Samples in tests/bench/data/: llama-bench -o json from llama-cpp-python 0.3.36's vendored llama.cpp (a
prefill run `-p P -n 0` and a decode run `-p 0 -n N -d P`), and `fathom bench` in both its formats."""
import importlib.util
import os
import struct
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
spec = importlib.util.spec_from_file_location(
    "llama_bench", os.path.join(HERE, "..", "..", "bench", "llama_bench.py"))
lb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lb)


def read(name):
    with open(os.path.join(DATA, name)) as f:
        return f.read()


class LlamaBenchJson(unittest.TestCase):
    def test_prefill(self):
        tests = lb.parse_llama_bench_json(read("llama_bench_pp.json"))
        s = lb.llama_bench_rates(tests, "pp")
        self.assertEqual(len(s), tests[0]["samples_ns"].__len__())
        self.assertTrue(all(x > 0 for x in s))
        with self.assertRaises(lb.BenchError):
            lb.llama_bench_rates(tests, "tg")
        info = lb.llama_bench_build(tests)
        self.assertIn("CPU", info["backends"])

    def test_decode(self):
        tests = lb.parse_llama_bench_json(read("llama_bench_tg.json"))
        s = lb.llama_bench_rates(tests, "tg")
        self.assertTrue(all(x > 0 for x in s))
        self.assertGreater(tests[0]["n_depth"], 0)

    def test_noise_around_the_array_and_jsonl(self):
        text = read("llama_bench_pp.json")
        noisy = "load_backend: loaded CPU backend\n" + text + "\nllama_perf: done\n"
        self.assertEqual(lb.parse_llama_bench_json(noisy), lb.parse_llama_bench_json(text))
        import json
        rows = lb.parse_llama_bench_json(text)
        jsonl = "\n".join(json.dumps(r) for r in rows)
        self.assertEqual(lb.parse_llama_bench_json(jsonl), rows)

    def test_garbage(self):
        for bad in ["", "error: failed to load model", "[]", '[{"foo": 1}]']:
            with self.assertRaises(lb.BenchError):
                lb.parse_llama_bench_json(bad)


class FathomBench(unittest.TestCase):
    def test_json(self):
        r = lb.parse_fathom_bench(read("fathom_bench.json"))
        self.assertEqual(r["prefill"]["n"], 64)
        self.assertEqual(r["decode"]["n"], 16)
        self.assertGreaterEqual(r["prefill"]["best"], r["prefill"]["median"])
        self.assertEqual(r["raw"]["device"], "cpu")

    def test_text(self):
        r = lb.parse_fathom_bench(read("fathom_bench.txt"))
        self.assertEqual(r["prefill"]["n"], 64)
        self.assertEqual(r["decode"]["n"], 16)
        self.assertGreaterEqual(r["decode"]["best"], r["decode"]["median"])
        self.assertIsNone(r["raw"])

    def test_json_after_log_lines_and_skipped_decode(self):
        text = 'note: something\n{"prefill":{"best_tok_s":10.5,"median_tok_s":9.0,"n_tokens":8},' \
               '"decode":{"best_tok_s":0.0,"median_tok_s":0.0,"n_tokens":0},"device":"cpu"}\n'
        r = lb.parse_fathom_bench(text)
        self.assertEqual(r["prefill"]["best"], 10.5)
        self.assertIsNone(r["decode"])

    def test_garbage(self):
        for bad in ["", "error: no such model", "{not json"]:
            with self.assertRaises(lb.BenchError):
                lb.parse_fathom_bench(bad)


def gguf_bytes(kvs):
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for k, t, v in kvs:
        out += s(k) + struct.pack("<I", t)
        if t == 8:
            out += s(v)
        elif t == 4:
            out += struct.pack("<I", v)
        elif t == 9:  # array of strings
            out += struct.pack("<IQ", 8, len(v)) + b"".join(s(x) for x in v)
    return out


class GgufArch(unittest.TestCase):
    def test_arch_after_other_keys(self):
        with tempfile.NamedTemporaryFile(suffix=".gguf", delete=False) as f:
            f.write(gguf_bytes([("general.alignment", 4, 32), ("x.list", 9, ["a", "bc"]),
                                ("general.architecture", 8, "deepseek4")]))
        try:
            self.assertEqual(lb.gguf_architecture(f.name), "deepseek4")
        finally:
            os.unlink(f.name)

    def test_not_gguf(self):
        with tempfile.NamedTemporaryFile(delete=False) as f:
            f.write(b"nope" + b"\0" * 32)
        try:
            with self.assertRaises(lb.BenchError):
                lb.gguf_architecture(f.name)
        finally:
            os.unlink(f.name)

    def test_known_arch_and_commit(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "src"))
            with open(os.path.join(d, "src", "llama-arch.cpp"), "w") as f:
                f.write('{ LLM_ARCH_LLAMA, "llama" },\n{ LLM_ARCH_DEEPSEEK4, "deepseek4" },\n')
            self.assertTrue(lb.llamacpp_knows_arch(d, "deepseek4"))
            self.assertFalse(lb.llamacpp_knows_arch(d, "deepseek5"))
            os.makedirs(os.path.join(d, "llama_cpp_python-9.9.9"))
            with open(os.path.join(d, "llama_cpp_python-9.9.9", "CHANGELOG.md"), "w") as f:
                f.write("# Changelog\n\n## [9.9.9]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
                        "## [9.9.8]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
            self.assertEqual(lb.llamacpp_commit(d, "9.9.9"), "0c1e57098")
            self.assertIsNone(lb.llamacpp_commit(d, "1.0.0"))


if __name__ == "__main__":
    unittest.main()
