#!/usr/bin/env python3
"""Black-box tests of the `fathom` binary (tests/cli/tests.cmake registers them with ctest).

  cli_test.py --fathom BIN --suite basic   --help text, and bad inputs -> one-line error, non-zero exit
  cli_test.py --fathom BIN --suite vocab   tokenize / detokenize on every vocab-only GGUF of
                                           ../shared/tokenizer-tests against its expected ids
  cli_test.py --fathom BIN --suite tiny    the same smoke tests on a random-weight llama made by
                                           make_tiny_model.py (GPT-2 vocab from ../shared)
  cli_test.py --fathom BIN --suite model --models-dir DIR
                                           tokenize / logits / run / chat / bench smoke on the real
                                           model (exit 77 = skipped when the models are absent)

Independent truths used: the option lists and groups of the CLI specification (docs/cli.md), the
reference token ids of ../shared/tokenizer-tests (Hugging Face tokenizers), the vocabulary stored in the
GGUF read with gguf-py (token ids must spell the input text), and cross-mode consistency of the
engine's logits.
"""
import argparse
import os
import subprocess
import sys
import tempfile

SKIP = 77
failures = []


def check(cond, what):
    if cond:
        print(f"ok   {what}")
    else:
        print(f"FAIL {what}")
        failures.append(what)


def run(fathom, args, stdin=None, timeout=120):
    p = subprocess.run([fathom] + args, input=stdin, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr.decode("utf-8", "replace")


# ------------------------------------------------------------------------------------------- help

# The CLI specification (docs/cli.md): each subcommand's --help shows exactly these options, under these
# headings (CLI11 help groups), besides -h,--help and --help-all under "Options". serve and daemon are
# specified in docs/server.md and docs/daemon-protocol.md.
MODEL_FILE = ["-m,--model", "--models-dir"]
ENGINE = ["-t,--threads", "--ctx", "-b,--batch", "--kv-type", "--exact", "--numerics", "--qat", "--ds4-checkpoint-mib",
          "--progress"]
DEVICES = ["--device", "--devices", "--layout", "--micro-batch", "--procs", "--procs-host", "--procs-local",
           "--no-cuda-graph"]
SAMPLING = ["--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n", "--frequency-penalty",
            "--presence-penalty", "--seed"]
SPEC = ["--spec", "--draft-model", "--draft-max", "--draft-row-cost", "--ngram-min", "--ngram-max"]
ENGINE_GROUPS = {"Model": MODEL_FILE, "Engine": ENGINE, "Devices": DEVICES}
OPTIONS = {
    "run": {**ENGINE_GROUPS, "Prompt": ["-p,--prompt", "-f,--file", "-n,--n-predict", "--system", "--no-chat"],
            "Speculative decoding": SPEC,
            "PFlash": ["--pflash", "--keep-ratio", "--drafter", "--drafter-residency", "--drafter-device",
                       "--drafter-window", "--pflash-verbatim-user"],
            "Sampling": SAMPLING},
    "chat": {**ENGINE_GROUPS, "Chat": ["--system", "-n,--n-predict", "--stats"], "Sampling": SAMPLING,
             "Speculative decoding": SPEC},
    "tokenize": {"Model": MODEL_FILE, "Tokenize": ["--parse-special"]},
    "detokenize": {"Model": MODEL_FILE, "Detokenize": ["--no-special"]},
    "logits": {**ENGINE_GROUPS, "Logits": ["--tokens-file", "--out", "--mode"],
               "DeepSeek V4 drafters": ["--mtp", "--next-token", "--dspark", "--seed-token"]},
    "bench": {**ENGINE_GROUPS, "Bench": ["-p,--n-prompt", "-n,--n-gen", "--no-warmup", "--reps", "--json",
                                         "--depths", "--sessions"]},
}
HELP_OPTIONS = ["-h,--help", "--help-all"]


def help_groups(text):
    """--help text -> {heading: [option names]} (an option line starts with two spaces and a dash)."""
    groups, heading = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":") and not line.startswith("Usage"):
            heading = line[:-1]
            groups.setdefault(heading, [])
        elif heading is not None and line.startswith("  -"):
            groups[heading].append(line.split()[0])
    return groups


