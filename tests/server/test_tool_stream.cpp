// Streamed tool calls below HTTP: the Hermes call_decoder fed token-like pieces (hand-worked event
// sequences), its split invariance, the shapes it takes whole, and call_stream's ids and
// parallel_tool_calls stop. The DSML decoder's parser deltas are tested in test_ds4chat (tests/chat).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>

#include "chat/dsml.h"
#include "server/tool_calls.h"
#include "server/tool_stream.h"

using namespace fathom::server;
using json = nlohmann::json;

namespace {

const std::vector<std::string> k_names = {"get_weather", "search"};

// Events flattened: "C:<text>" content, "B<i>:<name>:<args>" a call's begin, "F<i>:<args>" a
// fragment, "E" appended to the event that ends the call.
std::string flat(const call_event &e) {
    if (e.kind == call_event::content) return "C:" + e.text;
    std::string s = e.begin ? "B" + std::to_string(e.index) + ":" + e.name + ":" + e.text
                            : "F" + std::to_string(e.index) + ":" + e.text;
    return e.end ? s + "E" : s;
}

std::vector<std::string> run(call_decoder &d, const std::vector<std::string> &pieces) {
    std::vector<call_event> evs;
    for (const auto &p : pieces) d.push(p, evs);
    d.finish(evs);
    std::vector<std::string> out;
    for (const auto &e : evs) out.push_back(flat(e));
    return out;
}

std::vector<std::string> run(const tool_format &f, const std::vector<std::string> &pieces) {
    auto d = f.decoder(k_names);
    return run(*d, pieces);
}

using strs = std::vector<std::string>;

// Content and per-call (name, arguments, ended) as the events concatenate.
struct turn {
    std::string content;
    std::vector<std::tuple<std::string, std::string, bool>> calls;
    bool operator==(const turn &) const = default;
};

turn collect(const tool_format &f, const std::string &text, const std::vector<size_t> &cuts) {
    auto d = f.decoder(k_names);
    std::vector<call_event> evs;
    size_t prev = 0;
    for (size_t c : cuts) {
        d->push(std::string_view(text).substr(prev, c - prev), evs);
        prev = c;
    }
    d->push(std::string_view(text).substr(prev), evs);
    d->finish(evs);
    turn t;
    for (const auto &e : evs) {
        if (e.kind == call_event::content) {
            t.content += e.text;
            continue;
        }
        if (e.begin) {
            EXPECT_EQ(e.index, t.calls.size());
            t.calls.emplace_back(e.name, "", false);
        }
        EXPECT_LT(e.index, t.calls.size());
        if (e.index >= t.calls.size()) continue;
        EXPECT_FALSE(std::get<2>(t.calls[e.index])) << "an event after the call's end";
        std::get<1>(t.calls[e.index]) += e.text;
        std::get<2>(t.calls[e.index]) = e.end;
    }
    return t;
}

}  // namespace

TEST(HermesDecoder, TokenSplitHandWorked) {
    auto f = make_tool_format("hermes");
    EXPECT_EQ(run(*f, {"Sure", ".", " ", "<tool_call>", "\n", "{\"name\": \"", "get_weather", "\", \"arguments\": ",
                       "{\"city\": ", "\"Paris\"", "}}", "\n", "</tool_call>"}),
              strs({"C:Sure", "C:.", "B0:get_weather:", "F0:{\"city\": ", "F0:\"Paris\"", "F0:}E"}));
}

TEST(HermesDecoder, MarkerPrefixIsHeldThenReleased) {
    auto f = make_tool_format("hermes");
    // "<tool" may open a call; "<tools are" does not: released as text. Trailing spaces wait for text.
    EXPECT_EQ(run(*f, {"a <tool", "s are ", "fine"}), strs({"C:a", "C: <tools are", "C: fine"}));
    // Only whitespace after the text: it comes out at the end (no call was made).
    EXPECT_EQ(run(*f, {"ok", " \n"}), strs({"C:ok", "C: \n"}));
}

TEST(HermesDecoder, EverySplitGivesTheSameTurn) {
    auto f = make_tool_format("hermes");
    const std::string text =
        "I'll look.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"a } \\\" ] { </tool_call>\", "
        "\"n\": [1, {\"k\": 2}]}}\n</tool_call>\nand\n<tool_call>{\"arguments\": {\"x\": 1}, \"name\": "
        "\"get_weather\"}</tool_call>";
    // By hand: the whitespace before each call is not content; the first call's arguments are the
    // object as written (a "}" and "</tool_call>" inside its string do not end it); the second, in
    // another key order, is taken whole at its closing tag and re-serialised compactly.
    const turn expect{"I'll look.\nand",
                      {{"search", "{\"q\": \"a } \\\" ] { </tool_call>\", \"n\": [1, {\"k\": 2}]}", true},
                       {"get_weather", "{\"x\":1}", true}}};
    for (size_t cut = 0; cut <= text.size(); ++cut) ASSERT_EQ(collect(*f, text, {cut}), expect) << "cut " << cut;
    std::vector<size_t> every;
    for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
    EXPECT_EQ(collect(*f, text, every), expect);
}

