// Scheduler worker: admission, chunked prefill under a token budget batched with the decodes
// (one engine::sync_step per step), sampling, stop strings, cancellation and the counters behind
// /metrics. See scheduler.h for the policy.
#include "sched/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "sched/text_stream.h"

namespace fathom::sched {

using clock = std::chrono::steady_clock;

static double secs(clock::duration d) { return std::chrono::duration<double>(d).count(); }

const char *to_string(finish_reason r) {
    switch (r) {
    case finish_reason::none: return "none";
    case finish_reason::eog: return "eog";
    case finish_reason::stop_string: return "stop_string";
    case finish_reason::length: return "length";
    case finish_reason::cancelled: return "cancelled";
    case finish_reason::error: return "error";
    }
    return "none";
}

// ---------------------------------------------------------------------------------------------
// job channel and histogram
// ---------------------------------------------------------------------------------------------

bool job::next(event &ev, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, timeout, [&] { return !events_.empty(); })) return false;
    ev = std::move(events_.front());
    events_.pop_front();
    return true;
}

void job::post(event ev) {
    {
        std::lock_guard<std::mutex> lk(mu_);
        events_.push_back(std::move(ev));
    }
    cv_.notify_all();
}

histogram::histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size(), 0) {}

void histogram::observe(double v) {
    for (size_t i = 0; i < bounds.size(); ++i)
        if (v <= bounds[i]) ++counts[i];
    sum += v;
    ++count;
}

