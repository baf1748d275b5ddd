// mha::printable: text from files and arguments made safe to print (see mha/error.h).
#include <cstdint>
#include <string>
#include <string_view>

#include "mha/error.h"

namespace mha {
namespace {

// The length of the valid UTF-8 sequence at s[i] that encodes a printable code point (no C1
// control, no surrogate, no overlong form), or 0.
size_t printable_utf8(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  size_t n;
  uint32_t cp;
  if (b0 >= 0xc2 && b0 <= 0xdf) n = 2, cp = b0 & 0x1f;
  else if (b0 >= 0xe0 && b0 <= 0xef) n = 3, cp = b0 & 0x0f;
  else if (b0 >= 0xf0 && b0 <= 0xf4) n = 4, cp = b0 & 0x07;
  else return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3f);
  }
  const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f)) return 0;
  return n;
}

}  // namespace

std::string printable(std::string_view text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const uint8_t b = static_cast<uint8_t>(text[i]);
    if (b >= 0x20 && b < 0x7f) {
      out += static_cast<char>(b);
      ++i;
    } else if (const size_t n = b >= 0x80 ? printable_utf8(text, i) : 0; n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
      ++i;
    }
  }
  return out;
}

}  // namespace mha
