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


def start_server():
    cmd = [ARGS.fathom, "serve", "-m", ARGS.model, "--port", "0", "--parallel", "4", "--ctx", "2048",
           "-t", str(ARGS.threads)]
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
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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
