// DS4 attention sublayer (spec section 4): low-rank Q with per-head norm, one shared K=V row,
// partial interleaved RoPE, the raw sliding-window ring, the KV compressors (ratio 4 with
// overlapping windows, ratio 128 without), the indexer's top-k choice of compressed rows, sink
// attention, inverse RoPE on outputs and the grouped low-rank output projection.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <span>

#include "models/deepseek4_impl.h"
#include "models/deepseek4_qat.h"

namespace fathom::ds4 {

rope_set make_rope_set(const hparams &hp) {
    rope_set r;
    r.plain = rope_plain(hp.rope_base, hp.n_rot);
    r.yarn = rope_yarn(hp.compress_rope_base, hp.n_rot, hp.yarn_factor, hp.yarn_orig_ctx, hp.yarn_beta_fast,
                       hp.yarn_beta_slow);
    return r;
}

// ---- compressor --------------------------------------------------------------------------------------

bool compressor_push(compressor_state &s, const compressor_weights &w, const float *a, const float *g,
                     int64_t pos, float *pooled) {
    const int R = w.ratio, dp = w.dim;
    const bool overlap = R == 4;
    const size_t width = static_cast<size_t>((overlap ? 2 : 1) * dp);
    const int64_t slots = static_cast<int64_t>(s.kv.size() / width);
    const int phase = static_cast<int>(pos % R);
    const size_t slot = static_cast<size_t>(pos % slots);
    const float *ape = w.ape.data() + static_cast<size_t>(phase) * width;
    for (size_t j = 0; j < width; ++j) {
        s.kv[slot * width + j] = a[j];
        s.score[slot * width + j] = g[j] + ape[j];
    }
    if ((pos + 1) % R != 0) return false;

    // Candidates per channel j, by position: overlap -> the previous block's first half (positions
    // start - R .. start - 1, column j) then this block's second half (start .. pos, column dp + j);
    // otherwise this block's positions, column j. Positions < 0 are empty (score -inf, value 0).
    const int64_t start = pos + 1 - R, first = overlap ? start - R : start;
    const int n_cand = overlap ? 2 * R : R;
    std::vector<float> wgt(static_cast<size_t>(n_cand)), sc(static_cast<size_t>(n_cand)), val(static_cast<size_t>(n_cand));
    for (int j = 0; j < dp; ++j) {
        for (int t = 0; t < n_cand; ++t) {
            const int64_t q = first + t;
            const size_t col = static_cast<size_t>(overlap && t >= R ? dp + j : j);
            const size_t at = static_cast<size_t>(q % slots) * width + col;
            sc[static_cast<size_t>(t)] = q < 0 ? -INFINITY : s.score[at];
            val[static_cast<size_t>(t)] = q < 0 ? 0.0f : s.kv[at];
        }
        float mx = -INFINITY;
        for (int t = 0; t < n_cand; ++t) mx = std::max(mx, sc[static_cast<size_t>(t)]);
        float sum = 0;
        for (int t = 0; t < n_cand; ++t) sum += (wgt[static_cast<size_t>(t)] = std::exp(sc[static_cast<size_t>(t)] - mx));
        float acc = 0;
        for (int t = 0; t < n_cand; ++t) {
            const float wt = wgt[static_cast<size_t>(t)] / sum;
            if (wt != 0.0f) acc += val[static_cast<size_t>(t)] * wt;  // skips empty (-inf score, value 0) candidates
        }
        pooled[j] = acc;
    }
    return true;
}

// Emitted row: RMSNorm, RoPE at the block start, then the QAT round trip of its kind.
static void compressor_finish(const hparams &hp, const rope_set &ropes, const compressor_weights &w,
                              bool indexer, qat_mode qat, int64_t pos, float *row) {
    rms_norm(row, w.dim, w.norm.data(), hp.rms_eps, row);
    const int64_t block_start = pos + 1 - w.ratio;
    rope_apply(row + (w.dim - hp.n_rot), ropes.yarn, block_start, false);
    if (indexer) {
        if (qat != qat_mode::off) {
            hadamard_normalised(row, w.dim);
            fp4_round_trip(row, w.dim);
        }
    } else if (qat == qat_mode::full) {
        fp8_round_trip(row, w.dim - hp.n_rot);
    }
}

// ---- indexer and attention kernels ------------------------------------------------------------------

std::vector<int64_t> indexer_select(const float *q, const float *w, const row_store &rows, int64_t n,
                                    int idx_head, int idx_dim, int topk) {
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    if (n <= topk) return idx;
    std::vector<float> score(static_cast<size_t>(n)), k(static_cast<size_t>(idx_dim)),
        dh(static_cast<size_t>(idx_head));
    for (int64_t c = 0; c < n; ++c) {
        rows.get(c, k.data());
        dot_f32_rows(k.data(), q, idx_head, idx_dim,
                     dh.data());  // dot(k, q_h) == dot(q_h, k): exact products
        float s = 0;
        for (int h = 0; h < idx_head; ++h) s += w[h] * std::max(0.0f, dh[static_cast<size_t>(h)]);
        score[static_cast<size_t>(c)] = s;
    }
    std::partial_sort(idx.begin(), idx.begin() + topk, idx.end(), [&](int64_t a, int64_t b) {
        const float sa = score[static_cast<size_t>(a)], sb = score[static_cast<size_t>(b)];
        return sa > sb || (sa == sb && a < b);
    });
    idx.resize(static_cast<size_t>(topk));
    std::sort(idx.begin(), idx.end());
    return idx;
}

// o[i] += p * v[i]: one multiply and one add per element, the same bits at every vector width. GCC's
// avx512f target implies FMA, and its clone used to contract this into an FMA (other bits than the avx2
// and default clones); contraction is off here.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=off"))) static void axpy_f32(
    float p, const float *v, float *o, int64_t n) {
    for (int64_t i = 0; i < n; ++i) o[i] += p * v[i];
}

