// The prompt-cache entry format (src/cache/entry.h, docs/prompt-cache.md) without a directory or a
// model: encode / decode round trips (raw and zstd), and damage of every kind — truncation at every
// section boundary and at random offsets, single bit flips anywhere, a wrong magic or version, length
// fields set to absurd values under a valid header checksum, trailing bytes — each rejected with a
// one-line entry_error of the right kind, never a crash (the suite also runs under ASan). The last test
// replays a deterministic mutation corpus through the same checks as fuzz/fuzz_prompt_cache.cpp.
#include <gtest/gtest.h>
#include <xxhash.h>
#include <zstd.h>

#include <cstring>
#include <random>

#include "cache/entry.h"
#include "cache_test_util.h"

namespace {

using namespace fathom;
using namespace fathom::cache;
using fathom::cache_test::make_entry;
using fathom::cache_test::tokens_of;

const std::string k_id = "test identity v1";

// Decodes `b` fully; returns "" when it is a valid entry, else the entry_error's message (and its kind).
std::string verdict(const std::vector<uint8_t> &b, entry_error::kind_t *kind = nullptr) {
    try {
        check_entry(memory_source(b, "e"));
        return "";
    } catch (const entry_error &e) {
        if (kind) *kind = e.kind;
        const std::string m = e.what();
        EXPECT_EQ(m.find('\n'), std::string::npos) << m;
        EXPECT_EQ(m.rfind("e: ", 0), 0u) << m;  // names the file
        return m;
    }
}

// Rewrites the header checksum after a test edited header or table bytes.
void reseal(std::vector<uint8_t> &b) {
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    XXH64_update(h, b.data(), 56);
    XXH64_update(h, b.data() + header_bytes, n_sections_v1 * table_entry_bytes);
    const uint64_t v = XXH64_digest(h);
    XXH64_freeState(h);
    std::memcpy(&b[56], &v, 8);
}

template <class T>
void poke(std::vector<uint8_t> &b, size_t at, T v) {
    std::memcpy(&b[at], &v, sizeof v);
}

size_t table_field(int section, int offset) {
    return header_bytes + size_t(section) * table_entry_bytes + size_t(offset);
}

TEST(CacheEntry, RoundTripRawAndZstd) {
    const std::vector<int32_t> toks = tokens_of(300, 1);
    for (int level : {0, 1, 19}) {
        const std::vector<uint8_t> b = make_entry(k_id, toks, 100000, level);
        const memory_source src(b, "e");
        const entry_header h = check_entry(src);
        EXPECT_EQ(h.n_tokens, 300u);
        EXPECT_EQ(h.file_bytes, b.size());
        EXPECT_EQ(h.key_hash, entry_key(k_id, toks));
        EXPECT_EQ(read_identity(src, h), k_id);
        EXPECT_EQ(read_tokens(src, h), toks);
        EXPECT_EQ(h.sections[2].enc, level > 0 ? codec::zstd : codec::raw);
        EXPECT_EQ(h.sections[2].raw, 100000u);
        // The state reads back through a session in pieces of any size.
        fathom::cache_test::pattern_session s(100000);
        state_section_reader r(src, h.sections[2]);
        ASSERT_TRUE(s.load_state(r, toks, 300));
        r.finish();
        EXPECT_EQ(s.tokens(), toks);
        if (level == 0) {
            EXPECT_EQ(b.size(), 64 + 3 * 48 + k_id.size() + 4 * 300 + 100000u);
        }
    }
    EXPECT_EQ(entry_file_name(0x0123456789abcdefull), "0123456789abcdef.fpc");
}

// The entry layout of docs/prompt-cache.md, assembled by hand (cache_test::doc_entry), is byte for
// byte what write_entry produces for a raw state, and the decoder accepts it raw and zstd-compressed.
TEST(CacheEntry, DocumentedLayoutIsWhatTheCodeWritesAndReads) {
    const std::vector<int32_t> toks = tokens_of(77, 9);
    fathom::cache_test::pattern_session s(5000);
    s.sync(toks, {});
    fathom::cache_test::vector_writer w;
    ASSERT_TRUE(s.save_state(w));
    const std::vector<uint8_t> doc = fathom::cache_test::doc_entry(k_id, toks, w.bytes, 0, w.bytes.size());
    EXPECT_EQ(doc, make_entry(k_id, toks, 5000));
    EXPECT_EQ(check_entry(memory_source(doc, "doc")).n_tokens, 77u);
    std::vector<uint8_t> z(ZSTD_compressBound(w.bytes.size()));
    z.resize(ZSTD_compress(z.data(), z.size(), w.bytes.data(), w.bytes.size(), 3));
    const std::vector<uint8_t> docz = fathom::cache_test::doc_entry(k_id, toks, z, 1, w.bytes.size());
    const memory_source src(docz, "docz");
    const entry_header h = check_entry(src);
    EXPECT_EQ(h.sections[2].enc, codec::zstd);
    fathom::cache_test::pattern_session r(5000);
    state_section_reader sr(src, h.sections[2]);
    ASSERT_TRUE(r.load_state(sr, toks, 77));
    sr.finish();
    EXPECT_EQ(r.tokens(), toks);
}

TEST(CacheEntry, TruncatedAtEverySectionBoundaryAndRandomOffsets) {
    for (int level : {0, 3}) {
        const std::vector<uint8_t> b = make_entry(k_id, tokens_of(64, 2), 20000, level);
        const entry_header h = check_entry(memory_source(b, "e"));
        std::vector<size_t> cuts = {0, 1, 7, 8, 63, 64, 65, 64 + 48, 64 + 2 * 48, 64 + 3 * 48 - 1};
        for (const section &s : h.sections)
            for (size_t d : {size_t(0), size_t(1)}) {
                cuts.push_back(size_t(s.offset) + d);
                cuts.push_back(size_t(s.offset + s.stored) - 1 - d);
            }
        std::mt19937_64 rng(7);
        for (int i = 0; i < 200; ++i) cuts.push_back(size_t(rng() % b.size()));
        for (size_t cut : cuts) {
            if (cut >= b.size()) continue;
            std::vector<uint8_t> t(b.begin(), b.begin() + std::ptrdiff_t(cut));
            entry_error::kind_t k{};
            const std::string why = verdict(t, &k);
            EXPECT_FALSE(why.empty()) << "cut at " << cut;
            EXPECT_EQ(k, entry_error::kind_t::damaged) << why;
            if (cut >= 64 + 3 * 48) {
                EXPECT_NE(why.find("truncated"), std::string::npos) << why;
            }
        }
        // Bytes after the end are damage too.
        std::vector<uint8_t> longer = b;
        longer.push_back(0);
        EXPECT_NE(verdict(longer).find("after the end"), std::string::npos);
    }
}

TEST(CacheEntry, EveryBitFlipIsCaught) {
    for (int level : {0, 1}) {
        const std::vector<uint8_t> b = make_entry(k_id, tokens_of(40, 3), 3000, level);
        // Every bit of the header, the table, the identity and the tokens; a sample of the state's.
        std::vector<size_t> bits;
        const size_t head = (64 + 3 * 48 + k_id.size() + 160) * 8;
        for (size_t i = 0; i < head; ++i) bits.push_back(i);
        std::mt19937_64 rng(11);
        for (int i = 0; i < 2000; ++i) bits.push_back(size_t(rng() % (b.size() * 8)));
        for (size_t bit : bits) {
            std::vector<uint8_t> t = b;
            t[bit / 8] ^= uint8_t(1u << (bit % 8));
            entry_error::kind_t k{};
            const std::string why = verdict(t, &k);
            ASSERT_FALSE(why.empty()) << "flip of bit " << bit << " (byte " << bit / 8 << ") not caught";
            // Only a flip in the version field makes a well-formed header of another version.
            const bool version = bit / 8 >= 8 && bit / 8 < 12;
            EXPECT_EQ(k, version ? entry_error::kind_t::foreign : entry_error::kind_t::damaged) << why;
        }
    }
}

TEST(CacheEntry, WrongMagicVersionAndKey) {
    const std::vector<uint8_t> b = make_entry(k_id, tokens_of(10, 4), 100);
    std::vector<uint8_t> t = b;
    t[0] = 'X';
    EXPECT_NE(verdict(t).find("bad magic"), std::string::npos);
    t = b;
    poke<uint32_t>(t, 8, 2);
    reseal(t);
    entry_error::kind_t k{};
    EXPECT_NE(verdict(t, &k).find("format version 2"), std::string::npos);
    EXPECT_EQ(k, entry_error::kind_t::foreign);
    t = b;
    poke<uint64_t>(t, 40, 12345);  // key hash that is not XXH64(identity, tokens)
    reseal(t);
    EXPECT_NE(verdict(t).find("key does not match"), std::string::npos);
    t = b;
    poke<uint64_t>(t, 32, 999);  // identity hash
    reseal(t);
    EXPECT_NE(verdict(t).find("identity does not match"), std::string::npos);
    EXPECT_NE(verdict({}).find("truncated"), std::string::npos);
}

// Lengths set to absurd values under a valid header checksum: refused from the header alone, before
// any allocation or read they would imply (ASan's allocator would fail on a 2^60-byte vector).
TEST(CacheEntry, AbsurdLengthsAreRefusedBeforeAllocating) {
    const std::vector<uint8_t> b = make_entry(k_id, tokens_of(16, 5), 512);
    struct edit {
        size_t at;
        uint64_t value;
        const char *expect;
    };
    const edit edits[] = {
        {24, uint64_t{1} << 60, "tokens (1.."},                         // n_tokens
        {24, 0, "tokens (1.."},                                         // n_tokens
        {16, uint64_t{1} << 62, "truncated"},                           // file bytes
        {table_field(0, 16), uint64_t{1} << 40, "runs past the end"},   // identity stored
        {table_field(1, 16), uint64_t{1} << 62, "runs past the end"},   // tokens stored
        {table_field(2, 16), ~uint64_t{0}, "runs past the end"},        // state stored
        {table_field(2, 24), uint64_t{1} << 50, "raw length differs"},  // state raw (raw codec)
        {table_field(1, 8), 7, "starts at"},                            // token section offset
        {table_field(0, 40), 1, "reserved"},
        {48, 1, "reserved"},
        {12, 4, "sections"},
    };
    for (const edit &e : edits) {
        std::vector<uint8_t> t = b;
        if (e.at == 12)
            poke<uint32_t>(t, e.at, uint32_t(e.value));
        else
            poke<uint64_t>(t, e.at, e.value);
        reseal(t);
        const std::string why = verdict(t);
        EXPECT_NE(why.find(e.expect), std::string::npos) << "edit at " << e.at << ": " << why;
    }
    // A zstd state promising 2^39 decoded bytes decodes to fewer: damaged when the reader runs out
    // (nothing is allocated for the promise); 2^50 is over the limit outright.
    std::vector<uint8_t> z = make_entry(k_id, tokens_of(16, 5), 512, 1);
    poke<uint64_t>(z, table_field(2, 24), uint64_t{1} << 50);
    reseal(z);
    EXPECT_NE(verdict(z).find("state of"), std::string::npos) << verdict(z);
    poke<uint64_t>(z, table_field(2, 24), uint64_t{1} << 39);
    reseal(z);
    EXPECT_NE(verdict(z).find("frame ends before"), std::string::npos) << verdict(z);
    // Unknown codec / kind.
    std::vector<uint8_t> c = b;
    poke<uint32_t>(c, table_field(2, 4), 9);
    reseal(c);
    EXPECT_NE(verdict(c).find("codec 9"), std::string::npos);
    c = b;
    poke<uint32_t>(c, table_field(1, 0), 3);
    reseal(c);
    EXPECT_NE(verdict(c).find("kind 3"), std::string::npos);
}

// What fuzz/fuzz_prompt_cache.cpp does with each input, for the deterministic corpus below.
void exercise(const std::vector<uint8_t> &data) {
    const memory_source src(data, "fuzz");
    try {
        const entry_header h = read_header(src);
        (void)read_identity(src, h);
        const std::vector<int32_t> toks = read_tokens(src, h);
        state_section_reader r(src, h.sections[2]);
        std::vector<uint8_t> buf(777);
        while (r.remaining() > 0) r.read(buf.data(), size_t(std::min<uint64_t>(r.remaining(), buf.size())));
        r.finish();
        (void)check_entry(src);
        EXPECT_GT(toks.size(), 0u);
    } catch (const entry_error &e) {
        const std::string m = e.what();
        EXPECT_EQ(m.rfind("fuzz: ", 0), 0u) << m;
        EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
}

TEST(CacheEntry, DeterministicMutationCorpus) {
    std::vector<std::vector<uint8_t>> seeds = {make_entry(k_id, tokens_of(3, 6), 50),
                                               make_entry(k_id, tokens_of(30, 7), 3000, 1),
                                               make_entry("x", tokens_of(1, 8), 1)};
    std::mt19937_64 rng(12345);
    for (int iter = 0; iter < 3000; ++iter) {
        std::vector<uint8_t> d = seeds[size_t(rng() % seeds.size())];
        const int n_mut = 1 + int(rng() % 4);
        for (int m = 0; m < n_mut && !d.empty(); ++m) {
            switch (rng() % 5) {
                case 0:
                    d[rng() % d.size()] ^= uint8_t(1u << (rng() % 8));
                    break;
                case 1:
                    d.resize(rng() % d.size());
                    break;
                case 2:
                    d.insert(d.begin() + std::ptrdiff_t(rng() % d.size()), uint8_t(rng()));
                    break;
                case 3:
                    d[rng() % d.size()] = uint8_t(rng());
                    break;
                default:  // an aligned 8-byte field of the header or table set to a random value, resealed
                    if (d.size() >= 64 + 3 * 48) {
                        poke<uint64_t>(d, 8 * size_t(rng() % 26), rng() >> (rng() % 64));
                        reseal(d);
                    }
            }
        }
        exercise(d);
    }
    for (const auto &s : seeds) EXPECT_EQ(verdict(s), "");
}

}  // namespace
