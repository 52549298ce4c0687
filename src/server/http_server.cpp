// HTTP routes, auth, error JSON, body limit, request counting, the checks made on a request's head
// (framing, Host, Origin, CORS, Content-Type) and the access log. Connections: connections.h.
#include "server/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "server/server_impl.h"

namespace fathom::server {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// connection probe
// ---------------------------------------------------------------------------------------------

connection_probe::connection_probe(const httplib::Request &) {
    if (const connection *c = connection_manager::current()) fd_ = c->fd;
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
                const std::string &msg, const std::string &param, const std::string &code_in) {
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
        if (!code_in.empty()) code = code_in;
        body = {{"error", {{"message", msg}, {"type", t}, {"param", param.empty() ? json() : json(param)},
                           {"code", code.empty() ? json() : json(code)}}}};
    }
    res.status = status;
    res.set_content(dump_json(body), "application/json");
}

// ---------------------------------------------------------------------------------------------
// server
// ---------------------------------------------------------------------------------------------

// cpp-httplib's server with the connection handling of connections.h: the accept loop hands each
// socket to the connection manager (an inline task queue runs process_and_close_socket on the
// accept thread), which calls serve_one on a worker once a request head is complete.
class managed_server : public httplib::Server {
public:
    explicit managed_server(const connection_limits &lim)
        : conns(lim, [this](connection &c) { return serve_one(c); }) {
        new_task_queue = [] { return new inline_queue; };
    }
    ~managed_server() override { conns.stop(); }
    connection_manager conns;

private:
    struct inline_queue : httplib::TaskQueue {
        void enqueue(std::function<void()> fn) override { fn(); }
        void shutdown() override {}
    };
    static constexpr int k_keep_alive_max = 100;  // requests per connection

    bool process_and_close_socket(socket_t sock) override {
        conns.add(int(sock));
        return true;
    }
    // One request on c (worker thread); true = the connection may carry another.
    bool serve_one(connection &c) {
        bool closed = false;
        const bool last = c.served + 1 >= k_keep_alive_max;
        c.started = std::chrono::steady_clock::now();
        c.n_prompt = c.n_generated = -1;
        const bool ok = httplib::detail::process_client_socket(
            c.fd, read_timeout_sec_, read_timeout_usec_, write_timeout_sec_, write_timeout_usec_,
            [&](httplib::Stream &strm) { return process_request(strm, last, closed, nullptr); });
        return ok && !closed && !last;
    }
};

static connection_limits limits_of(const server_options &o) {
    auto ms = [](double s) { return std::chrono::milliseconds(int64_t(s * 1000.0)); };
    connection_limits l;
    l.header_timeout = ms(o.header_timeout_s);
    l.body_timeout = ms(o.body_timeout_s);
    l.max_per_client = o.max_conns_per_client;
    l.request_threads = std::max(o.http_threads, 2);
    return l;
}

struct http_server::impl {
    server_context ctx;
    managed_server svr;
    std::atomic<int> listen_fd{-1};  // the listening socket, captured when httplib creates it
    impl(engine &e, sched::scheduler &s, server_options o) : ctx(e, s, std::move(o)), svr(limits_of(ctx.opts)) {}
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
    // RFC 7235: the scheme name is case-insensitive.
    if (auth.size() > 7 && strncasecmp(auth.c_str(), "bearer ", 7) == 0 && key_matches(auth.substr(7), key)) return true;
    return req.has_header("x-api-key") && key_matches(req.get_header_value("x-api-key"), key);
}