// Heads [h0, h1) 4 at a time on AVX-512 or AVX2 + FMA (attention_scores_heads4 / attention_values_heads2: the bits
// of the one-head loop below, whose softmax they share); returns the first head left to the loop.
static int64_t attend_heads_grouped(const float *q, const float *kv, int64_t n, const float *sinks, int64_t h0,
                                    int64_t h1, int64_t d, float scale, float *o) {
    if (!attention_heads_grouped(d)) return h0;
    thread_local std::vector<float> s, pr;
    s.resize(static_cast<size_t>(4 * n));
    pr.resize(static_cast<size_t>(4 * n));
    int64_t h = h0;
    for (; h + 4 <= h1; h += 4) {
        attention_scores_heads4(q + h * d, kv, n, d, s.data());
        for (int k = 0; k < 4; ++k) {
            float *sk = &s[static_cast<size_t>(k * n)], *pk = &pr[static_cast<size_t>(k * n)];
            float mx = sinks[h + k];
            for (int64_t r = 0; r < n; ++r) mx = std::max(mx, sk[r] *= scale);
            float denom = std::exp(sinks[h + k] - mx);
            for (int64_t r = 0; r < n; ++r) denom += (sk[r] = std::exp(sk[r] - mx));
            for (int64_t r = 0; r < n; ++r) pk[r] = sk[r] / denom;
        }
        attention_values_heads2(pr.data(), kv, n, d, o + h * d);
        attention_values_heads2(pr.data() + 2 * n, kv, n, d, o + (h + 2) * d);
    }
    return h;
}