scheduler_stats::scheduler_stats()
    : ttft_s({0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      token_latency_s({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      disk_load_s({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}),
      disk_save_s({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}) {}

// ---------------------------------------------------------------------------------------------
// slots
// ---------------------------------------------------------------------------------------------

enum class phase { idle, prefill, decode };

struct scheduler::slot {
    int index = 0;
    std::unique_ptr<session> sess;
    std::shared_ptr<job> j;         // null when idle (written by the worker under mu_)
    phase ph = phase::idle;
    uint64_t seq = 0;               // admission order (FIFO among prefills)
    uint64_t last_used = 0;         // seq of the last request served (0 = never)
    size_t prefill_pos = 0;         // prompt tokens the session holds so far
    int64_t n_reused = 0;
    std::unique_ptr<sampler> smp;
    std::vector<int32_t> history;   // prompt + generated (penalties; a decode syncs the session to it)
    std::unique_ptr<text_stream> ts;
    int32_t n_gen = 0;
    int64_t n_drafted = 0, n_accepted = 0;  // speculative decoding, this request
    bool got_first = false;
    double ttft = 0.0;
    clock::time_point t_last;
    int64_t n_tokens_published = 0; // session size as seen by stats() (under mu_)
    int64_t kv_limit = 0;           // positions reserved in the pool for the running request
    // Disk prompt cache: set (by the worker, under mu_) while the I/O thread owns sess, cleared by the
    // I/O thread under mu_ once it is done with it; the worker leaves sess alone meanwhile.
    std::atomic<bool> io_busy{false};
    std::optional<cache::prompt_cache::match> pending_load;  // the entry to load (with io_busy)
    bool prompt_saved = false;  // the running request's prompt was queued for saving (whole-state sessions)
    size_t saved_upto = 0;      // whole-state sessions: the session's size at its last save (save_every)
    // Speculative decoding (scheduler_options::spec): this step's drafts after the pending token.
    std::vector<int32_t> spec_prefix;  // history + drafts: the decode's sync prefix
    std::vector<float> spec_rows;      // [1 + n_drafts, n_vocab] logits of the verification
    size_t n_drafts = 0;               // 0: a plain decode
    std::optional<spec::draft_budget> budget;  // draft lengths (reset per request)
    // Structured output (request::grammar): the constraint, made at the request's first sample; the
    // history tokens it has seen (history[0, gc_fed)); whether it applies yet (grammar_after seen),
    // the text generated before that (searched for grammar_after); the masked logits [n_vocab].
    std::unique_ptr<grammar::token_constraint> gc;
    size_t gc_fed = 0;
    bool gc_live = false;
    std::string gc_tail;
    std::vector<float> masked;
};

// How much of a prompt a slot's session keeps without evaluating it (session::reusable_prefix: the common
// prefix when the session can drop what it holds beyond it, DS4 prefix checkpoints included). A DS4
// state that diverges deeper resets: it reuses nothing, and a disk entry of the prompt's prefix can do
// better.
static size_t reusable_prefix(const session &s, const std::vector<int32_t> &prompt) {
    return static_cast<size_t>(std::max<int64_t>(0, s.reusable_prefix(prompt)));
}

scheduler::scheduler(engine &eng, const scheduler_options &opts) : eng_(eng), opts_(opts) {
    if (opts_.n_slots < 1) throw error("scheduler: --parallel must be >= 1 (got " + std::to_string(opts_.n_slots) + ")");
    if (opts_.max_queue < 0) throw error("scheduler: queue size must be >= 0");
    if (opts_.prefill_chunk < 1) throw error("scheduler: prefill chunk must be >= 1");
    opts_.step_token_budget = std::max(opts_.step_token_budget, 1);
    if (opts_.spec) opts_.spec_ngram.validate();
    step_cost_ = opts_.spec_ngram.cost();
    n_ctx_ = eng_.info().n_ctx;
    if (opts_.kv_block_tokens < 1) throw error("scheduler: KV block size must be >= 1 token");
    if (opts_.kv_blocks < 0) throw error("scheduler: KV block count must be >= 0");
    const int64_t per_slot = (int64_t(n_ctx_) + opts_.kv_block_tokens - 1) / opts_.kv_block_tokens;
    int64_t n_blocks = opts_.kv_blocks > 0 ? opts_.kv_blocks : per_slot * opts_.n_slots;
    // The engine's paged pool takes the geometry before any slot session exists; engines without
    // one get the counting pool. A pool bounded by memory (DS4 on a GPU: the device memory left after
    // the weights) may hold fewer blocks than asked: admission counts what it really holds.
    paged_ = eng_.kv_pool_configure(opts_.kv_block_tokens, n_blocks);
    if (paged_ && eng_.kv_pool().max_blocks > 0) n_blocks = std::min(n_blocks, eng_.kv_pool().max_blocks);
    if (!paged_) pool_ = std::make_unique<kv_block_pool>(n_blocks, opts_.kv_block_tokens, opts_.n_slots);
    kv_n_blocks_ = n_blocks;
    kv_block_tokens_ = opts_.kv_block_tokens;
    for (int i = 0; i < opts_.n_slots; ++i) {
        auto s = std::make_unique<slot>();
        s->index = i;
        s->sess = eng_.new_session();
        slots_.push_back(std::move(s));
    }
    stats_.n_slots = opts_.n_slots;
    stats_.queue_capacity = opts_.max_queue;
    stats_.kv_tokens_capacity = std::min(int64_t(opts_.n_slots) * n_ctx_, n_blocks * opts_.kv_block_tokens);
    stats_.kv_blocks_total = n_blocks;
    stats_.kv_block_tokens = opts_.kv_block_tokens;
    if (!opts_.prompt_cache.dir.empty()) {
        const std::string id = eng_.state_identity();
        if (id.empty())
            throw error(
                "prompt cache: this engine's sessions cannot save their state (the dense families and "
                "DeepSeek V4 on the CPU or one GPU can; not several devices)");
        cache_ = std::make_unique<cache::prompt_cache>(opts_.prompt_cache, id);
        disk_prefix_loads_ = slots_[0]->sess->loads_state_prefix();
        stats_.prompt_cache = true;
        io_ = std::thread([this] { io_loop(); });
    }
    worker_ = std::thread([this] { worker_loop(); });
}

scheduler::~scheduler() { stop(); }

void scheduler::stop() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    {
        std::lock_guard<std::mutex> lk(mu_);
        io_stop_ = true;  // pending saves still run (the I/O thread drains its queue); loads are dropped
    }
    io_cv_.notify_all();
    if (io_.joinable()) io_.join();
}

std::shared_ptr<job> scheduler::submit(request req) {
    if (req.prompt.empty()) throw error("the prompt is empty");
    if (int64_t(req.prompt.size()) >= n_ctx_)
        throw error("the prompt has " + std::to_string(req.prompt.size()) + " tokens but the context holds " +
                    std::to_string(n_ctx_) + " (prompt plus at least one generated token)");
    if (req.max_tokens <= 0) throw error("max_tokens must be > 0 (got " + std::to_string(req.max_tokens) + ")");
    const int32_t n_vocab = eng_.info().n_vocab;
    for (int32_t t : req.prompt)
        if (t < 0 || t >= n_vocab)
            throw error("prompt token " + std::to_string(t) + " outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
    req.sampling.validate();
    // Structured output's token tries are built here, on the first constrained request's thread (a
    // quarter second for a 256K vocabulary), not on the worker, which would stall every running request.
    if (req.grammar) vocab();
    const int64_t pool_tokens = kv_n_blocks_ * kv_block_tokens_;
    if (int64_t(req.prompt.size()) + 1 > pool_tokens) {
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.requests_rejected;
        // never servable, so not a 503 to retry: the server answers 400 naming the limit
        throw error("the prompt has " + std::to_string(req.prompt.size()) + " tokens but the KV pool holds " +
                         std::to_string(pool_tokens) + " (prompt plus at least one generated token)");
    }
    auto j = std::make_shared<job>();
    j->req_ = std::move(req);
    j->t_submit_ = clock::now();
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) throw queue_full("the server is shutting down");
        int64_t idle = 0;
        for (auto &s : slots_) idle += s->j ? 0 : 1;
        if (int64_t(queue_.size()) >= opts_.max_queue + idle) {
            ++stats_.requests_rejected;
            throw queue_full("the server is busy: " + std::to_string(queue_.size()) + " requests are waiting (limit " +
                             std::to_string(opts_.max_queue) + ")");
        }
        j->id_ = next_id_++;
        admit_blocked_ = false;
        ++stats_.requests_submitted;
        stats_.prompt_tokens += j->req_.prompt.size();
        queue_.push_back(j);
    }
    cv_.notify_all();
    return j;
}

scheduler_stats scheduler::stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    scheduler_stats s = stats_;
    s.queue_depth = int64_t(queue_.size());
    s.slots_busy = 0;
    s.kv_tokens_used = 0;
    s.kv_blocks_cached = 0;
    if (cache_) s.disk = cache_->get_stats();
    for (auto &sl : slots_) {
        s.slots_busy += sl->j ? 1 : 0;
        s.kv_tokens_used += sl->n_tokens_published;
        if (!sl->j) s.kv_blocks_cached += kv_held(*sl);
    }
    s.kv_blocks_used = kv_n_blocks_ - kv_free();
    return s;
}

std::vector<slot_info> scheduler::slots() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<slot_info> out;
    for (auto &sl : slots_) out.push_back({sl->index, sl->j != nullptr, sl->n_tokens_published});
    return out;
}

// ---------------------------------------------------------------------------------------------
// worker
// ---------------------------------------------------------------------------------------------

void scheduler::finish_queued(const std::shared_ptr<job> &j, finish_reason r, std::string error) {
    event ev;
    ev.final = true;
    ev.reason = r;
    ev.error = std::move(error);
    ev.n_prompt = int64_t(j->req_.prompt.size());
    ev.total_s = secs(clock::now() - j->t_submit_);
    j->post(std::move(ev));
    ++(r == finish_reason::error ? stats_.requests_failed : stats_.requests_cancelled);
}

