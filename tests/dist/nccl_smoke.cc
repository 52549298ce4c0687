// NCCL transport smoke test (src/dist/nccl_transport.*), one process per rank:
//   nccl_smoke lonely ID_FILE        rank 0 of 2 whose peer never starts: init must fail by its
//                                    deadline (exit 0 when it does, with the error printed)
//   nccl_smoke pair RANK ID_FILE     2 ranks exchange a 1 MiB pattern both ways, then rank 0 waits
//                                    for a message rank 1 never sends (deadline); exit 0 on success.
//                                    Device = RANK mod the visible device count. With one GPU NCCL
//                                    refuses two ranks on one device: that must be a clean error.
// pair: rank 0 makes the rendezvous (nccl_root: NCCL id + liveness listener on 127.0.0.1) and writes
// its id ("<256 hex>@127.0.0.1:port") to ID_FILE, rank 1 polls for it. lonely uses a bare nccl_new_id()
// (no side channel, so only NCCL's init deadline can end it). NCCL_NVLS_ENABLE=0 is set here too.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "core/error.h"
#include "dist/nccl_transport.h"

using namespace fathom;
using namespace std::chrono_literals;

static std::string read_id(const std::string &path) {
    for (int i = 0; i < 200; ++i) {
        std::ifstream in(path);
        std::string s;
        if (in >> s && s.size() > 256) return s;  // "<256 hex>@127.0.0.1:port"
        std::this_thread::sleep_for(50ms);
    }
    throw error("nccl_smoke: no id in " + path);
}

static int pair(int rank, const std::string &id_path) {
    int n_dev = 0;
    cudaGetDeviceCount(&n_dev);
    dist::nccl_options o;
    o.device = n_dev > 0 ? rank % n_dev : 0;
    o.timeout = 5s;
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<dist::transport> t;
    try {
        if (rank == 0) {
            dist::nccl_root root(o);
            std::ofstream(id_path + ".tmp") << root.id();
            std::rename((id_path + ".tmp").c_str(), id_path.c_str());
            t = dist::make_nccl_transport(std::move(root), 2, o);
        } else {
            t = dist::make_nccl_transport(rank, 2, read_id(id_path), o);
        }
    } catch (const error &e) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: init refused after %.1f s (devices %d): %s\n", rank, s, n_dev, e.what());
        return n_dev < 2 ? 3 : 1;  // 3 = the expected refusal of two ranks on one GPU
    }
    std::vector<uint32_t> a(1 << 18), b(a.size());
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint32_t>(i * 2654435761u + rank);
    const int peer = 1 - rank;
    if (rank == 0) {
        t->send(peer, a.data(), a.size() * 4);
        t->recv(peer, b.data(), b.size() * 4);
    } else {
        t->recv(peer, b.data(), b.size() * 4);
        t->send(peer, a.data(), a.size() * 4);
    }
    bool ok = true;
    for (size_t i = 0; i < b.size(); ++i) ok &= b[i] == static_cast<uint32_t>(i * 2654435761u + peer);
    std::printf("rank %d: 1 MiB exchange %s\n", rank, ok ? "ok" : "WRONG DATA");
    if (rank == 0) {
        try {
            uint32_t x = 0;
            t->recv(peer, &x, 4);
            std::printf("rank 0: unexpected message\n");
            ok = false;
        } catch (const error &e) {
            const bool deadline = std::string(e.what()).find("timed out") != std::string::npos;
            std::printf("rank 0: silent peer -> %s%s\n", e.what(), deadline ? "" : " (WRONG: not the deadline)");
            ok &= deadline;
        }
    } else {
        // Stay alive but silent past rank 0's 5 s deadline: rank 0 must fail by that deadline, not
        // earlier through the side channel (this process is alive).
        std::this_thread::sleep_for(8s);
    }
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    try {
        const std::string mode = argc > 1 ? argv[1] : "";
        if (mode == "lonely" && argc == 3) {
            dist::nccl_options o;
            o.timeout = 3s;
            const auto t0 = std::chrono::steady_clock::now();
            try {
                auto t = dist::make_nccl_transport(0, 2, dist::nccl_new_id(), o);
            } catch (const error &e) {
                const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                std::printf("lonely: failed after %.1f s: %s\n", s, e.what());
                return s < 10 ? 0 : 1;
            }
            std::printf("lonely: init unexpectedly succeeded\n");
            return 1;
        }
        if (mode == "pair" && argc == 4) return pair(std::atoi(argv[2]), argv[3]);
        std::fprintf(stderr, "usage: nccl_smoke lonely ID_FILE | pair RANK ID_FILE\n");
        return 2;
    } catch (const std::exception &e) {
        std::printf("error: %s\n", e.what());
        return 1;
    }
}
