// GGUF v2/v3 reader (mmap, strict validation) and writer.
// Format reference: docs/formats/gguf.md. Every failure throws fathom::error with a one-line message
// naming the file and the offending key/tensor/offset; no input can cause undefined behaviour.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/types.h"

namespace fathom::gguf {

enum class value_type : uint32_t {
    u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
    string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};
std::string_view value_type_name(value_type t);

// One metadata value. Scalars are widened into i/u/f; strings and string arrays are views into the
// mapped file (valid while the owning `file` lives). Arrays of numbers are stored widened.
struct value {
    value_type type = value_type::u8;
    value_type elem_type = value_type::u8;  // for arrays
    int64_t i = 0;                          // signed integer types and bool
    uint64_t u = 0;                         // unsigned integer types
    double f = 0;                           // f32/f64
    std::string_view str;                   // string
    std::vector<int64_t> arr_int;           // integer/bool arrays (u64 values > INT64_MAX rejected)
    std::vector<double> arr_float;          // f32/f64 arrays
    std::vector<std::string_view> arr_str;  // string arrays
    size_t arr_len = 0;                     // element count of an array (any element type)
    bool is_integer() const;                // any integer scalar type (not bool)
};

// The type as messages and tools print it: "u32", "string", "array[string]".
std::string value_type_label(const value &v);

struct kv {
    std::string_view key;
    value val;
};

struct tensor_info {
    std::string_view name;
    dtype type = dtype::f32;
    uint32_t n_dims = 0;
    int64_t ne[4] = {1, 1, 1, 1};  // ne[0] innermost
    uint64_t offset = 0;           // relative to the data section
    size_t nbytes = 0;
    const uint8_t *data = nullptr;  // into the mapping
    int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

class file {
public:
    // Map and validate a file. Throws fathom::error("<path>: <reason>").
    static std::unique_ptr<file> open(const std::string &path);
    // Parse a buffer that the caller keeps alive (fuzzing, tests). `name` is used in messages.
    static std::unique_ptr<file> from_memory(const void *data, size_t size, std::string name = "<memory>");
    ~file();
    file(const file &) = delete;
    file &operator=(const file &) = delete;

    const std::string &path() const { return path_; }
    uint32_t version() const { return version_; }
    size_t alignment() const { return alignment_; }
    size_t size() const { return size_; }
    size_t data_offset() const { return data_offset_; }  // start of the tensor data section
    // The whole file as mapped (or the caller's buffer): [size()] bytes.
    std::span<const uint8_t> bytes() const { return {base_, size_}; }

    // Metadata, in file order.
    const std::vector<kv> &metadata() const { return kvs_; }
    const value *find(std::string_view key) const;
    bool has(std::string_view key) const { return find(key) != nullptr; }

    // Typed getters: throw fathom::error naming the key if missing or of an incompatible type.
    // Integer getters accept any integer type whose value fits.
    int64_t get_int(std::string_view key) const;
    int64_t get_int(std::string_view key, int64_t def) const;
    uint32_t get_u32(std::string_view key) const;
    uint32_t get_u32(std::string_view key, uint32_t def) const;
    double get_float(std::string_view key) const;  // f32/f64 (or integer)
    double get_float(std::string_view key, double def) const;
    bool get_bool(std::string_view key) const;
    bool get_bool(std::string_view key, bool def) const;
    std::string_view get_string(std::string_view key) const;
    std::string_view get_string(std::string_view key, std::string_view def) const;
    const std::vector<std::string_view> &get_string_array(std::string_view key) const;
    std::vector<int64_t> get_int_array(std::string_view key) const;    // integer/bool arrays
    std::vector<double> get_float_array(std::string_view key) const;  // float or integer arrays

    // Tensors, in file order.
    const std::vector<tensor_info> &tensors() const { return tensors_; }
    const tensor_info *find_tensor(std::string_view name) const;
    // Throws naming the tensor if missing.
    const tensor_info &tensor(std::string_view name) const;

private:
    file() = default;
    void parse();
    std::string path_;
    const uint8_t *base_ = nullptr;
    size_t size_ = 0;
    bool mapped_ = false;
    uint32_t version_ = 0;
    size_t alignment_ = 32;
    size_t data_offset_ = 0;
    std::vector<kv> kvs_;
    std::vector<tensor_info> tensors_;
    struct index;
    std::unique_ptr<index> index_;  // name -> position lookups
};

// Streaming writer: declare metadata and tensors, then write headers and tensor data in order,
// so a multi-GiB file is produced with bounded memory. Used by tools and tests.
class writer {
public:
    explicit writer(std::string path, uint32_t version = 3, size_t alignment = 32);
    ~writer();
    void set_u32(const std::string &key, uint32_t v);
    void set_i32(const std::string &key, int32_t v);
    void set_u64(const std::string &key, uint64_t v);
    void set_f32(const std::string &key, float v);
    void set_bool(const std::string &key, bool v);
    void set_string(const std::string &key, const std::string &v);
    void set_arr_str(const std::string &key, const std::vector<std::string> &v);
    void set_arr_i32(const std::string &key, const std::vector<int32_t> &v);
    void set_arr_u32(const std::string &key, const std::vector<uint32_t> &v);
    void set_arr_f32(const std::string &key, const std::vector<float> &v);
    // Remaining value types (one setter per GGUF type; arrays of u8/i8/u16/i16/u64 and nested arrays
    // only through set_raw).
    void set_u8(const std::string &key, uint8_t v);
    void set_i8(const std::string &key, int8_t v);
    void set_u16(const std::string &key, uint16_t v);
    void set_i16(const std::string &key, int16_t v);
    void set_i64(const std::string &key, int64_t v);
    void set_f64(const std::string &key, double v);
    void set_arr_i64(const std::string &key, const std::vector<int64_t> &v);
    void set_arr_f64(const std::string &key, const std::vector<double> &v);
    void set_arr_bool(const std::string &key, const std::vector<bool> &v);
    // Raw escape hatch for tests of malformed input: any value type with its encoded payload bytes
    // (for arrays: u32 element type, u64 count, elements). Unchecked: duplicates are allowed.
    // The typed setters throw on duplicate keys; general.alignment is written automatically when the
    // writer alignment is not 32 (setting it by hand must agree with the constructor argument).
    void set_raw(const std::string &key, value_type type, std::vector<uint8_t> payload);
    // Declare a tensor (ne[0] innermost). Data is supplied later, in declaration order.
    void add_tensor(const std::string &name, dtype type, std::vector<int64_t> ne);
    // Writes magic, header, metadata and tensor directory. Call once, after all declarations.
    void write_header();
    // Append the next tensor's bytes (may be called several times per tensor; the writer pads between
    // tensors and checks that each tensor received exactly its size).
    void write_tensor_data(const void *data, size_t n);
    // Append n zero bytes to the current tensor without writing them: the file gets a hole (sparse
    // on file systems that support it), so a tensor that is mostly zeros costs no disk space.
    void write_tensor_zeros(uint64_t n);
    void finish();  // pads, flushes, closes; throws on I/O error
private:
    struct impl;
    std::unique_ptr<impl> p_;
};

}  // namespace fathom::gguf
