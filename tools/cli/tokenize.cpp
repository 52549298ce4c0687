// `fathom tokenize`: stdin bytes (verbatim, a trailing newline included) -> token ids on one line,
// separated by single spaces. No BOS/EOS is added; special-token text is plain text unless
// --parse-special. Other checks depend on this exact interface.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"

namespace fathom::cli {

namespace {

struct tokenize_args {
    model_args model;
    bool parse_special = false;
};

void tokenize_main(const tokenize_args &a) {
    auto eng = load_engine(a.model);
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    const std::vector<int32_t> ids = eng->tokenize(text, /*add_special=*/false, a.parse_special);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i) line += ' ';
        line += std::to_string(ids[i]);
    }
    line += '\n';
    write_out(line);
}

}  // namespace

void add_tokenize_command(CLI::App &app) {
    auto a = std::make_shared<tokenize_args>();
    auto *cmd = app.add_subcommand("tokenize",
                                   "Tokenize stdin (bytes as given, no BOS/EOS added) and print the ids on one line");
    add_model_options(cmd, a->model, /*model_required=*/true);
    cmd->add_flag("--parse-special", a->parse_special,
                  "Turn special-token text (e.g. <|im_start|>) into the special token instead of plain text");
    cmd->callback([a]() { tokenize_main(*a); });
}

}  // namespace fathom::cli
