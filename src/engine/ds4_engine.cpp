// The DS4 engine (ds4_internal.h): loading (the constructor, one CUDA device, a pipeline or tp over
// several devices, rank processes) and the batched steps (sync_step / decode_step: one CPU device's
// multi-row forward, one GPU's multi-row steps, pipelines' in-flight batches).
#include "engine/ds4_internal.h"

#include <cstdio>
#include <exception>

#include "dist/gpu_stage.h"
#include "engine/device.h"
#include "engine/ds4_session.h"

namespace fathom::ds4_detail {

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

ds4_engine::ds4_engine(const engine_options &o, std::shared_ptr<const gguf::file> file)
    : opts_(o), file_(std::move(file)) {
    check_options(o);
    qat_ = parse_qat(o.ds4_qat);
    const int ordinal = resolve_cuda_ordinal(o.device);  // -1: CPU; throws for an unusable forced device
    if (!o.dist.devices.empty() && o.device != "cpu")
        throw error("devices '" + o.dist.devices + "' and device '" + o.device + "': give one or the other");
    if (!o.dist.rank_layers.empty())
        throw error("rank_layers '" + o.dist.rank_layers + "' is for rank processes (fathom rank) only");
    if (!o.ds4_draft.empty() && o.ds4_draft != "mtp" && o.ds4_draft != "dspark")
        throw error("ds4_draft '" + o.ds4_draft + "': expected mtp or dspark");
    if (!o.ds4_draft.empty() && !o.dist.devices.empty())
        throw error("--spec " + o.ds4_draft + ": DeepSeek V4 drafts (and rolls back) on one device (the CPU or one GPU), "
                    "not with --devices");
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
    if (mtp_ && gpu_) gpu_->load_mtp(*model_, *mtp_);  // the head beside the weights, sharing embedding and output
    if (dspark_ && gpu_) gpu_->load_dspark(*model_, *dspark_);  // likewise the DSpark drafter
    if (on_one_cpu() && o.ds4_checkpoint_mib > 0)
        ckpt_ = std::make_unique<ds4_checkpoints>(ds4_checkpoints::budget_from_mib(o.ds4_checkpoint_mib),
                                                  n_batch_);
    if (o.on_load_progress) o.on_load_progress(file_->size(), file_->size());
}

// engine_options::ds4_draft (checked in the constructor): the MTP head from ds4_draft_model or the
// model file itself, or a DSpark drafter; each validated against the model.
void ds4_engine::load_drafter() {
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

// Upload the weights to CUDA device `ordinal` (memory checked before any allocation) and size the
// sessions' state pool there (make_ds4_gpu).
void ds4_engine::make_cuda(int ordinal) {
    ds4_gpu_options go;
    go.ordinal = ordinal;
    go.qat = qat_;
    go.kv = opts_.kv;
    go.n_ctx = n_ctx_;
    go.prefill_chunk = n_batch_;
    go.cuda_graphs = opts_.cuda_graphs;
    go.file_bytes = file_->size();
    go.progress = [&](uint64_t done, uint64_t total) {
        if (opts_.on_load_progress && total) opts_.on_load_progress(done * file_->size() / total, file_->size());
    };
    gpu_ = make_ds4_gpu(*model_, go);
    ordinal_ = ordinal;
    on_cuda_ = true;
    info_.device = "cuda:" + std::to_string(ordinal) + " (" + gpu_->name() + ")";
    info_.decode_weight_bytes = static_cast<uint64_t>(gpu_->bytes_per_token());
}

double ds4_engine::kv_block_bytes() const {
    if (gpu_ && kv_block_tokens_ > 0) {
        const int64_t n = int64_t{1} << 20;  // the mean over a long context (ratio-128 rows included)
        return static_cast<double>(gpu_->row_bytes(n)) / static_cast<double>(n) * kv_block_tokens_;
    }
    return 0.0;
}

kv_pool_info ds4_engine::kv_pool() const {
    kv_pool_info i;
    const double per = kv_block_bytes();
    if (per <= 0) return i;
    const ds4_gpu::state_pool_info sp = gpu_->state_pool();
    const double B = static_cast<double>(sp.block_bytes);
    i.block_tokens = kv_block_tokens_;
    i.max_blocks = static_cast<int64_t>(static_cast<double>(sp.capacity) * B / per);
    i.n_blocks = i.max_blocks;
    i.n_used = gpu_->mapped_blocks(kv_block_tokens_);
    return i;
}

bool ds4_engine::kv_pool_configure(int32_t block_tokens, int64_t max_blocks) {
    if (!gpu_) return false;
    if (block_tokens < 1) throw error("kv pool: the block size must be >= 1 token");
    if (gpu_->state_pool().used > 0) throw error("kv pool: cannot reconfigure while sessions hold state blocks");
    kv_block_tokens_ = block_tokens;
    if (max_blocks > 0) {
        const double want = static_cast<double>(max_blocks) * kv_block_bytes();
        const ds4_gpu::state_pool_info sp = gpu_->state_pool();
        // + the rounding: every sequence rounds each of its row regions up to whole state blocks, and the
        // scheduler's blocks bound the sequences (each holds at least one), so a tiny model's pool still
        // holds every sequence the scheduler admits (without it, one state block: no sequence fit)
        const auto blocks = static_cast<int64_t>(std::ceil(want / static_cast<double>(sp.block_bytes))) +
                            static_cast<int64_t>(sp.regions) * max_blocks;
        gpu_->set_state_capacity(std::min(sp.capacity, blocks));
    }
    return true;
}

// dist_options::devices: one block range per device (the planner's when every device is a CUDA
// device, else an even split), each CUDA device's blocks uploaded once, info().device naming the
// layout ("pipeline: cpu blocks 0-2 | cuda:0 (NVIDIA H200) blocks 3-5"). With rank processes only
// stage 0 lives in this process: the later stages' CUDA blocks are uploaded by their rank processes
// (which get these ranges from start_rank_procs), so their stages_ entries stay without weights.
void ds4_engine::make_pipeline(const std::vector<int> &ordinals) {
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
            if (!opts_.dist.rank_procs || r == 0) {
                const double fsz = static_cast<double>(file_->size());
                st.weights = dist::upload_stage(*model_, st.cuda_device, lr, qat_, opts_.kv,
                                                [&](uint64_t done, uint64_t total) {
                    if (!opts_.on_load_progress || total == 0) return;
                    const double part = (r + static_cast<double>(done) / static_cast<double>(total)) / P;
                    opts_.on_load_progress(static_cast<uint64_t>(part * fsz), file_->size());
                });
                step_bytes += dist::stage_bytes_per_token(*st.weights);
            }
            name = "cuda:" + std::to_string(st.cuda_device) + " (" + gpu_query_memory(st.cuda_device).name + ")";
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
void ds4_engine::start_rank_procs(int P) {
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
void ds4_engine::make_tp(const std::vector<int> &ordinals) {
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
std::vector<dist::layer_range> ds4_engine::planned_ranges(const std::vector<int> &ordinals) const {
    std::vector<dist::layer_range> out;
    std::vector<dist::device_spec> specs;
    for (int d : ordinals) {
        const auto share = static_cast<uint64_t>(std::count(ordinals.begin(), ordinals.end(), d));
        specs.push_back({"cuda:" + std::to_string(d), gpu_query_memory(d).free_bytes / share});
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
    return out;
}

void ds4_engine::fill_info() {
    const ds4::hparams &hp = model_->hp;
    info_.arch = "deepseek4";
    info_.tool_format = "dsml";
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
    if (on_one_cpu() || on_cuda_) {  // one device: the decodes as one-token sync items of one batched step
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
        if (on_cuda_)
            run_gpu_step(items);
        else
            run_cpu_step(items);
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
        const size_t held = s.tokens_.size();
        // New rows: a verification's, a decode's one, or a short prompt piece (at most kPieceRows tokens past
        // what the session holds: a follow-up turn's text) evaluated as rows beside the decodes with their
        // numerics, whatever else shares the step; longer pieces take session::sync's chunked prefill.
        size_t n_new = it.n_rows > 0 ? static_cast<size_t>(it.n_rows) : 1;
        if (it.n_rows == 0 && p.size() > held + 1 && p.size() - held <= kPieceRows) n_new = p.size() - held;
        bool ok = s.gpu_ && it.n_rows <= gpu_->max_step_rows() && p.size() > n_new && p.size() <= static_cast<size_t>(n_ctx_) &&
                  (it.n_rows > 0 || it.want_logits || n_new > 1);
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
        const size_t B = static_cast<size_t>(gpu_->max_step_rows()), Vz = static_cast<size_t>(V),
                     S = static_cast<size_t>(model_->hp.n_hc) * static_cast<size_t>(model_->hp.n_embd);
        std::vector<float> lg, hc, feat;
        for (size_t b0 = 0; b0 < batch.size();) {
            std::vector<gpu_sequence *> seqs;
            std::vector<int> counts;
            std::vector<int32_t> toks;
            bool rows_wanted = false;
            size_t b1 = b0;
            for (; b1 < batch.size() && toks.size() + batch[b1].rows.size() <= B; ++b1) {
                seqs.push_back(batch[b1].s->gpu_.get());
                counts.push_back(static_cast<int>(batch[b1].rows.size()));
                toks.insert(toks.end(), batch[b1].rows.begin(), batch[b1].rows.end());
                // verification rows go to the host unless the item lets them stay (sampled there)
                rows_wanted = rows_wanted || (items[batch[b1].i].n_rows > 0 && !items[batch[b1].i].rows_on_device);
            }
            lg.resize(rows_wanted ? toks.size() * Vz : 0);
            // Every row's final HC state when a session of the step drafts with the MTP head, its features with
            // DSpark (observe below; every session of an engine drafts alike).
            bool hc_wanted = false;
            size_t F = 0;
            for (size_t k = b0; k < b1; ++k)
                if (const ds4_drafter *d = batch[k].s->drafter_.get()) {
                    hc_wanted = hc_wanted || d->wants_hc_state();
                    F = std::max(F, d->feature_layers().size() * static_cast<size_t>(model_->hp.n_embd));
                }
            hc.resize(hc_wanted ? toks.size() * S : 0);
            feat.resize(toks.size() * F);
            try {
                gpu_->step_batch(seqs, counts, toks, lg, hc, feat);
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
                if (it.n_rows > 0 && !it.rows_on_device)
                    std::copy(lg.begin() + static_cast<std::ptrdiff_t>(r * Vz), lg.begin() + static_cast<std::ptrdiff_t>((r + n) * Vz),
                              it.rows);
                // the step kept every sequence's rows on the device (gpu_sequence::rows_held)
                s.device_rows_ = it.n_rows > 0 && it.rows_on_device ? static_cast<size_t>(s.gpu_->rows_held()) : 0;
                if (s.device_rows_ != 0 && s.device_rows_ != n) throw error("sync_step: the device kept " +
                    std::to_string(s.device_rows_) + " of a verification's " + std::to_string(n) + " rows");
                r += n;
                s.tokens_.insert(s.tokens_.end(), batch[k].rows.begin(), batch[k].rows.end());
                s.draft_conf_.clear();
                s.have_logits_ = true;
                s.logits_on_device_ = true;  // the last row's: sample() summarises them on the device
                if (s.drafter_ && (!hc.empty() || F > 0))
                    s.drafter_->observe(s.tokens_, s.n_past() - static_cast<int64_t>(n),
                                        hc.empty() ? std::span<const float>() : std::span<const float>(hc).subspan((r - n) * S, n * S),
                                        F == 0 ? std::span<const float>() : std::span<const float>(feat).subspan((r - n) * F, n * F));
            }
            b0 = b1;
        }
    }
    for (size_t i : slow) {
        if (items[i].n_rows > 0) sync_with_rows(items[i]);
        else items[i].sess->sync(items[i].prefix);
    }
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

}  // namespace fathom::ds4_detail

namespace fathom {

std::unique_ptr<engine> make_ds4_engine(const engine_options &opts, std::shared_ptr<const gguf::file> file) {
    return std::make_unique<ds4_detail::ds4_engine>(opts, std::move(file));
}

}  // namespace fathom
