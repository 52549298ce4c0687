// Rewrites ds4-tiny-a.gguf through gguf::writer with edited metadata and tensors (broken-file loader
// tests, re-typed weights). Tokenizer keys are dropped (the DS4 model code does not read them).
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "golden_util.h"

namespace ds4_test {

// One output tensor; `drop` omits it.
struct tensor_out {
    fathom::dtype type = fathom::dtype::f32;
    std::vector<int64_t> ne;
    std::vector<uint8_t> bytes;
    bool drop = false;
};

// Identity: the source tensor unchanged.
inline tensor_out copy_tensor(const fathom::gguf::tensor_info &t) {
    tensor_out o;
    o.type = t.type;
    o.ne.assign(t.ne, t.ne + t.n_dims);
    o.bytes.assign(t.data, t.data + t.nbytes);
    return o;
}

inline void copy_value(fathom::gguf::writer &w, const std::string &k, const fathom::gguf::value &v) {
    using vt = fathom::gguf::value_type;
    switch (v.type) {
        case vt::u32:
            w.set_u32(k, static_cast<uint32_t>(v.u));
            break;
        case vt::i32:
            w.set_i32(k, static_cast<int32_t>(v.i));
            break;
        case vt::u64:
            w.set_u64(k, v.u);
            break;
        case vt::f32:
            w.set_f32(k, static_cast<float>(v.f));
            break;
        case vt::boolean:
            w.set_bool(k, v.i != 0);
            break;
        case vt::string:
            w.set_string(k, std::string(v.str));
            break;
        case vt::array:
            if (v.elem_type == vt::i32)
                w.set_arr_i32(k, std::vector<int32_t>(v.arr_int.begin(), v.arr_int.end()));
            else if (v.elem_type == vt::f32)
                w.set_arr_f32(k, std::vector<float>(v.arr_float.begin(), v.arr_float.end()));
            else
                ADD_FAILURE() << "unexpected array type for " << k;
            break;
        default:
            ADD_FAILURE() << "unexpected value type for " << k;
    }
}

using key_edits = std::map<std::string, std::function<void(fathom::gguf::writer &)>>;  // null fn: drop key
using tensor_fn = std::function<tensor_out(const fathom::gguf::tensor_info &)>;

// Write a copy of ds4-tiny-a.gguf to the temp directory; returns its path.
inline std::string rewrite_tiny(const std::string &name, const key_edits &keys, const tensor_fn &tensors) {
    const auto src = fathom::gguf::file::open(golden_dir() + "/ds4-tiny-a.gguf");
    const std::string path =
        (std::filesystem::temp_directory_path() / ("ds4_test_" + name + ".gguf")).string();
    fathom::gguf::writer w(path);
    for (const auto &kv : src->metadata()) {
        const std::string k(kv.key);
        if (k.rfind("tokenizer.", 0) == 0) continue;
        if (auto it = keys.find(k); it != keys.end()) {
            if (it->second) it->second(w);
        } else {
            copy_value(w, k, kv.val);
        }
    }
    for (const auto &[k, fn] : keys)
        if (!src->has(k) && fn) fn(w);
    std::vector<std::pair<std::string, tensor_out>> outs;
    for (const auto &t : src->tensors()) {
        tensor_out o = tensors ? tensors(t) : copy_tensor(t);
        if (o.drop) continue;
        w.add_tensor(std::string(t.name), o.type, o.ne);
        outs.emplace_back(std::string(t.name), std::move(o));
    }
    w.write_header();
    for (auto &[n, o] : outs) w.write_tensor_data(o.bytes.data(), o.bytes.size());
    w.finish();
    return path;
}

}  // namespace ds4_test
