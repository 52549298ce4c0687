// Device memory in fixed-size physical blocks mapped into reserved virtual address ranges (the CUDA
// driver's virtual memory management: cuMemCreate / cuMemAddressReserve / cuMemMap).
//
// Why: a sequence's state grows with its context (DS4: compressed KV and indexer rows, ~6.9 KB per
// token at DS4-Flash), and many sequences share one GPU. Allocating every sequence's rows for the
// whole context up front wastes what short sequences never use; paging the rows through block tables
// would put an indirection into every attention and indexer kernel. Here each growing array keeps a
// contiguous virtual range reserved for its whole capacity (so kernels, captured graphs and their
// pointers never change), and physical blocks from one pool shared by all sequences are mapped behind
// it as the sequence grows: the block table is the GPU's page table.
//
// block_pool: the physical blocks of one device, each of the device's allocation granularity
// (block_bytes(), 2 MiB on current GPUs), created on first use up to a capacity and reused from a free
// list afterwards (released to the driver only by trim() or the pool's destruction). Thread-safe.
// vm_regions: the growing arrays of one owner (e.g. one sequence), each a reserved range mapped from the
// front; grow() is all or nothing over every region, so an owner never ends half-grown.
//
// The caller orders device work: blocks unmapped by shrink() or the destructor must no longer be read
// or written by queued kernels (synchronise the owner's streams first). This header has no CUDA
// includes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace fathom::cuda {

class block_pool {
  public:
    // Blocks on `device`, at most max_bytes of them mapped at once (rounded down to whole blocks; at
    // least one block). Throws fathom::error when the device has no virtual memory management.
    block_pool(int device, size_t max_bytes);
    ~block_pool();
    block_pool(const block_pool &) = delete;
    block_pool &operator=(const block_pool &) = delete;

    int device() const { return device_; }
    size_t block_bytes() const { return block_; }
    int64_t capacity() const;  // blocks
    int64_t used() const;                      // blocks mapped into some region now
    // A new capacity in blocks (at least 1; blocks already in use above it stay until given back).
    void set_capacity(int64_t blocks);
    // Release the idle blocks to the driver (the pool creates them again when needed).
    void trim();

    // Internal to vm_regions: n blocks for mapping, all or none (empty: the capacity, or the device's
    // memory, does not allow n more), and their return.
    std::vector<uint64_t> take(int64_t n);
    void give(std::span<const uint64_t> blocks);

  private:
    int device_ = 0;
    size_t block_ = 0;
    int64_t cap_ = 0;  // guarded by mu_ after construction
    mutable std::mutex mu_;
    int64_t used_ = 0;              // blocks handed out by take()
    std::vector<uint64_t> idle_;    // created, not mapped
};

class vm_regions {
  public:
    explicit vm_regions(std::shared_ptr<block_pool> pool);
    ~vm_regions();  // unmaps every block (back to the pool) and frees the address ranges
    vm_regions(const vm_regions &) = delete;
    vm_regions &operator=(const vm_regions &) = delete;

    // A new region of up to max_bytes (address space only, nothing mapped): its base address, stable for
    // the object's life. Regions are numbered in the order they are added.
    void *add(size_t max_bytes);
    size_t size() const { return regions_.size(); }
    // Map at least the first want[i] bytes of each region i (rounded up to blocks, capped at the region's
    // reservation); regions mapped further keep their blocks. All or nothing: false, changing nothing,
    // when the pool cannot supply the blocks. want.size() == size().
    bool grow(std::span<const size_t> want);
    // Blocks grow(want) would take (0: nothing to map).
    int64_t blocks_needed(std::span<const size_t> want) const;
    // Give back each region's blocks past its first keep[i] bytes (rounded up to blocks).
    void shrink(std::span<const size_t> keep);
    size_t mapped_bytes() const;
    const block_pool &pool() const { return *pool_; }

  private:
    struct region {
        uint64_t base = 0;    // reserved virtual address
        size_t reserved = 0;  // bytes, a multiple of the block size
        std::vector<uint64_t> blocks;  // mapped at base + i * block_bytes
    };
    std::shared_ptr<block_pool> pool_;
    std::vector<region> regions_;
    size_t blocks_for(const region &r, size_t bytes) const;
};

}  // namespace fathom::cuda
