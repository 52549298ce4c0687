// `fathom daemon` line protocol (see daemon.h, docs/daemon-protocol.md) and --root confinement.
#include "server/daemon.h"

#include <cstdio>
#include <cstring>
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

daemon::daemon(loader load, const fs::path &root, std::string default_drafter, cache::options prompt_cache)
    : load_(std::move(load)), root_(root), default_drafter_(std::move(default_drafter)) {
    std::error_code ec;
    if (!fs::is_directory(root_, ec)) throw error("daemon: --root '" + root_.string() + "' is not a directory");
    eng_ = load_();
    working_ = eng_->new_session();
    if (!prompt_cache.dir.empty()) {
        const std::string id = eng_->state_identity();
        if (id.empty()) throw error("daemon: prompt cache: this engine's sessions cannot save their state");
        cache_ = std::make_unique<cache::prompt_cache>(std::move(prompt_cache), id);
    }
}

void daemon::sync_working(const std::vector<int32_t> &prompt) {
    if (cache_) {
        const std::vector<int32_t> &held = working_->tokens();
        size_t lcp = 0;
        while (lcp < held.size() && lcp < prompt.size() && held[lcp] == prompt[lcp]) ++lcp;
        const auto m = cache_->lookup(prompt, working_->loads_state_prefix());
        std::string why;
        if (m && m->n_keep >= int64_t(lcp) + cache_->opts().min_tokens && !cache_->load(*m, *working_, why))
            std::fprintf(stderr, "fathom daemon: prompt cache: %s; evaluating the prompt instead\n",
                         why.c_str());
    }
    working_->sync(prompt);
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
        if (!working_tokens_.empty()) sync_working(working_tokens_);
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
    confine_path(root_, a[0], true);  // path errors before anything else
    const int64_t n = parse_int(a[1], 1, 1 << 24, "n");
    if (a.size() == 3) confine_path(root_, a[2], false);
    engine &eng = target("generate");
    const std::vector<int32_t> prompt = read_ids(a[0], eng);
    const int64_t n_ctx = eng.info().n_ctx;
    if (int64_t(prompt.size()) >= n_ctx)
        throw error("prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " + std::to_string(n_ctx));
    sync_working(prompt);
    sampling_params sp;
    sp.temperature = 0.0f;  // greedy
    sampler smp(sp);
    std::vector<int32_t> history = prompt, gen;
    std::string reason = "length";
    for (;;) {
        const int32_t t = working_->sample(smp, history).token;
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
    write_or_append_ids(gen, a.size() == 3 ? a[2] : std::string(), reply);
    if (cache_) {  // prompt + generated tokens (all but the last, never evaluated) for later prompts
        std::string why;
        if (cache_->save(*working_, why) == cache::prompt_cache::save_result::failed)
            std::fprintf(stderr, "fathom daemon: prompt cache: %s\n", why.c_str());
    }
    return reply;
}

// A file of little-endian int32 token ids inside --root, each checked against the vocabulary.
std::vector<int32_t> daemon::read_ids(const std::string &rel, const engine &eng) const {
    const fs::path in = confine_path(root_, rel, true);
    std::ifstream f(in, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (bytes.empty() || bytes.size() % 4 != 0)
        throw error("'" + rel + "' must hold little-endian int32 token ids (" + std::to_string(bytes.size()) + " bytes)");
    std::vector<int32_t> ids(bytes.size() / 4);
    for (size_t i = 0; i < ids.size(); ++i) {
        const auto *b = reinterpret_cast<const unsigned char *>(bytes.data() + 4 * i);
        ids[i] = int32_t(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24);
        if (ids[i] < 0 || ids[i] >= eng.info().n_vocab)
            throw error("token id " + std::to_string(ids[i]) + " at index " + std::to_string(i) + " outside the vocabulary");
    }
    return ids;
}

// Writes ids to out_rel (int32 LE, inside --root) or, when out_rel is empty, appends them to the reply.
void daemon::write_or_append_ids(const std::vector<int32_t> &ids, const std::string &out_rel, std::string &reply) const {
    if (out_rel.empty()) {
        for (int32_t t : ids) {
            reply += ' ';
            reply += std::to_string(t);
        }
        return;
    }
    const fs::path out = confine_path(root_, out_rel, false);
    std::ofstream o(out, std::ios::binary | std::ios::trunc);
    for (int32_t t : ids) {
        const uint32_t u = uint32_t(t);
        const char b[4] = {char(u & 0xFF), char((u >> 8) & 0xFF), char((u >> 16) & 0xFF), char(u >> 24)};
        o.write(b, 4);
    }
    if (!o) throw error("cannot write '" + out_rel + "'");
}

// compress <ids-file> <keep-x1000> <drafter> [device=cpu|cuda|cuda:N] [residency=keep|release|auto] [nopark] [out=<file>]
// Reply: "ok <n_original> <n_effective>" followed by the kept ids (or written to out=<file>).
std::string daemon::cmd_compress(const std::vector<std::string> &a) {
    static const char *usage =
        "usage: compress <ids-file> <keep-x1000> <drafter|default> [device=cpu|cuda|cuda:N] [residency=keep|release|auto] "
        "[nopark] [out=<file>]";
    if (a.size() < 3) throw error(usage);
    confine_path(root_, a[0], true);
    const double keep = double(parse_int(a[1], 0, 1000, "keep-x1000")) / 1000.0;
    std::string drafter;
    if (a[2] == "default") {
        if (default_drafter_.empty()) throw error("no default drafter (start the daemon with --drafter PATH)");
        drafter = default_drafter_;
    } else {
        drafter = confine_path(root_, a[2], true).string();
    }
    pflash::drafter_residency residency = pflash::drafter_residency::auto_select;
    std::string out_rel, device = "cpu";
    for (size_t i = 3; i < a.size(); ++i) {
        const std::string &o = a[i];
        if (o == "nopark") continue;  // the target is never parked while scoring (docs/daemon-protocol.md)
        if (o.rfind("device=", 0) == 0) {
            device = o.substr(7);  // checked by pflash::options::validate, usable-or-not by the load
        } else if (o.rfind("residency=", 0) == 0) {
            residency = pflash::parse_residency(o.substr(10));
        } else if (o.rfind("out=", 0) == 0) {
            out_rel = o.substr(4);
            confine_path(root_, out_rel, false);
        } else {
            throw error("unknown option '" + o + "' (" + usage + ")");
        }
    }
    engine &eng = target("compress");
    const std::vector<int32_t> prompt = read_ids(a[0], eng);
    if (!comp_ || comp_drafter_ != drafter || comp_->opts().residency != residency ||
        comp_->opts().drafter_device != device) {
        comp_.reset();  // a different drafter, policy or device: release the old one first
        pflash::options po;
        po.drafter_path = drafter;
        po.keep_ratio = keep;
        po.residency = residency;
        po.drafter_device = device;
        po.verbatim_last_user = false;  // ids carry no chat structure the caller asked to keep
        comp_ = pflash::compressor::create(po);
        comp_drafter_ = drafter;
    }
    comp_->set_keep_ratio(keep);
    const pflash::result r = comp_->compress(eng, prompt);
    std::string reply = "ok " + std::to_string(r.n_original) + " " + std::to_string(r.n_effective);
    write_or_append_ids(r.tokens, out_rel, reply);
    return reply;
}

std::string daemon::cmd_park(const std::vector<std::string> &a, bool park) {
    const char *cmd = park ? "park" : "unpark";
    if (a.size() > 1) throw error(std::string("usage: ") + cmd + " [target|draft|all]");
    const std::string what = a.empty() ? "all" : a[0];
    if (what != "target" && what != "draft" && what != "all")
        throw error(std::string(cmd) + ": unknown target '" + what + "' (target|draft|all)");
    if (what == "draft" && !comp_) throw error(std::string(cmd) + ": no drafter yet (run compress first)");
    if (what != "target" && comp_) {  // draft or all: the PFlash drafter's weights and state
        if (park) comp_->release_drafter();
        else comp_->load_drafter();
        if (what == "draft") return std::string("ok ") + (park ? "parked" : "unparked") + " draft";
    }
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

// Makes `to` hold what `from` holds by copying its state (session::save_state into memory, then
// load_state: no evaluation, the same bits and logits). false when the sessions cannot save or load
// states (CUDA dense sessions of some kinds, several devices) or the load fails (e.g. a full KV pool):
// the caller then re-evaluates.
static bool copy_state(const session &from, session &to) {
    struct mem_writer final : state_writer {
        std::vector<uint8_t> b;
        void write(const void *p, size_t n) override {
            b.insert(b.end(), static_cast<const uint8_t *>(p), static_cast<const uint8_t *>(p) + n);
        }
    };
    struct mem_reader final : state_reader {
        const std::vector<uint8_t> &b;
        size_t pos = 0;
        explicit mem_reader(const std::vector<uint8_t> &v) : b(v) {}
        void read(void *p, size_t n) override {
            if (n > b.size() - pos) throw error("snapshot: the state stream ended early");
            std::memcpy(p, b.data() + pos, n);
            pos += n;
        }
        uint64_t remaining() const override { return b.size() - pos; }
    };
    mem_writer w;
    if (!from.save_state(w)) return false;
    mem_reader r(w.b);
    const std::vector<int32_t> &toks = from.tokens();
    try {
        return to.load_state(r, toks, int64_t(toks.size()));
    } catch (const std::exception &) {
        to.reset();
        return false;
    }
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
        else if (!copy_state(*working_, *s.sess))  // no states: re-evaluated (a shared prefix kept)
            s.sess->sync(s.tokens);
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
    const char *draft = !comp_ ? "none" : comp_->drafter_loaded() ? "loaded" : "parked";
    std::string r = std::string("ok target=") + (eng_ ? "loaded" : "parked") + " draft=" + draft + " working=" +
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
        if (cmd == "compress") return cmd_compress(args);
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
