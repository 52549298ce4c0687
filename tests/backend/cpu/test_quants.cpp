// Quant kernel tests: dequantisation and quantisation against gguf-py reference files
// (tests/backend/cpu/data, made by scripts/gen_quant_ref.py), and vec_dot / gemm against an f64 dot of
// independently decoded values, for every compute type on every ISA this CPU supports.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quants.h"
#include "isa_levels.h"
#include "core/error.h"

using namespace fathom;
using namespace fathom::cpu;

namespace {

struct ref_file {
    uint32_t kind = 0, type = 0, n = 0;
    std::vector<uint8_t> bytes;  // quantised blocks
    std::vector<float> floats;   // dequantised values (kind 0) or inputs (kind 1)
};

ref_file load_ref(const std::string &name) {
    std::string path = std::string(FATHOM_SOURCE_DIR) + "/tests/backend/cpu/data/" + name;
    std::ifstream f(path, std::ios::binary);
    if (!f) {  // a relocated binary (e.g. run on another machine) finds the data from the repo root
        path = "tests/backend/cpu/data/" + name;
        f.open(path, std::ios::binary);
    }
    if (!f) throw std::runtime_error("missing reference file " + path);
    char magic[4];
    ref_file r;
    f.read(magic, 4);
    f.read(reinterpret_cast<char *>(&r.kind), 4);
    f.read(reinterpret_cast<char *>(&r.type), 4);
    f.read(reinterpret_cast<char *>(&r.n), 4);
    if (std::memcmp(magic, "FQRF", 4) != 0) throw std::runtime_error("bad magic in " + path);
    const size_t nbytes = dtype_row_bytes(static_cast<dtype>(r.type), r.n);
    r.bytes.resize(nbytes);
    r.floats.resize(r.n);
    auto read_bytes = [&] { f.read(reinterpret_cast<char *>(r.bytes.data()), nbytes); };
    auto read_floats = [&] { f.read(reinterpret_cast<char *>(r.floats.data()), r.n * 4); };
    if (r.kind == 0) read_bytes(), read_floats();
    else read_floats(), read_bytes();
    if (!f) throw std::runtime_error("truncated reference file " + path);
    return r;
}

using test::isa_guard;
using test::isas;

const dtype kWeightTypes[] = {dtype::f32,  dtype::f16,  dtype::bf16, dtype::q4_0, dtype::q4_1,
                              dtype::q5_0, dtype::q5_1, dtype::q8_0, dtype::mxfp4, dtype::q2_k,
                              dtype::q3_k, dtype::q4_k, dtype::q5_k, dtype::q6_k, dtype::iq2_xxs};

// ---- Independent decoders of the activation formats (plain field reads, no kernel code) ------------
// Returns the values the kernel must see, and per element the bound on |x - decoded| implied by the
// format's rounding (derived in docs/formats/quant-types.md, section "Tests").
void decode_activation(dtype t, const std::vector<uint8_t> &a, int64_t n, std::vector<double> &val,
                       std::vector<double> &err_bound, std::vector<double> &s_err) {
    val.assign(n, 0);
    err_bound.assign(n, 0);
    s_err.assign(n / 32, 0);
    const uint8_t *p = a.data();
    auto f16at = [](const uint8_t *q) { uint16_t h; std::memcpy(&h, q, 2); return static_cast<double>(f16_to_f32(h)); };
    if (t == dtype::f32) {
        for (int64_t i = 0; i < n; ++i) { float f; std::memcpy(&f, p + 4 * i, 4); val[i] = f; }
    } else if (t == dtype::f16 || t == dtype::bf16) {
        for (int64_t i = 0; i < n; ++i) {
            uint16_t h;
            std::memcpy(&h, p + 2 * i, 2);
            val[i] = t == dtype::f16 ? f16_to_f32(h) : bf16_to_f32(h);
            err_bound[i] = std::fabs(val[i]) * (t == dtype::f16 ? 0x1p-11 : 0x1p-8) + 0x1p-25;
        }
    } else if (t == dtype::q8_0 || t == dtype::q8_1) {
        const int bs = t == dtype::q8_0 ? 34 : 36, off = t == dtype::q8_0 ? 2 : 4;
        for (int64_t b = 0; b < n / 32; ++b, p += bs) {
            const double d = f16at(p);
            int sum = 0;
            for (int j = 0; j < 32; ++j) {
                const int q = static_cast<int8_t>(p[off + j]);
                sum += q;
                val[32 * b + j] = d * q;
                // |x - fp16(d) q| <= d/2 + |d - fp16(d)| * 127, |d - fp16(d)| <= 2^-11 d
                err_bound[32 * b + j] = d * (0.5 + 127 * 0x1p-11) * (1 + 1e-6) + 1e-30;
            }
            if (t == dtype::q8_1) s_err[b] = std::fabs(f16at(p + 2) - d * sum);  // kernel uses stored s
        }
    } else if (t == dtype::q8_k) {
        for (int64_t b = 0; b < n / 256; ++b, p += 292) {
            float d;
            std::memcpy(&d, p, 4);
            for (int j = 0; j < 256; ++j) {
                val[256 * b + j] = static_cast<double>(d) * static_cast<int8_t>(p[4 + j]);
                err_bound[256 * b + j] = std::fabs(d) * 0.5 * (1 + 1e-5) + 1e-30;
            }
        }
    } else {
        FAIL() << "no decoder for activation type " << dtype_name(t);
    }
}

// Weights with known values: gguf-py's dequantisation of random valid blocks (deq_*.bin), or for the
// plain types random floats.
struct weights {
    dtype t;
    int64_t n;                  // elements per row
    std::vector<uint8_t> bytes; // rows of blocks
    std::vector<double> value;  // reference values
    std::vector<double> m;      // q4_1 / q5_1: the per-block min (to bound the q8_1 s rounding)
};

weights make_weights(dtype t, std::mt19937 &rng) {
    weights w{t, 0, {}, {}, {}};
    if (t == dtype::f32 || t == dtype::f16 || t == dtype::bf16) {
        w.n = 512;
        std::normal_distribution<float> nd(0, 1);
        std::vector<float> f(w.n);
        for (auto &v : f) v = nd(rng);
        w.bytes.resize(dtype_row_bytes(t, w.n));
        quantize_row(t, f.data(), w.bytes.data(), w.n);
        std::vector<float> back(w.n);
        dequantize_row(t, w.bytes.data(), back.data(), w.n);  // f16/bf16 decode is checked vs gguf-py below
        w.value.assign(back.begin(), back.end());
        return w;
    }
    const ref_file r = load_ref("deq_" + std::string(dtype_name(t)) + ".bin");
    w.n = r.n;
    w.bytes = r.bytes;
    w.value.assign(r.floats.begin(), r.floats.end());
    if (t == dtype::q4_1 || t == dtype::q5_1) {
        const size_t bs = dtype_info(t).type_size;
        for (size_t b = 0; b < r.bytes.size() / bs; ++b) {
            uint16_t h;
            std::memcpy(&h, r.bytes.data() + b * bs + 2, 2);
            w.m.push_back(f16_to_f32(h));
        }
    }
    return w;
}

struct dot_ref {
    double exact;     // f64 dot of the weight values with the decoded activations
    double tol_q;     // allowed |kernel - exact|: float summation + q8_1 stored-s rounding
    double vs_float;  // f64 dot of the weight values with the original float activations
    double tol_f;     // allowed |kernel - vs_float|: adds the activation quantisation error bound
};

dot_ref reference_dot(const weights &w, int64_t off, int64_t n, const std::vector<float> &x,
                      const std::vector<uint8_t> &act) {
    std::vector<double> a, eb, serr;
    decode_activation(vec_dot_type(w.t), act, n, a, eb, serr);
    dot_ref r{0, 0, 0, 0};
    double mag = 0, qerr = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double wv = w.value[off + i];
        r.exact += wv * a[i];
        r.vs_float += wv * x[i];
        mag += std::fabs(wv * a[i]);
        qerr += std::fabs(wv) * eb[i];
    }
    double serr_sum = 0;
    if (!w.m.empty())
        for (int64_t b = 0; b < n / 32; ++b) serr_sum += std::fabs(w.m[off / 32 + b]) * serr[b];
    // float accumulation: ~n_terms * 2^-24 relative to sum |w a|; 4e-6 covers n <= 4096 blocks sums.
    r.tol_q = 4e-6 * mag + serr_sum + 1e-6;
    r.tol_f = r.tol_q + qerr * 1.001 + 1e-6 * mag;
    return r;
}

