// Test and benchmark hooks of DS4 on one CUDA device (deepseek4_cuda_testing.h): the upload with test
// switches, a sequence made deep without evaluating it, the profiled step, the greedy step and the graph
// replay count. The hooks reach the sequence's private state through cuda_testing::access, the friend
// that deepseek4_cuda.h declares.
#include "models/cuda/deepseek4_cuda_testing.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "backend/cuda/ds4_kernels.h"
#include "core/error.h"
#include "models/cuda/deepseek4_cuda_impl.h"

namespace fathom::ds4::cuda_testing {

std::shared_ptr<const cuda_weights> cuda_upload(const model &m, const cuda_run_options &o,
                                                const cuda_test_options &t,
                                                const std::function<void(uint64_t, uint64_t)> &progress) {
    std::shared_ptr<const cuda_weights> w = ds4::cuda_upload(m, o, progress);
    // ds4::cuda_upload made the weights as a non-const object (make_shared) and no sequence uses them
    // yet: setting the switches here is what setting them in the upload would be.
    const_cast<cuda_weights &>(*w).test = t;
    return w;
}

// The friend of cuda_sequence (deepseek4_cuda.h): the hooks that need its private state.
struct access {
    static void fill_synthetic(cuda_sequence &seq, int64_t n, uint64_t seed);
    static std::vector<std::pair<std::string, float>> profile_step(cuda_sequence &seq, int32_t tok);
    static int32_t step_greedy(cuda_sequence &seq, int32_t token);
    static uint64_t graph_replays(const cuda_sequence &seq) { return seq.replays_; }
};

void access::fill_synthetic(cuda_sequence &seq, int64_t n, uint64_t seed) {
    cuda_sequence::impl &p = *seq.p_;
    const hparams &hp = p.w->hp;
    if (n < 0 || n >= seq.n_ctx_) throw error("cuda ds4: synthetic depth " + std::to_string(n) + " outside [0, n_ctx)");
    seq.reset();
    seq.map_rows(n + 1);
    ck(cudaSetDevice(p.w->device), "selecting the device");
    // A pattern of 4096 rows of the widest row (head_dim) in the KV precision, N(0, 1) values.
    const size_t pat_rows = 4096, width = static_cast<size_t>(std::max(hp.head_dim, hp.idx_dim));
    std::vector<uint8_t> pat(pat_rows * width * p.kv_elem);
    uint64_t st = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < pat_rows * width; ++i) {
        double u1 = 0, u2 = 0;
        for (double *u : {&u1, &u2}) {
            st ^= st << 13, st ^= st >> 7, st ^= st << 17;
            *u = (static_cast<double>(st >> 11) + 0.5) / 9007199254740992.0;
        }
        const float v = static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
        if (p.kv_elem == 2) {
            const uint16_t h = cpu::f32_to_f16(v);
            std::memcpy(&pat[i * 2], &h, 2);
        } else {
            std::memcpy(&pat[i * 4], &v, 4);
        }
    }
    auto fill = [&](void *dst, size_t bytes) {
        size_t have = std::min(bytes, pat.size());
        ck(cudaMemcpy(dst, pat.data(), have, cudaMemcpyHostToDevice), "filling state");
        while (have < bytes) {
            const size_t c = std::min(have, bytes - have);
            ck(cudaMemcpy(static_cast<uint8_t *>(dst) + have, dst, c, cudaMemcpyDeviceToDevice), "filling state");
            have += c;
        }
    };
    const size_t d = static_cast<size_t>(hp.head_dim), Id = static_cast<size_t>(hp.idx_dim);
    for (size_t il = 0; il < p.ls.size(); ++il) {
        const int r = p.w->layers[il].ratio;
        layer_state_dev &ls = p.ls[il];
        fill(ls.ring, static_cast<size_t>(ring_rows(hp)) * d * p.kv_elem);
        // the layer's rows are every stride-th row of its kind's interleaved buffer (layer_state_dev::comp_stride)
        auto fill_rows = [&](void *dst, size_t stride, size_t row, int64_t rows) {
            std::vector<uint8_t> tmp(static_cast<size_t>(rows) * row);
            for (size_t o = 0; o < tmp.size(); o += pat.size()) std::memcpy(&tmp[o], pat.data(), std::min(pat.size(), tmp.size() - o));
            ck(cudaMemcpy2D(dst, stride, tmp.data(), row, row, static_cast<size_t>(rows), cudaMemcpyHostToDevice), "filling state");
        };
        if (r > 0 && n / r > 0) fill_rows(ls.comp_rows, ls.comp_stride, d * p.kv_elem, n / r);
        if (r == 4 && n / 4 > 0) fill_rows(ls.idx_rows, ls.idx_stride, Id * p.kv_elem, n / 4);
    }
    // The copies ran on the legacy stream, which the sequence's non-blocking streams do not wait
    // for (a device-to-device cudaMemcpy may return before it completes).
    ck(cudaDeviceSynchronize(), "filling state");
    seq.n_past_ = seq.reached_ = seq.floor_ = n;
}

