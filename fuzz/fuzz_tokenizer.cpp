// libFuzzer target: the tokenizer (src/tokenizer: special-token split, the regex pre-tokenizers, byte-level
// BPE and SentencePiece merges, byte fallback, detokenisation). Client text is arbitrary bytes. The
// vocabularies are the tokenizer suites' GGUF files in ../shared/tokenizer-tests (run from the repository
// root, as scripts/fuzz.sh does): BPE with the llama-bpe, qwen2, deepseek-v3 and gpt-2 pre-tokenizers,
// and SentencePiece. Input: the first byte picks the vocabulary and whether special-token texts are
// parsed; the rest is the text. Oracles: no crash, hang or sanitizer report; every id is in the vocabulary;
// without special parsing, decode(encode(x)) == x for every byte string (tokenizer.h's contract; SPM's
// dummy-prefix space dropped by strip_prefix_space, and a U+2581 of the text, SPM's own space, coming back
// as a space); utf8_stream over the pieces, one id at a time,
// gives the same bytes as decode().
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace {

std::vector<std::unique_ptr<fathom::tokenizer>> &vocabs() {
    static std::vector<std::unique_ptr<fathom::tokenizer>> v;
    return v;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    for (const char *name : {"llama-bpe", "qwen2", "deepseek-v3", "gpt-2", "llama-spm"}) {
        const std::string path = std::string("../shared/tokenizer-tests/ggml-vocab-") + name + ".gguf";
        try {
            vocabs().push_back(std::make_unique<fathom::tokenizer>(*fathom::gguf::file::open(path)));
        } catch (const std::exception &e) {
            std::fprintf(stderr, "fuzz_tokenizer: %s: %s (run from the repository root)\n", path.c_str(), e.what());
            std::abort();
        }
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const fathom::tokenizer &t = *vocabs()[data[0] % vocabs().size()];
    const bool parse_special = data[0] & 0x80;
    const std::string_view text(reinterpret_cast<const char *>(data + 1), size - 1);
    std::vector<int32_t> ids;
    try {
        ids = t.encode(text, false, parse_special);
    } catch (const fathom::error &) {
        __builtin_trap();  // any byte string has a tokenisation
    }
    for (int32_t id : ids)
        if (id < 0 || id >= t.n_vocab()) __builtin_trap();
    fathom::decode_options o;
    o.strip_prefix_space = t.add_space_prefix();
    const std::string back = t.decode(ids, o);
    std::string expect(text);
    if (t.model() == fathom::tokenizer::model_kind::spm)  // SentencePiece's space is U+2581 both ways
        for (size_t p = expect.find("\u2581"); p != std::string::npos; p = expect.find("\u2581", p + 1))
            expect.replace(p, 3, " ");
    if (!parse_special && back != expect) __builtin_trap();  // the round trip is exact
    fathom::utf8_stream s;
    std::string streamed;
    for (int32_t id : ids) streamed += s.push(t.token_to_piece(id));
    streamed += s.flush();
    const std::string whole = t.decode(ids);
    if (streamed != whole) __builtin_trap();  // pieces streamed one by one spell the whole decode
    return 0;
}
