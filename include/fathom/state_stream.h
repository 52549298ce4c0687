// A session's state as a byte stream (session::save_state / load_state, include/fathom/engine.h; the
// on-disk prompt cache, src/cache and docs/prompt-cache.md, frames, checksums and stores it). Its own
// header because the models below the engine write and read their parts of it (src/core/state_io.h).
#pragma once
#include <cstddef>
#include <cstdint>

namespace fathom {

// A writer takes the bytes in order; a reader hands them back in the same order and never reads past
// the end of the stream. Both throw fathom::error on failure (I/O, a stream that ends early).
class state_writer {
public:
    virtual ~state_writer() = default;
    virtual void write(const void *data, size_t n) = 0;
};

class state_reader {
public:
    virtual ~state_reader() = default;
    virtual void read(void *data, size_t n) = 0;  // throws when fewer than n bytes remain
    virtual uint64_t remaining() const = 0;       // bytes of the stream not yet read
};

}  // namespace fathom