def test_help(fathom):
    rc, out, _ = run(fathom, ["--help"])
    text = out.decode()
    check(rc == 0, "fathom --help exits 0")
    for sub in OPTIONS:
        check(sub in text, f"fathom --help lists subcommand {sub}")
    for sub, expected in OPTIONS.items():
        rc, out, _ = run(fathom, [sub, "--help"])
        text = out.decode()
        check(rc == 0, f"fathom {sub} --help exits 0")
        got = help_groups(text)
        want = {"Options": HELP_OPTIONS, **expected}
        check(list(got) == list(want), f"fathom {sub} --help headings {list(got)} == {list(want)}")
        for group, opts in want.items():
            check(sorted(got.get(group, [])) == sorted(opts),
                  f"fathom {sub} --help group {group!r}: exactly {opts} (got {got.get(group)})")
        # Every option line carries a description (no undocumented flags).
        lines = [l for l in text.splitlines() if l.strip().startswith("-")]
        bare = [l for l in lines if len(l.split("  ")) < 2 and not l.rstrip().endswith(":")]
        # CLI11 wraps a long option spec onto its own line with the description on the next one,
        # so a bare line is fine only if the next line is an indented description.
        all_lines = text.splitlines()
        for l in bare:
            i = all_lines.index(l)
            nxt = all_lines[i + 1] if i + 1 < len(all_lines) else ""
            check(nxt.startswith(" " * 10) and nxt.strip() != "", f"fathom {sub}: option documented: {l.strip()}")


# ------------------------------------------------------------------------------------ bad inputs

def expect_error(fathom, args, what, stdin=None, needle=None):
    try:
        rc, out, err = run(fathom, args, stdin=stdin, timeout=60)
    except subprocess.TimeoutExpired:
        check(False, f"{what}: finishes (hung)")
        return
    lines = [l for l in err.splitlines() if l.strip()]
    check(rc > 0, f"{what}: non-zero exit without a signal (rc={rc})")
    check(len(lines) == 1 and lines[0].startswith("error: "), f"{what}: one-line 'error:' message (got {lines!r})")
    if needle is not None:
        check(needle in err, f"{what}: message mentions {needle!r}")


