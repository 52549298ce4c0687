// The DS4 drafters' raw outputs for `fathom logits --mtp` / `--dspark` (include/fathom/drafter_logits.h).
#include "fathom/drafter_logits.h"

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <thread>

#include "backend/cpu/thread_pool.h"
#include "fathom/error.h"
#include "gguf/gguf.h"
#include "models/deepseek4.h"
#include "models/deepseek4_dspark.h"
#include "models/deepseek4_mtp.h"

namespace fathom {

namespace {

using ids_reader = std::function<std::vector<int32_t>(int32_t n_vocab)>;

ds4::qat_mode qat_of(const std::string &q) {
    return q == "off" ? ds4::qat_mode::off : q == "fp4only" ? ds4::qat_mode::fp4only : ds4::qat_mode::full;
}

// Calls fn(begin, end) over [0, n) in pieces of `chunk` (0 = one piece).
template <class F>
void chunks(int64_t n, int64_t chunk, F &&fn) {
    const int64_t step = chunk > 0 ? chunk : std::max<int64_t>(n, 1);
    for (int64_t b = 0; b < n; b += step) fn(b, std::min(n, b + step));
}

// Sparse synthetic files (fathom-gguf synth --sparse) hold zeros where the rows repeat: CUDA only.
void refuse_sparse(const gguf::file &f) {
    if (f.get_int("fathom.synth.replicate_rows", 0) > 0)
        throw error(f.path() +
                    ": a sparse synthetic file (fathom.synth.replicate_rows) is for CUDA benchmarks only");
}

void check_token(int64_t t, int32_t n_vocab, const char *opt) {
    if (t < 0 || t >= n_vocab)
        throw error(std::string("logits: ") + opt + " " + std::to_string(t) + " outside the vocabulary [0, " +
                    std::to_string(n_vocab) + ")");
}

// MTP logits of every position: the target prefills the ids keeping its final HC state per position,
// then the MTP block runs on rows (H_i, t_(i+1)), t_n = next_token.
drafter_logits_result run_mtp(const drafter_logits_args &a, const ds4::model &m, const ids_reader &read_ids,
                              const ds4::exec_options &exec, kv_precision kv) {
    const auto mtp = ds4::load_mtp(m, a.mtp);
    refuse_sparse(*mtp->file);
    check_token(a.next_token, m.hp.n_vocab, "--next-token");
    const std::vector<int32_t> ids = read_ids(m.hp.n_vocab);
    const int64_t n = static_cast<int64_t>(ids.size()), V = m.hp.n_vocab,
                  S = int64_t{m.hp.n_hc} * m.hp.n_embd;
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<float> hc(static_cast<size_t>(n * S));  // [n, n_hc, D]
    ds4::state st = ds4::new_state(m, qat_of(a.qat), kv);
    st.exec = exec;
    const std::span<const int32_t> sid(ids);
    chunks(n, a.chunk, [&](int64_t b, int64_t e) {
        ds4::forward(m, st, sid.subspan(b, e - b), std::span(pos).subspan(b, e - b),
                     {{}, std::span(hc).subspan(b * S, (e - b) * S)});
    });
    std::vector<int32_t> next(ids.begin() + 1, ids.end());
    next.push_back(static_cast<int32_t>(a.next_token));
    ds4::mtp_state ms = ds4::new_mtp_state(m, *mtp, qat_of(a.qat), kv);
    ms.exec = exec;
    drafter_logits_result r;
    r.n_rows = n;
    r.n_vocab = V;
    r.rows.resize(static_cast<size_t>(n * V));
    chunks(n, a.chunk, [&](int64_t b, int64_t e) {
        ds4::mtp_forward(m, *mtp, ms, std::span(hc).subspan(b * S, (e - b) * S),
                         std::span(next).subspan(b, e - b), std::span(pos).subspan(b, e - b),
                         std::span(r.rows).subspan(b * V, (e - b) * V));
    });
    return r;
}

// One DSpark block after the ids: the target runs over them capturing the drafter's features, then
// the drafter drafts greedily from seed_token at position n.
drafter_logits_result run_dspark(const drafter_logits_args &a, const ds4::model &m,
                                 const ids_reader &read_ids, const ds4::exec_options &exec, kv_precision kv) {
    const auto w = ds4::load_dspark(m, a.dspark);
    refuse_sparse(*w->file);
    check_token(a.seed_token, m.hp.n_vocab, "--seed-token");
    const std::vector<int32_t> ids = read_ids(m.hp.n_vocab);
    const int64_t n = static_cast<int64_t>(ids.size()), V = m.hp.n_vocab, F = w->feature_dim();
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), 0);
    // The drafter reads only the last `window` feature rows: keep those (tail [rows, F], first row at
    // position n - rows), not all n (12288 floats per token at the Flash geometry).
    std::vector<float> chunk_feat, tail;
    ds4::state st = ds4::new_state(m, qat_of(a.qat), kv);
    st.exec = exec;
    const std::span<const int32_t> sid(ids);
    const size_t keep = static_cast<size_t>(w->cfg.window * F);
    chunks(n, a.chunk, [&](int64_t b, int64_t e) {
        chunk_feat.resize(static_cast<size_t>((e - b) * F));
        ds4::dspark_capture(m, *w, st, sid.subspan(b, e - b), std::span(pos).subspan(b, e - b), chunk_feat);
        tail.insert(tail.end(), chunk_feat.begin(), chunk_feat.end());
        if (tail.size() > keep) tail.erase(tail.begin(), tail.end() - static_cast<std::ptrdiff_t>(keep));
    });
    const int64_t rows = static_cast<int64_t>(tail.size()) / F;
    const ds4::dspark_block b =
        ds4::dspark_draft(m, *w, qat_of(a.qat), exec, tail, n - rows, static_cast<int32_t>(a.seed_token));
    drafter_logits_result r;
    r.n_rows = 2 * static_cast<int64_t>(b.input_ids.size());
    r.n_vocab = V;
    r.rows = b.base_logits;
    r.rows.insert(r.rows.end(), b.corrected_logits.begin(), b.corrected_logits.end());
    const nlohmann::json j = {{"seed_position", b.seed_pos},      {"block_input_ids", b.input_ids},
                              {"ctx_positions", b.ctx_positions}, {"markov_prev_tokens", b.markov_prev},
                              {"draft_tokens", b.draft_tokens},   {"confidence_logit", b.confidence_logit},
                              {"confidence", b.confidence}};
    r.summary = j.dump();
    return r;
}

}  // namespace

drafter_logits_result drafter_logits(const drafter_logits_args &a, const ids_reader &read_ids) {
    const auto m = ds4::load_model(a.model_path);  // throws naming the file when it is not DS4
    refuse_sparse(*m->file);
    const int n_threads =
        a.threads > 0 ? a.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    std::unique_ptr<cpu::thread_pool> pool;
    ds4::exec_options exec;
    if (n_threads > 1) {
        pool = std::make_unique<cpu::thread_pool>(n_threads);
        exec.pool = pool.get();
    }
    const kv_precision kv = a.kv_type == "f32" ? kv_precision::f32 : kv_precision::f16;
    // Each loads and checks its drafter before reading the ids or evaluating anything.
    return a.mtp.empty() ? run_dspark(a, *m, read_ids, exec, kv) : run_mtp(a, *m, read_ids, exec, kv);
}

}  // namespace fathom
