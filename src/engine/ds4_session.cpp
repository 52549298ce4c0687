// DS4 engine and session (see ds4_session.h). The engine owns the mapped GGUF, the bound weights
// (ds4::model), the thread pool, the tokenizer and the chat template; a session owns one ds4::state
// (raw KV rings, compressor frontiers, compressed and indexer rows) and the token timeline.
//
// Prefix reuse (session::sync) and rollback (session::truncate). A DS4 state keeps only the newest
// positions' raw rows and compressor projections, so it can be taken back only a little: on one CPU
// device its rings are position-indexed with ds4::max_rollback spare positions (deepseek4.h), and
// dropping up to that many of the newest positions is free (ds4::truncate). So the rule is: the state
// is reused when the held tokens are a prefix of the requested ones (only the new tokens are
// evaluated) or diverge from them within the rollback reach (rolled back, then the rest evaluated);
// any deeper divergence restores the longest in-RAM prefix checkpoint of the engine's store
// (ds4_checkpoints.h: snapshots taken at prompt starts / ends and n_batch boundaries, bounded by
// engine_options::ds4_checkpoint_mib) and evaluates the rest, or, without one, resets the state and
// evaluates the whole prefix. Appending turns to a conversation never re-evaluates; a speculative
// step's rejected drafts cost nothing. One GPU rolls back the same way (cuda_sequence::truncate: the
// device rings are position-indexed too) but keeps no checkpoints; on several devices the state is
// append-only (rolls_back() is false, no checkpoints) and any divergence resets it.
//
// Several devices (dist_options::devices, e.g. "cpu,cpu" or "cuda:0,cuda:1"). The engine assigns
// each device a contiguous block range (the placement planner's choice when every device is a CUDA
// device, whose free memory it can read; an even split otherwise) and uploads each CUDA device's
// blocks once. Each *session* owns a dist::local_pipeline: one thread per further device, each rank
// holding the KV state of its blocks only, the HC state handed from rank to rank in host memory.
// Why per session: a DS4 state cannot be swapped out of a pipeline's ranks nor truncated, so one
// engine-wide pipeline shared by sessions would have to re-evaluate a session's whole history at
// every switch. Sessions still take turns under the engine's forward mutex (the CPU ranks share
// the engine's thread pool, which serves one caller at a time), and every chunk asks for logits so
// the pipeline is idle again when forward returns. A pipeline that threw is torn down (its ranks'
// states disagree) and the session starts afresh with a new one.
// In-flight batches: the engine's sync_step / decode_step (the server's scheduler step) submit every
// item that is a one-chunk append on its session's pipeline before collecting any (run_inflight), so
// the stages work on different sequences at once; the other items go through sync / eval afterwards.
// With rank processes the batch runs under one hold of their shared link (rank_procs::with_sessions).
// With dist_options::devices_layout "tp" the session owns a dist::local_tp instead (every device runs
// every block on its share of heads and experts, src/dist/tp.h); the same rules apply.
// With dist_options::rank_procs, ranks 1.. are child processes shared by all sessions
// (dist::rank_procs, spawned at load): a session owns only its rank-0 object (pipeline_rank / tp_rank
// over the engine's socket link) and a session id; each child keeps that session's rank state and
// steps it once per operation (src/dist/rank_procs.h). A failure there is final for the engine (a
// rank process is gone or its states disagree): every later forward throws the same line. Rank 0 hands
// the children its block ranges and n_ctx (start_rank_procs) and uploads only stage 0's CUDA blocks; a
// CUDA rank process uploads its own range once and shares it between its sessions (serve_ds4_rank).
#include "engine/ds4_session.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "backend/cpu/thread_pool.h"
#include "cache/identity.h"
#include "chat/chat_template.h"
#include "chat/ds4_chat.h"
#include "core/error.h"
#include "core/state_io.h"
#include "dist/pipeline.h"
#include "dist/planner.h"
#include "dist/rank_procs.h"
#include "dist/tp.h"
#include "engine/device.h"
#include "engine/ds4_drafter.h"
#include "engine/sync_plan.h"
#include "engine/ds4_checkpoints.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_mtp.h"
#include "tokenizer/tokenizer.h"
#ifdef FATHOM_ENGINE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_sample.h"
#include "backend/cuda/ds4_gemv.h"
#include "models/cuda/deepseek4_cuda.h"
#endif

namespace fathom {

namespace {

ds4::qat_mode parse_qat(const std::string &s) {
    if (s == "full") return ds4::qat_mode::full;
    if (s == "fp4only") return ds4::qat_mode::fp4only;
    if (s == "off") return ds4::qat_mode::off;
    throw error("ds4_qat '" + s + "': expected full, fp4only or off");
}

void check_options(const engine_options &o) {
    if (o.n_threads < 0) throw error("n_threads must be >= 0, got " + std::to_string(o.n_threads));
    if (o.n_ctx < 0) throw error("n_ctx must be >= 0, got " + std::to_string(o.n_ctx));
    if (o.n_batch < 0) throw error("n_batch must be >= 0, got " + std::to_string(o.n_batch));
    if (o.dist.devices_layout != "pipeline" && o.dist.devices_layout != "tp")
        throw error("devices layout '" + o.dist.devices_layout + "': expected pipeline or tp");
    if (o.dist.devices_layout != "pipeline" && o.dist.devices.empty())
        throw error("devices layout '" + o.dist.devices_layout + "' needs several devices (devices, e.g. cpu,cpu)");
    if (o.dist.rank_procs && o.dist.devices.empty())
        throw error("rank processes (--procs) need several devices (devices, e.g. cpu,cpu)");
    if (o.dist.rank_procs && !o.dist.rank_command) throw error("rank processes (--procs): no rank command was given");
    if (o.dist.rank_procs_local < 0)
        throw error("rank_procs_local must be >= 0, got " + std::to_string(o.dist.rank_procs_local));
    ds4_checkpoints::budget_from_mib(o.ds4_checkpoint_mib);  // throws for a negative or absurd budget
}

// Several devices: one session's ranks, a layer pipeline or a tensor-parallel group (one is set), or
// with rank processes this session's rank-0 object (pipe0 or tp0) and its id in the shared processes.
struct device_ranks {
    std::unique_ptr<dist::local_pipeline> pipeline;
    std::unique_ptr<dist::local_tp> tp;
    dist::rank_procs *procs = nullptr;  // the engine's (outlives its sessions)
    uint64_t sid = 0;
    std::unique_ptr<dist::pipeline_rank> pipe0;
    std::unique_ptr<dist::tp_rank> tp0;

    device_ranks() = default;
    device_ranks(const device_ranks &) = delete;
    device_ranks &operator=(const device_ranks &) = delete;
    ~device_ranks() {
        if (procs) procs->free_session(sid);  // the children drop this session's state
    }
    void forward(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> logits) {
        if (procs) {
            // Nothing to send for no tokens (rank 0's forward returns early, so the children must not be
            // told to expect a step).
            if (!toks.empty())
                procs->with_session(
                    sid, [&] { pipe0 ? pipe0->forward(toks, pos, logits) : tp0->forward(toks, pos, logits); },
                    pipe0 ? pipe0->forward_messages(toks.size(), logits.size()) : 1);
        }
        else if (pipeline)
            pipeline->forward(toks, pos, logits);
        else
            tp->forward(toks, pos, logits);
    }
    // Pipeline layout only (ds4_engine::inflight): forward() split in two (local_pipeline::submit, or
    // with rank processes pipeline_rank::begin_forward / finish_forward on rank 0's object). With rank
    // processes both must run inside one procs->with_sessions hold (the caller's), collects in the
    // order of the submits (rank_procs.h): another session's operation between them would take this
    // one's answer. Each half is a nested with_sessions, so that a failure in it (even one on rank 0
    // alone, after the children were told to step this session) fails the group before the caller's
    // cleanup (free_session) or the batch's next session could use the link.
    void submit(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> logits) {
        if (procs && pipe0 && !toks.empty()) {
            if (!procs->held_here()) throw error("dist: in-flight forwards over rank processes need a batch hold");
            procs->with_sessions([&] {
                procs->use(sid, pipe0->forward_messages(toks.size(), logits.size()));
                pipe0->begin_forward(toks, pos, logits);
            });
            return;
        }
        if (!pipeline) throw error("dist: in-flight forwards need a pipeline layout");
        pipeline->submit(toks, pos, logits);
    }
    void collect() {
        if (procs && pipe0) {
            if (!procs->held_here()) throw error("dist: in-flight forwards over rank processes need a batch hold");
            if (pipe0->forward_outstanding()) procs->with_sessions([&] { pipe0->finish_forward(); });
            return;
        }
        if (!pipeline) throw error("dist: in-flight forwards need a pipeline layout");
        pipeline->collect();
    }
    void reset() {
        if (procs)
            procs->with_session(sid, [&] { pipe0 ? pipe0->reset() : tp0->reset(); });
        else if (pipeline)
            pipeline->reset();
        else
            tp->reset();
    }
};

// dist_options::devices ("cpu,cuda:1,...") -> per entry -1 (the CPU) or a CUDA ordinal that
// resolve_cuda_ordinal accepted. Throws one line naming the list and the bad entry.
std::vector<int> parse_device_list(const std::string &list) {
    std::vector<int> out;
    size_t pos = 0;
    for (;;) {
        const size_t comma = list.find(',', pos);
        const std::string d = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        const std::string where = "devices '" + list + "': entry " + std::to_string(out.size() + 1);
        const bool cuda_n = d.size() > 5 && d.size() <= 8 && d.rfind("cuda:", 0) == 0 &&
                            d.find_first_not_of("0123456789", 5) == std::string::npos;
        if (d == "cpu") {
            out.push_back(-1);
        } else if (d == "cuda" || cuda_n) {
            try {
                out.push_back(resolve_cuda_ordinal(d));
            } catch (const std::exception &e) {
                throw error(where + ": " + e.what());
            }
        } else {
            throw error(where + " '" + d + "' is not cpu, cuda or cuda:N (a comma-separated list, no spaces)");
        }
        if (comma == std::string::npos) return out;
        pos = comma + 1;
    }
}

// In-process pipelines: a rank waits at most this long for its neighbour. The driving rank waits
// for a whole chunk through every later rank (minutes for a 512-token chunk of the full model on a
// CPU); a rank that fails wakes its peers at once, so this only bounds a hang.
constexpr std::chrono::milliseconds pipeline_deadline = std::chrono::hours(1);

int online_cores() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// engine_options::n_ctx = 0: the training context (deepseek4.context_length; 0 = unknown), at most 8192.
// One definition for the engine and its rank processes (a CUDA stage's sequence capacity).
int64_t default_n_ctx(int64_t n_ctx_train) {
    return n_ctx_train > 0 ? std::min<int64_t>(n_ctx_train, 8192) : 8192;
}

// Block ranges -> "0-2,3-5" (inclusive block numbers: dist::parse_layer_ranges' format), the
// `--rank-layers` that rank 0 hands its rank processes.
std::string ranges_text(const std::vector<dist::layer_range> &ranges) {
    std::string out;
    for (const dist::layer_range &r : ranges) {
        if (!out.empty()) out += ',';
        out += std::to_string(r.first);
        out += '-';
        out += std::to_string(r.last - 1);
    }
    return out;
}

#ifdef FATHOM_ENGINE_CUDA
// Upload blocks [lr.first, lr.last) of `m` to CUDA device `ordinal` (a pipeline stage's share: the
// embedding comes with block 0, the output head with the last block). `progress` may be empty.
std::shared_ptr<const ds4::cuda_weights> upload_stage(const ds4::model &m, int ordinal, dist::layer_range lr,
                                                      ds4::qat_mode qat, kv_precision kv,
                                                      const std::function<void(uint64_t, uint64_t)> &progress) {
    ds4::cuda_run_options co;
    co.device = ordinal;
    co.qat = qat;
    co.kv = kv;
    co.first_layer = lr.first;
    co.last_layer = lr.last;
    return ds4::cuda_upload(m, co, progress);
}
#endif

// DeepSeek V4 chat format (src/chat/ds4_chat.h, the official encoder), used when the file carries
// no tokenizer.chat_template: chat mode ("</think>" after the Assistant marker) unless thinking is
// on or max (thinking mode: "<think>" after the last Assistant marker, earlier turns' reasoning
// dropped; max adds the Think-Max paragraph). The encoder always ends a conversation whose last
// turn is the user's with the generation prefix; the engine contract makes that depend on add_gen.
std::string render_deepseek(const std::vector<chat_message> &msgs, bool add_gen, chat_thinking thinking) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const auto &m : msgs) j.push_back({{"role", m.role}, {"content", m.content}});
    ds4chat::render_options o;
    o.thinking = thinking == chat_thinking::on || thinking == chat_thinking::max;
    o.think_max = thinking == chat_thinking::max;
    std::string s = ds4chat::render_prompt(j, nlohmann::ordered_json(), o);
    const std::string gp = ds4chat::generation_prefix(o.thinking);
    const bool has = s.size() >= gp.size() && s.compare(s.size() - gp.size(), gp.size(), gp) == 0;
    if (!add_gen && has) s.resize(s.size() - gp.size());
    if (add_gen && !has) s += gp;
    return s;
}

