// The on-disk prompt cache: a directory of entry files (entry.h), each the saved state of a session
// (session::save_state) under the name of its key, XXH64(engine identity, tokens). The server's
// scheduler (src/sched) loads the entry sharing the longest prefix with a prompt into a slot's session
// instead of evaluating that prefix, and saves what a session holds when a request ends.
//
// Crash safety (docs/prompt-cache.md has the argument): an entry is written to a temporary file in the
// same directory (O_EXCL, a name with the pid and a random suffix), fsync'd, renamed over its final name
// (atomic) and the directory fsync'd; readers verify every checksum. So a reader sees a whole entry or
// none, a writer killed at any point leaves only a temporary file (removed later), and entries are
// never modified in place. Several threads of a process share one prompt_cache; several processes may
// share the directory (each keeps its own index and picks up the others' entries on refresh).
//
// Index: in memory, built from the directory (header and tokens of every entry of this identity;
// size and modification time of all entries) and refreshed at most every refresh_interval. Lookups
// never touch the disk beyond that refresh. LRU: a hit sets the file's modification time to now;
// when the entries' total size exceeds max_bytes, the oldest are deleted (any identity: the cap is
// the directory's). Damaged entries are deleted when found; entries of another identity or format
// version are left alone (another server may use them) but count towards the cap.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fathom/engine.h"

namespace fathom::cache {

struct options {
    std::string dir;                         // the cache directory (created if missing); "" = no cache
    uint64_t max_bytes = uint64_t{8} << 30;  // cap on the entries' total size
    int64_t min_tokens = 32;                 // token sequences shorter than this are not saved
    int zstd_level = 0;                      // 0: state stored raw; 1..19: zstd at that level
    // Sessions that load only whole states (DS4): the scheduler also saves an entry each time a running
    // request's session grew by this many tokens since its last save (prompt chunks and generated
    // tokens), so a crash or a later request resumes from the longest saved prefix. 0 = off.
    int64_t save_every = 0;
    std::chrono::milliseconds refresh_interval{
        2000};  // how stale the view of other processes' entries may get
};

struct stats {
    uint64_t entries = 0, bytes = 0;  // entry files in the directory (every identity) and their size
    uint64_t rejected = 0;            // damaged entries found (and deleted)
    uint64_t saves = 0, save_failures = 0, evictions = 0;
};

class prompt_cache {
  public:
    // Creates the directory if needed, removes temporary files left by dead writers, indexes the
    // entries and evicts down to the cap. identity: engine::state_identity() (non-empty). Throws
    // fathom::error when the directory cannot be created or read.
    prompt_cache(options o, std::string identity);
    ~prompt_cache();
    prompt_cache(const prompt_cache &) = delete;
    prompt_cache &operator=(const prompt_cache &) = delete;

    const options &opts() const { return opts_; }

    struct match {
        std::string name;                                    // entry file name
        std::shared_ptr<const std::vector<int32_t>> tokens;  // the tokens the entry holds
        int64_t n_keep = 0;  // tokens the session holds after loading it (a prefix of the prompt)
    };
    // The entry leaving a session with the longest prefix of `prompt`: with prefix_loads
    // (session::loads_state_prefix) any entry, kept up to its common prefix with the prompt; otherwise
    // only entries that are themselves a prefix of the prompt. nullopt when none shares a token.
    std::optional<match> lookup(std::span<const int32_t> prompt, bool prefix_loads);
    // Whether an entry holding exactly `tokens` exists (a save would be redundant).
    bool contains(std::span<const int32_t> tokens);

    // Loads m into s (session::load_state with m.n_keep). On failure s holds nothing, `why` says what
    // went wrong, and a damaged entry is deleted (counted in stats::rejected) unless another writer has
    // replaced the file meanwhile. Any exception (the session's too) is a failure, never thrown: the
    // scheduler's I/O thread calls this. A hit marks the entry recently used.
    bool load(const match &m, session &s, std::string &why);
    // Saves what s holds (s.tokens()) as an entry. The state is first copied into memory; then
    // `released` (if set) is called, exactly once on every path, and the caller may change s again while
    // the entry is written, fsync'd and renamed (so a session is held for a memory copy, not for the
    // disk). The caller keeps s unchanged until then. saved: a new
    // entry (then evicts down to the cap); exists: an entry for the same tokens, now marked recently
    // used; too_short: fewer than min_tokens; too_large: the entry alone would exceed the cap (not
    // kept); unsupported: the session cannot save; failed: an I/O error (`why`; counted in
    // save_failures). Only `saved` leaves a new file, and no outcome leaves a temporary one.
    enum class save_result { saved, exists, too_short, too_large, unsupported, failed };
    save_result save(const session &s, std::string &why, const std::function<void()> &released = {});

    // Re-reads the directory now (entries of other processes appear, deleted ones go).
    void refresh();
    stats get_stats() const;

  private:
    struct entry_info {
        std::shared_ptr<const std::vector<int32_t>> tokens;  // null: another identity or version
        uint64_t bytes = 0;
        int64_t mtime_ns = 0;
    };
    std::string path_of(const std::string &name) const { return opts_.dir + "/" + name; }
    void refresh_locked();
    void maybe_refresh_locked();
    // Reads a new file's header (and, for this identity, its tokens) into the index; deletes it
    // when damaged.
    void index_file_locked(const std::string &name);
    void remove_locked(const std::string &name, bool delete_file);
    void evict_locked(uint64_t incoming);
    void touch_locked(const std::string &name);
    void remove_stale_temps();

    options opts_;
    std::string identity_;
    mutable std::mutex mu_;
    std::map<std::string, entry_info> index_;  // file name -> entry
    uint64_t total_bytes_ = 0;
    stats stats_;
    std::chrono::steady_clock::time_point last_refresh_{};
};

}  // namespace fathom::cache
