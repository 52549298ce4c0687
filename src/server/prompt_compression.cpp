// Server-side PFlash policy (see prompt_compression.h).
#include "server/prompt_compression.h"

#include <chrono>
#include <cmath>
#include <filesystem>

namespace fathom::server {

compression_mode parse_compression_mode(const std::string &s, const std::string &what) {
    if (s == "off") return compression_mode::off;
    if (s == "auto") return compression_mode::auto_;
    if (s == "always") return compression_mode::always;
    throw error(what + " must be off, auto or always (got '" + s + "')");
}

const char *compression_mode_name(compression_mode m) {
    switch (m) {
        case compression_mode::off: return "off";
        case compression_mode::auto_: return "auto";
        case compression_mode::always: return "always";
    }
    return "?";
}

void compression_options::validate() const {
    pflash::validate_keep_ratio(keep_ratio, "--prefill-keep-ratio");
    if (threshold < 1) throw error("--prefill-threshold must be >= 1 (got " + std::to_string(threshold) + ")");
    if (n_threads < 0) throw error("drafter threads must be >= 0");
    pflash::validate_drafter_device(drafter_device, "--drafter-device");
    if (mode != compression_mode::off && drafter_path.empty())
        throw error(std::string("--prefill-compression ") + compression_mode_name(mode) +
                    " needs a drafter (--prefill-drafter PATH)");
    if (!drafter_path.empty()) {
        std::error_code ec;
        if (!std::filesystem::is_regular_file(drafter_path, ec))
            throw error("--prefill-drafter '" + drafter_path + "': no such file");
    }
}

prompt_compressor::prompt_compressor(compression_options o) : opts_(std::move(o)) { opts_.validate(); }

prompt_compressor::~prompt_compressor() = default;

compression_mode prompt_compressor::check(const compression_request &req) const {
    const compression_mode mode =
        req.mode.empty() ? opts_.mode : parse_compression_mode(req.mode, "'prefill_compression'");
    if (req.keep_ratio >= 0.0) pflash::validate_keep_ratio(req.keep_ratio, "'prefill_keep_ratio'");
    if (mode != compression_mode::off && !has_drafter())
        throw error(std::string("'prefill_compression': ") + compression_mode_name(mode) +
                    " needs a drafter, and this server has none (start it with --prefill-drafter PATH)");
    return mode;
}

bool prompt_compressor::would_compress(int64_t n_prompt, int64_t n_ctx, const compression_request &req) const {
    const compression_mode mode = check(req);
    const int64_t threshold = req.threshold >= 0 ? req.threshold : opts_.threshold;
    if (mode == compression_mode::off) return false;
    return mode == compression_mode::always || n_prompt >= threshold || n_prompt >= n_ctx;
}

compression_outcome prompt_compressor::apply(const engine &target, std::vector<int32_t> &prompt, int64_t n_ctx,
                                             const compression_request &req) {
    compression_outcome out;
    out.n_original = out.n_effective = int64_t(prompt.size());
    const double ratio = req.keep_ratio >= 0.0 ? req.keep_ratio : opts_.keep_ratio;
    if (!would_compress(int64_t(prompt.size()), n_ctx, req)) return out;

    std::lock_guard<std::mutex> lk(mu_);
    const auto t0 = std::chrono::steady_clock::now();  // after the lock: waiting is not compression time
    try {
        if (!c_) {
            pflash::options po;
            po.drafter_path = opts_.drafter_path;
            po.keep_ratio = ratio;
            po.residency = opts_.residency;
            po.n_threads = opts_.n_threads;
            po.drafter_device = opts_.drafter_device;
            c_ = pflash::compressor::create(po);
        }
        c_->set_keep_ratio(ratio);
        c_->set_verbatim(req.verbatim_system, req.verbatim_last_user);
        pflash::result r = c_->compress(target, prompt);
        prompt = std::move(r.tokens);
    } catch (const error &) {
        ++stats_.failures;
        throw;
    }
    out.applied = true;
    out.keep_ratio = ratio;
    out.n_effective = int64_t(prompt.size());
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++stats_.requests;
    stats_.tokens_original += uint64_t(out.n_original);
    stats_.tokens_effective += uint64_t(out.n_effective);
    stats_.seconds += out.seconds;
    return out;
}

compression_stats prompt_compressor::stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
}

}  // namespace fathom::server