std::vector<float> random_activations(int64_t n, std::mt19937 &rng) {
    std::normal_distribution<float> nd(0, 1);
    std::vector<float> x(n);
    for (auto &v : x) v = nd(rng);
    return x;
}

}  // namespace

// ---- f16 / bf16 conversions ------------------------------------------------------------------------
TEST(QuantConvert, F16RoundTripAllFinite) {
    for (uint32_t h = 0; h < 65536; ++h) {
        if ((h & 0x7C00) == 0x7C00) continue;
        const float f = f16_to_f32(static_cast<uint16_t>(h));
        ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
    }
}

TEST(QuantConvert, F16RoundingHandWorked) {
    EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
    EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
    EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);                  // halfway to 2^16, ties to even: inf
    EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3C00);           // tie, even stays
    EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);       // tie, odd rounds up
    EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);                  // smallest subnormal
    EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);                  // tie to even: zero
    EXPECT_EQ(f32_to_f16(0x1.8p-25f), 0x0001);
    EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
    EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);           // tie, even
    EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);
}

// ---- Dequantisation vs gguf-py -------------------------------------------------------------------
TEST(QuantDequant, MatchesGgufPyBitExact) {
    isa_guard g;
    const char *names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "q2_k", "q3_k",
                           "q4_k", "q5_k", "q6_k", "iq2_xxs", "bf16", "f16"};
    for (isa level : isas()) {
        force_isa(level);
        for (const char *name : names) {
            const ref_file r = load_ref(std::string("deq_") + name + ".bin");
            std::vector<float> out(r.n, NAN);
            dequantize_row(static_cast<dtype>(r.type), r.bytes.data(), out.data(), r.n);
            int bad = 0;
            for (uint32_t i = 0; i < r.n && bad < 5; ++i)
                if (std::memcmp(&out[i], &r.floats[i], 4) != 0)
                    ADD_FAILURE() << name << " [" << isa_name(level) << "] element " << i << ": got " << out[i]
                                  << " want " << r.floats[i],
                        ++bad;
        }
    }
}

