// Software prefetches that the compiler keeps.
//
// GCC 12 treats __builtin_prefetch (and so hwy::Prefetch and _mm_prefetch) as free of side
// effects: a loop, or a function, that does nothing but prefetch may be deleted (from -O1 on; a
// loop calling `void f(const char* p, size_t n) { for (...) __builtin_prefetch(p + b); }` loses
// the call). The decode kernel lost its key prefetches for every cache type and its value
// prefetches for int8/int4 that way (objdump of flash_decode.cc.o); restored, the int8 and
// bfloat16 steps at 256 MiB took ~25% less time (docs/benchmarks.md). A volatile asm statement is
// never deleted.
#ifndef MHA_KERNELS_CPU_PREFETCH_H_
#define MHA_KERNELS_CPU_PREFETCH_H_

#include <cstddef>
#include <cstdint>

namespace mha::kernels {

enum class PrefetchTo { kL1, kL2 };

// Asks for every cache line that [p, p + bytes) touches. A prefetch never faults, so the lines
// may extend past the object.
template <PrefetchTo kTo>
inline void PrefetchLines(const void* p, size_t bytes) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t a = start & ~(kLine - 1); a < start + bytes; a += kLine) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if constexpr (kTo == PrefetchTo::kL1) {
      asm volatile("prefetcht0 (%0)" : : "r"(a));
    } else {
      asm volatile("prefetcht2 (%0)" : : "r"(a));
    }
#else
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, kTo == PrefetchTo::kL1 ? 3 : 1);
#endif
  }
}

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_PREFETCH_H_