class ds4_engine;

class ds4_session final : public session {
  public:
    explicit ds4_session(ds4_engine &e);
    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) override;
    void eval(std::span<const int32_t> tokens, float *all_logits) override;
    std::span<const float> logits() const override;
    sample_result sample(sampler &smp, std::span<const int32_t> history) override;
    bool samples_on_device() const override { return on_gpu(); }
    int64_t n_past() const override { return static_cast<int64_t>(tokens_.size()); }
    const std::vector<int32_t> &tokens() const override { return tokens_; }
    void reset() override;
    // Rollback (one device, the CPU or a GPU): forgetting up to ds4::max_rollback of the newest positions
    // costs nothing (the state's rings are position-indexed: ds4::truncate, cuda_sequence::truncate);
    // deeper truncations, and sessions on several devices, go through sync (the state is rebuilt from the
    // kept tokens).
    void truncate(int64_t n_keep) override;
    bool rolls_back() const override { return !on_pipeline(); }
    int64_t rollback_limit() const override { return ds4::max_rollback; }
    // The common prefix when it is within the rollback reach (relative to the furthest evaluated
    // position, ds4::rollback_floor), or the longest prefix checkpoint, whichever is longer.
    int64_t reusable_prefix(std::span<const int32_t> prefix) const override;
    // The engine's drafter (engine_options::ds4_draft), one per session, fed by its forwards.
    bool has_drafter() const override { return drafter_ != nullptr; }
    std::vector<int32_t> draft(std::span<const int32_t> history, int32_t max) override;
    std::vector<float> draft_confidence() const override { return draft_conf_; }

  private:
    std::vector<float> draft_conf_;  // the last draft()'s confidence (cleared by every evaluation)

  public:
    // Saved states: one device, the CPU (ds4::state) or one GPU (ds4::cuda_sequence, the same stream
    // from the device); a pipeline's ranks are not saved. A DS4 state cannot drop positions (see the
    // banner), so it loads whole: n_keep == tokens.size().
    bool save_state(state_writer &w) const override;
    bool load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) override;

    // ---- in-flight batches (ds4_engine::run_inflight, pipeline layouts only) ----
    const ds4_engine &owner() const { return e_; }
    // True when eval(toks) would be one pipeline forward that cannot fail its checks: 1..n_batch tokens
    // inside the vocabulary and the context. Anything else takes eval / sync (which report the error).
    bool appends_in_one_forward(std::span<const int32_t> toks) const;
    // eval(toks) in two halves, the caller holding the engine's forward mutex across both:
    // submit_append starts the pipeline forward (last-token logits into logits_) and returns while
    // the later ranks compute; collect_append waits for it and appends toks (which must stay valid;
    // the same span) to the held tokens. A failure in either tears the pipeline down and leaves the
    // session empty, as eval does, and rethrows.
    void submit_append(std::span<const int32_t> toks);
    void collect_append(std::span<const int32_t> toks);

  private:
    friend class ds4_engine;  // the fused CPU step (ds4_engine::run_cpu_step) drives st_ / tokens_ / logits_
    bool on_gpu() const;
    bool on_pipeline() const;
    // The lowest token count truncate() reaches for free (one device; the state's rollback floor).
    int64_t rollback_floor() const;
    // Drop what is held after the first n tokens: a free rollback when the state allows it, else a
    // reset (n = 0 afterwards). Returns the tokens now held.
    size_t drop_after(size_t n);
    // sync: when the longest checkpoint that is a prefix of `prefix` (ds4_checkpoints) is longer than
    // what drop_after(keep) would leave, restore it (true: tokens_ is that prefix now).
    bool restore_checkpoint(std::span<const int32_t> prefix, size_t keep);
    void eval_chunks(std::span<const int32_t> toks, float *all_logits,
                     const std::function<void(int64_t, int64_t)> *on_progress);
    void forward_chunk(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> out);
    // The step extras the drafter reads (empty without one), sized for n rows; and its observe() of the
    // rows [p0, p0 + n) just appended, whose extras are rows [r0, r0 + n) of `x`.
    struct extras_buffers {
        std::vector<float> hc, features;
        ds4::step_extras view(size_t n_rows, const ds4::hparams &hp, std::span<const int> layers);
    };
    void observe(const extras_buffers &x, size_t r0, int64_t p0, size_t n) const;
    ds4_engine &e_;
    std::unique_ptr<ds4_drafter> drafter_;  // engine_options::ds4_draft (one CPU device), else null
    extras_buffers xb_;                     // forward_chunk's extras for the drafter
    ds4::state st_;  // CPU state (empty when the engine runs on CUDA or on several devices)
    // Several devices: this session's ranks (null after a failure until the next forward).
    std::unique_ptr<device_ranks> pl_;
#ifdef FATHOM_ENGINE_CUDA
    std::unique_ptr<ds4::cuda_sequence> gpu_;  // device state when the engine runs on CUDA
#endif
    std::vector<int32_t> tokens_;
    mutable std::vector<float> logits_;  // [n_vocab] of tokens_.back()
    bool have_logits_ = false;
    // CUDA: the last token's logits are still only on the device (logits() downloads them; sample()
    // summarises them there).
    mutable bool logits_on_device_ = false;
};

class ds4_engine final : public engine {
  public:
    ds4_engine(const engine_options &o, std::shared_ptr<const gguf::file> file) : opts_(o), file_(std::move(file)) {
        check_options(o);
        qat_ = parse_qat(o.ds4_qat);
        const int ordinal = resolve_cuda_ordinal(o.device);  // -1: CPU; throws for an unusable forced device
        if (!o.dist.devices.empty() && o.device != "cpu")
            throw error("devices '" + o.dist.devices + "' and device '" + o.device + "': give one or the other");
        if (!o.dist.rank_layers.empty())
            throw error("rank_layers '" + o.dist.rank_layers + "' is for rank processes (fathom rank) only");
        if (!o.ds4_draft.empty() && o.ds4_draft != "mtp" && o.ds4_draft != "dspark")
            throw error("ds4_draft '" + o.ds4_draft + "': expected mtp or dspark");
        if (!o.ds4_draft.empty() && (!o.dist.devices.empty() || ordinal >= 0))
            throw error("--spec " + o.ds4_draft + ": DeepSeek V4 drafts (and rolls back) on one CPU device so far, not "
                        "with --device cuda or --devices");
        if (o.ds4_draft == "dspark" && o.ds4_draft_model.empty())
            throw error("--spec dspark needs --draft-model (a DSpark drafter GGUF for this model)");
        const std::vector<int> stage_ordinals = o.dist.devices.empty() ? std::vector<int>() : parse_device_list(o.dist.devices);
        const bool any_cpu = o.dist.devices.empty() ? ordinal < 0
                                               : std::find(stage_ordinals.begin(), stage_ordinals.end(), -1) !=
                                                     stage_ordinals.end();
        if (o.on_load_progress) o.on_load_progress(0, file_->size());
        model_ = ds4::load_model(file_);
        if (any_cpu && file_->get_int("fathom.synth.replicate_rows", 0) > 0)
            throw error(o.model_path + ": a sparse synthetic file (fathom.synth.replicate_rows) is for CUDA benchmarks "
                        "only: its stored rows are not the model on the CPU; use --device cuda");
        const ds4::hparams &hp = model_->hp;
        n_ctx_train_ = file_->get_int("deepseek4.context_length", 0);
        if (n_ctx_train_ < 0 || n_ctx_train_ > INT32_MAX)
            throw error(file_->path() + ": deepseek4.context_length = " + std::to_string(n_ctx_train_) + " out of range");
        n_ctx_ = o.n_ctx > 0 ? o.n_ctx : default_n_ctx(n_ctx_train_);
        // Default chunk: 512 on the CPU, 4096 on one CUDA device (ds4::default_prefill_chunk).
        const bool on_cuda = o.dist.devices.empty() && o.device != "cpu";
        n_batch_ = std::min<int64_t>(o.n_batch > 0 ? o.n_batch : on_cuda ? 4096 : 512, n_ctx_);
        pool_ = std::make_unique<cpu::thread_pool>(o.n_threads > 0 ? o.n_threads : online_cores());
        exec_.pool = pool_.get();
        exec_.quantised = !o.exact;
        if (file_->has("tokenizer.ggml.model")) {
            tok_ = std::make_unique<tokenizer>(*file_);
            if (tok_->n_vocab() > hp.n_vocab)
                throw error(o.model_path + ": tokenizer has " + std::to_string(tok_->n_vocab()) + " tokens, the model " +
                            std::to_string(hp.n_vocab));
        }
        const std::string_view tmpl = file_->get_string("tokenizer.chat_template", "");
        if (!tmpl.empty()) template_.emplace(std::string(tmpl));
        fill_info();
        if (!stage_ordinals.empty())
            make_pipeline(stage_ordinals);
        else if (ordinal >= 0)
            make_cuda(ordinal);
        if (!o.ds4_draft.empty()) load_drafter();
        if (on_one_cpu() && o.ds4_checkpoint_mib > 0)
            ckpt_ = std::make_unique<ds4_checkpoints>(ds4_checkpoints::budget_from_mib(o.ds4_checkpoint_mib),
                                                      n_batch_);
        if (o.on_load_progress) o.on_load_progress(file_->size(), file_->size());
    }