// ---- Quantisation vs gguf-py (and ggml's reference for q8_1 / q8_k) ------------------------------
TEST(QuantQuantize, MatchesReferenceBitExact) {
    isa_guard g;
    const char *names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "bf16", "f16", "q8_1", "q8_k"};
    for (isa level : isas()) {
        force_isa(level);
        for (const char *name : names) {
            const ref_file r = load_ref(std::string("quant_") + name + ".bin");
            std::vector<uint8_t> out(r.bytes.size(), 0xCD);
            quantize_row(static_cast<dtype>(r.type), r.floats.data(), out.data(), r.n);
            size_t first = out.size();
            for (size_t i = 0; i < out.size(); ++i)
                if (out[i] != r.bytes[i]) { first = i; break; }
            EXPECT_EQ(first, out.size()) << name << " [" << isa_name(level) << "] first differing byte " << first;
        }
    }
}

// Hand-worked rounding: with amax = 127 the q8 scale is exactly 1, so x = k + 0.5 are exact ties.
// ggml's q8_0/q8_1 use roundf (ties away from zero); q8_k uses nearest_int (ties to even) on -x.
TEST(QuantQuantize, Q8TiesHandWorked) {
    isa_guard g;
    std::vector<float> x(256, 0.0f);
    x[0] = 127.0f;
    const float ties[] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f};
    for (int j = 0; j < 8; ++j) x[1 + j] = ties[j];
    const int away[] = {1, 2, 3, -1, -2, -3, 127, -127};
    const int even_neg[] = {0, -2, -2, 0, 2, 2, -126, 126};  // nearest_int(-x), ties to even
    for (isa level : isas()) {
        force_isa(level);
        std::vector<uint8_t> q0(dtype_row_bytes(dtype::q8_0, 256)), q1(dtype_row_bytes(dtype::q8_1, 256));
        std::vector<uint8_t> qk(dtype_row_bytes(dtype::q8_k, 256));
        quantize_row(dtype::q8_0, x.data(), q0.data(), 256);
        quantize_row(dtype::q8_1, x.data(), q1.data(), 256);
        quantize_row(dtype::q8_k, x.data(), qk.data(), 256);
        EXPECT_EQ(q0[0] | (q0[1] << 8), 0x3C00) << "q8_0 d must be f16(1.0)";
        for (int j = 0; j < 8; ++j) {
            EXPECT_EQ(static_cast<int8_t>(q0[2 + 1 + j]), away[j]) << "q8_0 [" << isa_name(level) << "] x=" << ties[j];
            EXPECT_EQ(static_cast<int8_t>(q1[4 + 1 + j]), away[j]) << "q8_1 [" << isa_name(level) << "] x=" << ties[j];
            EXPECT_EQ(static_cast<int8_t>(qk[4 + 1 + j]), even_neg[j]) << "q8_k [" << isa_name(level) << "] x=" << ties[j];
        }
        float dk;
        std::memcpy(&dk, qk.data(), 4);
        EXPECT_EQ(dk, -1.0f);  // d = 1 / (-127 / 127)
        int16_t bs0;
        std::memcpy(&bs0, qk.data() + 260, 2);
        int sum = -127;
        for (int j = 0; j < 8; ++j) sum += even_neg[j];
        EXPECT_EQ(bs0, sum) << "q8_k bsums[0]";
    }
}