std::vector<std::pair<std::string, float>> access::profile_step(cuda_sequence &seq, int32_t tok) {
    cuda_sequence::impl &p = *seq.p_;
    if (tok < 0 || tok >= p.w->hp.n_vocab || seq.n_past_ >= seq.n_ctx_) throw error("cuda ds4: profile_step: bad token or context full");
    ck(cudaSetDevice(p.w->device), "selecting the device");
    *p.h_pos = seq.n_past_;
    *p.h_token = tok;
    ck(cudaMemcpyAsync(p.pos, p.h_pos, sizeof(int64_t), cudaMemcpyHostToDevice, p.s), "uploading the position");
    ck(cudaMemcpyAsync(p.token, p.h_token, sizeof(int32_t), cudaMemcpyHostToDevice, p.s), "uploading the token");
    std::vector<std::pair<std::string, cudaEvent_t>> marks;
    p.mark = [&](const char *name) {
        cudaEvent_t e;
        ck(cudaEventCreate(&e), "creating an event");
        ck(cudaEventRecord(e, p.s), "recording an event");
        marks.emplace_back(name, e);
    };
    cd::launch_gpu_sleep(200'000'000, p.s);  // 200 ms: the host enqueues the whole step meanwhile
    try {
        p.enqueue_step();
    } catch (...) {
        p.mark = nullptr;
        throw;
    }
    p.mark = nullptr;
    ck(cudaStreamSynchronize(p.s), "profiled step");
    std::vector<std::pair<std::string, float>> out;
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
        float ms = 0;
        ck(cudaEventElapsedTime(&ms, marks[i].second, marks[i + 1].second), "event time");
        auto it = std::find_if(out.begin(), out.end(), [&](const auto &x) { return x.first == marks[i].first; });
        if (it == out.end()) out.emplace_back(marks[i].first, ms);
        else it->second += ms;
    }
    for (auto &m : marks) cudaEventDestroy(m.second);
    ++seq.n_past_;
    seq.reached_ = std::max(seq.reached_, seq.n_past_);
    return out;
}

int32_t access::step_greedy(cuda_sequence &seq, int32_t token) {
    if (!seq.p_->w->embed() || !seq.p_->w->head()) throw error("cuda ds4: step_greedy() needs the whole model");
    int32_t a = -1;
    seq.step(token, nullptr, &a);
    return a;
}


void fill_synthetic(cuda_sequence &seq, int64_t n, uint64_t seed) { access::fill_synthetic(seq, n, seed); }

std::vector<std::pair<std::string, float>> profile_step(cuda_sequence &seq, int32_t token) {
    return access::profile_step(seq, token);
}

int32_t step_greedy(cuda_sequence &seq, int32_t token) { return access::step_greedy(seq, token); }

uint64_t graph_replays(const cuda_sequence &seq) { return access::graph_replays(seq); }

}  // namespace fathom::ds4::cuda_testing
