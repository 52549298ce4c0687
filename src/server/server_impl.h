// Internal to src/server: state shared by the HTTP routes (http_server.cpp) and the generation
// endpoints (generate.cpp), and the client-connection probe used to cancel abandoned requests.
#pragma once
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <map>
#include <mutex>

#include "server/api.h"
#include "server/connections.h"
#include "server/http_server.h"
#include "server/tool_calls.h"

namespace fathom::server {

struct server_context {
    engine &eng;
    sched::scheduler &sch;
    server_options opts;
    std::unique_ptr<tool_format> fmt;
    std::unique_ptr<prompt_compressor> compressor;  // PFlash (validated options; drafter loads on first use)
    std::mutex mu;
    std::map<std::string, uint64_t> http_counts;  // "endpoint status" -> n
    server_context(engine &e, sched::scheduler &s, server_options o) : eng(e), sch(s), opts(std::move(o)) {}
};

// Watches the TCP connection a request arrived on (the connection served on this thread, see
// connections.h): alive() peeks it without consuming data (0 bytes readable = the client closed the connection).
class connection_probe {
public:
    explicit connection_probe(const httplib::Request &req);
    bool alive() const;
    // True at most once per 100 ms: rate-limits the checks of a busy stream.
    bool due();
private:
    int fd_ = -1;  // -1 = no connection (not served through connection_manager): always reported alive
    std::chrono::steady_clock::time_point last_{};
};

// Error JSON in the API's schema (Anthropic for /v1/messages*, OpenAI otherwise).
void send_error(const httplib::Request &req, httplib::Response &res, int status, const std::string &type,
                const std::string &msg, const std::string &param = {});

// POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens.
// body: the request body (read by the route under --max-body).
void handle_generate(server_context &ctx, const httplib::Request &req, const std::string &body, httplib::Response &res,
                     api_kind kind);
void handle_count_tokens(server_context &ctx, const httplib::Request &req, const std::string &body,
                         httplib::Response &res);

inline std::string dump_json(const nlohmann::json &j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace fathom::server