void scheduler::admit_locked() {
    admit_blocked_ = false;
    // Drop requests cancelled while waiting.
    for (auto it = queue_.begin(); it != queue_.end();) {
        if ((*it)->cancelled()) {
            finish_queued(*it, finish_reason::cancelled);
            it = queue_.erase(it);
        } else {
            ++it;
        }
    }
    while (!queue_.empty()) {
        auto j = queue_.front();
        // Prefer the idle slot sharing the longest prefix, if that reuses at least half of what the
        // slot holds; otherwise take the least recently used idle slot (empty ones first), so a
        // short accidental match (e.g. the template's opening tokens) does not evict a conversation.
        // A slot whose session is being saved (io_busy) is not available; when it is the best match
        // the request waits for it (its tokens do not change meanwhile: the saver only reads them).
        slot *best = nullptr, *lru = nullptr;
        size_t best_lcp = 0;
        for (auto &s : slots_) {
            if (s->j) continue;
            const size_t held = s->sess->tokens().size();
            const size_t l = reusable_prefix(*s->sess, j->req_.prompt);
            if (l > 0 && 2 * l >= held && l > best_lcp) {
                best = s.get();
                best_lcp = l;
            }
            if (!s->io_busy && (!lru || s->last_used < lru->last_used)) lru = s.get();
        }
        if (!lru || (best && best->io_busy)) break;  // every slot busy, or the best one saving: wait
        // A disk entry that beats the RAM prefix goes into the least recently used slot.
        std::optional<cache::prompt_cache::match> disk;
        if (cache_) disk = disk_candidate_locked(j->req_, best_lcp);
        if (disk) {
            best = lru;
            best_lcp = 0;
        } else if (!best) {
            best = lru;
            best_lcp = reusable_prefix(*best->sess, j->req_.prompt);
        }
        const int64_t need = kv_need_tokens(j->req_);
        if (!kv_make_room_locked(*best, int64_t(best_lcp), need)) {
            if (!j->kv_waited_) ++stats_.kv_waits;  // counted once per request
            j->kv_waited_ = true;
            break;  // not enough KV blocks until running requests end: the head keeps waiting (FIFO)
        }
        // The session keeps at most best_lcp tokens (sync would drop the rest): drop them now and
        // reserve the request's positions (kv_make_room_locked made sure they are free, counting blocks).
        if (!kv_prepare(*best, int64_t(best_lcp), need)) {
            // An engine pool that maps memory at a coarser grain than its blocks (DeepSeek V4 on a GPU: 2 MiB
            // per row array) can refuse what the counts allowed: free every other idle slot's cache and try
            // again; if that fails too and nothing runs (nothing will free memory), the request cannot fit.
            for (auto &o : slots_)
                if (o.get() != best && !o->j && !o->io_busy && kv_held(*o) > 0) {
                    kv_evict(*o);
                    o->n_tokens_published = 0;
                    ++stats_.kv_evictions;
                }
            if (!kv_prepare(*best, int64_t(best_lcp), need)) {
                bool running = false;
                for (auto &o : slots_) running = running || o->j != nullptr;
                if (running) break;  // running requests will give memory back: the head waits (FIFO)
                queue_.pop_front();
                finish_queued(j, finish_reason::error,
                              "the KV memory cannot hold this request's " + std::to_string(need) + " positions");
                continue;
            }
        }
        best->kv_limit = need;
        queue_.pop_front();
        slot &s = *best;
        s.j = j;
        s.ph = phase::prefill;
        s.seq = ++admit_seq_;
        s.last_used = s.seq;
        s.prefill_pos = best_lcp;
        j->prefilled_.store(int64_t(best_lcp));
        const size_t n = j->req_.prompt.size();
        s.n_reused = int64_t(std::min(best_lcp, n - 1));
        s.smp = std::make_unique<sampler>(j->req_.sampling);
        s.history = j->req_.prompt;
        s.ts = std::make_unique<text_stream>(j->req_.stop);
        s.n_gen = 0;
        s.n_drafted = s.n_accepted = 0;
        s.got_first = false;
        s.ttft = 0.0;
        s.prompt_saved = false;
        s.saved_upto = best_lcp;
        s.n_drafts = 0;
        s.budget.reset();  // the first decode drafts up to draft_max
        s.gc.reset();      // structured output: made at the first sample (sample_slot)
        if (disk) {  // the I/O thread loads it; prefill starts once it is done (io_load)
            s.pending_load = std::move(disk);
            s.io_busy = true;
            io_queue_.push_back({&s, true});
            io_cv_.notify_one();
        } else if (cache_ && best_lcp + 1 < n) {
            ++stats_.disk_misses;  // evaluates prompt tokens the disk did not supply
        }
    }
    admit_blocked_ = !queue_.empty();
}

// The disk entry for r's prompt when it leaves the session holding at least min_tokens more prompt
// tokens than the best idle slot's prefix (reading an entry costs time too).
std::optional<cache::prompt_cache::match> scheduler::disk_candidate_locked(const request &r,
                                                                           size_t best_lcp) {
    std::optional<cache::prompt_cache::match> m = cache_->lookup(r.prompt, disk_prefix_loads_);
    if (!m || m->n_keep < int64_t(best_lcp) + cache_->opts().min_tokens) return std::nullopt;
    return m;
}

// Positions a request may occupy: prompt + max_tokens, capped by the context and by the whole pool.
int64_t scheduler::kv_need_tokens(const request &r) const {
    const int64_t want = int64_t(r.prompt.size()) + int64_t(r.max_tokens);
    return std::min({want, int64_t(n_ctx_), kv_n_blocks_ * kv_block_tokens_});
}

// ---- KV accounting: the engine's paged pool through the slot's session, or the counting pool ----

int64_t scheduler::kv_held(const slot &s) const { return paged_ ? s.sess->kv_blocks() : pool_->held(s.index); }

int64_t scheduler::kv_free() const {
    return paged_ ? kv_n_blocks_ - eng_.kv_pool().n_used : pool_->n_free();
}

int64_t scheduler::kv_blocks_for(int64_t tokens) const { return (tokens + kv_block_tokens_ - 1) / kv_block_tokens_; }

bool scheduler::kv_prepare(slot &s, int64_t keep_tokens, int64_t need_tokens) {
    if (!paged_) {
        pool_->shrink(s.index, keep_tokens);
        return pool_->reserve(s.index, need_tokens);
    }
    s.sess->truncate(keep_tokens);  // paged: frees the blocks past the kept prefix
    return s.sess->kv_reserve(need_tokens);
}

void scheduler::kv_settle(slot &s) {
    if (paged_) s.sess->kv_reserve(0);  // shrinking: always succeeds
    else pool_->shrink(s.index, int64_t(s.sess->tokens().size()));
}

