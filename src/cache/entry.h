// One prompt-cache entry file: the on-disk format (docs/prompt-cache.md, byte by byte), its encoder
// and its validating decoder. An entry holds one saved session state: the engine's identity string,
// the tokens the session held and the session's state stream (session::save_state), each in a section
// with its own XXH64; a header with a magic, the format version, the file's length and a checksum of
// itself and the section table comes first.
//
//   [header 64 B][section table: n_sections x 48 B][identity][tokens][state]
//
// Decoding is defensive: every length is checked against the file's real size and fixed limits before
// anything is allocated or read (the only allocation sized by the file is the token array, at most
// max_tokens x 4 bytes and never more than the file holds), every section is verified against its
// checksum, and every failure is an entry_error naming the file and the reason, one line. Nothing here
// knows the directory (prompt_cache.h) or the session's own layout (the engines).
#pragma once
#include <xxhash.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "fathom/engine.h"

namespace fathom::cache {

constexpr char entry_magic[8] = {'F', 'A', 'T', 'H', 'O', 'M', 'P', 'C'};
constexpr uint32_t entry_version = 1;
constexpr uint64_t header_bytes = 64;
constexpr uint64_t table_entry_bytes = 48;
constexpr uint32_t n_sections_v1 = 3;
constexpr uint64_t max_identity_bytes = 4096;
constexpr uint64_t max_tokens = uint64_t{1} << 24;       // 16 Mi tokens (64 MiB of ids)
constexpr uint64_t max_state_bytes = uint64_t{1} << 40;  // 1 TiB decoded

enum class section_kind : uint32_t { identity = 1, tokens = 2, state = 3 };
enum class codec : uint32_t { raw = 0, zstd = 1 };

struct section {
    section_kind kind = section_kind::identity;
    codec enc = codec::raw;
    uint64_t offset = 0;  // from the start of the file
    uint64_t stored = 0;  // bytes in the file
    uint64_t raw = 0;     // bytes once decoded (== stored for codec raw)
    uint64_t hash = 0;    // XXH64 (seed 0) of the stored bytes
};

struct entry_header {
    uint32_t version = entry_version;
    uint64_t file_bytes = 0;
    uint64_t n_tokens = 0;
    uint64_t identity_hash = 0;  // XXH64 of the identity string
    uint64_t key_hash = 0;       // XXH64 of identity then tokens (the file name)
    section sections[n_sections_v1];
};

// Why an entry was refused. damaged: not a well-formed entry (truncated, bit-flipped, bad magic,
// impossible lengths, checksum mismatch); the directory deletes it. foreign: a well-formed header of
// another format version, or another engine identity; left alone (another server may use it).
class entry_error : public error {
  public:
    enum class kind_t { damaged, foreign };
    entry_error(kind_t k, const std::string &msg) : error(msg), kind(k) {}
    kind_t kind;
};

// XXH64 of identity followed by the tokens' bytes: the key an entry is stored under.
uint64_t entry_key(std::string_view identity, std::span<const int32_t> tokens);
// "<16 lower-case hex digits>.fpc"
std::string entry_file_name(uint64_t key);

// ---- byte sources (decoding) and sinks (encoding) --------------------------------------------------

class byte_source {
  public:
    virtual ~byte_source() = default;
    virtual uint64_t size() const = 0;
    // Exactly n bytes at `offset` (which the caller checked against size()); throws otherwise.
    virtual void read_at(uint64_t offset, void *dst, size_t n) const = 0;
    virtual const std::string &name() const = 0;  // for messages
};

// pread on an open descriptor (not owned); size() is fstat's at construction.
class fd_source final : public byte_source {
  public:
    fd_source(int fd, std::string name);
    uint64_t size() const override { return size_; }
    void read_at(uint64_t offset, void *dst, size_t n) const override;
    const std::string &name() const override { return name_; }