TEST(HermesDecoder, ShapesTakenWhole) {
    auto f = make_tool_format("hermes");
    // An unknown name is not a call: the block is text, as parse() keeps it.
    EXPECT_EQ(run(*f, {"x <tool_call>{\"name\": \"nope\", \"arguments\": {}}", "</tool_call>"}),
              strs({"C:x", "C: <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>"}));
    // A bare JSON call can only be the whole output: nothing until the end.
    auto d = f->decoder(k_names);
    std::vector<call_event> evs;
    d->push("{\"name\": \"get_weather\", ", evs);
    d->push("\"arguments\": {\"city\": \"Oslo\"}}", evs);
    EXPECT_TRUE(evs.empty());
    d->finish(evs);
    ASSERT_EQ(evs.size(), 1u);
    EXPECT_EQ(flat(evs[0]), "B0:get_weather:{\"city\":\"Oslo\"}E");
    // String arguments (JSON text): whole, parsed.
    EXPECT_EQ(run(*f, {"<tool_call>{\"name\": \"search\", \"arguments\": \"{\\\"q\\\": 1}\"}</tool_call>"}),
              strs({"B0:search:{\"q\":1}E"}));
}

TEST(HermesDecoder, CutOffInsideTheArguments) {
    auto f = make_tool_format("hermes");
    EXPECT_EQ(run(*f, {"<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"}),
              strs({"B0:get_weather:", "F0:{\"city\": \"Par"}));
}

TEST(HermesDecoder, ForcedOpeningComesFirst) {
    auto f = make_tool_format("hermes");
    tool_choice named{tool_choice::function, "get_weather"};
    EXPECT_EQ(run(*f, {f->forced_call_prefix(named), "{\"city\"", ": \"X\"}}"}),
              strs({"B0:get_weather:", "F0:{\"city\"", "F0:: \"X\"}E"}));
    tool_choice required{tool_choice::required, ""};
    EXPECT_EQ(run(*f, {f->forced_call_prefix(required), "search\", \"arguments\": {}}"}), strs({"B0:search:", "F0:{}E"}));
}

TEST(DsmlDecoder, ContentThenCallEvents) {
    auto f = make_tool_format("dsml");
    EXPECT_EQ(run(*f, {"Checking.", "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">\n",
                       "<｜DSML｜parameter name=\"q\" string=\"true\">x", "y</｜DSML｜parameter>\n</｜DSML｜invoke>",
                       "\n</｜DSML｜tool_calls>"}),
              strs({"C:Checking.", "B0:search:{", "F0:\"q\": \"x", "F0:y\"}E"}));
    // The forced opening of a named call announces it before the model writes anything.
    tool_choice named{tool_choice::function, "search"};
    EXPECT_EQ(run(*f, {f->forced_call_prefix(named)}), strs({"B0:search:{"}));
}

TEST(DsmlDecoder, MalformedMarkupIsTextUnlessACallWasStreamed) {
    auto f = make_tool_format("dsml");
    // No invoke began: the broken block is content at the end (as the whole-output parse keeps it).
    EXPECT_EQ(run(*f, {"a", "<｜DSML｜tool_calls>junk"}), strs({"C:a", "C:<｜DSML｜tool_calls>junk"}));
    // An invoke already streamed: its markup is dropped, never shown as content.
    EXPECT_EQ(run(*f, {"<｜DSML｜tool_calls><｜DSML｜invoke name=\"search\">junk"}), strs({"B0:search:{"}));
}

TEST(CallStream, IdsAndTheTurn) {
    auto f = make_tool_format("hermes");
    call_stream cs(*f, k_names, "toolu_", true);
    std::vector<call_event> evs;
    cs.push("Hi <tool_call>{\"name\": \"search\", \"arguments\": {\"q\": 1}}</tool_call>", evs);
    cs.push("<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>", evs);
    cs.finish(evs);
    const parsed_output &po = cs.output();
    EXPECT_EQ(po.content, "Hi");
    ASSERT_EQ(po.calls.size(), 2u);
    EXPECT_EQ(cs.n_complete(), 2u);
    EXPECT_FALSE(cs.call_open());
    EXPECT_EQ(po.calls[0].arguments, "{\"q\": 1}");
    EXPECT_EQ(po.calls[1].arguments, "{}");
    std::set<std::string> ids;
    for (const auto &e : evs) {
        if (e.kind != call_event::call) continue;
        EXPECT_EQ(e.id, po.calls[e.index].id);  // every event of a call carries its id
        ids.insert(e.id);
    }
    ASSERT_EQ(ids.size(), 2u);
    for (const auto &id : ids) EXPECT_EQ(id.rfind("toolu_", 0), 0u) << id;
}

TEST(CallStream, NoParallelCallsStopsAfterTheFirst) {
    auto f = make_tool_format("dsml");
    call_stream cs(*f, k_names, "call_", false);
    std::vector<call_event> evs;
    cs.push("<｜DSML｜tool_calls><｜DSML｜invoke name=\"search\"></｜DSML｜invoke>", evs);
    EXPECT_TRUE(cs.stopped());
    cs.push("<｜DSML｜invoke name=\"get_weather\"></｜DSML｜invoke></｜DSML｜tool_calls>after", evs);
    cs.finish(evs);
    ASSERT_EQ(evs.size(), 1u);  // the first call only: begun and ended in one push
    EXPECT_EQ(flat(evs[0]), "B0:search:{}E");
    ASSERT_EQ(cs.output().calls.size(), 1u);
    EXPECT_EQ(cs.output().calls[0].arguments, "{}");
    EXPECT_EQ(cs.output().content, "");
}
