// GGUF writer: collects metadata (encoded at set time) and the tensor directory, then streams the
// header and tensor data in declaration order. Memory use is bounded by the metadata size; tensor data
// passes straight through a buffered FILE. Layout: docs/formats/gguf.md.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_set>

#include <sys/types.h>
#include <unistd.h>

#include "core/error.h"
#include "gguf/gguf.h"
#include "gguf/gguf_format.h"

namespace fathom::gguf {

using detail::quote;

namespace {

template <typename T>
void put(std::vector<uint8_t> &out, T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));  // host is little-endian (static_assert in gguf_format.h)
    for (uint8_t x : b)
        out.push_back(x);  // (a range insert here trips a GCC 12 -Wstringop-overflow false positive)
}

void put_string(std::vector<uint8_t> &out, std::string_view s) {
    put<uint64_t>(out, s.size());
    out.insert(out.end(), s.begin(), s.end());
}

template <typename T>
std::vector<uint8_t> scalar_payload(T v) {
    std::vector<uint8_t> p;
    put<T>(p, v);
    return p;
}

// Array payload: element type, count, elements.
template <typename T>
std::vector<uint8_t> array_payload(value_type elem, const std::vector<T> &v) {
    std::vector<uint8_t> p;
    put<uint32_t>(p, static_cast<uint32_t>(elem));
    put<uint64_t>(p, v.size());
    for (const T &x : v) put<T>(p, x);
    return p;
}

uint64_t align_up(uint64_t x, uint64_t a) {
    return (x + a - 1) / a * a;
}

}  // namespace

struct writer::impl {
    struct entry {
        std::string key;
        value_type type;
        std::vector<uint8_t> payload;  // encoded value, without the key and type fields
    };
    struct tensor_decl {
        std::string name;
        dtype type;
        std::vector<int64_t> ne;
        uint64_t nbytes;
        uint64_t offset;  // relative to the data section, aligned
    };

    std::string path;
    uint32_t version;
    size_t alignment;
    std::vector<entry> kvs;
    std::unordered_set<std::string> keys;
    std::vector<tensor_decl> tensors;
    std::unordered_set<std::string> tensor_names;
    uint64_t next_offset = 0;  // end of the last declared tensor, relative to the data section

    std::FILE *fp = nullptr;
    uint64_t written = 0;     // bytes handed to fwrite so far
    uint64_t data_start = 0;  // absolute offset of the data section
    size_t cur = 0;           // tensor receiving data
    uint64_t cur_done = 0;    // bytes it has received
    bool header_done = false;
    bool finished = false;

    [[noreturn]] void fail(const std::string &reason) const { throw error(path + ": " + reason); }

    void emit(const void *data, size_t n) {
        if (n == 0) return;
        if (std::fwrite(data, 1, n, fp) != n) fail(std::string("write failed: ") + std::strerror(errno));
        written += n;
    }
    void pad_to(uint64_t target) {
        static const uint8_t zeros[256] = {};
        while (written < target)
            emit(zeros, static_cast<size_t>(std::min<uint64_t>(target - written, sizeof zeros)));
    }

    void add(const std::string &key, value_type type, std::vector<uint8_t> payload) {
        if (header_done) fail("metadata key " + quote(key) + " set after write_header()");
        if (!keys.insert(key).second) fail("duplicate key " + quote(key));
        if (key == "general.alignment") {
            uint32_t v = 0;
            if (type == value_type::u32) std::memcpy(&v, payload.data(), 4);
            if (type != value_type::u32 || v != alignment) {
                fail("general.alignment must be a u32 equal to the writer alignment " +
                     std::to_string(alignment));
            }
        }
        kvs.push_back({key, type, std::move(payload)});
    }
};

writer::writer(std::string path, uint32_t version, size_t alignment) : p_(std::make_unique<impl>()) {
    p_->path = std::move(path);
    p_->version = version;
    p_->alignment = alignment;
    if (version != 2 && version != 3)
        p_->fail("writer supports GGUF versions 2 and 3, not " + std::to_string(version));
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 ||
        alignment > std::numeric_limits<uint32_t>::max()) {
        p_->fail("alignment " + std::to_string(alignment) + " is not a power of two that fits in u32");
    }
}

writer::~writer() {
    if (p_->fp != nullptr) {
        std::fclose(p_->fp);
        // An unfinished file is incomplete (or was abandoned after an error): never leave it behind.
        if (!p_->finished) std::remove(p_->path.c_str());
    }
}

