// Option checks, device-list parsing and the helpers shared by the DS4 engine and its rank processes
// (see ds4_devices.h).
#include "engine/ds4_devices.h"

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <thread>

#include "engine/device.h"
#include "engine/ds4_checkpoints.h"

namespace fathom::ds4_detail {

ds4::qat_mode parse_qat(const std::string &s) {
    if (s == "full") return ds4::qat_mode::full;
    if (s == "fp4only") return ds4::qat_mode::fp4only;
    if (s == "off") return ds4::qat_mode::off;
    throw error("ds4_qat '" + s + "': expected full, fp4only or off");
}

void check_options(const engine_options &o) {
    if (o.n_threads < 0) throw error("n_threads must be >= 0, got " + std::to_string(o.n_threads));
    if (o.n_ctx < 0) throw error("n_ctx must be >= 0, got " + std::to_string(o.n_ctx));
    if (o.n_batch < 0) throw error("n_batch must be >= 0, got " + std::to_string(o.n_batch));
    if (o.dist.devices_layout != "pipeline" && o.dist.devices_layout != "tp")
        throw error("devices layout '" + o.dist.devices_layout + "': expected pipeline or tp");
    if (o.dist.devices_layout != "pipeline" && o.dist.devices.empty())
        throw error("devices layout '" + o.dist.devices_layout + "' needs several devices (devices, e.g. cpu,cpu)");
    if (o.dist.rank_procs && o.dist.devices.empty())
        throw error("rank processes (--procs) need several devices (devices, e.g. cpu,cpu)");
    if (o.dist.rank_procs && !o.dist.rank_command) throw error("rank processes (--procs): no rank command was given");
    if (o.dist.rank_procs_local < 0)
        throw error("rank_procs_local must be >= 0, got " + std::to_string(o.dist.rank_procs_local));
    ds4_checkpoints::budget_from_mib(o.ds4_checkpoint_mib);  // throws for a negative or absurd budget
}

std::vector<int> parse_device_list(const std::string &list) {
    std::vector<int> out;
    size_t pos = 0;
    for (;;) {
        const size_t comma = list.find(',', pos);
        const std::string d = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        const std::string where = "devices '" + list + "': entry " + std::to_string(out.size() + 1);
        const bool cuda_n = d.size() > 5 && d.size() <= 8 && d.rfind("cuda:", 0) == 0 &&
                            d.find_first_not_of("0123456789", 5) == std::string::npos;
        if (d == "cpu") {
            out.push_back(-1);
        } else if (d == "cuda" || cuda_n) {
            try {
                out.push_back(resolve_cuda_ordinal(d));
            } catch (const std::exception &e) {
                throw error(where + ": " + e.what());
            }
        } else {
            throw error(where + " '" + d + "' is not cpu, cuda or cuda:N (a comma-separated list, no spaces)");
        }
        if (comma == std::string::npos) return out;
        pos = comma + 1;
    }
}

int online_cores() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int64_t default_n_ctx(int64_t n_ctx_train) {
    return n_ctx_train > 0 ? std::min<int64_t>(n_ctx_train, 8192) : 8192;
}

std::string ranges_text(const std::vector<dist::layer_range> &ranges) {
    std::string out;
    for (const dist::layer_range &r : ranges) {
        if (!out.empty()) out += ',';
        out += std::to_string(r.first);
        out += '-';
        out += std::to_string(r.last - 1);
    }
    return out;
}

}  // namespace fathom::ds4_detail
