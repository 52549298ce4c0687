// Fathom's tokenizer: text <-> token ids for the vocabularies stored in GGUF metadata (tokenizer.ggml.*).
//
//   model "gpt2"  -> byte-level BPE: special-token split, regex pre-tokenizer chosen by tokenizer.ggml.pre
//                    (pretokenize.h), bytes mapped to GPT-2's printable code points, merges by rank.
//   model "llama" -> SentencePiece BPE (SPM): spaces escaped to U+2581, optional dummy-prefix space,
//                    highest-score-first merges, byte fallback <0xNN>.
//
// Behaviour matches llama.cpp's llama-vocab.cpp (tokenize / token_to_piece / detokenize), which the suites in
// ../shared/tokenizer-tests pin down. Differences, by design: input bytes that are not valid UTF-8 are kept as
// single bytes (llama.cpp replaces them by U+FFFD before BPE), so decode(encode(x)) == x for every byte string
// (SPM: a U+2581 of x, SentencePiece's escaped space, decodes as a space, as in llama.cpp and sentencepiece;
// checked by fuzz/fuzz_tokenizer.cpp); and decode() never applies clean_up_tokenization_spaces.
//
// A tokenizer is immutable after construction; all const members are safe to call from several threads.
// It copies what it needs, so the gguf::file may be closed afterwards.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fathom::gguf {
class file;
}

namespace fathom {

// GGUF token types (tokenizer.ggml.token_type).
enum class token_type : int32_t {
    undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6,
};

inline constexpr int32_t token_null = -1;  // "no such token" (absent special id, failed lookup)

struct decode_options {
    // Control/unknown tokens render as their text (true) or as nothing (false), like llama.cpp's `special`.
    bool render_special = true;
    // Drop one leading space of the first piece when the vocab adds a dummy prefix (SPM add_space_prefix),
    // i.e. undo what encode() added: use it when decoding a whole prompt, not a continuation.
    bool strip_prefix_space = false;
};

class tokenizer {
public:
    enum class model_kind { bpe, spm };

    // Reads tokenizer.ggml.* from `f`. Throws fathom::error naming the key for missing/ill-typed metadata,
    // an unknown tokenizer.ggml.model or tokenizer.ggml.pre, or out-of-range special ids.
    explicit tokenizer(const gguf::file &f);
    ~tokenizer();
    tokenizer(tokenizer &&) noexcept;
    tokenizer &operator=(tokenizer &&) noexcept;

    // Text -> ids. add_special: prepend BOS / append EOS as add_bos()/add_eos() say. parse_special: control
    // (and unknown) token texts in `text` become their ids; user-defined tokens are always matched (as in
    // llama.cpp and Hugging Face's added tokens).
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

    // Raw bytes of one token: byte tokens <0xNN> -> that byte, byte-level BPE code points -> bytes,
    // SPM U+2581 -> ' '. Control/unknown tokens give their text if render_special, else "". May be an
    // incomplete UTF-8 sequence (see utf8_stream). Throws on an out-of-range id.
    std::string token_to_piece(int32_t id, bool render_special = true) const;
    // Concatenated pieces (no clean-up of spaces). Throws on an out-of-range id.
    std::string decode(std::span<const int32_t> ids, decode_options opt = {}) const;

    // Vocabulary.
    int32_t n_vocab() const;
    model_kind model() const;
    const std::string &pre_name() const;  // tokenizer.ggml.pre ("default" when absent)
    std::string_view token_text(int32_t id) const;  // as stored in the GGUF (throws on bad id)
    token_type type(int32_t id) const;              // after llama.cpp's control-token fix-ups (see .cpp)
    float score(int32_t id) const;
    int32_t find_token(std::string_view text) const;  // exact text lookup, token_null if none

    // Special ids (token_null when the vocab has none).
    int32_t bos() const;
    int32_t eos() const;
    int32_t eot() const;
    int32_t eom() const;
    int32_t pad() const;
    int32_t unk() const;
    int32_t nl() const;  // the token of "\n"
    bool is_eog(int32_t id) const;  // end of generation: eos, eot, eom and the end-of-turn tokens found by text
    const std::vector<int32_t> &eog_ids() const;
    bool is_control(int32_t id) const;

    bool add_bos() const;
    bool add_eos() const;
    bool add_space_prefix() const;

    struct impl;

private:
    std::unique_ptr<impl> p_;
};

// Streaming detokenisation: feed token pieces, get back only whole UTF-8 characters. Bytes that cannot start
// or continue a valid sequence are passed through at once (waiting cannot fix them).
class utf8_stream {
public:
    // Returns the complete prefix of (held bytes + bytes); holds back at most 3 bytes of an unfinished character.
    std::string push(std::string_view bytes);
    // Returns whatever is held (an unfinished sequence, as raw bytes) and resets.
    std::string flush();
    size_t pending() const { return held_.size(); }

private:
    std::string held_;
};

}  // namespace fathom
