#!/usr/bin/env python3
"""Generate tests/tokenizer/data/<model>.llamacpp.json: token ids that llama.cpp (through the llama_cpp Python
binding, vocab_only) produces for a set of prompts, as an independent reference for Fathom's tokenizer on the
installed models (scripts/install-models.sh) that the shared suites do not cover: Gemma3 (SPM, no dummy
prefix, 262k vocab, user-defined whitespace tokens) and SmolLM2 (BPE, pre "smollm").

Each case: {"text", "add_special", "parse_special", "ids"}. Prompts: the strings of the shared llama-bpe suite
plus chat-template and special-token strings.

Usage: python3 tests/tokenizer/gen_llamacpp_goldens.py   (needs llama_cpp and the models in <repo>/models)
"""
import json
import os

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
EXTRA = [
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<bos><eos><pad> <unk><mask>",
    "  two leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\n\nend",
    "<b>bold</b> &amp; <div class=\"x\">text</div>",
    "emoji 🦙🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "中文和日本語のテキスト、한국어도.",
    "code:\n    def f(x):\n        return x ** 2  # square\n",
    "numbers 1234567890 3.14159 -42 1e10",
    "mixed <unused5> token and <start_of_image>",
    "literal \u2581 lower-eighth block and >\u2581</ pair",
    "Ünïcödé ñ ß ø Å ﬁ ligature",
]


def main() -> None:
    inp = open(os.path.join(ROOT, "..", "shared", "tokenizer-tests", "ggml-vocab-llama-bpe.gguf.inp"),
               encoding="utf-8").read()
    texts = inp.split("\n__ggml_vocab_test__\n")[:-1] + EXTRA
    out_dir = os.path.join(ROOT, "tests", "tokenizer", "data")
    os.makedirs(out_dir, exist_ok=True)
    for name, fn in MODELS.items():
        path = os.path.join(ROOT, "models", fn)
        m = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        cases = []
        for t in texts:
            for add_special, parse_special in ((False, False), (True, True), (False, True)):
                ids = m.tokenize(t.encode("utf-8"), add_bos=add_special, special=parse_special)
                cases.append({"text": t, "add_special": add_special, "parse_special": parse_special, "ids": ids})
        doc = {"model_file": fn, "llama_cpp_python": llama_cpp.__version__, "cases": cases}
        with open(os.path.join(out_dir, name + ".llamacpp.json"), "w", encoding="utf-8") as fh:
            json.dump(doc, fh, ensure_ascii=False, indent=0)
        print("wrote %s: %d cases" % (name, len(cases)))


if __name__ == "__main__":
    main()
