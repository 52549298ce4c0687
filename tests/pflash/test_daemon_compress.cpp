// The daemon's `compress` command (docs/daemon-protocol.md) on the real pair: target Gemma3-270M,
// drafter SmolLM2-135M (skipped when models/ lacks them). Checks the reply, the written ids (a
// subsequence of the prompt that still holds the needle the question asks about), drafter residency
// through park/unpark/list, and every bad argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include "fathom/engine.h"
#include "server/daemon.h"

namespace fathom {
namespace {

namespace fs = std::filesystem;
const std::string k_target = FATHOM_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf";
const std::string k_drafter = FATHOM_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";

std::unique_ptr<engine> load_target() {
    engine_options o;
    o.model_path = k_target;
    o.n_threads = 2;
    o.n_ctx = 2048;
    return engine::load(o);
}

void write_ids(const fs::path &p, const std::vector<int32_t> &ids) {
    std::ofstream f(p, std::ios::binary);
    for (int32_t t : ids) {
        const uint32_t u = uint32_t(t);
        const char b[4] = {char(u & 0xFF), char((u >> 8) & 0xFF), char((u >> 16) & 0xFF), char(u >> 24)};
        f.write(b, 4);
    }
}

std::vector<int32_t> read_ids(const fs::path &p) {
    std::ifstream f(p, std::ios::binary);
    std::vector<int32_t> ids;
    unsigned char b[4];
    while (f.read(reinterpret_cast<char *>(b), 4))
        ids.push_back(int32_t(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24));
    return ids;
}

// Varied filler sentences, one needle; the question's n-grams anchor the needle (within the budget).
std::string needle_prompt() {
    static const char *w[] = {"apple",  "river",  "lantern", "copper", "meadow", "violin", "harbor",
                              "pepper", "glacier", "saddle", "orchid", "tunnel", "walnut", "canyon",
                              "ribbon", "falcon", "marble", "thistle", "anchor", "biscuit"};
    std::string s;
    for (int i = 0; i < 36; ++i) {
        s += std::string("The ") + w[(i * 7) % 20] + " rests beside a " + w[(i * 11 + 3) % 20] + " and a " +
             w[(i * 3 + 5) % 20] + ". ";
        if (i == 16) s += "The secret code for the blue door is 48213. ";
    }
    return s + "\nQuestion: what is the secret code for the blue door?\nAnswer:";
}

TEST(DaemonCompress, RealPair) {
    if (!fs::exists(k_target) || !fs::exists(k_drafter)) GTEST_SKIP() << "models not installed";
    const fs::path root = fs::temp_directory_path() / ("fathom_dc_" + std::to_string(::getpid()));
    fs::create_directories(root);
    server::daemon d(load_target, root, k_drafter);
    auto eng = load_target();  // an independent copy to tokenize with and to detokenise the result
    const std::vector<int32_t> prompt = eng->tokenize(needle_prompt(), true, false);
    write_ids(root / "p.bin", prompt);

    EXPECT_EQ(d.handle("list").find("draft=none"), d.handle("list").find("draft="));
    const std::string r = d.handle("compress p.bin 200 default out=k.bin");
    ASSERT_EQ(r.rfind("ok ", 0), 0u) << r;
    long long n0 = 0, n1 = 0;
    std::istringstream(r.substr(3)) >> n0 >> n1;
    EXPECT_EQ(n0, (long long)prompt.size());
    const std::vector<int32_t> kept = read_ids(root / "k.bin");
    EXPECT_EQ((long long)kept.size(), n1);
    EXPECT_LT(kept.size(), prompt.size() * 7 / 10) << "keep 0.2 must drop much of the filler";
    // A subsequence of the original ids (no re-tokenisation), still holding the needle and the question.
    size_t j = 0;
    for (int32_t t : kept) {
        while (j < prompt.size() && prompt[j] != t) ++j;
        ASSERT_LT(j, prompt.size()) << "kept ids are not a subsequence of the prompt";
        ++j;
    }
    const std::string text = eng->detokenize(kept);
    EXPECT_NE(text.find("48213"), std::string::npos) << text;
    EXPECT_NE(text.find("secret code for the blue door?"), std::string::npos);

    // Without out=: the ids follow the counts on the reply line.
    const std::string inline_r = d.handle("compress p.bin 200 default");
    std::istringstream is(inline_r.substr(3));
    is >> n0 >> n1;
    std::vector<int32_t> inline_ids;
    for (long long t; is >> t;) inline_ids.push_back(int32_t(t));
    EXPECT_EQ(inline_ids, kept);

    // Residency: park/unpark the drafter, list reports it; release-after-use leaves it parked.
    EXPECT_NE(d.handle("list").find("draft=loaded"), std::string::npos);
    EXPECT_EQ(d.handle("park draft"), "ok parked draft");
    EXPECT_NE(d.handle("list").find("draft=parked"), std::string::npos);
    EXPECT_EQ(d.handle("unpark draft"), "ok unparked draft");
    EXPECT_NE(d.handle("list").find("draft=loaded"), std::string::npos);
    EXPECT_EQ(d.handle("compress p.bin 200 default residency=release nopark device=cpu").rfind("ok ", 0), 0u);
    EXPECT_NE(d.handle("list").find("draft=parked"), std::string::npos);

    // Bad arguments: one error line each, the daemon keeps working.
    // device=cuda in a build or on a machine without CUDA: the drafter load's one-line reason
    // (a CUDA machine runs it instead); device=tpu: the option check.
    const std::string cu = d.handle("compress p.bin 200 default device=cuda");
    EXPECT_TRUE(cu.rfind("ok ", 0) == 0 || cu.rfind("error: compress: device 'cuda': ", 0) == 0) << cu;
    EXPECT_EQ(d.handle("compress p.bin 200 default device=tpu").rfind("error: compress: pflash option drafter_device", 0), 0u);
    EXPECT_EQ(d.handle("compress p.bin 200 default residency=sometimes").rfind("error: compress: ", 0), 0u);
    EXPECT_EQ(d.handle("compress p.bin 200 default bogus").rfind("error: compress: unknown option 'bogus'", 0), 0u);
    EXPECT_EQ(d.handle("compress p.bin 200 default out=../k.bin").rfind("error: compress: path '../k.bin'", 0), 0u);
    EXPECT_EQ(d.handle("compress p.bin 200 nothere.gguf").rfind("error: compress: 'nothere.gguf': ", 0), 0u);
    fs::remove_all(root);
}

}  // namespace
}  // namespace fathom