void attend_with_sink(const float *q, const float *kv, int64_t n, const float *sinks, int n_head, int64_t d,
                      float scale, float *o) {
    // Heads are independent: split across the exec pool (same bits for any split).
    parallel_for(n_head, n * d * 2, [&](int64_t h0, int64_t h1) {
        std::vector<float> s(static_cast<size_t>(n));
        for (int64_t h = attend_heads_grouped(q, kv, n, sinks, h0, h1, d, scale, o); h < h1; ++h) {
            const float *qh = q + h * d;
            float mx = sinks[h];
            dot_f32_rows(qh, kv, n, d, s.data());
            for (int64_t r = 0; r < n; ++r) mx = std::max(mx, s[static_cast<size_t>(r)] *= scale);
            float denom = std::exp(sinks[h] - mx);
            for (int64_t r = 0; r < n; ++r)
                denom += (s[static_cast<size_t>(r)] = std::exp(s[static_cast<size_t>(r)] - mx));
            float *oh = o + h * d;
            std::fill(oh, oh + d, 0.0f);
            for (int64_t r = 0; r < n; ++r) {
                axpy_f32(s[static_cast<size_t>(r)] / denom, kv + r * d, oh, d);
            }
        }
    });
}

// ---- attention sublayer -------------------------------------------------------------------------------

namespace {

// Per-chunk projections of the attention sublayer (all [n, ...] row-major).
struct attn_proj {
    std::vector<float> q_lat;     // [n, q_lora]
    std::vector<float> q;         // [n, H*d]  normed per head, RoPE'd
    std::vector<float> kv;        // [n, d]    normed, RoPE'd, QAT-1
    std::vector<float> ca, cg;    // [n, c*d]  attention compressor inputs
    std::vector<float> iq;        // [n, IH*Id] indexer queries (RoPE, QAT-2)
    std::vector<float> iw;        // [n, IH]    indexer head weights (scaled)
    std::vector<float> ica, icg;  // [n, 2*Id]  indexer compressor inputs
};

// y [n, w.rows] = W x. y is reused across calls (no fresh pages to fault in and clear per chunk).
void project(std::vector<float> &y, const matrix &w, const float *x, int64_t n) {
    y.resize(static_cast<size_t>(n * w.rows));
    matmul(w, x, n, y.data());
}

// What the layer's state takes from each row (the KV row; the compressors' inputs, the indexer
// compressor's on ratio-4 layers): the part of the projections the rows' queries do not need.
void project_state(const hparams &hp, const rope_set &ropes, const layer_weights &l, qat_mode qat, const float *xn,
                   std::span<const int64_t> pos, attn_proj &p) {
    const int64_t n = static_cast<int64_t>(pos.size()), d = hp.head_dim, nr = hp.n_rot;
    const rope_table &rope = ropes.for_ratio(l.ratio);
    project(p.kv, l.kv, xn, n);
    parallel_for(n, 4 * d + 16 * nr, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            float *k = &p.kv[static_cast<size_t>(i * d)];
            rms_norm(k, d, l.kv_norm.data(), hp.rms_eps, k);
            rope_apply(k + (d - nr), rope, pos[static_cast<size_t>(i)], false);
            if (qat == qat_mode::full) fp8_round_trip(k, d - nr);
        }
    });
    if (l.ratio > 0) {
        project(p.ca, l.comp.kv, xn, n);
        project(p.cg, l.comp.gate, xn, n);
    }
    if (l.ratio == 4) {
        project(p.ica, l.idx_comp.kv, xn, n);
        project(p.icg, l.idx_comp.gate, xn, n);
    }
}

// Queries of heads [s.head0, s.head1) only (p.q [n, (head1-head0)*d]); the rest in full.
void project_attention(const hparams &hp, const rope_set &ropes, const layer_weights &l, qat_mode qat,
                       const float *xn, std::span<const int64_t> pos, const tp_slice &s, attn_proj &p) {
    const int64_t n = static_cast<int64_t>(pos.size()), d = hp.head_dim, nr = hp.n_rot;
    const rope_table &rope = ropes.for_ratio(l.ratio);
    project(p.q_lat, l.q_a, xn, n);
    // The per-row norms and rotations below run over the pool (rows are independent: the same bits).
    parallel_for(n, 4 * hp.q_lora, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i)
            rms_norm(&p.q_lat[static_cast<size_t>(i * hp.q_lora)], hp.q_lora, l.q_a_norm.data(), hp.rms_eps,
                     &p.q_lat[static_cast<size_t>(i * hp.q_lora)]);
    });
    const int Hs = s.head1 - s.head0;  // this rank's heads (all of them on one rank)
    project(p.q, matrix_rows(l.q_b, s.head0 * d, s.head1 * d), p.q_lat.data(), n);
    parallel_for(n, Hs * (4 * d + 16 * nr), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            float *qi = &p.q[static_cast<size_t>(i * Hs * d)];
            for (int h = 0; h < Hs; ++h) rms_norm(qi + h * d, d, nullptr, hp.rms_eps, qi + h * d);
            rope_apply_heads(qi + (d - nr), d, Hs, rope, pos[static_cast<size_t>(i)], false);
        }
    });
    project_state(hp, ropes, l, qat, xn, pos, p);
}

