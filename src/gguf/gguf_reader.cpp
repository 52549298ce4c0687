// GGUF reader: maps a file (or takes a caller-owned buffer), parses header, metadata and tensor
// directory, and validates everything before any value is handed out. Every check names the file and
// the offending key/tensor/offset in a one-line fathom::error. Layout and rules: docs/formats/gguf.md.
//
// Memory is only reserved after a count has been checked against the bytes left in the buffer, so a
// hostile count can never trigger a huge allocation (worst case: numeric arrays widened to 8 bytes per
// element, i.e. 8x the file bytes they occupy).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "core/error.h"
#include "gguf/gguf.h"
#include "gguf/gguf_format.h"

namespace fathom::gguf {

using detail::quote;

std::string_view value_type_name(value_type t) {
    switch (t) {
        case value_type::u8:
            return "u8";
        case value_type::i8:
            return "i8";
        case value_type::u16:
            return "u16";
        case value_type::i16:
            return "i16";
        case value_type::u32:
            return "u32";
        case value_type::i32:
            return "i32";
        case value_type::f32:
            return "f32";
        case value_type::boolean:
            return "bool";
        case value_type::string:
            return "string";
        case value_type::array:
            return "array";
        case value_type::u64:
            return "u64";
        case value_type::i64:
            return "i64";
        case value_type::f64:
            return "f64";
    }
    return "invalid";
}

std::string value_type_label(const value &v) {
    if (v.type != value_type::array) return std::string(value_type_name(v.type));
    return "array[" + std::string(value_type_name(v.elem_type)) + "]";
}

namespace {

bool is_signed_int(value_type t) {
    return t == value_type::i8 || t == value_type::i16 || t == value_type::i32 || t == value_type::i64;
}
bool is_unsigned_int(value_type t) {
    return t == value_type::u8 || t == value_type::u16 || t == value_type::u32 || t == value_type::u64;
}
bool is_float(value_type t) {
    return t == value_type::f32 || t == value_type::f64;
}

// Little-endian loads from a bounds-checked position.
template <typename T>
T load(const uint8_t *p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

// Sequential reader over [base, base+size) with precise error messages. `ctx_` names what is being
// parsed ("key 'general.name'", "tensor 'blk.0.attn_q.weight'") so every failure can say where it is.
class parser {
  public:
    parser(const std::string &path, const uint8_t *base, size_t size)
        : path_(path), base_(base), size_(size) {}

    [[noreturn]] void fail(const std::string &reason) const { throw error(path_ + ": " + reason); }
    // Failure inside the current context ("key 'x': ...").
    [[noreturn]] void fail_ctx(const std::string &reason) const { fail(ctx_ + ": " + reason); }

    size_t pos() const { return pos_; }
    size_t remaining() const { return size_ - pos_; }
    void set_ctx(std::string c) { ctx_ = std::move(c); }
    const std::string &ctx() const { return ctx_; }

    void need(uint64_t n, const char *what) const {
        if (n > remaining()) {
            fail("truncated file at offset " + std::to_string(pos_) + ": " + ctx_ + ": " + what + " needs " +
                 std::to_string(n) + " bytes, only " + std::to_string(remaining()) + " left");
        }
    }
    template <typename T>
    T read(const char *what) {
        need(sizeof(T), what);
        T v = load<T>(base_ + pos_);
        pos_ += sizeof(T);
        return v;
    }
    void skip(uint64_t n, const char *what) {
        need(n, what);
        pos_ += static_cast<size_t>(n);
    }
    // u64 length + bytes; the view points into the buffer.
    std::string_view read_string(const char *what) {
        const uint64_t len = read<uint64_t>(what);
        need(len, what);
        std::string_view s(reinterpret_cast<const char *>(base_ + pos_), static_cast<size_t>(len));
        pos_ += static_cast<size_t>(len);
        return s;
    }

  private:
    const std::string &path_;
    const uint8_t *base_;
    size_t size_;
    size_t pos_ = 0;
    std::string ctx_ = "header";
};

// Smallest encoding of one array element of type t: used to bound element counts by the bytes left.
uint64_t min_element_size(value_type t) {
    if (t == value_type::string) return 8;     // u64 length, empty string
    if (t == value_type::array) return 4 + 8;  // element type + length, empty array
    return detail::scalar_size(t);
}

value_type read_type(parser &p, const char *what) {
    const uint32_t id = p.read<uint32_t>(what);
    if (!detail::valid_value_type(id)) p.fail_ctx(std::string("unknown ") + what + " " + std::to_string(id));
    return static_cast<value_type>(id);
}

// Reads an array header and checks its length against the remaining bytes.
uint64_t read_array_header(parser &p, value_type &elem) {
    elem = read_type(p, "array element type");
    const uint64_t n = p.read<uint64_t>("array length");
    const uint64_t min = min_element_size(elem);
    if (n > p.remaining() / min) {
        p.fail_ctx("array length " + std::to_string(n) + " of " + std::string(value_type_name(elem)) +
                   " exceeds the " + std::to_string(p.remaining()) + " bytes left in the file");
    }
    return n;
}

// Skips a nested array (array element of an array); bounded in depth, linear in bytes.
void skip_array(parser &p, int depth) {
    if (depth > detail::kMaxArrayDepth) {
        p.fail_ctx("arrays nested deeper than " + std::to_string(detail::kMaxArrayDepth) + " levels");
    }
    value_type elem;
    const uint64_t n = read_array_header(p, elem);
    if (elem == value_type::string) {
        for (uint64_t i = 0; i < n; ++i) p.read_string("string in nested array");
    } else if (elem == value_type::array) {
        for (uint64_t i = 0; i < n; ++i) skip_array(p, depth + 1);
    } else {
        p.skip(n * detail::scalar_size(elem), "nested array data");  // n bounded above: no overflow
    }
}

// One integer or bool array element, widened to int64.
int64_t read_int_element(parser &p, value_type t) {
    switch (t) {
        case value_type::u8:
            return p.read<uint8_t>("array element");
        case value_type::i8:
            return p.read<int8_t>("array element");
        case value_type::u16:
            return p.read<uint16_t>("array element");
        case value_type::i16:
            return p.read<int16_t>("array element");
        case value_type::u32:
            return p.read<uint32_t>("array element");
        case value_type::i32:
            return p.read<int32_t>("array element");
        case value_type::i64:
            return p.read<int64_t>("array element");
        case value_type::u64: {
            const uint64_t u = p.read<uint64_t>("array element");
            if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
                p.fail_ctx("u64 array element " + std::to_string(u) + " exceeds the int64 range");
            }
            return static_cast<int64_t>(u);
        }
        case value_type::boolean: {
            const uint8_t b = p.read<uint8_t>("array element");
            if (b > 1) p.fail_ctx("bool array element has value " + std::to_string(b) + " (must be 0 or 1)");
            return b;
        }
        default:
            p.fail_ctx("internal: not an integer element type");
    }
}

void parse_array(parser &p, value &v) {
    const uint64_t n = read_array_header(p, v.elem_type);
    v.arr_len = static_cast<size_t>(n);
    switch (v.elem_type) {
        case value_type::string:
            v.arr_str.reserve(v.arr_len);
            for (uint64_t i = 0; i < n; ++i) v.arr_str.push_back(p.read_string("string array element"));
            break;
        case value_type::array:
            // Arrays of arrays: no user in Fathom; parsed for validity and skipped (arr_len is kept).
            for (uint64_t i = 0; i < n; ++i) skip_array(p, 2);
            break;
        case value_type::f32:
            v.arr_float.reserve(v.arr_len);
            for (uint64_t i = 0; i < n; ++i) v.arr_float.push_back(p.read<float>("array element"));
            break;
        case value_type::f64:
            v.arr_float.reserve(v.arr_len);
            for (uint64_t i = 0; i < n; ++i) v.arr_float.push_back(p.read<double>("array element"));
            break;
        default:
            v.arr_int.reserve(v.arr_len);
            for (uint64_t i = 0; i < n; ++i) v.arr_int.push_back(read_int_element(p, v.elem_type));
            break;
    }
}

void parse_value(parser &p, value &v) {
    switch (v.type) {
        case value_type::u8:
            v.u = p.read<uint8_t>("value");
            break;
        case value_type::i8:
            v.i = p.read<int8_t>("value");
            break;
        case value_type::u16:
            v.u = p.read<uint16_t>("value");
            break;
        case value_type::i16:
            v.i = p.read<int16_t>("value");
            break;
        case value_type::u32:
            v.u = p.read<uint32_t>("value");
            break;
        case value_type::i32:
            v.i = p.read<int32_t>("value");
            break;
        case value_type::u64:
            v.u = p.read<uint64_t>("value");
            break;
        case value_type::i64:
            v.i = p.read<int64_t>("value");
            break;
        case value_type::f32:
            v.f = p.read<float>("value");
            break;
        case value_type::f64:
            v.f = p.read<double>("value");
            break;
        case value_type::boolean: {
            const uint8_t b = p.read<uint8_t>("value");
            if (b > 1) p.fail_ctx("bool value " + std::to_string(b) + " (must be 0 or 1)");
            v.i = b;
            break;
        }
        case value_type::string:
            v.str = p.read_string("string value");
            break;
        case value_type::array:
            parse_array(p, v);
            break;
    }
}

}  // namespace

bool value::is_integer() const {
    return is_signed_int(type) || is_unsigned_int(type);
}

struct file::index {
    std::unordered_map<std::string_view, size_t> keys;     // key -> position in kvs_
    std::unordered_map<std::string_view, size_t> tensors;  // name -> position in tensors_
};

file::~file() {
    if (mapped_ && base_ != nullptr) munmap(const_cast<uint8_t *>(base_), size_);
}

std::unique_ptr<file> file::open(const std::string &path) {
    std::unique_ptr<file> f(new file());
    f->path_ = path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw error(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
        const int e = errno;
        ::close(fd);
        throw error(path + ": cannot stat: " + std::strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        throw error(path + ": not a regular file");
    }
    f->size_ = static_cast<size_t>(st.st_size);
    if (f->size_ > 0) {
        void *m = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            const int e = errno;
            ::close(fd);
            throw error(path + ": cannot mmap " + std::to_string(f->size_) + " bytes: " + std::strerror(e));
        }
        f->base_ = static_cast<const uint8_t *>(m);
        f->mapped_ = true;
    }
    ::close(fd);  // the mapping keeps the file alive
    f->parse();
    return f;
}

std::unique_ptr<file> file::from_memory(const void *data, size_t size, std::string name) {
    std::unique_ptr<file> f(new file());
    f->path_ = std::move(name);
    f->base_ = static_cast<const uint8_t *>(data);
    f->size_ = size;
    f->parse();
    return f;
}

namespace {

void parse_header(parser &p, uint32_t &version) {
    p.need(4, "magic");
    const uint32_t magic = p.read<uint32_t>("magic");
    if (magic != detail::kMagic) {
        char shown[5] = {};
        std::memcpy(shown, &magic, 4);
        std::string s = quote(std::string_view(shown, 4));
        p.fail("bad magic " + s + " (expected 'GGUF'): not a GGUF file");
    }
    version = p.read<uint32_t>("version");
    if (version == 2 || version == 3) return;
    if (version == 1) p.fail("GGUF version 1 is not supported (only versions 2 and 3)");
    const uint32_t swapped = __builtin_bswap32(version);
    if ((version & 0xffffu) == 0 && swapped >= 1 && swapped <= 3) {
        p.fail("big-endian GGUF file (version field reads " + std::to_string(swapped) +
               " byte-swapped) is not supported");
    }
    p.fail("unsupported GGUF version " + std::to_string(version) + " (only versions 2 and 3)");
}

// Validates the type, shape and size of one tensor directory entry (everything except placement).
void check_tensor_shape(parser &p, tensor_info &t, uint32_t type_id, const uint64_t *dims) {
    const dtype_traits &ti = dtype_info(type_id);
    if (!ti.known) {
        const std::string_view removed = detail::removed_ggml_type_name(type_id);
        if (!removed.empty()) {
            p.fail_ctx("type id " + std::to_string(type_id) + " (" + std::string(removed) +
                       ", removed from ggml) has no known block geometry");
        }
        p.fail_ctx("unknown tensor type id " + std::to_string(type_id));
    }
    t.type = static_cast<dtype>(type_id);
    uint64_t count = 1;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
        if (dims[d] == 0 || dims[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            p.fail_ctx("ne[" + std::to_string(d) + "] = " + std::to_string(dims[d]) +
                       " is out of range (must be >= 1)");
        }
        if (!detail::mul_ok(count, dims[d], count) ||
            count > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            p.fail_ctx("element count overflows int64");
        }
        t.ne[d] = static_cast<int64_t>(dims[d]);
    }
    if (dims[0] % ti.block_size != 0) {
        p.fail_ctx("ne[0] = " + std::to_string(dims[0]) + " is not a multiple of the " +
                   std::string(ti.name) + " block size " + std::to_string(ti.block_size));
    }
    // count / block_size blocks of type_size bytes; count is a multiple of block_size since ne[0] is.
    uint64_t nbytes = 0;
    if (!detail::mul_ok(count / ti.block_size, ti.type_size, nbytes)) p.fail_ctx("byte size overflows");
    t.nbytes = static_cast<size_t>(nbytes);
}

}  // namespace

void file::parse() {
    parser p(path_, base_, size_);
    parse_header(p, version_);
    const uint64_t n_tensors = p.read<uint64_t>("tensor count");
    const uint64_t n_kv = p.read<uint64_t>("metadata count");
    // Smallest kv: u64 key length + u32 type + 1-byte value.
    if (n_kv > p.remaining() / 13) {
        p.fail("metadata count " + std::to_string(n_kv) + " exceeds what the " +
               std::to_string(p.remaining()) + " bytes after the header can hold");
    }
    index_ = std::make_unique<index>();
    kvs_.reserve(static_cast<size_t>(n_kv));
    for (uint64_t i = 0; i < n_kv; ++i) {
        p.set_ctx("metadata entry #" + std::to_string(i));
        kv e;
        e.key = p.read_string("key");
        p.set_ctx("key " + quote(e.key));
        e.val.type = read_type(p, "value type");
        parse_value(p, e.val);
        if (!index_->keys.emplace(e.key, kvs_.size()).second) p.fail("duplicate key " + quote(e.key));
        kvs_.push_back(std::move(e));
    }

    if (const value *a = find("general.alignment")) {
        if (a->type != value_type::u32) {
            p.fail("key 'general.alignment' has type " + value_type_label(*a) + ", expected u32");
        }
        if (a->u == 0 || (a->u & (a->u - 1)) != 0) {
            p.fail("general.alignment = " + std::to_string(a->u) + " is not a non-zero power of two");
        }
        alignment_ = static_cast<size_t>(a->u);
    }

    // Smallest tensor entry: u64 name length + u32 n_dims + one u64 dim + u32 type + u64 offset.
    p.set_ctx("tensor directory");
    if (n_tensors > p.remaining() / 32) {
        p.fail("tensor count " + std::to_string(n_tensors) + " exceeds what the " +
               std::to_string(p.remaining()) + " bytes after the metadata can hold");
    }
    tensors_.reserve(static_cast<size_t>(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) {
        p.set_ctx("tensor info #" + std::to_string(i));
        tensor_info t;
        t.name = p.read_string("tensor name");
        p.set_ctx("tensor " + quote(t.name));
        t.n_dims = p.read<uint32_t>("n_dims");
        if (t.n_dims == 0 || t.n_dims > detail::kMaxDims) {
            p.fail_ctx("n_dims = " + std::to_string(t.n_dims) + " (must be 1.." +
                       std::to_string(detail::kMaxDims) + ")");
        }
        uint64_t dims[detail::kMaxDims] = {1, 1, 1, 1};
        for (uint32_t d = 0; d < t.n_dims; ++d) dims[d] = p.read<uint64_t>("ne");
        const uint32_t type_id = p.read<uint32_t>("tensor type");
        t.offset = p.read<uint64_t>("tensor data offset");
        check_tensor_shape(p, t, type_id, dims);
        if (!index_->tensors.emplace(t.name, tensors_.size()).second)
            p.fail("duplicate tensor name " + quote(t.name));
        tensors_.push_back(t);
    }

    // Data section: first multiple of the alignment at or after the end of the directory.
    data_offset_ = (p.pos() + alignment_ - 1) / alignment_ * alignment_;
    for (auto &t : tensors_) {
        if (t.offset % alignment_ != 0) {
            p.fail("tensor " + quote(t.name) + ": data offset " + std::to_string(t.offset) +
                   " is not a multiple of the alignment " + std::to_string(alignment_));
        }
        uint64_t begin = 0, end = 0;
        if (!detail::add_ok(data_offset_, t.offset, begin) || !detail::add_ok(begin, t.nbytes, end) ||
            end > size_) {
            p.fail("tensor " + quote(t.name) + ": data (offset " + std::to_string(t.offset) + ", " +
                   std::to_string(t.nbytes) + " bytes) extends past the end of the file (" +
                   std::to_string(size_) + " bytes, data section at " + std::to_string(data_offset_) + ")");
        }
        t.data = base_ + begin;
    }
    // Overlap check: sort by offset, each tensor must end at or before the next one starts.
    std::vector<size_t> order(tensors_.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
    for (size_t k = 1; k < order.size(); ++k) {
        const tensor_info &a = tensors_[order[k - 1]], &b = tensors_[order[k]];
        if (a.offset + a.nbytes > b.offset) {  // both bounded by the file size: no overflow
            p.fail("tensors " + quote(a.name) + " and " + quote(b.name) + " overlap (offsets " +
                   std::to_string(a.offset) + "+" + std::to_string(a.nbytes) + " and " +
                   std::to_string(b.offset) + ")");
        }
    }
}

// ---- lookups and typed getters ----

const value *file::find(std::string_view key) const {
    auto it = index_->keys.find(key);
    return it == index_->keys.end() ? nullptr : &kvs_[it->second].val;
}

const tensor_info *file::find_tensor(std::string_view name) const {
    auto it = index_->tensors.find(name);
    return it == index_->tensors.end() ? nullptr : &tensors_[it->second];
}

const tensor_info &file::tensor(std::string_view name) const {
    const tensor_info *t = find_tensor(name);
    if (t == nullptr) throw error(path_ + ": tensor " + quote(name) + " not found");
    return *t;
}

namespace {

[[noreturn]] void throw_type(const std::string &path, std::string_view key, const value &v,
                             const char *expected) {
    throw error(path + ": key " + quote(key) + " has type " + value_type_label(v) + ", expected " + expected);
}

const value &require(const file &f, std::string_view key) {
    const value *v = f.find(key);
    if (v == nullptr) throw error(f.path() + ": key " + quote(key) + " not found");
    return *v;
}

int64_t to_int(const std::string &path, std::string_view key, const value &v) {
    if (is_signed_int(v.type)) return v.i;
    if (is_unsigned_int(v.type)) {
        if (v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            throw error(path + ": key " + quote(key) + " value " + std::to_string(v.u) +
                        " does not fit in int64");
        }
        return static_cast<int64_t>(v.u);
    }
    throw_type(path, key, v, "integer");
}

uint32_t to_u32(const std::string &path, std::string_view key, const value &v) {
    if (!v.is_integer()) throw_type(path, key, v, "integer");
    const bool neg = is_signed_int(v.type) && v.i < 0;
    const uint64_t u = is_signed_int(v.type) ? static_cast<uint64_t>(v.i) : v.u;
    if (neg || u > std::numeric_limits<uint32_t>::max()) {
        throw error(path + ": key " + quote(key) + " value " +
                    (neg ? std::to_string(v.i) : std::to_string(u)) + " does not fit in u32");
    }
    return static_cast<uint32_t>(u);
}

double to_float(const std::string &path, std::string_view key, const value &v) {
    if (is_float(v.type)) return v.f;
    if (is_signed_int(v.type)) return static_cast<double>(v.i);
    if (is_unsigned_int(v.type)) return static_cast<double>(v.u);
    throw_type(path, key, v, "float");
}

bool is_int_array(const value &v) {
    return v.type == value_type::array &&
           (v.elem_type == value_type::boolean || is_signed_int(v.elem_type) || is_unsigned_int(v.elem_type));
}

}  // namespace

int64_t file::get_int(std::string_view key) const {
    return to_int(path_, key, require(*this, key));
}
int64_t file::get_int(std::string_view key, int64_t def) const {
    const value *v = find(key);
    return v ? to_int(path_, key, *v) : def;
}
uint32_t file::get_u32(std::string_view key) const {
    return to_u32(path_, key, require(*this, key));
}
uint32_t file::get_u32(std::string_view key, uint32_t def) const {
    const value *v = find(key);
    return v ? to_u32(path_, key, *v) : def;
}
double file::get_float(std::string_view key) const {
    return to_float(path_, key, require(*this, key));
}
double file::get_float(std::string_view key, double def) const {
    const value *v = find(key);
    return v ? to_float(path_, key, *v) : def;
}
bool file::get_bool(std::string_view key) const {
    const value &v = require(*this, key);
    if (v.type != value_type::boolean) throw_type(path_, key, v, "bool");
    return v.i != 0;
}
bool file::get_bool(std::string_view key, bool def) const {
    return has(key) ? get_bool(key) : def;
}
std::string_view file::get_string(std::string_view key) const {
    const value &v = require(*this, key);
    if (v.type != value_type::string) throw_type(path_, key, v, "string");
    return v.str;
}
std::string_view file::get_string(std::string_view key, std::string_view def) const {
    return has(key) ? get_string(key) : def;
}
const std::vector<std::string_view> &file::get_string_array(std::string_view key) const {
    const value &v = require(*this, key);
    if (v.type != value_type::array || v.elem_type != value_type::string)
        throw_type(path_, key, v, "array[string]");
    return v.arr_str;
}
std::vector<int64_t> file::get_int_array(std::string_view key) const {
    const value &v = require(*this, key);
    if (!is_int_array(v)) throw_type(path_, key, v, "integer array");
    return v.arr_int;
}
std::vector<double> file::get_float_array(std::string_view key) const {
    const value &v = require(*this, key);
    if (v.type == value_type::array && is_float(v.elem_type)) return v.arr_float;
    if (!is_int_array(v) || v.elem_type == value_type::boolean) throw_type(path_, key, v, "float array");
    return std::vector<double>(v.arr_int.begin(), v.arr_int.end());
}

}  // namespace fathom::gguf
