// Daemon line protocol with the fake engine, and --root path confinement (.., absolute paths,
// symlinks leading out). Expected ids follow the fake's completion rule: 'a' + (tokens held % 26).
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <thread>
#include <sstream>

#include "core/error.h"
#include "engine/fake_engine.h"
#include "server/daemon.h"

using namespace fathom;
namespace fs = std::filesystem;

namespace {

struct temp_root {
    fs::path dir;
    temp_root() {
        dir = fs::temp_directory_path() / ("fathom_daemon_test_" + std::to_string(::getpid()) + "_" +
                                           std::to_string(reinterpret_cast<uintptr_t>(this)));
        fs::create_directories(dir / "sub");
        fs::create_directories(dir.string() + "_outside");
        std::ofstream(dir.string() + "_outside/secret.bin") << "xxxx";
    }
    ~temp_root() {
        std::error_code ec;
        fs::remove_all(dir, ec);
        fs::remove_all(dir.string() + "_outside", ec);
    }
    void write_ids(const std::string &rel, const std::vector<int32_t> &ids) const {
        std::ofstream o(dir / rel, std::ios::binary);
        for (int32_t t : ids) {
            const uint32_t u = uint32_t(t);
            const char b[4] = {char(u & 0xFF), char((u >> 8) & 0xFF), char((u >> 16) & 0xFF), char(u >> 24)};
            o.write(b, 4);
        }
    }
};

}  // namespace

namespace {
std::string slurp(const fs::path &p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
std::string read_fd(int fd) {
    std::string s;
    char buf[256];
    for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) s.append(buf, size_t(n));
    return s;
}
}  // namespace

TEST(Confine, OpensOnlyRegularFilesBelowTheRoot) {
    temp_root r;
    const std::string out = r.dir.string() + "_outside";
    std::ofstream(r.dir / "a.bin") << "1234";
    fs::create_symlink(out + "/secret.bin", r.dir / "link_out");
    fs::create_symlink(out, r.dir / "dir_out");
    fs::create_symlink(r.dir / "a.bin", r.dir / "link_in");
    fs::create_symlink(out + "/evil.bin", r.dir / "dangling");
    fs::create_symlink(out + "/evil.bin", r.dir / "sub" / "dangling");
    const server::confined_root root(r.dir);
    EXPECT_EQ(read_fd(root.open_read("a.bin").get()), "1234");
    EXPECT_EQ(read_fd(root.open_read("./a.bin").get()), "1234");
    EXPECT_NO_THROW(root.open_write("sub/new.bin"));
    EXPECT_TRUE(fs::is_regular_file(r.dir / "sub/new.bin"));
    EXPECT_THROW(root.open_read(""), error);
    EXPECT_THROW(root.open_write("../x"), error);
    EXPECT_THROW(root.open_read("sub/../a.bin"), error);
    EXPECT_THROW(root.open_read("/etc/passwd"), error);
    EXPECT_THROW(root.open_read("link_out"), error);
    EXPECT_THROW(root.open_write("link_out"), error);
    EXPECT_THROW(root.open_read("link_in"), error);  // every symlink is refused, even one staying inside
    EXPECT_THROW(root.open_read("dir_out/secret.bin"), error);
    EXPECT_THROW(root.open_write("dir_out/new.bin"), error);
    EXPECT_THROW(root.open_write("dangling"), error);
    EXPECT_THROW(root.open_write("sub/dangling"), error);
    EXPECT_THROW(root.open_read("missing.bin"), error);
    EXPECT_THROW(root.open_write("nodir/new.bin"), error);
    EXPECT_THROW(root.open_write("sub"), error);  // a directory
    EXPECT_THROW(root.open_read("sub/"), error);
    fs::create_hard_link(out + "/secret.bin", r.dir / "hard.bin");  // same file system (the temp directory)
    EXPECT_THROW(root.open_write("hard.bin"), error);
    // Nothing outside was created or changed.
    EXPECT_EQ(slurp(out + "/secret.bin"), "xxxx");
    EXPECT_FALSE(fs::exists(out + "/evil.bin"));
    EXPECT_FALSE(fs::exists(out + "/new.bin"));
}

