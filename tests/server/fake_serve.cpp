// fathom_fake_serve: the real HTTP server (server::http_server, the scheduler) over the deterministic
// fake engine of fake_engine.h, on a free port, for the Python SDK tests that need a model whose output
// they choose (tool_stream_test.py): the fake echoes the last user message byte by byte, so a test
// writes the "model output" — a DSML or Hermes tool call — as that message. Test-only; never installed.
//   fathom_fake_serve [--arch deepseek4|llama] [--delay-us N] [--chunk N]
// Prints "listening on http://127.0.0.1:PORT" on stderr, serves until killed.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/fake_engine.h"
#include "server/http_server.h"

int main(int argc, char **argv) {
    std::string arch = "deepseek4";
    int delay_us = 0, chunk = 512;
    for (int i = 1; i < argc; ++i) {
        const bool has = i + 1 < argc;
        if (!std::strcmp(argv[i], "--arch") && has) arch = argv[++i];
        else if (!std::strcmp(argv[i], "--delay-us") && has) delay_us = std::atoi(argv[++i]);
        else if (!std::strcmp(argv[i], "--chunk") && has) chunk = std::atoi(argv[++i]);
        else {
            std::fprintf(stderr, "usage: fathom_fake_serve [--arch A] [--delay-us N] [--chunk N]\n");
            return 2;
        }
    }
    fathom::test::fake_engine eng(4096, delay_us);
    eng.set_arch(arch);
    fathom::sched::scheduler_options so;
    so.n_slots = 1;
    so.prefill_chunk = chunk;
    so.step_token_budget = chunk;
    fathom::sched::scheduler sch(eng, so);
    fathom::server::server_options ho;
    ho.port = 0;
    fathom::server::http_server srv(eng, sch, ho);
    const int port = srv.bind();
    std::fprintf(stderr, "fathom_fake_serve: listening on http://127.0.0.1:%d (arch %s)\n", port, arch.c_str());
    std::fflush(stderr);
    srv.listen();
    sch.stop();
    return 0;
}