// Reference quantisers of the types gguf-py cannot quantise: dequant(quant(x)) must be close to x.
TEST(QuantQuantize, WeightTypesRoundTrip) {
    struct c { dtype t; double max_rel_rms; };
    // Bound on rms(err)/rms(x) for Gaussian data; roughly step/sqrt(12) relative to the block range.
    const c cases[] = {{dtype::q2_k, 0.45}, {dtype::q3_k, 0.25}, {dtype::q4_k, 0.12}, {dtype::q5_k, 0.06},
                       {dtype::q6_k, 0.03}, {dtype::iq2_xxs, 0.6}, {dtype::q4_0, 0.15}, {dtype::q8_0, 0.01},
                       {dtype::mxfp4, 0.2}};
    std::mt19937 rng(7);
    const int64_t n = 2048;
    const std::vector<float> x = random_activations(n, rng);
    double sx = 0;
    for (float v : x) sx += v * v;
    for (const auto &cs : cases) {
        std::vector<uint8_t> q(dtype_row_bytes(cs.t, n));
        std::vector<float> back(n);
        quantize_row(cs.t, x.data(), q.data(), n);
        dequantize_row(cs.t, q.data(), back.data(), n);
        double se = 0;
        for (int64_t i = 0; i < n; ++i) se += (back[i] - x[i]) * (back[i] - x[i]);
        EXPECT_LT(std::sqrt(se / sx), cs.max_rel_rms) << dtype_name(cs.t);
        // A zero row must give exact zeros (no NaN from 0/0 scales).
        std::vector<float> z(n, 0.0f);
        quantize_row(cs.t, z.data(), q.data(), n);
        dequantize_row(cs.t, q.data(), back.data(), n);
        for (float v : back) ASSERT_EQ(v, 0.0f) << dtype_name(cs.t);
    }
}

// ---- Dot products ------------------------------------------------------------------------------------
TEST(QuantDot, AllTypesAllIsasMatchF64) {
    isa_guard g;
    std::mt19937 rng(11);
    for (dtype t : kWeightTypes) {
        const weights w = make_weights(t, rng);
        const dtype at = vec_dot_type(t);
        const std::vector<float> x = random_activations(w.n, rng);
        std::vector<uint8_t> act(dtype_row_bytes(at, w.n));
        quantize_row(at, x.data(), act.data(), w.n);
        const dot_ref ref = reference_dot(w, 0, w.n, x, act);
        for (isa level : isas()) {
            force_isa(level);
            const float got = vec_dot(t, w.n, w.bytes.data(), act.data());
            EXPECT_NEAR(got, ref.exact, ref.tol_q) << dtype_name(t) << " [" << isa_name(level) << "]";
            EXPECT_NEAR(got, ref.vs_float, ref.tol_f) << dtype_name(t) << " [" << isa_name(level) << "]";
        }
    }
}

