// bench_cuda_kernels: the CUDA kernel benchmarks (bench/cuda/bench_*.cpp). Each benchmark times one
// kernel family at DS4-Flash (or PFlash drafter) shapes and prints its figures (us per call, GB/s, share
// of the device copy rate); none is a correctness test (those are test_cuda's). The benchmarks
// share their fixtures with the test suites of the same kernels (tests/backend/cuda/*_fixture.h) and run on
// GoogleTest's runner, so a benchmark is named Suite.Name as the test it came from was.
//
// Usage: bench_cuda_kernels [--list] [NAME ...] [--gtest_* flags]
//   NAME   a benchmark (CudaDs4GemvBench.StreamCeiling) or a GoogleTest pattern ('CudaDs4GemvBench.*',
//          several joined with ':'); none: every benchmark. A NAME that matches nothing is an error.
//   --list the benchmarks' names.
// Without a CUDA device every benchmark is skipped.
#include <fnmatch.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// The benchmarks' full names (Suite.Name), as registered.
std::vector<std::string> benchmark_names() {
    std::vector<std::string> names;
    const ::testing::UnitTest &u = *::testing::UnitTest::GetInstance();
    for (int i = 0; i < u.total_test_suite_count(); ++i) {
        const ::testing::TestSuite &s = *u.GetTestSuite(i);
        for (int j = 0; j < s.total_test_count(); ++j)
            names.push_back(std::string(s.name()) + "." + s.GetTestInfo(j)->name());
    }
    return names;
}

// True when one of pattern's ':'-separated GoogleTest patterns (* and ?) matches some name.
bool matches_any(const std::string &pattern, const std::vector<std::string> &names) {
    size_t b = 0;
    while (b <= pattern.size()) {
        const size_t e = std::min(pattern.find(':', b), pattern.size());
        const std::string p = pattern.substr(b, e - b);
        for (const std::string &n : names)
            if (!p.empty() && fnmatch(p.c_str(), n.c_str(), 0) == 0) return true;
        b = e + 1;
    }
    return false;
}

}  // namespace

int main(int argc, char **argv) {
    std::vector<std::string> selected, passed;
    bool list = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--list") {
            list = true;
        } else if (a == "-h" || a == "--help") {
            std::printf("usage: %s [--list] [NAME ...] [--gtest_* flags]\n"
                        "  NAME: a benchmark (Suite.Name, see --list) or a GoogleTest pattern; none: all\n",
                        argv[0]);
            return 0;
        } else if (a.rfind("--gtest_", 0) == 0) {
            passed.push_back(a);
        } else {
            selected.push_back(a);
        }
    }
    std::string filter;
    for (const std::string &s : selected) filter += (filter.empty() ? "" : ":") + s;
    std::vector<std::string> args = {argv[0]};
    args.insert(args.end(), passed.begin(), passed.end());
    bool own_filter = false;  // --gtest_filter given as such: it selects (with any NAMEs ignored)
    for (const std::string &p : passed) own_filter = own_filter || p.rfind("--gtest_filter", 0) == 0;
    if (!own_filter) args.push_back("--gtest_filter=" + (filter.empty() ? std::string("*") : filter));
    if (list) args.push_back("--gtest_list_tests");
    std::vector<char *> cargs;
    for (std::string &a : args) cargs.push_back(a.data());
    int n = static_cast<int>(cargs.size());
    ::testing::InitGoogleTest(&n, cargs.data());
    const std::vector<std::string> names = benchmark_names();
    for (const std::string &s : selected)
        if (!matches_any(s, names)) {
            std::fprintf(stderr, "bench_cuda_kernels: no benchmark matches '%s' (--list shows them)\n", s.c_str());
            return 2;
        }
    return RUN_ALL_TESTS();
}
