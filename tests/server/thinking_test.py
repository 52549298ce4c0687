#!/usr/bin/env python3
"""Thinking mode of `fathom serve` on a DS4 model, with the official OpenAI and Anthropic SDKs.

Runs against ds4-tiny (../shared/golden/ds4-tiny/ds4-tiny-a.gguf: DS4 architecture, random weights,
a 512-token byte-level vocabulary without DS4's special tokens, so "<think>" and "</think>" are
several tokens each: the multi-token case of the end-of-thinking marker). Greedy decoding, so every
request is deterministic. Checks (docs/server.md "Thinking"):
  * OpenAI: message.reasoning_content / content; the logprobs show the forced tokens: "<think>" first,
    then exactly budget sampled tokens, then "</think>" (logprob 0, no alternatives), then the answer;
    the stream's reasoning_content and content deltas equal the non-streamed message.
  * Anthropic: thinking + text blocks; the raw stream validated event by event against the documented
    sequence; the SDK's accumulated message equals the non-streamed one.
  * thinking off (reasoning_effort none, thinking disabled, no field: DS4's default): no reasoning.
  * bad input (unknown reasoning_effort, budget <= 0 or above the context, unknown thinking.type):
    400 naming the field, nothing generated, the server keeps serving.
  * the prefix cache: turn 2 (turn 1's reasoning dropped, as DS4's format requires) reuses turn 1's
    whole prompt from the disk prompt cache.

Usage: thinking_test.py --fathom build/fathom --model ../shared/golden/ds4-tiny/ds4-tiny-a.gguf
"""
import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import anthropic
import openai
from serve_util import launch  # noqa: E402  (tests/server: the script's own directory)

ARGS = None
SERVER = None  # (process, base_url, cache dir)
CTX = 1024
SYSTEM = "You are a careful assistant. " * 12  # a prompt long enough for the disk cache


def start_server():
    cache = tempfile.mkdtemp(prefix="fathom-thinking-")
    proc, url = launch([ARGS.fathom, "serve", "-m", ARGS.model, "--port", "0", "--parallel", "1", "--ctx", str(CTX),
                        "-t", str(ARGS.threads), "--prompt-cache", cache, "--prompt-cache-min-tokens", "8", "--alias",
                        "m"])
    return proc, url, cache


