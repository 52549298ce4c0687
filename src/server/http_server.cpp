// HTTP routes, auth, error JSON, body limit, request counting and the connection probe.
#include "server/http_server.h"

#include <dirent.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "server/server_impl.h"

namespace fathom::server {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// connection probe
// ---------------------------------------------------------------------------------------------

static bool sock_matches(const sockaddr_storage &ss, const std::string &addr, int port) {
    char buf[INET6_ADDRSTRLEN] = {0};
    int p = -1;
    if (ss.ss_family == AF_INET) {
        auto *a = reinterpret_cast<const sockaddr_in *>(&ss);
        inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
        p = ntohs(a->sin_port);
    } else if (ss.ss_family == AF_INET6) {
        auto *a = reinterpret_cast<const sockaddr_in6 *>(&ss);
        inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
        p = ntohs(a->sin6_port);
    } else {
        return false;
    }
    return p == port && addr == buf;
}

connection_probe::connection_probe(const httplib::Request &req) {
    // cpp-httplib does not expose a request's socket: find it among our fds by its address pair.
    DIR *d = opendir("/proc/self/fd");
    if (!d) return;
    while (dirent *e = readdir(d)) {
        char *end = nullptr;
        const long fd = std::strtol(e->d_name, &end, 10);
        if (!end || *end || fd < 0 || fd == dirfd(d)) continue;
        struct stat st;
        if (fstat(int(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
        sockaddr_storage local{}, peer{};
        socklen_t ll = sizeof(local), pl = sizeof(peer);
        if (getsockname(int(fd), reinterpret_cast<sockaddr *>(&local), &ll) != 0) continue;
        if (getpeername(int(fd), reinterpret_cast<sockaddr *>(&peer), &pl) != 0) continue;
        if (sock_matches(local, req.local_addr, req.local_port) && sock_matches(peer, req.remote_addr, req.remote_port)) {
            fd_ = int(fd);
            break;
        }
    }
    closedir(d);
}

bool connection_probe::due() {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(100)) return false;
    last_ = now;
    return true;
}

bool connection_probe::alive() const {
    if (fd_ < 0) return true;
    char c;
    const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return true;
    if (n == 0) return false;  // orderly shutdown by the client
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

// ---------------------------------------------------------------------------------------------
// errors
// ---------------------------------------------------------------------------------------------

static bool is_anthropic(const httplib::Request &req) { return req.path.rfind("/v1/messages", 0) == 0; }

void send_error(const httplib::Request &req, httplib::Response &res, int status, const std::string &type,
                const std::string &msg, const std::string &param) {
    json body;
    if (is_anthropic(req)) {
        std::string t = type;
        if (t == "server_error") t = "api_error";
        body = {{"type", "error"}, {"error", {{"type", t}, {"message", msg}}}};
    } else {
        // OpenAI's vocabulary: everything a client got wrong is invalid_request_error.
        std::string t = type, code;
        if (type == "not_found_error") t = "invalid_request_error", code = param == "model" ? "model_not_found" : "not_found";
        if (type == "request_too_large") t = "invalid_request_error", code = "request_too_large";
        if (type == "authentication_error") code = "invalid_api_key";
        if (type == "overloaded_error" || type == "api_error") t = "server_error";
        if (msg.find("context is") != std::string::npos) code = "context_length_exceeded";
        body = {{"error", {{"message", msg}, {"type", t}, {"param", param.empty() ? json() : json(param)},
                           {"code", code.empty() ? json() : json(code)}}}};
    }
    res.status = status;
    res.set_content(dump_json(body), "application/json");
}

// ---------------------------------------------------------------------------------------------
// server
// ---------------------------------------------------------------------------------------------

struct http_server::impl {
    server_context ctx;
    httplib::Server svr;
    std::atomic<int> listen_fd{-1};  // the listening socket, captured when httplib creates it
    impl(engine &e, sched::scheduler &s, server_options o) : ctx(e, s, std::move(o)) {}
};

// cpp-httplib (Debian's build) listens with a backlog of 5: under a burst of connections the
// accept queue overflows, the kernel drops handshakes and clients see resets. Listen again with a
// real backlog (Linux updates the backlog of a listening socket).
constexpr int k_listen_backlog = 1024;

static bool key_matches(const std::string &given, const std::string &key) {
    // Constant-time in the key's length: no early exit on the first differing byte.
    unsigned diff = given.size() == key.size() ? 0u : 1u;
    for (size_t i = 0; i < key.size(); ++i) diff |= unsigned(uint8_t(key[i]) ^ uint8_t(i < given.size() ? given[i] : 0));
    return diff == 0;
}

static bool authorised(const httplib::Request &req, const std::string &key) {
    if (key.empty()) return true;
    const std::string auth = req.get_header_value("Authorization");
    if (auth.rfind("Bearer ", 0) == 0 && key_matches(auth.substr(7), key)) return true;
    return req.has_header("x-api-key") && key_matches(req.get_header_value("x-api-key"), key);
}

static json props_json(server_context &ctx) {
    const model_info &mi = ctx.eng.info();
    const auto s = ctx.sch.stats();
    const auto &d = ctx.opts.defaults;
    json slots = json::array();
    for (const auto &sl : ctx.sch.slots()) slots.push_back({{"id", sl.index}, {"busy", sl.busy}, {"n_tokens", sl.n_tokens}});
    return {{"model", {{"id", ctx.opts.model_ids.front()}, {"arch", mi.arch}, {"name", mi.name}, {"path", mi.path},
                       {"n_params", mi.n_params}, {"n_vocab", mi.n_vocab}, {"n_ctx_train", mi.n_ctx_train},
                       {"file_bytes", mi.file_bytes}}},
            {"n_ctx", ctx.sch.n_ctx()},
            {"parallel", s.n_slots},
            {"queue_capacity", s.queue_capacity},
            {"slots", slots},
            {"kv_pool", {{"blocks_total", s.kv_blocks_total}, {"blocks_used", s.kv_blocks_used},
                         {"blocks_cached", s.kv_blocks_cached}, {"block_tokens", s.kv_block_tokens},
                         {"bytes_per_token", mi.kv_bytes_per_token}}},
            {"tool_format", ctx.fmt->name()},
            {"prefill_compression", {{"mode", compression_mode_name(ctx.compressor->options().mode)},
                                     {"threshold", ctx.compressor->options().threshold},
                                     {"keep_ratio", ctx.compressor->options().keep_ratio},
                                     {"drafter", ctx.compressor->options().drafter_path},
                                     {"drafter_residency", pflash::residency_name(ctx.compressor->options().residency)}}},
            {"chat_template", mi.chat_template},
            {"max_body_bytes", ctx.opts.max_body_bytes},
            {"default_sampling", {{"temperature", d.temperature}, {"top_k", d.top_k}, {"top_p", d.top_p},
                                  {"min_p", d.min_p}, {"repeat_penalty", d.repeat_penalty}}},
            {"endpoints", {"GET /health", "GET /metrics", "GET /props", "GET /v1/models", "POST /v1/chat/completions",
                           "POST /v1/completions", "POST /v1/messages", "POST /v1/messages/count_tokens", "GET /"}}};
}

static void setup_routes(http_server::impl &p);

http_server::http_server(engine &eng, sched::scheduler &sch, server_options opts)
    : p_(std::make_unique<impl>(eng, sch, std::move(opts))) {
    auto &o = p_->ctx.opts;
    if (o.model_ids.empty()) {
        const model_info &mi = eng.info();
        o.model_ids.push_back(mi.path.empty() ? std::string("fathom") : std::filesystem::path(mi.path).stem().string());
        if (!mi.name.empty() && mi.name != o.model_ids.front()) o.model_ids.push_back(mi.name);
    }
    p_->ctx.fmt = make_tool_format(eng.info().arch);
    if (!o.tool_turns_path.empty()) p_->ctx.fmt->persist_replay(o.tool_turns_path);
    p_->ctx.compressor = std::make_unique<prompt_compressor>(o.compression);
    setup_routes(*p_);
}

http_server::~http_server() { stop(); }

const std::vector<std::string> &http_server::model_ids() const { return p_->ctx.opts.model_ids; }

int http_server::bind() {
    const auto &o = p_->ctx.opts;
    int port = o.port;
    if (port == 0) port = p_->svr.bind_to_any_port(o.host);
    else if (!p_->svr.bind_to_port(o.host, port)) port = -1;
    if (port >= 0 && p_->listen_fd.load() >= 0 && ::listen(p_->listen_fd.load(), k_listen_backlog) != 0)
        throw error(std::string("serve: cannot raise the listen backlog: ") + std::strerror(errno));
    if (port < 0) throw error("serve: cannot listen on " + o.host + ":" + std::to_string(o.port) + " (address in use or not available)");
    return port;
}

void http_server::listen() { p_->svr.listen_after_bind(); }

void http_server::stop() { p_->svr.stop(); }

static std::string endpoint_label(const std::string &path) {
    static const char *known[] = {"/", "/health", "/metrics", "/props", "/v1/models", "/v1/chat/completions",
                                  "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"};
    for (const char *k : known)
        if (path == k) return k;
    return "other";
}

// Runs a handler, turning exceptions into the API's error JSON.
template <class F>
static void guarded(const httplib::Request &req, httplib::Response &res, F &&f) {
    try {
        f();
    } catch (const api_error &e) {
        send_error(req, res, e.status, e.type, e.what(), e.param);
    } catch (const std::exception &e) {
        send_error(req, res, 500, "api_error", std::string("internal error: ") + e.what());
    }
}

static void setup_routes(http_server::impl &p) {
    server_context &ctx = p.ctx;
    httplib::Server &svr = p.svr;
    const int threads = std::max(ctx.opts.http_threads, 2);
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    svr.set_socket_options([&p](socket_t sock) {
        httplib::default_socket_options(sock);
        p.listen_fd.store(int(sock));  // the last socket created is the one that got bound
    });
    svr.set_payload_max_length(ctx.opts.max_body_bytes);

    svr.set_pre_routing_handler([&ctx](const httplib::Request &req, httplib::Response &res) {
        const bool open = req.path == "/" || req.path == "/health";
        if (open || authorised(req, ctx.opts.api_key)) return httplib::Server::HandlerResponse::Unhandled;
        send_error(req, res, 401, "authentication_error", "invalid or missing API key (send 'Authorization: Bearer KEY')");
        return httplib::Server::HandlerResponse::Handled;
    });
    svr.set_error_handler([&ctx](const httplib::Request &req, httplib::Response &res) {
        if (!res.body.empty()) return;
        if (res.status == 413)
            send_error(req, res, 413, "request_too_large",
                       "the request body exceeds " + std::to_string(ctx.opts.max_body_bytes) + " bytes");
        else if (res.status == 404)
            send_error(req, res, 404, "not_found_error", "no endpoint " + req.method + " " + req.path);
        else if (res.status == 405)
            send_error(req, res, 405, "invalid_request_error", "method " + req.method + " not allowed on " + req.path);
        else
            send_error(req, res, res.status, res.status >= 500 ? "api_error" : "invalid_request_error",
                       "HTTP error " + std::to_string(res.status));
    });
    svr.set_logger([&ctx](const httplib::Request &req, const httplib::Response &res) {
        std::lock_guard<std::mutex> lk(ctx.mu);
        ++ctx.http_counts[endpoint_label(req.path) + " " + std::to_string(res.status)];
    });

    svr.Get("/health", [](const httplib::Request &, httplib::Response &res) {
        res.set_content(R"({"status":"ok"})", "application/json");
    });
    svr.Get("/", [](const httplib::Request &, httplib::Response &res) {
        res.set_content(web_index_html(), "text/html; charset=utf-8");
    });
    svr.Get("/v1/models", [&ctx](const httplib::Request &, httplib::Response &res) {
        json data = json::array();
        const model_info &mi = ctx.eng.info();
        for (const auto &id : ctx.opts.model_ids)
            data.push_back({{"id", id}, {"object", "model"}, {"created", 0}, {"owned_by", "fathom"},
                            {"type", "model"}, {"display_name", mi.name.empty() ? id : mi.name},
                            {"meta", {{"n_ctx", ctx.sch.n_ctx()}, {"n_vocab", mi.n_vocab}, {"n_params", mi.n_params}}}});
        res.set_content(dump_json({{"object", "list"}, {"data", data}}), "application/json");
    });
    svr.Get("/metrics", [&ctx](const httplib::Request &, httplib::Response &res) {
        std::vector<std::pair<std::string, uint64_t>> counts;
        {
            std::lock_guard<std::mutex> lk(ctx.mu);
            counts.assign(ctx.http_counts.begin(), ctx.http_counts.end());
        }
        res.set_content(render_metrics(ctx.sch.stats(), counts) + render_compression_metrics(ctx.compressor->stats()),
                        "text/plain; version=0.0.4");
    });
    svr.Get("/props", [&ctx](const httplib::Request &, httplib::Response &res) {
        res.set_content(dump_json(props_json(ctx)), "application/json");
    });
    auto gen = [&ctx](api_kind kind) {
        return [&ctx, kind](const httplib::Request &req, httplib::Response &res) {
            guarded(req, res, [&] { handle_generate(ctx, req, res, kind); });
        };
    };
    svr.Post("/v1/chat/completions", gen(api_kind::openai_chat));
    svr.Post("/v1/completions", gen(api_kind::openai_completion));
    svr.Post("/v1/messages", gen(api_kind::anthropic_messages));
    svr.Post("/v1/messages/count_tokens", [&ctx](const httplib::Request &req, httplib::Response &res) {
        guarded(req, res, [&] { handle_count_tokens(ctx, req, res); });
    });
}

}  // namespace fathom::server