    const model_info &info() const override { return info_; }

    std::vector<int32_t> tokenize(std::string_view text, bool add_special, bool parse_special) const override {
        return tok().encode(text, add_special, parse_special);
    }
    std::string token_to_piece(int32_t token) const override { return tok().token_to_piece(token); }
    std::string detokenize(std::span<const int32_t> tokens) const override { return tok().decode(tokens); }
    bool is_end_of_generation(int32_t token) const override { return tok_ && tok_->is_eog(token); }
    bool is_control_token(int32_t token) const override {
        if (!tok_) return false;
        const token_type t = tok_->type(token);
        return t == token_type::control || t == token_type::unknown || t == token_type::unused;
    }
    int32_t bos_token() const override { return tok_ ? tok_->bos() : -1; }

    std::string apply_chat_template(const std::vector<chat_message> &messages, bool add_gen,
                                    chat_thinking thinking = chat_thinking::template_default) const override {
        if (!template_) return render_deepseek(messages, add_gen, thinking);
        chat_template_inputs in;
        for (const auto &m : messages) in.messages.push_back({{"role", m.role}, {"content", m.content}});
        in.add_generation_prompt = add_gen;
        set_thinking_vars(in, thinking);
        if (tok_ && tok_->bos() != token_null) in.bos_token = tok_->token_to_piece(tok_->bos());
        if (tok_ && tok_->eos() != token_null) in.eos_token = tok_->token_to_piece(tok_->eos());
        return template_->render(in);
    }

    std::unique_ptr<session> new_session() override { return std::make_unique<ds4_session>(*this); }

    // One device: the CPU (sessions' states in ds4::state) or one GPU (a ds4::cuda_sequence each);
    // not a pipeline. qat and kv change the saved rows; the backend and its numerics options everything
    // after a load (a CUDA state continues bit for bit only on CUDA, with the same indexer scoring).
    std::string state_identity() const override {
        if (pipelined()) return {};
        std::string backend;
#ifdef FATHOM_ENGINE_CUDA
        // the GPU's name too: the kernels' launch geometry (and so a few sums' order) follows its SM count
        if (gpu_)
            backend = std::string(" backend=cuda gpu=\"") + gpu_name_ + "\" indexer=" + (opts_.exact ? "exact" : "tensor-core");
#endif
        if (backend.empty() && ordinal_ >= 0) return {};
        if (backend.empty()) backend = std::string(" numerics=") + (opts_.exact ? "exact" : "quantised");
        std::call_once(identity_once_, [&] { file_identity_ = cache::file_fingerprint(*file_); });
        return "deepseek4 file=" + file_identity_ + " kv=" + (opts_.kv == kv_precision::f32 ? "f32" : "f16") +
               " qat=" + opts_.ds4_qat + backend;
    }

    // ---- for sessions ----
    const ds4::model &model() const { return *model_; }
    // A session's drafter (null without engine_options::ds4_draft).
    std::unique_ptr<ds4_drafter> new_drafter() const {
        if (mtp_) return make_mtp_drafter(*model_, mtp_, qat_, opts_.kv, exec_);
        if (dspark_) return make_dspark_drafter(*model_, dspark_, qat_, exec_);
        return nullptr;
    }
    bool drafts() const { return mtp_ || dspark_; }
    ds4::state fresh_state() const {
        ds4::state st = ds4::new_state(*model_, qat_, opts_.kv);
        st.exec = exec_;
        return st;
    }
    std::mutex &forward_mutex() { return forward_mutex_; }
    // Several devices: a fresh pipeline (its ranks' threads, KV states and CUDA sequences).
    bool pipelined() const { return !ranges_.empty() || tp_size_ > 0; }
    std::unique_ptr<device_ranks> new_pipeline() const {
        auto r = std::make_unique<device_ranks>();
        if (procs_) {
            // Only rank 0's share lives here; the children create theirs on the session's first use.
            r->procs = procs_.get();
            r->sid = procs_->new_session_id();
            if (tp_size_ > 0)
                r->tp0 = std::make_unique<dist::tp_rank>(*model_, procs_->link(), qat_, opts_.kv, exec_);
            else {
                r->pipe0 = std::make_unique<dist::pipeline_rank>(*model_, ranges_, procs_->link(), qat_, opts_.kv,
                                                                 exec_, stages_[0]);
                r->pipe0->set_micro_batch(opts_.dist.micro_batch);
            }
        } else if (tp_size_ > 0)
            r->tp = std::make_unique<dist::local_tp>(*model_, tp_size_, qat_, opts_.kv, exec_, pipeline_deadline);
        else {
            r->pipeline = std::make_unique<dist::local_pipeline>(*model_, ranges_, qat_, opts_.kv, exec_, stages_,
                                                                 pipeline_deadline);
            r->pipeline->set_micro_batch(opts_.dist.micro_batch);
        }
        return r;
    }
#ifdef FATHOM_ENGINE_CUDA
    // Device weights (null on the CPU) and a fresh device sequence of n_ctx tokens.
    const std::shared_ptr<const ds4::cuda_weights> &gpu() const { return gpu_; }
    // The sequences share one prefill scratch (gpu_prefill_): evaluations run under the forward mutex.
    std::unique_ptr<ds4::cuda_sequence> new_gpu_sequence() const {
        return std::make_unique<ds4::cuda_sequence>(gpu_, n_ctx_, opts_.cuda_graphs, n_batch_, gpu_prefill_);
    }
#endif
    double measure_copy_bandwidth() override {
#ifdef FATHOM_ENGINE_CUDA
        if (ordinal_ >= 0) {
            std::lock_guard<std::mutex> lock(forward_mutex_);
            return cuda_measure_copy_bandwidth(ordinal_);
        }
#endif
        return 0.0;
    }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_batch() const { return n_batch_; }
    // In-RAM prefix checkpoints (one CPU device, ds4_checkpoint_mib > 0; else null).
    ds4_checkpoints *checkpoints() const { return ckpt_.get(); }

    // Pipelines (in-process ranks or rank processes): the one-forward appends of a step are kept in
    // flight together (run_inflight), then the other items run through session::sync / eval. Every
    // other engine kind (one device, tp) takes engine::decode_step / engine::sync_step's defaults.
    void decode_step(std::span<session *const> sessions, std::span<const int32_t> tokens) override;
    void sync_step(std::span<const sync_item> items) override;

  private:
    // Several devices in the pipeline layout, as threads or as rank processes; not tp (its ranks
    // all-reduce inside every block, so a rank cannot run ahead on another sequence). Rank processes:
    // the batch runs under one hold of the shared link (rank_procs::with_sessions), see run_inflight.
    bool inflight() const { return !ranges_.empty() && tp_size_ == 0; }
    // One CPU device: the sessions' states are ds4::state, and a step's items run as the rows of one
    // ds4::step (run_cpu_step).
    bool on_one_cpu() const { return !pipelined() && !on_cuda_; }
    // sync_step on one CPU device: every item's missing tokens (rolled back first where the item diverges
    // within the rollback reach) as the rows of one multi-row forward, pieces of at most n_batch tokens
    // per item and n_batch + items rows per forward; items whose divergence is deeper go through sync.
    void run_cpu_step(std::span<const sync_item> items);
    struct cpu_work {
        ds4_session *s = nullptr;
        std::span<const int32_t> rest;  // still to evaluate
        bool want_logits = true;
        int32_t n_rows = 0;
        float *rows = nullptr;
        size_t total = 0;  // tokens to evaluate at the start (run_cpu_pieces)
    };
    std::vector<cpu_work> plan_cpu_step(std::span<const sync_item> items, std::vector<size_t> &alone);
    void run_cpu_pieces(std::vector<cpu_work> &work);
    // One session's share of an in-flight batch: `toks` appended in one pipeline forward.
    struct append_work {
        ds4_session *s = nullptr;
        std::span<const int32_t> toks;
    };
    ds4_session &step_session(session *p, size_t i, const char *what,
                              std::vector<const session *> &seen) const;
    void run_inflight(const std::vector<append_work> &work);
    // One GPU (sync_step / decode_step): the items that append one token (decodes) or a verification's
    // rows (n_rows > 0, after a free rollback to prefix[0, size - n_rows)) run as the rows of multi-row
    // steps of up to 16 rows (cuda_sequence::step_batch), each row bit-identical to its own decode step;
    // everything else (prompt chunks, deep divergences, a full context, a bad token) goes through
    // session::sync / sync_with_rows afterwards, which report what they refuse.
    void run_gpu_step(std::span<const sync_item> items);

    const tokenizer &tok() const {
        if (!tok_) throw error(opts_.model_path + ": the file has no tokenizer (tokenizer.ggml.model)");
        return *tok_;
    }

    // engine_options::ds4_draft (checked in the constructor): the MTP head from ds4_draft_model or the
    // model file itself, or a DSpark drafter; each validated against the model.
    void load_drafter() {
        const std::string &path = opts_.ds4_draft_model;
        if (opts_.ds4_draft == "mtp") {
            try {
                mtp_ = path.empty() ? ds4::load_mtp(*model_, file_) : ds4::load_mtp(*model_, path);
            } catch (const std::exception &e) {
                throw error("--spec mtp: " + (path.empty() ? opts_.model_path : path) + ": no usable MTP head (" +
                            e.what() + ")" + (path.empty() ? "; give the MTP file with --draft-model" : ""));
            }
        } else {
            dspark_ = ds4::load_dspark(*model_, path);
        }
    }

