// The default bodies of the public engine and session interfaces (include/fathom/engine.h): what an
// engine or session that overrides nothing gets. Each is correct for any backend; backends override
// them to fuse steps, page KV or roll back for free.
#include <algorithm>
#include <string>
#include <vector>

#include "fathom/engine.h"

namespace fathom {

// ---- engine ----

bool engine::kv_pool_configure(int32_t block_tokens, int64_t max_blocks) {
    (void)block_tokens;
    (void)max_blocks;
    return false;
}

void engine::decode_step(std::span<session *const> sessions, std::span<const int32_t> tokens) {
    if (sessions.size() != tokens.size())
        throw error("decode_step: " + std::to_string(sessions.size()) + " sessions but " +
                    std::to_string(tokens.size()) + " tokens");
    for (size_t i = 0; i < sessions.size(); ++i) sessions[i]->eval(tokens.subspan(i, 1));
}

void sync_with_rows(const sync_item &it) {
    const size_t n = it.prefix.size(), r = static_cast<size_t>(it.n_rows);
    if (it.n_rows < 1 || r > n || !it.rows)
        throw error("sync_step: " + std::to_string(it.n_rows) + " logit rows asked of a prefix of " + std::to_string(n) +
                    " tokens");
    const size_t m = n - r;
    const std::vector<int32_t> &held = it.sess->tokens();
    if (m == 0) it.sess->reset();
    else if (held.size() >= m && std::equal(it.prefix.begin(), it.prefix.begin() + static_cast<std::ptrdiff_t>(m), held.begin()))
        it.sess->truncate(static_cast<int64_t>(m));
    else
        it.sess->sync(it.prefix.first(m));
    if (it.rows_on_device)
        (void)it.sess->eval_verify(it.prefix.subspan(m), it.rows);  // rows written, or held (verify_rows_held)
    else
        it.sess->eval(it.prefix.subspan(m), it.rows);
}

void engine::sync_step(std::span<const sync_item> items) {
    std::vector<session *> dec;  // items that append exactly one token and want its logits
    std::vector<int32_t> toks;
    std::vector<bool> is_dec(items.size(), false);
    for (size_t i = 0; i < items.size(); ++i) {
        const sync_item &it = items[i];
        if (!it.sess) throw error("sync_step: item " + std::to_string(i) + " has no session");
        if (it.n_rows > 0) continue;  // below
        const std::vector<int32_t> &held = it.sess->tokens();
        if (it.want_logits && it.prefix.size() == held.size() + 1 &&
            std::equal(held.begin(), held.end(), it.prefix.begin())) {
            dec.push_back(it.sess);
            toks.push_back(it.prefix.back());
            is_dec[i] = true;
        }
    }
    if (!dec.empty()) decode_step(dec, toks);
    for (size_t i = 0; i < items.size(); ++i) {
        if (is_dec[i]) continue;
        if (items[i].n_rows > 0) sync_with_rows(items[i]);
        else items[i].sess->sync(items[i].prefix);
    }
}

// ---- session ----

void session::truncate(int64_t n_keep) {
    if (n_keep >= n_past()) return;
    std::vector<int32_t> keep(tokens().begin(), tokens().begin() + std::max<int64_t>(n_keep, 0));
    if (keep.empty()) reset();
    else sync(keep);  // sync keeps keep.size() - 1 tokens and re-evaluates the last for its logits
}

bool session::eval_verify(std::span<const int32_t> tokens, float *rows) {
    eval(tokens, rows);
    return true;
}

sample_result session::sample_row(size_t j, sampler &, std::span<const int32_t>) {
    throw error("sample_row: row " + std::to_string(j) + " is not held (this session hands a verification's rows to the caller)");
}

std::vector<int32_t> session::draft(std::span<const int32_t> history, int32_t max) {
    (void)history;
    (void)max;
    return {};
}

bool session::save_state(state_writer &w) const {
    (void)w;
    return false;
}

bool session::load_state(state_reader &r, std::span<const int32_t> tokens, int64_t n_keep) {
    (void)r;
    (void)tokens;
    (void)n_keep;
    return false;
}

int64_t session::reusable_prefix(std::span<const int32_t> prefix) const {
    const std::vector<int32_t> &held = tokens();
    size_t l = 0;
    while (l < held.size() && l < prefix.size() && held[l] == prefix[l]) ++l;
    if (l == held.size() || (rolls_back() && static_cast<uint64_t>(held.size() - l) <= static_cast<uint64_t>(rollback_limit())))
        return static_cast<int64_t>(l);
    return 0;
}

bool session::kv_reserve(int64_t n_tokens) {
    (void)n_tokens;
    return true;
}

}  // namespace fathom