// The comparison above must be able to fail: one flipped quant bit moves the result past tol_q.
TEST(QuantDot, CorruptedWeightByteIsDetected) {
    isa_guard g;
    std::mt19937 rng(5);
    struct c { dtype t; size_t byte; };  // a byte holding the low bits of a quant value
    const c cases[] = {{dtype::q4_0, 2}, {dtype::q4_1, 4}, {dtype::q5_0, 6}, {dtype::q8_0, 2},
                       {dtype::q2_k, 16}, {dtype::q4_k, 16}, {dtype::q5_k, 48}, {dtype::q6_k, 0}};
    const int64_t n = 512;
    for (const auto &cs : cases) {
        const std::vector<float> wf = random_activations(n, rng);
        std::vector<uint8_t> wq(dtype_row_bytes(cs.t, n));
        quantize_row(cs.t, wf.data(), wq.data(), n);
        weights w{cs.t, n, wq, {}, {}};
        std::vector<float> back(n);
        dequantize_row(cs.t, wq.data(), back.data(), n);
        w.value.assign(back.begin(), back.end());
        const std::vector<float> x(n, 1.0f);  // exact in every activation type
        std::vector<uint8_t> act(dtype_row_bytes(vec_dot_type(cs.t), n));
        quantize_row(vec_dot_type(cs.t), x.data(), act.data(), n);
        const dot_ref ref = reference_dot(w, 0, n, x, act);
        wq[cs.byte] ^= 0x01;
        for (isa level : isas()) {
            force_isa(level);
            const float got = vec_dot(cs.t, n, wq.data(), act.data());
            EXPECT_GT(std::fabs(got - ref.exact), ref.tol_q) << dtype_name(cs.t) << " [" << isa_name(level) << "]";
        }
    }
}

// ---- GEMM tiles ----------------------------------------------------------------------------------------
TEST(QuantGemm, TileEdgesAllTypesAllIsas) {
    isa_guard g;
    std::mt19937 rng(13);
    for (dtype t : kWeightTypes) {
        const weights w0 = make_weights(t, rng);
        // Rows: split the reference weights into rows of K elements (several blocks each).
        const int64_t bs = dtype_info(t).block_size;
        const int64_t K = bs == 256 ? 512 : (t == dtype::f32 || t == dtype::f16 || t == dtype::bf16 ? 72 : 128);
        const int64_t N = w0.n / K;
        ASSERT_GE(N, 7) << dtype_name(t);
        const size_t w_stride = dtype_row_bytes(t, K);
        const dtype at = vec_dot_type(t);
        const size_t x_stride = dtype_row_bytes(at, K) + 8;  // padded rows: stride != row size
        for (int64_t M : {1, 2, 3, 4, 5, 7, 9}) {
            std::vector<std::vector<float>> xs(M);
            std::vector<uint8_t> X(x_stride * M, 0);
            for (int64_t m = 0; m < M; ++m) {
                xs[m] = random_activations(K, rng);
                quantize_row(at, xs[m].data(), X.data() + m * x_stride, K);
            }
            for (isa level : isas()) {
                force_isa(level);
                for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, N}, {1, N - 1}, {2, 3}, {3, 3}}) {
                    const int64_t ldy = N + 3;
                    std::vector<float> y(M * ldy, -12345.0f);
                    gemm(t, K, w0.bytes.data(), w_stride, r0, r1, X.data(), x_stride, M, y.data(), ldy);
                    for (int64_t m = 0; m < M; ++m) {
                        const std::vector<uint8_t> act(X.begin() + m * x_stride, X.begin() + (m + 1) * x_stride);
                        for (int64_t r = 0; r < ldy; ++r) {
                            const float got = y[m * ldy + r];
                            if (r < r0 || r >= r1) {
                                ASSERT_EQ(got, -12345.0f) << "gemm wrote outside its tile";
                                continue;
                            }
                            const dot_ref ref = reference_dot(w0, r * K, K, xs[m], act);
                            ASSERT_NEAR(got, ref.exact, ref.tol_q) << dtype_name(t) << " [" << isa_name(level)
                                                                   << "] M=" << M << " m=" << m << " r=" << r;
                        }
                    }
                }
            }
        }
    }
}

