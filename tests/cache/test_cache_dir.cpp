// The prompt-cache directory (src/cache/prompt_cache.h) with model-free sessions (pattern_session):
// save / lookup / load, longest-prefix lookup with and without prefix loads, damaged and foreign files,
// LRU eviction under the byte cap, many threads at once, two caches (processes) on one directory, and
// crash safety: a writer process killed halfway through a save leaves no visible entry and harms no
// existing one, and its temporary file is removed by the next cache opened on the directory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "cache/entry.h"
#include "cache/prompt_cache.h"
#include "cache_test_util.h"

namespace {

using namespace fathom;
using namespace fathom::cache_test;
using cache::prompt_cache;
using save_result = prompt_cache::save_result;

const std::string k_id = "pattern identity";

cache::options opts_of(const temp_dir &d, uint64_t max_bytes = uint64_t{1} << 30) {
    cache::options o;
    o.dir = d.path;
    o.max_bytes = max_bytes;
    o.min_tokens = 4;
    o.refresh_interval = std::chrono::milliseconds(0);  // every lookup sees the directory as it is
    return o;
}

save_result save_tokens(prompt_cache &c, const std::vector<int32_t> &toks, uint64_t state_bytes = 4096) {
    pattern_session s(state_bytes);
    s.sync(toks, {});
    std::string why;
    const save_result r = c.save(s, why);
    EXPECT_NE(r, save_result::failed) << why;
    return r;
}

std::vector<uint8_t> read_file(const std::string &p) {
    std::ifstream f(p, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string &p, const std::vector<uint8_t> &b) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char *>(b.data()), std::streamsize(b.size()));
}

std::string entry_path(const temp_dir &d, const std::vector<int32_t> &toks) {
    return d.path + "/" + cache::entry_file_name(cache::entry_key(k_id, toks));
}

TEST(CacheDir, SaveLookupLoad) {
    temp_dir d;
    prompt_cache c(opts_of(d), k_id);
    const std::vector<int32_t> a = tokens_of(100, 1);
    EXPECT_EQ(save_tokens(c, a), save_result::saved);
    EXPECT_EQ(save_tokens(c, a), save_result::exists);
    EXPECT_EQ(save_tokens(c, tokens_of(3, 9)), save_result::too_short);
    EXPECT_TRUE(c.contains(a));
    EXPECT_EQ(d.files(), std::vector<std::string>{cache::entry_file_name(cache::entry_key(k_id, a))});

    // A prompt extending the entry: kept whole; one diverging at 60: a prefix (prefix loads only).
    std::vector<int32_t> longer = a;
    longer.push_back(7);
    auto m = c.lookup(longer, false);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_keep, 100);
    std::vector<int32_t> diverge(a.begin(), a.begin() + 60);
    diverge.push_back(-5);
    EXPECT_FALSE(c.lookup(diverge, false));
    m = c.lookup(diverge, true);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_keep, 60);
    EXPECT_FALSE(c.lookup(tokens_of(50, 2), true));

    pattern_session s;
    std::string why;
    ASSERT_TRUE(c.load(*m, s, why)) << why;
    EXPECT_EQ(s.tokens(), std::vector<int32_t>(a.begin(), a.begin() + 60));
    const cache::stats st = c.get_stats();
    EXPECT_EQ(st.entries, 1u);
    EXPECT_EQ(st.saves, 1u);
    EXPECT_EQ(st.bytes, uint64_t(std::filesystem::file_size(entry_path(d, a))));

    // A second cache on the directory (a restarted server) finds it.
    prompt_cache c2(opts_of(d), k_id);
    EXPECT_TRUE(c2.contains(a));
    // The longest of several entries wins; on a tie the shorter entry.
    EXPECT_EQ(save_tokens(c, std::vector<int32_t>(a.begin(), a.begin() + 80)), save_result::saved);
    m = c.lookup(longer, false);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_keep, 100);
    m = c.lookup(std::vector<int32_t>(a.begin(), a.begin() + 90), true);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_keep, 90);
    EXPECT_EQ(m->tokens->size(), 100u);
    m = c.lookup(std::vector<int32_t>(a.begin(), a.begin() + 70), true);
    EXPECT_EQ(m->tokens->size(), 80u);  // both keep 70: the smaller entry
}

