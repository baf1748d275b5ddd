// Which SIMD targets the fast kernels were compiled for and may run here.
#include <hwy/targets.h>

#include <atomic>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
std::atomic<bool> amx_allowed{true};
std::atomic<bool> amx_values_allowed{true};
std::atomic<bool> bf16_values_allowed{true};
std::atomic<bool> bf16_values_forced{false};
std::atomic<bool> forward_amx_allowed{true};
std::atomic<bool> backward_amx_allowed{true};
std::atomic<size_t> pack_limit{kDefaultBackwardPackLimit};
std::atomic<size_t> value_keep_limit{kDefaultForwardValueKeepLimit};

// Whether the OS lets this process use AMX's tile data: Linux asks for it once per process
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; the kernel then saves the tiles with a
// thread's state). False elsewhere.
// Whether the CPU has AMX's tiles and their bfloat16 products (CPUID leaf 7: EDX bits 24 and 22;
// __builtin_cpu_supports has no name for them in clang 14).
bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  return (d >> 24 & 1) != 0 && (d >> 22 & 1) != 0;
#else
  return false;
#endif
}

// Whether the CPU is AMD's (CPUID leaf 0's vendor string).
bool cpu_is_amd() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  return b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "Auth" "enti" "cAMD"
#else
  return false;
#endif
}

bool amx_tile_data_granted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
#else
  return false;
#endif
}
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

namespace {
// AMX-BF16 on this CPU and the tile state granted. Asked on first need only: allow_decode_amx(false),
// allow_forward_amx(false) and allow_backward_amx(false) before it keep the process's permissions
// as they were.
bool amx_bf16_granted() {
  static const bool supported = cpu_has_amx_bf16() && amx_tile_data_granted();
  return supported;
}
}  // namespace

bool decode_amx_bf16() {
  return amx_allowed.load(std::memory_order_relaxed) && decode_bf16_dots() && amx_bf16_granted();
}

bool decode_amx_bf16_values() { return amx_values_allowed.load(std::memory_order_relaxed) && decode_amx_bf16(); }

bool decode_bf16_values() {
  static const bool fast = cpu_is_amd();
  return (fast || bf16_values_forced.load(std::memory_order_relaxed)) &&
         bf16_values_allowed.load(std::memory_order_relaxed) && decode_bf16_dots();
}

bool forward_amx_bf16() {
  return forward_amx_allowed.load(std::memory_order_relaxed) && decode_bf16_dots() && amx_bf16_granted();
}

bool backward_amx_bf16() {
  return backward_amx_allowed.load(std::memory_order_relaxed) && decode_bf16_dots() && amx_bf16_granted();
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

void allow_decode_amx(bool allow) { amx_allowed.store(allow, std::memory_order_relaxed); }

void allow_decode_amx_values(bool allow) { amx_values_allowed.store(allow, std::memory_order_relaxed); }

void allow_decode_bf16_values(bool allow) { bf16_values_allowed.store(allow, std::memory_order_relaxed); }

void force_decode_bf16_values(bool force) { bf16_values_forced.store(force, std::memory_order_relaxed); }

void allow_forward_amx(bool allow) { forward_amx_allowed.store(allow, std::memory_order_relaxed); }

void allow_backward_amx(bool allow) { backward_amx_allowed.store(allow, std::memory_order_relaxed); }

size_t backward_pack_limit() { return pack_limit.load(std::memory_order_relaxed); }

void set_backward_pack_limit(size_t bytes) { pack_limit.store(bytes, std::memory_order_relaxed); }

size_t forward_value_keep_limit() { return value_keep_limit.load(std::memory_order_relaxed); }

void set_forward_value_keep_limit(size_t bytes) { value_keep_limit.store(bytes, std::memory_order_relaxed); }

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
