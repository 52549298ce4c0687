// Daemon line protocol with the fake engine, and --root path confinement (.., absolute paths,
// symlinks leading out). Expected ids follow the fake's completion rule: 'a' + (tokens held % 26).
#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <sstream>

#include "fake_engine.h"
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

TEST(Confine, RejectsEscapes) {
    temp_root r;
    std::ofstream(r.dir / "a.bin") << "1234";
    fs::create_symlink(r.dir.string() + "_outside/secret.bin", r.dir / "link_out");
    fs::create_symlink(r.dir.string() + "_outside", r.dir / "dir_out");
    fs::create_symlink(r.dir / "a.bin", r.dir / "link_in");
    EXPECT_EQ(server::confine_path(r.dir, "a.bin", true), fs::canonical(r.dir / "a.bin"));
    EXPECT_EQ(server::confine_path(r.dir, "link_in", true), fs::canonical(r.dir / "a.bin"));
    EXPECT_NO_THROW(server::confine_path(r.dir, "sub/new.bin", false));
    EXPECT_NO_THROW(server::confine_path(r.dir, "./a.bin", true));
    EXPECT_THROW(server::confine_path(r.dir, "", true), error);
    EXPECT_THROW(server::confine_path(r.dir, "../x", false), error);
    EXPECT_THROW(server::confine_path(r.dir, "sub/../a.bin", true), error);
    EXPECT_THROW(server::confine_path(r.dir, "/etc/passwd", true), error);
    EXPECT_THROW(server::confine_path(r.dir, "link_out", true), error);
    EXPECT_THROW(server::confine_path(r.dir, "link_out", false), error);     // writing through it
    EXPECT_THROW(server::confine_path(r.dir, "dir_out/secret.bin", true), error);
    EXPECT_THROW(server::confine_path(r.dir, "dir_out/new.bin", false), error);
    EXPECT_THROW(server::confine_path(r.dir, "missing.bin", true), error);
    EXPECT_THROW(server::confine_path(r.dir, "nodir/new.bin", false), error);
    EXPECT_THROW(server::confine_path(r.dir, "sub", false), error);  // a directory
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
    EXPECT_EQ(d.handle("bogus"), "error: unknown command 'bogus' (generate, compress, park, unpark, snapshot, restore, free, list, quit)");
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

TEST(Daemon, RunLoopOneLinePerCommand) {
    temp_root r;
    server::daemon d([] { return std::make_unique<test::fake_engine>(64); }, r.dir);
    std::istringstream in("list\n\nnope\nquit\nlist\n");
    std::ostringstream out;
    d.run(in, out);
    EXPECT_EQ(out.str(),
              "ok target=loaded draft=none working=0 slots=\n"
              "error: unknown command 'nope' (generate, compress, park, unpark, snapshot, restore, free, list, quit)\n"
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
