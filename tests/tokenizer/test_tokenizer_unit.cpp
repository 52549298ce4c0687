// Unit tests of the tokenizer: utf8_stream, byte tokens, special-token parsing, special ids, pre-tokenizer
// splits worked out by hand from the regexes, error paths, and the 1 MB encode speed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <ctime>

#include "tokenizer/pretokenize.h"
#include "tokenizer/unicode.h"
#include "tokenizer_test_util.h"

namespace fathom::test {
namespace {

// ---- utf8_stream ------------------------------------------------------------------------------------------

TEST(Utf8Stream, HoldsSplitCharacters) {
    utf8_stream s;
    EXPECT_EQ(s.push("a\xC3"), "a");  // é = C3 A9
    EXPECT_EQ(s.pending(), 1u);
    EXPECT_EQ(s.push("\xA9z"), "\xC3\xA9z");
    // 🦙 = F0 9F A6 99, one byte at a time
    EXPECT_EQ(s.push("\xF0"), "");
    EXPECT_EQ(s.push("\x9F"), "");
    EXPECT_EQ(s.push("\xA6"), "");
    EXPECT_EQ(s.push("\x99"), "\xF0\x9F\xA6\x99");
    EXPECT_EQ(s.pending(), 0u);
    EXPECT_EQ(s.flush(), "");
}

TEST(Utf8Stream, PassesInvalidBytesThrough) {
    utf8_stream s;
    EXPECT_EQ(s.push("\xFF"), "\xFF");          // never valid
    EXPECT_EQ(s.push("\x80x"), "\x80x");        // stray continuation
    EXPECT_EQ(s.push("\xE0\x80"), "\xE0\x80");  // overlong prefix can never complete
    EXPECT_EQ(s.push("\xED\xA0"), "\xED\xA0");  // surrogate prefix
    EXPECT_EQ(s.push("\xC3\xC3"), "\xC3");      // first lead is dead, second may still complete
    EXPECT_EQ(s.flush(), "\xC3");               // flush hands back the unfinished tail
    EXPECT_EQ(s.pending(), 0u);
}

TEST(Utf8Stream, StreamsTokenPiecesOfEmoji) {
    // Byte-level BPE splits emoji into byte tokens; the stream must only emit whole characters.
    const tokenizer &tok = vocab("llama-bpe");
    const std::string text = "hi 🦙🦙 ok";
    const auto ids = tok.encode(text, false, false);
    utf8_stream s;
    std::string out;
    for (int32_t id : ids) {
        const std::string chunk = s.push(tok.token_to_piece(id));
        // every emitted chunk is valid UTF-8 on its own
        for (size_t pos = 0; pos < chunk.size();) {
            const auto u = unicode::utf8_decode(chunk, pos);
            ASSERT_NE(u.cpt, unicode::k_invalid_cpt) << "chunk split a character";
            pos += u.len;
        }
        out += chunk;
    }
    out += s.flush();
    EXPECT_EQ(out, text);
}

// ---- byte tokens and pieces -------------------------------------------------------------------------------

TEST(Pieces, SpmByteTokensAndSpaces) {
    const tokenizer &tok = vocab("llama-spm");
    // The SPM vocab lays out <0x00>..<0xFF> at ids 3..258.
    EXPECT_EQ(tok.token_text(3 + 0x0A), "<0x0A>");
    EXPECT_EQ(tok.type(3 + 0x0A), token_type::byte);
    EXPECT_EQ(tok.token_to_piece(3 + 0x0A), "\n");
    EXPECT_EQ(tok.token_to_piece(3 + 0xE2), "\xE2");
    EXPECT_EQ(tok.nl(), 3 + 0x0A);
    // "▁" -> " "
    const int32_t space = tok.find_token("\xE2\x96\x81");
    ASSERT_GE(space, 0);
    EXPECT_EQ(tok.token_to_piece(space), " ");
    // A character without a token falls back to its bytes: " \x01" -> [▁, <0x01>]
    EXPECT_EQ(tok.encode("\x01", false, false), (std::vector<int32_t>{space, 3 + 0x01}));
    // Control tokens render only on request.
    EXPECT_EQ(tok.token_to_piece(tok.bos()), "<s>");
    EXPECT_EQ(tok.token_to_piece(tok.bos(), false), "");
}

TEST(Pieces, ByteLevelBpeMapping) {
    const tokenizer &tok = vocab("gpt-2");
    // GPT-2: 220 is "Ġ" (space), 198 is "Ċ" (newline), 0 is "!".
    EXPECT_EQ(tok.token_text(220), "\xC4\xA0");
    EXPECT_EQ(tok.token_to_piece(220), " ");
    EXPECT_EQ(tok.token_to_piece(198), "\n");
    EXPECT_EQ(tok.token_to_piece(0), "!");
    EXPECT_EQ(tok.nl(), 198);
    EXPECT_EQ(tok.encode(" ", false, false), std::vector<int32_t>{220});
}

TEST(Pieces, InvalidUtf8RoundTrips) {
    for (const char *name : {"gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "deepseek-llm", "llama-spm"}) {
        const tokenizer &tok = vocab(name);
        // Stray continuation byte, truncated sequences, NUL. (Not C0, C1, F5..FF, bytes that never occur in
        // UTF-8: deepseek-llm maps them to user-defined tokens such as "ÿ", which render as the character,
        // as in llama.cpp and HF.)
        const std::string text = std::string("ok \x80\xC3 x\xE2\x82", 9) + std::string(1, '\0') + "z";
        decode_options opt;
        opt.strip_prefix_space = true;
        EXPECT_EQ(tok.decode(tok.encode(text, false, false), opt), text) << name;
    }
}

TEST(Pieces, RandomBytesRoundTrip) {
    // Random byte strings (see InvalidUtf8RoundTrips for the bytes left out) mixed with special-token texts, UTF-8
    // characters and whitespace runs: decode(encode(x)) == x without special parsing; with it, every id is
    // in range and decoding does not fail.
    const std::string atoms[] = {"<|endoftext|>", "<s>", "</s>", "<|im_start|>", "é", "中", "🦙", "  ", "\n\n", "\t",
                                 "'s", "123"};  // not a literal U+2581 or "<0x41>": SPM reads those as its own
                                                // space / byte tokens (as llama.cpp), so they cannot round-trip
    uint32_t x = 987654321;
    auto next = [&x]() { return (x = x * 1664525u + 1013904223u) >> 8; };
    for (const char *name : {"gpt-2", "llama-bpe", "qwen2", "deepseek-v3", "deepseek-llm", "llama-spm", "phi-3"}) {
        const tokenizer &tok = vocab(name);
        decode_options opt;
        opt.strip_prefix_space = true;
        for (int iter = 0; iter < 150; ++iter) {
            std::string text;
            const uint32_t n = next() % 24;
            for (uint32_t k = 0; k < n; ++k) {
                if (next() % 3 == 0) {
                    text += atoms[next() % (sizeof(atoms) / sizeof(atoms[0]))];
                } else {
                    // skip C0, C1, F5..FF: never in UTF-8, and deepseek-llm maps them to user-defined tokens
                    uint32_t b = next() % 0xF5;
                    if (b == 0xC0 || b == 0xC1) b = 'x';
                    text += static_cast<char>(b);
                }
            }
            // Phi-3's user-defined "</s>" eats the whitespace after it (llama.cpp RSTRIP), even as plain text.
            if (std::string_view(name) != "phi-3") {
                ASSERT_EQ(tok.decode(tok.encode(text, false, false), opt), text) << name << " iter " << iter;
            }
            for (int32_t id : tok.encode(text, true, true)) ASSERT_TRUE(id >= 0 && id < tok.n_vocab());
        }
    }
}

TEST(Pieces, OutOfRangeIdsThrow) {
    const tokenizer &tok = vocab("gpt-2");
    EXPECT_THROW(tok.token_to_piece(-1), fathom::error);
    EXPECT_THROW(tok.token_to_piece(tok.n_vocab()), fathom::error);
    const std::vector<int32_t> bad = {0, 50257};
    EXPECT_THROW(tok.decode(bad), fathom::error);
}

// ---- special tokens ---------------------------------------------------------------------------------------

TEST(Special, ParseSpecialControlTokens) {
    const tokenizer &tok = vocab("llama-bpe");
    const int32_t hi = tok.find_token("hi");
    ASSERT_GE(hi, 0);
    EXPECT_EQ(tok.encode("<|begin_of_text|>hi<|eot_id|>", false, true),
              (std::vector<int32_t>{128000, hi, 128009}));
    // Without parse_special the text is ordinary text.
    const auto plain = tok.encode("<|begin_of_text|>hi", false, false);
    EXPECT_EQ(std::count(plain.begin(), plain.end(), 128000), 0);
    EXPECT_EQ(tok.decode(plain), "<|begin_of_text|>hi");
    // add_special prepends BOS (llama-bpe adds BOS by default).
    EXPECT_TRUE(tok.add_bos());
    EXPECT_EQ(tok.encode("hi", true, false), (std::vector<int32_t>{128000, hi}));
    EXPECT_EQ(tok.encode("", true, false), std::vector<int32_t>{128000});
    EXPECT_TRUE(tok.encode("", false, false).empty());
}

TEST(Special, LongestTokenWins) {
    // Qwen2: "<|im_start|>" must not be cut by a shorter special token; adjacent specials split cleanly.
    const tokenizer &tok = vocab("qwen2");
    EXPECT_EQ(tok.encode("<|im_start|><|im_end|><|endoftext|>", false, true),
              (std::vector<int32_t>{151644, 151645, 151643}));
}

TEST(Special, UserDefinedAlwaysMatched) {
    // deepseek-llm stores 'ø' (id 100002) as a user-defined token: matched even without parse_special.
    const tokenizer &tok = vocab("deepseek-llm");
    ASSERT_EQ(tok.token_text(100002), "ø");
    ASSERT_EQ(tok.type(100002), token_type::user_defined);
    EXPECT_EQ(tok.encode("ø", false, false), std::vector<int32_t>{100002});
    // A control token is not matched without parse_special.
    const auto ids = tok.encode("<｜end▁of▁sentence｜>", false, false);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), 100001), 0);
    EXPECT_EQ(tok.encode("<｜end▁of▁sentence｜>", false, true), std::vector<int32_t>{100001});
}

