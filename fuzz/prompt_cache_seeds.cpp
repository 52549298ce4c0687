// Seed corpus for fuzz_prompt_cache: small entries written by the Fathom encoder (write_entry), with
// raw and zstd-compressed states, into the directory given as argv[1].
#include <cstdio>
#include <string>
#include <vector>

#include "cache/entry.h"

namespace {

struct pattern_writer {
    uint64_t bytes;
    bool operator()(fathom::state_writer &w) const {
        for (uint64_t i = 0; i < bytes; ++i) {
            const uint8_t b = static_cast<uint8_t>(i * 131 + (i >> 7));
            w.write(&b, 1);
        }
        return true;
    }
};

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: prompt_cache_seeds DIR\n");
        return 2;
    }
    int k = 0;
    for (const uint64_t state : {uint64_t{1}, uint64_t{100}, uint64_t{3000}})
        for (const int level : {0, 1})
            for (const size_t n_tok : {size_t{1}, size_t{17}}) {
                std::vector<int32_t> toks(n_tok);
                for (size_t i = 0; i < n_tok; ++i) toks[i] = static_cast<int32_t>(i * 7 + 3);
                fathom::cache::memory_sink sink;
                fathom::cache::write_entry(sink, "seed identity", toks, level, pattern_writer{state});
                const std::string path = std::string(argv[1]) + "/seed" + std::to_string(k++);
                std::FILE *f = std::fopen(path.c_str(), "wb");
                if (!f) return 1;
                std::fwrite(sink.bytes.data(), 1, sink.bytes.size(), f);
                std::fclose(f);
            }
    return 0;
}
