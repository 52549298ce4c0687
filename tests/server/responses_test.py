#!/usr/bin/env python3
"""POST /v1/responses (the OpenAI Responses API) of `fathom serve`, driven by the official `openai` SDK.

Two servers: SmolLM2-135M-Instruct (text, tools, continuation) and, when given, ds4-tiny (DS4 format,
thinking mode: reasoning items). Greedy decoding throughout, so every request is deterministic and can be
compared with an independent path through the server: the Chat Completions endpoint (tested on its own by
integration_test.py and thinking_test.py) given the same conversation as explicit messages must produce
the same text and count the same prompt tokens. Checks (docs/server.md "Responses API"):
  * every returned object and every streamed event validates strictly (pydantic model_validate) against
    the SDK's own types (Response, the ResponseStreamEvent union: an event type the SDK does not know
    fails); sequence_number counts 0, 1, 2, ...; events follow the documented per-item sequence; the
    final response equals the accumulated deltas and the SDK's stream helper's accumulated response;
  * output_text / usage equal the Chat Completions answer for the same conversation;
  * previous_response_id: turn 2 sees turn 1 (its prompt is the explicit three-message conversation) and
    reuses turn 1's prompt (cached_tokens); retrieve / delete; unknown ids are 400
    previous_response_not_found (create) and 404 (retrieve);
  * a function_call item from tool_choice naming the function, its output sent back as
    function_call_output;
  * bad input: 400 naming the field, nothing generated, the server keeps serving;
  * ds4-tiny: reasoning item = chat reasoning_content, reasoning_tokens = the chat logprobs' tokens up to
    and including "</think>", reasoning_text events; turn 2 drops turn 1's reasoning and reuses its prompt.

Usage: responses_test.py --fathom build/fathom --model models/SmolLM2-135M-Instruct.Q4_1.gguf
                         [--ds4 ../shared/golden/ds4-tiny/ds4-tiny-a.gguf]
"""
import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import typing
import unittest
import urllib.request

import openai
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from serve_util import launch  # noqa: E402  (tests/server: the script's own directory)

ARGS = None
SMOL = None  # base url
DS4 = None
PROCS = []
INSTR = "You are a helpful assistant. Answer briefly."

# type literal -> the SDK's event class, from the ResponseStreamEvent union.
EVENT_CLASSES = {}
for _cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0]):
    for _lit in typing.get_args(_cls.model_fields["type"].annotation):
        EVENT_CLASSES[_lit] = _cls


def start_server(model, extra):
    proc, url = launch([ARGS.fathom, "serve", "-m", model, "--port", "0", "--parallel", "1", "-t", str(ARGS.threads),
                        "--alias", "m", *extra])
    PROCS.append(proc)
    return url


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def create_json(base, **kw):
    """A non-streamed create; the raw JSON validated strictly as the SDK's Response."""
    raw = client(base).responses.with_raw_response.create(**kw)
    data = raw.http_response.json()
    return Response.model_validate(data), data


def raw_events(base, **kw):
    """A streamed create; every SSE event validated strictly as the SDK's class for its type."""
    events = []
    with client(base).responses.with_streaming_response.create(stream=True, **kw) as resp:
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data["type"])
                cls = EVENT_CLASSES.get(data["type"])
                assert cls is not None, "event type unknown to the SDK: " + data["type"]
                events.append(cls.model_validate(data))
    return events


