// Prometheus text format (version 0.0.4) for /metrics, and SSE framing helpers.
#include <sstream>

#include "server/http_server.h"

namespace fathom::server {

std::string sse_data(const std::string &json_text) { return "data: " + json_text + "\n\n"; }

std::string sse_event(const std::string &name, const std::string &json_text) {
    return "event: " + name + "\ndata: " + json_text + "\n\n";
}

static void metric(std::ostringstream &o, const char *name, const char *type, const char *help, double v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n' << name << ' ' << v << '\n';
}

static void hist(std::ostringstream &o, const char *name, const char *help, const sched::histogram &h) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " histogram\n";
    for (size_t i = 0; i < h.bounds.size(); ++i)
        o << name << "_bucket{le=\"" << h.bounds[i] << "\"} " << h.counts[i] << '\n';
    o << name << "_bucket{le=\"+Inf\"} " << h.count << '\n';
    o << name << "_sum " << h.sum << '\n' << name << "_count " << h.count << '\n';
}

std::string render_metrics(const sched::scheduler_stats &s,
                           const std::vector<std::pair<std::string, uint64_t>> &http_counts) {
    std::ostringstream o;
    o.precision(10);
    metric(o, "fathom_requests_submitted_total", "counter", "Generation requests accepted into the queue.",
           double(s.requests_submitted));
    metric(o, "fathom_requests_finished_total", "counter", "Generation requests that ran to completion.",
           double(s.requests_finished));
    metric(o, "fathom_requests_cancelled_total", "counter", "Generation requests cancelled (client gone).",
           double(s.requests_cancelled));
    metric(o, "fathom_requests_rejected_total", "counter", "Requests refused because the queue was full.",
           double(s.requests_rejected));
    metric(o, "fathom_requests_failed_total", "counter", "Generation requests that failed in the engine.",
           double(s.requests_failed));
    metric(o, "fathom_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", double(s.prompt_tokens));
    metric(o, "fathom_prompt_tokens_evaluated_total", "counter",
           "Prompt tokens actually evaluated (the rest was reused from a slot's session).",
           double(s.prompt_tokens_evaluated));
    metric(o, "fathom_generated_tokens_total", "counter", "Tokens generated.", double(s.generated_tokens));
    metric(o, "fathom_scheduler_steps_total", "counter", "Scheduler steps run.", double(s.steps));
    metric(o, "fathom_spec_steps_total", "counter", "Decode steps that verified drafts (--spec).",
           double(s.spec_steps));
    metric(o, "fathom_spec_draft_failures_total", "counter",
           "Drafter errors (--spec mtp|dspark); that step decoded without drafts.", double(s.spec_draft_failures));
    metric(o, "fathom_spec_drafted_tokens_total", "counter", "Tokens drafted and verified.", double(s.spec_drafted));
    metric(o, "fathom_spec_accepted_tokens_total", "counter", "Drafted tokens kept.", double(s.spec_accepted));
    metric(o, "fathom_queue_depth", "gauge", "Requests waiting for a slot.", double(s.queue_depth));
    metric(o, "fathom_queue_capacity", "gauge", "Waiting requests allowed before 503.", double(s.queue_capacity));
    metric(o, "fathom_slots_busy", "gauge", "Slots serving a request.", double(s.slots_busy));
    metric(o, "fathom_slots_total", "gauge", "Slots (--parallel).", double(s.n_slots));
    metric(o, "fathom_kv_tokens_used", "gauge", "Tokens held in the slots' KV caches.", double(s.kv_tokens_used));
    metric(o, "fathom_kv_tokens_capacity", "gauge", "KV capacity in tokens (slots x context).",
           double(s.kv_tokens_capacity));
    metric(o, "fathom_kv_blocks_total", "gauge", "KV pool blocks.", double(s.kv_blocks_total));
    metric(o, "fathom_kv_blocks_used", "gauge", "KV pool blocks in use (reserved by running requests plus cached).",
           double(s.kv_blocks_used));
    metric(o, "fathom_kv_blocks_cached", "gauge", "KV blocks held by idle slots' cached prefixes (evictable).",
           double(s.kv_blocks_cached));
    metric(o, "fathom_kv_block_tokens", "gauge", "Token positions per KV block.", double(s.kv_block_tokens));
    metric(o, "fathom_kv_evictions_total", "counter", "Idle slot caches dropped to make room in the KV pool.",
           double(s.kv_evictions));
    metric(o, "fathom_kv_admission_waits_total", "counter", "Admissions deferred because the KV pool was full.",
           double(s.kv_waits));
    if (s.prompt_cache) {
        metric(o, "fathom_prompt_cache_disk_hits_total", "counter",
               "Requests whose prompt prefix was loaded from the disk prompt cache.", double(s.disk_hits));
        metric(o, "fathom_prompt_cache_disk_misses_total", "counter",
               "Requests admitted without a usable disk entry (failed loads included).",
               double(s.disk_misses));
        metric(o, "fathom_prompt_cache_disk_rejected_total", "counter",
               "Damaged disk entries found (and deleted).", double(s.disk.rejected));
        metric(o, "fathom_prompt_cache_disk_saves_total", "counter",
               "Entries written to the disk prompt cache.", double(s.disk.saves));
        metric(o, "fathom_prompt_cache_disk_save_failures_total", "counter",
               "Saves that failed (I/O errors).", double(s.disk.save_failures));
        metric(o, "fathom_prompt_cache_disk_evictions_total", "counter",
               "Entries deleted to keep the directory under --prompt-cache-max-gib.",
               double(s.disk.evictions));
        metric(o, "fathom_prompt_cache_disk_bytes", "gauge", "Bytes of the entries in the cache directory.",
               double(s.disk.bytes));
        metric(o, "fathom_prompt_cache_disk_entries", "gauge", "Entries in the cache directory.",
               double(s.disk.entries));
        hist(o, "fathom_prompt_cache_disk_load_seconds", "Time to load a disk entry into a session.",
             s.disk_load_s);
        hist(o, "fathom_prompt_cache_disk_save_seconds", "Time to write a session's state as a disk entry.",
             s.disk_save_s);
    }
    hist(o, "fathom_time_to_first_token_seconds", "Submit to first generated token.", s.ttft_s);
    hist(o, "fathom_token_latency_seconds", "Time between consecutive generated tokens of a request.",
         s.token_latency_s);
    o << "# HELP fathom_http_requests_total HTTP requests by endpoint and status.\n"
         "# TYPE fathom_http_requests_total counter\n";
    for (const auto &[key, n] : http_counts) {
        const size_t sp = key.rfind(' ');
        o << "fathom_http_requests_total{endpoint=\"" << key.substr(0, sp) << "\",status=\"" << key.substr(sp + 1)
          << "\"} " << n << '\n';
    }
    return o.str();
}

