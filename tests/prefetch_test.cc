// LineStream (kernels/cpu/prefetch.h): the decode kernel's prefetch pacing. A prefetch has no
// visible effect, so these check the bookkeeping: which lines are queued, and how many each
// share asks for.
#include "kernels/cpu/prefetch.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace mha::kernels {
namespace {

constexpr size_t kLine = kCacheLine;

// A line-aligned buffer to point ranges into (never read: prefetches do not fault, but the
// addresses stay inside it).
std::vector<uint8_t> buffer(size_t lines) { return std::vector<uint8_t>((lines + 1) * kLine); }
const uint8_t* aligned(const std::vector<uint8_t>& b) {
  const uintptr_t a = (reinterpret_cast<uintptr_t>(b.data()) + kLine - 1) & ~(kLine - 1);
  return reinterpret_cast<const uint8_t*>(a);
}

TEST(LineStream, CountsEveryLineARangeTouchesOnce) {
  const auto b = buffer(64);
  const uint8_t* p = aligned(b);
  LineStream s;
  s.Clear();
  s.Add(0, p + 10, 100);            // bytes 10 .. 110: lines 0 and 1
  s.Add(0, p + 2 * kLine, kLine);   // adjacent: line 2, merged
  s.Add(0, p + kLine + 5, 10);      // inside line 1: nothing new
  s.Add(2, p + 8 * kLine, 1);       // another stream: line 8
  s.Add(1, p + 4 * kLine, 0);       // empty: nothing
  EXPECT_EQ(s.lines(), 4u);
  EXPECT_EQ(s.pending(), 4u);
  s.Plan(4);
  s.IssueAll();
  EXPECT_EQ(s.pending(), 0u);
  s.Clear();
  EXPECT_EQ(s.lines(), 0u);
  EXPECT_EQ(s.pending(), 0u);
}

TEST(LineStream, SharesFollowTheWorkAndRoundUp) {
  const auto b = buffer(1000);
  const uint8_t* p = aligned(b);
  LineStream s;
  s.Clear();
  s.Add(0, p, 300 * kLine);
  s.Add(2, p + 500 * kLine, 100 * kLine);
  ASSERT_EQ(s.lines(), 400u);
  s.Plan(800);  // half a line per unit of work
  s.Issue(8);   // 4 lines
  EXPECT_EQ(s.pending(), 396u);
  s.Issue(3);   // 1.5, rounded up: 2
  EXPECT_EQ(s.pending(), 394u);
  s.Issue(600);  // 300: across the end of the first stream's range into the other's
  EXPECT_EQ(s.pending(), 94u);
  s.Issue(1000);  // more than is left: the rest, then nothing
  EXPECT_EQ(s.pending(), 0u);
  s.Issue(10);
  s.IssueAll();
  EXPECT_EQ(s.pending(), 0u);
}

TEST(LineStream, PlanOfNoWorkAsksForEverythingAtTheFirstShare) {
  const auto b = buffer(16);
  LineStream s;
  s.Clear();
  s.Add(3, aligned(b), 16 * kLine);
  s.Plan(0);
  s.Issue(1);
  EXPECT_EQ(s.pending(), 0u);
}

TEST(LineStream, RangesPastItsCapacityAreNotQueued) {
  // Every other line: no two ranges adjacent, more than a stream holds.
  const size_t n = LineStream::kRanges + 10;
  const auto b = buffer(2 * n);
  const uint8_t* p = aligned(b);
  LineStream s;
  s.Clear();
  for (size_t i = 0; i < n; ++i) s.Add(0, p + 2 * i * kLine, kLine);
  EXPECT_EQ(s.lines(), LineStream::kRanges);  // the rest were asked for at once
  s.Plan(1);
  s.IssueAll();
  EXPECT_EQ(s.pending(), 0u);
}

}  // namespace
}  // namespace mha::kernels