static json props_json(server_context &ctx) {
    const model_info &mi = ctx.eng.info();
    const auto s = ctx.sch.stats();
    const auto &d = ctx.opts.defaults;
    json slots = json::array();
    for (const auto &sl : ctx.sch.slots()) slots.push_back({{"id", sl.index}, {"busy", sl.busy}, {"n_tokens", sl.n_tokens}});
    return {{"model", {{"id", ctx.opts.model_ids.front()}, {"arch", mi.arch}, {"name", mi.name},
                       {"file", std::filesystem::path(mi.path).filename().string()},
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
                                     {"drafter", std::filesystem::path(ctx.compressor->options().drafter_path).filename().string()},
                                     {"drafter_residency", pflash::residency_name(ctx.compressor->options().residency)}}},
            {"chat_template", mi.chat_template},
            {"max_body_bytes", ctx.opts.max_body_bytes},
            {"default_sampling", {{"temperature", d.temperature}, {"top_k", d.top_k}, {"top_p", d.top_p},
                                  {"min_p", d.min_p}, {"repeat_penalty", d.repeat_penalty}}},
            {"endpoints", {"GET /health", "GET /metrics", "GET /props", "GET /v1/models", "POST /v1/chat/completions",
                           "POST /v1/completions", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses", "POST /v1/responses/input_tokens",
                           "GET /v1/responses/{id}", "GET /v1/responses/{id}/input_items", "DELETE /v1/responses/{id}", "GET /"}}};
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
    p_->ctx.fmt = make_tool_format(eng.info().tool_format);
    if (!o.tool_turns_path.empty()) p_->ctx.fmt->persist_replay(o.tool_turns_path);
    p_->ctx.compressor = std::make_unique<prompt_compressor>(o.compression);
    p_->ctx.responses = std::make_unique<response_store>(o.responses_max_entries, o.responses_max_bytes);
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
    if (port < 0)
        throw error("serve: cannot listen on " + o.host + " port " + std::to_string(o.port) +
                    " (the port is in use by another process, or the address is not available)");
    return port;
}

void http_server::listen() {
    p_->svr.listen_after_bind();
    p_->svr.conns.stop();  // requests in progress finish first
}

void http_server::stop() { p_->svr.stop(); }

connection_stats http_server::connections() const { return p_->svr.conns.stats(); }

