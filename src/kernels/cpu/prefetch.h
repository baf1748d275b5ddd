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

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace mha::kernels {

enum class PrefetchTo { kL1, kL2 };

constexpr uintptr_t kCacheLine = 64;

// Asks for the cache line at address a.
template <PrefetchTo kTo>
inline void PrefetchLine(uintptr_t a) {
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

// Asks for every cache line that [p, p + bytes) touches. A prefetch never faults, so the lines
// may extend past the object.
template <PrefetchTo kTo>
inline void PrefetchLines(const void* p, size_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t a = start & ~(kCacheLine - 1); a < start + bytes; a += kCacheLine) PrefetchLine<kTo>(a);
}

// The cache lines of the next block of a stream of work, prefetched (into L2) a few at a time
// through the current block's work. A burst of more prefetches than a core has line fill
// buffers (16 on recent Intel cores) stalls the core until lines return, and the arithmetic
// that should overlap the stream waits with it. Measured on the Xeon VM: a read loop with 4
// FMAs per line and a prefetch per line ran at 35 GB/s with bursts of 16 prefetches, 21 GB/s
// with bursts of 32; the decode step over a float32 cache spent about a third of its time on
// its key prefetch bursts (128 lines each), and with them spread took 9.4–9.7 ms instead of
// 11.6 (docs/benchmarks.md).
//
// The lines are paced by the work: Plan(work) spreads them over `work` units (the decode kernel
// counts multiply-adds, weighted by their cost), and Issue(w), called by a piece of work of w
// units, asks for its share, so that the lines go out at the same rate through the scores as
// through the value passes. With an equal share per call instead, the scores' few calls (a
// sixteenth of the calls for a third of the time) left the stream idle: the bfloat16 step at
// 256 MiB took 6.59 ms against 5.96 (docs/benchmarks.md).
//
// Add() collects the lines by stream (keys, key scales, values, value scales: prefetched in
// that order), merging adjacent ranges; IssueAll() asks for what the shares left.
class LineStream {
 public:
  static constexpr size_t kStreams = 4;
  // Ranges per stream: a block's rows one by one when they are not adjacent (strided K or V
  // rows of 128 keys); past that, Add() prefetches a range at once.
  static constexpr size_t kRanges = 130;

  void Clear() {
    for (size_t s = 0; s < kStreams; ++s) count_[s] = 0;
    stream_ = index_ = 0;
    at_ = end_ = 0;
    lines_ = quota_ = 0;
  }
  // [p, p + bytes) of stream s.
  void Add(size_t s, const void* p, size_t bytes) {
    if (bytes == 0) return;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p) & ~(kCacheLine - 1);
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes + kCacheLine - 1) & ~(kCacheLine - 1);
    Range* r = ranges_[s];
    size_t& n = count_[s];
    if (n > 0 && r[n - 1].end >= lo && r[n - 1].lo <= lo) {  // adjacent or overlapping the last one
      if (hi > r[n - 1].end) {
        lines_ += (hi - r[n - 1].end) / kCacheLine;
        r[n - 1].end = hi;
      }
      return;
    }
    if (n == kRanges) {
      PrefetchLines<PrefetchTo::kL2>(p, bytes);
      return;
    }
    r[n++] = {lo, hi};
    lines_ += (hi - lo) / kCacheLine;
  }
  void Plan(uint64_t work) {
    quota_ = (static_cast<uint64_t>(lines_) << kFraction) / std::max<uint64_t>(work, 1);
    stream_ = index_ = 0;
    at_ = end_ = 0;
  }
  // The share of `work` units, rounded up: the lines run out a little early rather than owe a
  // remainder from call to call (carried, it cost the float32 step ~5%: a chain through memory
  // in the value pass's loop over keys).
  inline void Issue(uint64_t work) {
    const uint64_t n = (work * quota_ + (uint64_t{1} << kFraction) - 1) >> kFraction;
    for (uint64_t k = n; k > 0; --k) {
      if (at_ == end_ && !Next()) return;
      PrefetchLine<PrefetchTo::kL2>(at_);
      at_ += kCacheLine;
    }
  }
  void IssueAll() {
    for (;;) {
      if (at_ == end_ && !Next()) return;
      PrefetchLine<PrefetchTo::kL2>(at_);
      at_ += kCacheLine;
    }
  }
  // The lines queued (adjacent and overlapping ranges counted once; past kRanges a range is
  // prefetched at once, not queued), and those not yet asked for.
  size_t lines() const { return lines_; }
  size_t pending() const {
    size_t n = (end_ - at_) / kCacheLine;
    for (size_t s = stream_; s < kStreams; ++s)
      for (size_t i = s == stream_ ? index_ : 0; i < count_[s]; ++i)
        n += (ranges_[s][i].end - ranges_[s][i].lo) / kCacheLine;
    return n;
  }

 private:
  static constexpr int kFraction = 20;  // quota_: lines in 2^-20
  struct Range {
    uintptr_t lo, end;
  };
  // Moves to the next range; false at the end (then Issue does nothing until the next Plan).
  bool Next() {
    while (stream_ < kStreams) {
      if (index_ < count_[stream_]) {
        at_ = ranges_[stream_][index_].lo;
        end_ = ranges_[stream_][index_].end;
        ++index_;
        return true;
      }
      ++stream_;
      index_ = 0;
    }
    quota_ = 0;
    return false;
  }

  Range ranges_[kStreams][kRanges];
  size_t count_[kStreams] = {};
  size_t stream_ = 0, index_ = 0;
  uintptr_t at_ = 0, end_ = 0;
  size_t lines_ = 0;
  uint64_t quota_ = 0;  // lines per unit of work
};

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_PREFETCH_H_
