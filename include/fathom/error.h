// The one exception type of Fathom's API: what() is a single line naming the offending file, key,
// tensor, option or value.
#pragma once
#include <stdexcept>
#include <string>

namespace fathom {

class error : public std::runtime_error {
public:
    explicit error(const std::string &msg) : std::runtime_error(msg) {}
};

}  // namespace fathom
