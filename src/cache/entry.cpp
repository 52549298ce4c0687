// Prompt-cache entry files: encoder and validating decoder (entry.h; format: docs/prompt-cache.md).
#include "cache/entry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "core/fd_io.h"

namespace fathom::cache {

static_assert(std::endian::native == std::endian::little, "entry files are little-endian");

namespace {

constexpr size_t io_chunk = size_t{1} << 20;  // bytes per read / write / compression call
constexpr int zstd_window_log_max = 24;       // decoder memory cap (16 MiB window); levels <= 19 stay below

using xxh_ptr = std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t *)>;

xxh_ptr new_hash() {
    xxh_ptr h(XXH64_createState(), XXH64_freeState);
    if (!h || XXH64_reset(h.get(), 0) != XXH_OK) throw error("prompt cache: cannot create a hash state");
    return h;
}

template <class T>
void store(uint8_t *p, T v) {
    std::memcpy(p, &v, sizeof v);
}

template <class T>
T load(const uint8_t *p) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

[[noreturn]] void fail(const byte_source &src, entry_error::kind_t k, const std::string &why) {
    throw entry_error(k, src.name() + ": " + why);
}

[[noreturn]] void damaged(const byte_source &src, const std::string &why) {
    fail(src, entry_error::kind_t::damaged, why);
}

std::string u64s(uint64_t v) {
    return std::to_string(v);
}

// Header [64 B] + table [n x 48 B], hash excluded; the layout of docs/prompt-cache.md.
std::vector<uint8_t> encode_header(const entry_header &h) {
    std::vector<uint8_t> b(header_bytes + n_sections_v1 * table_entry_bytes, 0);
    std::memcpy(b.data(), entry_magic, sizeof entry_magic);
    store<uint32_t>(&b[8], h.version);
    store<uint32_t>(&b[12], n_sections_v1);
    store<uint64_t>(&b[16], h.file_bytes);
    store<uint64_t>(&b[24], h.n_tokens);
    store<uint64_t>(&b[32], h.identity_hash);
    store<uint64_t>(&b[40], h.key_hash);
    for (uint32_t i = 0; i < n_sections_v1; ++i) {
        uint8_t *t = &b[header_bytes + i * table_entry_bytes];
        const section &s = h.sections[i];
        store<uint32_t>(t, static_cast<uint32_t>(s.kind));
        store<uint32_t>(t + 4, static_cast<uint32_t>(s.enc));
        store<uint64_t>(t + 8, s.offset);
        store<uint64_t>(t + 16, s.stored);
        store<uint64_t>(t + 24, s.raw);
        store<uint64_t>(t + 32, s.hash);
    }
    return b;
}

// XXH64 over header bytes [0, 56) and the table: the checksum stored at header offset 56.
uint64_t header_hash(const std::vector<uint8_t> &b) {
    xxh_ptr h = new_hash();
    XXH64_update(h.get(), b.data(), 56);
    XXH64_update(h.get(), b.data() + header_bytes, b.size() - header_bytes);
    return XXH64_digest(h.get());
}

// The state section's state_writer: buffers io_chunk bytes, then appends them (raw) or their zstd
// compression to the sink, hashing what is stored.
class section_writer final : public state_writer {
  public:
    section_writer(byte_sink &out, int zstd_level) : out_(out), hash_(new_hash()) {
        buf_.reserve(io_chunk);
        if (zstd_level > 0) {
            cctx_ = ZSTD_createCCtx();
            if (!cctx_) throw error("prompt cache: cannot create a zstd context");
            ZSTD_CCtx_setParameter(cctx_, ZSTD_c_compressionLevel, std::min(zstd_level, 19));
            zbuf_.resize(ZSTD_CStreamOutSize());
        }
    }
    ~section_writer() override { ZSTD_freeCCtx(cctx_); }
    void write(const void *data, size_t n) override {
        const auto *p = static_cast<const uint8_t *>(data);
        raw_ += n;
        while (n > 0) {
            const size_t k = std::min(n, io_chunk - buf_.size());
            buf_.insert(buf_.end(), p, p + k);
            p += k;
            n -= k;
            if (buf_.size() == io_chunk) flush(false);
        }
    }
    // Writes what is buffered (and the zstd frame's end); returns (stored, raw) byte counts.
    std::pair<uint64_t, uint64_t> finish(uint64_t &hash) {
        flush(true);
        hash = XXH64_digest(hash_.get());
        return {stored_, raw_};
    }