    // Upload the weights to CUDA device `ordinal` (memory checked before any allocation).
    void make_cuda(int ordinal) {
#ifdef FATHOM_ENGINE_CUDA
        ds4::cuda_run_options co;
        co.device = ordinal;
        co.qat = qat_;
        co.kv = opts_.kv;
        const size_t seq = ds4::cuda_sequence_bytes(model_->hp, opts_.kv, n_ctx_, n_batch_);
        const cuda_device_memory mem = cuda_query_memory(ordinal);
        if (seq + file_->size() > mem.free_bytes)
            throw error("device 'cuda:" + std::to_string(ordinal) + "' (" + mem.name + "): the weights (" +
                        std::to_string(file_->size() >> 20) + " MiB) and one " + std::to_string(n_ctx_) +
                        "-token context (" + std::to_string(seq >> 20) + " MiB) exceed its " +
                        std::to_string(mem.free_bytes >> 20) + " MiB free; lower --ctx or use more devices");
        gpu_ = ds4::cuda_upload(*model_, co, [&](uint64_t done, uint64_t total) {
            if (opts_.on_load_progress && total) opts_.on_load_progress(done * file_->size() / total, file_->size());
        });
        ordinal_ = ordinal;
        on_cuda_ = true;
        info_.device = "cuda:" + std::to_string(ordinal) + " (" + mem.name + ")";
        gpu_name_ = mem.name;
        info_.decode_weight_bytes = static_cast<uint64_t>(ds4::cuda_bytes_per_token(*gpu_));
#else
        (void)ordinal;
#endif
    }

    // dist_options::devices: one block range per device (the planner's when every device is a CUDA
    // device, else an even split), each CUDA device's blocks uploaded once, info().device naming the
    // layout ("pipeline: cpu blocks 0-2 | cuda:0 (NVIDIA H200) blocks 3-5"). With rank processes only
    // stage 0 lives in this process: the later stages' CUDA blocks are uploaded by their rank processes
    // (which get these ranges from start_rank_procs), so their stages_ entries stay without weights.
    void make_pipeline(const std::vector<int> &ordinals) {
        if (opts_.dist.devices_layout == "tp") {
            make_tp(ordinals);
            return;
        }
        const int P = static_cast<int>(ordinals.size()), L = model_->hp.n_layer;
        if (P > L)
            throw error("devices '" + opts_.dist.devices + "': " + std::to_string(P) + " devices for a model of " +
                        std::to_string(L) + " blocks (each device needs at least one block)");
        const bool all_cuda = std::find(ordinals.begin(), ordinals.end(), -1) == ordinals.end();
        ranges_ = all_cuda ? planned_ranges(ordinals) : dist::even_ranges(L, P);
        stages_.assign(static_cast<size_t>(P), {});
        std::string layout = "pipeline:";
        double step_bytes = 0;
        for (int r = 0; r < P; ++r) {
            dist::stage_device &st = stages_[static_cast<size_t>(r)];
            const dist::layer_range &lr = ranges_[static_cast<size_t>(r)];
            st.cuda_device = ordinals[static_cast<size_t>(r)];
            st.n_ctx = n_ctx_;
            st.cuda_graphs = opts_.cuda_graphs;
            std::string name = "cpu";
            if (st.cuda_device >= 0) {
#ifdef FATHOM_ENGINE_CUDA
                if (!opts_.dist.rank_procs || r == 0) {
                    const double fsz = static_cast<double>(file_->size());
                    st.weights = upload_stage(*model_, st.cuda_device, lr, qat_, opts_.kv,
                                              [&](uint64_t done, uint64_t total) {
                        if (!opts_.on_load_progress || total == 0) return;
                        const double part = (r + static_cast<double>(done) / static_cast<double>(total)) / P;
                        opts_.on_load_progress(static_cast<uint64_t>(part * fsz), file_->size());
                    });
                    step_bytes += ds4::cuda_bytes_per_token(*st.weights);
                }
                name = "cuda:" + std::to_string(st.cuda_device) + " (" + cuda_query_memory(st.cuda_device).name + ")";
#endif
            }
            layout += std::string(r ? " |" : "") + " " + name + " blocks " + std::to_string(lr.first) + "-" +
                      std::to_string(lr.last - 1);
        }
        info_.device = layout;
        if (all_cuda) {
            // With rank processes the later stages' weights are not here: the bytes stay unknown (0).
            if (!opts_.dist.rank_procs) info_.decode_weight_bytes = static_cast<uint64_t>(step_bytes);
            ordinal_ = ordinals[0];  // measure_copy_bandwidth: the first stage's device
        }
        if (opts_.dist.rank_procs) start_rank_procs(P);
    }

    // dist_options::rank_procs: spawn and join ranks 1..P-1 (rank_command), or wait for those started
    // by hand; info().device gains their pids. Each rank's argv gets what only this engine knows and the
    // rank must share: the pipeline's block ranges (`--rank-layers`; the planner's choice reads this
    // process's free device memory, which a rank process would see differently) and the context
    // (`--ctx`: a CUDA stage's sequence capacity). The printed commands (ranks started by hand) too.
    void start_rank_procs(int P) {
        const std::string layers = ranges_text(ranges_);  // "" for tp (every rank runs every block)
        const auto command = [base = opts_.dist.rank_command, layers, n_ctx = n_ctx_](int r, int world,
                                                                                const std::string &id) {
            std::vector<std::string> v = base(r, world, id);
            if (!layers.empty()) v.insert(v.end(), {"--rank-layers", layers});
            v.insert(v.end(), {"--ctx", std::to_string(n_ctx)});
            return v;
        };
        dist::rank_procs_options po;
        po.host = opts_.dist.rank_procs_host;
        po.command = [command, P](int r, const std::string &id) { return command(r, P, id); };
        po.spawn = opts_.dist.rank_procs_local > 0 ? opts_.dist.rank_procs_local : -1;
        const int spawn = std::min(po.spawn < 0 ? P : po.spawn, P);
        po.on_listening = [&](const std::string &id) {
            for (int r = std::max(spawn, 1); r < P; ++r) {  // ranks started by hand (another host)
                std::string line;
                for (const auto &a : command(r, P, id)) line += (line.empty() ? "" : " ") + a;
                std::fprintf(stderr, "dist: waiting for rank %d: start it with: %s\n", r, line.c_str());
            }
        };
        po.on_failure = opts_.dist.on_rank_failure;
        procs_ = std::make_unique<dist::rank_procs>(P, po);
        std::string pids;
        const std::vector<long> v = procs_->pids();
        for (size_t i = 0; i < v.size(); ++i)
            pids += (i ? ", " : " ") + std::string("rank ") + std::to_string(i + 1) +
                    (v[i] ? " pid " + std::to_string(v[i]) : std::string(" joined"));
        info_.device += "; processes:" + pids;
    }

    // dist_options::devices_layout "tp": every rank runs every block on its share (dist::tp_share);
    // checked here (rank count divides heads / groups / shared width, quant-block-aligned column views)
    // so a bad count fails at load. info().device names each rank's share ("tp: cpu heads 0-3
    // experts 0-4 | cpu heads 4-7 experts 5-9"). CUDA ranks need a CUDA tp forward (not built).
    void make_tp(const std::vector<int> &ordinals) {
        const int P = static_cast<int>(ordinals.size());
        if (std::find_if(ordinals.begin(), ordinals.end(), [](int d) { return d >= 0; }) != ordinals.end())
            throw error("devices '" + opts_.dist.devices + "': layout tp runs on CPU devices only so far (the CUDA "
                        "tensor-parallel forward is not built; docs/dist.md); use the pipeline layout");
        try {
            dist::tp_check(*model_, P);
        } catch (const std::exception &e) {
            throw error("devices '" + opts_.dist.devices + "': " + e.what());
        }
        std::string layout = "tp:";
        for (int r = 0; r < P; ++r) {
            const ds4::tp_slice s = dist::tp_share(model_->hp, r, P);
            layout += std::string(r ? " |" : "") + " cpu heads " + std::to_string(s.head0) + "-" +
                      std::to_string(s.head1 - 1) + " experts " + std::to_string(s.expert0) + "-" +
                      std::to_string(s.expert1 - 1);
        }
        info_.device = layout;
        tp_size_ = P;
        if (opts_.dist.rank_procs) start_rank_procs(P);
    }

    // Every device a CUDA device: the placement planner's pipeline ranges from each device's free
    // memory (a device listed k times offers 1/k of it to each entry) for one n_ctx sequence.
    std::vector<dist::layer_range> planned_ranges(const std::vector<int> &ordinals) const {
        std::vector<dist::layer_range> out;
#ifdef FATHOM_ENGINE_CUDA
        std::vector<dist::device_spec> specs;
        for (int d : ordinals) {
            const auto share = static_cast<uint64_t>(std::count(ordinals.begin(), ordinals.end(), d));
            specs.push_back({"cuda:" + std::to_string(d), cuda_query_memory(d).free_bytes / share});
        }
        dist::plan_options po;
        po.n_ctx = n_ctx_;
        po.n_seq = 1;
        po.kv = opts_.kv;
        po.chunk = n_batch_;
        try {
            for (const auto &d : dist::make_plan(dist::inventory_from_gguf(*file_), specs, po).devices)
                out.push_back(d.layers);
        } catch (const std::exception &e) {
            throw error("devices '" + opts_.dist.devices + "': " + e.what());
        }
#else
        (void)ordinals;  // CUDA entries were refused by parse_device_list in a build without CUDA
#endif
        return out;
    }

    void fill_info() {
        const ds4::hparams &hp = model_->hp;
        info_.arch = "deepseek4";
        info_.name = std::string(file_->get_string("general.name", ""));
        info_.path = opts_.model_path;
        info_.file_bytes = file_->size();
        for (const auto &t : file_->tensors()) info_.n_params += static_cast<uint64_t>(t.nelements());
        info_.n_vocab = hp.n_vocab;
        info_.n_ctx_train = static_cast<int32_t>(n_ctx_train_);
        info_.n_ctx = static_cast<int32_t>(std::min<int64_t>(n_ctx_, INT32_MAX));
        info_.n_layer = hp.n_layer;
        info_.n_embd = hp.n_embd;
        info_.kv_bytes_per_token =
            static_cast<uint64_t>(std::ceil(ds4::kv_bytes_per_token(hp, opts_.kv, n_ctx_)));
        info_.chat_template = template_ ? template_->source() : "";
    }

