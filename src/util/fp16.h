// IEEE binary16 and bfloat16 to float32, exact (every half and bf16 value is a float), and
// float32 to both, rounding to nearest even (the bit-level definitions behind mha/half.h).
#ifndef MHA_UTIL_FP16_H_
#define MHA_UTIL_FP16_H_

#include <cstdint>
#include <cstring>

namespace mha {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return bits_to_float(sign);  // +-0
  // Subnormal: normalise.
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400u) == 0);
  return bits_to_float(sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3FFu) << 13));
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Round to nearest even on the upper 16 bits; NaN stays a quiet NaN of the same sign.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16, round to nearest even, overflow to infinity, subnormals kept.
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: infinity
  if (a >= 0x38800000u) {                       // normal half (>= 2^-14)
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
    return sign | static_cast<uint16_t>(r >> 13);
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
  // Subnormal half: value = mant · 2^-24; shift the full significand into place, round to even.
  const uint32_t exp = a >> 23, mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14 .. 24
  const uint32_t half = 1u << (shift - 1), rest = mant & ((1u << shift) - 1u);
  uint32_t h = mant >> shift;
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

}  // namespace mha

#endif  // MHA_UTIL_FP16_H_