  private:
    void put(const void *p, size_t n) {
        out_.append(p, n);
        XXH64_update(hash_.get(), p, n);
        stored_ += n;
    }
    void flush(bool end) {
        if (!cctx_) {
            if (!buf_.empty()) put(buf_.data(), buf_.size());
            buf_.clear();
            return;
        }
        ZSTD_inBuffer in{buf_.data(), buf_.size(), 0};
        const ZSTD_EndDirective mode = end ? ZSTD_e_end : ZSTD_e_continue;
        for (;;) {
            ZSTD_outBuffer zo{zbuf_.data(), zbuf_.size(), 0};
            const size_t left = ZSTD_compressStream2(cctx_, &zo, &in, mode);
            if (ZSTD_isError(left))
                throw error(std::string("prompt cache: zstd: ") + ZSTD_getErrorName(left));
            if (zo.pos > 0) put(zbuf_.data(), zo.pos);
            if (end ? left == 0 : in.pos == in.size) break;
        }
        buf_.clear();
    }
    byte_sink &out_;
    xxh_ptr hash_;
    std::vector<uint8_t> buf_, zbuf_;
    ZSTD_CCtx *cctx_ = nullptr;
    uint64_t stored_ = 0, raw_ = 0;
};

}  // namespace

uint64_t entry_key(std::string_view identity, std::span<const int32_t> tokens) {
    xxh_ptr h = new_hash();
    XXH64_update(h.get(), identity.data(), identity.size());
    XXH64_update(h.get(), tokens.data(), tokens.size_bytes());
    return XXH64_digest(h.get());
}

std::string entry_file_name(uint64_t key) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%016" PRIx64 ".fpc", key);
    return buf;
}

// ---- sources and sinks -----------------------------------------------------------------------------

fd_source::fd_source(int fd, std::string name) : fd_(fd), name_(std::move(name)) {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw error(name_ + ": fstat: " + std::strerror(errno));
    size_ = static_cast<uint64_t>(st.st_size);
}

void fd_source::read_at(uint64_t offset, void *dst, size_t n) const {
    auto *p = static_cast<uint8_t *>(dst);
    while (n > 0) {
        const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) throw error(name_ + ": read: " + std::strerror(errno));
        if (r == 0) damaged(*this, "ends at byte " + u64s(offset) + " (shorter than when it was opened)");
        p += r;
        n -= static_cast<size_t>(r);
        offset += static_cast<uint64_t>(r);
    }
}

void memory_source::read_at(uint64_t offset, void *dst, size_t n) const {
    if (offset > b_.size() || n > b_.size() - offset) damaged(*this, "read past the end");
    std::memcpy(dst, b_.data() + offset, n);
}

void fd_sink::append(const void *data, size_t n) { fd_write_all(fd_, data, n, name_); }

void fd_sink::write_at(uint64_t offset, const void *data, size_t n) {
    const auto *p = static_cast<const uint8_t *>(data);
    while (n > 0) {
        const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) throw error(name_ + ": write: " + std::strerror(errno));
        p += w;
        n -= static_cast<size_t>(w);
        offset += static_cast<uint64_t>(w);
    }
}

void memory_sink::append(const void *data, size_t n) {
    const auto *p = static_cast<const uint8_t *>(data);
    bytes.insert(bytes.end(), p, p + n);
}

void memory_sink::write_at(uint64_t offset, const void *data, size_t n) {
    if (offset > bytes.size() || n > bytes.size() - offset) throw error("memory sink: write past the end");
    std::memcpy(bytes.data() + offset, data, n);
}

// ---- encoding --------------------------------------------------------------------------------------