void writer::set_u8(const std::string &key, uint8_t v) {
    p_->add(key, value_type::u8, scalar_payload(v));
}
void writer::set_i8(const std::string &key, int8_t v) {
    p_->add(key, value_type::i8, scalar_payload(v));
}
void writer::set_u16(const std::string &key, uint16_t v) {
    p_->add(key, value_type::u16, scalar_payload(v));
}
void writer::set_i16(const std::string &key, int16_t v) {
    p_->add(key, value_type::i16, scalar_payload(v));
}
void writer::set_u32(const std::string &key, uint32_t v) {
    p_->add(key, value_type::u32, scalar_payload(v));
}
void writer::set_i32(const std::string &key, int32_t v) {
    p_->add(key, value_type::i32, scalar_payload(v));
}
void writer::set_u64(const std::string &key, uint64_t v) {
    p_->add(key, value_type::u64, scalar_payload(v));
}
void writer::set_i64(const std::string &key, int64_t v) {
    p_->add(key, value_type::i64, scalar_payload(v));
}
void writer::set_f32(const std::string &key, float v) {
    p_->add(key, value_type::f32, scalar_payload(v));
}
void writer::set_f64(const std::string &key, double v) {
    p_->add(key, value_type::f64, scalar_payload(v));
}
void writer::set_bool(const std::string &key, bool v) {
    p_->add(key, value_type::boolean, scalar_payload<uint8_t>(v ? 1 : 0));
}
void writer::set_string(const std::string &key, const std::string &v) {
    std::vector<uint8_t> p;
    put_string(p, v);
    p_->add(key, value_type::string, std::move(p));
}
void writer::set_arr_str(const std::string &key, const std::vector<std::string> &v) {
    std::vector<uint8_t> p;
    put<uint32_t>(p, static_cast<uint32_t>(value_type::string));
    put<uint64_t>(p, v.size());
    for (const auto &s : v) put_string(p, s);
    p_->add(key, value_type::array, std::move(p));
}
void writer::set_arr_i32(const std::string &key, const std::vector<int32_t> &v) {
    p_->add(key, value_type::array, array_payload(value_type::i32, v));
}
void writer::set_arr_u32(const std::string &key, const std::vector<uint32_t> &v) {
    p_->add(key, value_type::array, array_payload(value_type::u32, v));
}
void writer::set_arr_i64(const std::string &key, const std::vector<int64_t> &v) {
    p_->add(key, value_type::array, array_payload(value_type::i64, v));
}
void writer::set_arr_f32(const std::string &key, const std::vector<float> &v) {
    p_->add(key, value_type::array, array_payload(value_type::f32, v));
}
void writer::set_arr_f64(const std::string &key, const std::vector<double> &v) {
    p_->add(key, value_type::array, array_payload(value_type::f64, v));
}
void writer::set_arr_bool(const std::string &key, const std::vector<bool> &v) {
    std::vector<uint8_t> bytes(v.begin(), v.end());
    p_->add(key, value_type::array, array_payload(value_type::boolean, bytes));
}
void writer::set_raw(const std::string &key, value_type type, std::vector<uint8_t> payload) {
    // Deliberately unchecked (duplicates, alignment key, payload): this builds malformed test files.
    if (p_->header_done) p_->fail("metadata key " + quote(key) + " set after write_header()");
    p_->keys.insert(key);
    p_->kvs.push_back({key, type, std::move(payload)});
}

void writer::add_tensor(const std::string &name, dtype type, std::vector<int64_t> ne) {
    impl &w = *p_;
    if (w.header_done) w.fail("tensor " + quote(name) + " declared after write_header()");
    const dtype_traits &ti = dtype_info(type);
    const std::string where = "tensor " + quote(name) + ": ";
    if (!ti.known) w.fail(where + "unknown type id " + std::to_string(static_cast<uint32_t>(type)));
    if (ne.empty() || ne.size() > detail::kMaxDims) {
        w.fail(where + std::to_string(ne.size()) + " dimensions (must be 1..4)");
    }
    uint64_t count = 1;
    for (size_t d = 0; d < ne.size(); ++d) {
        if (ne[d] <= 0)
            w.fail(where + "ne[" + std::to_string(d) + "] = " + std::to_string(ne[d]) + " (must be >= 1)");
        if (!detail::mul_ok(count, static_cast<uint64_t>(ne[d]), count) ||
            count > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            w.fail(where + "element count overflows int64");
        }
    }
    if (ne[0] % ti.block_size != 0) {
        w.fail(where + "ne[0] = " + std::to_string(ne[0]) + " is not a multiple of the block size " +
               std::to_string(ti.block_size));
    }
    uint64_t nbytes = 0, end = 0;
    if (!detail::mul_ok(count / ti.block_size, ti.type_size, nbytes) ||
        !detail::add_ok(w.next_offset, nbytes, end)) {
        w.fail(where + "byte size overflows");
    }
    if (!w.tensor_names.insert(name).second) w.fail("duplicate tensor name " + quote(name));
    w.tensors.push_back({name, type, std::move(ne), nbytes, w.next_offset});
    w.next_offset = align_up(end, w.alignment);
}