def check_sequence(test, events):
    """The documented order: created, in_progress, per item added / (content part: added, deltas, done,
    part done | arguments: deltas, done) / item done, then completed or incomplete. Returns the final
    Response and, per output index, the accumulated deltas."""
    test.assertEqual([e.sequence_number for e in events], list(range(len(events))))
    test.assertEqual([e.type for e in events[:2]], ["response.created", "response.in_progress"])
    test.assertEqual(events[0].response.status, "in_progress")
    test.assertIn(events[-1].type, ("response.completed", "response.incomplete"))
    acc = {}
    i, index = 2, 0
    while i < len(events) - 1:
        e = events[i]
        test.assertEqual(e.type, "response.output_item.added")
        test.assertEqual(e.output_index, index)
        item = e.item
        i += 1
        text = ""
        if item.type in ("message", "reasoning"):
            part = "output_text" if item.type == "message" else "reasoning_text"
            test.assertEqual(events[i].type, "response.content_part.added")
            test.assertEqual(events[i].part.type, part)
            i += 1
            delta = "response.output_text.delta" if item.type == "message" else "response.reasoning_text.delta"
            while events[i].type == delta:
                test.assertEqual((events[i].item_id, events[i].output_index), (item.id, index))
                text += events[i].delta
                i += 1
            test.assertEqual(events[i].type, delta[:-len("delta")] + "done")
            test.assertEqual(events[i].text, text)
            test.assertEqual(events[i + 1].type, "response.content_part.done")
            test.assertEqual(events[i + 1].part.text, text)
            i += 2
        else:
            test.assertEqual(item.type, "function_call")
            while events[i].type == "response.function_call_arguments.delta":
                text += events[i].delta
                i += 1
            test.assertEqual(events[i].type, "response.function_call_arguments.done")
            test.assertEqual(events[i].arguments, text)
            i += 1
        test.assertEqual(events[i].type, "response.output_item.done")
        test.assertEqual((events[i].output_index, events[i].item.id), (index, item.id))
        acc[index] = text
        i += 1
        index += 1
    final = events[-1].response
    test.assertEqual(final.id, events[0].response.id)
    test.assertEqual(len(final.output), index)
    for k, item in enumerate(final.output):
        if item.type == "message":
            test.assertEqual(item.content[0].text, acc[k])
        elif item.type == "reasoning":
            test.assertEqual(item.content[0].text, acc[k])
        else:
            test.assertEqual(item.arguments, acc[k])
    return final, acc


