#!/usr/bin/env bash
# Fuzz a parser: builds fuzz_<TARGET> with clang (libFuzzer + ASan + UBSan; the parser sources are
# instrumented too, see fuzz/CMakeLists.txt) in build-fuzz, writes a seed corpus with Fathom's own writer
# (or hand-written seeds) into a temp dir, and runs the target for N seconds. Exits non-zero on any crash, sanitizer report or leak.
#   scripts/fuzz.sh [SECONDS=60] [TARGET=gguf]
# TARGET: gguf (the GGUF reader; seeds from gguf_seeds), prompt_cache (the prompt-cache entry decoder,
# src/cache/entry.h; seeds from prompt_cache_seeds), json_schema (structured output's schema compiler
# and matcher, src/grammar; hand-written seeds: schema NUL document), chat_template (the Jinja chat
# template engine, src/chat; seeds: the templates under tests/chat/templates, and hand-written ones with
# messages after a NUL), tool_calls (the DSML stream parser and the Hermes / DSML call decoders,
# src/chat; hand-written seeds: an options byte, then model output), tokenizer (BPE and SentencePiece
# encode / decode round trips over ../shared/tokenizer-tests' vocabularies; seeds: their test strings) or
# api_request (the HTTP API's request parsers, src/server/api.cpp and responses_api.cpp: OpenAI, Anthropic,
# Responses bodies; hand-written seeds: an endpoint byte, then a body).
# Needs: clang and libclang-rt-14-dev (the libFuzzer/ASan runtimes; Debian bookworm's clang-14 gets them
# from that package).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
target="${2:-gguf}"
case "$target" in
    gguf|prompt_cache|json_schema|chat_template|tool_calls|tokenizer|api_request) ;;
    *) echo "fuzz.sh: unknown target '$target' (gguf, prompt_cache, json_schema, chat_template, tool_calls, tokenizer or api_request)" >&2; exit 2 ;;
esac
build=build-fuzz

if ! command -v clang++ >/dev/null; then
    echo "fuzz.sh: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2
    exit 1
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
      -DFATHOM_FUZZ=ON -DFATHOM_TESTS=OFF >/dev/null
seeds=()
case "$target" in gguf|prompt_cache) seeds=("${target}_seeds") ;; esac
cmake --build "$build" --target "fuzz_$target" "${seeds[@]}" -j2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/artifacts"
case "$target" in
json_schema)
    printf '{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"array","items":{"enum":["x","y"]}}},"required":["a"],"additionalProperties":false}\0{"a": -12, "b": ["x","y"]}' >"$work/corpus/object"
    printf '{"anyOf":[{"type":"string","maxLength":4},{"type":"null"}]}\0"ab\\u00e9"' >"$work/corpus/anyof"
    printf '{"$defs":{"n":{"type":"object","properties":{"c":{"$ref":"#/$defs/n"}}}},"$ref":"#/$defs/n"}\0{"c":{"c":{}}}' >"$work/corpus/ref"
    printf '{"type":["number","boolean"],"const":true}\0true' >"$work/corpus/const"
    printf '{}\0[1.5e3, {"k": null}, "s"]' >"$work/corpus/any"
    ;;
