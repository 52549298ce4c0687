// DS4 engine and session, internal to src/engine (the entry points engine::load and `fathom rank` use
// are in ds4_session.h). This header declares the classes; the code is in ds4_engine.cpp (loading, the
// batched steps), ds4_session.cpp (the session), ds4_devices.{h,cpp} (option checks, the device list,
// a session's ranks on several devices) and ds4_rank_server.cpp (serve_ds4_rank).
//
// Executors, chosen once at load: one CPU device (a session's ds4::state), one GPU (ds4_gpu.h: the
// engine's ds4_gpu and a session's gpu_sequence; the CUDA implementation is
// engine/cuda/ds4_gpu_cuda.cpp, in CUDA builds only) or several devices (device_ranks, ds4_devices.h;
// a pipeline's CUDA stages are dist/gpu_stage.h's). These files are compiled alike in every build: the
// interfaces hide whether the build has CUDA.
//
// The engine owns the mapped GGUF, the bound weights (ds4::model), the thread pool, the tokenizer and
// the chat template; a session owns one ds4::state (raw KV rings, compressor frontiers, compressed and
// indexer rows) and the token timeline.
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
#pragma once

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
#include "gguf/fingerprint.h"
#include "chat/chat_template.h"
#include "chat/ds4_chat.h"
#include "core/error.h"
#include "core/state_io.h"
#include "dist/pipeline.h"
#include "dist/planner.h"
#include "dist/rank_procs.h"
#include "dist/tp.h"
#include "engine/device.h"
#include "engine/ds4_checkpoints.h"
#include "engine/ds4_devices.h"
#include "engine/ds4_drafter.h"
#include "engine/ds4_gpu.h"
#include "engine/sync_plan.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_mtp.h"
#include "tokenizer/tokenizer.h"

namespace fathom::ds4_detail {

// DeepSeek V4 chat format (src/chat/ds4_chat.h, the official encoder), used when the file carries
// no tokenizer.chat_template: chat mode ("</think>" after the Assistant marker) unless thinking is
// on or max (thinking mode: "<think>" after the last Assistant marker, earlier turns' reasoning
// dropped; max adds the Think-Max paragraph). The encoder always ends a conversation whose last
// turn is the user's with the generation prefix; the engine contract makes that depend on add_gen.
std::string render_deepseek(const std::vector<chat_message> &msgs, bool add_gen, chat_thinking thinking);

class ds4_engine;

class ds4_session final : public session {
  public:
    explicit ds4_session(ds4_engine &e);
    void sync(std::span<const int32_t> prefix, const std::function<void(int64_t, int64_t)> &on_progress) override;
    void eval(std::span<const int32_t> tokens, float *all_logits) override;
    std::span<const float> logits() const override;
    sample_result sample(sampler &smp, std::span<const int32_t> history) override;
    // One GPU: a verification's rows stay on the device (gpu_sequence::eval_rows without logits) and each
    // sampled row is summarised there (row_top), downloaded only when the summary cannot decide; elsewhere
    // the default (every row's logits into `rows`).
    bool eval_verify(std::span<const int32_t> tokens, float *rows) override;
    sample_result sample_row(size_t j, sampler &smp, std::span<const int32_t> history) override;
    size_t verify_rows_held() const override { return device_rows_; }
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
    // Saved states: one device, the CPU (ds4::state) or one GPU (gpu_sequence, the same stream from the
    // device); a pipeline's ranks are not saved. A DS4 state cannot drop positions (see the
    // banner), so it loads whole: n_keep == tokens.size().
    bool save_state(state_writer &w) const override;
    bool load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) override;
    // Paged state (one GPU): the rows of positions [0, n_tokens) mapped from the engine's state pool now
    // (cuda_sequence::reserve); kv_blocks() is the session's mapped positions in the scheduler's blocks
    // (ds4_engine::kv_pool). Elsewhere the defaults (nothing paged).
    bool kv_reserve(int64_t n_tokens) override;
    int64_t kv_blocks() const override;

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
    // n rows with every row's logits (n_logits floats), at most a rollback's width: a verification, which
    // one GPU and a pipeline's CUDA stages evaluate with the decode step's numerics.
    bool verification_rows(size_t n, size_t n_logits) const;
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
    std::unique_ptr<ds4_drafter> drafter_;  // engine_options::ds4_draft (one device: CPU or GPU), else null
    extras_buffers xb_;                     // forward_chunk's extras for the drafter
    size_t xb_rows_ = 0;                    // ... on one GPU: the rows they hold (the evaluation's last)
    ds4::state st_;  // CPU state (empty when the engine runs on CUDA or on several devices)
    // Several devices: this session's ranks (null after a failure until the next forward).
    std::unique_ptr<device_ranks> pl_;
    std::unique_ptr<gpu_sequence> gpu_;  // device state when the engine runs on one GPU (else null)
    std::vector<int32_t> tokens_;
    mutable std::vector<float> logits_;  // [n_vocab] of tokens_.back()
    bool have_logits_ = false;
    // CUDA: the last token's logits are still only on the device (logits() downloads them; sample()
    // summarises them there).
    mutable bool logits_on_device_ = false;
    // CUDA: eval_verify's evaluation in progress (forward_chunk leaves the rows on the device), and the rows
    // it left there for sample_row (0 after any other evaluation, truncate or reset).
    bool rows_to_device_ = false;
    size_t device_rows_ = 0;
};