    engine_options opts_;
    std::shared_ptr<const gguf::file> file_;
    std::unique_ptr<ds4::model> model_;
    ds4::qat_mode qat_ = ds4::qat_mode::full;
    std::unique_ptr<cpu::thread_pool> pool_;
    ds4::exec_options exec_;
    std::unique_ptr<tokenizer> tok_;
    std::optional<chat_template> template_;
    model_info info_;
    int64_t n_ctx_train_ = 0, n_ctx_ = 0, n_batch_ = 0;
    std::mutex forward_mutex_;
    std::vector<dist::layer_range> ranges_;   // several devices: [device] its blocks (empty: one device)
    std::vector<dist::stage_device> stages_;  // [device] where those blocks run (shared CUDA weights)
    int tp_size_ = 0;                         // layout tp: the rank count (0: not tp)
#ifdef FATHOM_ENGINE_CUDA
    std::shared_ptr<const ds4::cuda_weights> gpu_;
    std::shared_ptr<ds4::cuda_prefill_pool> gpu_prefill_ = ds4::cuda_make_prefill_pool();
#endif
    int ordinal_ = -1;  // CUDA device of measure_copy_bandwidth (-1: none)
    bool on_cuda_ = false;  // one CUDA device (make_cuda)
    std::string gpu_name_;  // the CUDA device's name (state_identity)
    mutable std::once_flag identity_once_;  // state_identity: the file's fingerprint, computed once
    mutable std::string file_identity_;
    std::shared_ptr<const ds4::mtp_weights> mtp_;        // ds4_draft "mtp"
    std::shared_ptr<const ds4::dspark_weights> dspark_;  // ds4_draft "dspark"
    // rank_procs: the rank processes (destroyed first: stops them while the model is still here).
    std::unique_ptr<dist::rank_procs> procs_;
    std::unique_ptr<ds4_checkpoints> ckpt_;  // see checkpoints()
};

ds4_session::ds4_session(ds4_engine &e) : e_(e) {
#ifdef FATHOM_ENGINE_CUDA
    if (e.gpu()) gpu_ = e.new_gpu_sequence();
#endif
    if (e.pipelined()) pl_ = e.new_pipeline();
    if (!on_gpu() && !on_pipeline()) st_ = e.fresh_state();
    drafter_ = e.new_drafter();
    logits_.assign(static_cast<size_t>(e.model().hp.n_vocab), 0.0f);
}

ds4::step_extras ds4_session::extras_buffers::view(size_t n_rows, const ds4::hparams &hp, std::span<const int> layers) {
    const size_t D = static_cast<size_t>(hp.n_embd);
    hc.resize(n_rows * static_cast<size_t>(hp.n_hc) * D);
    features.resize(n_rows * layers.size() * D);
    return {hc, layers, features};
}

void ds4_session::observe(const extras_buffers &x, size_t r0, int64_t p0, size_t n) const {
    const ds4::hparams &hp = e_.model().hp;
    const size_t S = static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd),
                 F = drafter_->feature_layers().size() * static_cast<size_t>(hp.n_embd);
    drafter_->observe(tokens_, p0, drafter_->wants_hc_state() ? std::span<const float>(x.hc).subspan(r0 * S, n * S) : std::span<const float>(),
                      F > 0 ? std::span<const float>(x.features).subspan(r0 * F, n * F) : std::span<const float>());
}

std::vector<int32_t> ds4_session::draft(std::span<const int32_t> history, int32_t max) {
    if (!drafter_) return {};
    if (history.size() != tokens_.size() + 1 || !std::equal(tokens_.begin(), tokens_.end(), history.begin()))
        throw error("draft: the history must be what the session holds plus the pending token");
    std::lock_guard<std::mutex> lock(e_.forward_mutex());  // the drafter's products use the engine's pool
    return drafter_->draft(tokens_, history.back(), static_cast<int32_t>(std::min<int64_t>(max, rollback_limit())),
                           &draft_conf_);
}

bool ds4_session::on_pipeline() const {
    return e_.pipelined();
}

int64_t ds4_session::rollback_floor() const {
#ifdef FATHOM_ENGINE_CUDA
    if (gpu_) return gpu_->rollback_floor();
#endif
    return ds4::rollback_floor(st_);
}

bool ds4_session::on_gpu() const {
#ifdef FATHOM_ENGINE_CUDA
    return gpu_ != nullptr;
#else
    return false;
#endif
}

void ds4_session::reset() {
#ifdef FATHOM_ENGINE_CUDA
    if (gpu_) gpu_->reset();
#endif
    if (pl_) {
        try {
            pl_->reset();
        } catch (const std::exception &) {
            pl_.reset();  // a rank has failed: the next forward builds a new pipeline
        }
    }
    if (!on_gpu() && !on_pipeline()) st_ = e_.fresh_state();
    if (drafter_) drafter_->reset();
    tokens_.clear();
    have_logits_ = false;
    logits_on_device_ = false;
}

void ds4_session::forward_chunk(std::span<const int32_t> toks, std::span<const int64_t> pos, std::span<float> out) {
    if (on_pipeline()) {
        if (!pl_) pl_ = e_.new_pipeline();
        // Logits for every chunk (logits_ takes those nobody asked for): rank 0 then waits for the last
        // rank, so no rank still computes (on the shared thread pool) when the forward mutex is released.
        // A verification-sized evaluation with every row's logits runs one forward per row: its CUDA stages
        // then take the decode step's numerics, as one GPU's multi-row step does (one CPU is batch
        // invariant either way), so a pipeline's logits stay those of one device of the same kind.
        const size_t V = static_cast<size_t>(e_.model().hp.n_vocab), n = toks.size();
        const bool per_row = n > 1 && out.size() == n * V && static_cast<int64_t>(n) <= rollback_limit() + 1;
        try {
            if (per_row)
                for (size_t i = 0; i < n; ++i) pl_->forward(toks.subspan(i, 1), pos.subspan(i, 1), out.subspan(i * V, V));
            else
                pl_->forward(toks, pos, out.empty() ? std::span<float>(logits_) : out);
        } catch (...) {
            pl_.reset();  // the ranks' states disagree now: stop and join them (see the banner)
            throw;
        }
        return;
    }
#ifdef FATHOM_ENGINE_CUDA
    if (gpu_) {
        // A verification's rows (every row's logits, at most a rollback's width): one decode step each, so
        // greedy speculation gives plain decoding's tokens (chunked prefill rounds products to bf16).
        const size_t V = static_cast<size_t>(e_.model().hp.n_vocab);
        if (toks.size() > 1 && out.size() == toks.size() * V && static_cast<int64_t>(toks.size()) <= rollback_limit() + 1)
            gpu_->eval_rows(toks, out);
        else
            gpu_->eval(toks, out);
        return;
    }
#endif
    if (!drafter_) {
        ds4::forward(e_.model(), st_, toks, pos, {out, {}});
        return;
    }
    // With a drafter: the same forward as rows of one step, which also hands over its extras.
    const size_t n = toks.size(), V = static_cast<size_t>(e_.model().hp.n_vocab);
    std::vector<ds4::step_row> rows(n);
    for (size_t i = 0; i < n; ++i) rows[i] = {0, pos[i], toks[i]};
    std::vector<int32_t> logit_rows;
    if (out.size() == n * V)
        for (size_t i = 0; i < n; ++i) logit_rows.push_back(static_cast<int32_t>(i));
    else if (!out.empty())
        logit_rows.push_back(static_cast<int32_t>(n - 1));
    ds4::state *seq = &st_;
    ds4::step(e_.model(), std::span<ds4::state *const>(&seq, 1), rows, logit_rows, out,
              xb_.view(n, e_.model().hp, drafter_->feature_layers()));
}

void ds4_session::eval_chunks(std::span<const int32_t> toks, float *all_logits,
                              const std::function<void(int64_t, int64_t)> *on_progress) {
    draft_conf_.clear();
    const ds4::model &m = e_.model();
    const int64_t n_vocab = m.hp.n_vocab, total = static_cast<int64_t>(toks.size());
    if (total == 0) return;
    if (n_past() + total > e_.n_ctx())
        throw error("context full: " + std::to_string(n_past()) + " + " + std::to_string(total) +
                    " tokens exceed n_ctx " + std::to_string(e_.n_ctx()));
    for (int32_t t : toks)
        if (t < 0 || t >= n_vocab)
            throw error("token id " + std::to_string(t) + " outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
    std::lock_guard<std::mutex> lock(e_.forward_mutex());
    // Prefix checkpoints (one CPU device; not for evaluations that want every row's logits: verifications)
    ds4_checkpoints *ck = all_logits || !rolls_back() ? nullptr : e_.checkpoints();
    if (ck) ck->before_append(st_, tokens_, total);
    std::vector<int64_t> pos;
    for (int64_t done = 0; done < total;) {
        const int64_t n = std::min(e_.n_batch(), total - done);
        const bool last = done + n == total;
        std::span<float> out;
        if (all_logits)
            out = std::span<float>(all_logits + done * n_vocab, static_cast<size_t>(n * n_vocab));
        else if (last && !on_gpu())  // CUDA keeps them on the device until logits() / sample()
            out = std::span<float>(logits_);
        pos.resize(static_cast<size_t>(n));
        std::iota(pos.begin(), pos.end(), n_past());
        have_logits_ = false;
        logits_on_device_ = false;
        // On a throw mid-chunk the state may be half-updated: the session is left empty, not torn.
        try {
            forward_chunk(toks.subspan(static_cast<size_t>(done), static_cast<size_t>(n)), pos, out);
        } catch (...) {
            reset();
            throw;
        }
        tokens_.insert(tokens_.end(), toks.begin() + done, toks.begin() + done + n);
        if (drafter_ && !on_gpu() && !on_pipeline()) observe(xb_, 0, n_past() - n, static_cast<size_t>(n));
        done += n;
        if (last) {
            if (all_logits)
                std::memcpy(logits_.data(), all_logits + (total - 1) * n_vocab, static_cast<size_t>(n_vocab) * sizeof(float));
            else
                logits_on_device_ = on_gpu();
            have_logits_ = true;
        }
        if (ck)  // a prompt's end (with its logits) or a grid crossing
            ck->after_eval(st_, tokens_, n_past() - n,
                           last && total >= 2 ? std::span<const float>(logits_) : std::span<const float>());
        if (on_progress && *on_progress) (*on_progress)(done, total);
    }
}

// ---- saved states -----------------------------------------------------------------------------------
// Stream: ds4::write_state's (deepseek4_state.cpp), then u64 has_logits and, when set, the last token's
// logits [n_vocab] f32.

bool ds4_session::save_state(state_writer &w) const {
    if (on_pipeline()) return false;
#ifdef FATHOM_ENGINE_CUDA
    if (on_gpu())
        gpu_->save_state(w);
    else
#endif
        ds4::write_state(e_.model(), st_, w);
    state_io::put<uint64_t>(w, have_logits_ ? 1 : 0);
    if (have_logits_) {
        const std::span<const float> lg = logits();  // downloads them when they are on the device
        w.write(lg.data(), lg.size() * sizeof(float));
    }
    return true;
}

bool ds4_session::load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) {
    if (on_pipeline()) return false;
    const int64_t n = static_cast<int64_t>(tokens.size()), n_vocab = e_.model().hp.n_vocab;
    if (n < 1 || n > e_.n_ctx())
        throw error("saved state: " + std::to_string(n) + " tokens do not fit the context");
    if (n_keep != n)
        throw error("saved state: a DeepSeek V4 state loads whole (keep " + std::to_string(n_keep) + " of " +
                    std::to_string(n) + ")");
    for (int32_t t : tokens)
        if (t < 0 || t >= n_vocab)
            throw error("saved state: token id " + std::to_string(t) + " outside the vocabulary");
    reset();
    try {
#ifdef FATHOM_ENGINE_CUDA
        if (on_gpu())
            gpu_->load_state(r, n);
        else
#endif
            ds4::read_state(e_.model(), st_, r, n);
        const uint64_t has_logits = state_io::get<uint64_t>(r);
        if (has_logits > 1) throw error("saved state: bad logits flag");
        if (has_logits) r.read(logits_.data(), logits_.size() * sizeof(float));
#ifdef FATHOM_ENGINE_CUDA
        if (on_gpu() && has_logits) gpu_->restore_logits(logits_);  // sample() reads them on the device
#endif
        if (r.remaining() != 0)
            throw error("saved state: " + std::to_string(r.remaining()) + " bytes past its end");
        tokens_.assign(tokens.begin(), tokens.end());
        have_logits_ = has_logits == 1;
    } catch (...) {
        reset();  // a half-read state is torn
        throw;
    }
    return true;
}

