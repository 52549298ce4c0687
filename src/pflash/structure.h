// Prompt structure PFlash must respect, found in the prompt text (byte ranges):
//   forced  — kept whatever the scores say: chat role markers (begin marker + role line, end marker),
//             the system prompt and the last user message (when asked to keep them verbatim);
//   atomic  — kept whole or dropped whole, never cut: tool-call blocks (<tool_call>..</tool_call> and
//             kin, ```json fences) and JSON objects/arrays that open a line and balance.
// Recognised chat formats: ChatML (<|im_start|>role\n .. <|im_end|>), Gemma (<start_of_turn>role\n ..
// <end_of_turn>), Llama 3 (<|start_header_id|>role<|end_header_id|> .. <|eot_id|>) and DeepSeek V4
// (BOS + system text, <｜User｜> .., <｜Assistant｜>[<think>|</think>] .. <｜end▁of▁sentence｜>,
// <｜latest_reminder｜> ..; a user turn holding only tool results is the last user turn when it comes
// last, as in DS4's own format). DS4 atomic blocks: <｜DSML｜tool_calls> .. </｜DSML｜tool_calls> and
// <tool_result> .. </tool_result>.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "pflash/text_map.h"

namespace fathom::pflash {

struct chat_turn {
    std::string role;
    byte_span header;   // begin marker + role + delimiter
    byte_span content;  // up to the end marker (or the next turn / end of text)
    byte_span footer;   // end marker and the newline after it (empty if none)
};

struct prompt_structure {
    std::vector<chat_turn> turns;
    std::vector<byte_span> forced;  // merged
    std::vector<byte_span> atomic;  // merged, disjoint
};

prompt_structure find_structure(std::string_view text, bool verbatim_system, bool verbatim_last_user);

// Balanced JSON object/array starting at text[b] ('{' or '['), string-aware; returns the end (one past
// the closing bracket) or 0 if it does not balance within max_bytes.
uint64_t json_block_end(std::string_view text, uint64_t b, uint64_t max_bytes);

}  // namespace fathom::pflash