// Every file argument of every command against the escapes of docs/daemon-protocol.md.
TEST(Confine, DaemonCommandsStayInsideTheRoot) {
    temp_root r;
    const std::string out = r.dir.string() + "_outside";
    server::daemon d([] { return std::make_unique<test::fake_engine>(64); }, r.dir);
    r.write_ids("p.bin", {test::k_bos, 'H', 'i'});
    {
        std::ofstream o(out + "/ids.bin", std::ios::binary);
        const char ids[8] = {'H', 0, 0, 0, 'i', 0, 0, 0};
        o.write(ids, 8);
    }
    fs::create_symlink(out + "/evil.bin", r.dir / "dangling");
    fs::create_symlink(out + "/ids.bin", r.dir / "in_link");
    fs::create_symlink(out + "/ids.bin", r.dir / "drafter_link");
    fs::create_symlink(out, r.dir / "dir_out");
    for (const std::string bad : {"../p.bin", "/etc/passwd", "in_link", "dir_out/ids.bin"}) {
        EXPECT_EQ(d.handle("generate " + bad + " 2").rfind("error: generate: ", 0), 0u) << bad;
        EXPECT_EQ(d.handle("compress " + bad + " 500 default").rfind("error: compress: ", 0), 0u) << bad;
    }
    for (const std::string bad : {"../o.bin", "/tmp/o.bin", "dangling", "dir_out/new.bin"}) {
        EXPECT_EQ(d.handle("generate p.bin 2 " + bad).rfind("error: generate: ", 0), 0u) << bad;
        EXPECT_EQ(d.handle("compress p.bin 500 p.bin out=" + bad).rfind("error: compress: ", 0), 0u) << bad;
    }
    EXPECT_EQ(d.handle("compress p.bin 500 drafter_link").rfind("error: compress: ", 0), 0u);
    EXPECT_EQ(d.handle("compress p.bin 500 dir_out/ids.bin").rfind("error: compress: ", 0), 0u);
    EXPECT_FALSE(fs::exists(out + "/evil.bin"));  // the dangling symlink was not followed
    EXPECT_FALSE(fs::exists(out + "/new.bin"));
}

// A symlink swapped in and out while the daemon writes and reads the same name: no write ever
// lands outside, no read ever returns the outside file.
TEST(Confine, SymlinkSwappedDuringOpens) {
    temp_root r;
    const std::string out = r.dir.string() + "_outside";
    server::daemon d([] { return std::make_unique<test::fake_engine>(64); }, r.dir);
    r.write_ids("p.bin", {test::k_bos, 'H', 'i'});
    std::atomic<bool> stop{false};
    std::thread swapper([&] {
        const fs::path name = r.dir / "race.bin", link = r.dir / "race.link", file = r.dir / "race.file";
        for (int i = 0; !stop; ++i) {
            std::error_code ec;
            if (i % 2) {
                fs::remove(link, ec);
                fs::create_symlink(out + "/secret.bin", link, ec);
                fs::rename(link, name, ec);  // atomic replacement
            } else {
                r.write_ids("race.file", {test::k_bos, 'O', 'k'});
                fs::rename(file, name, ec);
            }
        }
    });
    int wrote = 0, read = 0;
    for (int i = 0; i < 400; ++i) {
        const std::string w = d.handle("generate p.bin 1 race.bin");
        wrote += w == "ok 1 length";
        const std::string g = d.handle("generate race.bin 1");
        read += g.rfind("ok ", 0) == 0;
        EXPECT_TRUE(g.rfind("ok ", 0) == 0 || g.rfind("error: generate: ", 0) == 0) << g;
        EXPECT_EQ(g.find("2021161080"), std::string::npos) << g;  // "xxxx" read as a token id: the outside file
    }
    stop = true;
    swapper.join();
    EXPECT_EQ(slurp(out + "/secret.bin"), "xxxx");
    EXPECT_GT(wrote + read, 0);  // the loop did exercise both outcomes' paths
}