// Row ui's state updates at position pos (all precede its attention): the raw ring, the compressors.
// row / irow: scratch of d and idx_dim floats.
void push_state(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls, qat_mode qat,
                const attn_proj &p, size_t ui, int64_t pos, float *row, float *irow) {
    const size_t d = static_cast<size_t>(hp.head_dim), cw = (l.ratio == 4 ? 2 : 1) * d,
                 icw = static_cast<size_t>(2 * hp.idx_dim);
    ls.raw.set(pos % ls.raw.size(), &p.kv[ui * d]);  // window + rollback rows, slot = pos mod ring
    if (l.ratio > 0 && compressor_push(ls.comp, l.comp, &p.ca[ui * cw], &p.cg[ui * cw], pos, row)) {
        compressor_finish(hp, ropes, l.comp, false, qat, pos, row);
        ls.comp_rows.push(row);
    }
    if (l.ratio == 4 && compressor_push(ls.idx_comp, l.idx_comp, &p.ica[ui * icw], &p.icg[ui * icw], pos, irow)) {
        compressor_finish(hp, ropes, l.idx_comp, true, qat, pos, irow);
        ls.idx_rows.push(irow);
    }
}

void project_indexer(const hparams &hp, const rope_set &ropes, const layer_weights &l, qat_mode qat,
                     const float *xn, std::span<const int64_t> pos, attn_proj &p) {
    const int64_t n = static_cast<int64_t>(pos.size()), Id = hp.idx_dim;
    project(p.iq, l.idx_q_b, p.q_lat.data(), n);
    parallel_for(n, hp.idx_head * (16 * Id), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            rope_apply_heads(&p.iq[static_cast<size_t>(i * hp.idx_head * Id + Id - hp.n_rot)], Id, hp.idx_head,
                             ropes.yarn, pos[static_cast<size_t>(i)], false);
            if (qat == qat_mode::off) continue;
            for (int h = 0; h < hp.idx_head; ++h) {
                float *qh = &p.iq[static_cast<size_t>((i * hp.idx_head + h) * Id)];
                hadamard_normalised(qh, Id);
                fp4_round_trip(qh, Id);
            }
        }
    });
    project(p.iw, l.idx_proj, xn, n);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Id) * hp.idx_head));
    for (float &w : p.iw) w *= scale;
}

// Grouped low-rank output projection (spec 4.7) of groups [s.group0, s.group1) over m rows: og
// [Gs, m, gd] (group-major: the heads of group g of row i at og[(g*m + i)*gd]) -> y [m, D] (a partial
// sum when the groups are not all of them: the column block of o_b). Every product takes all m rows
// at once (the weights are read once per block of rows, not once per row); each row's arithmetic is
// that of a lone row (matmul is per row), so batching does not change a bit.
void output_projection(const hparams &hp, const layer_weights &l, const tp_slice &s, const float *og,
                       int64_t m, float *y) {
    const int64_t gd = static_cast<int64_t>(hp.n_head / hp.o_groups) * hp.head_dim, r = hp.o_rank;
    const int Gs = s.group1 - s.group0;
    thread_local std::vector<float> zg, z;
    zg.resize(static_cast<size_t>(m * r));
    z.resize(static_cast<size_t>(m * Gs * r));  // [m, Gs*o_rank]
    for (int g = 0; g < Gs; ++g) {
        const int64_t ga = s.group0 + g;  // absolute group id: rows of o_a
        matmul_rows(l.out_a, ga * r, (ga + 1) * r, og + static_cast<size_t>(g * m * gd), m, zg.data());
        for (int64_t i = 0; i < m; ++i)
            std::copy_n(&zg[static_cast<size_t>(i * r)], r, &z[static_cast<size_t>((i * Gs + g) * r)]);
    }
    matmul(matrix_cols(l.out_b, s.group0 * r, s.group1 * r, "attn_output_b"), z.data(), m, y);
}

