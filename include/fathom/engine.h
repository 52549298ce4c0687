// Fathom's public engine API. The CLI and the server include only this header (and sampling.h):
// they never see tensors, backends or graph code.
//
//   engine  — loaded weights + tokenizer + chat template; immutable after load, shareable.
//   session — one timeline: KV state, position, logits. Handed the full token prefix, it decides
//             itself what it can reuse (common prefix) and evaluates only the rest.
//
// Every failure throws fathom::error (include/fathom/error.h) with a one-line message.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fathom/chat.h"          // chat_message, chat_thinking
#include "fathom/dist_options.h"
#include "fathom/error.h"
#include "fathom/kv_precision.h"  // kv_precision
#include "fathom/sampling.h"
#include "fathom/state_stream.h"  // state_writer, state_reader

namespace fathom {

struct engine_options {
    std::string model_path;        // GGUF file
    int n_threads = 0;             // 0 = number of online cores
    int n_ctx = 0;                 // 0 = min(model's training context, 8192)
    kv_precision kv = kv_precision::f16;
    bool exact = false;            // reference numerics: dequantised weights x f32 activations, f32 accumulation
    // Quantised numerics (exact = false): true = batch-invariant, every token's result is bit-identical
    // whatever batch it is evaluated in (prefill chunk, single-token decode, prefix-cache reuse, batched
    // serving), so greedy output never depends on cache state. false = mirror llama.cpp's CPU build,
    // whose attention sums differently for one token than for a batch (parity tests use this).
    bool batch_invariant = true;
    // Prefill chunk (tokens evaluated per forward call); 0 = the default: 512, or 4096 for DeepSeek V4
    // on CUDA (its chunks run layer-major on the device; bigger chunks feed every expert more tokens).
    int n_batch = 0;
    // "cpu" | "cuda" | "cuda:N" | "auto". cuda/cuda:N fail with a one-line error when the build has no
    // CUDA backend, no device is present or the weights + KV cache do not fit in free device memory;
    // auto uses cuda:0 when present and the CPU otherwise (model_info::device says which).
    // On CUDA, exact / batch_invariant do not apply (one numerics: f32 decode GEMV, bf16 prefill GEMM).
    std::string device = "cpu";
    bool cuda_graphs = true;       // CUDA: replay single-token decode steps as a captured CUDA graph
    // DeepSeek V4 only: several devices, their layout and rank processes (include/fathom/dist_options.h;
    // docs/dist.md). The default is one device (`device`), in this process.
    dist_options dist;
    // DeepSeek V4 only (ignored by other architectures): simulated quantisation-aware-training
    // round trips, "full" (trained configuration), "fp4only" or "off".
    std::string ds4_qat = "full";
    // DeepSeek V4 on one CPU device: a drafter its sessions keep for speculative decoding
    // (session::draft): "" none; "mtp" the model's MTP head (from ds4_draft_model, or from the model file
    // itself when that is empty); "dspark" a DSpark drafter file (ds4_draft_model). Loaded and checked
    // against the model at load (one-line errors: no MTP tensors, another geometry or vocabulary); other
    // architectures, CUDA and several devices refuse it.
    std::string ds4_draft;
    std::string ds4_draft_model;
    // DeepSeek V4 on one CPU device only (ignored elsewhere): the engine-wide budget, in MiB, of the
    // in-RAM prefix checkpoints of its sessions' states (docs/ds4.md "Prefix checkpoints"): a sync that
    // diverges deeper than the free rollback (ds4::max_rollback) restores the longest checkpoint whose
    // tokens are a prefix of the request and evaluates only the rest. 0 = off. Negative, or more than
    // the machine's physical memory: engine::load throws.
    int64_t ds4_checkpoint_mib = 4096;
    // Called with (done, total) while loading weights; may be empty.
    std::function<void(uint64_t done, uint64_t total)> on_load_progress;
};

struct model_info {
    std::string arch;      // GGUF general.architecture
    std::string name;      // general.name
    std::string path;
    uint64_t file_bytes = 0;
    uint64_t n_params = 0;
    int32_t n_vocab = 0;
    int32_t n_ctx_train = 0;
    int32_t n_ctx = 0;     // context this engine's sessions get
    int32_t n_layer = 0;
    int32_t n_embd = 0;
    uint64_t kv_bytes_per_token = 0;
    std::string chat_template;  // tokenizer.chat_template ("" if none)
    // The model's tool-call markup, as the server writes tools and parses calls (src/chat/tool_format.h):
    // "hermes" (the default: Hermes / Qwen <tool_call>) or "dsml" (DeepSeek V4).
    std::string tool_format = "hermes";
    std::string device = "cpu";   // where the forward runs: "cpu" or "cuda:N (<device name>)"
    uint64_t decode_weight_bytes = 0;  // weight bytes one decode step reads (all matrices, norms, output head; one embedding row)
};

class session;

// ---- batch / scheduler ----------------------------------------------------------------------
// What the server's scheduler (src/sched/scheduler.h), the prompt cache (src/cache) and speculative
// decoding (include/fathom/speculative.h) use to plan and fuse steps over many sessions. A caller that
// runs one session at a time (sync, eval, sample) never needs any of it; every member has a default
// that is correct for any engine and session, which a backend overrides to do better (fused steps,
// paged KV, free rollback). The engine's and session's members of this kind sit in a section of the
// same name in their class.

// The paged KV pool of an engine (dense family on the CPU: one pool per engine, sessions hold block
// tables into it; docs/kv-cache.md). block_tokens == 0: the engine has no pool and each session
// owns its KV memory (DeepSeek V4, the CUDA backend).
struct kv_pool_info {
    int32_t block_tokens = 0;  // token positions per block
    int64_t max_blocks = 0;    // cap (a KV memory budget); 0 = grows with demand
    int64_t n_blocks = 0;      // blocks allocated so far
    int64_t n_used = 0;        // blocks in sessions' tables (held tokens plus reservations)
};

// One session's share of engine::sync_step: the full token prefix it must hold afterwards.
struct sync_item {
    session *sess = nullptr;
    std::span<const int32_t> prefix;  // as session::sync: the common prefix is reused, the rest evaluated
    bool want_logits = true;          // false (an intermediate prompt chunk): logits() may be empty afterwards
    // n_rows > 0 (a speculative step's verification, include/fathom/speculative.h): the last n_rows
    // tokens of the prefix are evaluated afresh and every one's logits written to rows [n_rows, n_vocab];
    // the session first keeps prefix[0, size - n_rows) without re-deriving its logits (sync_with_rows).
    int32_t n_rows = 0;
    float *rows = nullptr;
    // n_rows > 0: the session may keep the rows where it computed them (session::eval_verify) instead of
    // writing `rows`; verify_rows_held() == n_rows afterwards says it did (sample them with sample_row).
    bool rows_on_device = false;
};

// sync_step's handling of an item with n_rows > 0: truncate the session to prefix[0, m) (m = size -
// n_rows) when it holds a longer match, else sync it there, then eval the last n_rows with every row's
// logits. For engines' sync_step overrides.
void sync_with_rows(const sync_item &it);

// ---- engine and session -----------------------------------------------------------------------

class engine {
public:
    static std::unique_ptr<engine> load(const engine_options &opts);
    virtual ~engine() = default;

