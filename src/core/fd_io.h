// Writing to a file descriptor: the EINTR-safe write loop that the prompt cache's file sink
// (src/cache/entry.h fd_sink) and the server's tool-turn journal (src/server/tool_calls.cpp) share.
#pragma once
#include <cstddef>
#include <string>

namespace fathom {

// Writes all n bytes to fd (not owned), retrying short writes and EINTR. Throws fathom::error
// "<name>: write: <strerror>" on failure.
void fd_write_all(int fd, const void *data, size_t n, const std::string &name);

}  // namespace fathom
