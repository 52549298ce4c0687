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
#include "server/response_store.h"
#include "server/tool_calls.h"

namespace fathom::server {

struct server_context {
    engine &eng;
    sched::scheduler &sch;
    server_options opts;
    std::unique_ptr<tool_format> fmt;
    std::unique_ptr<prompt_compressor> compressor;  // PFlash (validated options; drafter loads on first use)
    std::unique_ptr<response_store> responses;      // Responses API store (--responses-store, --responses-store-mib)
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
                const std::string &msg, const std::string &param = {}, const std::string &code = {});

// POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens.
// body: the request body (read by the route under --max-body).
void handle_generate(server_context &ctx, const httplib::Request &req, const std::string &body, httplib::Response &res,
                     api_kind kind);
void handle_count_tokens(server_context &ctx, const httplib::Request &req, const std::string &body,
                         httplib::Response &res);

// A validated chat/completion request with its prompt tokens (generate.cpp builds it).
struct prepared {
    gen_request r;
    std::vector<int32_t> prompt;
    std::string model_id;  // the id reported back
    compression_outcome compression;  // PFlash: applied or not, original/effective prompt tokens
    // Thinking (docs/server.md "Thinking"): reasoning = the output is split into reasoning and
    // content; in_reasoning = the prompt ends inside an open thinking block; think = the tokens the
    // scheduler forces (the opening marker moved out of the prompt, the budget's closing marker).
    bool reasoning = false;
    bool in_reasoning = false;
    think_control think;
    std::string forced;  // tool_choice required / named: the call opening ending the prompt ("" = none)
    // A streamed request whose prompt PFlash will compress: compression (and the context check after
    // it) runs after the headers are sent, in the stream (stream_run::compress_and_submit).
    bool defer_compression = false;
};

// generate.cpp's pipeline, shared with the Responses endpoint (responses.cpp):
// a chat-completions body -> parsed request, model check, prompt (thinking set-up, forced call), PFlash,
// context check (count_only: the rendered prompt only, as count_tokens reports it);
prepared prepare_chat(server_context &ctx, const nlohmann::json &chat_body, bool count_only = false);
// -> a scheduler job (503 when the queue is full);
std::shared_ptr<sched::job> submit_prepared(server_context &ctx, prepared &p);
// the job's next event, cancelling it when the client went away (false);
bool wait_event(sched::job &j, connection_probe &probe, sched::event &ev);
// the finished answer's tool calls (500 when a forced call did not come out; remembers the turn for
// exact replay);
parsed_output parse_calls(server_context &ctx, const prepared &p, const std::string &text);
// an engine message with file paths cut to their last component; the access log's token counts.
std::string client_message(const std::string &msg);
void record_tokens(const sched::event &ev);

// POST /v1/responses, GET and DELETE /v1/responses/{id} (responses.cpp).
void handle_responses_create(server_context &ctx, const httplib::Request &req, const std::string &body,
                             httplib::Response &res);
void handle_responses_get(server_context &ctx, const std::string &id, httplib::Response &res);
void handle_responses_delete(server_context &ctx, const std::string &id, httplib::Response &res);
// POST /v1/responses/input_tokens (responses.cpp).
void handle_responses_input_tokens(server_context &ctx, const std::string &body, httplib::Response &res);
// GET /v1/responses/{id}/input_items?limit=&order=&after= (responses.cpp).
void handle_responses_input_items(server_context &ctx, const std::string &id, const httplib::Request &req,
                                  httplib::Response &res);

inline std::string dump_json(const nlohmann::json &j) {
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace fathom::server
