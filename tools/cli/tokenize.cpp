// `fathom tokenize` and `fathom detokenize`: text <-> token ids with the vocabulary of a GGUF file. Only the
// tokenizer is loaded (tokenizer.ggml.* metadata, src/tokenizer), never an engine, so a vocabulary-only GGUF
// (no tensors, any architecture) works as well as a model file.
//
//   tokenize:   stdin bytes (verbatim, a trailing newline included) -> token ids on one line, separated by
//               single spaces. No BOS/EOS is added; special-token text is plain text unless --parse-special.
//   detokenize: whitespace-separated decimal ids on stdin -> the text bytes on stdout, nothing added. The
//               SentencePiece dummy-prefix space that tokenize adds is dropped, so tokenize | detokenize
//               gives the input back.
// Other checks depend on these exact interfaces.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace fathom::cli {

namespace {

struct tokenize_args {
    std::string model;
    std::string models_dir;
    bool parse_special = false;
};

struct detokenize_args {
    std::string model;
    std::string models_dir;
    bool no_special = false;
};

// The tokenizer of a GGUF file (path or short name); the file is closed again (the tokenizer copies).
tokenizer load_tokenizer(const std::string &model, const std::string &models_dir) {
    const auto file = gguf::file::open(resolve_model_path(model, models_dir));
    return tokenizer(*file);
}

std::string read_stdin() {
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (std::cin.bad()) throw error("cannot read stdin");
    return text;
}

void tokenize_main(const tokenize_args &a) {
    const tokenizer tok = load_tokenizer(a.model, a.models_dir);
    const std::vector<int32_t> ids = tok.encode(read_stdin(), /*add_special=*/false, a.parse_special);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i) line += ' ';
        line += std::to_string(ids[i]);
    }
    line += '\n';
    write_out(line);
}

// Whitespace-separated decimal ids, each in [0, n_vocab). Throws fathom::error naming the bad word.
std::vector<int32_t> parse_ids(const std::string &text, int32_t n_vocab) {
    std::vector<int32_t> ids;
    size_t pos = 0;
    for (;;) {
        pos = text.find_first_not_of(" \t\r\n", pos);
        if (pos == std::string::npos) return ids;
        const size_t end = std::min(text.find_first_of(" \t\r\n", pos), text.size());
        const std::string word = text.substr(pos, end - pos);
        int64_t v = 0;
        const auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
        if (ec != std::errc() || ptr != word.data() + word.size())
            throw error("detokenize: expected decimal token ids on stdin, got '" + word.substr(0, 40) + "'");
        if (v < 0 || v >= n_vocab)
            throw error("detokenize: token id " + word + " is outside the vocabulary [0, " +
                        std::to_string(n_vocab) + ")");
        ids.push_back(static_cast<int32_t>(v));
        pos = end;
    }
}

void detokenize_main(const detokenize_args &a) {
    const tokenizer tok = load_tokenizer(a.model, a.models_dir);
    const std::vector<int32_t> ids = parse_ids(read_stdin(), tok.n_vocab());
    decode_options opt;
    opt.render_special = !a.no_special;
    opt.strip_prefix_space = true;  // undo the dummy prefix tokenize adds (SentencePiece vocabularies)
    write_out(tok.decode(ids, opt));
}

}  // namespace

void add_tokenize_command(CLI::App &app) {
    auto a = std::make_shared<tokenize_args>();
    auto *cmd =
        app.add_subcommand("tokenize",
                           "Tokenize stdin (bytes as given, no BOS/EOS added) and print the ids on one line; "
                           "reads only the GGUF's vocabulary");
    add_model_file_options(cmd, a->model, a->models_dir, /*model_required=*/true);
    set_group(cmd, "Tokenize");
    cmd->add_flag("--parse-special", a->parse_special,
                  "Turn special-token text (e.g. <|im_start|>) into the special token instead of plain text");
    cmd->callback([a]() { tokenize_main(*a); });
}

void add_detokenize_command(CLI::App &app) {
    auto a = std::make_shared<detokenize_args>();
    auto *cmd =
        app.add_subcommand("detokenize",
                           "Print the text of the token ids on stdin (whitespace-separated, as tokenize "
                           "prints them), nothing added; reads only the GGUF's vocabulary");
    add_model_file_options(cmd, a->model, a->models_dir, /*model_required=*/true);
    set_group(cmd, "Detokenize");
    cmd->add_flag("--no-special", a->no_special,
                  "Print control tokens (e.g. BOS, <|im_start|>) as nothing instead of their text");
    cmd->callback([a]() { detokenize_main(*a); });
}

}  // namespace fathom::cli
