// How one engine splits a DeepSeek V4 model over several devices (docs/dist.md): the devices, the
// layout, and the plumbing of rank processes. engine_options holds one (engine_options::dist); the
// defaults are one device, in this process. Other architectures refuse a non-empty `devices`.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fathom {

struct dist_options {
    // DeepSeek V4 only: split the blocks over several devices of this process, e.g. "cpu,cpu" or
    // "cuda:0,cuda:1" (entries cpu | cuda | cuda:N; a device may repeat). Each session evaluates through
    // a layer pipeline with one thread per device, each device owning a contiguous block range
    // (docs/dist.md); the logits equal a one-device run on the same kind of device. "" = one device
    // (engine_options::device, which must then stay "cpu"). Other architectures throw; so do bad
    // entries, more devices than blocks and CUDA entries in a build without CUDA.
    std::string devices;
    // With `devices`: "pipeline" (above) or "tp": tensor + expert parallel, every device runs every block
    // on its share of the heads, output groups, routed experts and shared-expert width, one all-reduce per
    // sublayer (src/dist/tp.h; logits within f32 rounding of one device, not bit for bit). tp runs on CPU
    // devices only so far; the device count must divide the heads and output groups.
    std::string devices_layout = "pipeline";
    // With `devices` and the pipeline layout: evaluations of more than this many tokens (a prompt chunk)
    // go down the pipeline as micro-batches of this size, back to back, so the devices work at once
    // (rank r on micro-batch k while rank r + 1 is on k - 1); the logits are unchanged (bit for bit).
    // 0 = off (each chunk crosses whole: one device busy at a time).
    int64_t micro_batch = 0;

    // ---- rank processes (`--procs`; docs/dist.md "Several processes") ----
    // With `devices` (CPU and CUDA entries; layout tp: CPU only): ranks 1.. run as child processes of this
    // one instead of threads: the engine spawns `rank_command(r, P, id)` + `--rank-layers <its block
    // ranges> --ctx <its n_ctx>` for each (so every rank uses rank 0's split and sequence capacity), joins
    // them over TCP (src/dist/socket_transport.h) and supervises them. Each process uploads only its own
    // CUDA blocks. The logits equal the in-process ranks' bit for bit. A rank process that exits fails the
    // in-flight and every later forward with "dist: rank R (pid N) exited: <status>", the other ranks are
    // stopped, and on_rank_failure (if set) is called once with that line (from a supervisor thread).
    bool rank_procs = false;
    std::string rank_procs_host = "127.0.0.1";  // rank 0's listening address (another host: its address there)
    // Ranks 1..rank_procs_local-1 are spawned; the others (another host) are started by hand with the join
    // id printed on stderr. 0 = spawn every rank.
    int rank_procs_local = 0;
    // argv of rank `rank` of `world` joining `join_id` (argv[0] = the executable; the CLI gives
    // `fathom rank ...` with this engine's options).
    std::function<std::vector<std::string>(int rank, int world, const std::string &join_id)> rank_command;
    std::function<void(const std::string &line)> on_rank_failure;
    // A rank process only (serve_ds4_rank, `fathom rank --rank-layers`): the pipeline's block ranges as
    // rank 0 chose them, "0-2,3-5" (inclusive block numbers, one range per device); "" = the even split
    // (CPU entries only). The DS4 engine (rank 0) refuses it; other architectures ignore it.
    std::string rank_layers;
};

}  // namespace fathom
