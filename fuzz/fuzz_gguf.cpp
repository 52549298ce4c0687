// libFuzzer target for the GGUF reader: parses arbitrary bytes with file::from_memory and, when the
// parse succeeds, calls every getter on every key and reads every byte of every tensor, so that the
// sanitizers see any out-of-bounds view the reader might hand out. fathom::error is the only
// acceptable failure; anything else (crash, sanitizer report, other exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "gguf/gguf.h"

namespace {

// Calls a getter, accepting only fathom::error as a failure mode.
template <typename F>
void try_get(F &&fn) {
    try {
        fn();
    } catch (const fathom::error &) {
    }
}

// Sums bytes so the compiler cannot drop the reads.
volatile uint64_t g_sink = 0;

void touch(const uint8_t *p, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; i < n; ++i) s += p[i];
    g_sink = g_sink + s;
}

void exercise(const fathom::gguf::file &f) {
    for (const auto &e : f.metadata()) {
        touch(reinterpret_cast<const uint8_t *>(e.key.data()), e.key.size());
        const std::string_view k = e.key;
        try_get([&] { g_sink = g_sink + static_cast<uint64_t>(f.get_int(k)); });
        try_get([&] { g_sink = g_sink + f.get_u32(k, 0); });
        try_get([&] { g_sink = g_sink + static_cast<uint64_t>(f.get_float(k) != 0.0); });
        try_get([&] { g_sink = g_sink + f.get_bool(k); });
        try_get([&] {
            auto s = f.get_string(k);
            touch(reinterpret_cast<const uint8_t *>(s.data()), s.size());
        });
        try_get([&] {
            for (auto s : f.get_string_array(k)) touch(reinterpret_cast<const uint8_t *>(s.data()), s.size());
        });
        try_get([&] { g_sink = g_sink + f.get_int_array(k).size(); });
        try_get([&] { g_sink = g_sink + f.get_float_array(k).size(); });
        if (f.find(k) != &e.val) __builtin_trap();  // duplicates are rejected, so lookup must agree
    }
    try_get([&] { g_sink = g_sink + f.get_int("general.alignment", 0); });
    for (const auto &t : f.tensors()) {
        touch(reinterpret_cast<const uint8_t *>(t.name.data()), t.name.size());
        touch(t.data, t.nbytes);
        if (f.find_tensor(t.name) != &t) __builtin_trap();
        if (t.nelements() <= 0 || t.offset % f.alignment() != 0) __builtin_trap();
    }
    try_get([&] { f.tensor("fuzz.missing"); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    std::unique_ptr<fathom::gguf::file> f;
    try {
        f = fathom::gguf::file::from_memory(data, size, "fuzz");
    } catch (const fathom::error &e) {
        // Every rejection must be a single line naming the input.
        const std::string m = e.what();
        if (m.rfind("fuzz: ", 0) != 0 || m.find('\n') != std::string::npos) __builtin_trap();
        return 0;
    }
    exercise(*f);
    return 0;
}