chat_template)
    for t in tests/chat/templates/*.jinja; do cp "$t" "$work/corpus/$(basename "$t")"; done
    printf '{%% for m in messages %%}{{ m.role }}: {{ m.content | trim }}{%% if not loop.last %%}\n{%% endif %%}{%% endfor %%}\0[{"role":"user","content":" hi "}]' >"$work/corpus/loop"
    printf '{%% macro f(n) %%}{{ n }}{%% if n > 0 %%}{{ f(n - 1) }}{%% endif %%}{%% endmacro %%}{{ f(3) }}{{ tools | tojson(indent=2) }}{{ "%%s-%%d" | format("a", 2) }}' >"$work/corpus/macro"
    printf '{%% set ns = namespace(x=0) %%}{%% for i in range(5) %%}{%% set ns.x = ns.x + i %%}{%% endfor %%}{{ ns.x }}{{ raise_exception("no") if ns.x > 100 }}{{ messages[-1]["content"][0].text | upper }}' >"$work/corpus/ns"
    ;;
tool_calls)
    dsml='\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="n" string="false">[1, {"a": 2}]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    printf "\x04Sure.$dsml" >"$work/corpus/dsml"
    printf "\x05thinking</think>Ok.$dsml<｜end▁of▁sentence｜>" >"$work/corpus/dsml_think"
    printf '\x06<tool_calls><invoke name="f"><parameter name="x" string="true">1</parameter></invoke>' >"$work/corpus/dsml_bare"
    printf '\0Let me check.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' >"$work/corpus/hermes"
    printf '\x02{"name": "search", "arguments": {"q": "x"}}' >"$work/corpus/hermes_json"
    ;;
tokenizer)  # a selector byte (vocabulary, special parsing), then one of the suites' test strings
    python3 - "$work/corpus" <<'PY'
import pathlib, sys
out = pathlib.Path(sys.argv[1])
for v, name in enumerate(["llama-bpe", "qwen2", "deepseek-v3", "gpt-2", "llama-spm"]):
    text = pathlib.Path(f"../shared/tokenizer-tests/ggml-vocab-{name}.gguf.inp").read_bytes()
    for i, case in enumerate(text.split(b"\n__ggml_vocab_test__\n")):
        (out / f"{name}-{i}").write_bytes(bytes([v | (0x80 if i % 4 == 0 else 0)]) + case[:4000])
PY
    ;;
api_request)  # endpoint byte: % 5 = chat, completion, messages, count_tokens, responses; & 8 = DSML tools
    printf '\0{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"temperature":0.7,"top_p":0.9,"max_tokens":16,"stop":["x"],"stream":true,"seed":3,"logprobs":true,"top_logprobs":2,"reasoning_effort":"high"}' >"$work/corpus/chat"
    printf '\x08{"messages":[{"role":"user","content":"w?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"weather","arguments":"{\\"city\\":\\"P\\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"21"}],"tools":[{"type":"function","function":{"name":"weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"tool_choice":"required","response_format":{"type":"json_schema","json_schema":{"name":"r","schema":{"type":"object"}}}}' >"$work/corpus/chat_tools"
    printf '\x01{"prompt":"Once","max_tokens":8,"min_p":0.1,"repeat_penalty":1.1,"n":1}' >"$work/corpus/completion"
    printf '\x02{"model":"m","max_tokens":32,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{"a":1}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"thinking":{"type":"enabled","budget_tokens":1024},"tool_choice":{"type":"auto"}}' >"$work/corpus/messages"
    printf '\x03{"messages":[{"role":"user","content":"count"}]}' >"$work/corpus/count"
    printf '\x04{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}],"instructions":"be brief","max_output_tokens":20,"text":{"format":{"type":"json_schema","name":"n","schema":{"type":"object"}}},"reasoning":{"effort":"low"},"store":false}' >"$work/corpus/responses"
    ;;
*)
    "$build/fuzz/${target}_seeds" "$work/corpus"
    ;;
esac
# A few hand-made edge seeds: empty, bare magic, header only.
printf '' >"$work/corpus/empty"
if [ "$target" = gguf ]; then
    printf 'GGUF' >"$work/corpus/magic"
    printf 'GGUF\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00' >"$work/corpus/header"
else
    printf 'FATHOMPC\x01\x00\x00\x00\x03\x00\x00\x00' >"$work/corpus/magic"
fi
echo "fuzz.sh: $(ls "$work/corpus" | wc -l) seeds, running fuzz_$target for ${seconds}s"

# -max_len: the largest seed is a few KiB; room to grow. The fuzzer exits non-zero on a crash and
# writes the input to artifacts/ (printed below for reproduction).
set +e
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/fuzz/fuzz_$target" "$work/corpus" -max_total_time="$seconds" -max_len=16384 -timeout=10 \
    -rss_limit_mb=2048 -artifact_prefix="$work/artifacts/" -print_final_stats=1 2>"$work/log"
rc=$?
set -e
tail -n 25 "$work/log"
if [ $rc -ne 0 ]; then
    echo "fuzz.sh: fuzz_$target FAILED (exit $rc); crashing inputs:" >&2
    for f in "$work"/artifacts/*; do
        [ -e "$f" ] || continue
        mkdir -p "$build/crashes" && cp "$f" "$build/crashes/"
        echo "  $build/crashes/$(basename "$f")  (reproduce: $build/fuzz/fuzz_$target $build/crashes/$(basename "$f"))" >&2
    done
    exit 1
fi
echo "fuzz.sh: no crash in ${seconds}s"