    virtual const model_info &info() const = 0;

    // Tokenizer. add_special: BOS/EOS as the model's metadata asks. parse_special: special-token text
    // (e.g. "<|im_start|>") becomes the special token; otherwise it is plain text.
    virtual std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const = 0;
    virtual std::string token_to_piece(int32_t token) const = 0;  // raw bytes (may be a partial UTF-8 sequence)
    virtual std::string detokenize(std::span<const int32_t> tokens) const = 0;
    virtual bool is_end_of_generation(int32_t token) const = 0;
    // A token whose text is markup, not output (control, unknown or unused in the vocabulary): never
    // allowed by structured output's token masks (src/grammar/token_mask.h).
    virtual bool is_control_token(int32_t token) const { return false; }
    virtual int32_t bos_token() const = 0;  // -1 if none

    // Render messages with the model's chat template, in the given thinking mode. With thinking the
    // generation prompt of DS4 ends with "<think>"; earlier assistant turns render without reasoning
    // (chat_message carries none), as DS4's format and the thinking templates require.
    virtual std::string apply_chat_template(const std::vector<chat_message> &messages, bool add_generation_prompt,
                                            chat_thinking thinking = chat_thinking::template_default) const = 0;

    virtual std::unique_ptr<session> new_session() = 0;

    // Identity of the states this engine's sessions save (session::save_state): the model file (its
    // size and a hash of its GGUF header and of sampled tensor data) and every option that changes the
    // saved bytes or the logits that follow a load (KV precision, numerics, DS4 QAT). A state loads
    // only into a session of an engine with the same identity. "" when the sessions cannot save states
    // (the default; CUDA, several devices).
    virtual std::string state_identity() const { return {}; }

    // Device memory copy bandwidth in bytes/s (bytes read + written), measured now with device-to-device
    // copies of 1 GiB: the roofline ceiling for decode. 0 when the engine runs on the CPU.
    virtual double measure_copy_bandwidth() { return 0.0; }

