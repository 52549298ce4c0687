// Request scheduler: ONE worker thread owns every session of the engine. HTTP (or other) threads
// only validate and submit() a request, then read its events from the returned job's channel.
//
// Slots: n_slots sessions, each serving at most one request. Each worker step evaluates, in ONE
// engine::sync_step (one forward pass on the dense CPU engine),
//   1. one token for every decoding request, and
//   2. a prefill chunk of admitted requests, oldest first, while the step's token budget lasts
//      (the oldest prefilling request always gets at least one chunk, so prefill never starves);
// logits are computed for decodes and final chunks only. A slot granted several chunks in one
// step (a budget larger than the chunk) evaluates its later chunks in further engine steps.
// Prefill chunks end at absolute positions that are multiples of prefill_chunk (or at the prompt's
// end), so a prompt is split the same way whatever else is running; the engine keeps a session's
// result independent of the other sessions in the step (batch invariance).
// Admission: FIFO from a bounded queue; a request takes the idle slot whose session shares the
// longest token prefix with its prompt (session::sync then reuses that prefix) provided that
// prefix is at least half of what the slot holds; otherwise the least recently used idle slot, so
// a short accidental match does not evict another conversation's cache. A session that cannot drop
// what it holds beyond the common prefix (DS4: more than rollback_limit() positions, or any on CUDA)
// reuses nothing there, so such a match counts as none (a disk entry of the prompt's prefix can then be
// loaded instead). When the queue is
// full, submit() throws queue_full. A cancelled request (client gone) stops at the next step and
// frees its slot.
// KV memory: a pool of kv_blocks blocks of kv_block_tokens positions. For the dense engine on the
// CPU this is the engine's own paged pool (engine::kv_pool_configure; the sessions' K/V live in
// its blocks, so the counts below are the real memory); for engines whose sessions own their KV
// (DS4, CUDA, the tests' fake engine) the scheduler keeps a counting pool of the same geometry,
// one block table per slot. Admitting a request reserves the blocks for prompt + max_tokens
// (capped by the context and by the whole pool) for its slot; if the free blocks do not suffice,
// the caches of idle slots are dropped (least recently used first), and if that is still not
// enough the request waits at the head of the queue until running ones end. A request whose
// prompt alone exceeds the pool is refused with fathom::error (400: it could never run). When a request ends, its slot keeps only
// the blocks covering the tokens its session still holds (prefix reuse).
// Disk prompt cache (scheduler_options::prompt_cache, src/cache, docs/prompt-cache.md): at admission,
// when an entry on disk leaves the session holding at least min_tokens more of the prompt than the
// best idle slot, the request takes the least recently used idle slot and an I/O thread loads the
// entry into its session; only the rest of the prompt is evaluated. When a request ends, the I/O
// thread saves what its session holds (prompt + generated tokens); for sessions that load only whole
// states (DS4) it also saves the prompt alone once its prefill is done. While the I/O thread reads or
// writes a slot's session the slot is io_busy: the worker neither evaluates, admits to, evicts nor
// inspects it (a saving slot's decode waits; a request whose best slot is saving waits for it).
// Every idle slot's state is on disk already (saved when its request ended), so an eviction from RAM
// needs no save.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cache/prompt_cache.h"
#include "fathom/engine.h"
#include "fathom/speculative.h"
#include "fathom/sampling.h"
#include "grammar/token_mask.h"
#include "kv/paged_pool.h"

