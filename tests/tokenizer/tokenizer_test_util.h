// Shared helpers for the tokenizer tests: loading the vocab-only GGUFs of ../shared/tokenizer-tests and
// reading their .inp/.out suites.
#pragma once
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace fathom::test {

inline std::filesystem::path suite_dir() { return std::filesystem::path(FATHOM_SHARED_DIR) / "tokenizer-tests"; }

inline std::string read_file(const std::filesystem::path &p) {
    std::ifstream f(p, std::ios::binary);
    if (!f) throw fathom::error("cannot open " + p.string());
    std::ostringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Loads (once per process) the tokenizer of ggml-vocab-<name>.gguf.
inline const tokenizer &vocab(const std::string &name) {
    static std::map<std::string, std::unique_ptr<tokenizer>> cache;
    auto it = cache.find(name);
    if (it == cache.end()) {
        auto f = gguf::file::open((suite_dir() / ("ggml-vocab-" + name + ".gguf")).string());
        it = cache.emplace(name, std::make_unique<tokenizer>(*f)).first;
    }
    return *it->second;
}

struct suite_case {
    std::string text;
    std::vector<int32_t> ids;
};

// llama.cpp's format: each test string is followed by "\n__ggml_vocab_test__\n" (so a string's own trailing
// newlines are kept, and the separator's leading newline is not part of it); .out has one line of ids per
// string.
inline std::vector<suite_case> read_suite(const std::filesystem::path &gguf_path) {
    const std::string inp = read_file(gguf_path.string() + ".inp");
    const std::string outp = read_file(gguf_path.string() + ".out");
    const std::string sep = "\n__ggml_vocab_test__\n";
    std::vector<suite_case> cases;
    for (size_t pos = 0;;) {
        const size_t next = inp.find(sep, pos);
        if (next == std::string::npos) break;
        cases.push_back({inp.substr(pos, next - pos), {}});
        pos = next + sep.size();
    }
    std::istringstream lines(outp);
    std::string line;
    size_t i = 0;
    while (std::getline(lines, line)) {
        if (i >= cases.size()) throw fathom::error(gguf_path.string() + ".out has more lines than .inp has cases");
        std::istringstream ids(line);
        int32_t id;
        while (ids >> id) cases[i].ids.push_back(id);
        ++i;
    }
    if (i != cases.size()) throw fathom::error(gguf_path.string() + ".out has fewer lines than .inp has cases");
    return cases;
}

inline std::string ids_str(const std::vector<int32_t> &v) {
    std::string s;
    for (int32_t x : v) {
        s += ' ';
        s += std::to_string(x);
    }
    return s;
}

}  // namespace fathom::test