TEST(Special, Phi3SpecialTokensEatFollowingSpaces) {
    // llama.cpp marks Phi-3's special tokens RSTRIP (by model name): "<|assistant|> hi" == "<|assistant|>hi".
    const tokenizer &tok = vocab("phi-3");
    const auto a = tok.encode("<|user|>\n hi<|end|>", false, true);
    const auto b = tok.encode("<|user|>hi<|end|>", false, true);
    EXPECT_EQ(a, b);
    ASSERT_FALSE(a.empty());
    EXPECT_EQ(a.front(), tok.find_token("<|user|>"));
    EXPECT_EQ(a.back(), 32007);
    // SPM: after a special token the dummy-prefix space is added again: "hi" -> "▁hi".
    EXPECT_EQ(a[1], tok.find_token("\xE2\x96\x81hi"));
}

TEST(Special, IdsAndEog) {
    const tokenizer &l3 = vocab("llama-bpe");
    EXPECT_EQ(l3.bos(), 128000);
    EXPECT_EQ(l3.eos(), 128001);
    EXPECT_EQ(l3.eot(), 128009);  // "<|eot_id|>", found by text
    EXPECT_TRUE(l3.is_eog(128001));
    EXPECT_TRUE(l3.is_eog(128009));
    EXPECT_FALSE(l3.is_eog(128000));
    EXPECT_EQ(l3.model(), tokenizer::model_kind::bpe);

    const tokenizer &qw = vocab("qwen2");
    EXPECT_EQ(qw.eos(), 151645);
    EXPECT_EQ(qw.pad(), 151643);
    EXPECT_EQ(qw.bos(), token_null);
    EXPECT_FALSE(qw.add_bos());
    EXPECT_TRUE(qw.is_eog(151643));  // <|endoftext|>
    EXPECT_TRUE(qw.is_eog(151645));  // <|im_end|>

    const tokenizer &ds = vocab("deepseek-v3");
    EXPECT_EQ(ds.bos(), 0);
    EXPECT_EQ(ds.eos(), 1);
    EXPECT_TRUE(ds.add_bos());
    EXPECT_TRUE(ds.is_eog(1));

    const tokenizer &spm = vocab("llama-spm");
    EXPECT_EQ(spm.model(), tokenizer::model_kind::spm);
    EXPECT_EQ(spm.unk(), 0);
    EXPECT_TRUE(spm.add_space_prefix());
    EXPECT_EQ(spm.encode("", true, false), std::vector<int32_t>{1});
}

