#!/usr/bin/env python3
"""Fathom vs llama.cpp's own `llama-bench`, same GGUF, same threads, same P/N, same run: prints the ratios.

One command, CPU or CUDA:

  python3 bench/llama_bench.py -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 512 -n 128 -r 3
  python3 bench/llama_bench.py --cuda -m model.gguf -p 512 -n 128

llama.cpp (a test-time reference only; nothing under src/ uses it) is the copy vendored in the
`llama-cpp-python` source distribution, pinned to the version the repo's goldens use (0.3.36). The script
downloads it with `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION` into the cache
directory (--cache-dir, default ~/.cache/fathom-llamacpp), unpacks it and builds only the `llama-bench`
target with CMake (Release, static, CPU by default; --cuda adds -DGGML_CUDA=ON
-DCMAKE_CUDA_ARCHITECTURES=90a, for H100/H200; --cuda-arch changes it). An existing build is reused
(build-VERSION-cpu / build-VERSION-cuda-ARCH under the cache directory); --rebuild forces one. The build
runs under `nice -n 10` with --jobs (default 2; on the 16-core GPU machine pass -j 16: the CUDA build took
about 6 minutes at -j12 there), and takes ~15 min on 2 loaded cores; --build-only builds and exits, so it can
overlap other work.

What is measured, per round (--rounds, default 2; the tools alternate and swap order every round):
  * llama.cpp prefill: `llama-bench -m FILE -p P -n 0 -t T -r R -o json` (pp: a P-token prompt at depth 0);
  * llama.cpp decode:  `llama-bench -m FILE -p 0 -n N -d P -t T -r R -o json` (tg: N tokens after a
    P-token context, which is what `fathom bench` times; plain `-n N` would decode from an empty cache);
  * Fathom: `fathom bench -m FILE -p P -n N -t T --reps R --json`;
  * with --fathom-before BIN, the same command with a second fathom binary (a build of the base commit),
    in the same rounds, so a before/after pair of ratios shares one run's machine load.
  With --cuda, llama-bench gets `-ngl 99` and fathom `--device cuda`. Both tools run one untimed warm-up.
  Each side keeps its defaults otherwise (llama-bench: n_batch 2048 / n_ubatch 512, flash attention auto,
  f16 KV; fathom: prefill chunk 512, 4096 for DeepSeek V4 on CUDA); --llama-bench-args / --fathom-args
  add options to either command.
  Reported: best (max tok/s) and median over all reps of all rounds (llama-bench's samples_ts; Fathom's
  best of bests and median of medians), and Fathom / llama.cpp for each.

DeepSeek V4 files: llama.cpp's architecture `deepseek4` exists in the vendored llama.cpp of
llama-cpp-python 0.3.36 (src/models/deepseek4.cpp). The script reads the file's general.architecture and
checks that the vendored llama.cpp names it (src/llama-arch.cpp); if not (an older --llamacpp-version, or
an architecture llama.cpp lacks), it stops with one line saying so instead of running llama-bench.

--json OUT writes every number, the commands and the llama.cpp version/commit. Any failure (download,
build, run, parse) prints one `llama_bench.py: error: ...` line and exits 1.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tarfile
import time

LLAMACPP_PYTHON_VERSION = "0.3.36"  # the version tests/*/data/*llamacpp.json were recorded with
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


class BenchError(Exception):
    pass


# ---------------------------------------------------------------- output parsing (unit-tested)

def parse_llama_bench_json(text):
    """llama-bench -o json stdout -> list of test dicts (n_prompt, n_gen, n_depth, samples_ts, avg_ts, ...).

    Tolerates log lines before/after the array (some builds print to stdout) and -o jsonl output."""
    text = text.strip()
    if not text:
        raise BenchError("llama-bench printed nothing on stdout")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
        start, end = text.find("["), text.rfind("]")
        if start >= 0 and end > start:
            try:
                data = json.loads(text[start:end + 1])
            except json.JSONDecodeError:
                data = None
        if data is None:  # jsonl: one object per line
            rows = []
            for line in text.splitlines():
                line = line.strip()
                if line.startswith("{") and line.endswith("}"):
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
            data = rows or None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise BenchError("could not parse llama-bench JSON output: " + text[:120].replace("\n", " "))
    for t in data:
        if not isinstance(t, dict) or "n_prompt" not in t or "n_gen" not in t or \
                ("samples_ts" not in t and "avg_ts" not in t):
            raise BenchError("llama-bench JSON entry lacks n_prompt/n_gen/avg_ts: " + json.dumps(t)[:120])
    return data


def llama_bench_rates(tests, kind):
    """tok/s samples of the pp (kind='pp': n_gen == 0) or tg (kind='tg': n_prompt == 0) test."""
    for t in tests:
        if (kind == "pp" and t["n_prompt"] > 0 and t["n_gen"] == 0) or \
                (kind == "tg" and t["n_gen"] > 0 and t["n_prompt"] == 0):
            s = t.get("samples_ts") or [t["avg_ts"]]
            return [float(x) for x in s]
    raise BenchError(f"llama-bench output has no {kind} test")


def llama_bench_build(tests):
    t = tests[0]
    return {k: t.get(k) for k in ("build_commit", "build_number", "cpu_info", "gpu_info", "backends",
                                  "model_type", "n_threads", "n_gpu_layers", "flash_attn", "n_batch",
                                  "n_ubatch", "type_k", "type_v")}


_FATHOM_TEXT = re.compile(r"^(prefill|decode) (\d+) tokens: best ([0-9.]+) tok/s, median ([0-9.]+) tok/s")


def parse_fathom_bench(text):
    """`fathom bench` stdout (--json object, or the two text lines) ->
    {'prefill': {'best', 'median', 'n'}, 'decode': {...} or None, 'raw': dict or None}."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "prefill" in d and "decode" in d:
                out = {"raw": d}
                for k in ("prefill", "decode"):
                    v = d[k]
                    n = v.get("n_tokens", v.get("n_tokens_per_session"))
                    out[k] = None if not n else {"best": float(v["best_tok_s"]),
                                                 "median": float(v["median_tok_s"]), "n": int(n)}
                if out["prefill"] is None:
                    raise BenchError("fathom bench JSON has no prefill rate")
                return out
    out = {"prefill": None, "decode": None, "raw": None}
    for line in text.splitlines():
        m = _FATHOM_TEXT.match(line.strip())
        if m:
            out[m.group(1)] = {"best": float(m.group(3)), "median": float(m.group(4)), "n": int(m.group(2))}
    if out["prefill"] is None:
        raise BenchError("could not parse fathom bench output: " + text.strip()[:120].replace("\n", " "))
    return out