std::span<const float> ds4_session::logits() const {
    if (!have_logits_) return {};
#ifdef FATHOM_ENGINE_CUDA
    if (logits_on_device_) {
        gpu_->last_logits(logits_);
        logits_on_device_ = false;
    }
#endif
    return logits_;
}

sample_result ds4_session::sample(sampler &smp, std::span<const int32_t> history) {
#ifdef FATHOM_ENGINE_CUDA
    if (have_logits_ && logits_on_device_) {
        const sampling_params &p = smp.params();
        const int64_t V = e_.model().hp.n_vocab;
        const auto pen = smp.penalty_counts(history, V);
        const size_t k = std::min<size_t>(smp.top_candidates(), static_cast<size_t>(cuda::logits_top_max_k));
        ds4::cuda_sequence::top_summary d =
            gpu_->logits_top(static_cast<int>(k), pen, p.repeat_penalty, p.frequency_penalty, p.presence_penalty);
        if (d.bad == 0) {  // NaN / +inf: sample() below reports them
            logits_top t;
            t.ids = std::move(d.ids);
            t.logits = std::move(d.logits);
            t.max_logit = d.max_logit;
            t.z = d.z;
            t.n_vocab = V;
            if (auto r = smp.sample_top(t)) return *r;
        }
    }
#endif
    return smp.sample(logits(), history);
}

void ds4_session::eval(std::span<const int32_t> tokens, float *all_logits) {
    eval_chunks(tokens, all_logits, nullptr);
}

size_t ds4_session::drop_after(size_t n) {
    if (n >= tokens_.size()) return tokens_.size();
    if (rolls_back() && static_cast<int64_t>(n) >= rollback_floor()) {
#ifdef FATHOM_ENGINE_CUDA
        if (gpu_)
            gpu_->truncate(static_cast<int64_t>(n));
        else
#endif
            ds4::truncate(st_, static_cast<int64_t>(n));
        if (drafter_) drafter_->truncate(static_cast<int64_t>(n));
        tokens_.resize(n);
        have_logits_ = false;
        return n;
    }
    reset();  // beyond what the state can roll back: rebuilt from the kept tokens by the caller
    return 0;
}

void ds4_session::truncate(int64_t n_keep) {
    n_keep = std::max<int64_t>(n_keep, 0);
    if (n_keep >= n_past()) return;
    if (n_keep == 0) {
        reset();
        return;
    }
    if (rolls_back() && n_keep >= rollback_floor()) {
        drop_after(static_cast<size_t>(n_keep));  // logits() empty until the next evaluation
        return;
    }
    session::truncate(n_keep);  // through sync: rebuilt, the last kept token's logits re-derived
}

void ds4_session::sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) {
    if (static_cast<int64_t>(prefix.size()) > e_.n_ctx())
        throw error("prompt of " + std::to_string(prefix.size()) + " tokens exceeds n_ctx " + std::to_string(e_.n_ctx()));
    if (prefix.empty()) {
        reset();
        if (on_progress) on_progress(0, 0);
        return;
    }
    size_t keep = 0;
    while (keep < prefix.size() && keep < tokens_.size() && prefix[keep] == tokens_[keep]) ++keep;
    if (keep == prefix.size() && keep == tokens_.size() && have_logits_) {
        if (on_progress) on_progress(0, 0);  // exactly what is held, logits current
        return;
    }
    // The whole prefix is held but its last token's logits are not: that token is evaluated again.
    if (keep == prefix.size()) --keep;
    if (restore_checkpoint(prefix, keep)) {
        keep = tokens_.size();
        if (keep == prefix.size()) {  // a checkpoint of the whole prefix, with its logits
            if (on_progress) on_progress(0, 0);
            return;
        }
    } else {
        keep = drop_after(keep);  // a diverged or longer state: rolled back when it can be, else rebuilt
    }
    eval_chunks(prefix.subspan(keep), nullptr, &on_progress);
}

int64_t ds4_session::reusable_prefix(std::span<const int32_t> prefix) const {
    size_t l = 0;
    while (l < tokens_.size() && l < prefix.size() && tokens_[l] == prefix[l]) ++l;
    int64_t keep = 0;
    if (l == tokens_.size() || (rolls_back() && static_cast<int64_t>(l) >= rollback_floor()))
        keep = static_cast<int64_t>(l);
    if (const ds4_checkpoints *ck = rolls_back() ? e_.checkpoints() : nullptr)
        keep = std::max(keep, static_cast<int64_t>(ck->longest(prefix)));
    return keep;
}

bool ds4_session::restore_checkpoint(std::span<const int32_t> prefix, size_t keep) {
    ds4_checkpoints *ck = rolls_back() ? e_.checkpoints() : nullptr;
    if (!ck) return false;
    const bool free = keep >= tokens_.size() || static_cast<int64_t>(keep) >= rollback_floor();
    if (!ck->restore(prefix, free ? keep : 0, st_, tokens_, logits_, have_logits_)) return false;
    logits_on_device_ = false;
    // The drafter's history is the old timeline's: cut back to what both share (its rings are
    // position-indexed; a deeper cut restarts its rows, as after a state load).
    if (drafter_) drafter_->truncate(static_cast<int64_t>(std::min(keep, tokens_.size())));
    return true;
}

bool ds4_session::appends_in_one_forward(std::span<const int32_t> toks) const {
    const int64_t n = static_cast<int64_t>(toks.size()), n_vocab = e_.model().hp.n_vocab;
    // eval_chunks' checks (context, vocabulary) and its chunking (one chunk: at most n_batch tokens).
    if (!on_pipeline() || n < 1 || n > e_.n_batch() || n_past() + n > e_.n_ctx()) return false;
    return std::all_of(toks.begin(), toks.end(), [&](int32_t t) { return t >= 0 && t < n_vocab; });
}

void ds4_session::submit_append(std::span<const int32_t> toks) {
    std::vector<int64_t> pos(toks.size());  // sent by submit (copied): need not outlive it
    std::iota(pos.begin(), pos.end(), n_past());
    have_logits_ = false;
    logits_on_device_ = false;
    try {
        if (!pl_) pl_ = e_.new_pipeline();
        pl_->submit(toks, pos, logits_);  // the last token's logits land in logits_ at collect
    } catch (...) {
        pl_.reset();  // as forward_chunk / eval_chunks: the ranks' states disagree; hold nothing
        reset();
        throw;
    }
}

void ds4_session::collect_append(std::span<const int32_t> toks) {
    try {
        if (!pl_) throw error("ds4: collect without a submitted forward");
        pl_->collect();
    } catch (...) {
        pl_.reset();
        reset();
        throw;
    }
    tokens_.insert(tokens_.end(), toks.begin(), toks.end());
    have_logits_ = true;
}

// ---- in-flight batches ------------------------------------------------------------------------------
// Per session, what eval / sync would do, but the forwards of all sessions are submitted before any is
// collected: on the calling thread rank 0 of session B's pipeline runs its blocks while rank 1 of A's
// (its own thread) runs A's, and so on down the stages, so with one device per stage every stage can
// be busy with a different sequence. Each pipeline holds only its own session's state, so the logits
// are those of the session alone bit for bit (batch invariance). The forward mutex is held across the
// batch (CPU ranks share the thread pool; no rank computes once it is released).

ds4_session &ds4_engine::step_session(session *p, size_t i, const char *what,
                                      std::vector<const session *> &seen) const {
    const std::string who = std::string(what) + ": item " + std::to_string(i);
    if (!p) throw error(who + " has no session");
    auto *s = dynamic_cast<ds4_session *>(p);
    if (!s || &s->owner() != this) throw error(who + ": session not created by this engine");
    if (std::find(seen.begin(), seen.end(), p) != seen.end()) throw error(who + ": session appears twice");
    seen.push_back(p);
    return *s;
}

void ds4_engine::run_inflight(const std::vector<append_work> &work) {
    if (work.empty()) return;
    std::exception_ptr first;  // the first failure, rethrown once every submitted forward is collected
    std::vector<bool> submitted(work.size(), false);
    std::lock_guard<std::mutex> lock(forward_mutex_);
    // With rank processes the whole batch is one hold of the shared link, collected in submit order
    // (rank_procs.h); a failure there fails the group for good (every later item throws its line).
    const auto batch = [&] {
        for (size_t k = 0; k < work.size(); ++k) {
            try {
                work[k].s->submit_append(work[k].toks);
                submitted[k] = true;
            } catch (...) {
                if (!first) first = std::current_exception();
            }
        }
        for (size_t k = 0; k < work.size(); ++k) {
            if (!submitted[k]) continue;
            try {
                work[k].s->collect_append(work[k].toks);
            } catch (...) {
                if (!first) first = std::current_exception();
            }
        }
    };
    if (procs_) {
        try {
            procs_->with_sessions(batch);
        } catch (...) {
            if (!first) first = std::current_exception();
        }
    } else {
        batch();
    }
    if (first) std::rethrow_exception(first);
}