uint64_t write_entry(byte_sink &out, std::string_view identity, std::span<const int32_t> tokens,
                     int zstd_level, const std::function<bool(state_writer &)> &fill) {
    if (identity.empty() || identity.size() > max_identity_bytes)
        throw error("prompt cache: identity of " + std::to_string(identity.size()) + " bytes (1.." +
                    std::to_string(max_identity_bytes) + ")");
    if (tokens.empty() || tokens.size() > max_tokens)
        throw error("prompt cache: " + std::to_string(tokens.size()) + " tokens (1.." +
                    std::to_string(max_tokens) + ")");
    entry_header h;
    h.n_tokens = tokens.size();
    h.identity_hash = XXH64(identity.data(), identity.size(), 0);
    h.key_hash = entry_key(identity, tokens);
    const std::vector<uint8_t> zeros(header_bytes + n_sections_v1 * table_entry_bytes, 0);
    out.append(zeros.data(), zeros.size());
    uint64_t at = zeros.size();
    const auto raw_section = [&](section &s, section_kind k, const void *p, size_t n) {
        s = {k, codec::raw, at, n, n, XXH64(p, n, 0)};
        out.append(p, n);
        at += n;
    };
    raw_section(h.sections[0], section_kind::identity, identity.data(), identity.size());
    raw_section(h.sections[1], section_kind::tokens, tokens.data(), tokens.size_bytes());
    section_writer sw(out, zstd_level);
    if (!fill(sw)) return 0;
    section &st = h.sections[2];
    st.kind = section_kind::state;
    st.enc = zstd_level > 0 ? codec::zstd : codec::raw;
    st.offset = at;
    std::tie(st.stored, st.raw) = sw.finish(st.hash);
    if (st.raw > max_state_bytes)
        throw error("prompt cache: state of " + u64s(st.raw) + " bytes is over the limit");
    h.file_bytes = at + st.stored;
    std::vector<uint8_t> hb = encode_header(h);
    store<uint64_t>(&hb[56], header_hash(hb));
    out.write_at(0, hb.data(), hb.size());
    return h.file_bytes;
}

// ---- decoding --------------------------------------------------------------------------------------

entry_header read_header(const byte_source &src) {
    const uint64_t size = src.size(), fixed = header_bytes + n_sections_v1 * table_entry_bytes;
    if (size < header_bytes) damaged(src, "truncated: " + u64s(size) + " bytes, the header alone needs 64");
    std::vector<uint8_t> b(fixed, 0);
    src.read_at(0, b.data(), header_bytes);
    if (std::memcmp(b.data(), entry_magic, sizeof entry_magic) != 0)
        damaged(src, "not a prompt-cache entry (bad magic)");
    entry_header h;
    h.version = load<uint32_t>(&b[8]);
    if (h.version != entry_version)
        fail(src, entry_error::kind_t::foreign,
             "format version " + std::to_string(h.version) + " (this build reads " +
                 std::to_string(entry_version) + ")");
    const uint32_t n_sec = load<uint32_t>(&b[12]);
    if (n_sec != n_sections_v1) damaged(src, std::to_string(n_sec) + " sections (version 1 has 3)");
    if (size < fixed)
        damaged(src, "truncated: " + u64s(size) + " bytes, the header and section table need " + u64s(fixed));
    src.read_at(header_bytes, b.data() + header_bytes, fixed - header_bytes);
    if (load<uint64_t>(&b[56]) != header_hash(b)) damaged(src, "header checksum mismatch");
    h.file_bytes = load<uint64_t>(&b[16]);
    h.n_tokens = load<uint64_t>(&b[24]);
    h.identity_hash = load<uint64_t>(&b[32]);
    h.key_hash = load<uint64_t>(&b[40]);
    if (load<uint64_t>(&b[48]) != 0) damaged(src, "reserved header field is not zero");
    if (h.file_bytes != size)
        damaged(src, h.file_bytes > size ? "truncated: " + u64s(size) + " of " + u64s(h.file_bytes) + " bytes"
                                         : u64s(size - h.file_bytes) + " bytes after the end of the entry");
    if (h.n_tokens == 0 || h.n_tokens > max_tokens)
        damaged(src, u64s(h.n_tokens) + " tokens (1.." + u64s(max_tokens) + ")");
    uint64_t at = fixed;
    for (uint32_t i = 0; i < n_sections_v1; ++i) {
        const uint8_t *t = &b[header_bytes + i * table_entry_bytes];
        section &s = h.sections[i];
        s = {static_cast<section_kind>(load<uint32_t>(t)),
             static_cast<codec>(load<uint32_t>(t + 4)),
             load<uint64_t>(t + 8),
             load<uint64_t>(t + 16),
             load<uint64_t>(t + 24),
             load<uint64_t>(t + 32)};
        const std::string which = "section " + std::to_string(i);
        if (static_cast<uint32_t>(s.kind) != i + 1)
            damaged(src, which + " has kind " + std::to_string(uint32_t(s.kind)));
        if (load<uint64_t>(t + 40) != 0) damaged(src, which + ": reserved field is not zero");
        const bool may_zstd = s.kind == section_kind::state;
        if (s.enc != codec::raw && !(may_zstd && s.enc == codec::zstd))
            damaged(src, which + " has codec " + std::to_string(uint32_t(s.enc)));
        if (s.offset != at) damaged(src, which + " starts at " + u64s(s.offset) + ", not " + u64s(at));
        if (s.stored > size - at) damaged(src, which + " of " + u64s(s.stored) + " bytes runs past the end");
        if (s.enc == codec::raw && s.raw != s.stored)
            damaged(src, which + ": raw length differs from stored length");
        at += s.stored;
    }
    if (at != size) damaged(src, "sections end at " + u64s(at) + " of " + u64s(size) + " bytes");
    const section &id = h.sections[0], &tk = h.sections[1], &st = h.sections[2];
    if (id.stored == 0 || id.stored > max_identity_bytes)
        damaged(src, "identity of " + u64s(id.stored) + " bytes");
    if (tk.stored != 4 * h.n_tokens)
        damaged(src, "token section of " + u64s(tk.stored) + " bytes for " + u64s(h.n_tokens) + " tokens");
    if (st.raw == 0 || st.raw > max_state_bytes) damaged(src, "state of " + u64s(st.raw) + " bytes");
    return h;
}