def metric(name):
    with urllib.request.urlopen(SERVER[1] + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def oai():
    return openai.OpenAI(base_url=SERVER[1] + "/v1", api_key="x", max_retries=0)


def ant():
    return anthropic.Anthropic(base_url=SERVER[1], api_key="x", max_retries=0)


def msgs(user):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


class Thinking(unittest.TestCase):
    def test_openai_budget_and_forced_tokens(self):
        budget, max_tokens = 6, 40
        r = oai().chat.completions.create(model="m", messages=msgs("What is 2+2?"), temperature=0,
                                          max_tokens=max_tokens, logprobs=True,
                                          extra_body={"thinking": {"type": "enabled", "budget_tokens": budget}})
        m = r.choices[0].message
        reasoning = getattr(m, "reasoning_content", None)
        if reasoning is None:
            reasoning = m.model_extra["reasoning_content"]
        toks = r.choices[0].logprobs.content
        self.assertEqual(len(toks), r.usage.completion_tokens)
        pieces = [bytes(t.bytes) for t in toks]
        joined = b"".join(pieces)
        self.assertTrue(joined.startswith(b"<think>"), joined[:20])
        n_open = next(i + 1 for i in range(len(pieces)) if b"".join(pieces[:i + 1]) == b"<think>")
        self.assertEqual(b"".join(pieces[n_open:]).find(b"</think>") >= 0, True, joined)
        for t in toks[:n_open]:
            self.assertEqual((t.logprob, t.top_logprobs), (0.0, []))  # forced
        # Exactly `budget` sampled tokens, then the forced close (ds4-tiny's greedy output for this
        # prompt does not end within max_tokens).
        self.assertEqual(r.choices[0].finish_reason, "length")
        think = pieces[n_open:n_open + budget]
        rest = b"".join(pieces[n_open + budget:])
        self.assertTrue(rest.startswith(b"</think>"), rest[:20])
        k = n_open + budget
        n_close = next(i for i in range(1, 9) if b"".join(pieces[k:k + i]) == b"</think>")
        for t in toks[k:k + n_close]:
            self.assertEqual((t.logprob, t.top_logprobs), (0.0, []))
        # Random weights emit invalid UTF-8, which the server sends as U+FFFD (one per byte, where
        # Python's decoder may merge some): compare the valid text exactly.
        def text(b):
            return b.decode("utf-8", "replace").replace("\ufffd", "")
        self.assertEqual(reasoning.replace("\ufffd", ""), text(b"".join(think)))
        self.assertEqual(m.content.replace("\ufffd", ""), text(b"".join(pieces[k + n_close:])))
        self.assertGreater(len(text(b"".join(think))), 0)
        self.assertNotIn("</think>", reasoning)
        self.assertNotIn("<think>", m.content or "")
        # The stream carries the same split: reasoning deltas first, then content.
        s = oai().chat.completions.create(model="m", messages=msgs("What is 2+2?"), temperature=0,
                                          max_tokens=max_tokens, stream=True,
                                          extra_body={"thinking": {"type": "enabled", "budget_tokens": budget}})
        sr, sc, seen_content, finish = "", "", False, None
        for ch in s:
            if not ch.choices:
                continue
            d = ch.choices[0].delta
            rc = (d.model_extra or {}).get("reasoning_content")
            if rc:
                self.assertFalse(seen_content, "reasoning after content")
                sr += rc
            if d.content:
                seen_content = True
                sc += d.content
            finish = ch.choices[0].finish_reason or finish
        self.assertEqual((sr, sc, finish), (reasoning, m.content, r.choices[0].finish_reason))

    def test_openai_thinking_off(self):
        for extra in ({"reasoning_effort": "none"}, {"thinking": {"type": "disabled"}}, {}):
            r = oai().chat.completions.create(model="m", messages=msgs("Hi"), temperature=0, max_tokens=8,
                                              extra_body=extra)
            self.assertIsNone((r.choices[0].message.model_extra or {}).get("reasoning_content"), extra)
        r = oai().chat.completions.create(model="m", messages=msgs("Hi"), temperature=0, max_tokens=8,
                                          reasoning_effort="low")
        self.assertIn("reasoning_content", r.choices[0].message.model_extra)

    def test_anthropic_events(self):
        kw = dict(model="m", max_tokens=40, system=SYSTEM, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Why is the sky blue?"}],
                  thinking={"type": "enabled", "budget_tokens": 5})
        whole = ant().messages.create(**kw)
        types = [b.type for b in whole.content]
        self.assertEqual(types[0], "thinking")
        events = list(ant().messages.create(stream=True, **kw))
        # Documented order: message_start, (ping), then per block start / deltas / stop, message_delta, message_stop.
        seq = [e.type for e in events if e.type != "ping"]
        self.assertEqual(seq[0], "message_start")
        self.assertEqual(seq[-2:], ["message_delta", "message_stop"])
        blocks, open_idx, thinking, text = [], None, "", ""
        for e in events[1:-2]:
            if e.type == "ping":
                continue
            if e.type == "content_block_start":
                self.assertIsNone(open_idx)
                self.assertEqual(e.index, len(blocks))
                open_idx = e.index
                blocks.append([e.content_block.type])
            elif e.type == "content_block_delta":
                self.assertEqual(e.index, open_idx)
                blocks[-1].append(e.delta.type)
                if e.delta.type == "thinking_delta":
                    thinking += e.delta.thinking
                if e.delta.type == "text_delta":
                    text += e.delta.text
            elif e.type == "content_block_stop":
                self.assertEqual(e.index, open_idx)
                open_idx = None
            else:
                self.fail("unexpected event " + e.type)
        self.assertIsNone(open_idx)
        self.assertEqual(blocks[0][0], "thinking")
        self.assertEqual(blocks[0][-1], "signature_delta")
        self.assertEqual(set(blocks[0][1:-1]), {"thinking_delta"})
        for b in blocks[1:]:
            self.assertEqual(b[0], "text")
            self.assertEqual(set(b[1:]), {"text_delta"})
        self.assertEqual(thinking, whole.content[0].thinking)
        self.assertEqual(text, "".join(b.text for b in whole.content if b.type == "text"))
        self.assertEqual(events[-2].delta.stop_reason, whole.stop_reason)
        # The SDK's stream helper accumulates the same message.
        with ant().messages.stream(**kw) as st:
            final = st.get_final_message()
        self.assertEqual([b.model_dump() for b in final.content], [b.model_dump() for b in whole.content])

    def test_bad_input(self):
        before = metric("fathom_generated_tokens_total")
        with self.assertRaises(openai.BadRequestError) as e:
            oai().chat.completions.create(model="m", messages=msgs("Hi"), reasoning_effort="extreme")
        self.assertIn("reasoning_effort", str(e.exception))
        for th, field in (({"type": "enabled", "budget_tokens": 0}, "budget_tokens"),
                          ({"type": "enabled", "budget_tokens": -3}, "budget_tokens"),
                          ({"type": "enabled", "budget_tokens": CTX + 1}, "budget_tokens"),
                          ({"type": "sometimes"}, "thinking.type")):
            with self.assertRaises(anthropic.BadRequestError) as e:
                ant().messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "Hi"}],
                                      thinking=th)
            self.assertIn(field, str(e.exception))
        self.assertEqual(metric("fathom_generated_tokens_total"), before)
        r = oai().chat.completions.create(model="m", messages=msgs("Hi"), temperature=0, max_tokens=4)
        self.assertEqual(r.usage.completion_tokens, 4)

    def test_second_turn_reuses_first_prompt(self):
        th = {"thinking": {"type": "enabled", "budget_tokens": 8}}
        first = msgs("Name a colour.")
        r1 = oai().chat.completions.create(model="m", messages=first, temperature=0, max_tokens=24, extra_body=th)
        time.sleep(1.0)  # the prompt's state is saved by the cache's I/O thread
        a1 = r1.choices[0].message
        turn2 = first + [{"role": "assistant", "content": a1.content,
                          "reasoning_content": a1.model_extra["reasoning_content"]},
                         {"role": "user", "content": "Another one."}]
        evaluated, hits = metric("fathom_prompt_tokens_evaluated_total"), metric("fathom_prompt_cache_disk_hits_total")
        r2 = oai().chat.completions.create(model="m", messages=turn2, temperature=0, max_tokens=8, extra_body=th)
        # Turn 1's prompt ends at "<｜Assistant｜>" ("<think>" is generated), a prefix of turn 2's prompt:
        # its state is restored and only the rest is evaluated. The slot's held state, which has turn 1's
        # reasoning, cannot be cut back that far by rollback; the state comes from the engine's RAM
        # checkpoint of turn 1's prompt (--ds4-checkpoint-mib, on by default) or, without one, from the
        # disk cache's entry of that prompt.
        self.assertLessEqual(metric("fathom_prompt_cache_disk_hits_total") - hits, 1)
        self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens)
        self.assertEqual(metric("fathom_prompt_tokens_evaluated_total") - evaluated,
                         r2.usage.prompt_tokens - r1.usage.prompt_tokens)


def main():
    global ARGS, SERVER
    ap = argparse.ArgumentParser()
    ap.add_argument("--fathom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ARGS, rest = ap.parse_known_args()
    SERVER = start_server()
    try:
        ok = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2).result.wasSuccessful()
    finally:
        SERVER[0].terminate()
        SERVER[0].wait(timeout=60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
