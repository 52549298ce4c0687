// `fathom serve`'s HTTP front end (cpp-httplib): OpenAI- and Anthropic-compatible endpoints, SSE
// streaming, bearer-key auth, /health, /metrics (Prometheus), /props, /v1/models and the web chat
// page at /. HTTP threads parse and validate, then hand the work to the scheduler (one worker owns
// the model) and stream the job's events back. Errors use each API's error JSON.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "fathom/engine.h"
#include "fathom/sampling.h"
#include "sched/scheduler.h"
#include "server/connections.h"
#include "server/prompt_compression.h"

namespace fathom::server {

struct server_options {
    std::string host = "127.0.0.1";
    int port = 8080;                    // 0 = any free port (see http_server::bind)
    std::string api_key;                // "" = no auth; else "Authorization: Bearer KEY" or "x-api-key: KEY"
    size_t max_body_bytes = 8u << 20;   // larger bodies -> 413
    int http_threads = 64;              // connections served at once (streams hold one each)
    sampling_params defaults;           // used for fields a request leaves out
    std::vector<std::string> model_ids; // accepted "model" values; [0] is reported; empty = derive from the file
    compression_options compression;    // PFlash (docs/pflash.md "Server and daemon"); off by default
    std::string tool_turns_path;        // journal of replayed tool-call turns ("" = memory only; serve
                                        // puts it in the --prompt-cache directory: tool-turns.log)
    // Thinking (docs/server.md "Thinking"): the mode of requests that ask none (--reasoning:
    // template_default = auto, off, on) and their thinking budget in tokens (--reasoning-budget; -1 = none).
    chat_thinking reasoning = chat_thinking::template_default;
    int64_t reasoning_budget = -1;
    // Slow and greedy clients (docs/server.md "Connections"): seconds from connect (or keep-alive
    // reuse) to a complete request head, and from the head to a complete body; open connections
    // per client address (more are closed at once).
    double header_timeout_s = 10;
    double body_timeout_s = 60;
    int max_conns_per_client = 64;
    // Browsers (docs/server.md "Origins"): accepted Host header names ("" entries ignored; empty =
    // the listening address, plus localhost / 127.0.0.1 / ::1 when it is a loopback or wildcard
    // address), and origins allowed to call the API cross-origin ("*" = any; empty = none).
    std::vector<std::string> allowed_hosts;
    std::vector<std::string> cors_origins;
    bool access_log = false;            // one line per request on stderr (no prompt text, no keys)
    // Responses API store (docs/server.md "Responses API"): responses kept for previous_response_id
    // and GET/DELETE /v1/responses/{id}, at most this many and this many bytes (LRU eviction).
    size_t responses_max_entries = 1024;
    size_t responses_max_bytes = size_t(256) << 20;
};

class http_server {
public:
    http_server(engine &eng, sched::scheduler &sch, server_options opts);
    ~http_server();
    // Binds the listening socket; returns the port (useful with port 0). Throws fathom::error.
    int bind();
    // Serves until stop() (call bind() first).
    void listen();
    void stop();
    const std::vector<std::string> &model_ids() const;
    // Connections refused or timed out so far (also in /metrics).
    connection_stats connections() const;

    struct impl;  // opaque (http_server.cpp)

private:
    std::unique_ptr<impl> p_;
};

// Prometheus text exposition of the scheduler's and the HTTP layer's counters.
// http_counts: "endpoint status" -> count.
std::string render_metrics(const sched::scheduler_stats &s, const std::vector<std::pair<std::string, uint64_t>> &http_counts);
// The PFlash counters (fathom_prefill_compression_*), appended to the above.
std::string render_compression_metrics(const compression_stats &s);
// The connection counters (fathom_http_connections_*_total).
std::string render_connection_metrics(const connection_stats &s);

// "data: <json>\n\n"
std::string sse_data(const std::string &json_text);
// "event: <name>\ndata: <json>\n\n"
std::string sse_event(const std::string &name, const std::string &json_text);

// The embedded chat page (web/index.html).
const std::string &web_index_html();

}  // namespace fathom::server
