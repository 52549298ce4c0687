#!/usr/bin/env python3
"""Writes a tiny random-weight llama GGUF for CLI smoke tests (no real model needed).

The tokenizer (GPT-2 BPE, 50257 tokens) is copied from ../shared/tokenizer-tests/ggml-vocab-gpt-2.gguf;
the weights are seeded random f32 (2 layers, 64-wide), so outputs are gibberish but deterministic.

usage: make_tiny_model.py VOCAB.gguf OUT.gguf
"""
import sys

import numpy as np
import gguf


def main():
    vocab_path, out_path = sys.argv[1], sys.argv[2]
    src = gguf.GGUFReader(vocab_path)
    tokens = [bytes(src.fields["tokenizer.ggml.tokens"].parts[i]) for i in src.fields["tokenizer.ggml.tokens"].data]
    types = [int(src.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in src.fields["tokenizer.ggml.token_type"].data]
    merges = [bytes(src.fields["tokenizer.ggml.merges"].parts[i]) for i in src.fields["tokenizer.ggml.merges"].data]
    def scalar(key):
        return int(src.fields[key].parts[src.fields[key].data[0]][0])
    n_vocab, n_embd, n_layer, n_head, n_ff, n_ctx = len(tokens), 64, 2, 4, 128, 256

    w = gguf.GGUFWriter(out_path, "llama")
    w.add_name("fathom-cli-tiny")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(bytes(src.fields["tokenizer.ggml.pre"].parts[-1]), "utf-8"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))

    rng = np.random.default_rng(1234)
    def rand(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", rand(n_vocab, n_embd, scale=0.2))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", rand(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", rand(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
