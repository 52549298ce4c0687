#!/usr/bin/env python3
"""Structured output of `fathom serve` (docs/server.md "Structured output"), with the official SDKs and
the `jsonschema` package as the independent validator.

Runs one model twice: a plain server (--parallel 2, so requests batch) and one with --spec ngram (drafts
that leave the grammar must be rejected by the masked verification rows). On SmolLM2 the output is
sensible JSON; on ds4-tiny (random weights) it is gibberish, which is the point: the constraint alone
must make every output parse and validate. Checks, on each server:
  * json_schema: nested objects, arrays with minItems/maxItems, enums, const, nullable anyOf, required,
    additionalProperties false, a $defs/$ref schema written by the openai SDK's own pydantic conversion
    (client.chat.completions.parse), an array root and an enum root; non-stream and stream (the deltas
    concatenated); every complete output validated with jsonschema, finish_reason "stop". The schemas
    bound the document (maxLength, maxItems, enums), so it must close within max_tokens.
  * json_object: the output is one JSON object when finish_reason is "stop".
  * max_tokens reached first: finish_reason "length" and an incomplete document (as OpenAI documents).
  * four different schemas at once (batched), each output valid.
  * Anthropic output_format, and (SmolLM2, whose Hermes tool format carries JSON arguments) forced tool
    calls: tool_choice named / required (OpenAI) and {"type": "tool"} (Anthropic); the arguments validate
    against the tool's schema.
  * bad schemas and response formats: 400 naming the field and the keyword; nothing generated (the
    generated-token counter does not move); the server keeps serving.

Usage: structured_test.py --fathom build/fathom --model MODEL.gguf [--threads 2]
"""
import argparse
import concurrent.futures
import json
import re
import subprocess
import sys
import threading
import time
import unittest
import urllib.request
from typing import List, Literal, Optional

import anthropic
import jsonschema
import openai
import pydantic
from serve_util import launch  # noqa: E402  (tests/server: the script's own directory)

ARGS = None
SERVER = None  # (process, base_url)
SPEC = False   # the running server drafts (--spec ngram)
GREEDY = {}    # schema name -> the plain server's greedy output

STR = lambda n: {"type": "string", "maxLength": n}  # noqa: E731

PERSON = {
    "type": "object",
    "properties": {
        "name": STR(16),
        "age": {"type": "integer"},
        "height_m": {"type": "number"},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "nickname": {"anyOf": [STR(10), {"type": "null"}]},
        "address": {
            "type": "object",
            "properties": {"city": STR(20), "zip": {"type": "string", "minLength": 5, "maxLength": 5},
                           "country": {"const": "FR"}},
            "required": ["city", "zip", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": STR(8), "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "member", "role", "nickname", "address", "tags"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 2}},
              "required": ["id", "ok"], "additionalProperties": False},
    "minItems": 1, "maxItems": 3,
}
ANSWER = {"enum": ["yes", "no", "maybe", 42, None]}
OPTIONAL_ONLY = {"type": "object", "properties": {"a": {"type": ["integer", "null"]}, "b": STR(6)},
                 "additionalProperties": False}
SCHEMAS = {"person": PERSON, "items": ITEMS, "answer": ANSWER, "optional": OPTIONAL_ONLY}


def start_server(extra=()):
    return launch([ARGS.fathom, "serve", "-m", ARGS.model, "--port", "0", "--parallel", "2", "--ctx", "4096",
                   "-t", str(ARGS.threads), "--alias", "m", *extra])