# ---------------------------------------------------------------- GGUF architecture

def gguf_architecture(path):
    """general.architecture of a GGUF file (reads only the metadata it needs)."""
    def rd(f, n):
        b = f.read(n)
        if len(b) != n:
            raise BenchError(f"{path}: truncated GGUF header")
        return b
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        if rd(f, 4) != b"GGUF":
            raise BenchError(f"{path}: not a GGUF file")
        version = struct.unpack("<I", rd(f, 4))[0]
        if version < 2:
            raise BenchError(f"{path}: GGUF v{version} is not supported")
        _n_tensors, n_kv = struct.unpack("<QQ", rd(f, 16))

        def rstr():
            return rd(f, struct.unpack("<Q", rd(f, 8))[0]).decode("utf-8", "replace")

        def skip(t):
            if t in sizes:
                rd(f, sizes[t])
            elif t == 8:
                rstr()
            elif t == 9:
                et, n = struct.unpack("<IQ", rd(f, 12))
                if et in sizes:
                    f.seek(sizes[et] * n, 1)
                else:
                    for _ in range(n):
                        skip(et)
            else:
                raise BenchError(f"{path}: unknown GGUF value type {t}")
        for _ in range(n_kv):
            key = rstr()
            t = struct.unpack("<I", rd(f, 4))[0]
            if key == "general.architecture" and t == 8:
                return rstr()
            skip(t)
    raise BenchError(f"{path}: no general.architecture")


def llamacpp_knows_arch(src_dir, arch):
    p = os.path.join(src_dir, "src", "llama-arch.cpp")
    try:
        with open(p, encoding="utf-8", errors="replace") as f:
            return f'"{arch}"' in f.read()
    except OSError:
        return True  # layout changed: let llama-bench itself decide


# ---------------------------------------------------------------- llama.cpp download + build

def run_logged(cmd, log, cwd=None, env=None):
    with open(log, "a") as lf:
        lf.write("$ " + shlex.join(cmd) + "\n")
        lf.flush()
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=lf, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise BenchError(f"`{shlex.join(cmd)}` failed (exit {r.returncode}); see {log}")


def llamacpp_source(cache, version, log):
    src = os.path.join(cache, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return src
    os.makedirs(cache, exist_ok=True)
    sdist = os.path.join(cache, f"llama_cpp_python-{version}.tar.gz")
    if not os.path.isfile(sdist):
        run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    "-d", cache, f"llama-cpp-python=={version}"], log)
    if not os.path.isfile(sdist):
        raise BenchError(f"pip download did not produce {sdist}")
    with tarfile.open(sdist) as tf:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(cache, **kw)
    if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        raise BenchError(f"{sdist} has no vendor/llama.cpp")
    return src


