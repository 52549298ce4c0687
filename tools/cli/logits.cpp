// `fathom logits`: evaluates a file of whitespace-separated token ids and writes the logits of
// every position as raw float32 little-endian, row-major [n_tokens x n_vocab]. The evaluation
// mode fixes how the tokens are batched, so the three paths of the engine can be compared:
//   prefill    one eval() call with all tokens
//   decode     one eval() call per token
//   chunked:N  N tokens per eval() call (the last chunk may be shorter)
// Other checks depend on this exact interface.
#include <bit>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "fathom/error.h"

namespace fathom::cli {

static_assert(std::endian::native == std::endian::little, "logits output is written as native float32 (LE)");

namespace {

struct logits_args {
    model_args model;
    std::string tokens_file;
    std::string out;
    std::string mode = "prefill";
};

// Returns the chunk size: 0 = prefill (everything at once), 1 = decode, N = chunked:N.
int64_t parse_mode(const std::string &mode) {
    if (mode == "prefill") return 0;
    if (mode == "decode") return 1;
    if (mode.starts_with("chunked:")) {
        const std::string_view num = std::string_view(mode).substr(8);
        int64_t n = 0;
        const auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), n);
        if (ec == std::errc() && ptr == num.data() + num.size() && n >= 1) return n;
    }
    throw error("logits: invalid --mode '" + mode + "' (expected prefill, decode or chunked:N with N >= 1)");
}

std::vector<int32_t> read_token_ids(const std::string &path, int32_t n_vocab) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw error("cannot open tokens file: " + path);
    std::vector<int32_t> ids;
    std::string word;
    while (f >> word) {
        int64_t v = 0;
        const auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
        if (ec != std::errc() || ptr != word.data() + word.size())
            throw error(path + ": token #" + std::to_string(ids.size()) + " is not an integer: '" + word + "'");
        if (v < 0 || v >= n_vocab)
            throw error(path + ": token #" + std::to_string(ids.size()) + " = " + word + " outside vocabulary [0, " +
                        std::to_string(n_vocab) + ")");
        ids.push_back(static_cast<int32_t>(v));
    }
    if (ids.empty()) throw error(path + ": no token ids");
    return ids;
}

class float_file {
public:
    explicit float_file(const std::string &path) : path_(path), f_(std::fopen(path.c_str(), "wb")) {
        if (!f_) throw error("cannot create output file: " + path);
    }
    ~float_file() {
        if (f_) std::fclose(f_);
    }
    void write(const float *data, size_t n) {
        if (std::fwrite(data, sizeof(float), n, f_) != n) throw error("write failed: " + path_);
    }
    void close() {
        const int rc = std::fclose(f_);
        f_ = nullptr;
        if (rc != 0) throw error("write failed: " + path_);
    }
private:
    std::string path_;
    std::FILE *f_;
};

void logits_main(const logits_args &a) {
    const int64_t chunk = parse_mode(a.mode);  // before loading: a typo fails at once
    auto eng = load_engine(a.model);
    const model_info &info = eng->info();
    const std::vector<int32_t> ids = read_token_ids(a.tokens_file, info.n_vocab);
    const int64_t n = static_cast<int64_t>(ids.size());
    if (n > info.n_ctx)
        throw error("logits: " + std::to_string(n) + " tokens do not fit the context of " +
                    std::to_string(info.n_ctx) + " (raise --ctx)");
    const size_t n_vocab = static_cast<size_t>(info.n_vocab);

    auto sess = eng->new_session();
    float_file out(a.out);
    const int64_t step = chunk == 0 ? n : chunk;
    std::vector<float> buf(static_cast<size_t>(std::min(step, n)) * n_vocab);  // [step x n_vocab]
    progress_bar bar("evaluating", a.model.progress || (stderr_is_tty() && chunk != 0));
    for (int64_t i = 0; i < n; i += step) {
        const int64_t m = std::min(step, n - i);
        sess->eval(std::span<const int32_t>(ids.data() + i, static_cast<size_t>(m)), buf.data());
        out.write(buf.data(), static_cast<size_t>(m) * n_vocab);
        bar.update(i + m, n);
    }
    bar.finish();
    out.close();
    std::fprintf(stderr, "logits: wrote %lld x %zu float32 to %s\n", static_cast<long long>(n), n_vocab, a.out.c_str());
}

}  // namespace

void add_logits_command(CLI::App &app) {
    auto a = std::make_shared<logits_args>();
    auto *cmd = app.add_subcommand(
        "logits", "Evaluate token ids and write float32 little-endian logits [n_tokens x n_vocab]");
    add_model_options(cmd, a->model, /*model_required=*/true);
    cmd->add_option("--tokens-file", a->tokens_file, "File of whitespace-separated token ids")->required();
    cmd->add_option("--out", a->out, "Output file (raw float32 LE, row-major [n_tokens x n_vocab])")->required();
    cmd->add_option("--mode", a->mode,
                    "prefill (one call), decode (one token per call) or chunked:N (N tokens per call)")
        ->capture_default_str();
    cmd->callback([a]() { logits_main(*a); });
}

}  // namespace fathom::cli
