// The DS4 rank-process server (ds4_session.h, serve_ds4_rank): the body of `fathom rank`, one rank of
// a DS4 engine's rank processes (dist_options::rank_procs).
#include "engine/ds4_session.h"

#include <algorithm>
#include <exception>
#include <memory>

#include "backend/cpu/thread_pool.h"
#include "core/error.h"
#include "dist/gpu_stage.h"
#include "dist/pipeline.h"
#include "dist/planner.h"
#include "dist/rank_procs.h"
#include "dist/tp.h"
#include "engine/ds4_devices.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"

namespace fathom {

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
    ds4_detail::check_options(o);
    if (o.dist.devices.empty()) throw error("rank: devices (--devices) are required, as given to rank 0");
    // throws for CUDA entries without CUDA
    const std::vector<int> ordinals = ds4_detail::parse_device_list(o.dist.devices);
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
    const ds4::qat_mode qat = ds4_detail::parse_qat(o.ds4_qat);
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
    if (dev.cuda_device >= 0) {  // parse_device_list refused CUDA entries in a build without CUDA
        // Rank 0 passes its n_ctx (--ctx); without it, the engine's default for this file.
        dev.n_ctx =
            o.n_ctx > 0 ? o.n_ctx : ds4_detail::default_n_ctx(file->get_int("deepseek4.context_length", 0));
        dev.cuda_graphs = o.cuda_graphs;
        dev.weights = dist::upload_stage(*m, dev.cuda_device, ranges[static_cast<size_t>(rank)], qat, o.kv, {});
    }
    cpu::thread_pool pool(o.n_threads > 0 ? o.n_threads : ds4_detail::online_cores());
    ds4::exec_options exec;
    exec.pool = &pool;
    exec.quantised = !o.exact;
    dist::socket_options so;
    so.timeout = ds4_detail::pipeline_deadline;
    so.join_timeout = std::chrono::minutes(10);
    const std::unique_ptr<dist::socket_transport> t = dist::make_socket_transport(rank, P, join_id, so);
    dist::serve_sessions(*t, [&]() -> std::unique_ptr<dist::session_rank> {
        if (tp) return std::make_unique<rank_session<dist::tp_rank>>(*m, *t, qat, o.kv, exec);
        return std::make_unique<rank_session<dist::pipeline_rank>>(*m, ranges, *t, qat, o.kv, exec, dev);
    });
}

}  // namespace fathom
