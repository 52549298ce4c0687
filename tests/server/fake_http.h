// The HTTP server over the fake engine, for the HTTP-level server tests: a fake engine (n_ctx, per-token
// delay, optionally posing as another architecture), a scheduler and an http_server on an ephemeral
// port (ctest runs the tests in parallel processes), listening on its own thread until destroyed.
#pragma once
#include <httplib.h>

#include <string>
#include <thread>

#include "engine/fake_engine.h"
#include "sched/scheduler.h"
#include "server/http_server.h"

namespace fathom::test {

struct fake_http {
    fake_engine eng;
    sched::scheduler sch;
    server::http_server srv;
    int port = 0;
    std::thread th;

    fake_http(int n_ctx, int delay_us, const sched::scheduler_options &so, server::server_options ho,
              const std::string &arch = "")
        : eng(n_ctx, delay_us), sch(posed(eng, arch), so), srv(eng, sch, any_port(std::move(ho))) {
        port = srv.bind();
        th = std::thread([this] { srv.listen(); });
    }
    ~fake_http() {
        srv.stop();
        th.join();
        sch.stop();
    }
    fake_http(const fake_http &) = delete;
    fake_http &operator=(const fake_http &) = delete;
    httplib::Client client(int read_timeout_s = 20) const {
        httplib::Client c("127.0.0.1", port);
        c.set_read_timeout(read_timeout_s, 0);
        return c;
    }

  private:
    static fake_engine &posed(fake_engine &e, const std::string &arch) {
        if (!arch.empty()) e.set_arch(arch);
        return e;
    }
    static server::server_options any_port(server::server_options o) {
        o.port = 0;
        return o;
    }
};

}  // namespace fathom::test