// save() copies the state into memory and then releases the session (its callback, exactly once,
// before the entry file exists): a session changed right after the release is saved as it was.
TEST(CacheDir, SaveReleasesTheSessionBeforeTheFileIsWritten) {
    temp_dir d;
    prompt_cache c(opts_of(d), k_id);
    const std::vector<int32_t> a = tokens_of(100, 4);
    pattern_session s(1 << 20);
    s.sync(a, {});
    int calls = 0;
    bool file_there = true;
    std::string why;
    const auto r = c.save(s, why, [&] {
        ++calls;
        file_there = std::filesystem::exists(entry_path(d, a));
        s.eval(std::vector<int32_t>{1, 2, 3}, nullptr);  // the session is the caller's again
    });
    EXPECT_EQ(r, save_result::saved) << why;
    EXPECT_EQ(calls, 1);
    EXPECT_FALSE(file_there) << "released only after the entry was written";
    pattern_session back(1 << 20);
    auto m = c.lookup(a, false);
    ASSERT_TRUE(m);
    ASSERT_TRUE(c.load(*m, back, why)) << why;  // checks every state byte against a's pattern
    EXPECT_EQ(back.tokens(), a);
    // every other outcome releases exactly once too
    calls = 0;
    EXPECT_EQ(c.save(s, why, [&] { ++calls; }), save_result::saved);  // a + 1, 2, 3
    EXPECT_EQ(c.save(s, why, [&] { ++calls; }), save_result::exists);
    pattern_session tiny;
    tiny.sync(tokens_of(3, 1), {});
    EXPECT_EQ(c.save(tiny, why, [&] { ++calls; }), save_result::too_short);
    EXPECT_EQ(calls, 3);
}

TEST(CacheDir, DamagedEntriesAreRejectedAndDeleted) {
    temp_dir d;
    const std::vector<int32_t> a = tokens_of(64, 3), b = tokens_of(64, 4);
    {
        prompt_cache c(opts_of(d), k_id);
        save_tokens(c, a, 20000);
        save_tokens(c, b, 20000);
    }
    // b: a flipped state byte (found only when loading: the index reads headers and tokens).
    std::vector<uint8_t> bytes = read_file(entry_path(d, b));
    bytes[bytes.size() - 100] ^= 0x10;
    write_file(entry_path(d, b), bytes);
    // a third file: truncated header (found when indexing).
    const std::string junk = d.path + "/00000000000000aa.fpc";
    write_file(junk, {'F', 'A', 'T', 'H'});
    // a file that is not an entry name is ignored.
    write_file(d.path + "/notes.txt", {'h', 'i'});

    prompt_cache c(opts_of(d), k_id);
    EXPECT_FALSE(std::filesystem::exists(junk));
    EXPECT_EQ(c.get_stats().rejected, 1u);
    EXPECT_EQ(c.get_stats().entries, 2u);
    auto m = c.lookup(b, true);
    ASSERT_TRUE(m);
    pattern_session s(20000);
    s.sync(tokens_of(5, 0), {});
    std::string why;
    EXPECT_FALSE(c.load(*m, s, why));
    EXPECT_NE(why.find("checksum mismatch"), std::string::npos) << why;
    EXPECT_TRUE(s.tokens().empty());  // the session holds nothing after a failed load
    EXPECT_FALSE(std::filesystem::exists(entry_path(d, b)));
    EXPECT_EQ(c.get_stats().rejected, 2u);
    EXPECT_FALSE(c.contains(b));
    // a is intact and loads.
    m = c.lookup(a, true);
    ASSERT_TRUE(m);
    EXPECT_TRUE(c.load(*m, s, why)) << why;
    EXPECT_TRUE(std::filesystem::exists(d.path + "/notes.txt"));
}