// q8_0 gemm in ggml's float order, bit for bit, for every M, tile edge and row range (the DS4 prompt
// rows and a lone decode row must give the same bits: batch invariance), on each SIMD level: an
// independent scalar spelling of ggml-cpu's AVX2 ggml_vec_dot_q8_0_q8_0 (8 lanes, lane L = the i32
// sum of products 4L..4L+3 of a block; acc[L] = fma(d_w * d_x, lane, acc[L]) block after block;
// hsum as (lane i + lane i+4), then pairs, then the two). The weights are raw random bytes, -128
// included (q8_0 files never hold it, but the kernels must not depend on that).
float ggml_q8_0_dot(int64_t K, const uint8_t *w, const uint8_t *x) {
    float acc[8] = {};
    for (int64_t b = 0; b < K / 32; ++b, w += 34, x += 34) {
        uint16_t hw, hx;
        std::memcpy(&hw, w, 2);
        std::memcpy(&hx, x, 2);
        const float d = f16_to_f32(hw) * f16_to_f32(hx);
        for (int l = 0; l < 8; ++l) {
            int32_t lane = 0;
            for (int k = 4 * l; k < 4 * l + 4; ++k)
                lane += static_cast<int32_t>(static_cast<int8_t>(w[2 + k])) * static_cast<int8_t>(x[2 + k]);
            acc[l] = std::fma(d, static_cast<float>(lane), acc[l]);
        }
    }
    const float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
    return (s0 + s2) + (s1 + s3);
}

TEST(QuantGemm, Q8_0GgmlOrderEveryMBitExact) {
    isa_guard g;
    std::mt19937 rng(21);
    const int64_t K = 256, N = 11;
    const size_t ws = dtype_row_bytes(dtype::q8_0, K), xs = ws + 6;  // padded activation rows
    std::vector<uint8_t> W(ws * N);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> scale(0.001f, 0.05f);
    for (int64_t r = 0; r < N; ++r)
        for (int64_t b = 0; b < K / 32; ++b) {
            uint8_t *blk = W.data() + r * ws + b * 34;
            const uint16_t h = f32_to_f16(scale(rng));
            std::memcpy(blk, &h, 2);
            for (int k = 0; k < 32; ++k) blk[2 + k] = static_cast<uint8_t>(byte(rng));
        }
    for (int64_t M : {1, 2, 3, 4, 5, 8, 63, 64, 65, 70, 131}) {
        std::vector<uint8_t> X(xs * M, 0);
        for (int64_t m = 0; m < M; ++m) {
            const std::vector<float> xf = random_activations(K, rng);
            quantize_row(dtype::q8_0, xf.data(), X.data() + m * xs, K);
        }
        for (isa level : isas()) {
            force_isa(level);
            for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, N}, {1, N - 2}, {5, 6}, {4, 4}}) {
                const int64_t ldy = N + 1;
                std::vector<float> y(M * ldy, -7.0f);
                gemm(dtype::q8_0, K, W.data(), ws, r0, r1, X.data(), xs, M, y.data(), ldy);
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t r = 0; r < ldy; ++r) {
                        const float got = y[m * ldy + r];
                        if (r < r0 || r >= r1) {
                            ASSERT_EQ(got, -7.0f) << "gemm wrote outside its tile";
                            continue;
                        }
                        const float one = vec_dot(dtype::q8_0, K, W.data() + r * ws, X.data() + m * xs);
                        ASSERT_EQ(std::memcmp(&got, &one, 4), 0)
                            << isa_name(level) << " M=" << M << " m=" << m << " r=" << r << ": " << got
                            << " vs " << one;
                        if (level == isa::scalar) continue;
                        const float want = ggml_q8_0_dot(K, W.data() + r * ws, X.data() + m * xs);
                        ASSERT_EQ(std::memcmp(&got, &want, 4), 0)
                            << isa_name(level) << " M=" << M << " m=" << m << " r=" << r << ": " << got
                            << " vs " << want;
                    }
            }
        }
    }
}