TEST(Daemon, Protocol) {
    temp_root r;
    test::fake_engine *last = nullptr;
    int loads = 0;
    server::daemon d(
        [&] {
            ++loads;
            auto e = std::make_unique<test::fake_engine>(64);
            last = e.get();
            return e;
        },
        r.dir);
    r.write_ids("p.bin", {test::k_bos, 'H', 'i'});
    // 3 tokens held -> 'd' (100), then 'e', 'f', 'g'.
    EXPECT_EQ(d.handle("generate p.bin 4"), "ok 4 length 100 101 102 103");
    EXPECT_EQ(d.handle("generate p.bin 2 sub/out.bin"), "ok 2 length");
    {
        std::ifstream in(r.dir / "sub/out.bin", std::ios::binary);
        std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        EXPECT_EQ(bytes, std::string("d\0\0\0e\0\0\0", 8));
    }
    EXPECT_EQ(d.handle("compress a b c").rfind("error: compress: 'a': ", 0), 0u);  // missing ids file
    EXPECT_EQ(d.handle("compress p.bin"), "error: compress: usage: compress <ids-file> <keep-x1000> <drafter|default> "
                                          "[device=cpu|cuda|cuda:N] [residency=keep|release|auto] [nopark] [out=<file>]");
    EXPECT_EQ(d.handle("compress p.bin 1001 default"),
              "error: compress: keep-x1000 must be an integer in [0, 1000], got '1001'");
    EXPECT_EQ(d.handle("compress p.bin -1 default"), "error: compress: keep-x1000 must be an integer in [0, 1000], got '-1'");
    EXPECT_EQ(d.handle("compress p.bin nan default"), "error: compress: keep-x1000 must be an integer in [0, 1000], got 'nan'");
    EXPECT_EQ(d.handle("compress p.bin 200 default"), "error: compress: no default drafter (start the daemon with --drafter PATH)");
    EXPECT_EQ(d.handle("compress p.bin 200 ../x.gguf").rfind("error: compress: path '../x.gguf' contains '..'", 0), 0u);
    EXPECT_EQ(d.handle(""), "");
    EXPECT_EQ(d.handle("bogus"), "error: unknown command 'bogus' (generate, compress, park, unpark, snapshot, restore, free, list, stats, quit)");
    EXPECT_EQ(d.handle("generate ../p.bin 2").rfind("error: generate: ", 0), 0u);
    EXPECT_EQ(d.handle("generate /etc/passwd 2").rfind("error: generate: ", 0), 0u);
    EXPECT_EQ(d.handle("generate p.bin x").rfind("error: generate: n must be", 0), 0u);
    EXPECT_EQ(d.handle("generate p.bin").rfind("error: generate: usage", 0), 0u);
    std::ofstream(r.dir / "odd.bin") << "abc";
    EXPECT_EQ(d.handle("generate odd.bin 2").rfind("error: generate: ", 0), 0u);

    // Snapshots: the working session holds BOS H i d (the last sample is not evaluated) = 4 tokens.
    EXPECT_EQ(d.handle("snapshot 3"), "ok snapshot 3 4");
    EXPECT_EQ(d.handle("list"), "ok target=loaded draft=none working=4 slots=3:4");
    r.write_ids("q.bin", {test::k_bos, 'Y', 'o', 'u', '!'});
    EXPECT_EQ(d.handle("generate q.bin 1"), "ok 1 length 102");  // 5 tokens held -> 'f'
    EXPECT_EQ(d.handle("restore 3"), "ok restore 3 4");
    EXPECT_EQ(d.handle("list"), "ok target=loaded draft=none working=4 slots=3:4");
    EXPECT_EQ(d.handle("restore 3"), "ok restore 3 4");  // second restore re-derives the copy
    EXPECT_EQ(d.handle("restore 7"), "error: restore: slot 7 is empty");
    EXPECT_EQ(d.handle("free 3"), "ok free 3");
    EXPECT_EQ(d.handle("free 3"), "error: free: slot 3 is empty");

    // Park / unpark reload the model; generation in between is refused.
    EXPECT_EQ(d.handle("park draft"), "error: park: no drafter yet (run compress first)");
    EXPECT_EQ(d.handle("park target"), "ok parked target");
    EXPECT_EQ(d.handle("list").rfind("ok target=parked", 0), 0u);
    EXPECT_EQ(d.handle("generate p.bin 1").rfind("error: generate: the target model is parked", 0), 0u);
    EXPECT_EQ(d.handle("unpark"), "ok unparked all");
    EXPECT_EQ(loads, 2);
    EXPECT_EQ(d.handle("generate p.bin 1"), "ok 1 length 100");
    EXPECT_FALSE(d.done());
    EXPECT_EQ(d.handle("quit"), "ok bye");
    EXPECT_TRUE(d.done());
}

