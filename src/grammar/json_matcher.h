// Structured output, part 2: the character-level pushdown automaton over a json_grammar.
//
// The state is a stack of frames, one per open construct (object, its key being read, array,
// string, number, literal, sequence); feed() consumes one byte or refuses it, leaving the state
// unchanged. A number, or a literal that is a prefix of another (enum [1, 12]), completes lazily:
// the byte after it pops the frame and goes to the one below; feed_end() does the same at the end
// of the document. The document is complete when the stack is empty.
//
// Backtracking for the token mask (token_mask.h walks a trie of token bytes and undoes each byte):
// mark() / undo() restore the state through a trail of the frames a feed overwrote, so a byte costs
// a few frame copies, not a copy of the stack.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "grammar/json_schema.h"

namespace fathom::grammar {

class json_matcher {
public:
    explicit json_matcher(std::shared_ptr<const json_grammar> g);

    bool feed(uint8_t c);           // false: c cannot come next (state unchanged)
    bool feed(const std::string &bytes);  // all or nothing
    bool complete();                // the bytes so far are a whole document (end allowed here)
    bool done() const { return depth_ == 0; }  // complete, and no byte may follow

    // Inside a string value (or an unlisted object key) between characters: every byte of ordinary
    // string content (no quote, backslash or control byte; whole UTF-8 characters) keeps the state
    // as it is, apart from the length. room: code points the string may still take (-1 = any).
    // token_mask.h's fast path.
    bool in_plain_string(int64_t &room) const;
    // The length of that string grows by n code points (a token of plain content was accepted).
    void add_plain(int64_t n);

    struct mark_t {
        size_t trail;
        int32_t depth;
        int32_t ws;
    };
    mark_t mark();   // starts recording (until the matching undo)
    void undo(const mark_t &m);

    const json_grammar &grammar() const { return *g_; }

    struct frame {
        int32_t node = 0;
        uint8_t kind = 0;    // frame_kind
        uint8_t st = 0;      // state within the frame
        uint8_t esc = 0;     // string: 0, 1 after '\\', 2..5 hex digits of \u still to come (5 - esc + 1)
        uint8_t rem = 0;     // string: UTF-8 continuation bytes still to come
        uint8_t ulo = 0x80, uhi = 0xBF;  // string: range of the next continuation byte
        uint8_t free_ok = 0; // key: still a valid unlisted key
        uint8_t sur = 0;     // string: the \u escape began with 'd' (its next digit must be 0-7)
        int32_t lo = 0, hi = 0;  // literals / key: candidate range; array: items so far; seq: part index
        int64_t len = 0;     // literals / key: bytes matched; string: code points; number: digits of the part
        int64_t cur = -1;    // object: property whose value is being read (-1 = an unlisted key)
        uint64_t used = 0;   // object: properties given
    };

private:
    bool step(int c);  // c = -1: end of document
    bool start_value(int32_t node, uint8_t c);
    bool child_done();
    bool feed_object(frame &f, uint8_t c, bool ws);
    bool feed_key(uint8_t c);
    bool feed_array(frame &f, uint8_t c, bool ws);
    bool feed_string(uint8_t c);
    static int string_byte(frame &f, uint8_t c, bool escapes);  // -1 refused, 0 inside a character, 1 a character began, 2 closing quote
    int feed_number(uint8_t c);     // 1 consumed, 0 ends the number (c goes below), -1 refused
    int feed_literals(uint8_t c);   // as feed_number
    bool literal_complete(const frame &f) const;
    bool finish_literal();
    frame &top() { return frames_[size_t(depth_ - 1)]; }
    frame &mut_top();               // top, recorded on the trail first
    bool push(const frame &f);
    void pop() { --depth_; }

    std::shared_ptr<const json_grammar> g_;
    std::vector<frame> frames_;     // [kMaxDepth]; frames_[0, depth_) are live
    int32_t depth_ = 0;
    int32_t ws_ = 0;                // whitespace bytes in a row
    int recording_ = 0;             // marks outstanding
    std::vector<std::pair<int32_t, frame>> trail_;
};

}  // namespace fathom::grammar
