// The HTTP server against careless and hostile clients (issue 22), with the fake engine over real
// sockets: exclusive port, body limits whatever the framing, slow clients, the per-address
// connection cap, Host / Origin / Content-Type checks, CORS, no file paths, bearer scheme, the
// access log. Raw sockets where the client must misbehave; cpp-httplib's client elsewhere.
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "engine/fake_engine.h"
#include "server/http_server.h"

using namespace fathom;
using json = nlohmann::json;
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

namespace {

server::server_options base_options() {
    server::server_options o;
    o.port = 0;
    o.max_body_bytes = 64 << 10;
    return o;
}

struct server_under_test {
    test::fake_engine eng;
    sched::scheduler sch;
    server::http_server srv;
    int port = 0;
    std::thread th;
    static sched::scheduler_options sopts() {
        sched::scheduler_options o;
        o.n_slots = 2;
        o.max_queue = 8;
        return o;
    }
    explicit server_under_test(server::server_options o, int n_ctx = 4096)
        : eng(n_ctx), sch(eng, sopts()), srv(eng, sch, std::move(o)) {
        port = srv.bind();
        th = std::thread([this] { srv.listen(); });
    }
    ~server_under_test() {
        srv.stop();
        th.join();
        sch.stop();
    }
    httplib::Client client() const {
        httplib::Client c("127.0.0.1", port);
        c.set_read_timeout(20, 0);
        return c;
    }
};

// A TCP connection to the server from `from` (any 127.0.0.0/8 address is loopback).
int dial(int port, const char *from = "127.0.0.1") {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    inet_pton(AF_INET, from, &src.sin_addr);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr *>(&src), sizeof(src)), 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)), 0);
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

bool send_all(int fd, const std::string &s) {
    for (size_t done = 0; done < s.size();) {
        const ssize_t n = send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL);
        if (n <= 0) return false;
        done += size_t(n);
    }
    return true;
}

// Reads until the peer closes (or 10 s pass); returns what arrived.
std::string read_to_close(int fd) {
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, size_t(n));
    return out;
}

int status_of(const std::string &response) {
    if (response.rfind("HTTP/1.1 ", 0) != 0) return -1;
    return std::stoi(response.substr(9, 3));
}

// One request on a fresh connection ("Connection: close"); the status line's code, -1 = none.
int raw_status(int port, const std::string &head_and_body) {
    const int fd = dial(port);
    send_all(fd, head_and_body);
    const int st = status_of(read_to_close(fd));
    close(fd);
    return st;
}

std::string chat_json(const std::string &user = "hi") {
    return json({{"messages", json::array({{{"role", "user"}, {"content", user}}})}, {"max_tokens", 4},
                 {"temperature", 0}})
        .dump();
}

std::string post_head(const std::string &path, const std::string &extra) {
    return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra + "\r\n";
}

double metric(const server_under_test &s, const std::string &name) {
    auto res = s.client().Get("/metrics");
    if (!res) return -1;
    const size_t p = res->body.find("\n" + name + " ");
    return p == std::string::npos ? -1 : std::stod(res->body.substr(p + name.size() + 2));
}

double seconds_since(steady::time_point t0) { return std::chrono::duration<double>(steady::now() - t0).count(); }

}  // namespace

// Item 1: cpp-httplib set SO_REUSEPORT, so a second server bound the same port and took half the
// connections. Now the second bind fails, naming the port.
TEST(Hardening, SecondServerOnTheSamePortFails) {
    server_under_test a(base_options());
    server::server_options o = base_options();
    o.port = a.port;
    test::fake_engine eng;
    sched::scheduler sch(eng, server_under_test::sopts());
    server::http_server b(eng, sch, o);
    try {
        b.bind();
        ADD_FAILURE() << "a second server bound port " << a.port;
    } catch (const error &e) {
        EXPECT_NE(std::string(e.what()).find("port " + std::to_string(a.port)), std::string::npos) << e.what();
    }
    sch.stop();
    EXPECT_EQ(a.client().Get("/health")->status, 200);
}

