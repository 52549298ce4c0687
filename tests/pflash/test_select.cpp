// PFlash selection rules on constructed prompts: budget, head/tail, ranking, anchors, chat structure,
// JSON / tool-call atomicity, smoothing; plus keep-ratio and option validation. Expected values are
// worked out by hand from the rules in include/fathom/pflash.h.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "fathom/pflash.h"
#include "pflash/select.h"
#include "pflash/structure.h"

namespace fathom::pflash {
namespace {

// n drafter tokens of one byte each over a text of n 'x' bytes (so byte == token index).
struct toy {
    std::string text;
    std::vector<int32_t> ids;
    std::vector<byte_span> spans;
    explicit toy(int64_t n, std::string t = "") : text(t.empty() ? std::string(static_cast<size_t>(n), 'x') : t) {
        for (int64_t i = 0; i < n; ++i) {
            ids.push_back(1000 + static_cast<int32_t>(i % 7));
            spans.push_back({static_cast<uint64_t>(i), static_cast<uint64_t>(i + 1)});
        }
    }
};

options small_opts() {
    options o;
    o.drafter_path = "unused";
    o.chunk_tokens = 4;
    o.head_chunks = 1;
    o.tail_chunks = 1;
    o.anchor_ngram = 0;
    return o;
}

std::vector<int64_t> kept_chunks(const selection &s) {
    std::vector<int64_t> out;
    for (size_t c = 0; c < s.kept_chunk.size(); ++c)
        if (s.kept_chunk[c]) out.push_back(static_cast<int64_t>(c));
    return out;
}

TEST(pflash_select, budget_rounding) {
    options o = small_opts();
    o.keep_ratio = 0.35;
    EXPECT_EQ(chunk_budget(10, o), 4);  // round(3.5) = 4
    o.keep_ratio = 0.2;
    EXPECT_EQ(chunk_budget(10, o), 2);
    o.keep_ratio = 0.01;
    o.min_chunks = 3;
    EXPECT_EQ(chunk_budget(10, o), 3);  // min_chunks
    o.keep_ratio = 0.0;
    EXPECT_EQ(chunk_budget(10, o), 0);  // only forced chunks
    o.keep_ratio = 1.0;
    o.min_chunks = 50;
    EXPECT_EQ(chunk_budget(10, o), 10);
}

TEST(pflash_select, head_tail_and_ranking) {
    const toy t(40);  // 10 chunks of 4
    options o = small_opts();
    o.keep_ratio = 0.4;  // budget 4: head 0, tail 9, then the two best others
    std::vector<float> sc = {0, 1, 5, 2, 9, 3, 0.5f, 8, 1, 0};
    const selection s = select_spans(t.ids, t.spans, sc, prompt_structure{}, t.text, o);
    EXPECT_EQ(kept_chunks(s), (std::vector<int64_t>{0, 4, 7, 9}));
    EXPECT_EQ(s.n_forced, 2);
    EXPECT_EQ(s.kept, (std::vector<byte_span>{{0, 4}, {16, 20}, {28, 32}, {36, 40}}));
}

TEST(pflash_select, zero_ratio_keeps_only_forced) {
    const toy t(40);
    options o = small_opts();
    o.keep_ratio = 0.0;
    o.tail_chunks = 2;
    std::vector<float> sc(10, 1.0f);
    sc[5] = 100;
    const selection s = select_spans(t.ids, t.spans, sc, prompt_structure{}, t.text, o);
    EXPECT_EQ(kept_chunks(s), (std::vector<int64_t>{0, 8, 9}));
    EXPECT_EQ(s.kept, (std::vector<byte_span>{{0, 4}, {32, 40}}));  // adjacent chunks merged
}

TEST(pflash_select, anchors_claim_budget_for_earlier_occurrences) {
    // 64 one-byte tokens over a text of spaces (16 chunks of 4); the 3-gram 501 502 503 spells the
    // word "abc" in the tail (token 58) and earlier at token 21 (chunk 5).
    toy t(64, std::string(64, ' '));
    for (int base : {21, 58})
        for (int i = 0; i < 3; ++i) {
            t.ids[static_cast<size_t>(base + i)] = 501 + i;
            t.text[static_cast<size_t>(base + i)] = static_cast<char>('a' + i);
        }
    options o = small_opts();
    o.anchor_ngram = 3;
    o.anchor_tail_tokens = 8;
    o.anchor_max_hits = 2;
    o.anchor_radius_tokens = 0;
    o.anchor_budget_fraction = 0.5;
    const std::vector<float> zero(16, 0.f);  // no score preference: the fill takes the earliest chunks
    // keep 3/16: budget 3, forced head 0 + tail 15, anchor share round(1.5) = 2 -> chunk 5; budget full.
    o.keep_ratio = 3.0 / 16;
    selection s = select_spans(t.ids, t.spans, zero, {}, t.text, o);
    EXPECT_EQ(kept_chunks(s), (std::vector<int64_t>{0, 5, 15}));
    EXPECT_EQ(s.n_anchor, 1);
    // Radius 3 tokens: tokens [18, 27) -> chunks 4..6, 3 chunks: over the share of 2, so only the
    // occurrence's own chunk 5 is kept.
    o.anchor_radius_tokens = 3;
    EXPECT_EQ(kept_chunks(select_spans(t.ids, t.spans, zero, {}, t.text, o)), (std::vector<int64_t>{0, 5, 15}));
    o.anchor_ngram = 3;
    EXPECT_EQ(anchor_groups(t.ids, t.spans, t.text, {0, 64}, o),
              (std::vector<anchor_group>{{.core = {5}, .all = {4, 5, 6}}}));
    // keep 5/16: budget 5, share round(2.5) = 3 -> the group fits.
    o.keep_ratio = 5.0 / 16;
    EXPECT_EQ(kept_chunks(select_spans(t.ids, t.spans, zero, {}, t.text, o)), (std::vector<int64_t>{0, 4, 5, 6, 15}));
    // keep 0: no budget, so anchors add nothing (only head and tail).
    o.keep_ratio = 0.0;
    EXPECT_EQ(kept_chunks(select_spans(t.ids, t.spans, zero, {}, t.text, o)), (std::vector<int64_t>{0, 15}));
    // Too common: occurrences at 21, 33 and 45 exceed max_hits 2 -> no anchor.
    o.keep_ratio = 3.0 / 16;
    o.anchor_radius_tokens = 0;
    for (int base : {33, 45})
        for (int i = 0; i < 3; ++i) t.ids[static_cast<size_t>(base + i)] = 501 + i;
    // (bytes at 33 and 45 are spaces, but occurrences are matched on ids; words are checked on bytes)
    EXPECT_EQ(kept_chunks(select_spans(t.ids, t.spans, zero, {}, t.text, o)), (std::vector<int64_t>{0, 1, 15}));
}

TEST(pflash_select, anchor_ngrams_need_content_and_whole_words) {
    EXPECT_TRUE(is_content_piece(" entry"));
    EXPECT_TRUE(is_content_piece("\xc3\xa9"));       // é
    EXPECT_TRUE(is_content_piece("\xe6\x97\xa5"));   // 日
    EXPECT_FALSE(is_content_piece(" 47"));
    EXPECT_FALSE(is_content_piece(" .,;:\n\t"));
    EXPECT_FALSE(is_content_piece("\xe2\x80\x94"));  // em dash (General Punctuation)
    EXPECT_FALSE(is_content_piece("\xe3\x80\x82"));  // ideographic full stop
    EXPECT_FALSE(is_content_piece(""));

    // "x7y" cut as tokens x|7|y: the 2-gram "7y" in the tail cuts the word "x7y" -> no anchor; the
    // 2-gram ". ." has no content -> no anchor; the whole word " x7y" as tokens " x","7","y" is fine.
    options o = small_opts();
    o.anchor_ngram = 2;
    o.anchor_tail_tokens = 2;
    o.anchor_max_hits = 4;
    o.anchor_radius_tokens = 0;
    const std::string text = "x7y . . x7y";
    //                 tokens: x 7 y _. _. _x 7 y  (spans below)
    const std::vector<byte_span> sp = {{0, 1}, {1, 2}, {2, 3}, {3, 5}, {5, 7}, {7, 9}, {9, 10}, {10, 11}};
    const std::vector<int32_t> ids = {1, 2, 3, 4, 4, 5, 2, 3};
    EXPECT_TRUE(anchor_groups(ids, sp, text, {0, text.size()}, o).empty());  // tail "7","y": cuts "x7y"
    o.anchor_tail_tokens = 3;  // tail " x","7","y": "7 y" still cuts; " x 7" cuts too -> nothing
    EXPECT_TRUE(anchor_groups(ids, sp, text, {0, text.size()}, o).empty());
    o.anchor_ngram = 3;        // " x 7 y" is a whole word but never occurs earlier as those ids
    EXPECT_TRUE(anchor_groups(ids, sp, text, {0, text.size()}, o).empty());
    const std::vector<int32_t> ids2 = {5, 2, 3, 4, 4, 5, 2, 3};  // now it does, at token 0
    EXPECT_EQ(anchor_groups(ids2, sp, text, {0, text.size()}, o), (std::vector<anchor_group>{{.core = {0}, .all = {0}}}));
    // A query span of one token (" ." at [3, 5)) holds no 3-gram -> no anchors.
    EXPECT_TRUE(anchor_groups(ids2, sp, text, {3, 5}, o).empty());
}

TEST(pflash_structure, chatml_turns_forced) {
    const std::string text =
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nold question<|im_end|>\n"
        "<|im_start|>assistant\nold answer<|im_end|>\n<|im_start|>user\nnew question<|im_end|>\n"
        "<|im_start|>assistant\n";
    const prompt_structure st = find_structure(text, true, true);
    ASSERT_EQ(st.turns.size(), 5u);
    EXPECT_EQ(st.turns[0].role, "system");
    EXPECT_EQ(st.turns[4].role, "assistant");
    auto covered = [&](std::string_view what) {
        const uint64_t b = text.find(what), e = b + what.size();
        for (const byte_span &f : st.forced)
            if (f.begin <= b && e <= f.end) return true;
        return false;
    };
    EXPECT_TRUE(covered("<|im_start|>system\nBe brief.<|im_end|>\n"));  // header, content, footer
    EXPECT_TRUE(covered("<|im_start|>user\nnew question<|im_end|>\n"));
    EXPECT_TRUE(covered("<|im_start|>assistant\n"));
    EXPECT_FALSE(covered("old question"));
    EXPECT_FALSE(covered("old answer"));
    EXPECT_TRUE(covered("<|im_start|>user\n"));  // role markers of old turns stay
    const prompt_structure loose = find_structure(text, false, false);
    for (const byte_span &f : loose.forced) {
        const std::string_view s(text.data() + f.begin, f.end - f.begin);
        EXPECT_EQ(s.find("Be brief"), std::string_view::npos);
        EXPECT_EQ(s.find("new question"), std::string_view::npos);
    }
}

TEST(pflash_structure, gemma_and_llama3_markers) {
    const std::string g = "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n";
    const prompt_structure sg = find_structure(g, true, true);
    ASSERT_EQ(sg.turns.size(), 2u);
    EXPECT_EQ(sg.turns[1].role, "model");
    EXPECT_EQ(sg.forced, (std::vector<byte_span>{{0, g.size()}}));  // last user verbatim + all markers
    const std::string l = "<|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>";
    const prompt_structure sl = find_structure(l, false, false);
    ASSERT_EQ(sl.turns.size(), 2u);
    EXPECT_EQ(sl.turns[0].role, "system");
    EXPECT_EQ(std::string_view(l).substr(sl.turns[0].content.begin, 3), "sys");
}

TEST(pflash_structure, json_and_tool_blocks_are_atomic) {
    EXPECT_EQ(json_block_end(R"({"a": "}", "b": [1, {"c": "\"]"}]} tail)", 0, 1000), 34u);
    EXPECT_EQ(json_block_end("{\"a\": [1, 2}", 0, 1000), 0u);  // mismatched
    EXPECT_EQ(json_block_end("{\"a\": 1", 0, 1000), 0u);       // unterminated
    const std::string text = std::string(40, 'p') + "\n{\"k\": [1, 2, 3], \"v\": \"x\"}\n" + std::string(20, 'q') +
                             "<tool_call>{\"name\": \"f\"}</tool_call>" + std::string(30, 'r');
    const prompt_structure st = find_structure(text, true, true);
    const uint64_t jb = text.find('{'), je = text.find("}\n") + 1;
    const uint64_t tb = text.find("<tool_call>"), te = text.find("</tool_call>") + 12;
    ASSERT_EQ(st.atomic, (std::vector<byte_span>{{jb, je}, {tb, te}}));
    // A kept chunk touching the middle of each block keeps the whole block.
    toy t(static_cast<int64_t>(text.size()), text);
    options o = small_opts();
    o.keep_ratio = 0.0;
    o.head_chunks = 0;
    o.tail_chunks = 0;
    o.min_chunks = 0;
    o.keep_ratio = 2.0 / static_cast<double>((text.size() + 3) / 4);  // budget: 2 chunks
    std::vector<float> sc((text.size() + 3) / 4, 0.0f);
    sc[(jb + 10) / 4] = 5;  // inside the JSON
    sc[(tb + 15) / 4] = 4;  // inside the tool call
    const selection s = select_spans(t.ids, t.spans, sc, st, text, o);
    ASSERT_EQ(s.kept.size(), 2u);
    EXPECT_LE(s.kept[0].begin, jb);
    EXPECT_GE(s.kept[0].end, je);
    EXPECT_LE(s.kept[1].begin, tb);
    EXPECT_GE(s.kept[1].end, te);
}

