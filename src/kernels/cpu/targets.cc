// Which SIMD targets the fast kernels were compiled for and may run here.
#include <hwy/targets.h>

#include <atomic>
#include <string>
#include <vector>

#include "kernels/cpu/flash.h"
#include "util/check.h"

namespace mha::kernels {

std::vector<std::string> simd_targets() {
  std::vector<std::string> names;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) names.emplace_back(hwy::TargetName(t));
  return names;
}

namespace {
std::atomic<bool> dot_products_allowed{true};
std::atomic<bool> vnni_allowed{true};
std::atomic<bool> byte_values_allowed{true};
}  // namespace

// __builtin_cpu_supports takes a string literal, hence a macro; false off x86.
#if defined(__x86_64__) || defined(__i386__)
#define MHA_CPU_SUPPORTS(feature) __builtin_cpu_supports(feature)
#else
#define MHA_CPU_SUPPORTS(feature) false
#endif

bool decode_int8_dots() {
  // AVX2's vpmaddubsw / vpmaddwd where there is no VNNI: every x86 target the kernel has above
  // SCALAR (AVX2, AVX3) has one of them.
  static const bool supported = MHA_CPU_SUPPORTS("avx512vnni") || MHA_CPU_SUPPORTS("avx2");
  return supported && dot_products_allowed.load(std::memory_order_relaxed);
}

bool decode_avx512_vnni() {
  static const bool supported = MHA_CPU_SUPPORTS("avx512vnni");
  return supported && dot_products_allowed.load(std::memory_order_relaxed) &&
         vnni_allowed.load(std::memory_order_relaxed);
}

bool decode_bf16_dots() {
  static const bool supported = MHA_CPU_SUPPORTS("avx512bf16");
  return supported && dot_products_allowed.load(std::memory_order_relaxed);
}

bool decode_byte_values() {
  static const bool supported = MHA_CPU_SUPPORTS("avx2");
  return supported && dot_products_allowed.load(std::memory_order_relaxed) &&
         byte_values_allowed.load(std::memory_order_relaxed);
}

bool decode_vnni_byte_values() {
  static const bool supported = MHA_CPU_SUPPORTS("avx512vnni") && MHA_CPU_SUPPORTS("avx512vbmi");
  return supported && decode_avx512_vnni() && byte_values_allowed.load(std::memory_order_relaxed);
}

bool decode_vnni_word_values() {
  return decode_avx512_vnni() && byte_values_allowed.load(std::memory_order_relaxed);
}

void allow_decode_dot_products(bool allow) { dot_products_allowed.store(allow, std::memory_order_relaxed); }

void allow_decode_avx512_vnni(bool allow) { vnni_allowed.store(allow, std::memory_order_relaxed); }

void allow_decode_byte_values(bool allow) { byte_values_allowed.store(allow, std::memory_order_relaxed); }

void force_simd_target(const std::string& name) {
  if (name.empty()) {
    hwy::SetSupportedTargetsForTest(0);
    return;
  }
  hwy::SetSupportedTargetsForTest(0);
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (name == hwy::TargetName(t)) {
      hwy::SetSupportedTargetsForTest(t);
      return;
    }
  }
  throw Error(fmt::format("unknown or unsupported SIMD target '{}'", name));
}

}  // namespace mha::kernels