void scheduler::kv_evict(slot &s) {
    if (paged_) {
        s.sess->reset();  // its blocks go back to the engine's pool
        return;
    }
    pool_->release(s.index);
    try {
        s.sess = eng_.new_session();  // unmaps the old cache: its memory goes back to the system
    } catch (const std::exception &) {
        s.sess->reset();  // no memory for a fresh one: keep the old session, emptied
    }
}

// Under mu_ (worker). Can slot s, keeping keep_tokens of its cache, grow to need_tokens? Drops the
// caches of other idle slots, least recently used first, until it can; false if even that fails
// (then nothing was dropped).
bool scheduler::kv_make_room_locked(slot &s, int64_t keep_tokens, int64_t need_tokens) {
    const int64_t held_s = kv_held(s);
    const int64_t kept = std::min(held_s, kv_blocks_for(keep_tokens));
    const int64_t extra = kv_blocks_for(need_tokens) - kept;
    const int64_t freed_by_s = held_s - kept;
    int64_t avail = kv_free() + freed_by_s;
    if (avail >= extra) return true;
    std::vector<slot *> idle;
    int64_t evictable = 0;
    for (auto &o : slots_)
        if (o.get() != &s && !o->j && !o->io_busy && kv_held(*o) > 0) {
            idle.push_back(o.get());
            evictable += kv_held(*o);
        }
    if (avail + evictable < extra) return false;
    std::sort(idle.begin(), idle.end(), [](slot *a, slot *b) { return a->last_used < b->last_used; });
    for (slot *o : idle) {
        if (avail >= extra) break;
        avail += kv_held(*o);
        kv_evict(*o);
        o->n_tokens_published = 0;
        ++stats_.kv_evictions;
    }
    return true;
}

// Under mu_: a slot can be evaluated, or the queue head may be admissible.
bool scheduler::has_work_locked() const {
    if (stop_ || (!queue_.empty() && !admit_blocked_)) return true;
    for (auto &s : slots_)
        if (s->j && !s->io_busy) return true;
    return false;
}

// Gives the allocator's free pages back to the system. Requests are parsed, streamed and answered on
// many HTTP threads, each with its own glibc arena; after a burst those arenas hold freed memory the
// process keeps resident. Done once per busy period, after the engine has been idle kTrimAfter, so a
// server that has gone quiet returns to its baseline resident size (tests/server/load_test.py checks).
static void return_free_memory() {
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
}

void scheduler::worker_loop() {
    constexpr auto kTrimAfter = std::chrono::milliseconds(200);
    auto last_step = std::chrono::steady_clock::now();
    bool trimmed = true;  // nothing to give back before the first step
    for (;;) {
        {
            std::unique_lock<std::mutex> lk(mu_);
            // A blocked queue head is retried when a request ends, one is submitted or the I/O thread
            // releases a slot; the timeout also drops jobs cancelled while they wait.
            cv_.wait_for(lk, std::chrono::milliseconds(100), [&] { return has_work_locked(); });
            if (stop_) break;
            admit_locked();
            bool runnable = false;
            for (auto &s : slots_) runnable = runnable || (s->j && !s->io_busy);
            if (!runnable) {
                if (!trimmed && queue_.empty() && std::chrono::steady_clock::now() - last_step >= kTrimAfter) {
                    lk.unlock();
                    return_free_memory();
                    trimmed = true;
                }
                continue;
            }
        }
        last_step = std::chrono::steady_clock::now();
        trimmed = false;
        try {
            run_step();
        } catch (const std::exception &e) {
            // Unexpected failure outside a single job's evaluation: fail every active job.
            for (auto &s : slots_)
                if (s->j && !s->io_busy) finish(*s, finish_reason::error, e.what());
        }
    }
    std::lock_guard<std::mutex> lk(mu_);
    for (auto &j : queue_) finish_queued(j, finish_reason::cancelled);
    queue_.clear();
    for (auto &s : slots_) {
        if (!s->j) continue;
        event ev;
        ev.final = true;
        ev.reason = finish_reason::cancelled;
        s->j->post(std::move(ev));
        s->j.reset();
    }
}

bool scheduler::run_step() {
    std::vector<slot *> dec;
    for (auto &s : slots_) {
        if (!s->j || s->io_busy) continue;  // an I/O task owns the session until it is done
        if (s->j->cancelled()) {
            finish(*s, finish_reason::cancelled);
            continue;
        }
        if (s->ph == phase::decode) dec.push_back(s.get());
    }
    const std::vector<prefill_chunk> chunks = plan_prefill(opts_.step_token_budget - int(dec.size()));
    // Round 0: every decode and every planned slot's first chunk, in one engine step (one forward on
    // the dense CPU engine). A slot granted several chunks (a budget above the chunk size) evaluates
    // its later ones in later rounds, one engine step each.
    int n_rounds = 1;
    for (const prefill_chunk &c : chunks) n_rounds = std::max(n_rounds, c.round + 1);
    for (int r = 0; r < n_rounds; ++r) {
        std::vector<step_entry> es;
        if (r == 0)
            for (slot *s : dec) {
                plan_drafts(*s, int32_t(dec.size()) - 1);
                es.push_back({s, s->history.size(), 0, true});
            }
        for (const prefill_chunk &c : chunks)
            if (c.round == r && c.s->j && c.s->ph == phase::prefill && !c.s->io_busy)
                es.push_back({c.s, c.end, c.cost, false});
        if (!es.empty()) evaluate(es);
    }
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.steps;
    for (auto &s : slots_)
        if (!s->io_busy) s->n_tokens_published = int64_t(s->sess->tokens().size());
    return true;
}

