// IEEE binary16 and bfloat16 to float32, exact (every half and bf16 value is a float).
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

}  // namespace mha

#endif  // MHA_UTIL_FP16_H_