// The candidate rows of one row of the step, [raw window first..pos | chosen compressed rows] as f32
// (d values each), for attend_with_sink. Consecutive rows of one sequence share all but one row of
// their raw window, so the window is kept from one row to the next (the new row appended, the ones
// that left it skipped) instead of converting its W rows from f16 again per row (that serial gather
// was ~2 % of the prefill samples while the other thread waited). The values are those of
// row_store::get, so the attention sees the same rows.
struct candidate_rows {
    std::vector<float> buf;             // [cap rows, d]; the window starts at row off
    const layer_state *ls = nullptr;    // whose window buf holds (nullptr: none)
    int64_t first = 0, last = -1, off = 0;

    // Forget the window (a new step: the state may have been rolled back since); the buffer stays.
    void reset() {
        ls = nullptr;
        off = 0;
    }

    // Returns the first of the n_raw + sel.size() rows.
    const float *gather(const layer_state &st, int64_t first_pos, int64_t pos, std::span<const int64_t> sel,
                        int64_t d) {
        const int64_t ring = st.raw.size(), n_raw = pos - first_pos + 1;
        const bool slide = ls == &st && last + 1 == pos && first <= first_pos && first_pos <= pos;
        if (slide) {
            off += first_pos - first;  // rows that left the window
        } else {
            off = 0;
        }
        const int64_t kept = slide ? last - first_pos + 1 : 0;  // rows already in place
        const int64_t need = n_raw + static_cast<int64_t>(sel.size());
        if (off > 0 && static_cast<int64_t>(buf.size()) < (off + need) * d) {  // move the kept rows to the front
            std::memmove(buf.data(), buf.data() + off * d, static_cast<size_t>(kept * d) * sizeof(float));
            off = 0;
        }
        if (static_cast<int64_t>(buf.size()) < (off + need) * d)
            buf.resize(static_cast<size_t>((off + need + 256) * d));  // slack: ~256 rows slide before a move
        float *w = buf.data() + off * d;
        for (int64_t q = first_pos + kept; q <= pos; ++q) st.raw.get(q % ring, w + (q - first_pos) * d);
        for (size_t c = 0; c < sel.size(); ++c) st.comp_rows.get(sel[c], w + (n_raw + static_cast<int64_t>(c)) * d);
        ls = &st;
        first = first_pos;
        last = pos;
        return w;
    }
};

}  // namespace

void attention_layer(const hparams &hp, const rope_set &ropes, const layer_weights &l, layer_state &ls,
                     qat_mode qat, const float *xn, std::span<const int64_t> positions, float *y,
                     const tp_slice *slice) {
    const std::vector<layer_state *> states(positions.size(), &ls);
    attention_rows(hp, ropes, l, states, qat, xn, positions, y, slice);
}

