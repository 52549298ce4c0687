// Pre-tokenizers of byte-level BPE vocabularies: the regex splits that Hugging Face tokenizers (and llama.cpp,
// keyed by tokenizer.ggml.pre) apply before BPE, written as hand-made matchers over code points.
//
// Semantics follow HF `Split(pattern, behavior=Isolated)`: every stage cuts each current piece into its regex
// matches (leftmost, alternatives in order, greedy with backtracking) and the unmatched gaps between them; both
// become pieces, and later stages see each piece on its own (a lookahead or `$` stops at the piece's end).
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace fathom::tok_detail {

enum class pre_kind {
    gpt2,          // GPT-2 regex (gpt-2, phi-2, jina-*, mpt, olmo ...)
    llama3,        // llama-bpe / llama3: contractions, letters with one leading non-letter, digits in 1..3
    qwen2,         // as llama3 but single digits
    smollm,        // \p{N} isolated, then the GPT-2 regex
    deepseek_llm,  // DeepSeek LLM 7B: six stages
    deepseek_v3,   // DeepSeek V3 / DS4 (pre names deepseek-v3, joyai-llm): digits 1..3, CJK/kana runs, main regex
    default_bpe,   // llama.cpp's fallback for pre "default"
};

// Maps tokenizer.ggml.pre to a kind; throws fathom::error naming an unknown pre-tokenizer.
pre_kind pre_kind_from_name(std::string_view name);

// One decoded unit of the input: a code point or an invalid byte (flags of U+FFFD, like llama.cpp's
// replacement), with its byte offset in the text.
struct pre_unit {
    uint32_t cpt;
    uint32_t off;
    uint8_t flags;
};

struct pre_range {
    uint32_t begin, end;  // [begin, end) in units
};

// Reusable buffers so that repeated calls do not allocate.
struct pre_scratch {
    std::vector<pre_unit> units;  // [n_units + 1]; the last one is a sentinel holding off = text.size()
    std::vector<pre_range> a, b;
};

// Split `text` (size < 4 GiB, checked by the caller) into words. Returns byte ranges [first, second) into
// text, in order, covering the text exactly.
void pretokenize(pre_kind kind, std::string_view text, pre_scratch &scratch,
                 std::vector<std::pair<uint32_t, uint32_t>> &words);

}  // namespace fathom::tok_detail
