// `fathom daemon` line protocol (see daemon.h, docs/daemon-protocol.md) and --root confinement.
#include "server/daemon.h"

#include <fstream>
#include <istream>
#include <ostream>
#include <sstream>

#include "fathom/sampling.h"

namespace fathom::server {

namespace fs = std::filesystem;

static bool inside(const fs::path &root, const fs::path &p) {
    auto r = root.begin(), q = p.begin();
    for (; r != root.end(); ++r, ++q)
        if (q == p.end() || *r != *q) return false;
    return true;
}

fs::path confine_path(const fs::path &root, const std::string &rel, bool must_exist) {
    if (rel.empty()) throw error("empty path");
    const fs::path p(rel);
    if (p.is_absolute()) throw error("path '" + rel + "' is absolute (paths are relative to --root)");
    for (const auto &part : p)
        if (part == "..") throw error("path '" + rel + "' contains '..'");
    std::error_code ec;
    const fs::path real_root = fs::canonical(root, ec);
    if (ec) throw error("--root '" + root.string() + "': " + ec.message());
    const fs::path full = real_root / p;
    if (must_exist) {
        const fs::path real = fs::canonical(full, ec);  // resolves every symlink
        if (ec) throw error("'" + rel + "': " + ec.message());
        if (!inside(real_root, real)) throw error("path '" + rel + "' resolves outside --root");
        if (!fs::is_regular_file(real)) throw error("'" + rel + "' is not a regular file");
        return real;
    }
    const fs::path parent = fs::canonical(full.parent_path(), ec);
    if (ec) throw error("'" + rel + "': directory " + full.parent_path().string() + ": " + ec.message());
    if (!inside(real_root, parent)) throw error("path '" + rel + "' resolves outside --root");
    const fs::path target = parent / full.filename();
    if (fs::is_symlink(fs::symlink_status(target))) {
        const fs::path real = fs::weakly_canonical(target, ec);
        if (ec || !inside(real_root, real)) throw error("path '" + rel + "' is a symlink leading outside --root");
    }
    if (fs::is_directory(target)) throw error("'" + rel + "' is a directory");
    return target;
}

daemon::daemon(loader load, const fs::path &root) : load_(std::move(load)), root_(root) {
    std::error_code ec;
    if (!fs::is_directory(root_, ec)) throw error("daemon: --root '" + root_.string() + "' is not a directory");
    eng_ = load_();
    working_ = eng_->new_session();
}

daemon::~daemon() { drop_sessions(); }

void daemon::drop_sessions() {
    if (working_) working_tokens_ = working_->tokens();
    working_.reset();
    for (auto &[k, s] : slots_) {
        s.sess.reset();
        s.valid = false;
    }
}

engine &daemon::target(const char *cmd) {
    if (!eng_) throw error(std::string(cmd) + ": the target model is parked (send 'unpark target')");
    if (!working_) {  // first use after unpark: rebuild the working session's state
        working_ = eng_->new_session();
        if (!working_tokens_.empty()) working_->sync(working_tokens_);
    }
    return *eng_;
}

static std::vector<std::string> split_ws(const std::string &line) {
    std::istringstream is(line);
    std::vector<std::string> out;
    for (std::string w; is >> w;) out.push_back(w);
    return out;
}

static int64_t parse_int(const std::string &s, int64_t lo, int64_t hi, const std::string &what) {
    size_t used = 0;
    long long v = 0;
    try {
        v = std::stoll(s, &used);
    } catch (...) {
        used = 0;
    }
    if (used != s.size() || s.empty() || v < lo || v > hi)
        throw error(what + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + s + "'");
    return v;
}

std::string daemon::cmd_generate(const std::vector<std::string> &a) {
    if (a.size() < 2 || a.size() > 3) throw error("usage: generate <ids-file> <n> [out-file]");
    const fs::path in = confine_path(root_, a[0], true);
    const int64_t n = parse_int(a[1], 1, 1 << 24, "n");
    fs::path out;
    if (a.size() == 3) out = confine_path(root_, a[2], false);
    engine &eng = target("generate");
    std::ifstream f(in, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (bytes.empty() || bytes.size() % 4 != 0)
        throw error("'" + a[0] + "' must hold little-endian int32 token ids (" + std::to_string(bytes.size()) + " bytes)");
    std::vector<int32_t> prompt(bytes.size() / 4);
    for (size_t i = 0; i < prompt.size(); ++i) {
        const auto *b = reinterpret_cast<const unsigned char *>(bytes.data() + 4 * i);
        prompt[i] = int32_t(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24);
        if (prompt[i] < 0 || prompt[i] >= eng.info().n_vocab)
            throw error("token id " + std::to_string(prompt[i]) + " at index " + std::to_string(i) + " outside the vocabulary");
    }
    const int64_t n_ctx = eng.info().n_ctx;
    if (int64_t(prompt.size()) >= n_ctx)
        throw error("prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " + std::to_string(n_ctx));
    working_->sync(prompt);
    sampling_params sp;
    sp.temperature = 0.0f;  // greedy
    sampler smp(sp);
    std::vector<int32_t> history = prompt, gen;
    std::string reason = "length";
    for (;;) {
        const int32_t t = smp.sample(working_->logits(), history).token;
        if (eng.is_end_of_generation(t)) {
            reason = "eog";
            break;
        }
        gen.push_back(t);
        history.push_back(t);
        if (int64_t(gen.size()) >= n) break;
        if (working_->n_past() + 1 > n_ctx) {
            reason = "context";
            break;
        }
        working_->eval(std::span<const int32_t>(&t, 1));
    }
    std::string reply = "ok " + std::to_string(gen.size()) + " " + reason;
    if (!out.empty()) {
        std::ofstream o(out, std::ios::binary | std::ios::trunc);
        for (int32_t t : gen) {
            const uint32_t u = uint32_t(t);
            const char b[4] = {char(u & 0xFF), char((u >> 8) & 0xFF), char((u >> 16) & 0xFF), char(u >> 24)};
            o.write(b, 4);
        }
        if (!o) throw error("cannot write '" + a[2] + "'");
    } else {
        for (int32_t t : gen) {
            reply += ' ';
            reply += std::to_string(t);
        }
    }
    return reply;
}

std::string daemon::cmd_park(const std::vector<std::string> &a, bool park) {
    const char *cmd = park ? "park" : "unpark";
    if (a.size() > 1) throw error(std::string("usage: ") + cmd + " [target|draft|all]");
    const std::string what = a.empty() ? "all" : a[0];
    if (what == "draft") throw error(std::string(cmd) + ": no draft model is loaded");
    if (what != "target" && what != "all") throw error(std::string(cmd) + ": unknown target '" + what + "' (target|draft|all)");
    if (park) {
        if (eng_) {
            drop_sessions();  // sessions belong to the engine: keep their tokens, free their KV
            eng_.reset();
        }
        return "ok parked " + what;
    }
    if (!eng_) eng_ = load_();  // sessions are rebuilt on first use
    return "ok unparked " + what;
}

std::string daemon::cmd_slot(const std::string &cmd, const std::vector<std::string> &a) {
    if (a.size() != 1) throw error("usage: " + cmd + " <slot>");
    const int k = int(parse_int(a[0], 0, 1023, "slot"));
    if (cmd == "free") {
        if (!slots_.erase(k)) throw error("free: slot " + std::to_string(k) + " is empty");
        return "ok free " + std::to_string(k);
    }
    engine &eng = target(cmd.c_str());
    if (cmd == "snapshot") {
        snapshot &s = slots_[k];
        s.tokens = working_->tokens();
        if (!s.sess) s.sess = eng.new_session();
        if (s.tokens.empty()) s.sess->reset();
        else s.sess->sync(s.tokens);  // a copy by re-evaluation (reusing what the slot's session shares)
        s.valid = true;
        return "ok snapshot " + std::to_string(k) + " " + std::to_string(s.tokens.size());
    }
    auto it = slots_.find(k);
    if (it == slots_.end()) throw error("restore: slot " + std::to_string(k) + " is empty");
    snapshot &s = it->second;
    if (s.valid && s.sess) {
        std::swap(working_, s.sess);  // no evaluation; the slot now holds the old working session
        s.valid = false;
    } else if (s.tokens.empty()) {
        working_->reset();
    } else {
        working_->sync(s.tokens);
    }
    return "ok restore " + std::to_string(k) + " " + std::to_string(s.tokens.size());
}

std::string daemon::cmd_list() const {
    std::string r = std::string("ok target=") + (eng_ ? "loaded" : "parked") + " draft=none working=" +
                    std::to_string(working_ ? working_->tokens().size() : working_tokens_.size()) + " slots=";
    bool first = true;
    for (const auto &[k, s] : slots_) {
        if (!first) r += ',';
        r += std::to_string(k);
        r += ':';
        r += std::to_string(s.tokens.size());
        first = false;
    }
    return r;
}

std::string daemon::handle(const std::string &line) {
    const auto words = split_ws(line);
    if (words.empty()) return {};
    const std::string &cmd = words[0];
    const std::vector<std::string> args(words.begin() + 1, words.end());
    try {
        if (cmd == "generate") return cmd_generate(args);
        if (cmd == "compress") return "error: compress: not available (PFlash not built yet)";
        if (cmd == "park" || cmd == "unpark") return cmd_park(args, cmd == "park");
        if (cmd == "snapshot" || cmd == "restore" || cmd == "free") return cmd_slot(cmd, args);
        if (cmd == "list") {
            if (!args.empty()) throw error("usage: list");
            return cmd_list();
        }
        if (cmd == "quit") {
            done_ = true;
            return "ok bye";
        }
        return "error: unknown command '" + cmd + "' (generate, compress, park, unpark, snapshot, restore, free, list, quit)";
    } catch (const std::exception &e) {
        std::string msg = e.what();
        for (char &c : msg)
            if (c == '\n' || c == '\r') c = ' ';
        if (msg.rfind(cmd + ":", 0) == 0) return "error: " + msg;
        return "error: " + cmd + ": " + msg;
    }
}

void daemon::run(std::istream &in, std::ostream &out) {
    for (std::string line; !done_ && std::getline(in, line);) {
        const std::string reply = handle(line);
        if (!reply.empty()) out << reply << '\n' << std::flush;
    }
}

}  // namespace fathom::server