def test_bad_inputs(fathom, tmp, shared):
    garbage = os.path.join(tmp, "garbage.gguf")
    with open(garbage, "wb") as f:
        f.write(b"this is not a gguf file at all\n" * 10)
    truncated = os.path.join(tmp, "truncated.gguf")
    with open(truncated, "wb") as f:
        f.write(b"GGUF\x03\x00\x00\x00")  # magic + version, then nothing
    empty = os.path.join(tmp, "empty.gguf")
    open(empty, "wb").close()
    missing = os.path.join(tmp, "does-not-exist.gguf")
    ids = os.path.join(tmp, "ids.txt")
    with open(ids, "w") as f:
        f.write("1 2 3\n")

    expect_error(fathom, ["run", "-m", missing, "-p", "hi"], "missing model file", needle="does-not-exist.gguf")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi"], "garbage file as model")
    expect_error(fathom, ["run", "-m", truncated, "-p", "hi"], "truncated GGUF as model")
    expect_error(fathom, ["run", "-m", empty, "-p", "hi"], "empty file as model")
    expect_error(fathom, ["tokenize", "-m", garbage], "tokenize with a garbage model", stdin=b"hello")
    expect_error(fathom, ["logits", "-m", garbage, "--tokens-file", ids, "--out", os.path.join(tmp, "o.f32")],
                 "logits with a garbage model")
    expect_error(fathom, ["run", "-m", "no-such-short-name", "--models-dir", tmp, "-p", "hi"],
                 "unknown short model name", needle="no-such-short-name")
    expect_error(fathom, ["run", "-m", "x", "--models-dir", os.path.join(tmp, "nodir"), "-p", "hi"],
                 "missing models directory")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--temp", "nan"], "NaN temperature", needle="temperature")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--temp", "-1"], "negative temperature",
                 needle="temperature")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--top-p", "1.5"], "top-p above 1", needle="top_p")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--min-p", "nan"], "NaN min-p", needle="min_p")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--top-k", "-2"], "negative top-k", needle="top_k")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "-n", "-5"], "negative -n", needle="n-predict")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--temp", "abc"], "non-numeric temperature")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--kv-type", "q8"], "bad --kv-type", needle="kv-type")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--device", "gpu"], "bad --device", needle="device")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "--device", "cuda:x"], "bad --device ordinal", needle="device")
    expect_error(fathom, ["run", "-m", garbage, "-p", "hi", "-t", "-1"], "negative threads", needle="threads")
    expect_error(fathom, ["run", "-m", garbage], "run without a prompt", needle="prompt")
    expect_error(fathom, ["run", "-m", garbage, "-f", missing], "missing prompt file")
    expect_error(fathom, ["run", "--no-such-option"], "unknown option")
    expect_error(fathom, [], "no subcommand")
    expect_error(fathom, ["tokenize"], "tokenize without -m", needle="model")
    expect_error(fathom, ["logits", "-m", garbage, "--tokens-file", ids, "--out", "o.f32", "--mode", "chunked:0"],
                 "bad logits mode", needle="mode")
    expect_error(fathom, ["bench", "-m", garbage, "-p", "0"], "bench -p 0", needle="n-prompt")
    expect_error(fathom, ["detokenize", "-m", garbage], "detokenize with a garbage model", stdin=b"1 2")
    expect_error(fathom, ["detokenize"], "detokenize without -m", needle="model")
    expect_error(fathom, ["tokenize", "-m", garbage, "--threads", "2"], "tokenize takes no engine options",
                 stdin=b"hi", needle="--threads")
    vocab = os.path.join(shared, "tokenizer-tests", "ggml-vocab-gpt-2.gguf")
    if os.path.exists(vocab):
        expect_error(fathom, ["run", "-m", vocab, "-p", "hi"], "vocab-only GGUF (no weights) as model")
        expect_error(fathom, ["detokenize", "-m", vocab], "detokenize of a non-integer", stdin=b"12 x1",
                     needle="'x1'")
        expect_error(fathom, ["detokenize", "-m", vocab], "detokenize of an id outside the vocabulary",
                     stdin=b"50257", needle="50257")
        expect_error(fathom, ["detokenize", "-m", vocab], "detokenize of a negative id", stdin=b"-1", needle="-1")


# ------------------------------------------------------------------------------- vocabulary files

def vocab_cases(path):
    """The llama.cpp-format suite of a vocab GGUF: [(text, expected ids)] from X.gguf.inp / X.gguf.out."""
    with open(path + ".inp", encoding="utf-8", newline="") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")[:-1]
    with open(path + ".out", encoding="utf-8", newline="") as f:
        outs = [[int(x) for x in line.split()] for line in f.read().split("\n")[:len(texts)]]
    return list(zip(texts, outs))


def test_vocab_file(fathom, path):
    """tokenize gives the reference ids for every test string; detokenize of those ids gives the string back."""
    name = os.path.basename(path)
    cases = vocab_cases(path)
    check(len(cases) > 0, f"{name}: test strings found")

    def one(case):
        text, want = case
        rc, out, err = run(fathom, ["tokenize", "-m", path], stdin=text.encode())
        got = [int(x) for x in out.split()] if rc == 0 else None
        rc2, back, err2 = run(fathom, ["detokenize", "-m", path], stdin=" ".join(map(str, want)).encode())
        return text, want, (rc, got, err), (rc2, back, err2)

    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, cases))
    bad_tok = [(t, w, r) for t, w, r, _ in results if r[0] != 0 or r[1] != w]
    bad_detok = [(t, d) for t, _, _, d in results if d[0] != 0 or d[1] != t.encode()]
    check(not bad_tok, f"{name}: tokenize matches the reference ids on all {len(cases)} strings"
                       + (f" (first mismatch: {bad_tok[0]!r})" if bad_tok else ""))
    check(not bad_detok, f"{name}: detokenize of the reference ids gives each string back"
                         + (f" (first mismatch: {bad_detok[0]!r})" if bad_detok else ""))