def llamacpp_commit(cache, version):
    """llama.cpp commit from llama-cpp-python's CHANGELOG entry for this version (the sdist has no .git)."""
    p = os.path.join(cache, f"llama_cpp_python-{version}", "CHANGELOG.md")
    try:
        text = open(p, encoding="utf-8").read()
    except OSError:
        return None
    m = re.search(r"^## \[" + re.escape(version) + r"\]\s*$(.*?)^## ", text, re.M | re.S)
    if m:
        c = re.search(r"llama\.cpp@([0-9a-f]{7,40})", m.group(1))
        if c:
            return c.group(1)
    return None


def cmake_args(cuda, cuda_arch):
    a = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
         "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON"]
    if shutil.which("ninja"):
        a = ["-G", "Ninja"] + a
    if shutil.which("ccache"):
        a += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    if cuda:
        a += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
        if not shutil.which("nvcc") and not os.environ.get("CUDACXX"):
            for nvcc in ("/usr/local/cuda/bin/nvcc", "/usr/cuda/bin/nvcc"):
                if os.path.isfile(nvcc):
                    a.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
                    break
            else:
                raise BenchError("--cuda: no nvcc on PATH or in /usr/local/cuda/bin (set CUDACXX)")
    return a


def ensure_llama_bench(args, log):
    src = llamacpp_source(args.cache_dir, args.llamacpp_version, log)
    tag = f"cuda-{args.cuda_arch}" if args.cuda else "cpu"
    bdir = os.path.join(args.cache_dir, f"build-{args.llamacpp_version}-{tag}")
    exe = os.path.join(bdir, "bin", "llama-bench")
    if os.path.isfile(exe) and os.access(exe, os.X_OK) and not args.rebuild:
        return src, exe
    print(f"building llama-bench ({tag}) in {bdir} (log: {log}) ...", file=sys.stderr, flush=True)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    if not os.path.isfile(os.path.join(bdir, "CMakeCache.txt")) or args.rebuild:
        run_logged(nice + ["cmake", "-S", src, "-B", bdir] + cmake_args(args.cuda, args.cuda_arch), log)
    run_logged(nice + ["cmake", "--build", bdir, "--target", "llama-bench", "-j", str(args.jobs)], log)
    if not os.path.isfile(exe):
        raise BenchError(f"the build finished but {exe} is missing; see {log}")
    return src, exe


# ---------------------------------------------------------------- measurement

def run_tool(cmd, what):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise BenchError(f"{what}: cannot run {cmd[0]}: {e}")
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [""])[-1]
        raise BenchError(f"{what} failed (exit {r.returncode}): {tail}")
    return r.stdout


