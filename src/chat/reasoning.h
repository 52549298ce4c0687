// Reasoning ("thinking") output: splitting a generated text stream into reasoning and answer
// content at the <think> ... </think> markers, as the server reports them (OpenAI
// reasoning_content, Anthropic thinking blocks; docs/server.md "Thinking").
//
//   reasoning_splitter sp(/*in_reasoning=*/false);   // the output may open with "<think>"
//   for each released text piece t:  auto d = sp.push(t);  send d.reasoning, then d.content
//   auto d = sp.flush();                               // end of generation
//
// Rules (the official DS4 parse_message_from_completion_text, generalised to templates whose model
// opens the block itself, e.g. Qwen3):
//   - in_reasoning: the prompt ended inside an open thinking block (e.g. "<｜Assistant｜><think>");
//     everything up to the first "</think>" is reasoning, everything after it content.
//   - otherwise the output may open the block: leading whitespace then "<think>" switches to
//     reasoning (the marker and that whitespace are dropped); any other first byte makes the whole
//     output content.
//   - A marker split over several pieces is recognised: a tail that could still become the marker is
//     held back (never emitted on either side) until the next piece or flush().
//   - A stream that never closes the block is all reasoning (flush() releases the held tail as
//     reasoning).
// Concatenating every result's reasoning (and content) gives the same strings whatever the split of
// the input into pieces.
#pragma once
#include <string>
#include <string_view>

namespace fathom::chat {

inline constexpr std::string_view k_think_open = "<think>";
inline constexpr std::string_view k_think_close = "</think>";

struct reasoning_delta {
    std::string reasoning;
    std::string content;
};

class reasoning_splitter {
public:
    explicit reasoning_splitter(bool in_reasoning);
    reasoning_delta push(std::string_view piece);
    reasoning_delta flush();
    bool in_reasoning() const { return state_ == state::reasoning; }
    bool closed() const { return closed_; }  // "</think>" seen

private:
    enum class state { opening, reasoning, content };
    void drain(reasoning_delta &out, bool at_end);
    state state_;
    bool closed_ = false;
    std::string held_;
};

// Whole-text form: {reasoning, content} of a complete output.
reasoning_delta split_reasoning(std::string_view text, bool in_reasoning);

}  // namespace fathom::chat