// A state the session itself refuses (wrong size for it) under valid checksums: rejected and deleted
// too; a file renamed to another entry's name: damaged (its key does not match its name).
TEST(CacheDir, SessionRefusalAndRenamedFile) {
    temp_dir d;
    const std::vector<int32_t> a = tokens_of(32, 5), b = tokens_of(32, 6);
    prompt_cache c(opts_of(d), k_id);
    save_tokens(c, a, 1000);  // pattern_session(4096) refuses a state of 1000 bytes
    auto m = c.lookup(a, true);
    ASSERT_TRUE(m);
    pattern_session s(4096);
    std::string why;
    EXPECT_FALSE(c.load(*m, s, why));
    EXPECT_NE(why.find("pattern: state of 1000 bytes"), std::string::npos) << why;
    EXPECT_FALSE(std::filesystem::exists(entry_path(d, a)));

    save_tokens(c, b);
    std::filesystem::rename(entry_path(d, b), d.path + "/00000000000000bb.fpc");
    c.refresh();
    EXPECT_EQ(c.get_stats().entries, 0u);
    EXPECT_EQ(d.files().size(), 0u);
}

// A session failing with something other than fathom::error (here std::bad_alloc) is neither a damaged
// entry nor a reason to throw out of load(): the caller's thread (the scheduler's I/O thread) would die.
// load returns false, the session holds nothing, the entry stays and loads into the next session.
TEST(CacheDir, SessionThrowingAnotherExceptionFailsCleanly) {
    temp_dir d;
    const std::vector<int32_t> a = tokens_of(32, 21);
    prompt_cache c(opts_of(d), k_id);
    save_tokens(c, a);
    auto m = c.lookup(a, true);
    ASSERT_TRUE(m);
    pattern_session s;
    s.sync(tokens_of(9, 1), {});
    s.load_throws_std = true;
    std::string why;
    bool ok = true;
    EXPECT_NO_THROW(ok = c.load(*m, s, why));
    EXPECT_FALSE(ok);
    EXPECT_FALSE(why.empty());
    EXPECT_TRUE(s.tokens().empty());
    EXPECT_TRUE(std::filesystem::exists(entry_path(d, a)));
    EXPECT_EQ(c.get_stats().rejected, 0u);
    pattern_session t;
    EXPECT_TRUE(c.load(*m, t, why)) << why;
    EXPECT_EQ(t.tokens(), a);
}

// A zstd state section whose table promises 1 TiB decoded, stored as a few MiB of RLE blocks (valid
// checksums: anyone can compute XXH64). The session refuses it at once (wrong size); load() used to
// decode all of the promised terabyte to check the checksum (minutes on the one I/O thread, stalling
// every load and save behind it). The checksum covers the stored bytes: verifying them is enough.
TEST(CacheDir, RefusedZstdStateIsNotDecodedToItsPromisedLength) {
    temp_dir d;
    const std::vector<int32_t> a = tokens_of(40, 22);
    const uint64_t block = 128 << 10, n_blocks = uint64_t{1} << 23;  // 1 TiB decoded
    // Frame: magic, header descriptor 0 (no content size, checksum or dictionary), window 2^17; then
    // RLE blocks of 128 KiB of zeros (3-byte block header: last flag, type 1, size; then the byte).
    std::vector<uint8_t> z = {0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x38};
    z.reserve(z.size() + 4 * n_blocks);
    for (uint64_t i = 0; i < n_blocks; ++i) {
        const uint32_t h = uint32_t(block << 3) | (1u << 1) | (i + 1 == n_blocks ? 1u : 0u);
        z.insert(z.end(), {uint8_t(h), uint8_t(h >> 8), uint8_t(h >> 16), 0});
    }
    write_file(entry_path(d, a), doc_entry(k_id, a, z, 1, block * n_blocks));
    prompt_cache c(opts_of(d), k_id);
    auto m = c.lookup(a, true);
    ASSERT_TRUE(m);
    pattern_session s(4096);
    std::string why;
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE(c.load(*m, s, why));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(secs, 10.0) << "decoded the promised length";
    EXPECT_NE(why.find("pattern: state of 1099511627776 bytes"), std::string::npos) << why;
    EXPECT_FALSE(std::filesystem::exists(entry_path(d, a)));  // intact bytes the session refuses: deleted
    EXPECT_EQ(c.get_stats().rejected, 1u);
}

