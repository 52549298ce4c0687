// text_stream: stop strings never leak (not even partially) and UTF-8 sequences are never split.
// Expected outputs are worked by hand from the inputs.
#include <gtest/gtest.h>

#include "sched/text_stream.h"

using fathom::sched::partial_stop_suffix;
using fathom::sched::text_stream;
using fathom::sched::utf8_incomplete_tail;

TEST(TextStream, NoStopsPassesThrough) {
    text_stream ts;
    EXPECT_EQ(ts.push("Hel"), "Hel");
    EXPECT_EQ(ts.push("lo"), "lo");
    EXPECT_EQ(ts.flush(), "");
    EXPECT_FALSE(ts.stopped());
}

TEST(TextStream, StopSplitAcrossTokensNeverLeaks) {
    text_stream ts({"STOP"});
    EXPECT_EQ(ts.push("abc S"), "abc ");  // "S" could start "STOP"
    EXPECT_EQ(ts.push("TO"), "");
    EXPECT_EQ(ts.push("P def"), "");
    EXPECT_TRUE(ts.stopped());
    EXPECT_EQ(ts.matched_stop(), "STOP");
    EXPECT_EQ(ts.push("more"), "");
    EXPECT_EQ(ts.flush(), "");
}

TEST(TextStream, PartialMatchThatDivergesIsReleased) {
    text_stream ts({"STOP"});
    EXPECT_EQ(ts.push("ST"), "");
    EXPECT_EQ(ts.push("X"), "STX");
    EXPECT_FALSE(ts.stopped());
}

TEST(TextStream, StopInsideOneToken) {
    text_stream ts({"STOP"});
    EXPECT_EQ(ts.push("xxSTOPyy"), "xx");
    EXPECT_TRUE(ts.stopped());
}

TEST(TextStream, EarliestStopWins) {
    text_stream ts({"world", "lo w"});
    EXPECT_EQ(ts.push("hello world"), "hel");
    EXPECT_EQ(ts.matched_stop(), "lo w");
}

TEST(TextStream, FlushReleasesHeldPrefix) {
    text_stream ts({"STOP"});
    EXPECT_EQ(ts.push("abST"), "ab");
    EXPECT_EQ(ts.flush(), "ST");
}

TEST(TextStream, EmptyStopStringIgnored) {
    text_stream ts({""});
    EXPECT_EQ(ts.push("abc"), "abc");
    EXPECT_FALSE(ts.stopped());
}

TEST(TextStream, Utf8NotSplit) {
    text_stream ts;
    EXPECT_EQ(ts.push("a\xC3"), "a");  // first byte of U+00E9
    EXPECT_EQ(ts.push("\xA9"), "\xC3\xA9");
    EXPECT_EQ(ts.push("\xF0\x9F"), "");  // first half of U+1F600
    EXPECT_EQ(ts.push("\x98\x80!"), "\xF0\x9F\x98\x80!");
}

TEST(TextStream, Utf8TailCounts) {
    EXPECT_EQ(utf8_incomplete_tail(""), 0u);
    EXPECT_EQ(utf8_incomplete_tail("abc"), 0u);
    EXPECT_EQ(utf8_incomplete_tail("a\xC3"), 1u);
    EXPECT_EQ(utf8_incomplete_tail("a\xE2\x82"), 2u);     // 3-byte sequence missing one byte
    EXPECT_EQ(utf8_incomplete_tail("a\xE2\x82\xAC"), 0u); // complete euro sign
    EXPECT_EQ(utf8_incomplete_tail("\xF0\x9F\x98"), 3u);
}

TEST(TextStream, PartialStopSuffix) {
    EXPECT_EQ(partial_stop_suffix("abcST", "STOP"), 2u);
    EXPECT_EQ(partial_stop_suffix("abc", "STOP"), 0u);
    EXPECT_EQ(partial_stop_suffix("S", "STOP"), 1u);
    EXPECT_EQ(partial_stop_suffix("xSTO", "STOP"), 3u);
    EXPECT_EQ(partial_stop_suffix("aa", "aab"), 2u);
}
