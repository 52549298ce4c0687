// Device memory in physical blocks behind reserved virtual ranges (cuda_vmm.h), on the CUDA driver API.
// The driver's entry points come through the runtime (cudaGetDriverEntryPointByVersion), so nothing links
// libcuda: binaries still start, and skip their GPU work, on machines without a driver.
#include "backend/cuda/cuda_vmm.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "core/error.h"

namespace fathom::cuda {
namespace {

// The driver functions used here, resolved once.
struct driver_api {
    decltype(&::cuGetErrorString) get_error_string = nullptr;
    decltype(&::cuDeviceGet) device_get = nullptr;
    decltype(&::cuDeviceGetAttribute) device_get_attribute = nullptr;
    decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
    decltype(&::cuMemCreate) create = nullptr;
    decltype(&::cuMemRelease) release = nullptr;
    decltype(&::cuMemAddressReserve) reserve = nullptr;
    decltype(&::cuMemAddressFree) address_free = nullptr;
    decltype(&::cuMemMap) map = nullptr;
    decltype(&::cuMemUnmap) unmap = nullptr;
    decltype(&::cuMemSetAccess) set_access = nullptr;
};

template <class F>
void resolve(F &f, const char *name) {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || !p)
        throw error(std::string("cuda vmm: the driver has no ") + name);
    f = reinterpret_cast<F>(p);
}

const driver_api &drv() {
    static driver_api d;
    static std::once_flag once;
    std::call_once(once, [] {
        resolve(d.get_error_string, "cuGetErrorString");
        resolve(d.device_get, "cuDeviceGet");
        resolve(d.device_get_attribute, "cuDeviceGetAttribute");
        resolve(d.granularity, "cuMemGetAllocationGranularity");
        resolve(d.create, "cuMemCreate");
        resolve(d.release, "cuMemRelease");
        resolve(d.reserve, "cuMemAddressReserve");
        resolve(d.address_free, "cuMemAddressFree");
        resolve(d.map, "cuMemMap");
        resolve(d.unmap, "cuMemUnmap");
        resolve(d.set_access, "cuMemSetAccess");
    });
    return d;
}

void ck(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return;
    const char *s = nullptr;
    drv().get_error_string(r, &s);
    throw error(std::string("cuda vmm: ") + what + ": " + (s ? s : "unknown error"));
}

CUmemAllocationProp device_prop(int device) {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

}  // namespace

block_pool::block_pool(int device, size_t max_bytes) : device_(device) {
    // The runtime's primary context current on this thread (the driver calls below need one initialised).
    if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess)
        throw error("cuda vmm: cannot select device " + std::to_string(device));
    const driver_api &d = drv();
    CUdevice dev = 0;
    ck(d.device_get(&dev, device), "querying the device");
    int vmm = 0;
    ck(d.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), "querying the device");
    if (!vmm) throw error("cuda vmm: device " + std::to_string(device) + " has no virtual memory management");
    const CUmemAllocationProp prop = device_prop(device);
    ck(d.granularity(&block_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "querying the granularity");
    cap_ = std::max<int64_t>(1, static_cast<int64_t>(max_bytes / block_));
}

block_pool::~block_pool() {
    for (uint64_t h : idle_) drv().release(static_cast<CUmemGenericAllocationHandle>(h));
}

int64_t block_pool::capacity() const {
    std::lock_guard<std::mutex> lk(mu_);
    return cap_;
}

void block_pool::set_capacity(int64_t blocks) {
    std::lock_guard<std::mutex> lk(mu_);
    cap_ = std::max<int64_t>(1, blocks);
}

int64_t block_pool::used() const {
    std::lock_guard<std::mutex> lk(mu_);
    return used_;
}

void block_pool::trim() {
    std::lock_guard<std::mutex> lk(mu_);
    for (uint64_t h : idle_) drv().release(static_cast<CUmemGenericAllocationHandle>(h));
    idle_.clear();
}

std::vector<uint64_t> block_pool::take(int64_t n) {
    std::vector<uint64_t> out;
    if (n <= 0) return out;
    std::lock_guard<std::mutex> lk(mu_);
    if (used_ + n > cap_) return out;
    const CUmemAllocationProp prop = device_prop(device_);
    while (static_cast<int64_t>(out.size()) < n) {
        if (!idle_.empty()) {
            out.push_back(idle_.back());
            idle_.pop_back();
            continue;
        }
        CUmemGenericAllocationHandle h = 0;
        if (drv().create(&h, block_, &prop, 0) != CUDA_SUCCESS) {  // the device is out of memory
            idle_.insert(idle_.end(), out.begin(), out.end());
            return {};
        }
        out.push_back(static_cast<uint64_t>(h));
    }
    used_ += n;
    return out;
}