// Damage found while loading deletes the file only if its name still refers to the file that was read:
// meanwhile another process (or thread) may have saved the same key again, renaming a good entry over
// it, and that one must survive.
TEST(CacheDir, DamagedLoadKeepsAnEntryRenamedOverItMeanwhile) {
    temp_dir d;
    const std::vector<int32_t> a = tokens_of(48, 23);
    prompt_cache c(opts_of(d), k_id);
    save_tokens(c, a, 20000);
    const std::string path = entry_path(d, a);
    const std::vector<uint8_t> good = read_file(path);
    std::vector<uint8_t> bad = good;
    bad[bad.size() - 10] ^= 0x40;  // a state byte: found only while loading
    write_file(path, bad);
    auto m = c.lookup(a, true);
    ASSERT_TRUE(m);
    pattern_session s(20000);
    s.on_load = [&] {  // another writer's atomic rename of a good copy, while this load reads the old one
        write_file(path + ".new", good);
        std::filesystem::rename(path + ".new", path);
    };
    std::string why;
    EXPECT_FALSE(c.load(*m, s, why));
    EXPECT_NE(why.find("checksum mismatch"), std::string::npos) << why;
    ASSERT_TRUE(std::filesystem::exists(path));
    EXPECT_EQ(read_file(path), good);
    pattern_session t(20000);
    c.refresh();
    m = c.lookup(a, true);
    ASSERT_TRUE(m);
    EXPECT_TRUE(c.load(*m, t, why)) << why;
}

TEST(CacheDir, ForeignIdentityAndVersionAreKeptButNotUsed) {
    temp_dir d;
    const std::vector<int32_t> a = tokens_of(40, 7);
    {
        prompt_cache other(opts_of(d), "another model");
        save_tokens(other, a);
    }
    // A well-formed header of a future version.
    std::vector<uint8_t> v2 = make_entry(k_id, tokens_of(40, 8), 100);
    v2[8] = 2;
    write_file(d.path + "/00000000000000cc.fpc", v2);
    prompt_cache c(opts_of(d), k_id);
    EXPECT_FALSE(c.lookup(a, true));
    EXPECT_EQ(c.get_stats().entries, 2u);  // both count towards the cap
    EXPECT_EQ(c.get_stats().rejected, 0u);
    EXPECT_EQ(d.files().size(), 2u);
}

