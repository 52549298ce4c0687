// PFlash anchor rule on constructed prompts that made the old rule over-fire (it forced every
// earlier occurrence of any query-tail 4-gram, past the budget): a numbered list whose numbers are
// single digit tokens, a filler sentence repeated many times, and a multi-turn chat whose role
// markers repeat. Tokens come from a small word tokenizer that splits like SmolLM2's BPE (a leading
// space joins the next word, every digit is its own token, chat markers are single tokens). Scores
// are flat, so anything the question needs must be kept by the anchors, and the rest of the budget is
// filled with the earliest chunks. Checked: keep 0.2 < 0.5 < 1.0 in kept chunks, the chunk holding the
// needle the question asks about is kept at 0.2, and the anchors stay within their budget share.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "fathom/pflash.h"
#include "pflash/select.h"
#include "pflash/structure.h"

namespace fathom::pflash {
namespace {

struct word_tokens {
    std::vector<int32_t> ids;
    std::vector<byte_span> spans;
};

bool is_letter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Tokens: chat markers "<|im_start|>" / "<|im_end|>"; "\n"; [space]letters+; [space]digit (one per
// digit); [space]other-char. Ids are per distinct piece.
word_tokens tokenize_words(const std::string &t) {
    static const std::string markers[] = {"<|im_start|>", "<|im_end|>"};
    std::map<std::string, int32_t> vocab;
    word_tokens w;
    size_t i = 0;
    while (i < t.size()) {
        size_t e = i;
        bool marker = false;
        for (const std::string &m : markers)
            if (t.compare(i, m.size(), m) == 0) e = i + m.size(), marker = true;
        if (!marker) {
            e = i + ((t[i] == ' ' && i + 1 < t.size() && t[i + 1] != ' ' && t[i + 1] != '\n') ? 1 : 0);
            if (is_letter(t[e])) {
                while (e < t.size() && is_letter(t[e])) ++e;
            } else {
                ++e;  // one digit, punctuation, space or newline
            }
        }
        const std::string piece = t.substr(i, e - i);
        const auto it = vocab.emplace(piece, static_cast<int32_t>(vocab.size())).first;
        w.ids.push_back(it->second);
        w.spans.push_back({i, e});
        i = e;
    }
    return w;
}

struct outcome {
    int64_t n_kept = 0, n_chunks = 0, n_anchor = 0, n_forced = 0, budget = 0;
    bool needle_kept = false;
};

// Select with flat scores; the needle is the first occurrence of `needle` in the text.
outcome run(const std::string &text, double keep, const std::string &needle, bool verbatim_last_user = false) {
    const word_tokens w = tokenize_words(text);
    options o;
    o.drafter_path = "unused";
    o.keep_ratio = keep;
    o.chunk_tokens = 16;
    o.verbatim_system = false;
    o.verbatim_last_user = verbatim_last_user;
    const int64_t n_chunks = (static_cast<int64_t>(w.ids.size()) + o.chunk_tokens - 1) / o.chunk_tokens;
    const std::vector<float> flat(static_cast<size_t>(n_chunks), 1.0f);
    const prompt_structure st = find_structure(text, o.verbatim_system, o.verbatim_last_user);
    const selection s = select_spans(w.ids, w.spans, flat, st, text, o);
    outcome r;
    r.n_chunks = n_chunks;
    r.budget = chunk_budget(n_chunks, o);
    r.n_anchor = s.n_anchor;
    r.n_forced = s.n_forced;
    for (bool k : s.kept_chunk) r.n_kept += k ? 1 : 0;
    const size_t at = text.find(needle);
    EXPECT_NE(at, std::string::npos);
    for (const byte_span &b : s.kept) r.needle_kept |= b.begin <= at && at + needle.size() <= b.end;
    return r;
}

void expect_ratio_matters(const std::string &text, const std::string &needle, bool verbatim_last_user = false) {
    const outcome a = run(text, 0.2, needle, verbatim_last_user), b = run(text, 0.5, needle, verbatim_last_user),
                  c = run(text, 1.0, needle, verbatim_last_user);
    EXPECT_TRUE(a.needle_kept) << "keep 0.2 lost the needle: " << a.n_anchor << " anchor chunks, budget " << a.budget
                               << ", " << a.n_kept << "/" << a.n_chunks << " kept";
    EXPECT_GT(a.n_anchor, 0);
    EXPECT_LE(a.n_anchor, (a.budget + 1) / 2);  // anchor_budget_fraction 0.5 of the budget
    EXPECT_LT(a.n_kept, b.n_kept);
    EXPECT_LT(b.n_kept, c.n_kept);
    EXPECT_EQ(c.n_kept, c.n_chunks);
    EXPECT_LE(a.n_kept, std::max<int64_t>(a.budget, a.n_forced + (a.budget + 1) / 2));
}

const char *const k_words[] = {"amber", "basil",  "cedar", "delta",  "ember", "fable",  "garnet", "harbor",
                               "indigo", "juniper", "kelp", "lantern", "meadow", "nectar", "onyx",  "pepper"};

TEST(pflash_anchor_prompts, numbered_list_digits_do_not_anchor_neighbours) {
    // 48 entries "The value of entry 40 is ..." with two-digit numbers: under the old rule the 4-gram
    // " value of entry 4" anchored every "entry 4x" (8 of them at most 8 hits) on top of the budget.
    std::string text = "Inventory report.\n";
    for (int e = 10; e < 58; ++e)
        text += "The value of entry " + std::to_string(e) + " is " + k_words[e % 16] + " " + k_words[(e * 7) % 16] +
                " and nothing else.\n";
    text += "Question: what is the value of entry 47? Answer:";
    expect_ratio_matters(text, "entry 47 is");
    // With the question alone as the query, exactly one n-gram anchors, at entry 47 only: the chunk
    // holding "entry 47" is the single core chunk (" of entry 4" would cut the word "47").
    const word_tokens w = tokenize_words(text);
    options o;
    o.chunk_tokens = 16;
    const size_t q = text.find("Question:"), at = text.find("entry 47 is");
    const std::vector<anchor_group> groups = anchor_groups(w.ids, w.spans, text, {q, text.size()}, o);
    ASSERT_EQ(groups.size(), 1u);
    int64_t tok47 = 0;
    while (w.spans[static_cast<size_t>(tok47)].begin < at) ++tok47;
    EXPECT_EQ(groups[0].core, (std::vector<int64_t>{tok47 / 16}));
}

TEST(pflash_anchor_prompts, repeated_filler_does_not_anchor_its_copies) {
    // A filler sentence repeated 25 times (also right before the question) and one needle.
    const std::string filler = "The weather was calm and the harbor lights were dim that evening. ";
    std::string text = "Log book.\n";
    for (int i = 0; i < 48; ++i) {
        text += (i % 2 == 0) ? filler : std::string("Entry about ") + k_words[i % 16] + " and " + k_words[(i + 5) % 16] + ". ";
        if (i == 37) text += "The vault combination is stored as crimson falcon nine. ";
    }
    text += filler + "\nTell me where the vault combination is stored. Answer:";
    expect_ratio_matters(text, "vault combination is stored as crimson falcon");
}

TEST(pflash_anchor_prompts, multi_turn_chat_markup_does_not_anchor_turns) {
    // Earlier turns share the role markers with the tail ("<|im_end|>\n<|im_start|>assistant\n"); the
    // needle sits in the first user turn; the last user turn asks about it.
    std::string text = "<|im_start|>system\nYou answer questions.<|im_end|>\n";
    for (int turn = 0; turn < 7; ++turn) {
        text += "<|im_start|>user\nHere are some notes about " + std::string(k_words[turn]) + ". ";
        for (int i = 0; i < 6; ++i) text += std::string("The ") + k_words[(turn + i) % 16] + " was near the " + k_words[(turn * 3 + i) % 16] + ". ";
        if (turn == 1) text += "The launch code for the orbital station is quartz seven. ";
        text += "<|im_end|>\n<|im_start|>assistant\nNoted, thank you.<|im_end|>\n";
    }
    text += "<|im_start|>user\nWhat is the launch code for the orbital station?<|im_end|>\n<|im_start|>assistant\n";
    expect_ratio_matters(text, "launch code for the orbital station is quartz", /*verbatim_last_user=*/true);
}

}  // namespace
}  // namespace fathom::pflash
