// The on-disk prompt cache directory (prompt_cache.h; format and crash-safety argument:
// docs/prompt-cache.md). File I/O of loads and saves runs outside the index mutex, so one thread's
// save does not hold up another's lookup; the index is only touched under it.
#include "cache/prompt_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "cache/entry.h"
#include "core/error.h"

namespace fathom::cache {

namespace {

// Entry names: 16 lower-case hex digits + ".fpc". Temporary files: ".tmp-<pid>-<16 hex>.fpc".
bool is_entry_name(const std::string &n) {
    if (n.size() != 20 || n.compare(16, 4, ".fpc") != 0) return false;
    return std::all_of(n.begin(), n.begin() + 16,
                       [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

constexpr const char *temp_prefix = ".tmp-";
constexpr int64_t stale_temp_ns = int64_t{3600} * 1000000000;  // a temp file older than this is stale

int64_t mtime_ns(const struct stat &st) {
    return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

int64_t now_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// When this process started (this file's static initialisation, close enough). A temporary file named
// with our own pid but last written before then belongs to an earlier process that had the same pid: a
// server in a container runs as pid 1 again after it died halfway through a save. The coarse clock is
// the one file times are taken from: the precise one can be a few ms ahead of a file written after it.
const int64_t process_start_ns = [] {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME_COARSE, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}();

struct fd_guard {
    int fd = -1;
    ~fd_guard() {
        if (fd >= 0) ::close(fd);
    }
};

std::string errno_text(const std::string &what) {
    return what + ": " + std::strerror(errno);
}

void fsync_dir(const std::string &dir) {
    fd_guard d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
    if (d.fd < 0) throw error(errno_text(dir));
    if (::fsync(d.fd) != 0) throw error(errno_text("fsync " + dir));
}

// Whether `path` still names the file open as fd: entries are replaced by rename, never modified, so
// a damaged file found through fd may meanwhile have been replaced by a good one under the same name,
// which must not be deleted with it.
bool still_named(int fd, const std::string &path) {
    struct stat opened, now;
    return ::fstat(fd, &opened) == 0 && ::stat(path.c_str(), &now) == 0 && opened.st_dev == now.st_dev &&
           opened.st_ino == now.st_ino;
}

// After a failed load: the session holds nothing (a paged session keeps its reservation, which
// truncate leaves and reset would drop). A session that cannot even do that is left as it is: its
// tokens still describe what it holds, and the caller's next sync works from them.
void hold_nothing(session &s) {
    try {
        s.truncate(0);
    } catch (const std::exception &) {
    }
}

std::string random_hex() {
    std::random_device rd;
    const uint64_t v = (uint64_t(rd()) << 32) ^ rd();
    char buf[24];
    std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
    return buf;
}

}  // namespace

prompt_cache::prompt_cache(options o, std::string identity)
    : opts_(std::move(o)), identity_(std::move(identity)) {
    if (opts_.dir.empty()) throw error("prompt cache: no directory given");
    if (identity_.empty() || identity_.size() > max_identity_bytes)
        throw error("prompt cache: the engine's sessions cannot save their state");
    if (opts_.min_tokens < 1) throw error("prompt cache: min_tokens must be >= 1");
    if (opts_.zstd_level < 0 || opts_.zstd_level > 19)
        throw error("prompt cache: zstd level must be in [0, 19]");
    std::error_code ec;
    std::filesystem::create_directories(opts_.dir, ec);
    if (ec || !std::filesystem::is_directory(opts_.dir))
        throw error("prompt cache: cannot create the directory " + opts_.dir +
                    (ec ? ": " + ec.message() : ""));
    if (::access(opts_.dir.c_str(), R_OK | W_OK | X_OK) != 0)
        throw error(errno_text("prompt cache: " + opts_.dir));
    remove_stale_temps();
    std::lock_guard<std::mutex> lk(mu_);
    refresh_locked();
    evict_locked(0);
}

prompt_cache::~prompt_cache() = default;

// Temporary files of writers that died (their pid is gone, or is ours but the file predates this
// process, or the file is over an hour old: a pid reused by another process, a writer on another host
// sharing the directory).
void prompt_cache::remove_stale_temps() {
    DIR *d = ::opendir(opts_.dir.c_str());
    if (!d) throw error(errno_text("prompt cache: " + opts_.dir));
    std::vector<std::string> stale;
    const int64_t now = now_ns();
    while (const dirent *e = ::readdir(d)) {
        const std::string n = e->d_name;
        if (n.rfind(temp_prefix, 0) != 0) continue;
        const long pid = std::strtol(n.c_str() + 5, nullptr, 10);
        struct stat st;
        if (::stat(path_of(n).c_str(), &st) != 0) continue;
        const bool dead = pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH;
        const bool earlier_self = pid == long(::getpid()) && mtime_ns(st) < process_start_ns;
        if (dead || earlier_self || now - mtime_ns(st) > stale_temp_ns) stale.push_back(n);
    }
    ::closedir(d);
    for (const std::string &n : stale) ::unlink(path_of(n).c_str());
}

void prompt_cache::refresh() {
    std::lock_guard<std::mutex> lk(mu_);
    refresh_locked();
}

void prompt_cache::maybe_refresh_locked() {
    if (std::chrono::steady_clock::now() - last_refresh_ >= opts_.refresh_interval) refresh_locked();
}

void prompt_cache::refresh_locked() {
    last_refresh_ = std::chrono::steady_clock::now();
    DIR *d = ::opendir(opts_.dir.c_str());
    if (!d) return;  // the directory went away: keep the view; saves will report the error
    std::map<std::string, struct stat> present;
    while (const dirent *e = ::readdir(d)) {
        const std::string n = e->d_name;
        struct stat st;
        if (is_entry_name(n) && ::stat(path_of(n).c_str(), &st) == 0 && S_ISREG(st.st_mode)) present[n] = st;
    }
    ::closedir(d);
    for (auto it = index_.begin(); it != index_.end();) {
        const auto p = present.find(it->first);
        if (p == present.end() || uint64_t(p->second.st_size) != it->second.bytes) {
            total_bytes_ -= it->second.bytes;  // gone, or rewritten by another process: re-indexed below
            it = index_.erase(it);
        } else {
            it->second.mtime_ns = mtime_ns(p->second);  // another process's hits
            ++it;
        }
    }
    for (const auto &[n, st] : present)
        if (!index_.count(n)) index_file_locked(n);
}

void prompt_cache::index_file_locked(const std::string &name) {
    const std::string path = path_of(name);
    fd_guard f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    if (f.fd < 0) return;  // deleted meanwhile
    entry_info info;
    try {
        const fd_source src(f.fd, path);
        struct stat st;
        if (::fstat(f.fd, &st) != 0) return;
        info.bytes = src.size();
        info.mtime_ns = mtime_ns(st);
        const entry_header h = read_header(src);
        if (h.identity_hash == XXH64(identity_.data(), identity_.size(), 0) &&
            read_identity(src, h) == identity_) {
            auto toks = std::make_shared<std::vector<int32_t>>(read_tokens(src, h));
            if (entry_key(identity_, *toks) != h.key_hash || entry_file_name(h.key_hash) != name)
                throw entry_error(entry_error::kind_t::damaged,
                                  path + ": key does not match the file's name and contents");
            info.tokens = std::move(toks);
        }
    } catch (const entry_error &e) {
        if (e.kind == entry_error::kind_t::damaged) {
            std::fprintf(stderr, "fathom: prompt cache: %s; deleted\n", e.what());
            if (still_named(f.fd, path)) ::unlink(path.c_str());
            ++stats_.rejected;
            return;
        }
        // foreign (another format version): indexed without tokens, so it counts towards the cap
    } catch (const error &) {
        return;  // an I/O error: try again at the next refresh
    }
    index_[name] = info;
    total_bytes_ += info.bytes;
}

void prompt_cache::remove_locked(const std::string &name, bool delete_file) {
    const auto it = index_.find(name);
    if (it != index_.end()) {
        total_bytes_ -= it->second.bytes;
        index_.erase(it);
    }
    if (delete_file) ::unlink(path_of(name).c_str());
}

// Deletes least recently used entries (oldest modification time; any identity) until the total plus
// `incoming` bytes (an entry about to be renamed into place) fits the cap.
void prompt_cache::evict_locked(uint64_t incoming) {
    while (total_bytes_ + incoming > opts_.max_bytes && !index_.empty()) {
        auto victim = index_.begin();
        for (auto it = index_.begin(); it != index_.end(); ++it)
            if (it->second.mtime_ns < victim->second.mtime_ns) victim = it;
        const std::string name = victim->first;
        remove_locked(name, true);
        ++stats_.evictions;
    }
}

void prompt_cache::touch_locked(const std::string &name) {
    if (::utimensat(AT_FDCWD, path_of(name).c_str(), nullptr, 0) != 0) return;
    const auto it = index_.find(name);
    if (it != index_.end()) it->second.mtime_ns = now_ns();
}

std::optional<prompt_cache::match> prompt_cache::lookup(std::span<const int32_t> prompt, bool prefix_loads) {
    std::lock_guard<std::mutex> lk(mu_);
    maybe_refresh_locked();
    std::optional<match> best;
    for (const auto &[name, e] : index_) {
        if (!e.tokens) continue;
        const std::vector<int32_t> &t = *e.tokens;
        const size_t n = std::min(t.size(), prompt.size());
        size_t l = 0;
        while (l < n && t[l] == prompt[l]) ++l;
        if (l == 0 || (!prefix_loads && l != t.size())) continue;
        // Longest kept prefix; on a tie the smaller entry (fewer bytes to read).
        if (!best || int64_t(l) > best->n_keep ||
            (int64_t(l) == best->n_keep && t.size() < best->tokens->size()))
            best = match{name, e.tokens, int64_t(l)};
    }
    return best;
}

bool prompt_cache::contains(std::span<const int32_t> tokens) {
    const std::string name = entry_file_name(entry_key(identity_, tokens));
    std::lock_guard<std::mutex> lk(mu_);
    const auto it = index_.find(name);
    return it != index_.end() && it->second.tokens &&
           std::equal(tokens.begin(), tokens.end(), it->second.tokens->begin(), it->second.tokens->end());
}

bool prompt_cache::load(const match &m, session &s, std::string &why) {
    why.clear();
    const std::string path = path_of(m.name);
    if (!m.tokens || m.n_keep < 1 || m.n_keep > int64_t(m.tokens->size()) ||
        (m.n_keep < int64_t(m.tokens->size()) && !s.loads_state_prefix())) {
        // The caller's request, not the entry, is wrong (a whole-state session asked for a prefix): the
        // session would refuse it, and a refusal deletes the entry as unusable.
        why = path + ": cannot keep " + std::to_string(m.n_keep) + " tokens of this entry in this session";
        hold_nothing(s);
        return false;
    }
    fd_guard f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    if (f.fd < 0) {
        why = errno_text(path);
        hold_nothing(s);
        std::lock_guard<std::mutex> lk(mu_);
        remove_locked(m.name, false);  // evicted by another process
        return false;
    }
    bool damaged = false, failed = true;
    try {
        const fd_source src(f.fd, path);
        const entry_header h = read_header(src);
        if (read_identity(src, h) != identity_)
            throw entry_error(entry_error::kind_t::damaged, path + ": identity differs from its index entry");
        const std::vector<int32_t> toks = read_tokens(src, h);
        if (toks != *m.tokens)
            throw entry_error(entry_error::kind_t::damaged, path + ": tokens differ from its index entry");
        state_section_reader r(src, h.sections[2]);
        bool loaded = false;
        try {
            loaded = s.load_state(r, toks, m.n_keep);
        } catch (const entry_error &) {
            throw;
        } catch (const error &e) {
            // The session refused the stream: damaged if the checksum says so, else a state this engine
            // cannot use despite the same identity (useless here too). Only the stored bytes are checked:
            // decoding the rest (finish) could mean decoding whatever length a hostile table promises.
            r.verify_stored();
            throw entry_error(entry_error::kind_t::damaged, path + ": " + e.what());
        }
        if (!loaded) {
            why = "the session cannot load saved states";
        } else {
            r.finish();
            failed = false;
        }
    } catch (const entry_error &e) {
        why = e.what();
        damaged = e.kind == entry_error::kind_t::damaged;
    } catch (const std::exception &e) {
        // I/O, or the session out of memory: the file stays. Anything else must not escape either: the
        // caller is the scheduler's I/O thread, which a stray exception would take down with the process.
        why = path + ": " + e.what();
    }
    if (failed) hold_nothing(s);
    std::lock_guard<std::mutex> lk(mu_);
    if (failed) {
        if (damaged) {
            remove_locked(m.name, still_named(f.fd, path));  // a replacement is re-indexed on refresh
            ++stats_.rejected;
        }
        return false;
    }
    touch_locked(m.name);
    return true;
}

namespace {
// The session's state in memory (prompt_cache::save copies it before it writes the file).
struct memory_writer final : state_writer {
    std::vector<uint8_t> bytes;
    void write(const void *data, size_t n) override {
        const auto *p = static_cast<const uint8_t *>(data);
        bytes.insert(bytes.end(), p, p + n);
    }
};
// Calls f once: explicitly, or at the end of the scope (every early return and exception).
struct release_once {
    const std::function<void()> &f;
    bool done = false;
    void operator()() {
        if (done) return;
        done = true;
        if (f) f();
    }
    ~release_once() { (*this)(); }
};
}  // namespace

prompt_cache::save_result prompt_cache::save(const session &s, std::string &why,
                                             const std::function<void()> &released) {
    release_once release{released};
    const std::vector<int32_t> toks = s.tokens();
    if (int64_t(toks.size()) < opts_.min_tokens) return save_result::too_short;
    const uint64_t key = entry_key(identity_, toks);
    const std::string name = entry_file_name(key), path = path_of(name);
    {
        std::lock_guard<std::mutex> lk(mu_);
        const auto it = index_.find(name);
        if (it != index_.end() && it->second.tokens && *it->second.tokens == toks) {
            touch_locked(name);
            return save_result::exists;
        }
    }
    memory_writer state;  // the session is read here only
    try {
        if (!s.save_state(state)) return save_result::unsupported;
    } catch (const std::exception &e) {
        why = e.what();
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.save_failures;
        return save_result::failed;
    }
    release();
    const std::string tmp =
        path_of(std::string(temp_prefix) + std::to_string(::getpid()) + "-" + random_hex() + ".fpc");
    fd_guard f{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
    uint64_t bytes = 0;
    try {
        if (f.fd < 0) throw error(errno_text(tmp));
        fd_sink sink(f.fd, tmp);
        bytes = write_entry(sink, identity_, toks, opts_.zstd_level, [&](state_writer &w) {
            w.write(state.bytes.data(), state.bytes.size());
            return true;
        });
        if (bytes > opts_.max_bytes) {
            ::unlink(tmp.c_str());
            return save_result::too_large;
        }
        if (bytes > 0) {
            if (::fsync(f.fd) != 0) throw error(errno_text("fsync " + tmp));
            const int fd = f.fd;
            f.fd = -1;
            if (::close(fd) != 0) throw error(errno_text("close " + tmp));
            {
                // Make room first, so the directory never holds more than the cap (an entry for the
                // same key is replaced by the rename: its bytes are not counted twice).
                std::lock_guard<std::mutex> lk(mu_);
                remove_locked(name, false);
                evict_locked(bytes);
            }
            if (::rename(tmp.c_str(), path.c_str()) != 0) throw error(errno_text("rename " + tmp));
            fsync_dir(opts_.dir);
        }
    } catch (const std::exception &e) {
        ::unlink(tmp.c_str());
        why = e.what();
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.save_failures;
        return save_result::failed;
    }
    if (bytes == 0) {
        ::unlink(tmp.c_str());
        return save_result::unsupported;
    }
    std::lock_guard<std::mutex> lk(mu_);
    remove_locked(name, false);  // the same key saved twice (another thread): counted once
    index_[name] = entry_info{std::make_shared<const std::vector<int32_t>>(toks), bytes, now_ns()};
    total_bytes_ += bytes;
    ++stats_.saves;
    evict_locked(0);  // other threads' saves meanwhile
    return save_result::saved;
}

stats prompt_cache::get_stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    stats s = stats_;
    s.entries = index_.size();
    s.bytes = total_bytes_;
    return s;
}

}  // namespace fathom::cache