// Item 3: --max-body holds for chunked bodies (read no further than the limit), and a
// Content-Length that is negative, not a number or absurd gets 400 at once, a too large one 413
// at once (before: read or skipped for the 5 s read timeout).
TEST(Hardening, BodyLimitsWhateverTheFraming) {
    server_under_test s(base_options());
    // A valid request padded with 1 MiB of JSON whitespace, sent in 16 KiB chunks.
    std::string body = chat_json();
    body.insert(body.size() - 1, std::string(1 << 20, ' '));
    std::string chunked = post_head("/v1/chat/completions", "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n");
    for (size_t off = 0; off < body.size(); off += 16384) {
        const std::string piece = body.substr(off, 16384);
        char len[32];
        snprintf(len, sizeof(len), "%zx\r\n", piece.size());
        chunked += len + piece + "\r\n";
    }
    chunked += "0\r\n\r\n";
    const int fd = dial(s.port);
    std::thread sender([&] { send_all(fd, chunked); });
    const std::string answer = read_to_close(fd);
    sender.join();
    close(fd);
    EXPECT_EQ(status_of(answer), 413) << answer.substr(0, 200);
    EXPECT_NE(answer.find("exceeds 65536 bytes"), std::string::npos);
    // The same body, small enough, chunked: accepted.
    std::string small = post_head("/v1/chat/completions", "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n");
    const std::string j = chat_json("abc");
    char len[32];
    snprintf(len, sizeof(len), "%zx\r\n", j.size());
    small += len + j + "\r\n0\r\n\r\n";
    EXPECT_EQ(raw_status(s.port, small), 200);

    for (const std::string bad : {"-1", "abc", "1e3", "99999999999999999999999", "12, 12"}) {
        const auto t0 = steady::now();
        EXPECT_EQ(raw_status(s.port, post_head("/v1/chat/completions", "Content-Type: application/json\r\nContent-Length: " + bad + "\r\n")), 400)
            << bad;
        EXPECT_LT(seconds_since(t0), 2.0) << bad;
    }
    const auto t0 = steady::now();  // too large: 413 without waiting for the body
    EXPECT_EQ(raw_status(s.port, post_head("/v1/chat/completions", "Content-Type: application/json\r\nContent-Length: 10000000\r\n")), 413);
    EXPECT_LT(seconds_since(t0), 2.0);
    EXPECT_EQ(s.client().Get("/health")->status, 200);
}

