// `fathom daemon`: a line protocol on stdin/stdout for driving the engine from another process.
// One command per line, exactly one reply line per command: "ok ..." or "error: ...".
// Protocol reference: docs/daemon-protocol.md. File arguments are confined to --root.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/prompt_cache.h"
#include "fathom/engine.h"
#include "fathom/speculative.h"
#include "fathom/pflash.h"

namespace fathom::server {

// An owned file descriptor (closed on destruction; -1 = none).
class unique_fd {
public:
    unique_fd() = default;
    explicit unique_fd(int fd) : fd_(fd) {}
    unique_fd(unique_fd &&o) noexcept : fd_(o.release()) {}
    unique_fd &operator=(unique_fd &&o) noexcept;
    unique_fd(const unique_fd &) = delete;
    unique_fd &operator=(const unique_fd &) = delete;
    ~unique_fd();
    int get() const { return fd_; }
    int release() {
        const int f = fd_;
        fd_ = -1;
        return f;
    }

private:
    int fd_ = -1;
};

// The --root directory, held open: files are opened relative to its descriptor, one path component
// at a time with O_NOFOLLOW, so a path can only name a file below the root. Refused: empty and
// absolute paths, "..", any symlink (to a file or a directory, inside or outside the root, dangling
// or not) and anything but a regular file; a written file must not have other hard links. There
// is no check separate from the open, so nothing swapped in between can redirect it.
// Errors throw fathom::error naming the path as given.
class confined_root {
public:
    explicit confined_root(const std::filesystem::path &root);
    // A regular file to read.
    unique_fd open_read(const std::string &rel) const;
    // A regular file to write: created (0644) if missing; not truncated (see write_all).
    unique_fd open_write(const std::string &rel) const;
    // Replaces the contents of a file opened with open_write.
    static void write_all(int fd, const std::string &bytes, const std::string &rel);
    // "/proc/self/fd/N": a path naming exactly this open file, for loaders that take a path.
    static std::string fd_path(int fd);

private:
    unique_fd open_parent(const std::string &rel, std::string &leaf) const;
    unique_fd root_;
};

// Speculative decoding for `generate` (docs/daemon-protocol.md): drafts from n-grams of the history
// ("ngram") or from the sessions' own drafter ("session": DeepSeek V4's MTP head or DSpark, loaded with
// the engine); none when the working session cannot roll back. Greedy output is unchanged.
struct daemon_spec {
    std::string mode = "none";  // none | ngram | session
    spec::ngram_options ngram;
};

class daemon {
public:
    using loader = std::function<std::unique_ptr<engine>()>;
    // `load` is called now and again on "unpark"; root must be an existing directory.
    // default_drafter: the drafter `compress ... default` uses ("" = none; others are paths in root).
    // prompt_cache: the disk prompt cache (docs/prompt-cache.md; dir "" = none): `generate` loads the
    // entry sharing the longest prefix with its prompt when it beats what the working session holds by
    // min_tokens, and saves the working session afterwards.
    daemon(loader load, const std::filesystem::path &root, std::string default_drafter = {},
           cache::options prompt_cache = {}, daemon_spec spec = {});
    ~daemon();

    // Handles one command line and returns the reply line (no trailing newline). Blank lines -> "".
    std::string handle(const std::string &line);
    bool done() const { return done_; }
    // Reads commands until "quit" or end of input, writing one reply line each (flushed).
    void run(std::istream &in, std::ostream &out);

private:
    struct snapshot {
        std::vector<int32_t> tokens;
        std::unique_ptr<session> sess;  // holds `tokens` when valid
        bool valid = false;
    };
    std::string cmd_generate(const std::vector<std::string> &args);
    std::string cmd_compress(const std::vector<std::string> &args);
    // A file of little-endian int32 token ids (rel: its name in messages), each checked against the vocabulary.
    static std::vector<int32_t> read_ids(int fd, const std::string &rel, const engine &eng);
    // Writes ids to out (int32 LE) or, when out is -1, appends them to the reply.
    static void write_or_append_ids(const std::vector<int32_t> &ids, int out, const std::string &out_rel,
                                    std::string &reply);
    std::string cmd_park(const std::vector<std::string> &args, bool park);
    std::string cmd_slot(const std::string &cmd, const std::vector<std::string> &args);
    std::string cmd_list() const;
    engine &target(const char *cmd);
    void drop_sessions();
    // working_->sync(prompt), first loading a disk entry when one beats what the session holds.
    void sync_working(const std::vector<int32_t> &prompt);

    loader load_;
    confined_root root_;
    std::unique_ptr<engine> eng_;         // null while parked
    std::unique_ptr<session> working_;    // the session generate uses
    std::vector<int32_t> working_tokens_; // kept across park/unpark
    std::map<int, snapshot> slots_;
    std::string default_drafter_;
    std::unique_ptr<pflash::compressor> comp_;  // PFlash drafter state (created by the first compress)
    std::string comp_drafter_;                  // its drafter (path or name in --root, as given)
    unique_fd comp_drafter_fd_;                 // a drafter inside --root, held open while comp_ uses it
    std::unique_ptr<cache::prompt_cache> cache_;  // the disk prompt cache (null: none)
    daemon_spec spec_;
    spec::spec_stats spec_total_;  // summed over generate commands (the `stats` reply)
    bool done_ = false;
};

}  // namespace fathom::server
