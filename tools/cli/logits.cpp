// `fathom logits`: evaluates a file of whitespace-separated token ids and writes the logits of
// every position as raw float32 little-endian, row-major [n_tokens x n_vocab]. The evaluation
// mode fixes how the tokens are batched, so the three paths of the engine can be compared:
//   prefill    one eval() call with all tokens
//   decode     one eval() call per token
//   chunked:N  N tokens per eval() call (the last chunk may be shorter)
// Other checks depend on this exact interface.
// With --mtp or --dspark (DeepSeek V4 only) it writes a drafter's outputs instead
// (include/fathom/drafter_logits.h).
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
#include "fathom/drafter_logits.h"
#include "fathom/error.h"

namespace fathom::cli {

static_assert(std::endian::native == std::endian::little, "logits output is written as native float32 (LE)");

namespace {

struct logits_args {
    model_args model;
    std::string tokens_file;
    std::string out;
    std::string mode = "prefill";
    std::string mtp;          // --mtp: DS4 MTP head logits instead of the model's
    int64_t next_token = -1;  // --next-token (with --mtp)
    std::string dspark;       // --dspark: DS4 DSpark draft block instead of the model's logits
    int64_t seed_token = -1;  // --seed-token (with --dspark)
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

// --mtp / --dspark: option checks before anything is loaded, then the DS4 reference drafters.
void drafter_main(const logits_args &a, int64_t chunk) {
    if (!a.mtp.empty() && a.next_token < 0)
        throw error("logits: --mtp needs --next-token (the token after the ids)");
    if (!a.dspark.empty() && a.seed_token < 0)
        throw error("logits: --dspark needs --seed-token (the token at position n)");
    if (a.model.device != "cpu" || !a.model.devices.empty())
        throw error("logits: --mtp and --dspark run on the CPU reference model (no --device / --devices)");
    drafter_logits_args d;
    d.model_path = resolve_model_path(a.model.model, a.model.models_dir);
    d.qat = a.model.qat;
    d.kv_type = a.model.kv_type;
    d.threads = a.model.threads;
    d.chunk = chunk;
    d.mtp = a.mtp;
    d.next_token = a.next_token;
    d.dspark = a.dspark;
    d.seed_token = a.seed_token;
    const drafter_logits_result r =
        drafter_logits(d, [&](int32_t n_vocab) { return read_token_ids(a.tokens_file, n_vocab); });
    float_file out(a.out);
    out.write(r.rows.data(), r.rows.size());
    out.close();
    if (!r.summary.empty()) write_out(r.summary + "\n");
    std::fprintf(stderr, "logits: wrote %lld x %lld float32 %s rows to %s\n",
                 static_cast<long long>(r.n_rows), static_cast<long long>(r.n_vocab),
                 a.mtp.empty() ? "DSpark (base, then corrected)" : "MTP", a.out.c_str());
}

void logits_main(const logits_args &a) {
    const int64_t chunk = parse_mode(a.mode);  // before loading: a typo fails at once
    if (!a.mtp.empty() || !a.dspark.empty()) return drafter_main(a, chunk);
    if (a.next_token >= 0 || a.seed_token >= 0)
        throw error("logits: --next-token needs --mtp and --seed-token needs --dspark");
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
    set_group(cmd, "Logits");
    cmd->add_option("--tokens-file", a->tokens_file, "File of whitespace-separated token ids")->required();
    cmd->add_option("--out", a->out, "Output file (raw float32 LE, row-major [n_tokens x n_vocab])")->required();
    cmd->add_option("--mode", a->mode,
                    "prefill (one call), decode (one token per call) or chunked:N (N tokens per call)")
        ->capture_default_str();
    set_group(cmd, "DeepSeek V4 drafters");
    auto *mtp =
        cmd->add_option("--mtp", a->mtp,
                        "DeepSeek V4: write the MTP head's logits [n_tokens x n_vocab] instead (MTP GGUF, "
                        "llama.cpp or antirez/ds4 layout; row i = state of i with token i+1)");
    cmd->add_option("--next-token", a->next_token,
                    "With --mtp: the token after the ids (the last row's input)")
        ->check(at_least(0));
    cmd->add_option("--dspark", a->dspark,
                    "DeepSeek V4: draft one DSpark block after the ids (drafter GGUF); writes base then "
                    "corrected logits [2 x block x n_vocab], JSON summary on stdout")
        ->excludes(mtp);
    cmd->add_option("--seed-token", a->seed_token,
                    "With --dspark: the token at position n_tokens (the block's seed)")
        ->check(at_least(0));
    cmd->callback([a]() { logits_main(*a); });
}

}  // namespace fathom::cli
