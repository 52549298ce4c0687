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
#include "fathom/pflash.h"

namespace fathom::server {

// Resolves `rel` inside `root`. Rejects empty and absolute paths, any ".." component, and paths
// whose real location (symlinks resolved) is outside root. must_exist: the file must exist
// (input); otherwise its parent directory must exist (output). Throws fathom::error.
std::filesystem::path confine_path(const std::filesystem::path &root, const std::string &rel, bool must_exist);

class daemon {
public:
    using loader = std::function<std::unique_ptr<engine>()>;
    // `load` is called now and again on "unpark"; root must be an existing directory.
    // default_drafter: the drafter `compress ... default` uses ("" = none; others are paths in root).
    // prompt_cache: the disk prompt cache (docs/prompt-cache.md; dir "" = none): `generate` loads the
    // entry sharing the longest prefix with its prompt when it beats what the working session holds by
    // min_tokens, and saves the working session afterwards.
    daemon(loader load, const std::filesystem::path &root, std::string default_drafter = {},
           cache::options prompt_cache = {});
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
    std::vector<int32_t> read_ids(const std::string &rel, const engine &eng) const;
    void write_or_append_ids(const std::vector<int32_t> &ids, const std::string &out_rel, std::string &reply) const;
    std::string cmd_park(const std::vector<std::string> &args, bool park);
    std::string cmd_slot(const std::string &cmd, const std::vector<std::string> &args);
    std::string cmd_list() const;
    engine &target(const char *cmd);
    void drop_sessions();
    // working_->sync(prompt), first loading a disk entry when one beats what the session holds.
    void sync_working(const std::vector<int32_t> &prompt);

    loader load_;
    std::filesystem::path root_;
    std::unique_ptr<engine> eng_;         // null while parked
    std::unique_ptr<session> working_;    // the session generate uses
    std::vector<int32_t> working_tokens_; // kept across park/unpark
    std::map<int, snapshot> slots_;
    std::string default_drafter_;
    std::unique_ptr<pflash::compressor> comp_;  // PFlash drafter state (created by the first compress)
    std::string comp_drafter_;                  // its drafter path
    std::unique_ptr<cache::prompt_cache> cache_;  // the disk prompt cache (null: none)
    bool done_ = false;
};

}  // namespace fathom::server