namespace {

// A raw section's bytes (at most max(identity, tokens) sizes: bounded above), checksum verified.
std::vector<uint8_t> read_raw_section(const byte_source &src, const section &s, const char *what) {
    std::vector<uint8_t> b(static_cast<size_t>(s.stored));
    src.read_at(s.offset, b.data(), b.size());
    if (XXH64(b.data(), b.size(), 0) != s.hash) damaged(src, std::string(what) + " checksum mismatch");
    return b;
}

}  // namespace

std::string read_identity(const byte_source &src, const entry_header &h) {
    const std::vector<uint8_t> b = read_raw_section(src, h.sections[0], "identity");
    std::string id(b.begin(), b.end());
    if (XXH64(id.data(), id.size(), 0) != h.identity_hash) damaged(src, "identity does not match its hash");
    return id;
}

std::vector<int32_t> read_tokens(const byte_source &src, const entry_header &h) {
    const std::vector<uint8_t> b = read_raw_section(src, h.sections[1], "tokens");
    std::vector<int32_t> t(static_cast<size_t>(h.n_tokens));
    std::memcpy(t.data(), b.data(), b.size());
    for (int32_t id : t)
        if (id < 0) damaged(src, "negative token id " + std::to_string(id));
    return t;
}

// ---- state section reader ---------------------------------------------------------------------------

state_section_reader::state_section_reader(const byte_source &src, const section &s)
    : src_(src), s_(s), raw_left_(s.raw), hash_(new_hash()) {
    buf_.resize(static_cast<size_t>(std::min<uint64_t>(io_chunk, std::max<uint64_t>(s.stored, 1))));
    if (s.enc == codec::zstd) {
        dctx_ = ZSTD_createDCtx();
        if (!dctx_) throw error("prompt cache: cannot create a zstd context");
        ZSTD_DCtx_setParameter(static_cast<ZSTD_DCtx *>(dctx_), ZSTD_d_windowLogMax, zstd_window_log_max);
    }
}

state_section_reader::~state_section_reader() {
    ZSTD_freeDCtx(static_cast<ZSTD_DCtx *>(dctx_));
}

