// mha info: this CPU's SIMD features and the kernel variants that run on it.
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <utility>

#include "kernels/cpu/flash.h"
#include "kernels/cpu/linear_rows.h"
#include "ops/linear.h"
#include "tools/commands.h"
#include "util/parallel.h"

namespace mha::tools {
namespace {

#if defined(__x86_64__)
// AVX512_BF16: CPUID leaf 7, sub-leaf 1, EAX bit 5 (not every compiler's
// __builtin_cpu_supports knows it).
bool cpuid_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}
#endif

}  // namespace

int run_info() {
  fmt::print("mha {}\n", MHA_VERSION);
  std::string features;
#if defined(__x86_64__)
  const std::pair<const char*, bool> flags[] = {
      {"sse4.2", __builtin_cpu_supports("sse4.2")},     {"avx", __builtin_cpu_supports("avx")},
      {"avx2", __builtin_cpu_supports("avx2")},         {"fma", __builtin_cpu_supports("fma")},
      {"avx512f", __builtin_cpu_supports("avx512f")},   {"avx512bw", __builtin_cpu_supports("avx512bw")},
      {"avx512dq", __builtin_cpu_supports("avx512dq")}, {"avx512vl", __builtin_cpu_supports("avx512vl")},
      {"avx512vnni", __builtin_cpu_supports("avx512vnni")}, {"avx512bf16", cpuid_avx512_bf16()}};
  for (const auto& [name, has] : flags)
    if (has) features += std::string(features.empty() ? "" : " ") + name;
#endif
  fmt::print("cpu features:      {}\n", features.empty() ? "(none detected)" : features);
  std::string targets;
  for (const auto& t : kernels::simd_targets()) targets += (targets.empty() ? "" : ", ") + t;
  fmt::print("simd targets:      {} (compiled in and supported here, best first)\n", targets);
  fmt::print("attention forward: {}\n", kernels::flash_forward_name());
  fmt::print("element types:     float32; bfloat16 and float16 widened to float32 as read, results rounded once{}\n",
             kernels::forward_amx_bf16() ? " (bfloat16 forward: AMX tile products for head dims D % 32 == 0 and "
                                           "Dv % 16 == 0, P rounded to bfloat16; backward: for Dv % 32 == 0, P and "
                                           "dS rounded to bfloat16)"
                                         : "");
  fmt::print("reference:         attention_ref_f64 (Backend::kReference)\n");
  const dnnl_version_t* v = dnnl_version();
  fmt::print("decoding:          {}\n", kernels::flash_decode_name());
  fmt::print("projections:       oneDNN {}.{}.{} sgemm, {} threads by default; bfloat16 modules: {}; float16 "
             "modules: weights widened to float32 for sgemm, up to {} rows read as stored (linear_rows16)\n",
             v->major, v->minor, v->patch, resolve_threads(0),
             ops::bf16_matmul_available()
                 ? "its bf16 matmul"
                 : fmt::format("widened to float32 for sgemm, up to {} rows read as stored (linear_rows16; this "
                               "oneDNN has no bf16 matmul for this CPU)",
                               kernels::kLinearRowsMax),
             kernels::kLinearRowsMax);
  return 0;
}

}  // namespace mha::tools