void block_pool::give(std::span<const uint64_t> blocks) {
    std::lock_guard<std::mutex> lk(mu_);
    idle_.insert(idle_.end(), blocks.begin(), blocks.end());
    used_ -= static_cast<int64_t>(blocks.size());
}

vm_regions::vm_regions(std::shared_ptr<block_pool> pool) : pool_(std::move(pool)) {
    if (!pool_) throw error("cuda vmm: no block pool");
}

vm_regions::~vm_regions() {
    const size_t B = pool_->block_bytes();
    for (region &r : regions_) {
        for (size_t i = 0; i < r.blocks.size(); ++i) drv().unmap(static_cast<CUdeviceptr>(r.base + i * B), B);
        pool_->give(r.blocks);
        drv().address_free(static_cast<CUdeviceptr>(r.base), r.reserved);
    }
}

void *vm_regions::add(size_t max_bytes) {
    const size_t B = pool_->block_bytes();
    region r;
    r.reserved = std::max<size_t>(1, (max_bytes + B - 1) / B) * B;
    CUdeviceptr p = 0;
    ck(drv().reserve(&p, r.reserved, B, 0, 0), "reserving address space");
    r.base = static_cast<uint64_t>(p);
    regions_.push_back(std::move(r));
    return reinterpret_cast<void *>(static_cast<uintptr_t>(regions_.back().base));
}

size_t vm_regions::blocks_for(const region &r, size_t bytes) const {
    const size_t B = pool_->block_bytes();
    return (std::min(bytes, r.reserved) + B - 1) / B;
}

int64_t vm_regions::blocks_needed(std::span<const size_t> want) const {
    if (want.size() != regions_.size()) throw error("cuda vmm: grow() needs one size per region");
    int64_t n = 0;
    for (size_t i = 0; i < regions_.size(); ++i) {
        const size_t have = regions_[i].blocks.size(), need = blocks_for(regions_[i], want[i]);
        n += static_cast<int64_t>(need > have ? need - have : 0);
    }
    return n;
}

bool vm_regions::grow(std::span<const size_t> want) {
    const int64_t n = blocks_needed(want);
    if (n == 0) return true;
    std::vector<uint64_t> got = pool_->take(n);
    if (got.empty()) return false;
    const size_t B = pool_->block_bytes();
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = pool_->device();
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    size_t next = 0;
    try {
        for (size_t i = 0; i < regions_.size(); ++i) {
            region &r = regions_[i];
            const size_t first = r.blocks.size(), need = blocks_for(r, want[i]);
            for (size_t b = first; b < need; ++b) {
                ck(drv().map(static_cast<CUdeviceptr>(r.base + b * B), B, 0,
                            static_cast<CUmemGenericAllocationHandle>(got[next]), 0),
                   "mapping a block");
                r.blocks.push_back(got[next++]);
            }
            if (need > first)
                ck(drv().set_access(static_cast<CUdeviceptr>(r.base + first * B), (need - first) * B, &access, 1),
                   "setting access to blocks");
        }
    } catch (...) {
        // A driver failure part way: the blocks not yet mapped go back; those mapped stay with their region.
        pool_->give(std::span<const uint64_t>(got).subspan(next));
        throw;
    }
    return true;
}

void vm_regions::shrink(std::span<const size_t> keep) {
    if (keep.size() != regions_.size()) throw error("cuda vmm: shrink() needs one size per region");
    const size_t B = pool_->block_bytes();
    for (size_t i = 0; i < regions_.size(); ++i) {
        region &r = regions_[i];
        const size_t k = blocks_for(r, keep[i]);
        if (r.blocks.size() <= k) continue;
        for (size_t b = k; b < r.blocks.size(); ++b)
            ck(drv().unmap(static_cast<CUdeviceptr>(r.base + b * B), B), "unmapping a block");
        pool_->give(std::span<const uint64_t>(r.blocks).subspan(k));
        r.blocks.resize(k);
    }
}

size_t vm_regions::mapped_bytes() const {
    size_t n = 0;
    for (const region &r : regions_) n += r.blocks.size();
    return n * pool_->block_bytes();
}

}  // namespace fathom::cuda