// ---- pre-tokenizers, worked by hand from the regexes -------------------------------------------------------

std::vector<std::string> split(tok_detail::pre_kind k, const std::string &text) {
    tok_detail::pre_scratch s;
    std::vector<std::pair<uint32_t, uint32_t>> w;
    tok_detail::pretokenize(k, text, s, w);
    std::vector<std::string> out;
    for (auto [b, e] : w) out.push_back(text.substr(b, e - b));
    return out;
}
using sv = std::vector<std::string>;
using tok_detail::pre_kind;

TEST(PreTokenize, Gpt2) {
    EXPECT_EQ(split(pre_kind::gpt2, "Hello world"), (sv{"Hello", " world"}));
    EXPECT_EQ(split(pre_kind::gpt2, "a  b"), (sv{"a", " ", " b"}));          // \s+(?!\S) leaves one space
    EXPECT_EQ(split(pre_kind::gpt2, "don't DON'T"), (sv{"don", "'t", " DON", "'", "T"}));  // case-sensitive
    EXPECT_EQ(split(pre_kind::gpt2, "x 123!! \n"), (sv{"x", " 123", "!!", " \n"}));
}

TEST(PreTokenize, Llama3AndQwen2) {
    EXPECT_EQ(split(pre_kind::llama3, "DON'T 1234567"), (sv{"DON", "'T", " ", "123", "456", "7"}));
    EXPECT_EQ(split(pre_kind::qwen2, "x12"), (sv{"x", "1", "2"}));
    EXPECT_EQ(split(pre_kind::llama3, "\n\n  x"), (sv{"\n\n", " ", " x"}));  // \s*[\r\n]+ then \s+(?!\S)
    EXPECT_EQ(split(pre_kind::llama3, "(hi) ...\n\n"), (sv{"(hi", ")", " ...\n\n"}));
    EXPECT_EQ(split(pre_kind::llama3, "\thi"), (sv{"\thi"}));  // one non-letter may lead a letter run
}

