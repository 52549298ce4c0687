// Model file fingerprint (fingerprint.h).
#include "gguf/fingerprint.h"

#include <xxhash.h>

#include <cinttypes>
#include <cstdio>
#include <memory>

#include "core/error.h"
#include "gguf/gguf.h"

namespace fathom::gguf {

std::string file_fingerprint(const gguf::file &f) {
    const std::span<const uint8_t> b = f.bytes();
    const uint64_t size = b.size(), data0 = std::min<uint64_t>(f.data_offset(), size);
    std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> st(XXH64_createState(), XXH64_freeState);
    if (!st || XXH64_reset(st.get(), 0) != XXH_OK) throw error("fingerprint: cannot create a hash state");
    XXH64_update(st.get(), b.data(), static_cast<size_t>(data0));
    constexpr uint64_t n_samples = 64, sample = 4096;
    const uint64_t data_bytes = size - data0;
    if (data_bytes <= n_samples * sample) {
        XXH64_update(st.get(), b.data() + data0, static_cast<size_t>(data_bytes));
    } else {
        const uint64_t stride = (data_bytes - sample) / (n_samples - 1);  // sample k at data0 + k * stride
        for (uint64_t k = 0; k < n_samples; ++k)
            XXH64_update(st.get(), b.data() + data0 + k * stride, static_cast<size_t>(sample));
    }
    char buf[48];
    std::snprintf(buf, sizeof buf, "%" PRIu64 "-%016" PRIx64, size,
                  static_cast<uint64_t>(XXH64_digest(st.get())));
    return buf;
}

}  // namespace fathom::gguf