// The prompt chunks of this step, oldest request first: each prefilling slot takes chunks while the
// budget lasts (the oldest always gets one, so prefill never starves). A chunk ends at the next
// multiple of prefill_chunk or at the prompt's end, so a prompt is split the same way whatever else
// runs; round k is the slot's k-th chunk of the step.
std::vector<scheduler::prefill_chunk> scheduler::plan_prefill(int budget) const {
    std::vector<slot *> pre;
    for (auto &s : slots_)
        if (s->j && s->ph == phase::prefill && !s->io_busy) pre.push_back(s.get());
    std::sort(pre.begin(), pre.end(), [](slot *a, slot *b) { return a->seq < b->seq; });
    std::vector<prefill_chunk> plan;
    bool first = true;
    const size_t chunk = size_t(opts_.prefill_chunk);
    for (slot *s : pre) {
        const size_t n = s->j->req_.prompt.size();
        size_t pos = s->prefill_pos;
        for (int round = 0; budget > 0 || first; ++round) {
            first = false;
            size_t end = std::min(n, (pos / chunk + 1) * chunk);
            if (pos >= n) end = n;  // whole prompt held: the step re-derives the last logits
            const size_t cost = std::max<size_t>(end - std::min(pos, end), 1);
            plan.push_back({s, end, cost, round});
            budget -= int(cost);
            pos = end;
            if (end == n) break;
        }
    }
    return plan;
}

// One engine step for the entries: a decode syncs the slot's session to its history (prompt and
// generated tokens: exactly the pending token is new), a chunk to prompt[0, end). If the step fails,
// each entry is tried alone (sync semantics make a repeat of a finished one a no-op), so only a
// request whose own evaluation fails ends with an error. Then decodes and final chunks sample.
void scheduler::evaluate(std::vector<step_entry> &es) {
    std::vector<sync_item> items;
    items.reserve(es.size());
    for (const step_entry &e : es) {
        if (e.decode && e.s->n_drafts > 0) {  // the pending token and the drafts, every row's logits
            items.push_back({e.s->sess.get(), e.s->spec_prefix, true, static_cast<int32_t>(1 + e.s->n_drafts),
                             e.s->spec_rows.data(),
                             // rows sampled where the session holds them (no structured output: it masks host rows)
                             e.s->sess->samples_on_device() && !e.s->j->req_.grammar});
            continue;
        }
        const std::vector<int32_t> &toks = e.decode ? e.s->history : e.s->j->req_.prompt;
        items.push_back({e.s->sess.get(), std::span<const int32_t>(toks.data(), e.end), e.decode || e.end == toks.size()});
    }
    std::vector<bool> failed(es.size(), false);
    // Steps of decodes alone time the verification cost curve (spec::verify_cost, keyed by the step's
    // rows) that the slots' draft widths are chosen from; prompt chunks would blur it.
    int32_t rows = 0;
    bool decodes_only = opts_.spec;
    for (size_t i = 0; i < es.size(); ++i) {
        decodes_only = decodes_only && es[i].decode;
        rows += es[i].decode ? 1 + int32_t(es[i].s->n_drafts) : 0;
    }
    try {
        const auto t0 = clock::now();
        eng_.sync_step(items);
        if (decodes_only) step_cost_.observe(rows, secs(clock::now() - t0));
    } catch (const std::exception &) {
        for (size_t i = 0; i < es.size(); ++i) {
            try {
                eng_.sync_step(std::span<const sync_item>(&items[i], 1));
            } catch (const std::exception &e) {
                failed[i] = true;
                finish(*es[i].s, finish_reason::error, e.what());
            }
        }
    }
    {
        std::lock_guard<std::mutex> lk(mu_);  // counted before any event of the step is posted
        for (size_t i = 0; i < es.size(); ++i)
            if (!failed[i] && !es[i].decode) stats_.prompt_tokens_evaluated += es[i].cost;
    }
    for (size_t i = 0; i < es.size(); ++i) {
        if (failed[i]) continue;
        step_entry &e = es[i];
        if (e.decode) {
            if (e.s->n_drafts > 0) verify_and_emit(*e.s);
            else sample_and_emit(*e.s);
            if (e.s->j) save_periodic(*e.s);
            continue;
        }
        e.s->prefill_pos = e.end;
        e.s->j->prefilled_.store(int64_t(e.end));
        if (e.end != e.s->j->req_.prompt.size()) {
            save_periodic(*e.s);
            continue;
        }
        sample_and_emit(*e.s);
        // Sessions that load only whole states (DS4) could not reuse the prompt + generated entry
        // saved at the end for the same prompt again: save the prompt alone now (the next decode of
        // this slot waits for it). Dense sessions keep a prefix of any entry.
        if (cache_ && !disk_prefix_loads_ && e.s->j && e.s->ph == phase::decode && !e.s->prompt_saved) {
            std::lock_guard<std::mutex> lk(mu_);
            e.s->prompt_saved = true;
            e.s->saved_upto = e.s->sess->tokens().size();
            save_async_locked(*e.s);
        }
    }
}

// Greedy decoding without penalties or logprobs (the common serving case): the sampler would copy
// the logits, normalise the whole distribution (one exp per vocabulary entry, run serially between
// batched steps) for a logprob nobody reads, then take the argmax. Two scans find the same token:
// the maximum of every block of 256 logits (no early exit and no index, so the compiler vectorises
// it), then the first index holding the overall maximum inside the first block that reaches it,
// i.e. the first maximum (the sampler's strict > keeps the lowest id among ties). Returns -1 when
// the sampler must decide instead: a NaN or +inf logit, or nothing but -inf (it reports those).
static int32_t greedy_token(const sampling_params &p, bool want_logprobs, std::span<const float> logits) {
    if (p.temperature != 0.0f || want_logprobs || p.n_logprobs > 0 || p.repeat_penalty != 1.0f ||
        p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f || logits.empty())
        return -1;
    constexpr float inf = std::numeric_limits<float>::infinity();
    constexpr size_t block = 256;
    const float *l = logits.data();
    const size_t n = logits.size();
    float best_v = -inf;
    size_t best_b = 0;
    int special = 0;  // any NaN or +inf
    for (size_t b0 = 0; b0 < n; b0 += block) {
        const size_t b1 = std::min(n, b0 + block);
        float m = -inf;
        int bad = 0;
        for (size_t i = b0; i < b1; ++i) {
            m = l[i] > m ? l[i] : m;
            bad |= !(l[i] < inf);
        }
        special |= bad;
        if (m > best_v) {  // strict: the first block reaching the maximum
            best_v = m;
            best_b = b0;
        }
    }
    if (special || best_v == -inf) return -1;
    for (size_t i = best_b; i < n; ++i)
        if (l[i] == best_v) return static_cast<int32_t>(i);
    return -1;  // unreachable: block best_b holds best_v
}