TEST(PreTokenize, DeepseekV3) {
    EXPECT_EQ(split(pre_kind::deepseek_v3, "中文abc12345"), (sv{"中文", "abc", "123", "45"}));
    EXPECT_EQ(split(pre_kind::deepseek_v3, "x,y"), (sv{"x", ",y"}));   // ASCII punct + ASCII letters
    EXPECT_EQ(split(pre_kind::deepseek_v3, "é!!"), (sv{"é", "!!"}));
    EXPECT_EQ(split(pre_kind::deepseek_v3, "ひらがなカタ"), (sv{"ひらがなカタ"}));
}

TEST(PreTokenize, DeepseekLlm) {
    EXPECT_EQ(split(pre_kind::deepseek_llm, "Hi there\nok  "), (sv{"Hi", " there", "\n", "ok", "  "}));
    EXPECT_EQ(split(pre_kind::deepseek_llm, "a 1234"), (sv{"a", " ", "1234"}));
}

TEST(PreTokenize, LongInputsAreLinear) {
    // 200k spaces followed by a letter, and 200k digits: must not go quadratic.
    const std::string spaces(200000, ' ');
    for (pre_kind k : {pre_kind::gpt2, pre_kind::llama3, pre_kind::deepseek_v3, pre_kind::deepseek_llm}) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto w = split(k, spaces + "x");
        EXPECT_GE(w.size(), 1u);
        const auto w2 = split(k, std::string(200000, '7'));
        EXPECT_GE(w2.size(), 1u);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_LT(s, 1.0);
    }
}

TEST(PreTokenize, UnknownPreNameThrows) {
    try {
        tok_detail::pre_kind_from_name("no-such-pre");
        FAIL() << "expected an error";
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find("no-such-pre"), std::string::npos);
    }
}

