// Helpers shared by the prompt-cache suites (tests/cache): temporary directories, in-memory state
// streams, a model-free session whose state is a known byte pattern, and entry files built in memory.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "cache/entry.h"
#include "fathom/engine.h"

namespace fathom::cache_test {

// A fresh directory under the test temp dir, removed with everything in it at scope exit.
struct temp_dir {
    std::string path;
    temp_dir() {
        std::string t = ::testing::TempDir() + "/fathom_cache_XXXXXX";
        if (!::mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
        path = t;
    }
    ~temp_dir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    std::vector<std::string> files() const {
        std::vector<std::string> out;
        for (const auto &e : std::filesystem::directory_iterator(path))
            out.push_back(e.path().filename().string());
        std::sort(out.begin(), out.end());
        return out;
    }
};

struct vector_writer final : state_writer {
    std::vector<uint8_t> bytes;
    void write(const void *data, size_t n) override {
        const auto *p = static_cast<const uint8_t *>(data);
        bytes.insert(bytes.end(), p, p + n);
    }
};

struct vector_reader final : state_reader {
    const std::vector<uint8_t> &bytes;
    size_t pos = 0;
    explicit vector_reader(const std::vector<uint8_t> &b) : bytes(b) {}
    void read(void *dst, size_t n) override {
        if (n > bytes.size() - pos) throw error("vector_reader: stream ends early");
        std::memcpy(dst, bytes.data() + pos, n);
        pos += n;
    }
    uint64_t remaining() const override { return bytes.size() - pos; }
};

// Deterministic state bytes for `tokens`: every byte depends on the tokens and its position, so a
// load can check what it reads.
inline uint8_t pattern_byte(std::span<const int32_t> tokens, uint64_t i) {
    uint64_t h = i * 0x9e3779b97f4a7c15ull + tokens.size();
    if (!tokens.empty()) h ^= uint64_t(tokens[i % tokens.size()]) * 0xbf58476d1ce4e5b9ull;
    return uint8_t(h >> 29);
}

// A session without a model: holds tokens; its state is `state_bytes` pattern bytes (written in
// pieces of `piece` bytes, sleeping `sleep_us` after each, so a test can kill a writer halfway).
// load_state checks every byte and keeps any prefix.
class pattern_session final : public session {
  public:
    explicit pattern_session(uint64_t state_bytes = 4096) : state_bytes_(state_bytes) {}
    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &) override {
        toks_.assign(prefix.begin(), prefix.end());
    }
    void eval(std::span<const int32_t> t, float *) override { toks_.insert(toks_.end(), t.begin(), t.end()); }
    std::span<const float> logits() const override { return {}; }
    int64_t n_past() const override { return int64_t(toks_.size()); }
    const std::vector<int32_t> &tokens() const override { return toks_; }
    void reset() override { toks_.clear(); }
    bool save_state(state_writer &w) const override {
        std::vector<uint8_t> buf;
        for (uint64_t i = 0; i < state_bytes_; i += piece) {
            buf.resize(size_t(std::min<uint64_t>(piece, state_bytes_ - i)));
            for (size_t k = 0; k < buf.size(); ++k) buf[k] = pattern_byte(toks_, i + k);
            w.write(buf.data(), buf.size());
            if (sleep_us > 0) ::usleep(useconds_t(sleep_us));
        }
        return true;
    }
    bool load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) override {
        toks_.clear();
        if (on_load) on_load();
        if (load_throws_std) throw std::bad_alloc();  // not a fathom::error
        if (r.remaining() != state_bytes_)
            throw error("pattern: state of " + std::to_string(r.remaining()) + " bytes");
        std::vector<uint8_t> buf(4096);
        for (uint64_t i = 0; i < state_bytes_; i += buf.size()) {
            const size_t n = size_t(std::min<uint64_t>(buf.size(), state_bytes_ - i));
            r.read(buf.data(), n);
            for (size_t k = 0; k < n; ++k)
                if (buf[k] != pattern_byte(tokens, i + k))
                    throw error("pattern: byte " + std::to_string(i + k) + " differs");
        }
        if (n_keep < 1 || n_keep > int64_t(tokens.size())) throw error("pattern: bad n_keep");
        toks_.assign(tokens.begin(), tokens.begin() + n_keep);
        return true;
    }
    bool loads_state_prefix() const override { return prefix_loads; }