    // ---- batch / scheduler (see the section banner above) ----

    // Paged KV. kv_pool(): the pool's state (block_tokens == 0: no pool). kv_pool_configure():
    // set the block size (a power of two >= 8) and the cap in blocks (0 = none); only while no
    // session holds KV blocks (throws otherwise). Returns false, changing nothing, when the
    // engine has no paged pool (the default).
    virtual kv_pool_info kv_pool() const { return {}; }
    virtual bool kv_pool_configure(int32_t block_tokens, int64_t max_blocks);

    // Batched decode step (used by the server's scheduler once per step for all decoding requests):
    // for every i, append tokens[i] to sessions[i] and evaluate it, so that afterwards
    // sessions[i]->logits() are those of tokens[i]. sessions.size() == tokens.size(); the sessions
    // are distinct and were created by this engine. The default runs the sessions one after the
    // other with session::eval; a backend may override it to fuse them into one forward pass, but the
    // logits must not depend on which other sessions share the step (the server's greedy outputs are
    // required to be independent of batch composition).
    virtual void decode_step(std::span<session *const> sessions, std::span<const int32_t> tokens);

    // Batched step over distinct sessions of this engine (the server's scheduler calls it once per
    // step with every running request: decodes, whose prefix is what the session holds plus the new
    // token, and prompt chunks): afterwards items[i].sess holds items[i].prefix exactly as
    // items[i].sess->sync(prefix) would leave it, and its logits() are those of prefix.back() when
    // want_logits. The default runs the items that append one token through decode_step, then
    // sync() of the others in order; the dense engine on the CPU evaluates every missing token of
    // every item in one forward pass, logits only for the last row of items that want them. Like
    // decode_step, a session's result must not depend on the other items (batch invariance). On
    // an error some items may be done and others not; calling sync_step again with the same items
    // (or each alone) completes or reports them (sync semantics make a repeat a no-op).
    virtual void sync_step(std::span<const sync_item> items);
};

class session {
public:
    virtual ~session() = default;
    // Make the session hold exactly `prefix`: keep the longest common prefix with what it holds, drop
    // the rest, evaluate the remainder in chunks. Afterwards logits() are those of prefix.back().
    // on_progress(done, total) is called after each evaluated chunk.
    virtual void sync(std::span<const int32_t> prefix,
                      const std::function<void(int64_t, int64_t)> &on_progress = {}) = 0;
    // Append tokens and evaluate them. If all_logits is non-null it receives [tokens.size() x n_vocab].
    virtual void eval(std::span<const int32_t> tokens, float *all_logits = nullptr) = 0;
    // Logits of the last evaluated token, n_vocab floats.
    virtual std::span<const float> logits() const = 0;
    // The next token chosen by `smp` from the last evaluated token's logits (history: what the
    // penalties look at): exactly smp.sample(logits(), history). The default does that; a session
    // whose logits live on a device summarises them there instead (sampler::sample_top), so the
    // vocabulary never crosses to the host (samples_on_device(), below).
    virtual sample_result sample(sampler &smp, std::span<const int32_t> history) { return smp.sample(logits(), history); }
    virtual int64_t n_past() const = 0;
    virtual const std::vector<int32_t> &tokens() const = 0;
    virtual void reset() = 0;  // holds nothing afterwards (paged KV: every block and the reservation freed)

    // Keep only the first n_keep tokens (no-op when n_keep >= n_past()). logits() afterwards are
    // empty or those of the last kept token (the default goes through sync(), which re-derives
    // them); a later sync() of a longer prefix evaluates only what is missing.
    virtual void truncate(int64_t n_keep);