TEST(Load, UnknownPreInFileThrows) {
    const std::string path = ::testing::TempDir() + "tok_bad_pre.gguf";
    {
        gguf::writer w(path);
        w.set_string("tokenizer.ggml.model", "gpt2");
        w.set_string("tokenizer.ggml.pre", "mystery-pre");
        w.set_arr_str("tokenizer.ggml.tokens", {"a", "b", "ab"});
        w.set_arr_str("tokenizer.ggml.merges", {"a b"});
        w.write_header();
        w.finish();
    }
    auto f = gguf::file::open(path);
    try {
        tokenizer t(*f);
        FAIL() << "expected an error";
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find("mystery-pre"), std::string::npos) << e.what();
    }
    std::remove(path.c_str());
}

TEST(Load, TinyBpeMergesByRank) {
    // Hand-built vocab: merges "b c" (rank 0) before "a b" (rank 1), so "abc" -> "a" + "bc".
    const std::string path = ::testing::TempDir() + "tok_tiny.gguf";
    {
        gguf::writer w(path);
        w.set_string("tokenizer.ggml.model", "gpt2");
        w.set_string("tokenizer.ggml.pre", "gpt-2");
        w.set_arr_str("tokenizer.ggml.tokens", {"a", "b", "c", "ab", "bc", "\xC4\xA0"});
        w.set_arr_str("tokenizer.ggml.merges", {"b c", "a b"});
        w.write_header();
        w.finish();
    }
    auto f = gguf::file::open(path);
    tokenizer t(*f);
    EXPECT_EQ(t.encode("abc", false, false), (std::vector<int32_t>{0, 4}));
    EXPECT_EQ(t.encode("ab", false, false), (std::vector<int32_t>{3}));
    EXPECT_EQ(t.encode("ab c", false, false), (std::vector<int32_t>{3, 5, 2}));
    EXPECT_EQ(t.bos(), token_null);
    EXPECT_THROW(t.encode("x", false, false), fathom::error);  // byte without a token
    std::remove(path.c_str());
}

// ---- speed ------------------------------------------------------------------------------------------------

std::string mixed_text(size_t bytes) {
    const std::string parts[] = {
        "The quick brown fox jumps over the lazy dog. ",
        "int main(int argc, char **argv) {\n    return argc > 1 ? 0 : -1;\n}\n",
        "Überprüfung der Größe: 3.14159 × 2 = 6.28318; ",
        "深度学习模型的推理速度很重要。",
        "日本語のテキストも混ぜます。",
        "🦙🚀 emoji and   multiple    spaces\t\ttabs\n\n",
        "Привет, мир! Γειά σου κόσμε. ",
        "1234567890 2026-11-29 12:00:00 ",
    };
    // Each part is followed by a pseudo-random 6-letter word, so the text is not one phrase repeated.
    std::string s;
    size_t i = 0;
    uint32_t x = 12345;
    while (s.size() < bytes) {
        s += parts[i++ % (sizeof(parts) / sizeof(parts[0]))];
        for (int k = 0; k < 6; ++k) {
            x = x * 1103515245u + 12345u;
            s += static_cast<char>('a' + (x >> 16) % 26);
        }
        s += ' ';
    }
    return s;
}

TEST(Speed, EncodeOneMegabyte) {
    const std::string text = mixed_text(1 << 20);
    for (const char *name : {"llama-bpe", "qwen2", "deepseek-v3", "deepseek-llm", "gpt-2", "llama-spm"}) {
        const tokenizer &tok = vocab(name);
        // CPU time of this (single-threaded) process, so that a busy shared machine does not distort it.
        const std::clock_t c0 = std::clock();
        const auto t0 = std::chrono::steady_clock::now();
        const auto ids = tok.encode(text, false, false);
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
        std::printf("[ speed    ] %-12s 1 MiB -> %zu tokens: cpu %.3f s (%.1f MB/s), wall %.3f s\n", name, ids.size(),
                    cpu, text.size() / cpu / 1e6, wall);
        EXPECT_LT(cpu, 2.0) << name;  // loose bound for CI; typical figures are reported above
        decode_options opt;
        opt.strip_prefix_space = true;
        EXPECT_EQ(tok.decode(ids, opt), text) << name;
    }
}

}  // namespace
}  // namespace fathom::test
