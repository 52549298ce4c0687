// fathom-gguf: command-line tool for GGUF files. One function pair per subcommand:
// setup_<name>(CLI::App&) declares its options, run_<name>(options) does the work.
//   info FILE [--json]   header, metadata (arrays abbreviated) and tensor table
//   synth-dense ...      random-weight qwen3/gemma3 GGUF with a real vocab (src/models/dense_synth.h)
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "gguf/gguf.h"
#include "models/deepseek4_synth_cli.h"  // synth subcommand (DS4 engineer)
#include "models/dense_synth.h"

namespace {

using fathom::gguf::value;
using fathom::gguf::value_type;
using json = nlohmann::json;

// ---- shared formatting ----

// True if s is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool valid_utf8(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        size_t n = 0;
        uint32_t cp = 0;
        if (c < 0x80) {
            ++i;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            n = 1, cp = c & 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            n = 2, cp = c & 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            n = 3, cp = c & 0x07;
        } else {
            return false;
        }
        if (i + n >= s.size()) return false;  // sequence runs past the end
        for (size_t k = 1; k <= n; ++k) {
            const auto d = static_cast<unsigned char>(s[i + k]);
            if ((d & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (d & 0x3f);
        }
        static const uint32_t min_cp[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        i += n + 1;
    }
    return true;
}

// One-line printable rendering of file bytes: escapes control bytes (and all non-ASCII bytes unless
// the string is valid UTF-8), cuts long strings.
std::string printable(std::string_view s, size_t max_len = 80) {
    static const char *hex = "0123456789abcdef";
    const bool utf8 = valid_utf8(s);
    std::string out = "\"";
    for (size_t i = 0; i < s.size(); ++i) {
        const auto c = static_cast<unsigned char>(s[i]);
        // Cut only at a character boundary (never inside a UTF-8 sequence).
        if (i >= max_len && (c & 0xc0) != 0x80) {
            out += "...(" + std::to_string(s.size()) + " bytes)";
            break;
        }
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if ((c >= 0x20 && c < 0x7f) || (utf8 && c >= 0x80)) {
            out += static_cast<char>(c);
        } else {
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    return out + "\"";
}

std::string format_double(double d) {
    std::ostringstream os;
    os.precision(9);
    os << d;
    return os.str();
}

std::string format_scalar(const value &v) {
    switch (v.type) {
        case value_type::string:
            return printable(v.str);
        case value_type::boolean:
            return v.i ? "true" : "false";
        case value_type::f32:
        case value_type::f64:
            return format_double(v.f);
        case value_type::u8:
        case value_type::u16:
        case value_type::u32:
        case value_type::u64:
            return std::to_string(v.u);
        default:
            return std::to_string(v.i);
    }
}

// "[a, b, c, ...]" with at most `max` elements shown.
std::string format_array(const value &v, size_t max = 8) {
    std::string out = "[";
    const size_t n = std::min(v.arr_len, max);
    for (size_t k = 0; k < n; ++k) {
        if (k) out += ", ";
        if (v.elem_type == value_type::string) {
            out += printable(v.arr_str[k], 40);
        } else if (v.elem_type == value_type::f32 || v.elem_type == value_type::f64) {
            out += format_double(v.arr_float[k]);
        } else if (v.elem_type == value_type::boolean) {
            out += v.arr_int[k] ? "true" : "false";
        } else if (v.elem_type == value_type::array) {
            out += "[...]";
        } else {
            out += std::to_string(v.arr_int[k]);
        }
    }
    if (v.arr_len > n) out += ", ...";
    return out + "]";
}

std::string format_shape(const fathom::gguf::tensor_info &t) {
    std::string s = "[";
    for (uint32_t d = 0; d < t.n_dims; ++d) s += (d ? ", " : "") + std::to_string(t.ne[d]);
    return s + "]";
}

json value_json(const value &v) {
    json j;
    j["type"] = std::string(fathom::gguf::value_type_name(v.type));
    switch (v.type) {
        case value_type::string:
            j["value"] = std::string(v.str);
            break;
        case value_type::boolean:
            j["value"] = v.i != 0;
            break;
        case value_type::f32:
        case value_type::f64:
            j["value"] = v.f;
            break;
        case value_type::u8:
        case value_type::u16:
        case value_type::u32:
        case value_type::u64:
            j["value"] = v.u;
            break;
        case value_type::array: {
            j["elem_type"] = std::string(fathom::gguf::value_type_name(v.elem_type));
            j["len"] = v.arr_len;
            json head = json::array();
            const size_t n = std::min<size_t>(v.arr_len, 16);
            for (size_t k = 0; k < n; ++k) {
                if (v.elem_type == value_type::string)
                    head.push_back(std::string(v.arr_str[k]));
                else if (v.elem_type == value_type::f32 || v.elem_type == value_type::f64)
                    head.push_back(v.arr_float[k]);
                else if (v.elem_type == value_type::boolean)
                    head.push_back(v.arr_int[k] != 0);
                else if (v.elem_type != value_type::array)
                    head.push_back(v.arr_int[k]);
            }
            j["head"] = head;
            break;
        }
        default:
            j["value"] = v.i;
            break;
    }
    return j;
}

// ---- info ----

struct info_options {
    std::string path;
    bool json = false;
};

void print_info_json(const fathom::gguf::file &f) {
    json j;
    j["path"] = f.path();
    j["version"] = f.version();
    j["alignment"] = f.alignment();
    j["size"] = f.size();
    j["data_offset"] = f.data_offset();
    json md = json::array();
    for (const auto &e : f.metadata()) {
        json v = value_json(e.val);
        v["key"] = std::string(e.key);
        md.push_back(std::move(v));
    }
    j["metadata"] = std::move(md);
    json ts = json::array();
    for (const auto &t : f.tensors()) {
        json shape = json::array();
        for (uint32_t d = 0; d < t.n_dims; ++d) shape.push_back(t.ne[d]);
        ts.push_back({{"name", std::string(t.name)},
                      {"type", std::string(fathom::dtype_name(t.type))},
                      {"type_id", static_cast<uint32_t>(t.type)},
                      {"shape", shape},
                      {"offset", t.offset},
                      {"nbytes", t.nbytes}});
    }
    j["tensors"] = std::move(ts);
    // File bytes need not be UTF-8: replace invalid sequences instead of failing.
    std::cout << j.dump(1, ' ', false, json::error_handler_t::replace) << "\n";
}

void print_info_text(const fathom::gguf::file &f) {
    std::printf("file:        %s\n", f.path().c_str());
    std::printf("version:     %u\n", f.version());
    std::printf("alignment:   %zu\n", f.alignment());
    std::printf("size:        %zu bytes\n", f.size());
    std::printf("data offset: %zu\n", f.data_offset());
    std::printf("metadata:    %zu entries\n", f.metadata().size());
    for (const auto &e : f.metadata()) {
        const value &v = e.val;
        std::string line = "  " + printable(e.key, 120) + " " + fathom::gguf::value_type_label(v);
        if (v.type == value_type::array) {
            line += " (" + std::to_string(v.arr_len) + ") = " + format_array(v);
        } else {
            line += " = " + format_scalar(v);
        }
        std::printf("%s\n", line.c_str());
    }
    size_t total = 0;
    for (const auto &t : f.tensors()) total += t.nbytes;
    std::printf("tensors:     %zu (%zu bytes)\n", f.tensors().size(), total);
    if (f.tensors().empty()) return;
    std::printf("  %-40s %-8s %-28s %14s %14s\n", "name", "type", "shape", "offset", "bytes");
    for (const auto &t : f.tensors()) {
        std::printf("  %-40s %-8s %-28s %14llu %14zu\n", printable(t.name, 60).c_str(),
                    std::string(fathom::dtype_name(t.type)).c_str(), format_shape(t).c_str(),
                    static_cast<unsigned long long>(t.offset), t.nbytes);
    }
}

int run_info(const info_options &o) {
    auto f = fathom::gguf::file::open(o.path);
    if (o.json) {
        print_info_json(*f);
    } else {
        print_info_text(*f);
    }
    return 0;
}

void setup_info(CLI::App &app, int &rc) {
    auto opts = std::make_shared<info_options>();
    CLI::App *sub = app.add_subcommand("info", "Print header, metadata and tensor table of a GGUF file");
    sub->add_option("file", opts->path, "GGUF file")->required();
    sub->add_flag("--json", opts->json, "Machine-readable JSON (array values: length and first 16 elements)");
    sub->callback([opts, &rc] { rc = run_info(*opts); });
}

// ---- synth-dense ----

struct synth_dense_options {
    std::string arch = "qwen3";
    std::string vocab;
    std::string out;
    uint64_t seed = 1;
    bool float_weights = false;
};

int run_synth_dense(const synth_dense_options &o) {
    fathom::dense_synth_options so = fathom::dense_synth_preset(o.arch, o.vocab, o.seed);
    so.float_weights = o.float_weights;
    fathom::dense_synth_write(so, o.out);
    std::printf("%s  %s\n", fathom::dense_synth_sha256(o.out).c_str(), o.out.c_str());
    return 0;
}

void setup_synth_dense(CLI::App &app, int &rc) {
    auto opts = std::make_shared<synth_dense_options>();
    CLI::App *sub = app.add_subcommand(
        "synth-dense", "Write a small random-weight dense model (preset geometry) with the tokenizer of a vocab GGUF");
    sub->add_option("--arch", opts->arch, "qwen3 | gemma3")->capture_default_str();
    sub->add_option("--vocab", opts->vocab, "GGUF whose tokenizer.* keys are copied")->required();
    sub->add_option("--seed", opts->seed, "weight seed")->capture_default_str();
    sub->add_option("-o,--out", opts->out, "output GGUF")->required();
    sub->add_flag("--float-weights", opts->float_weights, "only f32/f16 matrices (no quantised types)");
    sub->callback([opts, &rc] { rc = run_synth_dense(*opts); });
}

}  // namespace

int main(int argc, char **argv) {
    CLI::App app{"fathom-gguf: inspect and write GGUF files"};
    app.require_subcommand(1);
    int rc = 0;
    setup_info(app, rc);
    fathom::ds4::setup_synth_command(app, rc);
    setup_synth_dense(app, rc);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError &e) {
        return app.exit(e);
    } catch (const fathom::error &e) {
        std::fprintf(stderr, "fathom-gguf: %s\n", e.what());
        return 1;
    }
    return rc;
}
