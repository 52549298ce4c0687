// `fathom daemon` line protocol (see daemon.h, docs/daemon-protocol.md) and --root confinement.
#include "server/daemon.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <istream>
#include <ostream>
#include <sstream>

#include "fathom/sampling.h"

namespace fathom::server {

namespace fs = std::filesystem;

unique_fd &unique_fd::operator=(unique_fd &&o) noexcept {
    if (this != &o) {
        if (fd_ >= 0) ::close(fd_);
        fd_ = o.release();
    }
    return *this;
}

unique_fd::~unique_fd() {
    if (fd_ >= 0) ::close(fd_);
}

confined_root::confined_root(const fs::path &root) {
    root_ = unique_fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (root_.get() < 0) throw error("daemon: --root '" + root.string() + "' is not a directory: " + std::strerror(errno));
}

static std::string open_failure(const std::string &rel, int err) {
    if (err == ELOOP || err == ENOTDIR)  // O_NOFOLLOW met a symlink (or a file where a directory must be)
        return "'" + rel + "': a symlink or a non-directory on the way (symlinks are refused in --root)";
    return "'" + rel + "': " + std::strerror(err);
}

// The directory holding rel's last component, opened component by component from the root with
// O_NOFOLLOW (a symlink fails with ELOOP or ENOTDIR); leaf = the last component.
unique_fd confined_root::open_parent(const std::string &rel, std::string &leaf) const {
    if (rel.empty()) throw error("empty path");
    if (rel[0] == '/') throw error("path '" + rel + "' is absolute (paths are relative to --root)");
    std::vector<std::string> parts;
    for (size_t pos = 0; pos <= rel.size();) {
        size_t slash = rel.find('/', pos);
        if (slash == std::string::npos) slash = rel.size();
        const std::string part = rel.substr(pos, slash - pos);
        if (part == "..") throw error("path '" + rel + "' contains '..'");
        if (!part.empty() && part != ".") parts.push_back(part);
        pos = slash + 1;
    }
    if (parts.empty() || rel.back() == '/') throw error("'" + rel + "' does not name a file");
    leaf = parts.back();
    parts.pop_back();
    unique_fd dir(::openat(root_.get(), ".", O_PATH | O_DIRECTORY | O_CLOEXEC));
    for (const auto &part : parts) {
        unique_fd next(::openat(dir.get(), part.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (next.get() < 0) throw error(open_failure(rel, errno));
        dir = std::move(next);
    }
    return dir;
}

static void check_regular(int fd, const std::string &rel, bool for_write) {
    struct stat st;
    if (fstat(fd, &st) != 0) throw error("'" + rel + "': " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw error("'" + rel + "' is not a regular file");
    if (for_write && st.st_nlink > 1) throw error("'" + rel + "' has other hard links (refused: it may lie outside --root)");
}

unique_fd confined_root::open_read(const std::string &rel) const {
    std::string leaf;
    const unique_fd dir = open_parent(rel, leaf);
    // O_NONBLOCK: a FIFO must not block the open (it is refused as not a regular file next).
    unique_fd f(::openat(dir.get(), leaf.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (f.get() < 0) throw error(open_failure(rel, errno));
    check_regular(f.get(), rel, false);
    return f;
}

unique_fd confined_root::open_write(const std::string &rel) const {
    std::string leaf;
    const unique_fd dir = open_parent(rel, leaf);
    // O_NOFOLLOW with O_CREAT: a symlink, dangling or not, fails (ELOOP) instead of being followed.
    unique_fd f(::openat(dir.get(), leaf.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644));
    if (f.get() < 0) throw error(open_failure(rel, errno));
    check_regular(f.get(), rel, true);
    return f;
}

void confined_root::write_all(int fd, const std::string &bytes, const std::string &rel) {
    if (::ftruncate(fd, 0) != 0 || ::lseek(fd, 0, SEEK_SET) != 0) throw error("cannot write '" + rel + "': " + std::strerror(errno));
    for (size_t done = 0; done < bytes.size();) {
        const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw error("cannot write '" + rel + "': " + std::strerror(errno));
        done += size_t(n);
    }
}

std::string confined_root::fd_path(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

daemon::daemon(loader load, const fs::path &root, std::string default_drafter, cache::options prompt_cache,
               daemon_spec spec)
    : load_(std::move(load)), root_(root), default_drafter_(std::move(default_drafter)), spec_(std::move(spec)) {
    if (spec_.mode != "none" && spec_.mode != "ngram" && spec_.mode != "session")
        throw error("daemon: speculation mode must be none, ngram or session, got '" + spec_.mode + "'");
    if (spec_.mode != "none") spec_.ngram.validate();
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
    const unique_fd in = root_.open_read(a[0]);  // path errors before anything else
    const int64_t n = parse_int(a[1], 1, 1 << 24, "n");
    const unique_fd out = a.size() == 3 ? root_.open_write(a[2]) : unique_fd();
    engine &eng = target("generate");
    const std::vector<int32_t> prompt = read_ids(in.get(), a[0], eng);
    const int64_t n_ctx = eng.info().n_ctx;
    if (int64_t(prompt.size()) >= n_ctx)
        throw error("prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " + std::to_string(n_ctx));
    sync_working(prompt);
    sampling_params sp;
    sp.temperature = 0.0f;  // greedy
    sampler smp(sp);
    std::vector<int32_t> history = prompt, gen;
    std::string reason = "length";
    if (spec_.mode != "none" && working_->rolls_back()) {
        // The same loop with drafts (include/fathom/speculative.h): the same tokens, fewer forwards.
        session &w = *working_;
        const spec::drafter draft = spec_.mode == "session"
                                        ? spec::drafter([&w](std::span<const int32_t> h, int32_t max) { return w.draft(h, max); })
                                        : spec::drafter([this](std::span<const int32_t> h, int32_t max) {
                                              return spec::ngram_draft(h, spec_.ngram, max);
                                          });
        const spec::spec_stats st = spec::generate(w, smp, n_ctx, spec_.ngram, draft, [&](int32_t t) {
            if (eng.is_end_of_generation(t)) {
                reason = "eog";
                return spec::token_verdict::stop;
            }
            gen.push_back(t);
            return int64_t(gen.size()) >= n ? spec::token_verdict::keep_and_stop : spec::token_verdict::keep;
        });
        if (st.hit_ctx) reason = "context";
        spec_total_.steps += st.steps;
        spec_total_.drafted += st.drafted;
        spec_total_.accepted += st.accepted;
        spec_total_.emitted += st.emitted;
    } else {
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
    }
    std::string reply = "ok " + std::to_string(gen.size()) + " " + reason;
    write_or_append_ids(gen, out.get(), a.size() == 3 ? a[2] : std::string(), reply);
    if (cache_) {  // prompt + generated tokens (all but the last, never evaluated) for later prompts
        std::string why;
        if (cache_->save(*working_, why) == cache::prompt_cache::save_result::failed)
            std::fprintf(stderr, "fathom daemon: prompt cache: %s\n", why.c_str());
    }
    return reply;
}

std::vector<int32_t> daemon::read_ids(int fd, const std::string &rel, const engine &eng) {
    std::string bytes;
    char buf[65536];
    for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw error("cannot read '" + rel + "': " + std::strerror(errno));
        if (n == 0) break;
        bytes.append(buf, size_t(n));
    }
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

void daemon::write_or_append_ids(const std::vector<int32_t> &ids, int out, const std::string &out_rel, std::string &reply) {
    if (out < 0) {
        for (int32_t t : ids) {
            reply += ' ';
            reply += std::to_string(t);
        }
        return;
    }
    std::string bytes;
    for (int32_t t : ids) {
        const uint32_t u = uint32_t(t);
        const char b[4] = {char(u & 0xFF), char((u >> 8) & 0xFF), char((u >> 16) & 0xFF), char(u >> 24)};
        bytes.append(b, 4);
    }
    confined_root::write_all(out, bytes, out_rel);
}

// compress <ids-file> <keep-x1000> <drafter> [device=cpu|cuda|cuda:N] [residency=keep|release|auto] [nopark] [out=<file>]
// Reply: "ok <n_original> <n_effective>" followed by the kept ids (or written to out=<file>).
std::string daemon::cmd_compress(const std::vector<std::string> &a) {
    static const char *usage =
        "usage: compress <ids-file> <keep-x1000> <drafter|default> [device=cpu|cuda|cuda:N] [residency=keep|release|auto] "
        "[nopark] [out=<file>]";
    if (a.size() < 3) throw error(usage);
    const unique_fd in = root_.open_read(a[0]);
    const double keep = double(parse_int(a[1], 0, 1000, "keep-x1000")) / 1000.0;
    // The drafter: the operator's --drafter, or a file in --root held open and loaded through its descriptor.
    const std::string drafter = a[2] == "default" ? default_drafter_ : a[2];
    if (a[2] == "default" && default_drafter_.empty()) throw error("no default drafter (start the daemon with --drafter PATH)");
    unique_fd drafter_fd = a[2] == "default" ? unique_fd() : root_.open_read(a[2]);
    pflash::drafter_residency residency = pflash::drafter_residency::auto_select;
    std::string out_rel, device = "cpu";
    unique_fd out;
    for (size_t i = 3; i < a.size(); ++i) {
        const std::string &o = a[i];
        if (o == "nopark") continue;  // the target is never parked while scoring (docs/daemon-protocol.md)
        if (o.rfind("device=", 0) == 0) {
            device = o.substr(7);  // checked by pflash::options::validate, usable-or-not by the load
        } else if (o.rfind("residency=", 0) == 0) {
            residency = pflash::parse_residency(o.substr(10));
        } else if (o.rfind("out=", 0) == 0) {
            out_rel = o.substr(4);
            out = root_.open_write(out_rel);
        } else {
            throw error("unknown option '" + o + "' (" + usage + ")");
        }
    }
    engine &eng = target("compress");
    const std::vector<int32_t> prompt = read_ids(in.get(), a[0], eng);
    if (!comp_ || comp_drafter_ != drafter || comp_->opts().residency != residency ||
        comp_->opts().drafter_device != device) {
        comp_.reset();  // a different drafter, policy or device: release the old one first
        comp_drafter_fd_ = std::move(drafter_fd);
        pflash::options po;
        po.drafter_path = comp_drafter_fd_.get() >= 0 ? confined_root::fd_path(comp_drafter_fd_.get()) : drafter;
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
    write_or_append_ids(r.tokens, out.get(), out_rel, reply);
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
        if (cmd == "stats") {
            if (!args.empty()) throw error("usage: stats");
            return "ok spec_steps " + std::to_string(spec_total_.steps) + " drafted " + std::to_string(spec_total_.drafted) +
                   " accepted " + std::to_string(spec_total_.accepted);
        }
        if (cmd == "quit") {
            done_ = true;
            return "ok bye";
        }
        return "error: unknown command '" + cmd + "' (generate, compress, park, unpark, snapshot, restore, free, list, stats, quit)";
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
