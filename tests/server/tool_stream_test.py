#!/usr/bin/env python3
"""Streamed tool calls and long-prefill keepalives, checked with the official OpenAI and Anthropic SDKs.

Two servers:
  * fathom_fake_serve (tests/server/fake_serve.cpp): the real HTTP server and scheduler over the fake
    engine, posing as DS4 ("deepseek4": DSML tool calls) or a dense model ("llama": Hermes). The fake
    echoes the last user message byte by byte, so each test writes the model's output itself and knows
    the exact call that must come out.
  * `fathom serve` on ds4-tiny (random weights, DS4 architecture): a forced call (tool_choice naming a
    function) through the real engine (the model is not expected to finish it, so the checks are the
    ones that hold either way), and the prefill progress comments of a long prompt.

Checked (docs/server.md "Tool calls", "Keepalive and progress"):
  * OpenAI: the chunk sequence as OpenAI documents it (role first; per call a first delta with index,
    id, type "function", function.name and arguments so far, then deltas with index and an arguments
    fragment only; finish_reason tool_calls); the SDK's own stream helper accumulates the fragments into
    the final arguments; concatenated fragments == the non-streamed message's arguments == the call
    written in the output; no markup in content.
  * Anthropic: the raw event sequence (message_start, ping, text block, tool_use block with
    input_json_delta events, message_delta stop_reason tool_use, message_stop), the SDK's accumulated
    message equals the non-streamed one.
  * parallel_tool_calls false / disable_parallel_tool_use: one call; tool_choice named / required /
    none; a tool result sent back renders as DS4's <tool_result>.
  * a long prefill: the SDK gets its stream object (headers) within 1 s while the prefill takes > 2 s,
    and parses the stream despite the keepalive comments.

Usage: tool_stream_test.py --fake-serve build/tests/fathom_fake_serve --fathom build/fathom
                           --model ../shared/golden/ds4-tiny/ds4-tiny-a.gguf
"""
import argparse
import json
import re
import subprocess
import sys
import threading
import time
import unittest

import anthropic
import openai
from serve_util import launch  # noqa: E402  (tests/server: the script's own directory)

ARGS = None

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Web search",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]
# The Anthropic SDK (2.x) no longer takes `temperature` as an argument; the API still does.
GREEDY = {"temperature": 0}
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


start = launch  # tests/server/serve_util.py


class Server:
    def __init__(self, cmd):
        self.cmd = cmd

    def __enter__(self):
        self.proc, self.url = start(self.cmd)
        return self

    def __exit__(self, *a):
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def oai(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    def ant(self):
        return anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0)


def fake(arch="deepseek4", delay_us=0, chunk=512):
    return Server([ARGS.fake_serve, "--arch", arch, "--delay-us", str(delay_us), "--chunk", str(chunk)])


def dsml_invoke(name, params):
    """One-line DSML (the fake echoes the user message up to its first newline)."""
    out = f'<｜DSML｜invoke name="{name}">'
    for k, v in params.items():
        if isinstance(v, str):
            out += f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>'
        else:
            out += f'<｜DSML｜parameter name="{k}" string="false">{json.dumps(v)}</｜DSML｜parameter>'
    return out + "</｜DSML｜invoke>"


def dsml_block(*invokes):
    return "<｜DSML｜tool_calls>" + "".join(invokes) + "</｜DSML｜tool_calls>"


def user(text):
    return [{"role": "user", "content": text}]


def read_openai_stream(stream):
    """Validates an OpenAI chat stream chunk by chunk; returns (content, {index: (id, name, [fragments])},
    finish_reason)."""
    content, calls, finish, first = "", {}, None, True
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        if first:
            assert d.role == "assistant", d
            first = False
        if d.content:
            content += d.content
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                # The call's first delta: index, id, type, function.name (arguments so far).
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = (tc.id, tc.function.name, [tc.function.arguments or ""])
            else:
                # Later deltas: the index and an arguments fragment only.
                assert tc.id is None and tc.type is None and tc.function.name is None, tc
                calls[tc.index][2].append(tc.function.arguments)
        if ch.finish_reason:
            assert finish is None
            finish = ch.finish_reason
    return content, calls, finish