def summary(xs):
    return {"best": max(xs), "median": statistics.median(xs), "samples": xs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL, help="GGUF file (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="CPU threads for both (default 2)")
    ap.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens P (default 512)")
    ap.add_argument("-n", "--gen", type=int, default=128, help="decoded tokens N (default 128)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions per tool invocation (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both tools (default 2)")
    ap.add_argument("--cuda", action="store_true", help="CUDA build of llama-bench (-ngl 99), fathom --device cuda")
    ap.add_argument("--cuda-arch", default="90a", help="CMAKE_CUDA_ARCHITECTURES for --cuda (default 90a: H100/H200)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fathom-llamacpp"),
                    help="sdist, sources and llama-bench builds (default: %(default)s)")
    ap.add_argument("--llamacpp-version", default=LLAMACPP_PYTHON_VERSION,
                    help="llama-cpp-python sdist version (default %(default)s, as the goldens)")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="build parallelism for llama-bench (default 2)")
    ap.add_argument("--rebuild", action="store_true", help="reconfigure and rebuild llama-bench")
    ap.add_argument("--build-only", action="store_true", help="only download/build llama-bench, then exit")
    ap.add_argument("--fathom", default=os.path.join(REPO, "build", "fathom"), help="fathom binary")
    ap.add_argument("--fathom-before", metavar="BIN",
                    help="a second fathom binary (say, a build of the base commit) measured in the same rounds: "
                         "its row and its ratios are printed too, so before/after share one run's load")
    ap.add_argument("--llama-bench-args", default="", metavar="ARGS",
                    help="extra llama-bench arguments, one string: --llama-bench-args='--poll 0'")
    ap.add_argument("--fathom-args", default="", metavar="ARGS",
                    help="extra fathom bench arguments, one string: --fathom-args='--numerics llamacpp'")
    ap.add_argument("--json", metavar="OUT", help="write the numbers, commands and versions to OUT")
    args = ap.parse_args(argv)

    log = os.path.join(args.cache_dir, "build.log")
    os.makedirs(args.cache_dir, exist_ok=True)
    if args.build_only:
        print(ensure_llama_bench(args, log)[1])
        return 0
    # Cheap checks first, so a typo does not wait for a build.
    if args.prompt < 1 or args.gen < 1 or args.reps < 1 or args.rounds < 1:
        raise BenchError("-p, -n, -r and --rounds must be >= 1")
    if not os.path.isfile(args.model):
        raise BenchError(f"{args.model}: no such file")
    if not (os.path.isfile(args.fathom) and os.access(args.fathom, os.X_OK)):
        raise BenchError(f"{args.fathom}: no fathom binary (build it: cmake --build build --target fathom)")
    if args.fathom_before and not (os.path.isfile(args.fathom_before) and os.access(args.fathom_before, os.X_OK)):
        raise BenchError(f"{args.fathom_before}: no such fathom binary (--fathom-before)")
    arch = gguf_architecture(args.model)
    src = llamacpp_source(args.cache_dir, args.llamacpp_version, log)
    if not llamacpp_knows_arch(src, arch):
        raise BenchError(f"llama.cpp of llama-cpp-python {args.llamacpp_version} does not support the "
                         f"'{arch}' architecture of {args.model} (not in src/llama-arch.cpp); "
                         f"pick a newer --llamacpp-version")
    src, lb = ensure_llama_bench(args, log)
    commit = llamacpp_commit(args.cache_dir, args.llamacpp_version)

    T, P, N, R = str(args.threads), str(args.prompt), str(args.gen), str(args.reps)
    gpu = (["-ngl", "99"] if args.cuda else []) + shlex.split(args.llama_bench_args)
    lb_pp = [lb, "-m", args.model, "-p", P, "-n", "0", "-t", T, "-r", R, "-o", "json"] + gpu
    lb_tg = [lb, "-m", args.model, "-p", "0", "-n", N, "-d", P, "-t", T, "-r", R, "-o", "json"] + gpu
    fb = [args.fathom, "bench", "-m", args.model, "-p", P, "-n", N, "-t", T, "--reps", R, "--json"]
    if args.cuda:
        fb += ["--device", "cuda"]
    fb += shlex.split(args.fathom_args)
    fb0 = [args.fathom_before] + fb[1:] if args.fathom_before else None

    l_pp, l_tg, f_pp_best, f_pp_med, f_tg_best, f_tg_med = [], [], [], [], [], []
    b_pp_best, b_pp_med, b_tg_best, b_tg_med = [], [], [], []
    lb_info, f_raw = None, None

    def llama_round():
        nonlocal lb_info
        tests = parse_llama_bench_json(run_tool(lb_pp, "llama-bench (prefill)"))
        l_pp.extend(llama_bench_rates(tests, "pp"))
        lb_info = llama_bench_build(tests)
        tests = parse_llama_bench_json(run_tool(lb_tg, "llama-bench (decode)"))
        l_tg.extend(llama_bench_rates(tests, "tg"))

    def fathom_round():
        nonlocal f_raw
        r = parse_fathom_bench(run_tool(fb, "fathom bench"))
        if r["decode"] is None:
            raise BenchError("fathom bench reported no decode rate")
        f_pp_best.append(r["prefill"]["best"]); f_pp_med.append(r["prefill"]["median"])
        f_tg_best.append(r["decode"]["best"]); f_tg_med.append(r["decode"]["median"])
        f_raw = r["raw"]

    def before_round():
        r = parse_fathom_bench(run_tool(fb0, "fathom bench (--fathom-before)"))
        if r["decode"] is None:
            raise BenchError("fathom bench (--fathom-before) reported no decode rate")
        b_pp_best.append(r["prefill"]["best"]); b_pp_med.append(r["prefill"]["median"])
        b_tg_best.append(r["decode"]["best"]); b_tg_med.append(r["decode"]["median"])

    t0 = time.time()
    tools = [llama_round, fathom_round] + ([before_round] if fb0 else [])
    for i in range(args.rounds):
        print(f"round {i + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
        k = i % len(tools)  # rotate the order every round
        for fn in tools[k:] + tools[:k]:
            fn()
    elapsed = time.time() - t0

    lpp, ltg = summary(l_pp), summary(l_tg)
    fpp = {"best": max(f_pp_best), "median": statistics.median(f_pp_med), "samples": f_pp_best}
    ftg = {"best": max(f_tg_best), "median": statistics.median(f_tg_med), "samples": f_tg_best}
    device = "cuda" if args.cuda else "cpu"
    if f_raw and f_raw.get("device"):
        device = f_raw["device"]
    res = {
        "model": os.path.basename(args.model), "arch": arch, "device": device, "threads": args.threads,
        "n_prompt": args.prompt, "n_gen": args.gen, "reps": args.reps, "rounds": args.rounds,
        "llama_cpp_python": args.llamacpp_version, "llama_cpp_commit": commit, "llama_bench": lb_info,
        "llamacpp": {"prefill": lpp, "decode": ltg}, "fathom": {"prefill": fpp, "decode": ftg},
        "ratio": {"prefill_best": fpp["best"] / lpp["best"], "decode_best": ftg["best"] / ltg["best"],
                  "prefill_median": fpp["median"] / lpp["median"],
                  "decode_median": ftg["median"] / ltg["median"]},
        "commands": {"llama_bench_prefill": shlex.join(lb_pp), "llama_bench_decode": shlex.join(lb_tg),
                     "fathom": shlex.join(fb)},
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "elapsed_s": elapsed,
    }
    if fb0:
        bpp = {"best": max(b_pp_best), "median": statistics.median(b_pp_med), "samples": b_pp_best}
        btg = {"best": max(b_tg_best), "median": statistics.median(b_tg_med), "samples": b_tg_best}
        res["fathom_before"] = {"prefill": bpp, "decode": btg}
        res["ratio_before"] = {"prefill_best": bpp["best"] / lpp["best"], "decode_best": btg["best"] / ltg["best"],
                               "prefill_median": bpp["median"] / lpp["median"],
                               "decode_median": btg["median"] / ltg["median"]}
        res["commands"]["fathom_before"] = shlex.join(fb0)
    rt = res["ratio"]
    print(f"model {res['model']} ({arch}), device {device}, threads {args.threads}, P={args.prompt}, "
          f"N={args.gen} (decode after the P-token prompt), {args.reps} reps x {args.rounds} rounds")
    if not commit and lb_info:
        commit = lb_info.get("build_commit")
        res["llama_cpp_commit"] = commit
    print(f"llama.cpp: llama-cpp-python {args.llamacpp_version} vendored, commit {commit or 'unknown'}"
          + (f"; llama-bench backends {lb_info.get('backends')}, flash_attn {lb_info.get('flash_attn')}, "
             f"n_batch {lb_info.get('n_batch')}, n_ubatch {lb_info.get('n_ubatch')}, "
             f"KV {lb_info.get('type_k')}/{lb_info.get('type_v')}" if lb_info else ""))
    if f_raw:
        print(f"Fathom: numerics {f_raw.get('numerics')}, KV {f_raw.get('kv_type')}")
    print()
    print("| model | device | P | N | llama.cpp pp | llama.cpp tg | Fathom pp | Fathom tg | pp ratio | tg ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {res['model']} | {device} | {args.prompt} | {args.gen} | {lpp['best']:.1f} | {ltg['best']:.1f} | "
          f"{fpp['best']:.1f} | {ftg['best']:.1f} | **{rt['prefill_best']:.2f}x** | **{rt['decode_best']:.2f}x** |")
    print(f"| (median) | | | | {lpp['median']:.1f} | {ltg['median']:.1f} | {fpp['median']:.1f} | "
          f"{ftg['median']:.1f} | {rt['prefill_median']:.2f}x | {rt['decode_median']:.2f}x |")
    if fb0:
        rb, bpp, btg = res["ratio_before"], res["fathom_before"]["prefill"], res["fathom_before"]["decode"]
        print(f"| before: {os.path.basename(args.fathom_before)} | | | | {lpp['best']:.1f} | {ltg['best']:.1f} | "
              f"{bpp['best']:.1f} | {btg['best']:.1f} | {rb['prefill_best']:.2f}x | {rb['decode_best']:.2f}x |")
        print(f"| (before, median) | | | | {lpp['median']:.1f} | {ltg['median']:.1f} | {bpp['median']:.1f} | "
              f"{btg['median']:.1f} | {rb['prefill_median']:.2f}x | {rb['decode_median']:.2f}x |")
    print()
    print("tok/s, best (max) and median over all reps; ratio = Fathom / llama.cpp. Commands:")
    for c in res["commands"].values():
        print("  " + c)
    if res["load_average"]:
        print("load average at the end: " + " ".join(f"{x:.2f}" for x in res["load_average"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"llama_bench.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("llama_bench.py: error: interrupted", file=sys.stderr)
        sys.exit(130)
