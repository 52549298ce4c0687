// PFlash in the server: decides per request whether the prompt is compressed by the drafter
// (include/fathom/pflash.h) before it is submitted to the scheduler, applies the request's
// overrides, and keeps the counters /metrics reports. docs/pflash.md ("Server and daemon") has the
// rules; docs/server.md the request fields.
//
// Threading: the HTTP threads call apply() concurrently; the compressor (one drafter, not
// thread-safe) is used under a mutex, so compressions run one at a time, in parallel with the
// scheduler's worker (which keeps decoding the running requests meanwhile).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fathom/engine.h"
#include "fathom/pflash.h"

namespace fathom::server {

enum class compression_mode {
    off,     // never compress
    auto_,   // compress prompts of at least `threshold` tokens, and prompts that do not fit the context
    always,  // compress every prompt (short ones come back whole: pflash keeps head + tail chunks)
};
// "off" | "auto" | "always"; throws fathom::error naming `what` otherwise.
compression_mode parse_compression_mode(const std::string &s, const std::string &what);
const char *compression_mode_name(compression_mode m);

struct compression_options {
    compression_mode mode = compression_mode::off;
    int64_t threshold = 4096;     // auto: prompts of at least this many tokens are compressed
    double keep_ratio = 0.2;      // pflash keep ratio, in [0, 1]
    std::string drafter_path;     // GGUF of the drafter; required unless mode is off and no request may enable it
    pflash::drafter_residency residency = pflash::drafter_residency::auto_select;
    int n_threads = 0;            // drafter threads (0 = online cores)
    std::string drafter_device = "cpu";  // pflash::options::drafter_device
    // Throws fathom::error on an invalid field (keep ratio, threshold, a mode that needs a missing drafter).
    void validate() const;
};

// A request's overrides; "unset" values leave the server's setting.
struct compression_request {
    std::string mode;          // "" = server's mode, else off | auto | always
    double keep_ratio = -1.0;  // < 0 = server's keep ratio
    int64_t threshold = -1;    // < 0 = server's threshold
    // The system prompt and the last user message are kept verbatim unless the request sets these false.
    bool verbatim_system = true;
    bool verbatim_last_user = true;
};

struct compression_outcome {
    bool applied = false;        // the drafter ran and the prompt was replaced by the kept tokens
    int64_t n_original = 0;      // prompt tokens before
    int64_t n_effective = 0;     // prompt tokens submitted
    double keep_ratio = 0.0;     // the ratio used (when applied)
    double seconds = 0.0;        // compression wall time (drafter load + scoring + selection)
};

struct compression_stats {
    uint64_t requests = 0;             // prompts compressed
    uint64_t tokens_original = 0, tokens_effective = 0;
    uint64_t failures = 0;             // compressions that threw (the request got an error)
    double seconds = 0.0;
};

class prompt_compressor {
public:
    explicit prompt_compressor(compression_options o);  // validates; the drafter loads on first use
    ~prompt_compressor();

    const compression_options &options() const { return opts_; }
    bool has_drafter() const { return !opts_.drafter_path.empty(); }

    // Decides with the request's overrides whether to compress `prompt` (tokens of `target`; n_ctx is the
    // context the prompt must fit) and, if so, replaces it with the kept tokens. Throws fathom::error for
    // an override this server cannot honour (e.g. "always" without a drafter) or a drafter failure.
    compression_outcome apply(const engine &target, std::vector<int32_t> &prompt, int64_t n_ctx,
                              const compression_request &req);
    // The override checks apply() starts with, alone (the server answers 400 for these, 500 for a drafter
    // failure inside apply()). Returns the mode the request resolves to.
    compression_mode check(const compression_request &req) const;
    // Whether apply() would run the drafter on a prompt of n_prompt tokens (check() included): the
    // streaming endpoints then send their headers first and compress while keeping the client informed.
    bool would_compress(int64_t n_prompt, int64_t n_ctx, const compression_request &req) const;

    compression_stats stats() const;

private:
    compression_options opts_;
    mutable std::mutex mu_;  // guards c_ and stats_
    std::unique_ptr<pflash::compressor> c_;
    compression_stats stats_;
};

}  // namespace fathom::server
