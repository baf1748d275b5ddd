// The scalar conversions of mha/half.h: float to bfloat16 and float16 rounds to nearest even;
// specials, float16 overflow and subnormals; every 16-bit value survives float and back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "mha/half.h"

namespace mha::test {
namespace {

TEST(HalfConversion, RoundsToNearestEven) {
  EXPECT_EQ(to_bfloat16(1.0f).bits, 0x3F80);
  EXPECT_EQ(to_bfloat16(1.0f + 1.0f / 256).bits, 0x3F80);                 // tie, even stays
  EXPECT_EQ(to_bfloat16(1.0f + 3.0f / 256).bits, 0x3F82);                 // tie, odd rounds up
  EXPECT_EQ(to_bfloat16(1.0f + 1.0f / 256 + 1.0f / 65536).bits, 0x3F81);  // above the tie
  EXPECT_TRUE(std::isnan(to_float(to_bfloat16(std::nanf("")))));
  EXPECT_EQ(to_float(to_bfloat16(-std::numeric_limits<float>::infinity())), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(to_float16(1.0f).bits, 0x3C00);
  EXPECT_EQ(to_float(to_float16(65504.0f)), 65504.0f);
  EXPECT_EQ(to_float(to_float16(65519.0f)), 65504.0f);
  EXPECT_EQ(to_float(to_float16(65520.0f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -24)).bits, 0x0001);       // smallest subnormal
  EXPECT_EQ(to_float16(std::ldexp(1.0f, -25)).bits, 0x0000);       // tie to even: zero
  EXPECT_EQ(to_float16(std::ldexp(1.5f, -25)).bits, 0x0001);
  EXPECT_EQ(to_float16(std::ldexp(3.0f, -25)).bits, 0x0002);       // 1.5 ulp: tie to even (2)
  EXPECT_TRUE(std::isnan(to_float(to_float16(std::nanf("")))));
  // Every float16 value survives float and back; every bf16 value too.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float16 h{static_cast<uint16_t>(b)};
    const float f = to_float(h);
    if (!std::isnan(f)) ASSERT_EQ(to_float16(f).bits, h.bits) << b;
    const bfloat16 g{static_cast<uint16_t>(b)};
    if (!std::isnan(to_float(g))) ASSERT_EQ(to_bfloat16(to_float(g)).bits, g.bits) << b;
  }
}

}  // namespace
}  // namespace mha::test