namespace fathom::sched {

// Thrown by submit() when the waiting queue is full (the server answers 503).
class queue_full : public error {
public:
    using error::error;
};

struct request {
    std::vector<int32_t> prompt;        // full token prefix, BOS included
    sampling_params sampling;
    int32_t max_tokens = 256;           // > 0; generation also ends when the context is full
    std::vector<std::string> stop;      // stop strings (excluded from the output)
    bool want_logprobs = false;         // fill token_info::logprob/top (top count from sampling.n_logprobs)
    think_control thinking;             // tokens emitted instead of sampled (thinking open / budget close);
                                        // a forced token reports logprob 0 and no alternatives
    int32_t draft_max = -1;             // speculative decoding for this request: -1 the server's, 0 off,
                                        // 1..64 at most this many drafts per step (never above the server's)
    // Structured output (docs/server.md "Structured output"): null = unconstrained; otherwise every
    // sampled token continues a document of this grammar (the logits of the others are masked, in
    // plain decoding and in each speculative verification row alike) and end of generation is
    // allowed only once the document is complete. grammar_after: text the output must hold first
    // (the end-of-thinking marker when the output opens a thinking block); "" = from the first token.
    std::shared_ptr<const grammar::json_grammar> grammar;
    std::string grammar_after;
};

struct token_info {
    int32_t id = -1;
    float logprob = 0.0f;
    std::vector<token_logprob> top;
};

enum class finish_reason { none, eog, stop_string, length, cancelled, error };
const char *to_string(finish_reason r);

struct event {
    std::string text;                 // newly released text (may be empty)
    std::vector<token_info> tokens;   // the token(s) generated in this event
    bool final = false;               // last event of the job
    // Filled on the final event:
    finish_reason reason = finish_reason::none;
    std::string stop_string;          // the stop string that matched (reason == stop_string)
    std::string error;                // reason == error
    int64_t n_prompt = 0;             // prompt tokens
    int64_t n_reused = 0;             // prompt tokens reused from the slot's session (not evaluated)
    int64_t n_generated = 0;          // sampled tokens, end-of-generation token excluded
    int64_t n_drafted = 0;            // speculative decoding: tokens drafted for this request
    int64_t n_accepted = 0;           // of those, kept
    double ttft_s = 0.0;              // submit -> first token
    double total_s = 0.0;             // submit -> final
};

struct job_runtime;  // worker-side state (scheduler.cpp)

// Shared between the submitting thread and the worker.
class job {
public:
    // Waits up to `timeout` for the next event; false on timeout.
    bool next(event &ev, std::chrono::milliseconds timeout);
    void cancel() { cancelled_.store(true); }
    bool cancelled() const { return cancelled_.load(); }
    // Prompt tokens the job's session holds so far (reused + evaluated; 0 while queued), for progress
    // reports during a long prefill; the prompt's size once the first token is sampled.
    int64_t n_prefilled() const { return prefilled_.load(); }
    uint64_t id() const { return id_; }

private:
    friend class scheduler;
    void post(event ev);
    uint64_t id_ = 0;
    request req_;
    std::chrono::steady_clock::time_point t_submit_;
    std::atomic<bool> cancelled_{false};
    std::atomic<int64_t> prefilled_{0};  // written by the worker (n_prefilled)
    bool kv_waited_ = false;  // worker only: already counted in kv_waits
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<event> events_;
};

// Fixed-bucket histogram (Prometheus semantics: counts[i] = observations <= bounds[i]).
struct histogram {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // cumulative per bound
    double sum = 0.0;
    uint64_t count = 0;
    explicit histogram(std::vector<double> b = {});
    void observe(double v);
};

struct scheduler_stats {
    uint64_t requests_submitted = 0, requests_finished = 0, requests_cancelled = 0;
    uint64_t requests_rejected = 0, requests_failed = 0;
    uint64_t prompt_tokens = 0, prompt_tokens_evaluated = 0, generated_tokens = 0;
    uint64_t steps = 0;
    int64_t queue_depth = 0, queue_capacity = 0;
    int64_t slots_busy = 0, n_slots = 0;
    int64_t kv_tokens_used = 0, kv_tokens_capacity = 0;  // tokens held by the slots' sessions
    int64_t kv_blocks_total = 0, kv_blocks_used = 0;     // pool blocks; used = reserved + cached
    int64_t kv_blocks_cached = 0;                        // held by idle slots' caches (evictable)
    int64_t kv_block_tokens = 0;
    uint64_t kv_evictions = 0;                           // idle caches dropped to make room
    uint64_t kv_waits = 0;                               // admissions deferred for lack of blocks
    histogram ttft_s, token_latency_s;
    uint64_t spec_steps = 0, spec_drafted = 0, spec_accepted = 0;  // speculative decode steps and drafts
    uint64_t spec_draft_failures = 0;  // drafter errors (that step decoded without drafts)
    // Disk prompt cache (when enabled): hits (entries loaded), misses (admissions that evaluate prompt
    // tokens no disk entry supplied, failed loads included; a prompt a RAM slot covers is neither), the
    // directory's figures and the I/O times.
    bool prompt_cache = false;
    uint64_t disk_hits = 0, disk_misses = 0;
    cache::stats disk;
    histogram disk_load_s, disk_save_s;
    scheduler_stats();
};

struct scheduler_options {
    int n_slots = 1;
    int max_queue = 64;            // waiting requests beyond the slots
    int prefill_chunk = 512;       // tokens per prefill chunk
    int step_token_budget = 512;   // tokens per step (decodes count one each)
    int64_t kv_blocks = 0;         // KV pool size in blocks; 0 = every slot can hold a full context
    int kv_block_tokens = 16;      // token positions per block
    cache::options prompt_cache;   // disk prompt cache; dir "" = off (the constructor throws when the
                                   // engine's sessions cannot save states)
    // Speculative decoding for every request on sessions that roll back (include/fathom/speculative.h):
    // a decode step evaluates the pending token and up to draft_max drafts of its slot in one forward
    // and keeps the drafts its own samples confirm. Same tokens. Drafts from n-grams of the slot's
    // history, or (spec_session_drafter) from the session's own drafter (DS4's MTP head or DSpark).
    bool spec = false;
    spec::ngram_options spec_ngram;
    bool spec_session_drafter = false;
};

struct slot_info {
    int index = 0;
    bool busy = false;
    int64_t n_tokens = 0;  // tokens held by the slot's session
};

class scheduler {
public:
    scheduler(engine &eng, const scheduler_options &opts);
    ~scheduler();  // stops the worker; unfinished jobs end with reason cancelled
    scheduler(const scheduler &) = delete;
    scheduler &operator=(const scheduler &) = delete;