// ---- one CPU device: a step's items as the rows of one ds4::step ------------------------------------

// Checks every item before any session changes (ownership, distinct sessions, context, vocabulary),
// then brings each session to the longest common prefix of what it holds and its item's prefix (a free
// rollback; session::sync's rule: when the whole prefix is held but its last token's logits are wanted
// and not kept, that token is evaluated again). Returns the items that have tokens to evaluate; items
// that diverge beyond the rollback reach, or verify more rows than one piece, are left to `alone`.
std::vector<ds4_engine::cpu_work> ds4_engine::plan_cpu_step(std::span<const sync_item> items,
                                                           std::vector<size_t> &alone) {
    constexpr size_t nothing = SIZE_MAX;  // keep[i]: the session already holds what item i asks for
    std::vector<size_t> keep(items.size(), nothing);
    std::vector<const session *> seen;
    for (size_t i = 0; i < items.size(); ++i) {
        const sync_item &it = items[i];
        ds4_session &s = step_session(it.sess, i, "sync_step", seen);
        const sync_plan p = plan_sync_item(it, s.tokens_, s.have_logits_, n_ctx_, n_batch_, model_->hp.n_vocab);
        if (p.what == sync_plan::kind::done) continue;
        const size_t k = p.keep;
        const bool deep = !it.prefix.empty() && k < s.tokens_.size() && static_cast<int64_t>(k) < ds4::rollback_floor(s.st_);
        // Deeper than the rollback reach, or a prefix checkpoint beats it: sync restores or rebuilds.
        if (p.what == sync_plan::kind::alone || deep ||
            (ckpt_ && it.n_rows == 0 && it.prefix.size() >= k + 2 && ckpt_->longest(it.prefix) > k)) {
            alone.push_back(i);
            continue;
        }
        keep[i] = k;
    }
    std::vector<cpu_work> work;
    for (size_t i = 0; i < items.size(); ++i) {
        if (keep[i] == nothing) continue;
        auto *s = static_cast<ds4_session *>(items[i].sess);
        if (items[i].prefix.empty()) {
            s->reset();
            continue;
        }
        s->drop_after(keep[i]);  // within the rollback reach (checked above): free
        if (keep[i] == items[i].prefix.size()) continue;  // truncated; no logits wanted
        work.push_back({s, items[i].prefix.subspan(keep[i]), items[i].want_logits, items[i].n_rows, items[i].rows});
    }
    return work;
}

// Every item's next piece (at most n_batch tokens) as the rows of one forward, until all are done (one
// forward normally: n_batch + one row per item fits a prompt chunk beside every decode of the step).
// Logits only of the rows asked for: a verification's last n_rows, otherwise an item's last token.
void ds4_engine::run_cpu_pieces(std::vector<cpu_work> &work) {
    const size_t V = static_cast<size_t>(model_->hp.n_vocab);
    const int64_t cap = n_batch_ + static_cast<int64_t>(work.size());
    std::lock_guard<std::mutex> lock(forward_mutex_);
    for (cpu_work &w : work) {
        w.s->have_logits_ = false;
        w.total = w.rest.size();
        if (ckpt_ && w.n_rows == 0)
            ckpt_->before_append(w.s->st_, w.s->tokens_, static_cast<int64_t>(w.total));
    }
    for (;;) {
        std::vector<ds4::state *> seqs;
        std::vector<ds4::step_row> rows;
        std::vector<int32_t> logit_rows;
        struct piece_of {
            cpu_work *w;
            size_t piece, first_row;
        };
        std::vector<piece_of> in;
        for (cpu_work &w : work) {
            if (w.rest.empty()) continue;
            const size_t piece = std::min<size_t>(static_cast<size_t>(n_batch_), w.rest.size());
            if (!rows.empty() && static_cast<int64_t>(rows.size() + piece) > cap) continue;  // next forward
            const bool last = piece == w.rest.size();
            const auto seq = static_cast<int32_t>(seqs.size());
            seqs.push_back(&w.s->st_);
            const size_t first_row = rows.size();
            for (size_t t = 0; t < piece; ++t)
                rows.push_back({seq, w.s->st_.n_past + static_cast<int64_t>(t), w.rest[t]});
            if (last && w.n_rows > 0)
                for (size_t t = piece - static_cast<size_t>(w.n_rows); t < piece; ++t)
                    logit_rows.push_back(static_cast<int32_t>(first_row + t));
            else if (last && w.want_logits)
                logit_rows.push_back(static_cast<int32_t>(rows.size() - 1));
            in.push_back({&w, piece, first_row});
        }
        if (rows.empty()) break;
        std::vector<float> logits(logit_rows.size() * V);
        // Every session of a drafting engine has a drafter of the same kind: one set of extras for all rows.
        ds4_session::extras_buffers xb;
        const std::unique_ptr<ds4_drafter> &d0 = in.front().w->s->drafter_;
        try {
            if (d0)
                ds4::step(*model_, seqs, rows, logit_rows, logits, xb.view(rows.size(), model_->hp, d0->feature_layers()));
            else
                ds4::step(*model_, seqs, rows, logit_rows, logits);
        } catch (...) {
            for (const piece_of &p : in) p.w->s->reset();  // a forward that failed part-way leaves torn states
            throw;
        }
        size_t out = 0;  // the next row of `logits`, in the order logit_rows were added
        for (const piece_of &p : in) {
            cpu_work *w = p.w;
            const size_t piece = p.piece;
            ds4_session &s = *w->s;
            s.tokens_.insert(s.tokens_.end(), w->rest.begin(), w->rest.begin() + static_cast<std::ptrdiff_t>(piece));
            if (s.drafter_) s.observe(xb, p.first_row, s.n_past() - static_cast<int64_t>(piece), piece);
            w->rest = w->rest.subspan(piece);
            // Grid crossings (a prompt's end with its logits: below)
            if (ckpt_ && w->n_rows == 0 && (!w->rest.empty() || !w->want_logits || w->total < 2))
                ckpt_->after_eval(s.st_, s.tokens_, s.n_past() - static_cast<int64_t>(piece), {});
            if (!w->rest.empty()) continue;
            if (w->n_rows > 0) {
                const size_t nr = static_cast<size_t>(w->n_rows);
                std::copy(logits.begin() + static_cast<std::ptrdiff_t>(out * V),
                          logits.begin() + static_cast<std::ptrdiff_t>((out + nr) * V), w->rows);
                out += nr;
                std::copy(w->rows + (nr - 1) * V, w->rows + nr * V, s.logits_.begin());
                s.have_logits_ = true;
            } else if (w->want_logits) {
                std::copy(logits.begin() + static_cast<std::ptrdiff_t>(out * V),
                          logits.begin() + static_cast<std::ptrdiff_t>((out + 1) * V), s.logits_.begin());
                ++out;
                s.have_logits_ = true;
                if (ckpt_ && w->total >= 2)  // a prompt's end, with its logits
                    ckpt_->after_eval(s.st_, s.tokens_, s.n_past() - static_cast<int64_t>(piece), s.logits_);
            }
        }
    }
}

void ds4_engine::run_cpu_step(std::span<const sync_item> items) {
    std::vector<size_t> alone;
    std::vector<cpu_work> work = plan_cpu_step(items, alone);
    if (!work.empty()) run_cpu_pieces(work);
    for (size_t i : alone) {
        if (items[i].n_rows > 0) sync_with_rows(items[i]);
        else items[i].sess->sync(items[i].prefix);
    }
}

void ds4_engine::decode_step(std::span<session *const> sessions, std::span<const int32_t> tokens) {
    if (on_one_cpu()) {
        if (sessions.size() != tokens.size())
            throw error("decode_step: " + std::to_string(sessions.size()) + " sessions but " +
                        std::to_string(tokens.size()) + " tokens");
        std::vector<std::vector<int32_t>> prefixes(sessions.size());
        std::vector<sync_item> items(sessions.size());
        for (size_t i = 0; i < sessions.size(); ++i) {
            if (!sessions[i]) throw error("decode_step: item " + std::to_string(i) + " has no session");
            prefixes[i] = sessions[i]->tokens();
            prefixes[i].push_back(tokens[i]);
            items[i].sess = sessions[i];
            items[i].prefix = prefixes[i];
        }
        run_cpu_step(items);
        return;
    }
    if (on_cuda_) {  // as one-token sync items (run_gpu_step batches them)
        if (sessions.size() != tokens.size())
            throw error("decode_step: " + std::to_string(sessions.size()) + " sessions but " +
                        std::to_string(tokens.size()) + " tokens");
        std::vector<std::vector<int32_t>> prefixes(sessions.size());
        std::vector<sync_item> items(sessions.size());
        for (size_t i = 0; i < sessions.size(); ++i) {
            if (!sessions[i]) throw error("decode_step: item " + std::to_string(i) + " has no session");
            prefixes[i] = sessions[i]->tokens();
            prefixes[i].push_back(tokens[i]);
            items[i].sess = sessions[i];
            items[i].prefix = prefixes[i];
        }
        run_gpu_step(items);
        return;
    }
    if (!inflight()) {
        engine::decode_step(sessions, tokens);
        return;
    }
    if (sessions.size() != tokens.size())
        throw error("decode_step: " + std::to_string(sessions.size()) + " sessions but " +
                    std::to_string(tokens.size()) + " tokens");
    std::vector<append_work> fast;
    std::vector<size_t> slow;  // through session::eval (which reports what it refuses), after the batch
    std::vector<const session *> seen;
    for (size_t i = 0; i < sessions.size(); ++i) {
        ds4_session &s = step_session(sessions[i], i, "decode_step", seen);
        if (s.appends_in_one_forward(tokens.subspan(i, 1)))
            fast.push_back({&s, tokens.subspan(i, 1)});
        else
            slow.push_back(i);
    }
    run_inflight(fast);
    for (size_t i : slow) sessions[i]->eval(tokens.subspan(i, 1));
}

