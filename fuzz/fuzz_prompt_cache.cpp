// libFuzzer target for the prompt-cache entry decoder (src/cache/entry.h): parses arbitrary bytes as an
// entry file, reads the identity and tokens, then streams the state section in uneven pieces the way a
// session's load_state does and verifies it (finish). fathom::cache::entry_error is the only acceptable
// failure, with a one-line message naming the input; anything else (crash, sanitizer report, another
// exception, a huge allocation: -rss_limit_mb) is a finding. The seeds are written by write_entry (raw
// and zstd states); tests/cache/test_cache_entry.cpp replays a deterministic mutation corpus through the
// same steps in ctest.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cache/entry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    using namespace fathom::cache;
    const memory_source src(std::span<const uint8_t>(data, size), "fuzz");
    try {
        const entry_header h = read_header(src);
        (void)read_identity(src, h);
        const std::vector<int32_t> toks = read_tokens(src, h);
        if (toks.size() != h.n_tokens) __builtin_trap();
        state_section_reader r(src, h.sections[2]);
        std::vector<uint8_t> buf(4093);
        size_t piece = 1;
        while (r.remaining() > 0) {
            const size_t n = static_cast<size_t>(std::min<uint64_t>(r.remaining(), piece));
            r.read(buf.data(), n);
            piece = piece * 3 % buf.size() + 1;
        }
        r.finish();
    } catch (const entry_error &e) {
        const std::string m = e.what();
        if (m.rfind("fuzz: ", 0) != 0 || m.find('\n') != std::string::npos) __builtin_trap();
    }
    return 0;
}