std::string render_compression_metrics(const compression_stats &s) {
    std::ostringstream o;
    o.precision(10);
    metric(o, "fathom_prefill_compression_requests_total", "counter", "Prompts compressed by PFlash.",
           double(s.requests));
    metric(o, "fathom_prefill_compression_failures_total", "counter", "PFlash compressions that failed.",
           double(s.failures));
    metric(o, "fathom_prefill_compression_tokens_original_total", "counter",
           "Prompt tokens of compressed prompts, before compression.", double(s.tokens_original));
    metric(o, "fathom_prefill_compression_tokens_effective_total", "counter",
           "Prompt tokens of compressed prompts, after compression.", double(s.tokens_effective));
    metric(o, "fathom_prefill_compression_seconds_total", "counter",
           "Wall time spent compressing (drafter load, scoring, selection).", s.seconds);
    return o.str();
}

std::string render_connection_metrics(const connection_stats &s) {
    std::ostringstream o;
    metric(o, "fathom_http_connections_rejected_total", "counter",
           "Connections closed at accept: the client address held --max-conns-per-client already.",
           double(s.rejected_per_client));
    metric(o, "fathom_http_header_timeouts_total", "counter",
           "Connections closed without a complete request head within --header-timeout.", double(s.header_timeouts));
    metric(o, "fathom_http_body_timeouts_total", "counter",
           "Requests whose body did not arrive within --body-timeout (408).", double(s.body_timeouts));
    return o.str();
}

}  // namespace fathom::server
