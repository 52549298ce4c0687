// `fathom plan`: placement of a DS4 GGUF over several devices (src/dist/planner.h). Reads only the
// GGUF header (metadata + tensor directory); free memory per device comes from CUDA when this build
// has it and the devices exist, else from --mem-gib (so it runs on any machine).
//
//   fathom plan -m MODEL --devices cuda:0,cuda:1 --ctx N [--mem-gib 141,141] [--layout pipeline|tp]
//               [--layers 0-21,22-42] [--kv f16|f32] [--seqs N] [--chunk N] [--reserve-gib G] [--json]
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "dist/planner.h"
#include "gguf/gguf.h"

namespace fathom::cli {

namespace {

struct plan_args {
    std::string model, devices = "cuda:0", mem_gib, layout = "pipeline", layers, kv = "f16";
    int64_t ctx = 0, chunk = 512;
    int seqs = 1;
    double reserve_gib = 1.5;
    bool json = false;
};

std::vector<std::string> split_commas(const std::string &s) {
    std::vector<std::string> out;
    size_t pos = 0;
    for (;;) {
        const size_t c = s.find(',', pos);
        out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
        if (c == std::string::npos) return out;
        pos = c + 1;
    }
}

uint64_t gib_to_bytes(const std::string &text) {
    size_t used = 0;
    double g = 0;
    try {
        g = std::stod(text, &used);
    } catch (const std::exception &) {
        used = 0;
    }
    if (used != text.size() || !(g > 0) || g > 1e6)
        throw error("plan: --mem-gib entry '" + text + "' is not a positive number of GiB");
    return static_cast<uint64_t>(std::llround(g * static_cast<double>(1ull << 30)));
}

// Device names and free bytes: --mem-gib when given, else cudaMemGetInfo of each cuda:N.
std::vector<dist::device_spec> resolve_devices(const plan_args &a) {
    std::vector<dist::device_spec> devs;
    for (const auto &name : split_commas(a.devices)) {
        if (name.empty()) throw error("plan: empty device name in --devices '" + a.devices + "'");
        devs.push_back({name, 0});
    }
    if (!a.mem_gib.empty()) {
        const auto mem = split_commas(a.mem_gib);
        if (mem.size() != devs.size())
            throw error("plan: --mem-gib has " + std::to_string(mem.size()) + " entries for " +
                        std::to_string(devs.size()) + " devices");
        for (size_t i = 0; i < devs.size(); ++i) devs[i].free_bytes = gib_to_bytes(mem[i]);
        return devs;
    }
    for (auto &d : devs) d.free_bytes = dist::device_free_bytes(d.name);
    return devs;
}

void plan_main(const plan_args &a) {
    if (a.ctx <= 0) throw error("plan: --ctx must be a positive number of tokens");
    const auto f = gguf::file::open(a.model);
    const auto inv = dist::inventory_from_gguf(*f);
    dist::plan_options o;
    o.n_ctx = a.ctx;
    o.n_seq = a.seqs;
    o.chunk = a.chunk;
    o.kv = a.kv == "f32" ? kv_precision::f32 : kv_precision::f16;
    o.kind = a.layout == "tp" ? dist::layout::tp : dist::layout::pipeline;
    if (!(a.reserve_gib >= 0) || a.reserve_gib > 1e6) throw error("plan: --reserve-gib must be >= 0");
    o.reserve_bytes = static_cast<uint64_t>(std::llround(a.reserve_gib * static_cast<double>(1ull << 30)));
    if (!a.layers.empty()) o.ranges = dist::parse_layer_ranges(a.layers);
    const auto p = dist::make_plan(inv, resolve_devices(a), o);
    write_out(a.json ? dist::plan_json(p) + "\n" : "model " + a.model + "\n" + dist::plan_text(p));
}

}  // namespace

void add_plan_command(CLI::App &app) {
    auto a = std::make_shared<plan_args>();
    auto *cmd = app.add_subcommand("plan", "Place a DeepSeek-V4 model over several devices (layers/experts, weights, "
                                           "KV, free memory left)");
    set_group(cmd, "Plan");
    cmd->add_option("-m,--model", a->model, "GGUF file (only its header is read)")->required();
    cmd->add_option("--devices", a->devices, "Comma-separated devices, e.g. cuda:0,cuda:1")->capture_default_str();
    cmd->add_option("--ctx", a->ctx, "Context length (tokens per sequence)")->required();
    cmd->add_option("--mem-gib", a->mem_gib,
                    "Free memory per device in GiB, comma-separated (default: queried from CUDA)");
    cmd->add_option("--layout", a->layout, "pipeline (layer ranges) or tp (tensor + expert parallel)")
        ->capture_default_str()
        ->check(CLI::IsMember({"pipeline", "tp"}));
    cmd->add_option("--layers", a->layers, "Pipeline override: inclusive block ranges per device, e.g. 0-21,22-42");
    cmd->add_option("--kv", a->kv, "KV cache precision")->capture_default_str()->check(CLI::IsMember({"f16", "f32"}));
    cmd->add_option("--seqs", a->seqs, "Sequences resident at once (KV per sequence)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    cmd->add_option("--chunk", a->chunk, "Prefill chunk in tokens (activation reserve)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    cmd->add_option("--reserve-gib", a->reserve_gib, "Fixed reserve per device (CUDA context, workspaces), GiB")
        ->capture_default_str();
    cmd->add_flag("--json", a->json, "Print the plan as JSON");
    cmd->callback([a]() { plan_main(*a); });
}

}  // namespace fathom::cli