// Item 4: N clients trickling header bytes against N HTTP threads hold no thread: /health and
// /metrics answer at once, and the trickling connections are closed at --header-timeout.
// N clients trickling a POST body hold the N request threads until --body-timeout (408), and
// /health and /metrics still answer meanwhile.
TEST(Hardening, SlowClientsDoNotBlockHealth) {
    server::server_options o = base_options();
    o.http_threads = 4;
    o.header_timeout_s = 1.5;
    o.body_timeout_s = 1.5;
    server_under_test s(o);
    constexpr int n = 4;
    std::vector<int> heads, bodies;
    for (int i = 0; i < n; ++i) {
        heads.push_back(dial(s.port));
        send_all(heads.back(), "GET /health HTTP/1.1\r\nHo");
        bodies.push_back(dial(s.port));
        send_all(bodies.back(), post_head("/v1/chat/completions", "Content-Type: application/json\r\nContent-Length: 60000\r\n"));
    }
    std::atomic<bool> stop{false};
    std::thread trickle([&] {  // one byte per socket every 100 ms
        while (!stop) {
            for (int fd : heads) send(fd, "s", 1, MSG_NOSIGNAL);
            for (int fd : bodies) send(fd, " ", 1, MSG_NOSIGNAL);
            std::this_thread::sleep_for(100ms);
        }
    });
    std::this_thread::sleep_for(300ms);  // every slow request is in progress
    for (const char *path : {"/health", "/metrics", "/health"}) {
        const auto t0 = steady::now();
        auto res = s.client().Get(path);
        ASSERT_TRUE(res) << path;
        EXPECT_EQ(res->status, 200);
        EXPECT_LT(seconds_since(t0), 0.5) << path;
    }
    const auto t0 = steady::now();
    for (int fd : heads) EXPECT_EQ(read_to_close(fd), "");  // closed without an answer
    EXPECT_LT(seconds_since(t0), 4.0);
    for (int fd : bodies) {
        const std::string answer = read_to_close(fd);
        EXPECT_EQ(status_of(answer), 408) << answer.substr(0, 200);
    }
    EXPECT_LT(seconds_since(t0), 5.0);
    stop = true;
    trickle.join();
    for (int fd : heads) close(fd);
    for (int fd : bodies) close(fd);
    EXPECT_EQ(metric(s, "fathom_http_header_timeouts_total"), n);
    EXPECT_EQ(metric(s, "fathom_http_body_timeouts_total"), n);
    auto c = s.client();
    auto res = c.Post("/v1/chat/completions", chat_json("ok"), "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
}

// Item 4: a client that sends part of a head and shuts its side down is closed at once (the
// poller does not spin on the readable end-of-file until --header-timeout).
TEST(Hardening, HalfClosedPartialHeadClosedAtOnce) {
    server::server_options o = base_options();
    o.header_timeout_s = 5;
    server_under_test s(o);
    const int fd = dial(s.port);
    send_all(fd, "GET /health HTTP/1.1\r\nHo");
    std::this_thread::sleep_for(100ms);
    shutdown(fd, SHUT_WR);
    const auto t0 = steady::now();
    EXPECT_EQ(read_to_close(fd), "");
    EXPECT_LT(seconds_since(t0), 1.0);
    close(fd);
    EXPECT_EQ(s.client().Get("/health")->status, 200);
}

// Item 4: one client address holds at most --max-conns-per-client connections; another address
// is unaffected, and a closed connection frees its place.
TEST(Hardening, ConnectionCapPerClientAddress) {
    server::server_options o = base_options();
    o.max_conns_per_client = 3;
    server_under_test s(o);
    std::vector<int> idle;
    for (int i = 0; i < 3; ++i) idle.push_back(dial(s.port, "127.0.0.1"));
    std::this_thread::sleep_for(200ms);
    const int over = dial(s.port, "127.0.0.1");
    send_all(over, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(read_to_close(over), "");  // closed at accept, nothing answered
    close(over);
    EXPECT_EQ(raw_status(s.port, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"), -1);
    const int other = dial(s.port, "127.0.0.2");
    send_all(other, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(status_of(read_to_close(other)), 200);
    close(other);
    close(idle.back());
    idle.pop_back();
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(raw_status(s.port, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"), 200);
    for (int fd : idle) close(fd);
    EXPECT_EQ(metric(s, "fathom_http_connections_rejected_total"), 2);
}

// Item 5: DNS rebinding (Host), cross-origin pages (Origin, Content-Type), CORS preflight.
TEST(Hardening, HostOriginAndContentTypeChecks) {
    server_under_test s(base_options());
    const std::string port = std::to_string(s.port);
    auto get = [&](const std::string &host) {
        return raw_status(s.port, "GET /v1/models HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n\r\n");
    };
    EXPECT_EQ(get("127.0.0.1:" + port), 200);
    EXPECT_EQ(get("localhost:" + port), 200);
    EXPECT_EQ(get("LocalHost"), 200);
    EXPECT_EQ(get("[::1]:" + port), 200);
    EXPECT_EQ(get("attacker.example:" + port), 400);
    EXPECT_EQ(get("localhost.attacker.example"), 400);

    auto post = [&](const std::string &headers) {
        const std::string body = chat_json();
        return raw_status(s.port, post_head("/v1/chat/completions", headers + "Content-Length: " +
                                                                        std::to_string(body.size()) + "\r\n") + body);
    };
    EXPECT_EQ(post("Content-Type: application/json\r\n"), 200);
    EXPECT_EQ(post("Content-Type: Application/JSON; charset=utf-8\r\n"), 200);
    EXPECT_EQ(post("Content-Type: text/plain\r\n"), 415);  // a form or fetch without preflight
    EXPECT_EQ(post(""), 415);
    EXPECT_EQ(post("Content-Type: application/json\r\nOrigin: http://attacker.example\r\n"), 403);
    EXPECT_EQ(post("Content-Type: application/json\r\nOrigin: http://127.0.0.1\r\n"), 200);  // the chat page itself
    EXPECT_EQ(raw_status(s.port, "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                 "Origin: http://attacker.example\r\nAccess-Control-Request-Method: POST\r\n\r\n"),
              403);

    server::server_options o = base_options();
    o.cors_origins = {"https://app.example"};
    o.allowed_hosts = {"my.box"};
    server_under_test c(o);
    const int fd = dial(c.port);
    send_all(fd, "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: my.box\r\nConnection: close\r\nOrigin: https://app.example\r\n"
                 "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\r\n");
    const std::string pre = read_to_close(fd);
    close(fd);
    EXPECT_EQ(status_of(pre), 204) << pre;
    EXPECT_NE(pre.find("Access-Control-Allow-Origin: https://app.example\r\n"), std::string::npos) << pre;
    EXPECT_NE(pre.find("Access-Control-Allow-Methods: GET, POST, DELETE, OPTIONS\r\n"), std::string::npos) << pre;
    EXPECT_NE(pre.find("Access-Control-Allow-Headers: authorization, content-type\r\n"), std::string::npos) << pre;
    httplib::Client cl("127.0.0.1", c.port);
    auto res = cl.Post("/v1/chat/completions", {{"Host", "my.box"}, {"Origin", "https://app.example"}}, chat_json(),
                       "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_EQ(res->get_header_value("Access-Control-Allow-Origin"), "https://app.example");
    EXPECT_EQ(raw_status(c.port, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"), 400);
}

// Item 5: /props names the model file, not where it lies (the fake's path is /models/fake-model.gguf).
TEST(Hardening, NoAbsolutePathsToClients) {
    server_under_test s(base_options());
    const std::string props = s.client().Get("/props")->body;
    EXPECT_EQ(props.find("/models/"), std::string::npos) << props;
    EXPECT_EQ(json::parse(props)["model"]["file"], "fake-model.gguf");
}

// Item 5: an error from loading a file (here a PFlash drafter that is not a GGUF) names the file,
// not its directory.
TEST(Hardening, NoAbsolutePathsInErrors) {
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("fathom_secret_dir_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    { std::ofstream(dir / "drafter.gguf") << "not a gguf file at all"; }
    server::server_options o = base_options();
    o.compression.drafter_path = (dir / "drafter.gguf").string();
    {
        server_under_test s(o);
        auto res = s.client().Post("/v1/chat/completions",
                                   json({{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                                         {"prefill_compression", "always"}, {"max_tokens", 2}}).dump(),
                                   "application/json");
        ASSERT_TRUE(res);
        EXPECT_GE(res->status, 400);
        EXPECT_EQ(res->body.find(dir.string()), std::string::npos) << res->body;
        EXPECT_NE(res->body.find("drafter.gguf"), std::string::npos) << res->body;
    }
    std::filesystem::remove_all(dir);
}

// Item 6: the bearer scheme is case-insensitive (RFC 7235); /v1/completions errors name 'prompt';
// /v1/models lists the model once.
TEST(Hardening, BearerCompletionsParamAndModelList) {
    server::server_options o = base_options();
    o.api_key = "k123";
    server_under_test s(o, 64);
    auto c = s.client();
    for (const std::string scheme : {"Bearer", "bearer", "BEARER"}) {
        auto res = c.Get("/v1/models", {{"Authorization", scheme + " k123"}});
        ASSERT_TRUE(res);
        EXPECT_EQ(res->status, 200) << scheme;
        const json m = json::parse(res->body);
        ASSERT_EQ(m["data"].size(), 1u);
        EXPECT_EQ(m["data"][0]["id"], "fake-model");
        EXPECT_EQ(m["data"][0]["aliases"], json::array({"Fake Model"}));
    }
    EXPECT_EQ(c.Get("/v1/models", {{"Authorization", "bearer wrong"}})->status, 401);
    EXPECT_EQ(c.Get("/v1/models", {{"Authorization", "Basic k123"}})->status, 401);
    auto res = c.Post("/v1/completions", {{"Authorization", "Bearer k123"}},
                      json({{"prompt", std::string(100, 'x')}}).dump(), "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400);
    EXPECT_EQ(json::parse(res->body)["error"]["param"], "prompt") << res->body;
}

// More requests than slots and queue (2 slots, 8 queued, the engine held): the next is answered 503
// (busy) with Retry-After at once; the held ones all finish once the engine goes on. (The worker may
// have started its held step with one slot busy: the queue then holds the other 9.)
TEST(Hardening, FullQueueAnswers503WithRetryAfterAndTheOthersFinish) {
    server_under_test s(base_options());
    s.eng.hold = true;
    std::vector<std::thread> clients;
    std::atomic<int> ok{0}, busy{0};
    for (int i = 0; i < 10; ++i)
        clients.emplace_back([&, i] {
            auto c = s.client();
            auto r = c.Post("/v1/completions", json({{"prompt", "p" + std::to_string(i)}, {"max_tokens", 3}}).dump(),
                            "application/json");
            if (r && r->status == 200) ++ok;
            if (r && r->status == 503 && r->get_header_value("Retry-After") == "1") ++busy;
        });
    const auto until = steady::now() + 20s;
    // full: every slot taken or queued for (the queue holds max_queue + the idle slots' requests)
    auto taken = [&] { return s.sch.stats().queue_depth + s.sch.stats().slots_busy; };
    while (taken() + busy.load() < 10 && steady::now() < until) std::this_thread::sleep_for(5ms);
    const bool full = taken() == 10;
    EXPECT_TRUE(full);
    if (full) {
        auto c = s.client();
        auto res = c.Post("/v1/completions", json({{"prompt", "one more"}, {"max_tokens", 3}}).dump(), "application/json");
        EXPECT_TRUE(res);
        if (res) {
            EXPECT_EQ(res->status, 503);
            EXPECT_EQ(res->get_header_value("Retry-After"), "1");
            EXPECT_NE(res->body.find("busy"), std::string::npos) << res->body;
        }
    }
    s.eng.hold = false;
    for (auto &t : clients) t.join();
    EXPECT_EQ(busy.load(), 0);
    EXPECT_EQ(ok.load(), 10);
    EXPECT_EQ(s.client().Get("/health")->status, 200);
}

// Item 6: the access log: one line per request with method, path, status, duration and tokens;
// never the prompt text, the key or the query string.
TEST(Hardening, AccessLog) {
    server::server_options o = base_options();
    o.api_key = "sekrit-key";
    o.access_log = true;
    server_under_test s(o);
    testing::internal::CaptureStderr();
    auto c = s.client();
    c.set_bearer_token_auth("sekrit-key");
    auto res = c.Post("/v1/chat/completions?q=query-secret", chat_json("PROMPT-SECRET"), "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_EQ(c.Get("/nope")->status, 404);
    std::this_thread::sleep_for(200ms);  // the line is written after the response
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("POST /v1/chat/completions 200 "), std::string::npos) << log;
    EXPECT_NE(log.find(" ms prompt_tokens="), std::string::npos) << log;
    EXPECT_NE(log.find("completion_tokens=4"), std::string::npos) << log;
    EXPECT_NE(log.find("GET other 404 "), std::string::npos) << log;
    EXPECT_EQ(log.find("PROMPT-SECRET"), std::string::npos);
    EXPECT_EQ(log.find("sekrit"), std::string::npos);
    EXPECT_EQ(log.find("query-secret"), std::string::npos);

    server_under_test quiet(base_options());
    testing::internal::CaptureStderr();
    EXPECT_EQ(quiet.client().Get("/health")->status, 200);
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

namespace {
// Bounded arguments (one short string each): where the echo leaves the grammar, the lowest-id choices
// (whitespace, then spaces inside a string) must still reach the end of the call.
const json k_string8 = {{"type", "string"}, {"maxLength", 8}};
const json k_tools = json::array(
    {{{"type", "function"}, {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}, {"properties", {{"city", k_string8}}}}}}}},
     {{"type", "function"}, {"function", {{"name", "get_time"}, {"parameters", {{"type", "object"}, {"properties", {{"tz", k_string8}}}}}}}}});
// The hermes call opening the server writes after the generation prompt (forced_call_prefix).
const std::string k_open_required = "<tool_call>\n{\"name\": \"";
const std::string k_open_get_time = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": ";

std::string filler(const std::string &opening) { return std::string(opening.size(), '.'); }

json tool_chat(const std::string &user, const json &choice, bool stream = false) {
    return {{"messages", json::array({{{"role", "user"}, {"content", user}}})}, {"tools", k_tools},
            {"tool_choice", choice}, {"temperature", 0}, {"stream", stream}};
}
}  // namespace

// Item 6: tool_choice "required", a named function and Anthropic any / tool are enforced: the
// prompt ends inside a call's opening (with the name when one is named), and the rest of the call is
// grammar-constrained (docs/server.md "Structured output"): a tool name of the request, arguments
// valid for its schema, the closing tag. So even a model that would answer in prose writes a valid
// call; output that still is not one (max_tokens cut it) is an error, never plain text or another
// tool's call. The fake engine echoes the user message from the position it has reached after the
// generation prompt (a message runs to its first newline): a message whose first bytes are filler
// as long as the forced opening continues it; where the echo leaves the grammar, greedy decoding takes
// the allowed token with the lowest id (all other logits are equal).
TEST(Hardening, ToolChoiceEnforced) {
    server_under_test s(base_options());
    auto c = s.client();
    auto chat = [&](const json &body) {
        auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
        EXPECT_TRUE(res);
        return res ? std::make_pair(res->status, json::parse(res->body, nullptr, false)) : std::make_pair(-1, json());
    };
    auto is_call_to = [](const json &r, const std::set<std::string> &names) {
        const json &calls = r["choices"][0]["message"]["tool_calls"];
        if (r["choices"][0]["finish_reason"] != "tool_calls" || calls.size() != 1) return false;
        const json args = json::parse(calls[0]["function"]["arguments"].get<std::string>(), nullptr, false);
        return names.count(calls[0]["function"]["name"].get<std::string>()) > 0 && args.is_object();
    };
    // A model that would answer in prose: constrained into a call all the same.
    auto [st, r] = chat(tool_chat("hello", "required"));
    ASSERT_EQ(st, 200) << r.dump();
    EXPECT_TRUE(is_call_to(r, {"get_time", "get_weather"})) << r.dump();
    // Cut by max_tokens before the call closes: an error, not a 200 without calls.
    json cut = tool_chat("hello", "required");
    cut["max_tokens"] = 3;
    std::tie(st, r) = chat(cut);
    EXPECT_EQ(st, 500) << r.dump();
    EXPECT_NE(r["error"]["message"].get<std::string>().find("did not complete a valid call"), std::string::npos) << r.dump();
    // The opening forced, the model completes it.
    std::tie(st, r) = chat(tool_chat(filler(k_open_required) + "get_time\", \"arguments\": {}}</tool_call>", "required"));
    ASSERT_EQ(st, 200) << r.dump();
    EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
    EXPECT_EQ(r["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_time");
    // Named: the user's text is a get_weather call, but get_time's opening is forced: a get_time call.
    const json named = {{"type", "function"}, {"function", {{"name", "get_time"}}}};
    std::tie(st, r) = chat(tool_chat("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>", named));
    ASSERT_EQ(st, 200) << r.dump();
    EXPECT_TRUE(is_call_to(r, {"get_time"})) << r.dump();
    std::tie(st, r) = chat(tool_chat(filler(k_open_get_time) + "{\"tz\": \"UTC\"}}</tool_call>", named));
    ASSERT_EQ(st, 200) << r.dump();
    ASSERT_EQ(r["choices"][0]["message"]["tool_calls"].size(), 1u);
    EXPECT_EQ(r["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_time");
    EXPECT_EQ(json::parse(r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
              json({{"tz", "UTC"}}));
    // Streamed and cut: an error frame, no content.
    cut["stream"] = true;
    auto res = c.Post("/v1/chat/completions", cut.dump(), "application/json");
    ASSERT_TRUE(res);
    EXPECT_NE(res->body.find("did not complete a valid call"), std::string::npos) << res->body;
    EXPECT_EQ(res->body.find("\"content\":\"hello\""), std::string::npos) << res->body;

    // Anthropic: any and tool.
    const json tools_a = json::array({{{"name", "get_weather"}, {"input_schema", k_tools[0]["function"]["parameters"]}},
                                      {{"name", "get_time"}, {"input_schema", k_tools[1]["function"]["parameters"]}}});
    auto msg = [&](const std::string &user, const json &choice, int max_tokens = 200) {
        const json b = {{"model", "fake-model"}, {"max_tokens", max_tokens}, {"messages", json::array({{{"role", "user"}, {"content", user}}})},
                        {"tools", tools_a}, {"tool_choice", choice}};
        auto res = c.Post("/v1/messages", b.dump(), "application/json");
        EXPECT_TRUE(res);
        return res ? std::make_pair(res->status, json::parse(res->body, nullptr, false)) : std::make_pair(-1, json());
    };
    std::tie(st, r) = msg("hello", {{"type", "any"}});
    ASSERT_EQ(st, 200) << r.dump();
    EXPECT_EQ(r["stop_reason"], "tool_use");
    std::tie(st, r) = msg("hello", {{"type", "any"}}, 3);
    EXPECT_EQ(st, 500) << r.dump();
    EXPECT_EQ(r["type"], "error");
    std::tie(st, r) = msg(filler(k_open_get_time) + "{\"tz\": \"UTC\"}}</tool_call>", {{"type", "tool"}, {"name", "get_time"}});
    ASSERT_EQ(st, 200) << r.dump();
    EXPECT_EQ(r["stop_reason"], "tool_use");
    ASSERT_EQ(r["content"].size(), 1u);
    EXPECT_EQ(r["content"][0]["name"], "get_time");
    EXPECT_EQ(r["content"][0]["input"], json({{"tz", "UTC"}}));
    // auto stays a hint: prose is prose.
    std::tie(st, r) = chat(tool_chat("hello", "auto"));
    EXPECT_EQ(st, 200);
    EXPECT_EQ(r["choices"][0]["message"]["content"], "hello");
}