// --spec ngram: the fake's periodic completion ('a' + held % 26) repeats, so n-gram drafts are kept; the
// replies are the plain daemon's, at every length (token limits inside a step's drafts, a full context).
TEST(Daemon, SpeculativeGenerateRepliesAsPlain) {
    temp_root r;
    server::daemon_spec sp;
    sp.mode = "ngram";
    sp.ngram.ngram_min = 1;
    sp.ngram.row_cost = 0;  // deterministic widths
    server::daemon plain([] { return std::make_unique<test::fake_engine>(120); }, r.dir);
    server::daemon spec([] { return std::make_unique<test::fake_engine>(120); }, r.dir, {}, {}, sp);
    std::vector<int32_t> prompt{test::k_bos};
    for (int i = 0; i < 60; ++i) prompt.push_back('a' + (i + 1) % 26);  // one period and more: drafts match
    r.write_ids("p.bin", prompt);
    for (int n : {1, 2, 3, 7, 26, 40, 59, 60, 61, 100}) {
        const std::string cmd = "generate p.bin " + std::to_string(n);
        EXPECT_EQ(plain.handle(cmd), spec.handle(cmd)) << cmd;  // n >= 60: the context (120) ends it
    }
    const std::string st = spec.handle("stats");
    ASSERT_EQ(st.rfind("ok spec_steps ", 0), 0u) << st;
    unsigned long steps = 0, drafted = 0, accepted = 0;
    ASSERT_EQ(std::sscanf(st.c_str(), "ok spec_steps %lu drafted %lu accepted %lu", &steps, &drafted, &accepted), 3);
    EXPECT_GT(accepted, 50u);
    EXPECT_LE(accepted, drafted);
    EXPECT_EQ(plain.handle("stats"), "ok spec_steps 0 drafted 0 accepted 0");
    EXPECT_EQ(spec.handle("stats x"), "error: stats: usage: stats");
    server::daemon_spec bad;
    bad.mode = "guess";
    EXPECT_THROW(server::daemon([] { return std::make_unique<test::fake_engine>(64); }, r.dir, {}, {}, bad), error);
}

TEST(Daemon, RunLoopOneLinePerCommand) {
    temp_root r;
    server::daemon d([] { return std::make_unique<test::fake_engine>(64); }, r.dir);
    std::istringstream in("list\n\nnope\nquit\nlist\n");
    std::ostringstream out;
    d.run(in, out);
    EXPECT_EQ(out.str(),
              "ok target=loaded draft=none working=0 slots=\n"
              "error: unknown command 'nope' (generate, compress, park, unpark, snapshot, restore, free, list, stats, quit)\n"
              "ok bye\n");
}

// --prompt-cache: a second daemon on the same directory (a restart) loads the first one's working
// session for the same prompt instead of evaluating it, and generates the same ids.
// snapshot copies the working session's state (save_state / load_state in memory): nothing is evaluated,
// and restoring it continues as the working session would have.
TEST(Daemon, SnapshotCopiesStateWithoutEvaluating) {
    temp_root r;
    test::fake_engine *eng = nullptr;
    server::daemon d(
        [&] {
            auto e = std::make_unique<test::fake_engine>(256);
            eng = e.get();
            return e;
        },
        r.dir);
    std::vector<int32_t> prompt = {test::k_bos};
    for (int i = 0; i < 30; ++i) prompt.push_back('a' + i % 26);
    r.write_ids("p.bin", prompt);
    r.write_ids("q.bin", {test::k_bos, 'Q'});
    const std::string first = d.handle("generate p.bin 3");
    const int64_t before = eng->evaluated.load();
    EXPECT_EQ(d.handle("snapshot 1"), "ok snapshot 1 33");
    EXPECT_EQ(eng->evaluated.load(), before);  // copied, not re-evaluated
    EXPECT_EQ(d.handle("generate q.bin 1").rfind("ok 1", 0), 0u);
    EXPECT_EQ(d.handle("restore 1"), "ok restore 1 33");
    const int64_t at_restore = eng->evaluated.load();
    EXPECT_EQ(d.handle("generate p.bin 3"), first);  // the snapshot holds prompt + 2: a strict prefix is kept
    EXPECT_LE(eng->evaluated.load() - at_restore, 3);
}

TEST(Daemon, PromptCacheAcrossRestarts) {
    temp_root r;
    std::vector<int32_t> prompt = {test::k_bos};
    for (int i = 0; i < 40; ++i) prompt.push_back('a' + i % 26);
    r.write_ids("p.bin", prompt);
    cache::options pc;
    pc.dir = (r.dir / "cache").string();
    pc.min_tokens = 8;
    std::string first;
    {
        server::daemon d([] { return std::make_unique<test::fake_engine>(256); }, r.dir, "", pc);
        first = d.handle("generate p.bin 5");
        EXPECT_EQ(first.rfind("ok 5 length", 0), 0u) << first;
    }
    test::fake_engine *eng = nullptr;
    server::daemon d(
        [&] {
            auto e = std::make_unique<test::fake_engine>(256);
            eng = e.get();
            return e;
        },
        r.dir, "", pc);
    EXPECT_EQ(d.handle("generate p.bin 5"), first);
    // Loaded 41 of the prompt's 41 tokens from the entry (prompt + 4 generated): only the prompt's last
    // token (its logits) and 4 generated tokens were evaluated.
    EXPECT_EQ(eng->evaluated.load(), 1 + 4);
}
