// NCCL implementation of dist::transport: one rank per process (one GPU each), point-to-point
// ncclSend/ncclRecv on a private stream, host data staged through a device buffer (the CPU pipeline
// passes host arrays; a GPU pipeline would pass device pointers instead, see docs/dist.md).
//
// Failure handling: the communicator is created non-blocking, and every wait (init, send, recv)
// polls cudaStreamQuery + ncclCommGetAsyncError against a deadline; on a timeout, an NCCL error or
// abort() the communicator is aborted (ncclCommAbort), so a dead or hung peer becomes a one-line
// fathom::error instead of a hang. NCCL cannot tell a receiver why its peer failed (a peer's abort
// reaches it as a remote error or as a timeout); the launcher that supervises the ranks reports the
// first rank's own reason. NCCL_NVLS_ENABLE defaults to 0 (NVLink multicast off) unless set.
//
// Built only with -DFATHOM_CUDA=ON (the file extension keeps it out of fathom_core's *.cpp glob;
// tests/dist/tests.cmake builds it into the fathom_dist_nccl library and the NCCL smoke test).
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "dist/transport.h"

namespace fathom::dist {

// A fresh NCCL unique id as 256 hex characters (rank 0 makes it; the launcher hands it to every
// rank, e.g. in FATHOM_NCCL_ID).
std::string nccl_new_id();

struct nccl_options {
    int device = 0;                                 // CUDA ordinal of this rank
    std::chrono::milliseconds timeout{60000};       // init / send / recv deadline
};

// Join the communicator `id_hex` as `rank` of `size`. Throws fathom::error (timeout included) if the
// other ranks do not join in time or NCCL refuses (e.g. two ranks on one GPU).
std::unique_ptr<transport> make_nccl_transport(int rank, int size, const std::string &id_hex,
                                               const nccl_options &o);

}  // namespace fathom::dist