TEST(pflash_select, smoothing_and_chunk_means) {
    const std::vector<float> x = {0, 0, 3, 0, 0, 6};
    EXPECT_EQ(smooth_scores(x, 1), x);
    const std::vector<float> y = smooth_scores(x, 3);  // clipped windows at the ends
    const std::vector<float> want = {0, 1, 1, 1, 2, 3};
    for (size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(y[i], want[i]);
    EXPECT_EQ(chunk_means(x, 4), (std::vector<float>{0.75f, 3.0f}));
}

TEST(pflash_options, keep_ratio_validation) {
    for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                       -std::numeric_limits<double>::infinity(), -0.01, 1.0001, 2.0}) {
        EXPECT_THROW(validate_keep_ratio(bad), fathom::error) << bad;
        options o;
        o.drafter_path = "x.gguf";
        o.keep_ratio = bad;
        EXPECT_THROW(o.validate(), fathom::error);
        EXPECT_THROW(compressor::create(o), fathom::error);
    }
    for (double ok : {0.0, 0.05, 0.5, 1.0}) EXPECT_NO_THROW(validate_keep_ratio(ok));
    try {
        validate_keep_ratio(std::nan(""), "--keep-ratio");
        FAIL();
    } catch (const fathom::error &e) {
        EXPECT_NE(std::string(e.what()).find("--keep-ratio"), std::string::npos);
    }
    options o;
    o.drafter_path = "/nonexistent/drafter.gguf";
    o.residency = drafter_residency::release_after_use;  // lazy: create succeeds without the file
    auto c = compressor::create(o);
    EXPECT_THROW(c->set_keep_ratio(-1), fathom::error);
    EXPECT_THROW(c->set_keep_ratio(std::numeric_limits<double>::quiet_NaN()), fathom::error);
    EXPECT_DOUBLE_EQ(c->opts().keep_ratio, 0.2);  // unchanged
    c->set_keep_ratio(0.0);
    EXPECT_DOUBLE_EQ(c->opts().keep_ratio, 0.0);
}