void scheduler::sample_and_emit(slot &s) {
    sample_result r;
    if (sample_slot(s, {}, s.history, r)) emit(s, std::move(r));
}

// The next token of slot s from `row` (a verification row), from row `held` of a verification the session
// holds (sync_item::rows_on_device: sampled there, session::sample_row; no structured output), or else from
// the session's last logits, with `history` for the penalties. false (the slot finished with the error) when
// sampling throws.
bool scheduler::sample_slot(slot &s, std::span<const float> row, std::span<const int32_t> history, sample_result &r,
                            std::optional<size_t> held) {
    try {
        const sampling_params &p = s.j->req_.sampling;
        const size_t n_prompt = s.j->req_.prompt.size();
        if (history.size() >= n_prompt) {
            if (const int32_t f = s.j->req_.thinking.forced(history.subspan(n_prompt)); f >= 0) {
                r = sample_result{};
                r.token = f;
                return true;
            }
        }
        if (held) {
            r = s.sess->sample_row(*held, *s.smp, history);
            return true;
        }
        if (s.j->req_.grammar) {
            constrain(s, history, row.empty() ? s.sess->logits() : row);
            r.token = greedy_token(p, s.j->req_.want_logprobs, s.masked);
            if (r.token < 0) r = s.smp->sample(s.masked, history);
            // Alternatives the grammar excluded (fewer allowed tokens than top_logprobs) are not reported.
            std::erase_if(r.top, [](const token_logprob &t) { return !std::isfinite(t.logprob); });
            return true;
        }
        if (!row.empty()) {
            r.token = greedy_token(p, s.j->req_.want_logprobs, row);
            if (r.token < 0) r = s.smp->sample(row, history);
            return true;
        }
        // (a session sampling on its device needs no host scan: its summary is as cheap)
        r.token = s.sess->samples_on_device() ? -1 : greedy_token(p, s.j->req_.want_logprobs, s.sess->logits());
        if (r.token < 0) r = s.sess->sample(*s.smp, history);
    } catch (const std::exception &e) {
        finish(s, finish_reason::error, e.what());
        return false;
    }
    return true;
}

// Built once (std::call_once: submitting threads race for it); the worker reads it only for requests
// whose submit() built it first, and the queue's mutex orders the two.
const std::shared_ptr<const grammar::vocab_index> &scheduler::vocab() {
    std::call_once(vocab_once_, [this] {
        vocab_ = std::make_shared<const grammar::vocab_index>(
            eng_.info().n_vocab, [this](int32_t t) { return eng_.token_to_piece(t); },
            [this](int32_t t) { return eng_.is_end_of_generation(t); },
            [this](int32_t t) { return eng_.is_control_token(t); });
    });
    return vocab_;
}

// Structured output for slot s about to sample after `history` from `logits`: brings the constraint
// up to date with the generated tokens it has not seen (history only grows between calls: a
// verification row's history is the slot's plus the drafts kept so far, and rejected drafts never
// enter it), then masks the logits into s.masked: before grammar_after (the thinking) only the
// end-of-generation tokens, since the output must still hold the document. Throws when a token does
// not continue the document (a stop string or a forced token can only end the output, so this is a
// bug) or no token can.
void scheduler::constrain(slot &s, std::span<const int32_t> history, std::span<const float> logits) {
    const request &q = s.j->req_;
    if (!s.gc) {
        s.gc = std::make_unique<grammar::token_constraint>(q.grammar, vocab());
        s.gc_fed = q.prompt.size();
        s.gc_live = q.grammar_after.empty();
        s.gc_tail.clear();
    }
    for (; s.gc_fed < history.size(); ++s.gc_fed) {
        const int32_t t = history[s.gc_fed];
        if (s.gc_live) {
            if (!s.gc->accept(t))
                throw error("structured output: the generated token " + std::to_string(t) + " does not continue the document");
            continue;
        }
        s.gc_tail += eng_.token_to_piece(t);
        const size_t at = s.gc_tail.find(q.grammar_after);
        if (at == std::string::npos) {  // keep what a marker split across tokens needs
            if (s.gc_tail.size() > 2 * q.grammar_after.size()) s.gc_tail.erase(0, s.gc_tail.size() - q.grammar_after.size());
            continue;
        }
        // The document starts after the marker: what the same token holds after it (whitespace dropped)
        // is its first bytes.
        s.gc_live = true;
        std::string rest = s.gc_tail.substr(at + q.grammar_after.size());
        rest.erase(0, std::min(rest.size(), rest.find_first_not_of(" \n\t\r")));
        if (!rest.empty() && !s.gc->accept_bytes(rest))
            throw error("structured output: the text after the end of the thinking does not start the document");
    }
    s.masked.assign(logits.begin(), logits.end());
    if (!s.gc_live) {  // thinking: free text, but it may not end the output before the document
        for (int32_t t : s.gc->vocab().eog_ids())
            if (size_t(t) < s.masked.size()) s.masked[size_t(t)] = -std::numeric_limits<float>::infinity();
        return;
    }
    if (s.gc->apply(s.masked) == 0) throw error("structured output: no token of the vocabulary continues the document");
}

