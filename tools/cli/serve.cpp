// `fathom serve`: loads one model and serves the OpenAI/Anthropic-compatible HTTP API
// (src/server) on top of the request scheduler (src/sched). SIGINT/SIGTERM stop it cleanly.
#include <pthread.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "cli/commands.h"
#include "fathom/pflash.h"
#include "cli/common.h"
#include "server/http_server.h"

namespace fathom::cli {

namespace {

struct serve_args {
    model_args model;
    std::string host = "127.0.0.1";
    int port = 8080;
    std::string api_key;
    int parallel = 1;
    int queue = 64;
    int prefill_chunk = 512;
    size_t max_body = 8u << 20;
    int http_threads = 64;
    double header_timeout = 10;
    double body_timeout = 60;
    int max_conns_per_client = 64;
    std::vector<std::string> allowed_hosts;
    std::vector<std::string> cors_origins;
    bool access_log = false;
    double kv_mem_mib = 0;       // KV pool budget; 0 = every slot can hold a full context
    int kv_block = 16;           // tokens per KV block
    std::vector<std::string> aliases;
    sampling_params sampling;
    // PFlash (docs/pflash.md "Server and daemon").
    std::string prefill_compression = "off";
    int64_t prefill_threshold = 4096;
    double prefill_keep_ratio = 0.2;
    std::string prefill_drafter;           // path or short name; "" = none
    std::string drafter_residency = "auto";
    std::string drafter_device = "cpu";
    // Disk prompt cache (docs/prompt-cache.md).
    std::string prompt_cache_dir;  // "" = off
    double prompt_cache_max_gib = 8;
    int64_t prompt_cache_min_tokens = 32;
    int prompt_cache_zstd = 0;
    int64_t prompt_cache_every = 8192;
    spec_args spec;  // --spec ngram|mtp|dspark: speculative decoding for every request
    std::string reasoning = "auto";  // thinking mode of requests that ask none (docs/server.md "Thinking")
    int64_t reasoning_budget = 0;    // their thinking budget in tokens; 0 = none
    // Responses API store (docs/server.md "Responses API").
    size_t responses_store = 1024;
    double responses_store_mib = 256;
};

chat_thinking parse_reasoning_flag(const std::string &v) {
    if (v == "auto") return chat_thinking::template_default;
    if (v == "on") return chat_thinking::on;
    if (v == "off") return chat_thinking::off;
    if (v == "max") return chat_thinking::max;
    throw error("--reasoning must be auto, on, off or max (got \"" + v + "\")");
}

void serve_main(serve_args &a) {
    resolve_spec_mode(a.spec, a.model);  // --spec auto: before the (slow) load
    if (a.spec.mode == "draft")  // before the (slow) load
        throw error("--spec draft: serve drafts with n-grams or DeepSeek V4's own heads so far (--spec ngram|mtp|dspark); "
                    "draft models work in run and chat");
    if (a.api_key.empty())
        if (const char *k = std::getenv("FATHOM_API_KEY")) a.api_key = k;
    a.sampling.validate();
    const chat_thinking reasoning = parse_reasoning_flag(a.reasoning);  // before the (slow) load
    server::compression_options co;
    co.mode = server::parse_compression_mode(a.prefill_compression, "--prefill-compression");
    co.threshold = a.prefill_threshold;
    co.keep_ratio = a.prefill_keep_ratio;
    co.residency = pflash::parse_residency(a.drafter_residency);
    co.drafter_device = a.drafter_device;
    co.n_threads = a.model.threads;
    if (!a.prefill_drafter.empty()) co.drafter_path = resolve_model_path(a.prefill_drafter, a.model.models_dir);
    co.validate();  // before the (slow) model load: a bad flag fails at once
#if defined(__GLIBC__)
    // Requests are parsed and answered on many HTTP threads (--http-threads); glibc gives threads that
    // contend for the allocator new arenas, up to 8 per core, and each arena keeps its freed memory
    // resident. Four arenas serve that work without the growth: after a 64-client burst the load test
    // (tests/server/load_test.py) measured +33 MiB of resident memory with the default, +7 MiB with 4.
    // Before any thread starts.
    mallopt(M_ARENA_MAX, 4);
#endif
    // Block the stop signals before any thread starts, so only the waiter below receives them.
    sigset_t stop_set;
    sigemptyset(&stop_set);
    sigaddset(&stop_set, SIGINT);
    sigaddset(&stop_set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_set, nullptr);

    // --procs: a rank process that dies ends the server (docs/dist.md): the supervisor stores the line
    // and raises SIGTERM, which the waiter below turns into a stop; serve then exits 1 with the line.
    std::mutex rank_mu;
    std::string rank_failure;
    model_args ma = a.model;
    apply_spec(ma, a.spec);  // --spec mtp|dspark: the drafter loads with the model
    std::unique_ptr<engine> eng = load_engine(ma, [&rank_mu, &rank_failure](const std::string &line) {
        {
            std::lock_guard<std::mutex> lock(rank_mu);
            rank_failure = line;
        }
        ::kill(::getpid(), SIGTERM);
    });
    sched::scheduler_options so;
    so.n_slots = a.parallel;
    so.max_queue = a.queue;
    so.prefill_chunk = a.prefill_chunk;
    so.step_token_budget = a.prefill_chunk;
    so.kv_block_tokens = a.kv_block;
    so.prompt_cache.dir = a.prompt_cache_dir;
    so.prompt_cache.max_bytes = uint64_t(a.prompt_cache_max_gib * 1073741824.0);
    so.prompt_cache.min_tokens = a.prompt_cache_min_tokens;
    so.prompt_cache.zstd_level = a.prompt_cache_zstd;
    so.prompt_cache.save_every = a.prompt_cache_every;
    so.spec = a.spec.enabled();
    so.spec_ngram = a.spec.ngram;
    so.spec_session_drafter = a.spec.mode == "mtp" || a.spec.mode == "dspark";
    if (so.spec && !eng->new_session()->rolls_back()) {
        std::fprintf(stderr, "note: --spec ngram: this model's sessions cannot drop rejected positions (DeepSeek V4 "
                             "rolls back on one device only, not across --devices); serving without speculative decoding\n");
        so.spec = false;
    }
    if (a.kv_mem_mib > 0) {
        const double block_bytes = double(eng->info().kv_bytes_per_token) * a.kv_block;
        if (block_bytes <= 0) throw error("--kv-mem: the model reports no KV size per token");
        so.kv_blocks = int64_t(a.kv_mem_mib * 1048576.0 / block_bytes);
        if (so.kv_blocks < 1) throw error("--kv-mem " + std::to_string(a.kv_mem_mib) + " MiB is less than one KV block");
    }
    sched::scheduler sch(*eng, so);

    server::server_options o;
    o.host = a.host;
    o.port = a.port;
    o.api_key = a.api_key;
    o.max_body_bytes = a.max_body;
    o.http_threads = a.http_threads;
    o.header_timeout_s = a.header_timeout;
    o.body_timeout_s = a.body_timeout;
    o.max_conns_per_client = a.max_conns_per_client;
    o.allowed_hosts = a.allowed_hosts;
    o.cors_origins = a.cors_origins;
    o.access_log = a.access_log;
    o.defaults = a.sampling;
    o.model_ids = a.aliases;
    o.compression = co;
    o.reasoning = reasoning;
    o.responses_max_entries = a.responses_store;
    o.responses_max_bytes = size_t(a.responses_store_mib * 1048576.0);
    o.reasoning_budget = a.reasoning_budget > 0 ? a.reasoning_budget : -1;
    if (o.reasoning_budget > sch.n_ctx())
        throw error("--reasoning-budget " + std::to_string(a.reasoning_budget) + " exceeds the context (" +
                    std::to_string(sch.n_ctx()) + " tokens)");
    if (!a.prompt_cache_dir.empty())  // the replayed tool-call turns beside the cached states
        o.tool_turns_path = (std::filesystem::path(a.prompt_cache_dir) / "tool-turns.log").string();
    server::http_server srv(*eng, sch, o);
    const int port = srv.bind();
    const auto st0 = sch.stats();
    std::fprintf(stderr, "fathom serve: listening on http://%s:%d  model '%s'  ctx %d  parallel %d  kv %lld blocks x %lld%s\n",
                 a.host.c_str(), port, srv.model_ids().front().c_str(), sch.n_ctx(), a.parallel,
                 static_cast<long long>(st0.kv_blocks_total), static_cast<long long>(st0.kv_block_tokens),
                 a.api_key.empty() ? "" : "  (API key required)");
    if (st0.prompt_cache)
        std::fprintf(stderr, "fathom serve: prompt cache %s: %llu entries, %.3f GiB (cap %.3f GiB)\n",
                     a.prompt_cache_dir.c_str(), static_cast<unsigned long long>(st0.disk.entries),
                     double(st0.disk.bytes) / 1073741824.0, a.prompt_cache_max_gib);
    const bool loopback = a.host == "127.0.0.1" || a.host == "localhost" || a.host == "::1";
    if (!loopback && a.api_key.empty())
        std::fprintf(stderr, "fathom serve: warning: listening on %s without --api-key\n", a.host.c_str());
    if (!loopback && a.allowed_hosts.empty())
        std::fprintf(stderr, "fathom serve: note: requests must name this server by IP address or localhost; "
                             "give DNS names with --allowed-host\n");

    std::thread waiter([&] {
        int sig = 0;
        sigwait(&stop_set, &sig);
        srv.stop();
    });
    srv.listen();
    pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter if listen ended on its own
    waiter.join();
    sch.stop();
    std::lock_guard<std::mutex> lock(rank_mu);
    if (!rank_failure.empty()) throw error(rank_failure);  // "error: dist: rank R (pid N) exited: ...", exit 1
    std::fprintf(stderr, "fathom serve: stopped\n");
}

}  // namespace

void add_serve_command(CLI::App &app) {
    auto a = std::make_shared<serve_args>();
    auto *cmd = app.add_subcommand("serve", "Serve the OpenAI- and Anthropic-compatible HTTP API (and a chat page at /)");
    add_model_options(cmd, a->model, /*model_required=*/false);
    set_group(cmd, "Server");
    cmd->add_option("--host", a->host, "Address to listen on (loopback by default)")->capture_default_str();
    cmd->add_option("--port", a->port, "TCP port (0 = any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
    cmd->add_option("--api-key", a->api_key,
                    "Require 'Authorization: Bearer KEY' (or x-api-key) on /v1/*, /metrics, /props "
                    "(default: $FATHOM_API_KEY)");
    add_spec_options(cmd, a->spec);
    cmd->add_option("--parallel,--np", a->parallel, "Requests generated at once (slots, one session each)")
        ->capture_default_str()
        ->check(CLI::Range(1, 256));
    cmd->add_option("--queue", a->queue, "Requests allowed to wait for a slot; beyond that: 503")
        ->capture_default_str()
        ->check(CLI::Range(0, 100000));
    cmd->add_option("--prefill-chunk", a->prefill_chunk, "Prefill chunk and per-step token budget")
        ->capture_default_str()
        ->check(CLI::Range(1, 1 << 20));
    cmd->add_option("--max-body", a->max_body, "Largest request body in bytes (413 beyond)")->capture_default_str();
    cmd->add_option("--http-threads", a->http_threads,
                    "Requests served at once (POSTs; GET, HEAD and OPTIONS have 4 workers of their own, and "
                    "connections waiting for a request hold none)")
        ->capture_default_str()
        ->check(CLI::Range(2, 4096));
    cmd->add_option("--header-timeout", a->header_timeout,
                    "Seconds a client has to send a request's line and headers (from connecting, or from reusing "
                    "a kept-alive connection); then the connection is closed")
        ->capture_default_str()
        ->check(CLI::Range(0.1, 3600.0));
    cmd->add_option("--body-timeout", a->body_timeout,
                    "Seconds a client has to send a request's body once its headers are in (then 408)")
        ->capture_default_str()
        ->check(CLI::Range(0.1, 3600.0));
    cmd->add_option("--max-conns-per-client", a->max_conns_per_client,
                    "Open connections one client address may hold; more are closed at once")
        ->capture_default_str()
        ->check(CLI::Range(1, 100000));
    cmd->add_option("--allowed-host", a->allowed_hosts,
                    "Host header names accepted (repeatable; '*' = any). Default: IP addresses, localhost and "
                    "--host (a page on another name that resolves here is refused: DNS rebinding)");
    cmd->add_option("--cors-origin", a->cors_origins,
                    "Origin allowed to call the API from a browser page (repeatable; '*' = any). Default: none "
                    "(only the server's own chat page)");
    cmd->add_flag("--access-log", a->access_log,
                  "Log one line per request on stderr: client, method, path, status, duration, tokens "
                  "(never prompt text or keys)");
    cmd->add_option("--kv-mem", a->kv_mem_mib,
                    "KV cache budget in MiB, shared by all slots in blocks; requests that do not fit wait "
                    "(default 0: every slot can hold a full context)")
        ->check(CLI::Range(0.0, 1e9));
    cmd->add_option("--kv-block", a->kv_block, "Token positions per KV block")
        ->capture_default_str()
        ->check(CLI::Range(1, 4096));
    cmd->add_option("--alias", a->aliases, "Model id(s) clients use (default: the file name without .gguf)");
    cmd->add_option("--prefill-compression", a->prefill_compression,
                    "PFlash prompt compression: off, auto (prompts of at least --prefill-threshold tokens, or too "
                    "long for the context) or always; requests may override it (docs/pflash.md)")
        ->capture_default_str()
        ->check(CLI::IsMember({"off", "auto", "always"}));
    cmd->add_option("--prefill-threshold", a->prefill_threshold, "PFlash auto mode: smallest prompt compressed (tokens)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
    cmd->add_option("--prefill-keep-ratio", a->prefill_keep_ratio,
                    "PFlash: fraction of prompt chunks kept, finite, in [0, 1]")
        ->capture_default_str();
    cmd->add_option("--prefill-drafter", a->prefill_drafter, "PFlash drafter model (path or short name, e.g. smollm2)");
    cmd->add_option("--drafter-residency", a->drafter_residency,
                    "PFlash: keep | release-after-use | auto (drafter memory after each compression)")
        ->capture_default_str();
    cmd->add_option("--drafter-device", a->drafter_device, "PFlash: where the drafter runs: cpu | cuda | cuda:N")
        ->capture_default_str();
    cmd->add_option(
        "--prompt-cache", a->prompt_cache_dir,
        "Directory of the disk prompt cache: prompts' KV state is saved there when requests end and "
        "loaded for later prompts sharing a prefix, across restarts (docs/prompt-cache.md; the CPU or one GPU)");
    cmd->add_option(
           "--prompt-cache-max-gib", a->prompt_cache_max_gib,
           "Cap on the prompt cache directory's size; least recently used entries are deleted beyond it")
        ->capture_default_str()
        ->check(CLI::Range(1e-6, 1e6));
    cmd->add_option(
           "--prompt-cache-min-tokens", a->prompt_cache_min_tokens,
           "Shortest token sequence saved, and the least gain over a RAM prefix for which an entry is loaded")
        ->capture_default_str()
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
    cmd->add_option(
           "--prompt-cache-every", a->prompt_cache_every,
           "DeepSeek V4: also save an entry every N tokens of a long prompt or generation (a crash or a "
           "regenerate resumes from the longest saved prefix); 0 = only at a prompt's and a request's end")
        ->capture_default_str()
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
    cmd->add_option(
           "--prompt-cache-zstd", a->prompt_cache_zstd,
           "zstd level for the saved KV state (0 = stored raw, the default: see docs/prompt-cache.md)")
        ->capture_default_str()
        ->check(CLI::Range(0, 19));
    cmd->add_option("--reasoning", a->reasoning,
                    "Thinking mode of requests that set neither reasoning_effort nor thinking: auto (the model's "
                    "format decides; DS4: off) | on | off | max (DS4 Think-Max, at >= 384K context)")
        ->capture_default_str();
    cmd->add_option("--reasoning-budget", a->reasoning_budget,
                    "Thinking tokens allowed to requests that give no budget before the end of thinking is forced "
                    "(0 = no limit)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
    cmd->add_option("--responses-store", a->responses_store,
                    "Responses API: finished responses kept for previous_response_id and GET /v1/responses/{id} "
                    "(least recently used evicted first; 0 = keep none)")
        ->capture_default_str()
        ->check(CLI::Range(size_t{0}, size_t{1} << 24));
    cmd->add_option("--responses-store-mib", a->responses_store_mib,
                    "Responses API: bytes of kept responses and their conversations, in MiB")
        ->capture_default_str()
        ->check(CLI::Range(0.0, 1048576.0));
    add_sampling_options(cmd, a->sampling);
    cmd->callback([a]() { serve_main(*a); });
}

}  // namespace fathom::cli