class Ds4FakeOpenAI(unittest.TestCase):
    OUT_TEXT = "Let me look that up."
    CALL = {"city": "Paris", "days": 3}

    def output(self):
        return self.OUT_TEXT + dsml_block(dsml_invoke("get_weather", self.CALL))

    def test_stream_matches_the_call_and_the_whole_response(self):
        with fake() as s:
            c = s.oai()
            stream = c.chat.completions.create(model="fake-model", messages=user(self.output()), tools=TOOLS,
                                               temperature=0, stream=True)
            content, calls, finish = read_openai_stream(stream)
            self.assertEqual(content, self.OUT_TEXT)
            self.assertNotIn("DSML", content)
            self.assertEqual(finish, "tool_calls")
            self.assertEqual(list(calls), [0])
            cid, name, frags = calls[0]
            self.assertEqual(name, "get_weather")
            self.assertGreater(len(frags), 5, frags)  # streamed as decoded, not one block
            self.assertEqual(json.loads("".join(frags)), self.CALL)
            whole = c.chat.completions.create(model="fake-model", messages=user(self.output()), tools=TOOLS,
                                              temperature=0)
            m = whole.choices[0].message
            self.assertEqual(whole.choices[0].finish_reason, "tool_calls")
            self.assertEqual(m.content, self.OUT_TEXT)
            self.assertEqual(len(m.tool_calls), 1)
            self.assertEqual(m.tool_calls[0].function.name, "get_weather")
            self.assertEqual(m.tool_calls[0].function.arguments, "".join(frags))

    def test_sdk_stream_helper_accumulates_the_arguments(self):
        # The SDK's own accumulator (ChatCompletionStream) builds the call from our deltas.
        with fake() as s:
            with s.oai().chat.completions.stream(model="fake-model", messages=user(self.output()), tools=TOOLS,
                                                 temperature=0) as st:
                deltas, done = [], []
                for ev in st:
                    if ev.type == "tool_calls.function.arguments.delta":
                        deltas.append(ev.arguments_delta)
                    if ev.type == "tool_calls.function.arguments.done":
                        done.append((ev.name, ev.arguments))
                final = st.get_final_completion()
            self.assertEqual(done, [("get_weather", "".join(deltas))])
            self.assertEqual(json.loads(done[0][1]), self.CALL)
            tc = final.choices[0].message.tool_calls
            self.assertEqual(len(tc), 1)
            self.assertEqual(json.loads(tc[0].function.arguments), self.CALL)

    def test_parallel_calls_and_parallel_tool_calls_false(self):
        out = dsml_block(dsml_invoke("get_weather", {"city": "Oslo"}), dsml_invoke("search", {"q": "fjords"}))
        with fake() as s:
            c = s.oai()
            _, calls, finish = read_openai_stream(c.chat.completions.create(
                model="fake-model", messages=user(out), tools=TOOLS, temperature=0, stream=True))
            self.assertEqual([calls[i][1] for i in sorted(calls)], ["get_weather", "search"])
            self.assertEqual(json.loads("".join(calls[1][2])), {"q": "fjords"})
            self.assertNotEqual(calls[0][0], calls[1][0])
            self.assertEqual(finish, "tool_calls")
            _, calls, finish = read_openai_stream(c.chat.completions.create(
                model="fake-model", messages=user(out), tools=TOOLS, temperature=0, stream=True,
                parallel_tool_calls=False))
            self.assertEqual(list(calls), [0])
            self.assertEqual(json.loads("".join(calls[0][2])), {"city": "Oslo"})
            self.assertEqual(finish, "tool_calls")
            whole = c.chat.completions.create(model="fake-model", messages=user(out), tools=TOOLS, temperature=0,
                                              parallel_tool_calls=False)
            self.assertEqual(len(whole.choices[0].message.tool_calls), 1)

    def test_tool_choice(self):
        rest = ('<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter></｜DSML｜invoke>'
                '</｜DSML｜tool_calls>')
        named_open = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        with fake() as s:
            c = s.oai()
            # Named: the prompt ends inside the invoke; the fake echoes from after it (filler of that length).
            _, calls, finish = read_openai_stream(c.chat.completions.create(
                model="fake-model", messages=user("." * len(named_open.encode()) + rest), tools=TOOLS,
                temperature=0, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
            self.assertEqual((calls[0][1], json.loads("".join(calls[0][2])), finish),
                             ("get_weather", {"city": "Rome"}, "tool_calls"))
            # none: no tools described, the markup is plain text.
            out = dsml_block(dsml_invoke("search", {"q": "x"}))
            r = c.chat.completions.create(model="fake-model", messages=user(out), tools=TOOLS, temperature=0,
                                          tool_choice="none")
            self.assertEqual((r.choices[0].message.content, r.choices[0].message.tool_calls), (out, None))
            # A named tool that is not in tools: 400, and the server keeps serving.
            with self.assertRaises(openai.BadRequestError) as e:
                c.chat.completions.create(model="fake-model", messages=user("x"), tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "nope"}})
            self.assertIn("nope", str(e.exception))
            self.assertEqual(c.chat.completions.create(model="fake-model", messages=user("ok"),
                                                       temperature=0).choices[0].message.content, "ok")

    def test_tool_result_turn_renders_in_ds4_form(self):
        with fake() as s:
            c = s.oai()
            first = c.chat.completions.create(model="fake-model", messages=user(self.output()), tools=TOOLS,
                                              temperature=0)
            call = first.choices[0].message.tool_calls[0]
            msgs = user("weather?") + [
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
            # The fake echoes the last user turn: the result as DS4's encoder writes it.
            r = c.chat.completions.create(model="fake-model", messages=msgs, tools=TOOLS, temperature=0)
            self.assertEqual(r.choices[0].message.content, "<tool_result>sunny, 24 C</tool_result>")


class Ds4FakeAnthropic(unittest.TestCase):
    def test_event_sequence_and_accumulated_message(self):
        out = "Checking." + dsml_block(dsml_invoke("search", {"q": "tide tables", "n": 5}))
        with fake() as s:
            a = s.ant()
            kw = dict(model="fake-model", max_tokens=1000, extra_body=GREEDY, tools=ANTHROPIC_TOOLS, messages=user(out))
            events, partial = [], ""
            with a.messages.stream(**kw) as st:
                for ev in st:
                    if ev.type in ("text", "input_json", "citation", "thinking", "signature"):
                        continue  # the SDK's derived events
                    e = ev.type
                    if ev.type == "content_block_start":
                        e += "/" + ev.content_block.type
                        if ev.content_block.type == "tool_use":
                            self.assertEqual((ev.content_block.name, ev.content_block.input), ("search", {}))
                            self.assertTrue(ev.content_block.id.startswith("toolu_"))
                    if ev.type == "content_block_delta":
                        e += "/" + ev.delta.type
                        if ev.delta.type == "input_json_delta":
                            partial += ev.delta.partial_json
                    if ev.type == "message_delta":
                        e += "/" + ev.delta.stop_reason
                    if not events or events[-1] != e:
                        events.append(e)
                final = st.get_final_message()
            self.assertEqual(events, ["message_start", "content_block_start/text", "content_block_delta/text_delta",
                                      "content_block_stop", "content_block_start/tool_use",
                                      "content_block_delta/input_json_delta", "content_block_stop",
                                      "message_delta/tool_use", "message_stop"])
            self.assertEqual(json.loads(partial), {"q": "tide tables", "n": 5})
            whole = a.messages.create(**kw)
            strip = lambda m: [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
                               for b in m.content]
            self.assertEqual(strip(final), strip(whole))
            self.assertEqual(strip(whole), [("text", "Checking.", None, None),
                                            ("tool_use", None, "search", {"q": "tide tables", "n": 5})])
            self.assertEqual((final.stop_reason, whole.stop_reason), ("tool_use", "tool_use"))

    def test_disable_parallel_tool_use(self):
        out = dsml_block(dsml_invoke("get_weather", {"city": "Oslo"}), dsml_invoke("search", {"q": "x"}))
        with fake() as s:
            with s.ant().messages.stream(model="fake-model", max_tokens=1000, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
                                         messages=user(out),
                                         tool_choice={"type": "auto", "disable_parallel_tool_use": True}) as st:
                final = st.get_final_message()
            self.assertEqual([(b.type, b.name, b.input) for b in final.content],
                             [("tool_use", "get_weather", {"city": "Oslo"})])


class HermesFake(unittest.TestCase):
    def test_openai_and_anthropic(self):
        call = {"q": "a } b", "opts": {"n": [1, 2]}}
        out = 'Sure. <tool_call>{"name": "search", "arguments": ' + json.dumps(call) + "}</tool_call>"
        with fake("llama") as s:
            content, calls, finish = read_openai_stream(s.oai().chat.completions.create(
                model="fake-model", messages=user(out), tools=TOOLS, temperature=0, stream=True))
            self.assertEqual((content, finish), ("Sure.", "tool_calls"))
            self.assertEqual(json.loads("".join(calls[0][2])), call)
            with s.ant().messages.stream(model="fake-model", max_tokens=1000, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
                                         messages=user(out)) as st:
                final = st.get_final_message()
            self.assertEqual([(b.type, getattr(b, "input", None)) for b in final.content],
                             [("text", None), ("tool_use", call)])


class LongPrefill(unittest.TestCase):
    def test_headers_at_once_and_sdks_ignore_keepalives(self):
        # 6 chunks of 256 prompt tokens at 400 ms each: ~2.4 s of prefill before the first token.
        with fake("llama", delay_us=400000, chunk=256) as s:
            for i, api in enumerate(("openai", "anthropic")):
                text = ("abc" if i == 0 else "xyz") * 500
                t0 = time.time()
                if api == "openai":
                    stream = s.oai().chat.completions.create(model="fake-model", messages=user(text), max_tokens=3,
                                                             temperature=0, stream=True)
                else:
                    stream = s.ant().messages.create(model="fake-model", max_tokens=3, extra_body=GREEDY,
                                                     messages=user(text), stream=True)
                t_headers = time.time() - t0
                got = ""
                for ev in stream:
                    if api == "openai" and ev.choices and ev.choices[0].delta.content:
                        got += ev.choices[0].delta.content
                    if api == "anthropic" and ev.type == "content_block_delta":
                        got += ev.delta.text
                total = time.time() - t0
                self.assertLess(t_headers, 1.0, api)
                self.assertGreater(total, 2.0, api)
                self.assertEqual(got, text[:3], api)


class Ds4Tiny(unittest.TestCase):
    """`fathom serve` on ds4-tiny (the real DS4 engine on the CPU)."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server([ARGS.fathom, "serve", "-m", ARGS.model, "--port", "0", "--parallel", "1", "--ctx",
                             "8192", "-t", "2", "--alias", "m", "--prefill-chunk", "256"]).__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.server.__exit__()

    def test_long_prefill_progress(self):
        """A ~5400-token prompt (seconds of prefill on 2 cores): the first bytes within 1 s, then
        `: prefill D/T` comments, D at 256-token chunk boundaries and rising, T the prompt's tokens. (The
        comment timing itself is checked deterministically with a slow fake engine, LongPrefill.* in
        test_server; a machine fast enough to prefill this in under 1.5 s skips the comment checks.)"""
        import http.client
        body = json.dumps({"model": "m", "messages": user("lorem ipsum dolor sit amet " * 195), "max_tokens": 1,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection(self.server.url[len("http://"):], timeout=300)
        t0 = time.time()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        t_headers = time.time() - t0
        self.assertEqual(resp.status, 200)
        raw = resp.read().decode()
        total = time.time() - t0
        conn.close()
        frames = [f for f in raw.split("\n\n") if f]
        comments = [f[1:].strip() for f in frames if f.startswith(":")]
        usage = [json.loads(f[6:]) for f in frames if f.startswith("data: {")][-1]["usage"]
        self.assertLess(t_headers, 1.0)
        if total <= 1.5:
            self.skipTest(f"the prefill took only {total:.2f} s: too fast for a keepalive comment")
        self.assertGreaterEqual(len(comments), 1, raw[:500])
        seen = []
        for c in comments:
            m = re.fullmatch(r"prefill (\d+)/(\d+)", c)
            self.assertIsNotNone(m, c)
            d, t = int(m.group(1)), int(m.group(2))
            self.assertEqual(t, usage["prompt_tokens"])
            self.assertTrue(d % 256 == 0 and d < t, c)
            seen.append(d)
        self.assertEqual(seen, sorted(seen))

    def test_forced_named_call(self):
        """The forced opening makes the first streamed delta a call to the named function; random weights
        will hardly finish it, so it ends either as a valid call or with the documented error, never with
        markup in the content."""
        c = self.server.oai()
        named = {"type": "function", "function": {"name": "get_weather"}}
        first, content = None, ""
        try:
            for chunk in c.chat.completions.create(model="m", messages=user("Weather in Paris?"), tools=TOOLS,
                                                   tool_choice=named, temperature=0, max_tokens=24, stream=True):
                if not chunk.choices:
                    continue
                d = chunk.choices[0].delta
                content += d.content or ""
                if d.tool_calls and first is None:
                    first = d.tool_calls[0]
            completed = True
        except openai.APIError as e:
            self.assertIn("did not complete a valid call to 'get_weather'", str(e))
            completed = False
        self.assertIsNotNone(first)
        self.assertEqual((first.index, first.type, first.function.name), (0, "function", "get_weather"))
        self.assertTrue(first.id.startswith("call_"))
        self.assertEqual(first.function.arguments, "{")
        self.assertEqual(content, "")
        if not completed:  # the whole response reports the same failure; the server keeps serving
            with self.assertRaises(openai.InternalServerError):
                c.chat.completions.create(model="m", messages=user("Weather in Paris?"), tools=TOOLS,
                                          tool_choice=named, temperature=0, max_tokens=24)
        r = c.chat.completions.create(model="m", messages=user("Hi"), temperature=0, max_tokens=4)
        self.assertEqual(r.choices[0].finish_reason, "length")


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--fake-serve", required=True)
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ARGS, rest = ap.parse_known_args()
    ok = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2).result.wasSuccessful()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