void ds4_engine::run_gpu_step(std::span<const sync_item> items) {
#ifdef FATHOM_ENGINE_CUDA
    struct row_item {
        size_t i;  // the item
        ds4_session *s;
        std::span<const int32_t> rows;  // the tokens its step evaluates
    };
    std::vector<row_item> batch;
    std::vector<size_t> slow;
    std::vector<const session *> seen;
    const int32_t V = model_->hp.n_vocab;
    for (size_t i = 0; i < items.size(); ++i) {
        const sync_item &it = items[i];
        ds4_session &s = step_session(it.sess, i, "sync_step", seen);
        const std::span<const int32_t> p = it.prefix;
        const size_t n_new = it.n_rows > 0 ? static_cast<size_t>(it.n_rows) : 1, held = s.tokens_.size();
        bool ok = s.gpu_ && it.n_rows <= cuda::ds4::gemv_max_rows && p.size() > n_new && p.size() <= static_cast<size_t>(n_ctx_) &&
                  (it.n_rows > 0 || it.want_logits);
        const size_t m = ok ? p.size() - n_new : 0;  // kept before the new rows
        ok = ok && held >= m && std::equal(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(m), s.tokens_.begin()) &&
             (held == m || (it.n_rows > 0 && static_cast<int64_t>(m) >= s.rollback_floor()));
        for (size_t k = m; ok && k < p.size(); ++k) ok = p[k] >= 0 && p[k] < V;
        if (!ok) {
            slow.push_back(i);
            continue;
        }
        if (held > m) s.drop_after(m);  // a verification after a longer timeline: the free rollback
        batch.push_back({i, &s, p.subspan(m)});
    }
    {
        std::lock_guard<std::mutex> lock(forward_mutex());
        const size_t B = static_cast<size_t>(cuda::ds4::gemv_max_rows), Vz = static_cast<size_t>(V);
        std::vector<float> lg;
        for (size_t b0 = 0; b0 < batch.size();) {
            std::vector<ds4::cuda_sequence *> seqs;
            std::vector<int> counts;
            std::vector<int32_t> toks;
            bool rows_wanted = false;
            size_t b1 = b0;
            for (; b1 < batch.size() && toks.size() + batch[b1].rows.size() <= B; ++b1) {
                seqs.push_back(batch[b1].s->gpu_.get());
                counts.push_back(static_cast<int>(batch[b1].rows.size()));
                toks.insert(toks.end(), batch[b1].rows.begin(), batch[b1].rows.end());
                rows_wanted = rows_wanted || items[batch[b1].i].n_rows > 0;
            }
            lg.resize(rows_wanted ? toks.size() * Vz : 0);
            try {
                ds4::cuda_sequence::step_batch(seqs, counts, toks, lg);
            } catch (...) {
                for (size_t k = b0; k < b1; ++k)  // a device-side error reset the sequences: the sessions follow
                    if (batch[k].s->gpu_->n_past() != batch[k].s->n_past()) batch[k].s->reset();
                throw;
            }
            size_t r = 0;
            for (size_t k = b0; k < b1; ++k) {
                ds4_session &s = *batch[k].s;
                const sync_item &it = items[batch[k].i];
                const size_t n = batch[k].rows.size();
                if (it.n_rows > 0) std::copy(lg.begin() + static_cast<std::ptrdiff_t>(r * Vz),
                                             lg.begin() + static_cast<std::ptrdiff_t>((r + n) * Vz), it.rows);
                r += n;
                s.tokens_.insert(s.tokens_.end(), batch[k].rows.begin(), batch[k].rows.end());
                s.draft_conf_.clear();
                s.have_logits_ = true;
                s.logits_on_device_ = true;  // the last row's: sample() summarises them on the device
            }
            b0 = b1;
        }
    }
    for (size_t i : slow) {
        if (items[i].n_rows > 0) sync_with_rows(items[i]);
        else items[i].sess->sync(items[i].prefix);
    }
#else
    engine::sync_step(items);
#endif
}

void ds4_engine::sync_step(std::span<const sync_item> items) {
    if (on_one_cpu()) {
        run_cpu_step(items);
        return;
    }
    if (on_cuda_) {
        run_gpu_step(items);
        return;
    }
    if (!inflight()) {
        engine::sync_step(items);
        return;
    }
    std::vector<append_work> fast;
    std::vector<size_t> slow;  // through session::sync (reuse, truncation, long prompts), after the batch
    std::vector<const session *> seen;
    for (size_t i = 0; i < items.size(); ++i) {
        ds4_session &s = step_session(items[i].sess, i, "sync_step", seen);
        // A pure append (what the session holds is a proper prefix of the item's prefix) of one chunk:
        // sync would evaluate exactly prefix[held, end) with eval, whatever want_logits says.
        const std::vector<int32_t> &held = s.tokens();
        const std::span<const int32_t> p = items[i].prefix;
        const bool appends = items[i].n_rows == 0 && p.size() > held.size() && std::equal(held.begin(), held.end(), p.begin());
        if (appends && s.appends_in_one_forward(p.subspan(held.size())))
            fast.push_back({&s, p.subspan(held.size())});
        else
            slow.push_back(i);
    }
    run_inflight(fast);
    for (size_t i : slow) {
        if (items[i].n_rows > 0) sync_with_rows(items[i]);
        else items[i].sess->sync(items[i].prefix);
    }
}

}  // namespace

std::unique_ptr<engine> make_ds4_engine(const engine_options &opts, std::shared_ptr<const gguf::file> file) {
    return std::make_unique<ds4_engine>(opts, std::move(file));
}

namespace {

// A rank process's state for one engine session: its pipeline_rank or tp_rank (KV of its share).
template <class Rank>
class rank_session final : public dist::session_rank {
  public:
    template <class... A>
    explicit rank_session(A &&...a) : r_(std::forward<A>(a)...) {}
    void step() override {
        if (!r_.serve_one())
            throw error("dist: rank " + std::to_string(r_.rank()) + ": a session's ranks stopped");
    }

  private:
    Rank r_;
};

// A rank process's block ranges (pipeline layout): rank 0's (`--rank-layers`, dist_options::rank_layers),
// checked to be one range per device tiling the model; without them the even split, which is rank 0's
// only for lists of CPU entries (with a CUDA entry rank 0 may have used the planner).
std::vector<dist::layer_range> rank_ranges(const engine_options &o, const std::vector<int> &ordinals, int n_layer) {
    const int P = static_cast<int>(ordinals.size());
    if (o.dist.rank_layers.empty()) {
        if (std::find_if(ordinals.begin(), ordinals.end(), [](int d) { return d >= 0; }) != ordinals.end())
            throw error("rank: devices '" + o.dist.devices + "' have CUDA entries: the block ranges (--rank-layers, "
                        "given by rank 0) are required");
        return dist::even_ranges(n_layer, P);
    }
    std::vector<dist::layer_range> ranges;
    try {
        ranges = dist::parse_layer_ranges(o.dist.rank_layers);
        if (static_cast<int>(ranges.size()) != P)
            throw error(std::to_string(ranges.size()) + " ranges for the " + std::to_string(P) + " devices '" +
                        o.dist.devices + "'");
        dist::check_ranges(ranges, n_layer);
    } catch (const std::exception &e) {
        std::string why = e.what();  // without the "plan: " / "dist: " of the parser / check_ranges
        if (why.rfind("plan: ", 0) == 0 || why.rfind("dist: ", 0) == 0) why.erase(0, 6);
        throw error("rank: --rank-layers '" + o.dist.rank_layers + "': " + why);
    }
    return ranges;
}

}  // namespace

void serve_ds4_rank(const engine_options &o, int rank, int world, const std::string &join_id) {
    check_options(o);
    if (o.dist.devices.empty()) throw error("rank: devices (--devices) are required, as given to rank 0");
    const std::vector<int> ordinals = parse_device_list(o.dist.devices);  // throws for CUDA entries without CUDA
    const int P = static_cast<int>(ordinals.size());
    if (P != world)
        throw error("rank: world " + std::to_string(world) + " but devices '" + o.dist.devices + "' has " +
                    std::to_string(P) + " entries");
    if (rank < 1 || rank >= P)
        throw error("rank: rank " + std::to_string(rank) + " outside 1.." + std::to_string(P - 1));
    const bool tp = o.dist.devices_layout == "tp";
    if (tp && std::find_if(ordinals.begin(), ordinals.end(), [](int d) { return d >= 0; }) != ordinals.end())
        throw error("devices '" + o.dist.devices + "': layout tp runs on CPU devices only so far (the CUDA "
                    "tensor-parallel forward is not built; docs/dist.md); use the pipeline layout");
    if (tp && !o.dist.rank_layers.empty())
        throw error("rank: --rank-layers '" + o.dist.rank_layers + "' is for the pipeline layout, not tp");
    const ds4::qat_mode qat = parse_qat(o.ds4_qat);
    std::shared_ptr<const gguf::file> file = gguf::file::open(o.model_path);
    if (file->get_string("general.architecture", "") != "deepseek4")
        throw error(o.model_path + ": rank processes serve DeepSeek V4 (deepseek4) models only");
    const std::unique_ptr<ds4::model> m = ds4::load_model(file);
    // The same split as rank 0's engine (make_pipeline / make_tp).
    std::vector<dist::layer_range> ranges;
    if (tp)
        dist::tp_check(*m, P);
    else
        ranges = rank_ranges(o, ordinals, m->hp.n_layer);
    // A CUDA stage (pipeline layout): this rank's blocks uploaded once for the process, shared by every
    // session's pipeline_rank (a session costs only its KV state), as make_pipeline does for stage r.
    // Uploaded before the join, so a failure here ends the load of rank 0 with this process's status.
    dist::stage_device dev;
    dev.cuda_device = ordinals[static_cast<size_t>(rank)];
    if (dev.cuda_device >= 0) {
#ifdef FATHOM_ENGINE_CUDA
        // Rank 0 passes its n_ctx (--ctx); without it, the engine's default for this file.
        dev.n_ctx = o.n_ctx > 0 ? o.n_ctx : default_n_ctx(file->get_int("deepseek4.context_length", 0));
        dev.cuda_graphs = o.cuda_graphs;
        dev.weights = upload_stage(*m, dev.cuda_device, ranges[static_cast<size_t>(rank)], qat, o.kv, {});
#else
        throw error("devices '" + o.dist.devices + "': CUDA entries need a build with CUDA (-DFATHOM_CUDA=ON)");
#endif
    }
    cpu::thread_pool pool(o.n_threads > 0 ? o.n_threads : online_cores());
    ds4::exec_options exec;
    exec.pool = &pool;
    exec.quantised = !o.exact;
    dist::socket_options so;
    so.timeout = pipeline_deadline;
    so.join_timeout = std::chrono::minutes(10);
    const std::unique_ptr<dist::socket_transport> t = dist::make_socket_transport(rank, P, join_id, so);
    dist::serve_sessions(*t, [&]() -> std::unique_ptr<dist::session_rank> {
        if (tp) return std::make_unique<rank_session<dist::tp_rank>>(*m, *t, qat, o.kv, exec);
        return std::make_unique<rank_session<dist::pipeline_rank>>(*m, ranges, *t, qat, o.kv, exec, dev);
    });
}

}  // namespace fathom
