// Little helpers for sessions' state streams (session::save_state / load_state, include/fathom/engine.h):
// fixed-width little-endian scalars and the checks a loader makes on what it reads. The prompt cache
// (src/cache) frames and checksums the stream; these helpers only make each session's layout readable
// and every length it reads bounded by what the session already knows (its geometry), never by the
// stream, so a malformed stream cannot make a loader allocate.
#pragma once
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "fathom/state_stream.h"

namespace fathom::state_io {

static_assert(std::endian::native == std::endian::little, "state streams are little-endian");

template <class T>
void put(state_writer &w, T v) {
    static_assert(std::is_arithmetic_v<T>);
    w.write(&v, sizeof v);
}

template <class T>
T get(state_reader &r) {
    static_assert(std::is_arithmetic_v<T>);
    T v{};
    r.read(&v, sizeof v);
    return v;
}

// Reads a u64 and throws "<what>: the state has X, this session Y" unless it equals `want`.
inline void expect(state_reader &r, uint64_t want, const char *what) {
    const uint64_t got = get<uint64_t>(r);
    if (got != want)
        throw error(std::string("saved state: ") + what + " is " + std::to_string(got) + ", this session's " +
                    std::to_string(want));
}

// Discards n bytes of the stream (a loader that keeps only part of it).
inline void skip(state_reader &r, uint64_t n) {
    char buf[4096];
    while (n > 0) {
        const size_t k = n < sizeof buf ? static_cast<size_t>(n) : sizeof buf;
        r.read(buf, k);
        n -= k;
    }
}

}  // namespace fathom::state_io