void attention_rows(const hparams &hp, const rope_set &ropes, const layer_weights &l,
                    std::span<layer_state *const> states, qat_mode qat, const float *xn,
                    std::span<const int64_t> positions, float *y, const tp_slice *slice) {
    const tp_slice s = slice ? *slice : tp_whole(hp);
    // H: the heads evaluated here (all of them, or one tensor-parallel rank's share).
    const int64_t n = static_cast<int64_t>(positions.size()), d = hp.head_dim, H = s.head1 - s.head0, W = hp.window;
    // Per-thread buffers kept between calls: a 256-row chunk's projections are ~45 MB, and fresh
    // allocations of that size are mmapped, faulted in and cleared on every layer (~2.5 % of prefill).
    thread_local attn_proj p;
    project_attention(hp, ropes, l, qat, xn, positions, s, p);
    if (l.ratio == 4) project_indexer(hp, ropes, l, qat, xn, positions, p);
    thread_local candidate_rows cand;  // its buffer kept between calls (as p's), its window not
    cand.reset();
    std::vector<float> row(static_cast<size_t>(d)), irow(static_cast<size_t>(hp.idx_dim));
    std::vector<float> o(static_cast<size_t>(H * d));
    // Attention outputs of a block of up to `blk` rows, group-major [Gs, blk, gd], projected together.
    const int Gs = s.group1 - s.group0;
    const int64_t gd = static_cast<int64_t>(hp.n_head / hp.o_groups) * d, blk = std::min<int64_t>(n, 64);
    thread_local std::vector<float> og;
    og.resize(static_cast<size_t>(Gs * blk * gd));
    int64_t b0 = 0;  // first row of the pending block
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = positions[static_cast<size_t>(i)];
        const size_t ui = static_cast<size_t>(i);
        layer_state &ls = *states[ui];  // this row's sequence
        // 1. state updates for token pos (all precede its attention): raw ring, compressors.
        push_state(hp, ropes, l, ls, qat, p, ui, pos, row.data(), irow.data());
        // 2. candidate rows: raw window max(0, pos-W+1)..pos, then the chosen compressed rows.
        const int64_t first = std::max<int64_t>(0, pos - W + 1);
        const int64_t n_comp = l.ratio > 0 ? ls.comp_rows.size() : 0;
        std::vector<int64_t> sel;
        if (l.ratio == 4)
            sel = indexer_select(&p.iq[ui * static_cast<size_t>(hp.idx_head * hp.idx_dim)],
                                 &p.iw[ui * static_cast<size_t>(hp.idx_head)], ls.idx_rows, n_comp,
                                 hp.idx_head, hp.idx_dim, hp.idx_topk);
        else if (l.ratio > 0) {
            sel.resize(static_cast<size_t>(n_comp));
            std::iota(sel.begin(), sel.end(), 0);
        }
        const int64_t n_rows = pos - first + 1 + static_cast<int64_t>(sel.size());
        const float *rows = cand.gather(ls, first, pos, sel, d);
        // 3. sink attention, inverse RoPE on each head's output, grouped output projection.
        attend_with_sink(&p.q[ui * static_cast<size_t>(H * d)], rows, n_rows, l.sinks.data() + s.head0,
                         static_cast<int>(H), d, static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))),
                         o.data());
        rope_apply_heads(&o[static_cast<size_t>(d - hp.n_rot)], d, H, ropes.for_ratio(l.ratio), pos, true);
        const int64_t m = std::min(blk, n - b0), j = i - b0;  // row j of the pending block of m rows
        for (int g = 0; g < Gs; ++g)
            std::copy_n(&o[static_cast<size_t>(g * gd)], gd, &og[static_cast<size_t>((g * m + j) * gd)]);
        if (j + 1 == m) {
            output_projection(hp, l, s, og.data(), m, y + b0 * hp.n_embd);
            b0 += m;
        }
    }
}

void attention_state_rows(const hparams &hp, const rope_set &ropes, const layer_weights &l,
                          std::span<layer_state *const> states, qat_mode qat, const float *xn,
                          std::span<const int64_t> positions) {
    thread_local attn_proj p;  // kept between calls, as attention_rows' (its q parts stay unused)
    project_state(hp, ropes, l, qat, xn, positions, p);
    std::vector<float> row(static_cast<size_t>(hp.head_dim)), irow(static_cast<size_t>(hp.idx_dim));
    for (size_t i = 0; i < positions.size(); ++i)
        push_state(hp, ropes, l, *states[i], qat, p, i, positions[i], row.data(), irow.data());
}

}  // namespace fathom::ds4