    // Validates (prompt non-empty and within the context, max_tokens > 0, sampling valid) and
    // queues. Throws fathom::error on invalid input, queue_full when the queue is full.
    std::shared_ptr<job> submit(request req);

    scheduler_stats stats() const;
    std::vector<slot_info> slots() const;
    int n_ctx() const { return n_ctx_; }
    void stop();

private:
    struct slot;
    struct prefill_chunk {  // slot s evaluates prompt[0, end) this step (cost: new tokens, >= 1)
        slot *s;
        size_t end;
        size_t cost;
        int round;           // the slot's round-th chunk of the step
    };
    struct step_entry {      // one slot's share of an engine step
        slot *s;
        size_t end;          // decode: history.size(); chunk: prompt end
        size_t cost;         // chunk: prompt tokens it evaluates
        bool decode;
    };
    void worker_loop();
    bool has_work_locked() const;
    void admit_locked();
    bool run_step();
    std::vector<prefill_chunk> plan_prefill(int budget) const;
    void evaluate(std::vector<step_entry> &es);
    void sample_and_emit(slot &s);
    bool sample_slot(slot &s, std::span<const float> row, std::span<const int32_t> history, sample_result &r,
                     std::optional<size_t> held = std::nullopt);
    void constrain(slot &s, std::span<const int32_t> history, std::span<const float> logits);
    const std::shared_ptr<const grammar::vocab_index> &vocab();  // built on first use (submit)
    void emit(slot &s, sample_result r);
    // Drafts for s's next decode; other_rows: the step's other decodes (the drafts' price is marginal).
    void plan_drafts(slot &s, int32_t other_rows);
    void verify_and_emit(slot &s);
    void finish(slot &s, finish_reason r, const std::string &err = {});
    // A queued job's final event (cancelled: counted as cancelled; error: as failed, with its message).
    void finish_queued(const std::shared_ptr<job> &j, finish_reason r, std::string error = {});
    int64_t kv_need_tokens(const request &r) const;
    bool kv_make_room_locked(slot &s, int64_t keep_tokens, int64_t need_tokens);
    // KV accounting over the engine's paged pool (paged_) or the counting pool (pool_).
    int64_t kv_held(const slot &s) const;         // blocks in s's table
    int64_t kv_free() const;                      // blocks not in any table
    int64_t kv_blocks_for(int64_t tokens) const;
    bool kv_prepare(slot &s, int64_t keep_tokens, int64_t need_tokens);  // keep a prefix, reserve; all or nothing
    void kv_settle(slot &s);                      // keep only the blocks of the tokens s's session holds
    void kv_evict(slot &s);                       // drop s's cache and all its blocks
    // Disk prompt cache (I/O thread). A task owns its slot's session until it clears the slot's io_busy.
    struct io_task {
        slot *s = nullptr;
        bool load = false;  // load s->pending_load into s's session, else save what it holds
    };
    void io_loop();
    void io_load(slot &s);
    void io_save(slot &s);
    // Under mu_: the disk entry for prompt r when it beats the RAM prefix best_lcp by min_tokens.
    std::optional<cache::prompt_cache::match> disk_candidate_locked(const request &r, size_t best_lcp);
    void save_periodic(slot &s);      // worker: prompt_cache.save_every (whole-state sessions)
    void save_async_locked(slot &s);  // under mu_: queue a save of what s's session holds, if worth it

    engine &eng_;
    scheduler_options opts_;
    spec::verify_cost step_cost_;  // worker: decode steps' cost by row count (speculative widths)
    int n_ctx_ = 0;
    std::vector<std::unique_ptr<slot>> slots_;
    bool paged_ = false;                   // the engine's paged pool is the KV record
    std::unique_ptr<kv_block_pool> pool_;  // counting pool when !paged_; guarded by mu_
    int64_t kv_n_blocks_ = 0;
    int32_t kv_block_tokens_ = 0;
    mutable std::mutex mu_;               // guards queue_, stats_, stop_, slot busy flags
    std::condition_variable cv_;
    std::deque<std::shared_ptr<job>> queue_;
    scheduler_stats stats_;
    bool stop_ = false;
    uint64_t next_id_ = 1;
    uint64_t admit_seq_ = 0;  // worker only
    bool admit_blocked_ = false;  // the queue head waits (slots, KV, a saving slot) until something ends
    std::shared_ptr<const grammar::vocab_index> vocab_;  // structured output's token tries (vocab())
    std::once_flag vocab_once_;
    std::unique_ptr<cache::prompt_cache> cache_;  // null: no disk cache
    bool disk_prefix_loads_ = false;              // the sessions' loads_state_prefix()
    std::deque<io_task> io_queue_;                // guarded by mu_
    std::condition_variable io_cv_;
    bool io_stop_ = false;
    std::thread io_;
    std::thread worker_;
};

}  // namespace fathom::sched
