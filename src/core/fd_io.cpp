// Writing to a file descriptor (fd_io.h).
#include "core/fd_io.h"

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace fathom {

void fd_write_all(int fd, const void *data, size_t n, const std::string &name) {
    const auto *p = static_cast<const uint8_t *>(data);
    while (n > 0) {
        const ssize_t w = ::write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) throw error(name + ": write: " + std::strerror(errno));
        p += w;
        n -= static_cast<size_t>(w);
    }
}

}  // namespace fathom
