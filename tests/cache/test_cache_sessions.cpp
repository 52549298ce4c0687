// Saved session states on real engines (session::save_state / load_state, through the disk prompt
// cache): SmolLM2-135M (skipped when models/ lacks it), the synthetic Qwen3 and Gemma 3 geometries
// (dense_synth; Gemma's sliding window of 32 is crossed) and ds4-tiny (DeepSeek V4: a 301-token prompt
// wraps the 32-row raw ring and crosses ratio-4 and ratio-128 compressor boundaries, leaving both
// frontiers mid-block). For each: a state saved after a prompt and loaded into a fresh session gives
// logits bit-identical to the saving session's, and so do a few greedy steps and a sync of a longer
// prefix afterwards; dense sessions also load a prefix of an entry and evaluate the rest bit for bit as a
// session that never went through disk. A malformed state under valid checksums (wrong geometry, token
// count, length) is refused with a clear error and leaves the session empty and usable.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "cache/prompt_cache.h"
#include "cache_test_util.h"
#include "fathom/engine.h"
#include "models/dense_synth.h"

namespace {

using namespace fathom;
using namespace fathom::cache_test;
using cache::prompt_cache;

bool same_bits(std::span<const float> a, std::span<const float> b) {
    return a.size() == b.size() && !a.empty() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

int32_t argmax(std::span<const float> l) {
    return int32_t(std::max_element(l.begin(), l.end()) - l.begin());
}

// Token ids of a fixed pattern below `vocab_cap` (ordinary tokens of every vocabulary used here).
std::vector<int32_t> prompt_tokens(size_t n, int salt, int32_t vocab_cap) {
    std::vector<int32_t> p;
    for (size_t i = 0; i < n; ++i)
        p.push_back(int32_t(3 + (i * 53 + size_t(salt) * 17) % size_t(vocab_cap - 3)));
    return p;
}

std::unique_ptr<engine> load(const std::string &path, int n_ctx, int n_batch,
                             kv_precision kv = kv_precision::f16, const std::string &qat = "full") {
    engine_options o;
    o.model_path = path;
    o.n_threads = 2;
    o.n_ctx = n_ctx;
    o.n_batch = n_batch;
    o.kv = kv;
    o.ds4_qat = qat;
    return engine::load(o);
}

std::string synth(const std::string &arch) {
    const std::string vocab = std::string(FATHOM_SHARED_DIR) + "/tokenizer-tests/ggml-vocab-qwen2.gguf";
    const std::string path = ::testing::TempDir() + "/fathom_cache_synth_" + arch + ".gguf";
    if (!std::filesystem::exists(path)) dense_synth_write(dense_synth_preset(arch, vocab, 3), path);
    return path;
}

cache::options cache_opts(const temp_dir &d) {
    cache::options o;
    o.dir = d.path;
    o.min_tokens = 1;
    return o;
}

// The round trip of the banner on engine e: prompt, then `extra` more tokens synced after 4 greedy steps.
void round_trip(engine &e, const std::vector<int32_t> &prompt, const std::vector<int32_t> &extra,
                int zstd = 0) {
    temp_dir d;
    cache::options co = cache_opts(d);
    co.zstd_level = zstd;
    prompt_cache c(co, e.state_identity());
    auto a = e.new_session();
    a->sync(prompt);
    std::string why;
    ASSERT_EQ(c.save(*a, why), prompt_cache::save_result::saved) << why;

    auto b = e.new_session();
    b->sync(prompt_tokens(5, 99, 200));  // something else first: the load replaces it
    const auto m = c.lookup(prompt, b->loads_state_prefix());
    ASSERT_TRUE(m);
    ASSERT_EQ(m->n_keep, int64_t(prompt.size()));
    ASSERT_TRUE(c.load(*m, *b, why)) << why;
    EXPECT_EQ(b->tokens(), prompt);
    EXPECT_TRUE(same_bits(a->logits(), b->logits())) << "logits after the load";
    b->sync(prompt);  // holds exactly that, logits current: nothing to evaluate
    EXPECT_TRUE(same_bits(a->logits(), b->logits()));

    for (int i = 0; i < 4; ++i) {
        const int32_t t = argmax(a->logits());
        ASSERT_EQ(argmax(b->logits()), t);
        a->eval(std::span<const int32_t>(&t, 1));
        b->eval(std::span<const int32_t>(&t, 1));
        EXPECT_TRUE(same_bits(a->logits(), b->logits())) << "greedy step " << i;
    }
    std::vector<int32_t> longer = a->tokens();
    longer.insert(longer.end(), extra.begin(), extra.end());
    a->sync(longer);
    b->sync(longer);
    EXPECT_TRUE(same_bits(a->logits(), b->logits())) << "sync of " << longer.size() << " tokens";
    EXPECT_EQ(b->n_past(), int64_t(longer.size()));
}

// Dense sessions keep a prefix of an entry: load the first k tokens of a saved state, sync a prompt that
// diverges after them, and compare with a session that evaluated that prompt without the disk.
void prefix_load(engine &e, const std::vector<int32_t> &prompt, size_t k, const std::vector<int32_t> &tail) {
    temp_dir d;
    prompt_cache c(cache_opts(d), e.state_identity());
    auto a = e.new_session();
    a->sync(prompt);
    std::string why;
    ASSERT_EQ(c.save(*a, why), prompt_cache::save_result::saved) << why;
    std::vector<int32_t> p2(prompt.begin(), prompt.begin() + std::ptrdiff_t(k));
    p2.insert(p2.end(), tail.begin(), tail.end());
    auto b = e.new_session();
    ASSERT_TRUE(b->loads_state_prefix());
    const auto m = c.lookup(p2, true);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->n_keep, int64_t(k));
    ASSERT_TRUE(c.load(*m, *b, why)) << why;
    EXPECT_EQ(b->n_past(), int64_t(k));
    EXPECT_TRUE(b->logits().empty());  // a prefix: the last kept token's logits were not saved
    b->sync(p2);
    auto ref = e.new_session();
    ref->sync(p2);
    EXPECT_TRUE(same_bits(ref->logits(), b->logits())) << "after a prefix load of " << k << " tokens";
}

// Malformed states under valid checksums, fed to load_state directly: each refused with an error naming
// the problem; the session then holds nothing and evaluates normally.
void malformed(engine &e, const std::vector<int32_t> &prompt, size_t geometry_offset,
               const char *geometry_name) {
    auto a = e.new_session();
    a->sync(prompt);
    const std::vector<float> ref(a->logits().begin(), a->logits().end());
    vector_writer w;
    ASSERT_TRUE(a->save_state(w));
    struct variant {
        std::vector<uint8_t> bytes;
        std::vector<int32_t> tokens;
        const char *expect;
    };
    std::vector<variant> vs;
    std::vector<uint8_t> t = w.bytes;
    t[0] ^= 1;
    vs.push_back({t, prompt, "not a"});
    t = w.bytes;
    t[geometry_offset] ^= 1;
    vs.push_back({t, prompt, geometry_name});
    vs.push_back({w.bytes, std::vector<int32_t>(prompt.begin(), prompt.end() - 1), "token count"});
    vs.push_back({std::vector<uint8_t>(w.bytes.begin(), w.bytes.end() - 3), prompt, "ends early"});
    t = w.bytes;
    t.push_back(0);
    vs.push_back({t, prompt, "past its end"});
    for (const variant &v : vs) {
        auto b = e.new_session();
        b->sync(prompt_tokens(7, 5, 200));
        vector_reader r(v.bytes);
        try {
            b->load_state(r, v.tokens, int64_t(v.tokens.size()));
            ADD_FAILURE() << "accepted a state expected to fail with '" << v.expect << "'";
        } catch (const error &x) {
            EXPECT_NE(std::string(x.what()).find(v.expect), std::string::npos) << x.what();
        }
        EXPECT_EQ(b->n_past(), 0);
        b->sync(prompt);
        EXPECT_TRUE(same_bits(ref, b->logits())) << "the session is usable after a refused load";
    }
}

const std::string k_smol = std::string(FATHOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string k_ds4 = std::string(FATHOM_SHARED_DIR) + "/golden/ds4-tiny/ds4-tiny-a.gguf";

// Dense state stream: u32 magic, u32 version, u64 n_layer at byte 8.
constexpr size_t k_dense_layers_at = 8;
// DS4 state stream: magic, version, u64 n_layer at byte 8 (n_past at 16).
constexpr size_t k_ds4_layers_at = 8;

TEST(CacheSessions, SmolLM2RoundTripIsBitIdentical) {
    if (!std::filesystem::exists(k_smol)) GTEST_SKIP() << k_smol << " not installed";
    auto e = load(k_smol, 512, 64);
    EXPECT_NE(e->state_identity().find("dense arch=llama file="), std::string::npos) << e->state_identity();
    round_trip(*e, prompt_tokens(150, 1, 4000), prompt_tokens(70, 2, 4000));
    round_trip(*e, prompt_tokens(37, 3, 4000), prompt_tokens(5, 4, 4000), 3);  // zstd-compressed state
    prefix_load(*e, prompt_tokens(150, 1, 4000), 90, prompt_tokens(40, 6, 4000));
    malformed(*e, prompt_tokens(40, 7, 4000), k_dense_layers_at, "layer count");
}

TEST(CacheSessions, SmolLM2F32KvAndOtherNumericsHaveOtherIdentities) {
    if (!std::filesystem::exists(k_smol)) GTEST_SKIP() << k_smol << " not installed";
    auto e16 = load(k_smol, 256, 64), e32 = load(k_smol, 256, 64, kv_precision::f32);
    EXPECT_NE(e16->state_identity(), e32->state_identity());
    round_trip(*e32, prompt_tokens(70, 8, 4000), prompt_tokens(10, 9, 4000));
    // A state of the f16 engine refuses to load into an f32 session (the cache keys by identity; the
    // session checks its own geometry too).
    auto a = e16->new_session();
    const auto p = prompt_tokens(20, 10, 4000);
    a->sync(p);
    vector_writer w;
    ASSERT_TRUE(a->save_state(w));
    auto b = e32->new_session();
    vector_reader r(w.bytes);
    EXPECT_THROW(b->load_state(r, p, int64_t(p.size())), error);
}

TEST(CacheSessions, Qwen3SynthRoundTrip) {
    auto e = load(synth("qwen3"), 512, 32);
    round_trip(*e, prompt_tokens(100, 11, 30000), prompt_tokens(50, 12, 30000));
    prefix_load(*e, prompt_tokens(100, 11, 30000), 33, prompt_tokens(20, 13, 30000));
    malformed(*e, prompt_tokens(30, 14, 30000), k_dense_layers_at, "layer count");
}

TEST(CacheSessions, Gemma3SynthRoundTripAcrossTheSlidingWindow) {
    auto e = load(synth("gemma3"), 512, 32);
    round_trip(*e, prompt_tokens(100, 15, 30000), prompt_tokens(60, 16, 30000));  // window 32: crossed
    prefix_load(*e, prompt_tokens(100, 15, 30000), 70, prompt_tokens(30, 17, 30000));
}

TEST(CacheSessions, Ds4TinyRoundTripAcrossRingAndCompressorBoundaries) {
    for (const kv_precision kv : {kv_precision::f32, kv_precision::f16}) {
        auto e = load(k_ds4, 1024, 64, kv, "full");
        EXPECT_NE(e->state_identity().find("deepseek4 file="), std::string::npos);
        auto s = e->new_session();
        EXPECT_FALSE(s->loads_state_prefix());
        // 301 tokens: ring of 32 wrapped, ratio-128 rows at 128 and 256, ratio-4 frontier 1 into a block;
        // the continuation crosses 384 (ratio 128) and many ratio-4 blocks.
        round_trip(*e, prompt_tokens(301, 18, 500), prompt_tokens(90, 19, 500));
    }
    auto e = load(k_ds4, 1024, 64, kv_precision::f32, "off");
    round_trip(*e, prompt_tokens(130, 20, 500), prompt_tokens(3, 21, 500), 1);
    malformed(*e, prompt_tokens(140, 22, 500), k_ds4_layers_at, "layer count");
}

// DS4 loads only whole states: an entry that is not a prefix of the prompt is not offered, and a
// partial load is refused.
TEST(CacheSessions, Ds4RefusesPrefixLoads) {
    auto e = load(k_ds4, 512, 64, kv_precision::f32, "off");
    temp_dir d;
    prompt_cache c(cache_opts(d), e->state_identity());
    auto a = e->new_session();
    const auto p = prompt_tokens(50, 23, 500);
    a->sync(p);
    std::string why;
    ASSERT_EQ(c.save(*a, why), prompt_cache::save_result::saved) << why;
    std::vector<int32_t> diverge(p.begin(), p.begin() + 40);
    diverge.push_back(7);
    EXPECT_FALSE(c.lookup(diverge, false));
    vector_writer w;
    ASSERT_TRUE(a->save_state(w));
    auto b = e->new_session();
    vector_reader r(w.bytes);
    EXPECT_THROW(b->load_state(r, p, 40), error);
    EXPECT_EQ(b->n_past(), 0);
}

// A dense session keeps a prefix of an entry longer than its own context: the entry was saved by a server
// with a larger --ctx (the identity leaves the context out, and the directory may be shared), and the
// prompt fits. The session used to refuse the whole entry ("do not fit the context"), and the cache then
// deleted the intact entry as damaged.
TEST(CacheSessions, DensePrefixOfAnEntryLongerThanTheContextLoads) {
    const std::string path = synth("qwen3");
    auto big = load(path, 512, 32), small = load(path, 128, 32);
    ASSERT_EQ(big->state_identity(), small->state_identity());
    temp_dir d;
    const auto prompt = prompt_tokens(200, 31, 30000);
    std::string why;
    {
        prompt_cache c(cache_opts(d), big->state_identity());
        auto a = big->new_session();
        a->sync(prompt);
        ASSERT_EQ(c.save(*a, why), prompt_cache::save_result::saved) << why;
    }
    prompt_cache c(cache_opts(d), small->state_identity());
    std::vector<int32_t> p2(prompt.begin(), prompt.begin() + 90);
    const auto tail = prompt_tokens(10, 32, 30000);
    p2.insert(p2.end(), tail.begin(), tail.end());
    const auto m = c.lookup(p2, true);
    ASSERT_TRUE(m);
    ASSERT_EQ(m->n_keep, 90);
    auto b = small->new_session();
    EXPECT_TRUE(c.load(*m, *b, why)) << why;
    EXPECT_EQ(b->n_past(), 90);
    EXPECT_EQ(c.get_stats().rejected, 0u);
    EXPECT_EQ(d.files().size(), 1u);  // the entry stays for the server that can use all of it
    b->sync(p2);
    auto ref = small->new_session();
    ref->sync(p2);
    EXPECT_TRUE(same_bits(ref->logits(), b->logits()));
}

uint64_t u64_at(const std::vector<uint8_t> &b, size_t at) {
    uint64_t v = 0;
    std::memcpy(&v, &b[at], 8);
    return v;
}

uint32_t u32_at(const std::vector<uint8_t> &b, size_t at) {
    uint32_t v = 0;
    std::memcpy(&v, &b[at], 4);
    return v;
}

// The state streams parsed by the tables of docs/prompt-cache.md ("Dense state stream", "DeepSeek V4
// state stream"): every field at its documented offset, every length as documented, ending exactly at
// the stream's end with the session's logits.
TEST(CacheSessions, StreamsMatchTheDocumentedLayout) {
    const auto check_logits = [](const std::vector<uint8_t> &b, size_t at, session &s) {
        ASSERT_EQ(b.size() - at, s.logits().size_bytes());
        EXPECT_EQ(std::memcmp(&b[at], s.logits().data(), s.logits().size_bytes()), 0);
    };
    {
        auto e = load(synth("qwen3"), 256, 32, kv_precision::f16);
        const auto p = prompt_tokens(45, 33, 30000);
        auto a = e->new_session();
        a->sync(p);
        vector_writer w;
        ASSERT_TRUE(a->save_state(w));
        const std::vector<uint8_t> &b = w.bytes;
        ASSERT_GE(b.size(), 64u);
        EXPECT_EQ(std::memcmp(b.data(), "DNS1", 4), 0);
        EXPECT_EQ(u32_at(b, 4), 1u);
        const uint64_t n_layer = u64_at(b, 8), n_head_kv = u64_at(b, 16), head_dim = u64_at(b, 24);
        EXPECT_EQ(u64_at(b, 32), 0u);  // f16
        EXPECT_EQ(u64_at(b, 40), uint64_t(e->info().n_vocab));
        EXPECT_EQ(u64_at(b, 48), p.size());
        EXPECT_EQ(u64_at(b, 56), 1u);
        check_logits(b, 64 + n_layer * 2 * n_head_kv * p.size() * head_dim * 2, *a);
    }
    for (const kv_precision kv : {kv_precision::f32, kv_precision::f16}) {
        auto e = load(k_ds4, 512, 64, kv, "fp4only");
        const auto p = prompt_tokens(137, 34, 500);
        auto a = e->new_session();
        a->sync(p);
        vector_writer w;
        ASSERT_TRUE(a->save_state(w));
        const std::vector<uint8_t> &b = w.bytes;
        ASSERT_GE(b.size(), 64u);
        EXPECT_EQ(std::memcmp(b.data(), "DS41", 4), 0);
        EXPECT_EQ(u32_at(b, 4), 1u);
        const uint64_t n_layer = u64_at(b, 8), n = u64_at(b, 16), elt = u64_at(b, 24) == 1 ? 4 : 2;
        EXPECT_EQ(n, p.size());
        EXPECT_EQ(elt, kv == kv_precision::f32 ? 4u : 2u);
        EXPECT_EQ(u64_at(b, 32), 1u);  // fp4only
        const uint64_t window = u64_at(b, 40), head_dim = u64_at(b, 48), idx_dim = u64_at(b, 56);
        size_t at = 64;
        std::set<uint64_t> ratios;
        for (uint64_t l = 0; l < n_layer; ++l) {
            ASSERT_LE(at + 8, b.size());
            const uint64_t r = u64_at(b, at);
            ratios.insert(r);
            at += 8 + window * head_dim * elt;
            const uint64_t slots = r == 4 ? 8 : r, c = r == 4 ? 2 : 1;
            if (r > 0) at += 2 * slots * c * head_dim * 4 + (n / r) * head_dim * elt;
            if (r == 4) at += 2 * slots * 2 * idx_dim * 4 + (n / 4) * idx_dim * elt;
        }
        EXPECT_EQ(ratios, (std::set<uint64_t>{0, 4, 128})) << "ds4-tiny has layers of each kind";
        ASSERT_LE(at + 8, b.size());
        EXPECT_EQ(u64_at(b, at), 1u);
        check_logits(b, at + 8, *a);
    }
}

}  // namespace
