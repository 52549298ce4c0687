// DS4 engine internals (ds4_internal.h): option checks, the device list, a session's ranks on several
// devices (device_ranks) and the helpers that the engine (ds4_engine.cpp) and its rank processes
// (ds4_rank_server.cpp) share. Definitions in ds4_devices.cpp. A pipeline's CUDA stages are
// dist/gpu_stage.h's (their weights uploaded with dist::upload_stage).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/pipeline.h"
#include "dist/rank_procs.h"
#include "dist/tp.h"
#include "fathom/engine.h"
#include "models/deepseek4.h"

namespace fathom::ds4_detail {

// engine_options::ds4_qat ("full", "fp4only", "off"); throws for anything else.
ds4::qat_mode parse_qat(const std::string &s);

// The option checks shared by the engine and its rank processes (threads, ctx, batch, layout, rank
// processes, checkpoint budget); throws one line.
void check_options(const engine_options &o);

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
std::vector<int> parse_device_list(const std::string &list);

// In-process pipelines: a rank waits at most this long for its neighbour. The driving rank waits
// for a whole chunk through every later rank (minutes for a 512-token chunk of the full model on a
// CPU); a rank that fails wakes its peers at once, so this only bounds a hang.
inline constexpr std::chrono::milliseconds pipeline_deadline = std::chrono::hours(1);

int online_cores();

// engine_options::n_ctx = 0: the training context (deepseek4.context_length; 0 = unknown), at most 8192.
// One definition for the engine and its rank processes (a CUDA stage's sequence capacity).
int64_t default_n_ctx(int64_t n_ctx_train);

// Block ranges -> "0-2,3-5" (inclusive block numbers: dist::parse_layer_ranges' format), the
// `--rank-layers` that rank 0 hands its rank processes.
std::string ranges_text(const std::vector<dist::layer_range> &ranges);

}  // namespace fathom::ds4_detail
