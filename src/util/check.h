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

#endif  // MHA_UTIL_CHECK_H_
