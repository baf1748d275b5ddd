// Argument checks that throw mha::Error with a formatted message.
#ifndef MHA_UTIL_CHECK_H_
#define MHA_UTIL_CHECK_H_

#include <fmt/format.h>

#include "mha/error.h"

// MHA_CHECK(cond, "fmt {}", args...): throws mha::Error(formatted) when cond is false.
#define MHA_CHECK(cond, ...)                                  \
  do {                                                        \
    if (!(cond)) throw ::mha::Error(::fmt::format(__VA_ARGS__)); \
  } while (0)

namespace mha {

// a · b and a + b for sizes, counts and offsets: an mha::Error naming `what` instead of signed
// overflow (undefined behaviour) when the result does not fit int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Error(fmt::format("{}: {} × {} overflows 64 bits", what, a, b));
  return r;
}
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw Error(fmt::format("{}: {} + {} overflows 64 bits", what, a, b));
  return r;
}

}  // namespace mha

#endif  // MHA_UTIL_CHECK_H_