  private:
    int fd_;
    uint64_t size_ = 0;
    std::string name_;
};

class memory_source final : public byte_source {
  public:
    memory_source(std::span<const uint8_t> bytes, std::string name) : b_(bytes), name_(std::move(name)) {}
    uint64_t size() const override { return b_.size(); }
    void read_at(uint64_t offset, void *dst, size_t n) const override;
    const std::string &name() const override { return name_; }

  private:
    std::span<const uint8_t> b_;
    std::string name_;
};

class byte_sink {
  public:
    virtual ~byte_sink() = default;
    virtual void append(const void *data, size_t n) = 0;                     // at the end
    virtual void write_at(uint64_t offset, const void *data, size_t n) = 0;  // over bytes already appended
};

// write/pwrite on an open descriptor (not owned); throws naming `name` and errno.
class fd_sink final : public byte_sink {
  public:
    fd_sink(int fd, std::string name) : fd_(fd), name_(std::move(name)) {}
    void append(const void *data, size_t n) override;
    void write_at(uint64_t offset, const void *data, size_t n) override;

  private:
    int fd_;
    std::string name_;
};

class memory_sink final : public byte_sink {
  public:
    void append(const void *data, size_t n) override;
    void write_at(uint64_t offset, const void *data, size_t n) override;
    std::vector<uint8_t> bytes;
};

// ---- encoding -------------------------------------------------------------------------------------

// Writes one entry to `out` (empty so far): the header and table as zeros, the identity and tokens
// sections, then the state section through the state_writer that `fill` is handed (buffered, hashed,
// zstd-compressed when zstd_level > 0), then the real header and table over the zeros. Returns the
// file's length. fill returns false when it has nothing to write (the session cannot save): then
// nothing meaningful was written and write_entry returns 0.
uint64_t write_entry(byte_sink &out, std::string_view identity, std::span<const int32_t> tokens,
                     int zstd_level, const std::function<bool(state_writer &)> &fill);

// ---- decoding -------------------------------------------------------------------------------------

// Header and section table: magic, version (another one -> foreign), header checksum, section kinds,
// order and codecs, contiguous layout ending exactly at the source's end, every length within limits.
entry_header read_header(const byte_source &src);
// The identity string (checksum verified).
std::string read_identity(const byte_source &src, const entry_header &h);
// The tokens (checksum verified; each id >= 0).
std::vector<int32_t> read_tokens(const byte_source &src, const entry_header &h);

// The state section as a state_reader: decodes (zstd) and hashes while the session reads. remaining()
// is the decoded length the table promises; a stream that ends early or decodes to more throws
// (damaged). finish() reads and hashes whatever the session left unread and throws (damaged) unless
// the decoded length and the checksum match: call it after load_state, and trust the session's
// result only when it returns.
class state_section_reader final : public state_reader {
  public:
    state_section_reader(const byte_source &src, const section &s);
    ~state_section_reader() override;
    void read(void *dst, size_t n) override;
    uint64_t remaining() const override { return raw_left_; }
    void finish();
    // Reads and hashes the stored bytes not read yet, without decoding them, and throws (damaged) unless
    // the checksum matches: whether the bytes on disk are intact after the session refused the stream.
    // Costs at most the file's size, where finish() would decode up to the promised raw length (a few
    // MiB of zstd can promise a terabyte). The reader is spent afterwards.
    void verify_stored();

  private:
    void fill_input();  // the next chunk of stored bytes into buf_ (hashed)
    [[noreturn]] void damaged(const std::string &why) const;
    const byte_source &src_;
    section s_;
    uint64_t stored_read_ = 0, raw_left_ = 0;
    std::vector<uint8_t> buf_;
    size_t buf_pos_ = 0, buf_len_ = 0;
    std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t *)> hash_;
    void *dctx_ = nullptr;     // ZSTD_DCtx when zstd
    bool frame_done_ = false;  // zstd: the frame's end was decoded
};

// Decodes and verifies a whole entry without a session (the state section is read and hashed, not
// interpreted): what the fuzz target and the corruption tests drive. Returns the header; throws
// entry_error.
entry_header check_entry(const byte_source &src);

}  // namespace fathom::cache