    uint64_t piece = 1024;
    int sleep_us = 0;
    bool prefix_loads = true;
    bool load_throws_std = false;   // load_state throws std::bad_alloc (memory, not the stream)
    std::function<void()> on_load;  // called as load_state starts (another process acting meanwhile)

  private:
    uint64_t state_bytes_;
    std::vector<int32_t> toks_;
};

inline std::vector<int32_t> tokens_of(size_t n, int salt) {
    std::vector<int32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = int32_t((i * 7919 + size_t(salt) * 104729) % 50000);
    return t;
}

// An entry in memory for `tokens` with a pattern state of `state_bytes` bytes.
inline std::vector<uint8_t> make_entry(const std::string &identity, const std::vector<int32_t> &tokens,
                                       uint64_t state_bytes, int zstd_level = 0) {
    pattern_session s(state_bytes);
    s.sync(tokens, {});
    cache::memory_sink sink;
    cache::write_entry(sink, identity, tokens, zstd_level, [&](state_writer &w) { return s.save_state(w); });
    return sink.bytes;
}

// An entry assembled byte by byte from docs/prompt-cache.md ("Entry file (format version 1)"), not
// through write_entry, so the documented layout and the code are held to each other. state: the state
// section's stored bytes; codec 0 raw, 1 zstd; raw: its decoded length.
inline std::vector<uint8_t> doc_entry(const std::string &identity, const std::vector<int32_t> &tokens,
                                      const std::vector<uint8_t> &state, uint32_t codec, uint64_t raw) {
    const auto put = [](std::vector<uint8_t> &b, size_t at, auto v) { std::memcpy(&b[at], &v, sizeof v); };
    const uint64_t table = 64, id_at = table + 3 * 48, tok_at = id_at + identity.size(),
                   st_at = tok_at + 4 * tokens.size();
    std::vector<uint8_t> b(st_at + state.size(), 0);
    std::memcpy(&b[id_at], identity.data(), identity.size());
    std::memcpy(&b[tok_at], tokens.data(), 4 * tokens.size());
    std::memcpy(&b[st_at], state.data(), state.size());
    std::memcpy(&b[0], "FATHOMPC", 8);
    put(b, 8, uint32_t{1});
    put(b, 12, uint32_t{3});
    put(b, 16, uint64_t(b.size()));
    put(b, 24, uint64_t(tokens.size()));
    put(b, 32, uint64_t(XXH64(identity.data(), identity.size(), 0)));
    // The key: XXH64 of the identity followed by the tokens (little-endian int32), i.e. of bytes the
    // file holds back to back.
    put(b, 40, uint64_t(XXH64(&b[id_at], identity.size() + 4 * tokens.size(), 0)));
    const struct {
        uint64_t at, stored, raw;
        uint32_t codec;
    } secs[3] = {{id_at, identity.size(), identity.size(), 0},
                 {tok_at, 4 * tokens.size(), 4 * tokens.size(), 0},
                 {st_at, state.size(), raw, codec}};
    for (uint32_t i = 0; i < 3; ++i) {
        const size_t t = table + 48 * i;
        put(b, t, i + 1);
        put(b, t + 4, secs[i].codec);
        put(b, t + 8, secs[i].at);
        put(b, t + 16, secs[i].stored);
        put(b, t + 24, secs[i].raw);
        put(b, t + 32, uint64_t(XXH64(&b[secs[i].at], secs[i].stored, 0)));
    }
    // Header checksum: XXH64 of bytes 0..55 followed by the section table.
    std::vector<uint8_t> h(b.begin(), b.begin() + 56);
    h.insert(h.end(), b.begin() + table, b.begin() + id_at);
    put(b, 56, uint64_t(XXH64(h.data(), h.size(), 0)));
    return b;
}

}  // namespace fathom::cache_test
