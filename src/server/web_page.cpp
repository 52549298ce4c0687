// The web chat page served at "/": web/index.html, embedded at build time (src/CMakeLists.txt
// generates web_index.inc, a raw string literal of the file, and re-configures when it changes).
#include "server/http_server.h"

namespace fathom::server {

const std::string &web_index_html() {
    static const std::string page =
#include "web_index.inc"
        ;
    return page;
}

}  // namespace fathom::server