    // ---- drafting (speculative decoding) ----
    // Sessions with a drafter of their own (DS4 with engine_options::ds4_draft): up to `max` tokens likely
    // to follow `history` = what the session holds, then the pending token (sampled, not yet evaluated).
    // Greedy, deterministic drafts. Throws when history does not extend what the session holds. The
    // default has no drafter and drafts nothing.
    virtual bool has_drafter() const { return false; }
    virtual std::vector<int32_t> draft(std::span<const int32_t> history, int32_t max);
    // A speculative verification (spec::generate): append tokens (the pending token, then the drafts) and
    // evaluate them as eval(tokens, rows) would with every row's logits, row j = the logits after
    // tokens[0..j]. Returns true when `rows` ([tokens.size() x n_vocab], the caller's) received them (the
    // default); false when they stay where the session computed them (DS4 on one GPU: a row's 129,280
    // logits cost more to download than a step's rows cost to verify), so sample_row() samples them.
    virtual bool eval_verify(std::span<const int32_t> tokens, float *rows);
    // After an eval_verify() that returned false, until the next evaluation, truncate or reset: position
    // j's token exactly as smp.sample(row j's logits, history) would give it, RNG draws included (a device
    // summarises the row, sampler::sample_top, and downloads it only when the summary cannot decide).
    // Throws fathom::error for a row that is not held (the default holds none).
    virtual sample_result sample_row(size_t j, sampler &smp, std::span<const int32_t> history);
    // Rows of the last verification the session holds for sample_row (0: none; the default).
    virtual size_t verify_rows_held() const { return 0; }
    // The last draft()'s per-token confidence: each draft's predicted probability of being kept given its
    // predecessors were (DSpark's confidence head; the speculation loop narrows the step by it, spec::
    // draft_budget::cut). Empty when the drafter gives none (MTP) or an evaluation came since.
    virtual std::vector<float> draft_confidence() const { return {}; }

    // ---- saved states (the on-disk prompt cache, docs/prompt-cache.md) ----
    // save_state writes what the session holds: the held token count, the KV state (DS4: raw rings,
    // compressor frontiers, compressed and indexer rows) and the last token's logits, so that a fresh
    // session of an engine with the same state_identity() that load_state()s it continues bit for bit
    // as this one would. Returns false, writing nothing, when the session cannot (the default). The
    // caller keeps the session unchanged (no sync, eval, truncate, reset) while it runs; evaluations of
    // other sessions of the engine may run meanwhile, on other threads.
    virtual bool save_state(state_writer &w) const;
    // load_state replaces what the session holds with a state save_state wrote while its session held
    // exactly `tokens` (the caller stores them; the stream records their count), keeping the first
    // n_keep of them (1 <= n_keep <= tokens.size()); logits() are the saved ones when n_keep ==
    // tokens.size(), else empty (a later sync re-derives them). n_keep < tokens.size() needs
    // loads_state_prefix() (below). Reads the whole stream. Returns false, reading nothing, when the
    // session cannot load states (the default). Throws fathom::error naming the mismatch (another
    // geometry, token count, precision; a malformed stream) and then holds nothing. Paged KV: the
    // positions come from the session's reservation (kv_reserve), or from the pool (throws when it is full).
    virtual bool load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep);

    // ---- batch / scheduler (see the section banner above engine) ----
    // True when sample() picks the token on the device the logits live on (logits() then costs a copy
    // to the host): the scheduler samples such sessions through sample() rather than from logits().
    virtual bool samples_on_device() const { return false; }
    // True when truncate() only forgets positions (no re-evaluation), so a speculative step can drop
    // its rejected drafts for nothing (include/fathom/speculative.h). The dense sessions: true; DS4: on
    // one CPU device (up to rollback_limit() positions), not on CUDA or several devices.
    virtual bool rolls_back() const { return false; }
    // For sessions that roll back: how many of its newest positions truncate() can drop for free right
    // after an evaluation (a speculative step drafts at most this many). Dense: unlimited; DS4 on one CPU
    // device: ds4::max_rollback (16; its state keeps that many positions of history in its rings).
    virtual int64_t rollback_limit() const { return INT64_MAX; }
    // How many leading tokens of `prefix` a sync() to it would keep without evaluating them (the scheduler
    // admits requests to slots and reports cached tokens by it). The default: the common prefix with what
    // the session holds when nothing is held beyond it or the session can drop the rest for free
    // (rolls_back(), at most rollback_limit() positions), else 0. DS4 on the CPU also counts its prefix
    // checkpoints.
    virtual int64_t reusable_prefix(std::span<const int32_t> prefix) const;
    // Paged KV: make the session's block table cover positions [0, max(n_tokens, n_past())) now,
    // so evaluations up to n_tokens positions never run out of blocks; n_tokens below n_past()
    // gives back blocks reserved beyond the held tokens. All or nothing: false, changing nothing,
    // when the pool cannot supply the blocks. Sessions that own their KV memory (no pool) need no
    // reservation: true (the default).
    virtual bool kv_reserve(int64_t n_tokens);
    virtual int64_t kv_blocks() const { return 0; }  // blocks in the session's table (0 without a pool)
    // True when load_state accepts n_keep < tokens.size() (KV stored per position: the dense family);
    // a DS4 state cannot drop positions (see src/engine/ds4_internal.h), so it loads whole or not at all.
    virtual bool loads_state_prefix() const { return false; }
};

}  // namespace fathom