def metric(name):
    with urllib.request.urlopen(SERVER[1] + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


def oai():
    return openai.OpenAI(base_url=SERVER[1] + "/v1", api_key="x", max_retries=0, timeout=600)


def ant():
    return anthropic.Anthropic(base_url=SERVER[1], api_key="x", max_retries=0, timeout=600)


def fmt(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(what):
    return [{"role": "system", "content": "You answer with JSON only."},
            {"role": "user", "content": f"Give me {what} as JSON."}]


class Structured(unittest.TestCase):
    def check(self, text, schema, finish):
        self.assertEqual(finish, "stop", f"the document did not close: {text!r}")
        value = json.loads(text)  # must parse
        jsonschema.validate(value, schema)  # must validate (raises with the reason)
        return value

    def chat(self, schema_name, temperature, seed, stream=False, max_tokens=1500):
        kw = dict(model="m", messages=ask(f"a {schema_name}"), max_tokens=max_tokens, temperature=temperature,
                  seed=seed, response_format=fmt(schema_name, SCHEMAS[schema_name]))
        if not stream:
            r = oai().chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        for ch in oai().chat.completions.create(stream=True, **kw):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        return text, finish

    def test_schemas_non_stream_and_stream(self):
        for name, schema in SCHEMAS.items():
            for temperature, seed in ((0.0, 1), (1.0, 11), (1.0, 12)):
                for stream in (False, True):
                    with self.subTest(schema=name, temperature=temperature, seed=seed, stream=stream):
                        text, finish = self.chat(name, temperature, seed, stream)
                        self.check(text, schema, finish)

    def test_stream_equals_non_stream(self):
        a = self.chat("person", 0.0, 3, stream=False)
        b = self.chat("person", 0.0, 3, stream=True)
        self.assertEqual(a, b)

    def test_sdk_parse_with_pydantic_models(self):
        class Address(pydantic.BaseModel):
            city: str = pydantic.Field(max_length=20)
            kind: Literal["home", "work"]

        class Contact(pydantic.BaseModel):
            name: str = pydantic.Field(max_length=16)
            emails: List[str] = pydantic.Field(max_length=2)
            address: Address
            score: Optional[float]

        # The SDK writes the strict schema itself ($defs, $ref, anyOf for Optional, additionalProperties
        # false) and parses the reply back into the model.
        for seed in (1, 2, 3):
            r = oai().chat.completions.parse(model="m", messages=ask("a contact"), response_format=Contact,
                                             max_tokens=1500, temperature=1.0, seed=seed)
            self.assertEqual(r.choices[0].finish_reason, "stop")
            self.assertIsInstance(r.choices[0].message.parsed, Contact)
            jsonschema.validate(json.loads(r.choices[0].message.content), Contact.model_json_schema())

    def test_greedy_speculation_same_output(self):
        # Greedy decoding under a constraint: the --spec server's output equals the plain server's (the
        # plain run records it), as speculation promises the same tokens.
        for name in ("person", "items"):
            text, finish = self.chat(name, 0.0, 1)
            self.check(text, SCHEMAS[name], finish)
            if SPEC:
                self.assertEqual(text, GREEDY[name])
            else:
                GREEDY[name] = text

    def test_thinking_then_document(self):
        if ARGS.tools != "dsml":
            self.skipTest("thinking mode is DS4's")
        schema = SCHEMAS["optional"]
        for stream in (False, True):
            kw = dict(model="m", messages=ask("a pair"), max_tokens=600, temperature=1.0, seed=4,
                      response_format=fmt("pair", schema), extra_body={"thinking": {"type": "enabled", "budget_tokens": 12}})
            if stream:
                reasoning, text, finish = "", "", None
                for ch in oai().chat.completions.create(stream=True, **kw):
                    d = ch.choices[0].delta if ch.choices else None
                    reasoning += (getattr(d, "reasoning_content", None) or "") if d else ""
                    text += (d.content or "") if d else ""
                    if ch.choices and ch.choices[0].finish_reason:
                        finish = ch.choices[0].finish_reason
            else:
                r = oai().chat.completions.create(**kw)
                m = r.choices[0].message
                reasoning, text, finish = m.reasoning_content, m.content, r.choices[0].finish_reason
            self.assertTrue(reasoning)  # the thinking is free text; the document follows it
            self.check(text, schema, finish)

    def test_json_object(self):
        for temperature, seed in ((0.0, 1), (1.0, 5)):
            for stream in (False, True):
                kw = dict(model="m", messages=ask("a city with its population"), max_tokens=300,
                          temperature=temperature, seed=seed, response_format={"type": "json_object"})
                if stream:
                    text, finish = "", None
                    for ch in oai().chat.completions.create(stream=True, **kw):
                        if ch.choices and ch.choices[0].delta.content:
                            text += ch.choices[0].delta.content
                        if ch.choices and ch.choices[0].finish_reason:
                            finish = ch.choices[0].finish_reason
                else:
                    r = oai().chat.completions.create(**kw)
                    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
                self.assertTrue(text.startswith("{"), text)
                if finish == "stop":  # an unbounded document may also run to max_tokens
                    self.assertIsInstance(json.loads(text), dict)
                else:
                    self.assertEqual(finish, "length")

    def test_max_tokens_first_gives_length(self):
        for stream in (False, True):
            text, finish = self.chat("person", 1.0, 7, stream=stream, max_tokens=4)
            self.assertEqual(finish, "length")
            self.assertTrue(text.startswith("{"), text)
            with self.assertRaises(json.JSONDecodeError):
                json.loads(text)

    def test_batched_requests(self):
        names = ["person", "items", "answer", "optional"]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda n: self.chat(n, 1.0, 21), names))
        for n, (text, finish) in zip(names, outs):
            self.check(text, SCHEMAS[n], finish)

    def test_anthropic_output_format(self):
        for seed in (1, 2):
            r = ant().messages.create(model="m", max_tokens=1500, messages=[{"role": "user", "content": "A person?"}],
                                      extra_body={"output_format": {"type": "json_schema", "schema": PERSON},
                                                  "seed": seed, "temperature": 1.0})
            self.assertEqual(r.stop_reason, "end_turn")
            jsonschema.validate(json.loads(r.content[-1].text), PERSON)

    def test_anthropic_output_format_stream(self):
        text, stop = "", None
        for ev in ant().messages.create(model="m", max_tokens=1500, messages=[{"role": "user", "content": "Items?"}],
                                        stream=True, extra_body={"output_format": {"type": "json_schema", "schema": ITEMS},
                                                                 "seed": 3, "temperature": 1.0}):
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                text += ev.delta.text
            if ev.type == "message_delta":
                stop = ev.delta.stop_reason
        self.assertEqual(stop, "end_turn")
        jsonschema.validate(json.loads(text), ITEMS)

    def test_logprobs_only_allowed_alternatives(self):
        # The enum root allows a handful of first tokens: fewer than top_logprobs; the alternatives the
        # grammar excluded are not reported, and every reported logprob is a finite number.
        r = oai().chat.completions.create(model="m", messages=ask("an answer"), max_tokens=50, temperature=0.0,
                                          logprobs=True, top_logprobs=20, response_format=fmt("a", ANSWER))
        self.check(r.choices[0].message.content, ANSWER, r.choices[0].finish_reason)
        for t in r.choices[0].logprobs.content:
            self.assertTrue(-1e30 < t.logprob <= 0.0, t)
            for alt in t.top_logprobs:
                self.assertTrue(-1e30 < alt.logprob <= 0.0, alt)
        self.assertLess(len(r.choices[0].logprobs.content[0].top_logprobs), 20)

    def test_forced_tool_calls(self):
        if ARGS.tools != "hermes":
            self.skipTest("this model's tool format (DSML) does not carry the arguments as one JSON value")
        weather = {"type": "object", "properties": {"city": STR(20), "days": {"type": "integer"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "days", "unit"], "additionalProperties": False}
        clock = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                 "additionalProperties": False}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
                 {"type": "function", "function": {"name": "get_time", "parameters": clock}}]
        schemas = {"get_weather": weather, "get_time": clock}
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            for seed in (1, 2):
                r = oai().chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                                  tools=tools, tool_choice=choice, max_tokens=400, temperature=1.0,
                                                  seed=seed)
                calls = r.choices[0].message.tool_calls
                self.assertEqual(r.choices[0].finish_reason, "tool_calls")
                self.assertEqual(len(calls), 1)
                if isinstance(choice, dict):
                    self.assertEqual(calls[0].function.name, "get_weather")
                jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])
        r = ant().messages.create(model="m", max_tokens=400, messages=[{"role": "user", "content": "Time?"}],
                                  tools=[{"name": "get_time", "input_schema": clock},
                                         {"name": "get_weather", "input_schema": weather}],
                                  tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 1.0})
        self.assertEqual(r.stop_reason, "tool_use")
        use = [b for b in r.content if b.type == "tool_use"]
        self.assertEqual(len(use), 1)
        jsonschema.validate(use[0].input, clock)

    def test_bad_schemas_are_400(self):
        cases = [
            ({"type": "string", "pattern": "^a"}, "pattern"),
            ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "minimum"),
            ({"type": "objekt"}, "objekt"),
            ({"anyOf": [{"type": "object"}, {"type": "object", "properties": {}}]}, "anyOf"),
            ({"$ref": "#/$defs/nope"}, "$ref"),
            ({"type": "array", "items": [{"type": "string"}]}, "items"),
            ({"type": "array", "minItems": 5, "maxItems": 1}, "minItems"),
            ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ]
        before = metric("fathom_generated_tokens_total")
        for schema, keyword in cases:
            with self.subTest(keyword=keyword):
                with self.assertRaises(openai.BadRequestError) as cm:
                    oai().chat.completions.create(model="m", messages=ask("x"), max_tokens=8,
                                                  response_format=fmt("x", schema))
                err = cm.exception.body
                self.assertIn(keyword, err["message"])
                self.assertEqual(err["param"], "response_format.json_schema.schema")
        for rf, param in (({"type": "xml"}, "response_format.type"),
                          ({"type": "json_schema"}, "response_format.json_schema"),
                          ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
                          ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
                           "response_format.json_schema.name")):
            with self.assertRaises(openai.BadRequestError) as cm:
                oai().chat.completions.create(model="m", messages=ask("x"), max_tokens=8, response_format=rf)
            self.assertEqual(cm.exception.body["param"], param)
        with self.assertRaises(anthropic.BadRequestError) as cm:
            ant().messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                                  extra_body={"output_format": {"type": "json_schema",
                                                                "schema": {"type": "number", "multipleOf": 2}}})
        self.assertIn("multipleOf", str(cm.exception))
        if ARGS.tools == "hermes":
            with self.assertRaises(openai.BadRequestError) as cm:
                oai().chat.completions.create(
                    model="m", messages=ask("x"), max_tokens=8,
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {
                        "type": "object", "properties": {"s": {"type": "string", "pattern": "x"}}}}}],
                    tool_choice={"type": "function", "function": {"name": "f"}})
            self.assertIn("pattern", cm.exception.body["message"])
            self.assertIn("'f'", cm.exception.body["message"])
        self.assertEqual(metric("fathom_generated_tokens_total"), before)  # nothing generated
        text, finish = self.chat("answer", 0.0, 1)  # still serving
        self.check(text, ANSWER, finish)


def main():
    global ARGS, SERVER, SPEC
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tools", default="hermes", help="the model's tool format: hermes (dense) or dsml (DS4)")
    ap.add_argument("--threads", type=int, default=2)
    ARGS, rest = ap.parse_known_args()
    ok = True
    for extra in ((), ("--spec", "ngram")):
        SPEC = bool(extra)
        SERVER = start_server(extra)
        try:
            print(f"== {ARGS.model} {' '.join(extra) or '(no speculation)'}", flush=True)
            res = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2).result
            ok = ok and res.wasSuccessful()
            if SPEC:
                drafted = metric("fathom_spec_drafted_tokens_total")
                print(f"speculation: {drafted:.0f} drafted, {metric('fathom_spec_accepted_tokens_total'):.0f} kept")
                if drafted <= 0:
                    print("FAIL: the --spec server drafted nothing", file=sys.stderr)
                    ok = False
        finally:
            SERVER[0].terminate()
            SERVER[0].wait(timeout=60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