TEST(CacheDir, LruEvictionKeepsTheDirectoryUnderTheCap) {
    temp_dir d;
    const uint64_t state = 10000;
    const uint64_t entry = uint64_t(make_entry(k_id, tokens_of(20, 0), state).size());
    prompt_cache c(opts_of(d, 3 * entry + entry / 2), k_id);  // room for three
    std::vector<std::vector<int32_t>> t;
    for (int i = 0; i < 3; ++i) {
        t.push_back(tokens_of(20, 100 + i));
        save_tokens(c, t.back(), state);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // distinct modification times
    }
    // A hit makes t[0] the most recently used: the next save evicts t[1].
    auto m = c.lookup(t[0], true);
    pattern_session s(state);
    std::string why;
    ASSERT_TRUE(c.load(*m, s, why)) << why;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    t.push_back(tokens_of(20, 103));
    save_tokens(c, t.back(), state);
    EXPECT_TRUE(c.contains(t[0]));
    EXPECT_FALSE(c.contains(t[1]));
    EXPECT_TRUE(c.contains(t[2]));
    EXPECT_TRUE(c.contains(t[3]));
    EXPECT_EQ(c.get_stats().evictions, 1u);
    uint64_t total = 0;
    for (const auto &f : d.files()) total += std::filesystem::file_size(d.path + "/" + f);
    EXPECT_LE(total, 3 * entry + entry / 2);
    EXPECT_EQ(total, c.get_stats().bytes);
    // An entry larger than the whole cap is not kept (and evicts nothing).
    EXPECT_EQ(save_tokens(c, tokens_of(20, 200), 8 * state), save_result::too_large);
    EXPECT_FALSE(c.contains(tokens_of(20, 200)));
    EXPECT_EQ(c.get_stats().entries, 3u);
    EXPECT_EQ(d.files().size(), 3u);
    // A smaller cap at start-up evicts down to it.
    prompt_cache small(opts_of(d, entry + 1), k_id);
    EXPECT_EQ(small.get_stats().entries, 1u);
    EXPECT_EQ(d.files().size(), 1u);
}

TEST(CacheDir, ThreadsSaveAndLoadConcurrently) {
    temp_dir d;
    prompt_cache c(opts_of(d), k_id);
    std::atomic<int> failures{0};
    std::vector<std::thread> th;
    for (int w = 0; w < 6; ++w)
        th.emplace_back([&, w] {
            for (int i = 0; i < 20; ++i) {
                const std::vector<int32_t> toks =
                    tokens_of(50, (w * 7 + i) % 10);  // shared keys across threads
                pattern_session s(30000);
                s.sync(toks, {});
                std::string why;
                if (c.save(s, why) == save_result::failed) ++failures;
                auto m = c.lookup(toks, w % 2 == 0);
                pattern_session r(30000);
                if (!m || !c.load(*m, r, why) || r.tokens() != toks) ++failures;
            }
        });
    for (auto &t : th) t.join();
    EXPECT_EQ(failures.load(), 0);
    EXPECT_EQ(c.get_stats().entries, 10u);
    EXPECT_EQ(c.get_stats().rejected, 0u);
    for (const auto &f : d.files()) {
        EXPECT_EQ(f.find(".tmp-"), std::string::npos) << f;  // no temporary file left behind
        const int fd = ::open((d.path + "/" + f).c_str(), O_RDONLY);
        EXPECT_NO_THROW(cache::check_entry(cache::fd_source(fd, f)));
        ::close(fd);
    }
}

// Two caches on one directory stand for two server processes: each sees the other's entries after a
// refresh, and a load of an entry the other evicted fails cleanly (the file is gone).
TEST(CacheDir, TwoCachesShareADirectory) {
    temp_dir d;
    prompt_cache p1(opts_of(d), k_id), p2(opts_of(d), k_id);
    const std::vector<int32_t> a = tokens_of(64, 11);
    save_tokens(p1, a);
    auto m = p2.lookup(a, true);  // refresh_interval 0: sees it now
    ASSERT_TRUE(m);
    std::filesystem::remove(entry_path(d, a));  // p1 evicts it
    pattern_session s;
    std::string why;
    EXPECT_FALSE(p2.load(*m, s, why));
    EXPECT_NE(why.find("No such file"), std::string::npos) << why;
    EXPECT_FALSE(p2.lookup(a, true));
    EXPECT_EQ(p2.get_stats().rejected, 0u);
}