TEST(pflash_options, other_fields) {
    options o;
    EXPECT_THROW(o.validate(), fathom::error);  // no drafter path
    o.drafter_path = "d.gguf";
    EXPECT_NO_THROW(o.validate());
    options b = o;
    b.smooth_kernel = 4;
    EXPECT_THROW(b.validate(), fathom::error);
    b = o;
    b.query_tokens = 0;
    EXPECT_THROW(b.validate(), fathom::error);
    b = o;
    b.chunk_tokens = 0;
    EXPECT_THROW(b.validate(), fathom::error);
    for (double f : {-0.1, 1.5, std::nan(""), std::numeric_limits<double>::infinity()}) {
        b = o;
        b.anchor_budget_fraction = f;
        EXPECT_THROW(b.validate(), fathom::error) << f;
    }
    b.anchor_budget_fraction = 0.0;
    EXPECT_NO_THROW(b.validate());
    EXPECT_EQ(parse_residency("keep"), drafter_residency::keep);
    EXPECT_EQ(parse_residency("release-after-use"), drafter_residency::release_after_use);
    EXPECT_EQ(parse_residency("auto"), drafter_residency::auto_select);
    EXPECT_THROW(parse_residency("sometimes"), fathom::error);
}

}  // namespace
}  // namespace fathom::pflash