class Smol(unittest.TestCase):
    def chat(self, messages, max_tokens, **kw):
        return client(SMOL).chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens, **kw)

    def test_create_matches_chat(self):
        r, data = create_json(SMOL, model="m", instructions=INSTR, input="What is the capital of France?",
                              temperature=0, max_output_tokens=24, metadata={"run": "1"})
        self.assertEqual((r.object, r.model, r.metadata), ("response", "m", {"run": "1"}))
        self.assertTrue(r.id.startswith("resp_"))
        c = self.chat([{"role": "system", "content": INSTR}, {"role": "user", "content": "What is the capital of France?"}], 24)
        self.assertEqual(r.output_text, c.choices[0].message.content)
        self.assertEqual(r.usage.input_tokens, c.usage.prompt_tokens)
        self.assertEqual(r.usage.output_tokens, c.usage.completion_tokens)
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens)
        self.assertEqual(r.usage.output_tokens_details.reasoning_tokens, 0)
        truncated = c.choices[0].finish_reason == "length"
        self.assertEqual(r.status, "incomplete" if truncated else "completed")
        if truncated:
            self.assertEqual(r.incomplete_details.reason, "max_output_tokens")
        self.assertEqual([o.type for o in r.output], ["message"])
        n = client(SMOL).responses.input_tokens.count(model="m", instructions=INSTR,
                                                      input="What is the capital of France?")
        self.assertEqual((n.object, n.input_tokens), ("response.input_tokens", r.usage.input_tokens))

    def test_stream_events(self):
        kw = dict(model="m", instructions=INSTR, input="Write one short sentence about the sea.", temperature=0,
                  max_output_tokens=64)
        events = raw_events(SMOL, **kw)
        final, acc = check_sequence(self, events)
        self.assertGreater(sum(1 for e in events if e.type == "response.output_text.delta"), 1)
        self.assertEqual(final.status, "completed")  # the SDK's helper below needs response.completed
        self.assertEqual([o.type for o in final.output], ["message"])
        r, _ = create_json(SMOL, **kw)
        self.assertEqual(final.output_text, r.output_text)
        self.assertEqual((final.status, final.usage.output_tokens), (r.status, r.usage.output_tokens))
        # The SDK's own stream object and its accumulating helper agree.
        typed = list(client(SMOL).responses.create(stream=True, **kw))
        self.assertEqual([type(e) for e in typed], [type(e) for e in events])
        with client(SMOL).responses.stream(**kw) as s:
            text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
            helper = s.get_final_response()
        self.assertEqual((text, helper.output_text), (acc[0], r.output_text))

    def test_previous_response(self):
        q1, q2 = "My name is Alice and I like green tea.", "What is my name?"
        r1, raw1 = create_json(SMOL, model="m", instructions=INSTR, input=q1, temperature=0, max_output_tokens=16)
        r2, _ = create_json(SMOL, model="m", instructions=INSTR, input=[{"role": "user", "content": q2}],
                            previous_response_id=r1.id, temperature=0, max_output_tokens=16)
        self.assertEqual(r2.previous_response_id, r1.id)
        c = self.chat([{"role": "system", "content": INSTR}, {"role": "user", "content": q1},
                       {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": q2}], 16)
        self.assertEqual(r2.usage.input_tokens, c.usage.prompt_tokens)
        self.assertEqual(r2.output_text, c.choices[0].message.content)
        # Turn 2 (as the Responses request) reused at least turn 1's whole prompt.
        self.assertGreaterEqual(r2.usage.input_tokens_details.cached_tokens, r1.usage.input_tokens)
        # The input items of turn 2, newest first, validated as the SDK's ResponseItemList.
        page = client(SMOL).responses.input_items.with_raw_response.list(r2.id).http_response.json()
        lst = ResponseItemList.model_validate(page)
        self.assertEqual([(i.type, i.role) for i in lst.data],
                         [("message", "user"), ("message", "assistant"), ("message", "user")])  # no instructions
        self.assertEqual([i.content[0].text for i in lst.data], [q2, r1.output_text, q1])
        self.assertEqual(lst.data[1].id, r1.output[0].id)
        self.assertFalse(lst.has_more)
        sdk_items = list(client(SMOL).responses.input_items.list(r2.id, order="asc", limit=1))  # pages through
        self.assertEqual([i.id for i in sdk_items], [i.id for i in reversed(lst.data)])
        # retrieve / delete
        got = client(SMOL).responses.with_raw_response.retrieve(r1.id).http_response.json()
        self.assertEqual(got, raw1)
        client(SMOL).responses.delete(r1.id)
        with self.assertRaises(openai.NotFoundError):
            client(SMOL).responses.retrieve(r1.id)
        with self.assertRaises(openai.BadRequestError) as e:
            client(SMOL).responses.create(model="m", input="x", previous_response_id=r1.id)
        self.assertEqual(e.exception.code, "previous_response_not_found")
        self.assertEqual(e.exception.param, "previous_response_id")
        # store=False: nothing kept.
        r3, _ = create_json(SMOL, model="m", input="Hi", store=False, max_output_tokens=4, temperature=0)
        self.assertFalse(r3.store)
        with self.assertRaises(openai.NotFoundError):
            client(SMOL).responses.retrieve(r3.id)

    TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]

    def test_function_call(self):
        q = "What is the weather in Paris?"
        kw = dict(model="m", input=q, tools=self.TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                  temperature=0, max_output_tokens=60)
        r, _ = create_json(SMOL, **kw)
        calls = [o for o in r.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1, r.output)
        fc = calls[0]
        self.assertEqual((fc.name, fc.status), ("get_weather", "completed"))
        self.assertTrue(fc.call_id.startswith("call_") and fc.id.startswith("fc_"))
        self.assertIsInstance(json.loads(fc.arguments), dict)
        # The same call through Chat Completions (independent rendering of the same request).
        c = client(SMOL).chat.completions.create(
            model="m", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=60,
            tools=[{"type": "function", "function": {k: v for k, v in self.TOOLS[0].items() if k != "type"}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        self.assertEqual(json.loads(c.choices[0].message.tool_calls[0].function.arguments), json.loads(fc.arguments))
        # Streamed: added (arguments ""), arguments delta(s) and done, item done.
        final, acc = check_sequence(self, raw_events(SMOL, **kw))
        self.assertEqual(json.loads(final.output[-1].arguments), json.loads(fc.arguments))
        # The result goes back as function_call_output; the prompt is the chat conversation with the tool
        # turn (the output's message item, when there is one, is that turn's content).
        said = "".join(o.content[0].text for o in r.output if o.type == "message") or None
        r2, _ = create_json(SMOL, model="m", previous_response_id=r.id, tools=self.TOOLS, temperature=0,
                            max_output_tokens=24,
                            input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "22 C, sunny"}])
        c2 = client(SMOL).chat.completions.create(
            model="m", temperature=0, max_tokens=24,
            tools=[{"type": "function", "function": {k: v for k, v in self.TOOLS[0].items() if k != "type"}}],
            messages=[{"role": "user", "content": q},
                      {"role": "assistant", "content": said, "tool_calls": [
                          {"id": fc.call_id, "type": "function", "function": {"name": fc.name, "arguments": fc.arguments}}]},
                      {"role": "tool", "tool_call_id": fc.call_id, "content": "22 C, sunny"}])
        self.assertEqual(r2.usage.input_tokens, c2.usage.prompt_tokens)
        self.assertEqual(r2.output_text, c2.choices[0].message.content or "")
        # The agent way with store=False: the whole conversation resent, the output items as the SDK
        # serialises them (to_dict) -- the same prompt and answer.
        items = [{"role": "user", "content": q}] + [o.to_dict() for o in r.output] + \
                [{"type": "function_call_output", "call_id": fc.call_id, "output": "22 C, sunny"}]
        r3, _ = create_json(SMOL, model="m", input=items, tools=self.TOOLS, temperature=0, max_output_tokens=24,
                            store=False)
        self.assertEqual((r3.usage.input_tokens, r3.output_text), (r2.usage.input_tokens, r2.output_text))

    def test_bad_input(self):
        before = metric(SMOL, "fathom_generated_tokens_total")
        cases = [
            (dict(input=[{"type": "bogus_item"}]), "input[0].type"),
            (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0].type"),
            (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
            (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "?"}]), "input[0].call_id"),
            (dict(input="x", tools=self.TOOLS, tool_choice={"type": "function", "name": "absent"}), "tool_choice"),
            (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
            (dict(input="x", reasoning={"effort": "enormous"}), "reasoning.effort"),
            (dict(input="x", previous_response_id="resp_doesnotexist"), "previous_response_id"),
            (dict(input="x", max_output_tokens=0), "max_output_tokens"),
        ]
        for kw, param in cases:
            with self.assertRaises(openai.BadRequestError, msg=param) as e:
                client(SMOL).responses.create(model="m", **kw)
            self.assertEqual(e.exception.status_code, 400)
            self.assertEqual(e.exception.param, param)
        with self.assertRaises(openai.NotFoundError):
            client(SMOL).responses.retrieve("resp_doesnotexist")
        self.assertEqual(metric(SMOL, "fathom_generated_tokens_total"), before)
        r, _ = create_json(SMOL, model="m", input="Hello", max_output_tokens=3, temperature=0)
        self.assertEqual(r.usage.output_tokens, 3)


class Ds4(unittest.TestCase):
    """ds4-tiny: random weights and a byte-level vocabulary, so "<think>"/"</think>" are several tokens."""

    def setUp(self):
        if DS4 is None:
            self.skipTest("no --ds4 model")

    def chat_tokens(self, messages, max_tokens):
        return client(DS4).chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=max_tokens,
                                                   reasoning_effort="high", logprobs=True)

    def test_reasoning_item(self):
        kw = dict(model="m", input="What is 2+2?", reasoning={"effort": "high"}, temperature=0, max_output_tokens=40)
        r, _ = create_json(DS4, **kw)
        c = self.chat_tokens([{"role": "user", "content": "What is 2+2?"}], 40)
        m = c.choices[0].message
        self.assertEqual(r.reasoning.effort, "high")
        self.assertEqual(r.output[0].type, "reasoning")
        self.assertEqual(r.output[0].content[0].text, m.model_extra["reasoning_content"])
        self.assertEqual(r.output_text, m.content)
        # Reasoning tokens: the generated tokens through the one completing "</think>" (the server's
        # --reasoning-budget 6 forces it), counted from the chat API's logprobs.
        pieces = [bytes(t.bytes) for t in c.choices[0].logprobs.content]
        n = next(k for k in range(1, len(pieces) + 1) if b"</think>" in b"".join(pieces[:k]))
        self.assertEqual(r.usage.output_tokens_details.reasoning_tokens, n)
        self.assertEqual(r.usage.output_tokens, c.usage.completion_tokens)
        self.assertEqual([o.type for o in r.output], ["reasoning", "message"])
        final, acc = check_sequence(self, raw_events(DS4, **kw))
        self.assertEqual(acc[0], r.output[0].content[0].text)
        self.assertEqual(final.output_text, r.output_text)
        # reasoning none: no reasoning item.
        off, _ = create_json(DS4, model="m", input="What is 2+2?", reasoning={"effort": "none"}, temperature=0,
                             max_output_tokens=8)
        self.assertEqual([o.type for o in off.output], ["message"])
        self.assertEqual(off.usage.output_tokens_details.reasoning_tokens, 0)

    def test_continuation_drops_reasoning(self):
        th = dict(reasoning={"effort": "high"}, temperature=0)
        r1, _ = create_json(DS4, model="m", instructions="Be careful. " * 8, input="Name a colour.",
                            max_output_tokens=24, **th)
        time.sleep(1.0)  # the prompt's state is saved by the cache's I/O thread
        r2, _ = create_json(DS4, model="m", instructions="Be careful. " * 8, input="Another one.",
                            previous_response_id=r1.id, max_output_tokens=8, **th)
        c = client(DS4).chat.completions.create(
            model="m", temperature=0, max_tokens=8, reasoning_effort="high",
            messages=[{"role": "system", "content": "Be careful. " * 8}, {"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Another one."}])
        self.assertEqual(r2.usage.input_tokens, c.usage.prompt_tokens)
        self.assertEqual(r2.output[0].content[0].text, c.choices[0].message.model_extra["reasoning_content"])
        # Turn 1's prompt (ending at "<｜Assistant｜>") is a prefix of turn 2's and is reused.
        self.assertGreaterEqual(r2.usage.input_tokens_details.cached_tokens, r1.usage.input_tokens)
        # The same turn with the history resent (reasoning item included, as agents send it back).
        items = [{"role": "user", "content": "Name a colour."}] + [o.to_dict() for o in r1.output] + \
                [{"role": "user", "content": "Another one."}]
        self.assertEqual(r1.output[0].type, "reasoning")
        r3, _ = create_json(DS4, model="m", instructions="Be careful. " * 8, input=items, max_output_tokens=8,
                            store=False, **th)
        self.assertEqual((r3.usage.input_tokens, r3.output_text), (r2.usage.input_tokens, r2.output_text))


def main():
    global ARGS, SMOL, DS4
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ds4", default="")
    ap.add_argument("--threads", type=int, default=2)
    ARGS, rest = ap.parse_known_args()
    try:
        SMOL = start_server(ARGS.model, ["--ctx", "2048"])
        if ARGS.ds4:
            cache = tempfile.mkdtemp(prefix="fathom-responses-")
            DS4 = start_server(ARGS.ds4, ["--ctx", "1024", "--reasoning-budget", "6", "--prompt-cache", cache,
                                          "--prompt-cache-min-tokens", "8"])
        ok = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2).result.wasSuccessful()
    finally:
        for p in PROCS:
            p.terminate()
            p.wait(timeout=60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