# --------------------------------------------------------------------------------- with a model

def find_model(models_dir, prefix):
    if not os.path.isdir(models_dir):
        return None
    for name in sorted(os.listdir(models_dir)):
        if name.lower().startswith(prefix) and name.endswith(".gguf"):
            return os.path.join(models_dir, name)
    return None


def gguf_tokens(path):
    import gguf
    r = gguf.GGUFReader(path)
    f = r.fields["tokenizer.ggml.tokens"]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def gpt2_bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def test_model(fathom, model, mv, tmp, special, real, engine_args=()):
    """Smoke tests on one model file; `mv` are the -m (and --models-dir) arguments, `engine_args` the engine
    options added for the commands that load an engine, `special` a special token's text."""
    import numpy as np
    m = mv + list(engine_args)

    # tokenize: ids spell the input text through the GGUF's own vocabulary (read with gguf-py).
    text = "Hello world, naïve café! 1234"
    rc, out, err = run(fathom, ["tokenize"] + mv, stdin=text.encode())
    check(rc == 0, f"tokenize exits 0 ({err.strip()})")
    ids = [int(x) for x in out.decode().split()]
    check(out.decode().endswith("\n") and out.decode().count("\n") == 1, "tokenize prints one line")
    vocab = gguf_tokens(model)
    b2u = gpt2_bytes_to_unicode()
    spelled = bytes(b2u[c] for i in ids for c in vocab[i]).decode("utf-8", "replace")
    check(spelled == text, f"tokenize ids spell the input ({ids} -> {spelled!r})")
    # Special-token text: plain text by default, one token with --parse-special.
    rc, out_plain, _ = run(fathom, ["tokenize"] + mv, stdin=special.encode())
    rc2, out_special, _ = run(fathom, ["tokenize", "--parse-special"] + mv, stdin=special.encode())
    plain, special_ids = out_plain.decode().split(), out_special.decode().split()
    check(rc == 0 and rc2 == 0, "tokenize of special text exits 0")
    check(len(special_ids) == 1 and vocab[int(special_ids[0])] == special,
          f"--parse-special gives the special token {special_ids}")
    check(len(plain) > 1, f"special text without --parse-special is plain text {plain}")
    # detokenize: the ids give the text back; control tokens print their text unless --no-special.
    rc, back, err = run(fathom, ["detokenize"] + mv, stdin=" ".join(map(str, ids)).encode())
    check(rc == 0 and back == text.encode(), f"detokenize gives the text back ({back!r}; {err.strip()[-200:]})")
    rc, back, _ = run(fathom, ["detokenize"] + mv, stdin=out_special)
    rc2, hidden, _ = run(fathom, ["detokenize", "--no-special"] + mv, stdin=out_special)
    check(rc == 0 and back == special.encode() and rc2 == 0 and hidden == b"",
          f"detokenize prints a control token's text, --no-special nothing ({back!r}, {hidden!r})")

    # logits: the three evaluation modes agree (same model, same tokens, different batching).
    ids_file = os.path.join(tmp, "ids.txt")
    with open(ids_file, "w") as f:
        f.write(" ".join(map(str, ids)) + "\n")
    arrays = {}
    for mode in ["prefill", "decode", "chunked:3"]:
        path = os.path.join(tmp, mode.replace(":", "_") + ".f32")
        rc, _, err = run(fathom, ["logits"] + m + ["--tokens-file", ids_file, "--out", path, "--mode", mode], timeout=300)
        check(rc == 0, f"logits --mode {mode} exits 0 ({err.strip()[-200:]})")
        if rc == 0:
            arrays[mode] = np.fromfile(path, dtype="<f4")
    n_vocab = len(vocab)
    if "prefill" in arrays:
        a = arrays["prefill"]
        check(a.size == len(ids) * n_vocab, f"logits file is n_tokens x n_vocab floats ({a.size})")
        check(bool(np.all(np.isfinite(a))), "logits are finite")
        a = a.reshape(len(ids), n_vocab)
        for mode, b in arrays.items():
            if mode == "prefill" or b.size != a.size:
                continue
            b = b.reshape(a.shape)
            err = float(np.max(np.abs(a - b)))
            check(err < 0.05 * float(np.max(np.abs(a))), f"logits {mode} vs prefill: max |diff| {err:.4g}")
            check(bool(np.all(a.argmax(1) == b.argmax(1))), f"logits {mode} vs prefill: same argmax per row")

    # run: greedy output is reproducible and streams text; timings on stderr.
    args = ["run"] + m + ["-p", "What is the capital of France?", "-n", "16", "--temp", "0"]
    rc, out1, err1 = run(fathom, args, timeout=300)
    check(rc == 0, f"run exits 0 ({err1.strip()[-200:]})")
    check(len(out1.decode("utf-8", "replace").strip()) > 0, f"run prints text ({out1[:80]!r})")
    check("tok/s" in err1 and "prefill" in err1 and "decode" in err1, "run prints prefill/decode tok/s on stderr")
    rc, out2, _ = run(fathom, args, timeout=300)
    check(out1 == out2, "greedy run is reproducible")
    if real:  # random weights may emit byte tokens that never form a character; a real model does not
        try:
            out1.decode("utf-8")
            check(True, "run output is valid UTF-8 (no character split by streaming)")
        except UnicodeDecodeError as e:
            check(False, f"run output is valid UTF-8 ({e})")
    seeded = ["run"] + m + ["-p", "Tell me a story.", "-n", "12", "--temp", "1.0", "--seed", "7"]
    _, s1, _ = run(fathom, seeded, timeout=300)
    _, s2, _ = run(fathom, seeded, timeout=300)
    check(s1 == s2, "seeded sampling run is reproducible")
    expect_error(fathom, ["run"] + m + ["-p", "word " * 200, "--ctx", "64"], "prompt longer than the context",
                 needle="context")

    # chat through a pipe: two turns, /reset, /quit.
    rc, out, err = run(fathom, ["chat"] + m + ["--temp", "0", "-n", "12", "--stats"],
                       stdin=b"Hi!\nWhat is 2+2?\n/reset\nHello again\n/quit\nnever read\n", timeout=300)
    check(rc == 0, f"chat via a pipe exits 0 ({err.strip()[-200:]})")
    turns = [l for l in err.splitlines() if l.startswith("prefill:")]
    check(len(turns) == 3, f"chat answered three turns and stopped at /quit ({len(turns)} replies)")
    if len(turns) == 3:
        # Turn 2 reuses turn 1's prefix, so it prefills fewer tokens than its whole prompt;
        # turn 3 follows /reset and starts from scratch.
        check("reused" in turns[1], f"chat turn 2 reuses the session prefix ({turns[1]})")
        check("reused" not in turns[2], f"chat turn 3 (after /reset) starts from scratch ({turns[2]})")
    check(not out.decode("utf-8", "replace").startswith("> "), "no prompt is printed when stdin is a pipe")

    # bench: machine-readable output.
    import json
    rc, out, err = run(fathom, ["bench"] + m + ["-p", "32", "-n", "8", "--reps", "1", "--json"], timeout=300)
    check(rc == 0, f"bench exits 0 ({err.strip()[-200:]})")
    if rc == 0:
        j = json.loads(out.decode())
        check(j["prefill"]["best_tok_s"] > 0 and j["decode"]["best_tok_s"] > 0, "bench reports positive tok/s")
        check(j["device"] == "cpu" and j["decode_weight_bytes"] > 0, "bench reports device and weight bytes per token")
    # bench --depths: one row per context depth, interval rates between them.
    rc, out, err = run(fathom, ["bench"] + m + ["--depths", "16,48", "-n", "4", "-b", "16", "--json"], timeout=300)
    check(rc == 0, f"bench --depths exits 0 ({err.strip()[-200:]})")
    if rc == 0:
        rows = json.loads(out.decode())["depths"]
        check([r["depth"] for r in rows] == [16, 48] and rows[1]["interval"] == [16, 48],
              f"bench --depths rows and intervals ({rows!r})")
        check(all(r["prefill_tok_s"] > 0 and r["interval_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows),
              "bench --depths reports positive rates")
    expect_error(fathom, ["bench"] + m + ["--depths", "48,16"], "bench --depths not ascending", needle="ascending")
    # bench --sessions: S sessions through sync_step / decode_step, aggregate rates.
    rc, out, err = run(fathom, ["bench"] + m + ["--sessions", "3", "-p", "16", "-n", "4", "--reps", "1", "--json"],
                       timeout=300)
    check(rc == 0, f"bench --sessions exits 0 ({err.strip()[-200:]})")
    if rc == 0:
        j = json.loads(out.decode())
        check(j["sessions"] == 3 and j["prefill"]["n_tokens_per_session"] == 16 and
              j["decode"]["n_tokens_per_session"] == 4, f"bench --sessions fields ({j!r})")
        check(j["prefill"]["median_tok_s"] > 0 and j["decode"]["median_tok_s"] > 0 and
              j["decode"]["median_round_ms"] > 0, "bench --sessions reports positive rates")
    expect_error(fathom, ["bench"] + m + ["--sessions", "2", "--depths", "16"], "bench --sessions with --depths",
                 needle="cannot be combined")

    # --spec ngram: the same text as plain decoding (greedy, and sampled with a seed), a spec stats line.
    for extra in (["--temp", "0"], ["--temp", "0.8", "--seed", "5"]):
        args = ["run"] + m + ["-p", "one two three one two three one two three", "-n", "24"] + extra
        rc, plain_out, _ = run(fathom, args, timeout=300)
        rc2, spec_out, spec_err = run(fathom, args + ["--spec", "ngram", "--draft-max", "4"], timeout=300)
        check(rc == 0 and rc2 == 0 and plain_out == spec_out,
              f"run --spec ngram {' '.join(extra)} prints the plain decoding text ({plain_out!r} vs {spec_out!r})")
        check("spec: " in spec_err and "drafted" in spec_err, "run --spec ngram reports its drafts")
    expect_error(fathom, ["run"] + m + ["-p", "hi", "--spec", "ngram", "--ngram-min", "5"],
                 "run --ngram-min above --ngram-max", needle="ngram_min")
    # --spec draft with the model as its own drafter: the plain text, nearly every draft kept.
    args = ["run"] + m + ["-p", "one two three one two three one two three", "-n", "16", "--temp", "0"]
    rc, plain_out, _ = run(fathom, args, timeout=300)
    rc2, spec_out, spec_err = run(fathom, args + ["--spec", "draft", "--draft-model", model], timeout=300)
    check(rc == 0 and rc2 == 0 and plain_out == spec_out,
          f"run --spec draft prints the plain decoding text ({plain_out!r} vs {spec_out!r}; {spec_err[-200:]!r})")
    expect_error(fathom, ["run"] + m + ["-p", "hi", "--spec", "draft"], "run --spec draft without --draft-model",
                 needle="--draft-model")

    # --device: cuda fails with one line when this build or machine has no CUDA device (CI); auto
    # falls back to the CPU with a notice. A build and machine with a device run it instead (no check).
    rc, out, err = run(fathom, ["run"] + m + ["-p", "hi", "-n", "2", "--temp", "0", "--device", "cuda"], timeout=120)
    if rc != 0:
        lines = [l for l in err.splitlines() if l.strip()]
        check(len(lines) == 1 and "device 'cuda'" in lines[0] and ("no CUDA" in lines[0]),
              f"--device cuda without CUDA: one-line error naming it (got {lines!r})")
        rc, out, err = run(fathom, ["run"] + m + ["-p", "hi", "-n", "2", "--temp", "0", "--device", "auto"], timeout=120)
        check(rc == 0 and "running on the CPU" in err, f"--device auto falls back to the CPU with a notice ({err[-200:]!r})")


def test_prefill_progress(fathom, m):
    """The prefill bar (docs/cli.md): drawn on stderr only when it is a terminal or with --progress (here
    stderr is a pipe); one redraw per evaluated chunk (-b), ending at 100%; erased at the end."""
    import re
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    rc, _, err = run(fathom, ["run", "-p", prompt, "-n", "1", "--no-chat", "-b", "4", "--progress"] + m)
    text = err
    draws = re.findall(r"\rprefill \[[#.]{30}\] +(\d+)% \((\d+)/(\d+)\)", text)
    check(rc == 0 and len(draws) >= 3, f"run --progress draws the prefill bar per chunk ({len(draws)} draws)")
    if draws:
        done = [int(d[1]) for d in draws]
        check(done == sorted(done) and draws[-1][0] == "100" and draws[-1][1] == draws[-1][2],
              f"the bar rises to 100% ({draws})")
        check("\r\033[K" in text, "the bar line is erased at the end")
    rc, _, err = run(fathom, ["run", "-p", prompt, "-n", "1", "--no-chat", "-b", "4"] + m)
    check(rc == 0 and "prefill [" not in err, "no bar when stderr is not a terminal")


def test_serve_port(fathom, m):
    """A second `fathom serve` on a port another server listens on: one error line naming the port,
    non-zero exit (issue 22: SO_REUSEPORT let it bind and take half the connections)."""
    import re
    first = subprocess.Popen([fathom, "serve", "--port", "0"] + m, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in first.stderr:
            hit = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if hit:
                port = hit.group(1)
                break
        check(port is not None, "serve --port 0 starts and reports its port")
        if port is None:
            return
        try:
            rc, out, err = run(fathom, ["serve", "--port", port] + m, timeout=30)
        except subprocess.TimeoutExpired:
            rc, err = 0, "(still serving after 30 s: it bound the same port)"
        lines = [l for l in err.splitlines() if l.strip()]
        check(rc != 0, f"a second serve on port {port} exits non-zero (rc {rc})")
        check(len(lines) == 1 and lines[0].startswith("error: ") and f"port {port}" in lines[0],
              f"a second serve on port {port} prints one error line naming the port ({lines})")
    finally:
        first.terminate()
        first.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--suite", choices=["basic", "vocab", "tiny", "model"], required=True)
    ap.add_argument("--models-dir", default="models")
    ap.add_argument("--shared", default="../shared")
    a = ap.parse_args()
    if not os.path.exists(a.fathom):
        print(f"fathom binary not found: {a.fathom}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        if a.suite == "basic":
            test_help(a.fathom)
            test_bad_inputs(a.fathom, tmp, a.shared)
        elif a.suite == "vocab":
            # Every vocab-only GGUF of ../shared/tokenizer-tests, through the binary (tokenizer only, no engine).
            d = os.path.join(a.shared, "tokenizer-tests")
            files = sorted(f for f in os.listdir(d) if f.endswith(".gguf")) if os.path.isdir(d) else []
            if not files:
                print(f"SKIP: no vocab GGUF in {d}")
                return SKIP
            for f in files:
                test_vocab_file(a.fathom, os.path.join(d, f))
        elif a.suite == "tiny":
            # A random-weight llama with the GPT-2 vocabulary, generated here: exercises every
            # command end to end without the real models.
            vocab = os.path.join(a.shared, "tokenizer-tests", "ggml-vocab-gpt-2.gguf")
            try:
                import gguf, numpy  # noqa: F401
            except ImportError:
                print("SKIP: gguf-py / numpy not installed")
                return SKIP
            if not os.path.exists(vocab):
                print(f"SKIP: {vocab} not found")
                return SKIP
            model = os.path.join(tmp, "tiny-llama.gguf")
            here = os.path.dirname(os.path.abspath(__file__))
            subprocess.run([sys.executable, os.path.join(here, "make_tiny_model.py"), vocab, model], check=True)
            test_model(a.fathom, model, ["-m", model], tmp, "<|endoftext|>", real=False, engine_args=["-t", "1"])
            test_prefill_progress(a.fathom, ["-m", model, "-t", "1"])
            test_serve_port(a.fathom, ["-m", model, "-t", "1"])
        else:
            model = find_model(a.models_dir, "smollm2")
            if model is None:
                print(f"SKIP: no SmolLM2 .gguf in {a.models_dir} (run scripts/install-models.sh)")
                return SKIP
            test_model(a.fathom, model, ["-m", "smollm2", "--models-dir", a.models_dir], tmp, "<|im_start|>", real=True)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