class ds4_engine final : public engine {
  public:
    ds4_engine(const engine_options &o, std::shared_ptr<const gguf::file> file);

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

    // One device: the CPU (sessions' states in ds4::state) or one GPU (a gpu_sequence each);
    // not a pipeline. qat and kv change the saved rows; the backend and its numerics options everything
    // after a load (a CUDA state continues bit for bit only on CUDA, with the same indexer scoring).
    std::string state_identity() const override {
        if (pipelined()) return {};
        std::string backend;
        // the GPU's name too: the kernels' launch geometry (and so a few sums' order) follows its SM count
        if (gpu_)
            backend = std::string(" backend=cuda gpu=\"") + gpu_->name() + "\" indexer=" + (opts_.exact ? "exact" : "tensor-core");
        if (backend.empty() && ordinal_ >= 0) return {};
        if (backend.empty()) backend = std::string(" numerics=") + (opts_.exact ? "exact" : "quantised");
        std::call_once(identity_once_, [&] { file_identity_ = gguf::file_fingerprint(*file_); });
        return "deepseek4 file=" + file_identity_ + " kv=" + (opts_.kv == kv_precision::f32 ? "f32" : "f16") +
               " qat=" + opts_.ds4_qat + backend;
    }

    // ---- for sessions ----
    const ds4::model &model() const { return *model_; }
    // A session's drafter (null without engine_options::ds4_draft).
    std::unique_ptr<ds4_drafter> new_drafter() const {
        const ds4::hparams &hp = model_->hp;
        if (mtp_ && gpu_)  // the head on the device (ds4_gpu::load_mtp)
            return make_mtp_drafter(gpu_->new_mtp_head(), static_cast<size_t>(hp.n_hc) * static_cast<size_t>(hp.n_embd));
        if (mtp_) return make_mtp_drafter(*model_, mtp_, qat_, opts_.kv, exec_);
        if (dspark_ && gpu_) return gpu_->new_dspark_drafter();  // on the device (ds4_gpu::load_dspark)
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
    // One GPU: a fresh device sequence of n_ctx tokens (null on the CPU and on several devices). The
    // sequences share one prefill scratch (ds4_gpu): evaluations run under the forward mutex. Their
    // compressed and indexer rows are blocks of the ds4_gpu's state pool, mapped as they grow.
    std::unique_ptr<gpu_sequence> new_gpu_sequence() const { return gpu_ ? gpu_->new_sequence() : nullptr; }
    int max_gpu_step_rows() const { return gpu_ ? gpu_->max_step_rows() : 0; }  // rows of one GPU step (0: no GPU)
    // Paged state on one GPU: the state pool in the scheduler's terms, blocks of block_tokens positions,
    // each worth block_tokens times the rows' mean bytes per token (max_blocks: the pool's capacity in
    // them). n_used counts the sessions' mapped positions (each session's rounded up to whole blocks, as
    // kv_blocks() does), not the pool's 2 MiB blocks: every sequence also rounds each row region up to
    // whole 2 MiB blocks, which kv_pool_configure adds to the pool as slack. kv_pool_configure sets the block size
    // and caps the pool at max_blocks of them (0: the device memory the pool was sized to at load).
    // Elsewhere (CPU, several devices) no pool: the scheduler counts tokens.
    kv_pool_info kv_pool() const override;
    bool kv_pool_configure(int32_t block_tokens, int64_t max_blocks) override;
    // Bytes one scheduler block stands for (0 before kv_pool_configure, or without a state pool).
    double kv_block_bytes() const;
    int32_t kv_block_tokens() const { return kv_block_tokens_; }
    double measure_copy_bandwidth() override {
        if (ordinal_ >= 0) {
            std::lock_guard<std::mutex> lock(forward_mutex_);
            return gpu_measure_copy_bandwidth(ordinal_);
        }
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
    // One GPU (sync_step / decode_step): the items that append one token (decodes), a verification's
    // rows (n_rows > 0, after a free rollback to prefix[0, size - n_rows)) or a short prompt piece (at most
    // kPieceRows tokens past what the session holds) run as the rows of multi-row steps of up to 16 rows
    // (ds4_gpu::step_batch), each row bit-identical to its own decode step, and sessions drafting with the
    // MTP head observe their rows' final HC states; everything else (longer prompt chunks, deep
    // divergences, a full context, a bad token) goes through session::sync / sync_with_rows afterwards,
    // which report what they refuse.
    void run_gpu_step(std::span<const sync_item> items);
    static constexpr size_t kPieceRows = 8;  // run_gpu_step: the longest prompt piece evaluated as rows

    const tokenizer &tok() const {
        if (!tok_) throw error(opts_.model_path + ": the file has no tokenizer (tokenizer.ggml.model)");
        return *tok_;
    }

    // Loading (ds4_engine.cpp): the constructor's steps.
    void load_drafter();
    void make_cuda(int ordinal);
    void make_pipeline(const std::vector<int> &ordinals);
    void start_rank_procs(int P);
    void make_tp(const std::vector<int> &ordinals);
    std::vector<dist::layer_range> planned_ranges(const std::vector<int> &ordinals) const;
    void fill_info();

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
    // One CUDA device (make_cuda): the weights on it, the sessions' prefill scratch and state pool; else null.
    std::unique_ptr<ds4_gpu> gpu_;
    int32_t kv_block_tokens_ = 0;  // kv_pool_configure's block size (0: not configured)
    int ordinal_ = -1;  // CUDA device of measure_copy_bandwidth (-1: none)
    bool on_cuda_ = false;  // one CUDA device (make_cuda)
    mutable std::once_flag identity_once_;  // state_identity: the file's fingerprint, computed once
    mutable std::string file_identity_;
    std::shared_ptr<const ds4::mtp_weights> mtp_;        // ds4_draft "mtp"
    std::shared_ptr<const ds4::dspark_weights> dspark_;  // ds4_draft "dspark"
    // rank_procs: the rank processes (destroyed first: stops them while the model is still here).
    std::unique_ptr<dist::rank_procs> procs_;
    std::unique_ptr<ds4_checkpoints> ckpt_;  // see checkpoints()
};

}  // namespace fathom::ds4_detail