// Drafts for slot s's next decode (its pending token is history.back()): none unless speculation is on
// and the session rolls back. At most draft_max (adapted), and only what can matter: the tokens the
// request may still emit after the pending one, and positions that leave the session below its
// context / KV reservation by one, so emit's room check passes for every kept draft as in plain decoding.
void scheduler::plan_drafts(slot &s, int32_t other_rows) {
    s.n_drafts = 0;
    if (!opts_.spec || !s.sess->rolls_back() || s.j->req_.draft_max == 0) return;
    if (!s.budget) s.budget.emplace(opts_.spec_ngram.draft_max, opts_.spec_ngram.adaptive);
    const int64_t limit = std::min<int64_t>(n_ctx_, s.kv_limit);
    int64_t room = limit - static_cast<int64_t>(s.history.size()) - 1;
    room = std::min<int64_t>(room, int64_t(s.j->req_.max_tokens) - s.n_gen - 1);
    if (room < 1) return;
    room = std::min<int64_t>({room, s.budget->next(&step_cost_, other_rows), s.sess->rollback_limit()});
    if (s.j->req_.draft_max > 0) room = std::min<int64_t>(room, s.j->req_.draft_max);
    if (room < 1) return;
    std::vector<int32_t> d;
    try {
        const auto t0 = clock::now();
        d = opts_.spec_session_drafter ? s.sess->draft(s.history, static_cast<int32_t>(room))
                                       : spec::ngram_draft(s.history, opts_.spec_ngram, static_cast<int32_t>(room));
        step_cost_.observe_draft(static_cast<int32_t>(room), secs(clock::now() - t0));  // the width pays for it
    } catch (const std::exception &e) {
        // A drafter that fails drafts nothing this step: the request decodes plainly (counted).
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.spec_draft_failures;
        return;
    }
    if (d.size() > static_cast<size_t>(room)) d.resize(static_cast<size_t>(room));
    if (opts_.spec_session_drafter && opts_.spec_ngram.adaptive) {  // DSpark: this step's own odds
        const std::vector<float> conf = s.sess->draft_confidence();
        if (!conf.empty())
            d.resize(std::min(d.size(), spec::draft_budget::cut(std::span<const float>(conf).first(std::min(conf.size(), d.size())),
                                                                 &step_cost_, other_rows)));
    }
    if (d.empty()) return;
    s.spec_prefix = s.history;
    s.spec_prefix.insert(s.spec_prefix.end(), d.begin(), d.end());
    s.n_drafts = d.size();
    s.spec_rows.resize((1 + d.size()) * static_cast<size_t>(eng_.info().n_vocab));
}

// After a decode with drafts: sample every position from its own row, in order, as plain decoding would
// (the history grows with each kept token); a draft is kept while it equals its position's sample. The
// session drops the rejected drafts before anything is emitted (emitting may finish the slot and hand
// the session to the prompt cache's I/O thread), then the samples are emitted in order: the kept drafts
// and the first sample that differed (the new pending token), unless the request finishes first.
void scheduler::verify_and_emit(slot &s) {
    const size_t k = s.n_drafts, V = static_cast<size_t>(eng_.info().n_vocab);
    s.n_drafts = 0;
    const size_t base = s.history.size();  // the pending token is history[base - 1], now evaluated
    std::vector<int32_t> hist = s.history;
    std::vector<sample_result> out;  // the samples to emit: the kept drafts, then the step's last sample
    bool failed = false;             // sample_slot finished the request
    const bool on_device = s.sess->verify_rows_held() == k + 1;  // the rows stayed where they were computed
    int32_t last = -1;
    spec::accept_drafts(
        std::span<const int32_t>(s.spec_prefix).subspan(base, k),
        [&](size_t j) -> std::optional<int32_t> {
            sample_result r;
            const bool ok = on_device ? sample_slot(s, {}, hist, r, j)
                                      : sample_slot(s, std::span<const float>(s.spec_rows.data() + j * V, V), hist, r);
            if (!ok) {
                failed = true;
                return std::nullopt;
            }
            out.push_back(std::move(r));
            return out.back().token;
        },
        [&](size_t, int32_t y) {
            if (eng_.is_end_of_generation(y)) return spec::draft_verdict::refuse;  // emitted: it finishes
            hist.push_back(y);
            return spec::draft_verdict::take;
        },
        &last);
    if (failed) return;
    const size_t kept = out.size() - 1;
    try {
        s.sess->truncate(static_cast<int64_t>(base + kept));
    } catch (const std::exception &e) {
        finish(s, finish_reason::error, e.what());
        return;
    }
    if (s.budget) s.budget->update(k, kept);
    s.n_drafted += int64_t(k);
    s.n_accepted += int64_t(kept);
    {
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.spec_steps;
        stats_.spec_drafted += k;
        stats_.spec_accepted += kept;
    }
    for (sample_result &r : out) {
        emit(s, std::move(r));
        if (!s.j || s.ph != phase::decode) break;  // finished
    }
}

void scheduler::emit(slot &s, sample_result r) {
    const auto now = clock::now();
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (!s.got_first) {
            s.ttft = secs(now - s.j->t_submit_);
            stats_.ttft_s.observe(s.ttft);
        } else {
            stats_.token_latency_s.observe(secs(now - s.t_last));
        }
    }
    s.got_first = true;
    s.t_last = now;
    if (eng_.is_end_of_generation(r.token)) {
        finish(s, finish_reason::eog);
        return;
    }
    s.history.push_back(r.token);
    ++s.n_gen;
    {
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.generated_tokens;
    }
    event ev;
    ev.text = s.ts->push(eng_.token_to_piece(r.token));
    token_info ti;
    ti.id = r.token;
    if (s.j->req_.want_logprobs) {
        ti.logprob = r.logprob;
        ti.top = std::move(r.top);
    }
    ev.tokens.push_back(std::move(ti));
    s.j->post(std::move(ev));
    if (s.ts->stopped()) finish(s, finish_reason::stop_string);
    else if (s.n_gen >= s.j->req_.max_tokens) finish(s, finish_reason::length);
    else if (s.sess->n_past() + 1 > std::min<int64_t>(n_ctx_, s.kv_limit))
        finish(s, finish_reason::length);  // no room to evaluate it (context or KV reservation full)
    else
        s.ph = phase::decode;  // history.back() is sampled, not yet evaluated
}

