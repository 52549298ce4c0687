// The disk prompt cache end to end over HTTP with the fake engine (fake_engine.h; its saved state is a
// token count plus filler bytes): a restarted server answers an identical request from the disk entry
// (usage.prompt_tokens_details.cached_tokens > 0, same greedy output, /metrics counts the hit), a damaged
// entry is deleted and the request recomputed, the directory stays under --prompt-cache-max-gib, many
// concurrent clients while slots save, and an engine without saved states refuses the option.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cache/cache_test_util.h"
#include "engine/fake_engine.h"
#include "server/http_server.h"

using namespace fathom;
using json = nlohmann::json;

namespace {

// A fresh directory (cache_test::temp_dir) and its entry files.
struct cache_dir : cache_test::temp_dir {
    std::vector<std::filesystem::path> entries() const {
        std::vector<std::filesystem::path> out;
        for (const auto &e : std::filesystem::directory_iterator(path))
            if (e.path().extension() == ".fpc" && e.path().filename().string()[0] != '.')
                out.push_back(e.path());
        return out;
    }
    // The server saves and evicts on its own threads: an entry listed here may be gone by the time it
    // is measured (it was evicted, so it counts nothing).
    uint64_t bytes() const {
        uint64_t b = 0;
        for (const auto &p : entries()) {
            std::error_code ec;
            const uintmax_t n = std::filesystem::file_size(p, ec);
            if (!ec) b += n;
        }
        return b;
    }
};

struct cached_server {
    test::fake_engine eng;
    std::unique_ptr<sched::scheduler> sch;
    std::unique_ptr<server::http_server> srv;
    int port = 0;
    std::thread th;

    cached_server(const std::string &dir, uint64_t max_bytes = uint64_t{1} << 30, int slots = 2,
                  size_t state_pad = 1000)
        : eng(4096) {
        eng.state_pad = state_pad;
        sched::scheduler_options so;
        so.n_slots = slots;
        so.max_queue = 64;
        so.prompt_cache.dir = dir;
        so.prompt_cache.max_bytes = max_bytes;
        so.prompt_cache.min_tokens = 8;
        sch = std::make_unique<sched::scheduler>(eng, so);
        server::server_options ho;
        ho.port = 0;
        srv = std::make_unique<server::http_server>(eng, *sch, ho);
        port = srv->bind();
        th = std::thread([this] { srv->listen(); });
    }
    ~cached_server() {
        srv->stop();
        th.join();
        sch->stop();  // waits for the slots' saves
    }
    json chat(const std::string &user) const {
        httplib::Client c("127.0.0.1", port);
        c.set_read_timeout(20, 0);
        const json body = {{"model", "fake-model"},
                           {"messages", json::array({{{"role", "user"}, {"content", user}}})},
                           {"temperature", 0}};
        auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
        EXPECT_TRUE(res);
        if (!res) return {};
        EXPECT_EQ(res->status, 200) << res->body;
        return json::parse(res->body, nullptr, false);
    }
    double metric(const std::string &name) const {
        httplib::Client c("127.0.0.1", port);
        auto res = c.Get("/metrics");
        if (!res) return -1;
        const std::string &b = res->body;
        const size_t p = b.find("\n" + name + " ");
        return p == std::string::npos ? -1 : std::stod(b.substr(p + name.size() + 2));
    }
};

int64_t cached_tokens(const json &r) {
    return r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
}
std::string content(const json &r) {
    return r["choices"][0]["message"]["content"].get<std::string>();
}

const std::string k_question = "tell me about the prompt cache on disk, across restarts";

TEST(PromptCacheHttp, RestartedServerReusesTheDiskEntry) {
    cache_dir d;
    json first;
    {
        cached_server s(d.path);
        first = s.chat(k_question);
        EXPECT_EQ(cached_tokens(first), 0);
        EXPECT_EQ(content(first), k_question);  // the fake echoes the user message
    }
    EXPECT_EQ(d.entries().size(), 1u);
    cached_server s(d.path);
    const int64_t before = s.eng.evaluated.load();
    const json again = s.chat(k_question);
    EXPECT_EQ(content(again), content(first));
    const int64_t prompt = again["usage"]["prompt_tokens"].get<int64_t>();
    EXPECT_EQ(cached_tokens(again), prompt - 1);
    // Evaluated: the prompt's last token (its logits) and the generated tokens but the last.
    EXPECT_EQ(s.eng.evaluated.load() - before, 1 + int64_t(k_question.size()));
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_hits_total"), 1);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_misses_total"), 0);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_entries"), 1);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_load_seconds_count"), 1);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_rejected_total"), 0);
    EXPECT_GT(s.metric("fathom_prompt_cache_disk_bytes"), 1000);
}

