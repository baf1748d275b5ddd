// mha info: this CPU's SIMD features and the kernel variants that run on it.
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>

#include "kernels/cpu/flash.h"
#include "tools/commands.h"
#include "util/parallel.h"

namespace mha::tools {

int run_info() {
  fmt::print("mha {}\n", MHA_VERSION);
  std::string features;
  for (const char* f : {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                        "avx512vnni", "avx512bf16"}) {
#if defined(__x86_64__)
    // __builtin_cpu_supports needs literal names; test the common ones explicitly.
    bool has = false;
    const std::string name = f;
    if (name == "sse4.2") has = __builtin_cpu_supports("sse4.2");
    if (name == "avx") has = __builtin_cpu_supports("avx");
    if (name == "avx2") has = __builtin_cpu_supports("avx2");
    if (name == "fma") has = __builtin_cpu_supports("fma");
    if (name == "f16c") has = __builtin_cpu_supports("f16c");
    if (name == "avx512f") has = __builtin_cpu_supports("avx512f");
    if (name == "avx512bw") has = __builtin_cpu_supports("avx512bw");
    if (name == "avx512dq") has = __builtin_cpu_supports("avx512dq");
    if (name == "avx512vl") has = __builtin_cpu_supports("avx512vl");
    if (name == "avx512vnni") has = __builtin_cpu_supports("avx512vnni");
    if (name == "avx512bf16") has = __builtin_cpu_supports("avx512bf16");
    if (has) features += std::string(features.empty() ? "" : " ") + f;
#endif
  }
  fmt::print("cpu features:      {}\n", features.empty() ? "(none detected)" : features);
  std::string targets;
  for (const auto& t : kernels::simd_targets()) targets += (targets.empty() ? "" : ", ") + t;
  fmt::print("simd targets:      {} (compiled in and supported here, best first)\n", targets);
  fmt::print("attention forward: {}\n", kernels::flash_forward_name());
  fmt::print("reference:         attention_ref_f64 (Backend::kReference)\n");
  const dnnl_version_t* v = dnnl_version();
  fmt::print("projections:       oneDNN {}.{}.{} sgemm ({} threads by default)\n", v->major, v->minor, v->patch,
             resolve_threads(0));
  return 0;
}

}  // namespace mha::tools