void scheduler::finish(slot &s, finish_reason r, const std::string &err) {
    event ev;
    ev.final = true;
    ev.reason = r;
    if (r == finish_reason::eog || r == finish_reason::length) ev.text = s.ts->flush();
    if (r == finish_reason::stop_string) ev.stop_string = s.ts->matched_stop();
    ev.error = err;
    ev.n_prompt = int64_t(s.j->req_.prompt.size());
    ev.n_reused = s.n_reused;
    ev.n_generated = s.n_gen;
    ev.n_drafted = s.n_drafted;
    ev.n_accepted = s.n_accepted;
    ev.ttft_s = s.ttft;
    ev.total_s = secs(clock::now() - s.j->t_submit_);
    // Speculative decoding: a finish at an earlier sample of a verified step (a stop string) leaves the
    // kept drafts after it evaluated; hold what plain decoding would: history minus its unevaluated last
    // token (end of generation: the EOG token was never pushed, the whole history is evaluated).
    if (opts_.spec && s.ph == phase::decode && r != finish_reason::error && !s.io_busy && s.sess->rolls_back()) {
        const int64_t want = int64_t(s.history.size()) - (r == finish_reason::eog ? 0 : 1);
        try {
            if (want >= 0 && s.sess->n_past() > want) s.sess->truncate(want);
        } catch (const std::exception &) {
            // keeping extra evaluated tokens is harmless (they are real tokens with valid KV)
        }
    }
    s.gc.reset();
    s.masked = {};
    if (!s.spec_rows.empty()) {  // up to (1 + draft_max) x n_vocab floats: not kept by an idle slot
        s.spec_rows = {};
        s.spec_prefix = {};
        s.n_drafts = 0;
    }
    auto j = s.j;
    if (r == finish_reason::error) {
        try {
            s.sess->reset();  // its state is unknown after a failed evaluation
        } catch (...) {
        }
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (r == finish_reason::cancelled) ++stats_.requests_cancelled;
        else if (r == finish_reason::error) ++stats_.requests_failed;
        else ++stats_.requests_finished;
        s.j.reset();
        s.ph = phase::idle;
        s.smp.reset();
        s.n_tokens_published = int64_t(s.sess->tokens().size());
        kv_settle(s);  // keep blocks only for the cached prefix
        s.kv_limit = 0;
        admit_blocked_ = false;
        if (r != finish_reason::error) save_async_locked(s);  // prompt + generated tokens, off the worker
    }
    j->post(std::move(ev));
}

// ---------------------------------------------------------------------------------------------
// disk prompt cache: the I/O thread
// ---------------------------------------------------------------------------------------------

// Whole-state sessions (DS4) with prompt_cache.save_every: an entry each time the running request's
// session grew by that many tokens since its last save (a long prompt's chunks, a long generation).
void scheduler::save_periodic(slot &s) {
    const int64_t every = cache_ ? cache_->opts().save_every : 0;
    if (every <= 0 || disk_prefix_loads_ || s.io_busy) return;
    const size_t held = s.sess->tokens().size();
    if (held < s.saved_upto + size_t(every)) return;
    std::lock_guard<std::mutex> lk(mu_);
    s.saved_upto = held;
    save_async_locked(s);
}

void scheduler::save_async_locked(slot &s) {
    if (!cache_ || s.io_busy || int64_t(s.sess->tokens().size()) < cache_->opts().min_tokens) return;
    s.io_busy = true;  // save() marks an existing entry recently used, or writes a new one
    io_queue_.push_back({&s, false});
    io_cv_.notify_one();
}

void scheduler::io_loop() {
    for (;;) {
        io_task t;
        {
            std::unique_lock<std::mutex> lk(mu_);
            io_cv_.wait(lk, [&] { return io_stop_ || !io_queue_.empty(); });
            if (io_queue_.empty()) return;  // stopping, every save done
            // Loads first: a request's first token waits for its load, only slot reuse for a save.
            auto it =
                std::find_if(io_queue_.begin(), io_queue_.end(), [](const io_task &x) { return x.load; });
            if (it == io_queue_.end()) it = io_queue_.begin();
            t = *it;
            io_queue_.erase(it);
        }
        if (t.load)
            io_load(*t.s);
        else
            io_save(*t.s);
    }
}

void scheduler::io_load(slot &s) {
    const auto t0 = clock::now();
    std::string why;
    bool ok = false;
    bool stopping;
    {
        std::lock_guard<std::mutex> lk(mu_);
        stopping = io_stop_;  // the worker is gone: the job was cancelled
    }
    if (!stopping) {
        // Nothing may escape this thread (std::terminate), and io_busy must be cleared whatever
        // happens, or the slot's request would wait forever; prompt_cache::load throws nothing itself.
        try {
            ok = cache_->load(*s.pending_load, *s.sess, why);
        } catch (const std::exception &e) {
            ok = false;
            why = e.what();
        }
        if (!ok)
            std::fprintf(stderr, "fathom: prompt cache: %s; evaluating the prompt instead\n", why.c_str());
    }
    const double dt = secs(clock::now() - t0);
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (ok) {
            ++stats_.disk_hits;
            stats_.disk_load_s.observe(dt);
            s.prefill_pos = size_t(s.pending_load->n_keep);
            if (s.j) s.j->prefilled_.store(s.pending_load->n_keep);
            s.saved_upto = size_t(s.pending_load->n_keep);  // on disk already
            if (s.j)
                s.n_reused = std::min<int64_t>(s.pending_load->n_keep, int64_t(s.j->req_.prompt.size()) - 1);
        } else {
            ++stats_.disk_misses;
        }
        s.pending_load.reset();
        s.io_busy = false;
        admit_blocked_ = false;
    }
    cv_.notify_all();
}

void scheduler::io_save(slot &s) {
    const auto t0 = clock::now();
    const size_t n_tokens = s.sess->tokens().size();  // s is the worker's again once released
    std::string why;
    cache::prompt_cache::save_result r = cache::prompt_cache::save_result::failed;
    // The slot is released as soon as its state is copied into memory (prompt_cache::save calls this
    // exactly once, on every path): the file's write and fsync no longer hold the slot, so a DS4
    // request's first decode step waits for a memory copy, not for the disk.
    auto release = [&] {
        {
            std::lock_guard<std::mutex> lk(mu_);
            s.io_busy = false;
            admit_blocked_ = false;
        }
        cv_.notify_all();
    };
    try {  // as io_load: nothing escapes (save releases the slot on every path, exceptions included)
        r = cache_->save(*s.sess, why, release);
    } catch (const std::exception &e) {
        why = e.what();
    }
    const double dt = secs(clock::now() - t0);
    if (r == cache::prompt_cache::save_result::failed)
        std::fprintf(stderr, "fathom: prompt cache: saving %zu tokens failed: %s\n", n_tokens, why.c_str());
    if (r == cache::prompt_cache::save_result::saved) {
        std::lock_guard<std::mutex> lk(mu_);
        stats_.disk_save_s.observe(dt);
    }
}

}  // namespace fathom::sched