void writer::write_header() {
    impl &w = *p_;
    if (w.header_done) w.fail("write_header() called twice");
    if (w.alignment != detail::kDefaultAlignment && w.keys.count("general.alignment") == 0) {
        w.add("general.alignment", value_type::u32,
              scalar_payload<uint32_t>(static_cast<uint32_t>(w.alignment)));
    }
    w.fp = std::fopen(w.path.c_str(), "wb");
    if (w.fp == nullptr) w.fail(std::string("cannot create: ") + std::strerror(errno));
    std::setvbuf(w.fp, nullptr, _IOFBF, 1 << 20);
    w.header_done = true;

    std::vector<uint8_t> h;
    put<uint32_t>(h, detail::kMagic);
    put<uint32_t>(h, w.version);
    put<uint64_t>(h, w.tensors.size());
    put<uint64_t>(h, w.kvs.size());
    for (const auto &e : w.kvs) {
        put_string(h, e.key);
        put<uint32_t>(h, static_cast<uint32_t>(e.type));
        h.insert(h.end(), e.payload.begin(), e.payload.end());
        if (h.size() >= (1u << 20)) {  // keep the staging buffer small for big vocabularies
            w.emit(h.data(), h.size());
            h.clear();
        }
    }
    for (const auto &t : w.tensors) {
        put_string(h, t.name);
        put<uint32_t>(h, static_cast<uint32_t>(t.ne.size()));
        for (int64_t n : t.ne) put<uint64_t>(h, static_cast<uint64_t>(n));
        put<uint32_t>(h, static_cast<uint32_t>(t.type));
        put<uint64_t>(h, t.offset);
    }
    w.emit(h.data(), h.size());
    w.data_start = align_up(w.written, w.alignment);
    w.pad_to(w.data_start);
}

void writer::write_tensor_data(const void *data, size_t n) {
    impl &w = *p_;
    if (!w.header_done) w.fail("write_tensor_data() before write_header()");
    if (w.finished) w.fail("write_tensor_data() after finish()");
    if (n == 0) return;
    if (w.cur >= w.tensors.size())
        w.fail("write_tensor_data(): all declared tensors already have their data");
    const auto &t = w.tensors[w.cur];
    if (n > t.nbytes - w.cur_done) {
        w.fail("tensor " + quote(t.name) + ": " + std::to_string(n) + " bytes supplied but only " +
               std::to_string(t.nbytes - w.cur_done) + " of its " + std::to_string(t.nbytes) +
               " bytes remain");
    }
    if (w.cur_done == 0) w.pad_to(w.data_start + t.offset);
    w.emit(data, n);
    w.cur_done += n;
    if (w.cur_done == t.nbytes) {
        ++w.cur;
        w.cur_done = 0;
    }
}

void writer::write_tensor_zeros(uint64_t n) {
    impl &w = *p_;
    if (!w.header_done) w.fail("write_tensor_zeros() before write_header()");
    if (w.finished) w.fail("write_tensor_zeros() after finish()");
    if (n == 0) return;
    if (w.cur >= w.tensors.size()) w.fail("write_tensor_zeros(): all declared tensors already have their data");
    const auto &t = w.tensors[w.cur];
    if (n > t.nbytes - w.cur_done)
        w.fail("tensor " + quote(t.name) + ": " + std::to_string(n) + " zero bytes supplied but only " +
               std::to_string(t.nbytes - w.cur_done) + " of its " + std::to_string(t.nbytes) + " bytes remain");
    if (w.cur_done == 0) w.pad_to(w.data_start + t.offset);
    if (std::fflush(w.fp) != 0 || fseeko(w.fp, static_cast<off_t>(n), SEEK_CUR) != 0)
        w.fail(std::string("seek failed: ") + std::strerror(errno));
    w.written += n;
    w.cur_done += n;
    if (w.cur_done == t.nbytes) {
        ++w.cur;
        w.cur_done = 0;
    }
}

void writer::finish() {
    impl &w = *p_;
    if (w.finished) w.fail("finish() called twice");
    if (!w.header_done) write_header();
    if (w.cur < w.tensors.size()) {
        const auto &t = w.tensors[w.cur];
        w.fail("tensor " + quote(t.name) + " received " + std::to_string(w.cur_done) + " of its " +
               std::to_string(t.nbytes) + " bytes (" + std::to_string(w.tensors.size() - w.cur) +
               " tensors incomplete)");
    }
    const uint64_t expected = w.data_start + w.next_offset;  // next_offset is aligned past the last tensor
    w.pad_to(expected);
    if (std::fflush(w.fp) != 0) w.fail(std::string("write failed: ") + std::strerror(errno));
    // A trailing hole (write_tensor_zeros at the very end) leaves the file short until extended.
    if (ftruncate(fileno(w.fp), static_cast<off_t>(expected)) != 0)
        w.fail(std::string("truncate failed: ") + std::strerror(errno));
    const long pos = std::ftell(w.fp);
    if (pos < 0 || static_cast<uint64_t>(pos) != expected || w.written != expected) {
        w.fail("byte count mismatch: wrote " + std::to_string(w.written) + ", expected " +
               std::to_string(expected));
    }
    std::FILE *fp = w.fp;
    w.fp = nullptr;
    if (std::fclose(fp) != 0) {
        std::remove(w.path.c_str());
        w.fail(std::string("close failed: ") + std::strerror(errno));
    }
    w.finished = true;
}

}  // namespace fathom::gguf