static std::string endpoint_label(const std::string &path) {
    static const char *known[] = {"/", "/health", "/metrics", "/props", "/v1/models", "/v1/chat/completions",
                                  "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                                  "/v1/responses/input_tokens"};
    for (const char *k : known)
        if (path == k) return k;
    if (path.rfind("/v1/responses/", 0) == 0)  // never the id itself
        return path.size() > 12 && path.compare(path.size() - 12, 12, "/input_items") == 0 ? "/v1/responses/{id}/input_items"
                                                                                           : "/v1/responses/{id}";
    return "other";
}

static bool is_post_endpoint(const std::string &path) {
    return path == "/v1/chat/completions" || path == "/v1/completions" || path == "/v1/messages" ||
           path == "/v1/messages/count_tokens" || path == "/v1/responses" ||
           path == "/v1/responses/input_tokens";
}

// Runs a handler, turning exceptions into the API's error JSON.
template <class F>
static void guarded(const httplib::Request &req, httplib::Response &res, F &&f) {
    try {
        f();
    } catch (const api_error &e) {
        if (e.retry_after_s > 0) res.set_header("Retry-After", std::to_string(e.retry_after_s));
        send_error(req, res, e.status, e.type, e.what(), e.param, e.code);
    } catch (const std::exception &e) {
        send_error(req, res, 500, "api_error", std::string("internal error: ") + e.what());
    }
}

// ---------------------------------------------------------------------------------------------
// request checks before the body is read (pre-routing)
// ---------------------------------------------------------------------------------------------

static std::string lower(std::string s) {
    for (char &c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

// Host header -> host name without port ("[::1]:8080" -> "::1", "a.b:80" -> "a.b").
static std::string host_name(const std::string &host) {
    if (!host.empty() && host[0] == '[') {
        const size_t close = host.find(']');
        return close == std::string::npos ? host : host.substr(1, close - 1);
    }
    const size_t colon = host.find(':');
    return lower(colon == std::string::npos ? host : host.substr(0, colon));
}

static bool is_ip_literal(const std::string &name) {
    unsigned char buf[sizeof(in6_addr)];
    return inet_pton(AF_INET, name.c_str(), buf) == 1 || inet_pton(AF_INET6, name.c_str(), buf) == 1;
}

// DNS rebinding: a page on attacker.example whose name now resolves to 127.0.0.1 reaches us with
// "Host: attacker.example". Accepted: names in --allowed-host, else IP literals, "localhost" and
// the --host value.
static bool host_allowed(const server_options &o, const httplib::Request &req) {
    if (!req.has_header("Host")) return true;  // HTTP/1.0 tools; every browser sends Host
    const std::string name = host_name(req.get_header_value("Host"));
    if (!o.allowed_hosts.empty()) {
        for (const auto &h : o.allowed_hosts)
            if (h == "*" || lower(h) == name) return true;
        return false;
    }
    return is_ip_literal(name) || name == "localhost" || name == lower(o.host);
}

static bool origin_listed(const server_options &o, const std::string &origin) {
    for (const auto &c : o.cors_origins)
        if (c == "*" || c == origin) return true;
    return false;
}

// A request with no Origin, or from the page's own origin, or from an origin given to --cors-origin.
static bool origin_allowed(const server_options &o, const httplib::Request &req) {
    if (!req.has_header("Origin")) return true;
    const std::string origin = req.get_header_value("Origin");
    const std::string host = req.get_header_value("Host");
    if (!host.empty() && (origin == "http://" + host || origin == "https://" + host)) return true;
    return origin_listed(o, origin);
}

// The CORS preflight (OPTIONS) for an origin given to --cors-origin.
static void answer_preflight(const httplib::Request &req, httplib::Response &res) {
    res.status = 204;
    res.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
    const std::string asked = req.get_header_value("Access-Control-Request-Headers");
    res.set_header("Access-Control-Allow-Headers",
                   asked.empty() ? "Authorization, Content-Type, x-api-key, anthropic-version" : asked);
    res.set_header("Access-Control-Max-Age", "600");
}

// Content-Length / Transfer-Encoding of a request, checked before any body byte is read: an absurd
// length gets 400 and a too large one 413 at once (cpp-httplib would read or skip it first).
static void check_framing(const server_options &o, const httplib::Request &req) {
    const size_t n_len = req.get_header_value_count("Content-Length");
    const bool chunked = req.has_header("Transfer-Encoding");
    if (chunked && lower(req.get_header_value("Transfer-Encoding")) != "chunked")
        throw api_error(400, "invalid_request_error", "unsupported Transfer-Encoding (only chunked is accepted)");
    if (chunked && n_len) throw api_error(400, "invalid_request_error", "both Content-Length and Transfer-Encoding sent");
    if (n_len > 1) throw api_error(400, "invalid_request_error", "more than one Content-Length header");
    if (n_len == 1) {
        const std::string v = req.get_header_value("Content-Length");
        const bool digits = !v.empty() && v.size() <= 18 &&
                            std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
        if (!digits) throw api_error(400, "invalid_request_error", "invalid Content-Length '" + v.substr(0, 32) + "'");
        if (std::stoull(v) > o.max_body_bytes)
            throw api_error(413, "request_too_large", "the request body exceeds " + std::to_string(o.max_body_bytes) + " bytes");
    } else if (!chunked && req.method == "POST") {
        throw api_error(411, "invalid_request_error", "a POST needs Content-Length or chunked Transfer-Encoding");
    }
}

static bool has_body(const httplib::Request &req) {
    if (req.has_header("Transfer-Encoding")) return true;
    const std::string v = req.get_header_value("Content-Length");
    return !v.empty() && v != "0";
}

static bool is_json_type(const std::string &content_type) {
    std::string t = lower(content_type.substr(0, content_type.find(';')));
    while (!t.empty() && t.back() == ' ') t.pop_back();
    return t == "application/json";
}

// Everything decided from the head alone; true = answered (res holds the reply).
static bool pre_route(server_context &ctx, connection_manager &conns, const httplib::Request &req, httplib::Response &res) {
    const server_options &o = ctx.opts;
    if (connection *c = connection_manager::current()) conns.body_started(*c);
    if (!host_allowed(o, req))
        throw api_error(400, "invalid_request_error",
                        "Host '" + req.get_header_value("Host").substr(0, 64) + "' is not accepted by this server (--allowed-host)");
    if (!origin_allowed(o, req))
        throw api_error(403, "permission_error",
                        "cross-origin request from '" + req.get_header_value("Origin").substr(0, 64) +
                            "' refused (allow it with --cors-origin)");
    if (req.has_header("Origin") && origin_listed(o, req.get_header_value("Origin"))) {
        res.set_header("Access-Control-Allow-Origin", req.get_header_value("Origin"));
        res.set_header("Vary", "Origin");
    }
    if (req.method == "OPTIONS") {  // preflight: no key needed (browsers send none)
        answer_preflight(req, res);
        return true;
    }
    check_framing(o, req);
    const bool open = req.path == "/" || req.path == "/health";
    if (!open && !authorised(req, o.api_key))
        throw api_error(401, "authentication_error", "invalid or missing API key (send 'Authorization: Bearer KEY')");
    if (req.method == "POST" && !is_post_endpoint(req.path))
        throw api_error(404, "not_found_error", "no endpoint POST " + req.path);
    if (req.method == "POST" && !is_json_type(req.get_header_value("Content-Type")))
        throw api_error(415, "invalid_request_error", "the request body must be sent as 'Content-Type: application/json'");
    if (req.method != "POST" && req.method != "GET" && req.method != "HEAD" && req.method != "DELETE")
        throw api_error(405, "invalid_request_error", "method " + req.method + " not allowed on " + req.path);
    return false;
}

// Reads the request body through cpp-httplib's content reader, whatever its framing, keeping at
// most max bytes: a longer body stops the read (413); a body that does not arrive in time, 408.
static std::string read_body(server_context &ctx, connection_manager &conns, const httplib::ContentReader &reader) {
    std::string body;
    bool over = false, late = false;
    const size_t max = ctx.opts.max_body_bytes;
    connection *c = connection_manager::current();
    const bool ok = reader([&](const char *data, size_t n) {
        if (body.size() + n > max) {
            over = true;
            return false;
        }
        if (c && std::chrono::steady_clock::now() > c->body_deadline) {
            late = true;
            return false;
        }
        body.append(data, n);
        return true;
    });
    if (c) conns.body_done(*c);
    if (ok) return body;
    if (c) c->close_after = true;  // the rest of the body is still on the wire
    if (over) throw api_error(413, "request_too_large", "the request body exceeds " + std::to_string(max) + " bytes");
    if (late) {
        conns.body_timed_out();
        throw api_error(408, "invalid_request_error",
                        "the request body did not arrive within " + std::to_string(int(ctx.opts.body_timeout_s)) + " s");
    }
    throw api_error(400, "invalid_request_error", "the request body could not be read (malformed chunked encoding?)");
}

static void access_log(const httplib::Request &req, const httplib::Response &res) {
    const connection *c = connection_manager::current();
    const double ms = c ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c->started).count() : 0;
    std::string tokens;
    if (c && c->n_prompt >= 0)
        tokens = " prompt_tokens=" + std::to_string(c->n_prompt) + " completion_tokens=" + std::to_string(c->n_generated);
    // The path only (a query string could carry anything), never headers or the body.
    std::fprintf(stderr, "fathom serve: %s %s %s %d %.1f ms%s\n", req.remote_addr.c_str(), req.method.c_str(),
                 endpoint_label(req.path).c_str(), res.status, ms, tokens.c_str());
}

static void setup_routes(http_server::impl &p) {
    server_context &ctx = p.ctx;
    managed_server &svr = p.svr;
    connection_manager &conns = svr.conns;
    svr.set_socket_options([&p](socket_t sock) {
        // cpp-httplib's defaults set SO_REUSEPORT, which lets a second server bind the same port and
        // take half the connections: only SO_REUSEADDR (restart while old connections linger).
        const int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
        p.listen_fd.store(int(sock));  // the last socket created is the one that got bound
    });
    svr.set_payload_max_length(ctx.opts.max_body_bytes);

    svr.set_pre_routing_handler([&ctx, &conns](const httplib::Request &req, httplib::Response &res) {
        bool answered = true;
        guarded(req, res, [&] { answered = pre_route(ctx, conns, req, res); });
        if (!answered) return httplib::Server::HandlerResponse::Unhandled;
        if (has_body(req)) {  // answered before reading the body: drop it, then close
            if (connection *c = connection_manager::current()) c->close_after = true;
            if (req.get_header_value("Connection") != "close") res.set_header("Connection", "close");
        }
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
    // Counted just before the response is written (a client that got it sees it counted), logged after.
    svr.set_post_routing_handler([&ctx](const httplib::Request &req, httplib::Response &res) {
        std::lock_guard<std::mutex> lk(ctx.mu);
        ++ctx.http_counts[endpoint_label(req.path) + " " + std::to_string(res.status)];
    });
    svr.set_logger([&ctx](const httplib::Request &req, const httplib::Response &res) {
        if (ctx.opts.access_log) access_log(req, res);
    });

    // GET handlers: the body phase ends with the head (GET bodies are never read).
    auto get = [&svr, &conns](const char *path, httplib::Server::Handler h) {
        svr.Get(path, [&conns, h](const httplib::Request &req, httplib::Response &res) {
            if (connection *c = connection_manager::current()) conns.body_done(*c);
            h(req, res);
        });
    };
    get("/health", [](const httplib::Request &, httplib::Response &res) {
        res.set_content(R"({"status":"ok"})", "application/json");
    });
    get("/", [](const httplib::Request &, httplib::Response &res) {
        res.set_content(web_index_html(), "text/html; charset=utf-8");
    });
    get("/v1/models", [&ctx](const httplib::Request &, httplib::Response &res) {
        // One model, listed once; the other ids it answers to (--alias, the file's model name) in "aliases".
        const model_info &mi = ctx.eng.info();
        const auto &ids = ctx.opts.model_ids;
        const std::string &id = ids.front();
        json m = {{"id", id}, {"object", "model"}, {"created", 0}, {"owned_by", "fathom"}, {"type", "model"},
                  {"display_name", mi.name.empty() ? id : mi.name},
                  {"aliases", std::vector<std::string>(ids.begin() + 1, ids.end())},
                  {"meta", {{"n_ctx", ctx.sch.n_ctx()}, {"n_vocab", mi.n_vocab}, {"n_params", mi.n_params}}}};
        res.set_content(dump_json({{"object", "list"}, {"data", json::array({m})}}), "application/json");
    });
    get("/metrics", [&ctx, &conns](const httplib::Request &, httplib::Response &res) {
        std::vector<std::pair<std::string, uint64_t>> counts;
        {
            std::lock_guard<std::mutex> lk(ctx.mu);
            counts.assign(ctx.http_counts.begin(), ctx.http_counts.end());
        }
        res.set_content(render_metrics(ctx.sch.stats(), counts) + render_compression_metrics(ctx.compressor->stats()) +
                            render_connection_metrics(conns.stats()),
                        "text/plain; version=0.0.4");
    });
    get("/props", [&ctx](const httplib::Request &, httplib::Response &res) {
        res.set_content(dump_json(props_json(ctx)), "application/json");
    });
    auto post = [&svr, &ctx, &conns](const char *path, auto handler) {
        svr.Post(path, [&ctx, &conns, handler](const httplib::Request &req, httplib::Response &res,
                                               const httplib::ContentReader &reader) {
            guarded(req, res, [&] { handler(req, read_body(ctx, conns, reader), res); });
        });
    };
    auto gen = [&ctx](api_kind kind) {
        return [&ctx, kind](const httplib::Request &req, const std::string &body, httplib::Response &res) {
            handle_generate(ctx, req, body, res, kind);
        };
    };
    post("/v1/chat/completions", gen(api_kind::openai_chat));
    post("/v1/completions", gen(api_kind::openai_completion));
    post("/v1/messages", gen(api_kind::anthropic_messages));
    post("/v1/messages/count_tokens", [&ctx](const httplib::Request &req, const std::string &body, httplib::Response &res) {
        handle_count_tokens(ctx, req, body, res);
    });
    post("/v1/responses", [&ctx](const httplib::Request &req, const std::string &body, httplib::Response &res) {
        handle_responses_create(ctx, req, body, res);
    });
    post("/v1/responses/input_tokens", [&ctx](const httplib::Request &, const std::string &body, httplib::Response &res) {
        handle_responses_input_tokens(ctx, body, res);
    });
    const char *response_path = R"(/v1/responses/([^/]+))";
    get(response_path, [&ctx](const httplib::Request &req, httplib::Response &res) {
        guarded(req, res, [&] { handle_responses_get(ctx, req.matches[1].str(), res); });
    });
    get(R"(/v1/responses/([^/]+)/input_items)", [&ctx](const httplib::Request &req, httplib::Response &res) {
        guarded(req, res, [&] { handle_responses_input_items(ctx, req.matches[1].str(), req, res); });
    });
    svr.Delete(response_path, [&ctx, &conns](const httplib::Request &req, httplib::Response &res) {
        if (connection *c = connection_manager::current()) conns.body_done(*c);
        guarded(req, res, [&] { handle_responses_delete(ctx, req.matches[1].str(), res); });
    });
}

}  // namespace fathom::server