void state_section_reader::damaged(const std::string &why) const {
    cache::damaged(src_, "state section: " + why);
}

void state_section_reader::fill_input() {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf_.size(), s_.stored - stored_read_));
    if (n == 0)
        damaged("ends early (" + u64s(s_.stored) + " stored bytes, " + u64s(raw_left_) +
                " bytes still expected)");
    src_.read_at(s_.offset + stored_read_, buf_.data(), n);
    XXH64_update(hash_.get(), buf_.data(), n);
    stored_read_ += n;
    buf_pos_ = 0;
    buf_len_ = n;
}

void state_section_reader::read(void *dst, size_t n) {
    if (n > raw_left_)
        throw entry_error(entry_error::kind_t::damaged, src_.name() + ": state section: the session reads " +
                                                            std::to_string(n) + " bytes, " + u64s(raw_left_) +
                                                            " are left");
    auto *p = static_cast<uint8_t *>(dst);
    if (!dctx_) {
        for (size_t done = 0; done < n;) {
            if (buf_pos_ == buf_len_) fill_input();
            const size_t k = std::min(n - done, buf_len_ - buf_pos_);
            std::memcpy(p + done, buf_.data() + buf_pos_, k);
            buf_pos_ += k;
            done += k;
        }
    } else {
        ZSTD_outBuffer out{p, n, 0};
        while (out.pos < n) {
            if (frame_done_) damaged("the zstd frame ends before the promised " + u64s(s_.raw) + " bytes");
            if (buf_pos_ == buf_len_) fill_input();
            ZSTD_inBuffer in{buf_.data(), buf_len_, buf_pos_};
            const size_t r = ZSTD_decompressStream(static_cast<ZSTD_DCtx *>(dctx_), &out, &in);
            if (ZSTD_isError(r)) damaged(std::string("zstd: ") + ZSTD_getErrorName(r));
            buf_pos_ = in.pos;
            frame_done_ = r == 0;
        }
    }
    raw_left_ -= n;
}

void state_section_reader::finish() {
    std::vector<uint8_t> sink(64 << 10);
    while (raw_left_ > 0) read(sink.data(), static_cast<size_t>(std::min<uint64_t>(raw_left_, sink.size())));
    if (dctx_) {
        // The frame's end may follow the last decoded byte: decode on, expecting no more output.
        while (!frame_done_) {
            if (buf_pos_ == buf_len_) {
                if (stored_read_ == s_.stored) damaged("the zstd frame is incomplete");
                fill_input();
            }
            uint8_t extra = 0;
            ZSTD_outBuffer out{&extra, 1, 0};
            ZSTD_inBuffer in{buf_.data(), buf_len_, buf_pos_};
            const size_t r = ZSTD_decompressStream(static_cast<ZSTD_DCtx *>(dctx_), &out, &in);
            if (ZSTD_isError(r)) damaged(std::string("zstd: ") + ZSTD_getErrorName(r));
            if (out.pos > 0) damaged("decodes to more than the promised " + u64s(s_.raw) + " bytes");
            buf_pos_ = in.pos;
            frame_done_ = r == 0;
        }
        if (buf_pos_ != buf_len_ || stored_read_ != s_.stored)
            damaged("bytes after the end of the zstd frame");
    }
    if (stored_read_ != s_.stored) damaged("not all stored bytes were read");
    if (XXH64_digest(hash_.get()) != s_.hash) damaged("checksum mismatch");
}

void state_section_reader::verify_stored() {
    while (stored_read_ < s_.stored) fill_input();
    buf_pos_ = buf_len_;  // nothing more to decode from this reader
    raw_left_ = 0;
    if (XXH64_digest(hash_.get()) != s_.hash) damaged("checksum mismatch");
}

entry_header check_entry(const byte_source &src) {
    const entry_header h = read_header(src);
    const std::string id = read_identity(src, h);
    const std::vector<int32_t> toks = read_tokens(src, h);
    if (entry_key(id, toks) != h.key_hash) damaged(src, "key does not match the identity and tokens");
    state_section_reader r(src, h.sections[2]);
    r.finish();
    return h;
}

}  // namespace fathom::cache
