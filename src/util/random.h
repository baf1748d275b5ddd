// Portable, counter-based random numbers for initialisation and demo inputs: the same seed
// gives the same values on every platform and standard library (unlike <random>'s
// distributions). Not for dropout (that is kernels/dropout.h).
#ifndef MHA_UTIL_RANDOM_H_
#define MHA_UTIL_RANDOM_H_

#include <cmath>
#include <cstdint>

namespace mha {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 random bits, from (seed, index).
inline float uniform01(uint64_t seed, uint64_t index) {
  return static_cast<float>(splitmix64(seed ^ splitmix64(index)) >> 40) * (1.0f / 16777216.0f);
}

// Uniform in [-a, a).
inline float uniform_pm(uint64_t seed, uint64_t index, float a) {
  return (2.0f * uniform01(seed, index) - 1.0f) * a;
}

// Standard normal (Box-Muller) from (seed, index).
inline float normal(uint64_t seed, uint64_t index) {
  const double u1 = (static_cast<double>(splitmix64(seed ^ splitmix64(2 * index)) >> 11) + 1.0) *
                    (1.0 / 9007199254740992.0);
  const double u2 = static_cast<double>(splitmix64(seed ^ splitmix64(2 * index + 1)) >> 11) *
                    (1.0 / 9007199254740992.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace mha

#endif  // MHA_UTIL_RANDOM_H_