// k-quant gemm == vec_dot bit for bit for every M (decode row by row, 4-row tiles, decoded panels for
// M > 4) and row range, on every level (batch invariance of the DS4 expert products).
TEST(QuantGemm, KQuantGemmEqualsDotBitwise) {
    isa_guard g;
    std::mt19937 rng(23);
    const int64_t K = 512, N = 11;
    for (dtype t : {dtype::q2_k, dtype::q4_k, dtype::q5_k, dtype::q6_k}) {
        const size_t ws = dtype_row_bytes(t, K), xs = dtype_row_bytes(dtype::q8_k, K) + 4;
        std::vector<uint8_t> W(ws * N);
        for (int64_t r = 0; r < N; ++r) {
            const std::vector<float> wf = random_activations(K, rng);
            quantize_row(t, wf.data(), W.data() + r * ws, K);
        }
        const int64_t Mmax = 17;
        std::vector<uint8_t> X(xs * Mmax, 0);
        for (int64_t m = 0; m < Mmax; ++m) {
            const std::vector<float> xf = random_activations(K, rng);
            quantize_row(dtype::q8_k, xf.data(), X.data() + m * xs, K);
        }
        for (isa level : isas()) {
            force_isa(level);
            for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17})
                for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, N}, {1, N - 2}, {5, 6}}) {
                    std::vector<float> y(M * N, -7.0f);
                    gemm(t, K, W.data(), ws, r0, r1, X.data(), xs, M, y.data(), N);
                    for (int64_t m = 0; m < M; ++m)
                        for (int64_t r = r0; r < r1; ++r) {
                            const float got = y[m * N + r],
                                        one = vec_dot(t, K, W.data() + r * ws, X.data() + m * xs);
                            ASSERT_EQ(std::memcmp(&got, &one, 4), 0)
                                << dtype_name(t) << " " << isa_name(level) << " M=" << M << " m=" << m
                                << " r=" << r << ": " << got << " vs " << one;
                        }
                }
        }
    }
}

// ---- Argument errors ------------------------------------------------------------------------------------
TEST(QuantErrors, BadArgumentsThrow) {
    std::vector<float> f(64);
    std::vector<uint8_t> b(1024);
    EXPECT_THROW(dequantize_row(dtype::q4_0, b.data(), f.data(), 33), fathom::error);
    EXPECT_THROW(dequantize_row(dtype::iq3_s, b.data(), f.data(), 256), fathom::error);
    EXPECT_THROW(quantize_row(static_cast<dtype>(99), f.data(), b.data(), 32), fathom::error);
    EXPECT_THROW(vec_dot_type(dtype::i32), fathom::error);
    EXPECT_THROW(vec_dot(dtype::q4_k, 255, b.data(), b.data()), fathom::error);
    EXPECT_THROW(gemm(dtype::q8_0, 32, b.data(), 34, 2, 1, b.data(), 34, 1, f.data(), 1), fathom::error);
}

TEST(QuantDispatch, ForceIsaClampsToDetected) {
    isa_guard g;
    std::printf("detected ISA: %s (all kernels are checked on every level up to it)\n", isa_name(detected_isa()));
    force_isa(isa::avx512);
    EXPECT_LE(static_cast<int>(active_isa()), static_cast<int>(detected_isa()));
    force_isa(isa::scalar);
    EXPECT_EQ(active_isa(), isa::scalar);
    EXPECT_EQ(vec_dot_type(dtype::q4_1), dtype::q8_1);
    EXPECT_EQ(vec_dot_type(dtype::mxfp4), dtype::q8_0);
    EXPECT_EQ(vec_dot_type(dtype::iq2_xxs), dtype::q8_k);
}
