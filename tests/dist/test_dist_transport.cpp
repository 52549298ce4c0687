// In-process transport (src/dist/transport.*) and the pipeline's failure handling: ordered delivery,
// size checks, receive deadlines, and a failed or silent peer turning into a one-line error on the
// driver within the deadline instead of a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <numeric>
#include <thread>
#include <unistd.h>

#include "core/error.h"
#include "dist/dist_test_util.h"
#include "dist/pipeline.h"
#include "dist/transport.h"
#include "models/deepseek4_synth.h"

namespace {

using namespace fathom;
using dist_test::error_of;
using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

TEST(dist_transport, ordered_delivery_and_size_check) {
    dist::inprocess_hub hub(3, 1000ms);
    auto a = hub.endpoint(0), b = hub.endpoint(1), c = hub.endpoint(2);
    EXPECT_EQ(a->size(), 3);
    EXPECT_EQ(c->rank(), 2);
    const int x1 = 11, x2 = 22;
    const double y = 3.5;
    a->send(1, &x1, sizeof x1);
    c->send(1, &y, sizeof y);
    a->send(1, &x2, sizeof x2);
    int r = 0;
    double ry = 0;
    b->recv(2, &ry, sizeof ry);  // per-pair FIFOs: rank 2's message is independent of rank 0's
    EXPECT_EQ(ry, 3.5);
    b->recv(0, &r, sizeof r);
    EXPECT_EQ(r, 11);
    b->recv(0, &r, sizeof r);
    EXPECT_EQ(r, 22);
    a->send(1, &x1, sizeof x1);
    EXPECT_EQ(error_of([&] { b->recv(0, &ry, sizeof ry); }), "dist: rank 1 expected 8 bytes from rank 0, got 4");
    EXPECT_THROW(a->send(0, &x1, sizeof x1), error);  // itself
    EXPECT_THROW(a->send(3, &x1, sizeof x1), error);  // out of range
    EXPECT_THROW(hub.endpoint(1), error);             // taken
    EXPECT_THROW(hub.endpoint(3), error);
    EXPECT_THROW(dist::inprocess_hub(0, 10ms), error);
    EXPECT_THROW(dist::inprocess_hub(2, 0ms), error);
}

TEST(dist_transport, recv_times_out) {
    dist::inprocess_hub hub(2, 50ms);
    auto a = hub.endpoint(0), b = hub.endpoint(1);
    int r = 0;
    const auto t0 = clk::now();
    EXPECT_EQ(error_of([&] { b->recv(0, &r, sizeof r); }),
              "dist: rank 1 timed out after 50 ms waiting for 4 bytes from rank 0");
    const auto waited = clk::now() - t0;
    EXPECT_GE(waited, 50ms);
    EXPECT_LT(waited, 5s);
}

TEST(dist_transport, failed_peer_wakes_waiters_at_once) {
    dist::inprocess_hub hub(2, 60s);  // the deadline must not be what ends the wait
    auto a = hub.endpoint(0), b = hub.endpoint(1);
    const int v = 5;
    a->send(1, &v, sizeof v);
    std::thread killer([&] {
        std::this_thread::sleep_for(30ms);
        a->abort("rank 0 killed by test");
    });
    int r = 0;
    b->recv(0, &r, sizeof r);  // delivered before the failure: still received
    EXPECT_EQ(r, 5);
    const auto t0 = clk::now();
    EXPECT_EQ(error_of([&] { b->recv_idle(0, &r, sizeof r); }), "dist: rank 0 failed: rank 0 killed by test");
    EXPECT_LT(clk::now() - t0, 10s);
    killer.join();
    EXPECT_EQ(error_of([&] { b->send(0, &v, sizeof v); }), "dist: rank 0 failed: rank 0 killed by test");
    a->abort("second reason is ignored");
    EXPECT_EQ(error_of([&] { b->recv(0, &r, sizeof r); }), "dist: rank 0 failed: rank 0 killed by test");
}

const ds4::model &small_model() {
    static std::unique_ptr<ds4::model> m = [] {
        const std::string path = (std::filesystem::temp_directory_path() /
                                  ("dist_transport_synth_" + std::to_string(::getpid()) + ".gguf")).string();
        ds4::hparams hp = ds4::synth_preset("tiny");
        hp.n_layer = 3;
        ds4::synth_fix_layers(hp, 1.5f);
        ds4::synth_write(path, hp, {});
        auto m = ds4::load_model(path);  // mapped: the file can go
        std::filesystem::remove(path);
        return m;
    }();
    return *m;
}

// Rank 1 dies (aborts) while rank 0 drives: forward() throws naming rank 1's reason, no hang.
TEST(dist_transport, pipeline_peer_death_is_an_error) {
    const auto &m = small_model();
    dist::inprocess_hub hub(2, 30s);
    auto e0 = hub.endpoint(0), e1 = hub.endpoint(1);
    dist::pipeline_rank r0(m, {{0, 2}, {2, 3}}, *e0, ds4::qat_mode::full, kv_precision::f32);
    e1->abort("rank 1 exited with signal 9");
    const std::vector<int32_t> tok = {5, 6};
    const std::vector<int64_t> pos = {0, 1};
    std::vector<float> logits(static_cast<size_t>(m.hp.n_vocab));
    const auto t0 = clk::now();
    EXPECT_EQ(error_of([&] { r0.forward(tok, pos, logits); }), "dist: rank 1 failed: rank 1 exited with signal 9");
    EXPECT_LT(clk::now() - t0, 10s);
}

// Rank 2 exists but never answers (hung peer): the driver's recv of the logits hits its deadline.
TEST(dist_transport, pipeline_silent_peer_times_out) {
    const auto &m = small_model();
    dist::inprocess_hub hub(3, 300ms);
    auto e0 = hub.endpoint(0), e1 = hub.endpoint(1), e2 = hub.endpoint(2);
    const std::vector<dist::layer_range> ranges = {{0, 1}, {1, 2}, {2, 3}};
    dist::pipeline_rank r0(m, ranges, *e0, ds4::qat_mode::full, kv_precision::f32);
    dist::pipeline_rank r1(m, ranges, *e1, ds4::qat_mode::full, kv_precision::f32);
    std::string r1_error;
    std::thread t1([&] {
        try {
            r1.serve();
        } catch (const error &e) {
            r1_error = e.what();
        }
    });
    const std::vector<int32_t> tok = {5};
    const std::vector<int64_t> pos = {0};
    std::vector<float> logits(static_cast<size_t>(m.hp.n_vocab));
    EXPECT_EQ(error_of([&] { r0.forward(tok, pos, logits); }),
              "dist: rank 0 timed out after 300 ms waiting for " + std::to_string(logits.size() * 4) +
                  " bytes from rank 2");
    e0->abort("driver gave up");  // what the driver does next: rank 1 leaves serve() at once
    t1.join();
    EXPECT_EQ(r1_error, "dist: rank 0 failed: driver gave up");
}

// A malformed message (wrong size on the wire) is reported by the receiving stage, which aborts, so
// the driver sees the cause instead of waiting.
TEST(dist_transport, pipeline_protocol_error_propagates) {
    const auto &m = small_model();
    dist::inprocess_hub hub(2, 30s);
    auto e0 = hub.endpoint(0), e1 = hub.endpoint(1);
    dist::pipeline_rank r1(m, {{0, 1}, {1, 3}}, *e1, ds4::qat_mode::full, kv_precision::f32);
    std::string r1_error;
    std::thread t1([&] {
        try {
            r1.serve();
        } catch (const error &e) {
            r1_error = e.what();
        }
    });
    const int64_t bad_header[4] = {1, 1, 1, 7};  // n_past 7 on a fresh rank
    e0->send(1, bad_header, sizeof bad_header);
    int32_t sink = 0;
    EXPECT_EQ(error_of([&] { e0->recv(1, &sink, sizeof sink); }),
              "dist: rank 1 failed: dist: rank 1 received a bad header {1, 1, 1, 7} at n_past 0");
    t1.join();
    EXPECT_EQ(r1_error, "dist: rank 1 received a bad header {1, 1, 1, 7} at n_past 0");
}

}  // namespace

namespace {

// The first 2-GPU run (docs/dist.md) had the NCCL transport hand a receiver a zeroed buffer; with
// op 0 meaning "stop", rank 1 left serve() quietly. No op is 0 now: zeros are a protocol error.
TEST(dist_transport, zeroed_header_is_an_error_not_a_stop) {
    const auto &m = small_model();
    dist::inprocess_hub hub(2, 30s);
    auto e0 = hub.endpoint(0), e1 = hub.endpoint(1);
    dist::pipeline_rank r1(m, {{0, 1}, {1, 3}}, *e1, ds4::qat_mode::full, kv_precision::f32);
    const int64_t zeros[4] = {0, 0, 0, 0};
    e0->send(1, zeros, sizeof zeros);
    EXPECT_EQ(error_of([&] { r1.serve(); }), "dist: rank 1 received a bad header {0, 0, 0, 0} at n_past 0");
}

}  // namespace