// A writer process killed halfway through a save: no entry appears, the existing one is intact, and the
// temporary file goes when the next cache opens the directory (its pid is dead).
TEST(CacheDir, WriterKilledMidWriteLeavesNoEntry) {
    temp_dir d;
    const std::vector<int32_t> old = tokens_of(64, 12), fresh = tokens_of(64, 13);
    {
        prompt_cache c(opts_of(d), k_id);
        save_tokens(c, old, 50000);
    }
    const std::vector<uint8_t> old_bytes = read_file(entry_path(d, old));
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // the writer: 64 MiB of state in 64 KiB pieces, 2 ms apart (about 2 s)
        prompt_cache c(opts_of(d), k_id);
        pattern_session s(64u << 20);
        s.piece = 64 << 10;
        s.sleep_us = 2000;
        s.sync(fresh, {});
        std::string why;
        c.save(s, why);
        ::_exit(0);
    }
    // Wait until its temporary file has grown past a few pieces, then kill it.
    std::string tmp;
    for (int i = 0; i < 500 && tmp.empty(); ++i) {
        for (const auto &f : d.files())
            if (f.rfind(".tmp-", 0) == 0) {
                std::error_code ec;  // the writer may have renamed it since the listing
                if (std::filesystem::file_size(d.path + "/" + f, ec) > (1u << 20) && !ec) tmp = f;
            }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_FALSE(tmp.empty()) << "the writer never got going";
    EXPECT_TRUE(WIFSIGNALED(status));
    EXPECT_EQ(tmp.rfind(".tmp-" + std::to_string(pid) + "-", 0), 0u) << tmp;
    EXPECT_FALSE(std::filesystem::exists(entry_path(d, fresh)));
    EXPECT_EQ(read_file(entry_path(d, old)), old_bytes);

    prompt_cache c(opts_of(d), k_id);
    EXPECT_EQ(d.files(), std::vector<std::string>{cache::entry_file_name(cache::entry_key(k_id, old))});
    EXPECT_FALSE(c.lookup(fresh, true));
    auto m = c.lookup(old, true);
    ASSERT_TRUE(m);
    pattern_session s(50000);
    std::string why;
    EXPECT_TRUE(c.load(*m, s, why)) << why;
    EXPECT_EQ(c.get_stats().rejected, 0u);
}

// A temporary file of a live process (this one) is left alone.
TEST(CacheDir, LiveWritersTemporaryFileIsKept) {
    temp_dir d;
    const std::string tmp = d.path + "/.tmp-" + std::to_string(::getpid()) + "-0123456789abcdef.fpc";
    write_file(tmp, {1, 2, 3});
    prompt_cache c(opts_of(d), k_id);
    EXPECT_TRUE(std::filesystem::exists(tmp));
    EXPECT_EQ(c.get_stats().entries, 0u);
}

// A temporary file named with this process's pid but written before it started is an earlier
// incarnation's (a container's server is pid 1 every time it restarts): removed, not kept for an hour.
TEST(CacheDir, EarlierProcessWithOurPidLeavesAStaleTemporaryFile) {
    temp_dir d;
    const std::string tmp = d.path + "/.tmp-" + std::to_string(::getpid()) + "-fedcba9876543210.fpc";
    write_file(tmp, {1, 2, 3});
    struct timespec ts[2];
    clock_gettime(CLOCK_REALTIME, &ts[0]);
    ts[0].tv_sec -= 600;  // ten minutes ago: before this test binary started, within the hour
    ts[1] = ts[0];
    ASSERT_EQ(::utimensat(AT_FDCWD, tmp.c_str(), ts, 0), 0);
    prompt_cache c(opts_of(d), k_id);
    EXPECT_FALSE(std::filesystem::exists(tmp));
}

TEST(CacheDir, RejectsBadOptions) {
    temp_dir d;
    EXPECT_THROW(prompt_cache(opts_of(d), ""), error);
    cache::options o = opts_of(d);
    o.dir = "";
    EXPECT_THROW(prompt_cache(o, k_id), error);
    o = opts_of(d);
    o.dir = "/proc/fathom-no-such-dir/x";
    EXPECT_THROW(prompt_cache(o, k_id), error);
    o = opts_of(d);
    o.zstd_level = 20;
    EXPECT_THROW(prompt_cache(o, k_id), error);
}

}  // namespace
