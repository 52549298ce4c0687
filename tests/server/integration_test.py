#!/usr/bin/env python3
"""Integration tests for `fathom serve` with the official OpenAI and Anthropic Python SDKs.

Starts a live server on a real model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf) and checks
plain/streaming chat, completions, stop sequences, usage, logprobs, tool-call round trip, error
cases, batch invariance (16 concurrent greedy requests == each alone) and that cancelling a stream
frees its slot (seen in /metrics). Needs: pip install openai anthropic.

Usage: integration_test.py --fathom build/tools/fathom --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import concurrent.futures
import json
import re
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

import anthropic
import openai

ARGS = None
SERVER = None  # (process, base_url)


def start_server(extra=()):
    cmd = [ARGS.fathom, "serve", "-m", ARGS.model, "--port", "0", "--parallel", "4", "--ctx", "2048",
           "-t", str(ARGS.threads), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    port = None
    lines = []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError("fathom serve exited: " + "".join(lines))
            continue
        lines.append(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        raise RuntimeError("fathom serve did not start: " + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # drain stderr
    return proc, f"http://127.0.0.1:{port}"


def http_get(path):
    with urllib.request.urlopen(SERVER[1] + path, timeout=30) as r:
        return r.read().decode()


def metric(name):
    for line in http_get("/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def oa():
    return openai.OpenAI(base_url=SERVER[1] + "/v1", api_key="unused", max_retries=0, timeout=600)


def an():
    return anthropic.Anthropic(base_url=SERVER[1], api_key="unused", max_retries=0, timeout=600)


MODEL = None
MSG = [{"role": "user", "content": "Name three colours."}]


class ServeTests(unittest.TestCase):
    def chat(self, **kw):
        args = dict(model=MODEL, messages=MSG, temperature=0, max_tokens=24)
        args.update(kw)
        return oa().chat.completions.create(**args)

    def test_models(self):
        ids = [m.id for m in oa().models.list().data]
        self.assertIn(MODEL, ids)

    def test_chat_plain_and_stream_agree(self):
        r = self.chat()
        text = r.choices[0].message.content
        self.assertTrue(text)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 5)
        self.assertGreater(r.usage.completion_tokens, 0)
        self.assertLessEqual(r.usage.completion_tokens, 24)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        parts, usage, finish = [], None, None
        for ch in self.chat(stream=True, stream_options={"include_usage": True}):
            if ch.usage:
                usage = ch.usage
            for c in ch.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        self.assertEqual("".join(parts), text)  # greedy: streaming == non-streaming
        self.assertEqual(finish, r.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, r.usage.completion_tokens)
        self.assertEqual(usage.prompt_tokens, r.usage.prompt_tokens)

    def test_completions(self):
        r = oa().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
        self.assertTrue(r.choices[0].text)
        self.assertEqual(r.usage.completion_tokens, 6 if r.choices[0].finish_reason == "length" else r.usage.completion_tokens)
        s = "".join(c.choices[0].text for c in oa().completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True) if c.choices)
        self.assertEqual(s, r.choices[0].text)

    def test_stop_sequences(self):
        full = self.chat(max_tokens=32).choices[0].message.content
        words = full.split()
        self.assertGreaterEqual(len(words), 3, full)
        stop = words[2]
        expect = full[: full.index(stop)]
        r = self.chat(max_tokens=32, stop=[stop])
        self.assertEqual(r.choices[0].message.content, expect)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        streamed = "".join(c.choices[0].delta.content or "" for c in self.chat(max_tokens=32, stop=stop, stream=True)
                           if c.choices)
        self.assertEqual(streamed, expect)

    def test_logprobs(self):
        r = self.chat(logprobs=True, top_logprobs=3, max_tokens=8)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        for t in content:
            self.assertLessEqual(t.logprob, 1e-6)
            self.assertEqual(len(t.top_logprobs), 3)
            lps = [a.logprob for a in t.top_logprobs]
            self.assertEqual(lps, sorted(lps, reverse=True))
            self.assertAlmostEqual(t.logprob, lps[0], places=4)  # greedy picks the most likely token

    def test_tool_round_trip(self):
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        messages = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        r = self.chat(messages=messages, tools=tools, max_tokens=48)
        ch = r.choices[0]
        self.assertIn(ch.finish_reason, ("stop", "length", "tool_calls"))
        if ch.message.tool_calls:
            for tc in ch.message.tool_calls:
                self.assertEqual(tc.function.name, "get_weather")
                json.loads(tc.function.arguments)
        else:
            self.assertTrue(ch.message.content)
        # The tools description reaches the prompt: more prompt tokens than without tools.
        plain = self.chat(messages=messages, max_tokens=1)
        self.assertGreater(r.usage.prompt_tokens, plain.usage.prompt_tokens)

    def test_errors(self):
        with self.assertRaises(openai.BadRequestError):
            self.chat(temperature=-1)
        with self.assertRaises(openai.NotFoundError):
            self.chat(model="no-such-model")
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(messages=[{"role": "user", "content": "word " * 5000}])
        self.assertIn("context", str(e.exception))
        with self.assertRaises(anthropic.BadRequestError):
            an().messages.create(model=MODEL, max_tokens=8, messages=MSG, extra_body={"temperature": 5})
        # PFlash overrides: this server has no drafter, and bad values are 400s naming the field.
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(extra_body={"prefill_compression": "always"})
        self.assertIn("--prefill-drafter", str(e.exception))
        for bad in ({"prefill_keep_ratio": 1.5}, {"prefill_keep_ratio": -0.1}, {"prefill_keep_ratio": "NaN"},
                    {"prefill_compression": "sometimes"}, {"prefill_threshold": 0}):
            with self.assertRaises(openai.BadRequestError, msg=str(bad)) as e:
                self.chat(extra_body=bad)
            self.assertIn(next(iter(bad)), str(e.exception))
        self.assertEqual(json.loads(http_get("/health"))["status"], "ok")  # still serving

    def test_anthropic(self):
        c = an()
        # Sampling fields go through extra_body: recent SDK versions dropped them from create().
        greedy = {"temperature": 0}
        r = c.messages.create(model=MODEL, max_tokens=16, system="Be brief.", messages=MSG, extra_body=greedy)
        self.assertEqual(r.role, "assistant")
        self.assertIn(r.stop_reason, ("end_turn", "max_tokens"))
        text = "".join(b.text for b in r.content if b.type == "text")
        self.assertTrue(text)
        with c.messages.stream(model=MODEL, max_tokens=16, system="Be brief.", messages=MSG, extra_body=greedy) as s:
            streamed = "".join(s.text_stream)
            final = s.get_final_message()
        self.assertEqual(streamed, text)
        self.assertEqual(final.usage.output_tokens, r.usage.output_tokens)
        n = c.messages.count_tokens(model=MODEL, system="Be brief.", messages=MSG)
        self.assertEqual(n.input_tokens, r.usage.input_tokens)

    def test_batch_invariance(self):
        prompts = [f"Write a short sentence about the number {i}." for i in range(16)]

        def one(p):
            return self.chat(messages=[{"role": "user", "content": p}], max_tokens=12).choices[0].message.content

        alone = [one(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            together = list(ex.map(one, prompts))
        self.assertEqual(together, alone)

    def test_cancel_frees_slot(self):
        before = metric("fathom_requests_cancelled_total")
        host, port = SERVER[1].split("//")[1].split(":")
        body = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 1000, "stream": True, "temperature": 0})
        s = socket.create_connection((host, int(port)))
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        s.recv(512)  # headers and the first chunk: it is generating
        s.close()
        deadline = time.time() + 30
        while time.time() < deadline:
            if metric("fathom_requests_cancelled_total") > before and metric("fathom_slots_busy") == 0:
                break
            time.sleep(0.2)
        self.assertGreater(metric("fathom_requests_cancelled_total"), before)
        self.assertEqual(metric("fathom_slots_busy"), 0)


def haystack(n_sentences, needle_at):
    # Distinct filler sentences: a repeated filler would make PFlash's anchor rule (n-grams of the
    # query tail seen earlier at most 8 times) keep nearly everything.
    words = ["apple", "river", "lantern", "copper", "meadow", "violin", "harbor", "pepper", "glacier", "saddle",
             "orchid", "tunnel", "walnut", "canyon", "ribbon", "falcon", "marble", "thistle", "anchor", "biscuit"]
    s = ""
    for i in range(n_sentences):
        s += f"The {words[(i * 7) % 20]} rests beside a {words[(i * 11 + 3) % 20]} and a {words[(i * 3 + 5) % 20]}. "
        if i == needle_at:
            s += "The secret code for the blue door is 48213. "
    return s + "\nQuestion: what is the secret code for the blue door?"


class PFlashServeTests(unittest.TestCase):
    """`fathom serve --prefill-compression auto` with SmolLM2 as its own drafter (docs/pflash.md)."""

    @classmethod
    def setUpClass(cls):
        cls.proc, cls.url = start_server(["--prefill-compression", "auto", "--prefill-threshold", "300",
                                          "--prefill-keep-ratio", "0.2", "--prefill-drafter", ARGS.model])
        cls.client = openai.OpenAI(base_url=cls.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        cls.proc.wait(timeout=30)

    @staticmethod
    def msgs(content):
        # The haystack is an earlier turn: the last user message (the question) stays verbatim.
        return [{"role": "user", "content": content}, {"role": "assistant", "content": "I have read it."},
                {"role": "user", "content": "What is the secret code for the blue door?"}]

    def chat(self, content, **kw):
        return self.client.chat.completions.create(model=MODEL, messages=self.msgs(content), temperature=0,
                                                   max_tokens=4, **kw)

    def usage_pc(self, r):
        extra = r.usage.model_extra or {}
        return extra.get("prefill_compression")

    def test_long_prompt_compressed_short_not(self):
        long_text = haystack(36, 15)
        r = self.chat(long_text)
        pc = self.usage_pc(r)
        self.assertIsNotNone(pc, "a prompt over --prefill-threshold must be compressed")
        self.assertGreater(pc["original_prompt_tokens"], 300)
        # How much is kept depends on the selection rules (tested in tests/pflash); here: it shrank.
        self.assertLess(pc["effective_prompt_tokens"], pc["original_prompt_tokens"] * 0.9)
        self.assertEqual(r.usage.prompt_tokens, pc["effective_prompt_tokens"])
        self.assertAlmostEqual(pc["keep_ratio"], 0.2)
        self.assertIsNone(self.usage_pc(self.chat("Name three colours.")))
        # Per-request overrides: off, a threshold above the prompt, a different keep ratio, always.
        self.assertIsNone(self.usage_pc(self.chat(long_text, extra_body={"prefill_compression": "off"})))
        self.assertIsNone(self.usage_pc(self.chat(long_text, extra_body={"prefill_threshold": 100000})))
        r5 = self.chat(long_text, extra_body={"prefill_keep_ratio": 1.0})
        self.assertGreater(self.usage_pc(r5)["effective_prompt_tokens"], pc["effective_prompt_tokens"])
        self.assertIsNotNone(self.usage_pc(self.chat("Name three colours.", extra_body={"prefill_compression": "always"})))
        # Streaming reports it too, and so does the Anthropic API.
        chunks = list(self.client.chat.completions.create(
            model=MODEL, messages=self.msgs(long_text), temperature=0, max_tokens=4,
            stream=True, stream_options={"include_usage": True}))
        usage = [c.usage for c in chunks if c.usage][0]
        self.assertEqual((usage.model_extra or {})["prefill_compression"]["effective_prompt_tokens"],
                         pc["effective_prompt_tokens"])
        a = anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=600)
        m = a.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": long_text}],
                              extra_body={"temperature": 0})
        self.assertIn("prefill_compression", m.usage.model_extra or {})
        # A single user message is the document: verbatim by default, compressible on request.
        one = [{"role": "user", "content": long_text}]
        r1 = self.client.chat.completions.create(model=MODEL, messages=one, temperature=0, max_tokens=4)
        self.assertGreater(self.usage_pc(r1)["effective_prompt_tokens"], 0.9 * self.usage_pc(r1)["original_prompt_tokens"])
        r2 = self.client.chat.completions.create(model=MODEL, messages=one, temperature=0, max_tokens=4,
                                                 extra_body={"prefill_verbatim_last_user": False})
        self.assertLess(self.usage_pc(r2)["effective_prompt_tokens"], self.usage_pc(r1)["effective_prompt_tokens"])
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as f:
            text = f.read().decode()
        n = [float(l.split()[1]) for l in text.splitlines()
             if l.startswith("fathom_prefill_compression_requests_total ")][0]
        self.assertGreaterEqual(n, 5)
        with urllib.request.urlopen(self.url + "/props", timeout=30) as f:
            props = json.loads(f.read())
        self.assertEqual(props["prefill_compression"]["mode"], "auto")

    def test_bad_flags_fail_before_loading(self):
        for extra, needle in ((["--prefill-compression", "auto"], "--prefill-drafter"),
                              (["--prefill-keep-ratio", "nan", "--prefill-drafter", ARGS.model], "keep"),
                              (["--prefill-keep-ratio", "1.5", "--prefill-drafter", ARGS.model], "keep"),
                              (["--prefill-drafter", "/no/such/drafter.gguf"], "drafter")):
            p = subprocess.run([ARGS.fathom, "serve", "-m", ARGS.model, "--port", "0", *extra],
                               capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0, extra)
            self.assertIn(needle, p.stderr, extra)


def main():
    global ARGS, SERVER, MODEL
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ARGS, rest = ap.parse_known_args()
    SERVER = start_server()
    try:
        MODEL = oa().models.list().data[0].id
        prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
        ok = prog.result.wasSuccessful()
    finally:
        SERVER[0].terminate()
        SERVER[0].wait(timeout=30)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