TEST(PromptCacheHttp, DamagedEntryIsDeletedAndTheRequestRecomputed) {
    cache_dir d;
    json first;
    {
        cached_server s(d.path);
        first = s.chat(k_question);
    }
    ASSERT_EQ(d.entries().size(), 1u);
    {
        // Flip a byte of the state (the index reads only header and tokens: found at load time).
        std::fstream f(d.entries()[0], std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(-10, std::ios::end);
        f.put('!');
    }
    cached_server s(d.path);
    const json again = s.chat(k_question);
    EXPECT_EQ(content(again), content(first));
    EXPECT_EQ(cached_tokens(again), 0);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_rejected_total"), 1);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_hits_total"), 0);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_misses_total"), 1);
}

TEST(PromptCacheHttp, EvictionKeepsTheDirectoryUnderTheCap) {
    cache_dir d;
    const size_t pad = 20000;
    const uint64_t cap = 3 * pad + pad / 2;  // about three entries
    cached_server s(d.path, cap, 1, pad);
    for (int i = 0; i < 8; ++i) {
        const json r = s.chat("question number " + std::to_string(i) + " about eviction");
        EXPECT_EQ(content(r), "question number " + std::to_string(i) + " about eviction");
        EXPECT_LE(d.bytes(), cap) << "after request " << i;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the last save
    EXPECT_LE(d.bytes(), cap);
    EXPECT_GE(s.metric("fathom_prompt_cache_disk_evictions_total"), 4);
    EXPECT_LE(s.metric("fathom_prompt_cache_disk_entries"), 3);
    EXPECT_LE(s.metric("fathom_prompt_cache_disk_bytes"), double(cap));
}

// Many clients at once on two slots that save after every request: every request answers correctly
// (a request whose best slot is saving waits for it; none is lost).
TEST(PromptCacheHttp, ConcurrentClientsWhileSlotsSave) {
    cache_dir d;
    cached_server s(d.path, uint64_t{1} << 30, 2, 200000);
    std::vector<std::thread> th;
    std::atomic<int> bad{0};
    for (int c = 0; c < 8; ++c)
        th.emplace_back([&, c] {
            for (int i = 0; i < 4; ++i) {
                const std::string q = "client " + std::to_string(c) + " asks " + std::to_string(i % 2);
                const json r = s.chat(q);
                if (r.is_discarded() || content(r) != q) ++bad;
            }
        });
    for (auto &t : th) t.join();
    EXPECT_EQ(bad.load(), 0);
    EXPECT_EQ(s.metric("fathom_slots_busy"), 0);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_save_failures_total"), 0);
    EXPECT_EQ(s.metric("fathom_prompt_cache_disk_entries"), 16);
}

TEST(PromptCacheHttp, EngineWithoutSavedStatesRefusesTheOption) {
    cache_dir d;
    test::fake_engine eng;
    eng.identity = "";
    sched::scheduler_options so;
    so.prompt_cache.dir = d.path;
    try {
        sched::scheduler s(eng, so);
        ADD_FAILURE() << "accepted";
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("cannot save their state"), std::string::npos) << e.what();
    }
}

}  // namespace
