// The row formats of KV cache storage (kv_cache.h describes them): writing a float32 row as
// float32/bfloat16/float16 or as int8/int4 groups, reading rows back, the key channel scales.
#include "modules/kv_storage.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "util/check.h"
#include "util/convert.h"
#include "util/fp16.h"

namespace mha::kv_storage {
namespace {

// A key channel whose rms exceeds this many times the median channel's is an outlier (kept exactly).
constexpr double kOutlierRatio = 4.0;
// int4 values are clamped to ±kQuantLimit (kv_cache.h): a group's bfloat16 minimum and scale and
// every stored code's value then stay finite (at most (1 + (1 + 2^-7)/15)·2^127 < 2^128).
constexpr float kQuantLimit = 0x1p127f;

// x rounded to bfloat16, toward +inf (up) or -inf: its 16 bits. |x| < 2^128 (never infinite).
uint32_t bf16_directed(double x, bool up) {
  float f = static_cast<float>(x);  // nearest, then one step the way asked if it went the other
  if (up ? f < x : f > x) f = std::nextafter(f, up ? kQuantLimit * 2 : -kQuantLimit * 2);
  const uint32_t bits = float_bits(f);
  const uint32_t high = bits >> 16;
  if ((bits & 0xFFFFu) == 0) return high;
  const bool negative = bits >> 31;
  return up != negative ? high + 1 : high;  // dropping the low half rounds toward zero
}

bool is_outlier(const int64_t* outliers, int64_t c) {
  if (!outliers) return false;
  for (int64_t i = 0; i < kCacheKeyOutliers; ++i)
    if (outliers[i] == c) return true;
  return false;
}

// row quantized to `bits`: put(c, code) for every value c of the padded row (whole groups;
// code 0 past width), word(e) for each of its scale words (kv_cache.h): a group's scale and
// minimum (int8: float32, a word each; int4: bfloat16, one word), then (keys) the outlier
// channels' float32 values (NaN if not finite). inv_channel (or nullptr): per-value multipliers
// (powers of two) applied first. Outlier channels take no part in their group: code 0, value
// kept exactly.
template <class PutCode, class Word>
void quantize_row(const float* row, int64_t cs, int64_t width, int bits, const float* inv_channel,
                  const int64_t* outliers, const PutCode& put, const Word& word) {
  const int levels = (1 << bits) - 1;
  const int64_t G = kCacheQuantGroup;
  if (outliers)
    for (int64_t i = 0; i < kCacheKeyOutliers; ++i) {
      const float x = outliers[i] >= 0 ? row[outliers[i] * cs] : 0.0f;
      // NaN for an infinity too, as for a group (the query meets it as a NaN score).
      word(outlier_offset(width, bits) + i) =
          float_bits(std::isfinite(x) ? x : std::numeric_limits<float>::quiet_NaN());
    }
  for (int64_t g = 0; g * G < width; ++g) {
    const int64_t n = std::min(G, width - g * G);
    auto value = [&](int64_t i) { return row[(g * G + i) * cs] * (inv_channel ? inv_channel[g * G + i] : 1.0f); };
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    bool finite = true, any = false;
    for (int64_t i = 0; i < n; ++i) {
      if (is_outlier(outliers, g * G + i)) continue;
      any = true;
      const float v = value(i);
      finite &= std::isfinite(v);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    if (!any || !finite) lo = hi = 0.0f;  // every channel of the group an outlier; or NaN below
    float step;
    if (bits == 8) {
      // hi/levels − lo/levels stays finite for any finite hi and lo (their difference may not).
      step = hi / static_cast<float>(levels) - lo / static_cast<float>(levels);
      // NaN for the whole group if any value is not finite: never a finite stand-in for it.
      const float nan = std::numeric_limits<float>::quiet_NaN();
      word(2 * g) = float_bits(finite ? step : nan);
      word(2 * g + 1) = float_bits(finite ? lo : nan);
    } else {
      // The minimum rounded down and the scale up (in double: hi − minimum does not overflow),
      // so that the codes' values cover [lo, hi] and each value is within half a step of its code's.
      lo = std::clamp(lo, -kQuantLimit, kQuantLimit), hi = std::clamp(hi, -kQuantLimit, kQuantLimit);
      const uint32_t minimum = bf16_directed(lo, false);
      lo = bf16_to_float(static_cast<uint16_t>(minimum));
      const uint32_t scale = bf16_directed((static_cast<double>(hi) - lo) / levels, true);
      step = bf16_to_float(static_cast<uint16_t>(scale));
      word(g) = finite ? minimum << 16 | scale : 0x7FC07FC0u;  // NaN in both halves
    }
    for (int64_t i = 0; i < G; ++i) {
      int code = 0;  // padding, outliers, a non-finite group, a group of equal values
      if (finite && step > 0.0f && i < n && !is_outlier(outliers, g * G + i)) {
        const double x = bits == 8 ? value(i) : std::clamp(value(i), -kQuantLimit, kQuantLimit);
        const double q = std::nearbyint((x - lo) / step);
        code = static_cast<int>(std::clamp(q, 0.0, static_cast<double>(levels)));
      }
      put(g * G + i, static_cast<uint8_t>(code));
    }
  }
}

// Where code c of a value row, or of key lane `lane` of a key tile, lies: byte and nibble shift
// (kv_cache.h has both layouts).
struct CodeAt {
  int64_t byte;
  int shift;
};
CodeAt row_code_at(int bits, int64_t c) {
  const int64_t G = kCacheQuantGroup, g = c / G, i = c % G;
  if (bits == 8) return {c, 0};
  return {g * G / 2 + i % (G / 2), i < G / 2 ? 0 : 4};  // byte i of the group's 16: i low, i + 16 high
}
CodeAt tile_code_at(int bits, int64_t lane, int64_t c) {
  const int64_t per_word = 32 / bits, k = c % per_word;  // codes per lane word (4 bytes)
  return {c / per_word * kCacheKeyTileBytes + lane * 4 + k % 4, static_cast<int>(k / 4 * 4)};
}

void put_code(uint8_t* codes, CodeAt at, int bits, uint8_t code) {
  if (bits == 8) {
    codes[at.byte] = code;
    return;
  }
  codes[at.byte] = static_cast<uint8_t>((codes[at.byte] & ~(0xF << at.shift)) | code << at.shift);
}
int get_code(const uint8_t* codes, CodeAt at, int bits) {
  return (codes[at.byte] >> at.shift) & (bits == 8 ? 0xFF : 0xF);
}

// Row r's tile: its codes and scale words (scale_elements rows of kCacheKeyTile), its lane.
// Value rows take only the scales' offset (their codes are a row each).
struct TileOf {
  int64_t lane, codes, scales;  // offsets into the pools
  TileOf(int64_t r, int64_t width, CacheType type, bool keys)
      : lane(r % kCacheKeyTile),
        codes(r / kCacheKeyTile * kCacheKeyTile * row_elements(type, width)),
        scales(r / kCacheKeyTile * kCacheKeyTile * scale_elements(width, keys, type)) {}
  // Where the row's scale element e lies in the scales pool (transposed: lane l of element e at
  // kCacheKeyTile · e + l of the tile).
  int64_t scale_at(int64_t e) const { return scales + e * kCacheKeyTile + lane; }
};

// `width` values of a row read back as float32 into dst: code(c) dequantized with its group's
// word(g) as the decode kernel does (one fused multiply-add), times channel (or nullptr), the
// outliers' exact values in their channels.
template <class Code, class Word>
void dequantize_row(const Code& code, const Word& word, int bits, const float* channel, const int64_t* outliers,
                    int64_t width, float* dst) {
  for (int64_t c = 0; c < width; ++c) {
    const int64_t g = c / kCacheQuantGroup;
    const float scale = bits == 8 ? cache_word_float(word(2 * g)) : cache_group_scale(word(g));
    const float minimum = bits == 8 ? cache_word_float(word(2 * g + 1)) : cache_group_minimum(word(g));
    dst[c] = std::fma(static_cast<float>(code(c)), scale, minimum) * (channel ? channel[c] : 1.0f);
  }
  if (outliers)
    for (int64_t i = 0; i < kCacheKeyOutliers; ++i)
      if (outliers[i] >= 0) dst[outliers[i]] = cache_word_float(word(outlier_offset(width, bits) + i));
}

}  // namespace

int quant_bits(CacheType t) { return t == CacheType::kInt8 ? 8 : t == CacheType::kInt4 ? 4 : 0; }

DType element_type(CacheType t) {
  switch (t) {
    case CacheType::kBF16: return DType::kBF16;
    case CacheType::kF16: return DType::kF16;
    case CacheType::kF32: return DType::kF32;
    default: return DType::kU8;  // codes
  }
}

void check_row_width(int64_t width, const char* what) {
  MHA_CHECK(width > 0 && width <= kMaxRowWidth, "{}: a head dim of {} is not in [1, 2^40]", what, width);
}

int64_t quant_groups(int64_t width) { return (width + kCacheQuantGroup - 1) / kCacheQuantGroup; }

int64_t outlier_offset(int64_t width, int bits) { return quant_groups(width) * cache_group_words(bits); }

int64_t scale_elements(int64_t width, bool keys, CacheType type) {
  return outlier_offset(width, quant_bits(type)) + (keys ? kCacheKeyOutliers : 0);
}

int64_t row_elements(CacheType t, int64_t width) {
  const int bits = quant_bits(t);
  return bits ? quant_groups(width) * kCacheQuantGroup * bits / 8 : width;
}

void write_row(const float* row, int64_t cs, int64_t width, CacheType type, void* data) {
  MHA_CHECK(!quant_bits(type), "write_row: {} rows are stored by write_key_row / write_value_row",
            cache_type_name(type));
  const DType dtype = element_type(type);
  if (dtype == DType::kF32) {
    float* dst = static_cast<float*>(data);
    for (int64_t d = 0; d < width; ++d) dst[d] = row[d * cs];
    return;
  }
  auto* dst = static_cast<uint16_t*>(data);
  if (cs == 1) {
    narrow_from_f32(row, dtype, dst, width);
    return;
  }
  for (int64_t d = 0; d < width; ++d)
    dst[d] = dtype == DType::kBF16 ? float_to_bf16(row[d * cs]) : float_to_half(row[d * cs]);
}

void read_row(const void* data, int64_t width, CacheType type, float* dst) {
  MHA_CHECK(!quant_bits(type), "read_row: {} rows are read by read_key_row / read_value_row", cache_type_name(type));
  if (type == CacheType::kF32) {
    std::copy(static_cast<const float*>(data), static_cast<const float*>(data) + width, dst);
    return;
  }
  widen_to_f32(data, element_type(type), dst, width);
}

void write_key_row(const float* row, int64_t cs, int64_t width, CacheType type, const float* inv_channel,
                   const int64_t* outliers, uint8_t* codes, uint32_t* scales, int64_t r) {
  const int bits = quant_bits(type);
  const TileOf t(r, width, type, true);
  quantize_row(
      row, cs, width, bits, inv_channel, outliers,
      [&](int64_t c, uint8_t code) { put_code(codes + t.codes, tile_code_at(bits, t.lane, c), bits, code); },
      [&](int64_t e) -> uint32_t& { return scales[t.scale_at(e)]; });
}

void read_key_row(const uint8_t* codes, const uint32_t* scales, int64_t r, const float* channel,
                  const int64_t* outliers, int64_t width, CacheType type, float* dst) {
  const int bits = quant_bits(type);
  const TileOf t(r, width, type, true);
  dequantize_row([&](int64_t c) { return get_code(codes + t.codes, tile_code_at(bits, t.lane, c), bits); },
                 [&](int64_t e) { return scales[t.scale_at(e)]; }, bits, channel, outliers, width, dst);
}

void write_value_row(const float* row, int64_t cs, int64_t width, CacheType type, uint8_t* codes, uint32_t* scales,
                     int64_t r) {
  const int bits = quant_bits(type);
  const TileOf t(r, width, type, false);
  uint8_t* at = codes + r * row_elements(type, width);
  quantize_row(
      row, cs, width, bits, nullptr, nullptr,
      [&](int64_t c, uint8_t code) { put_code(at, row_code_at(bits, c), bits, code); },
      [&](int64_t e) -> uint32_t& { return scales[t.scale_at(e)]; });
}

void read_value_row(const uint8_t* codes, const uint32_t* scales, int64_t r, int64_t width, CacheType type,
                    float* dst) {
  const int bits = quant_bits(type);
  const TileOf t(r, width, type, false);
  const uint8_t* at = codes + r * row_elements(type, width);
  dequantize_row([&](int64_t c) { return get_code(at, row_code_at(bits, c), bits); },
                 [&](int64_t e) { return scales[t.scale_at(e)]; }, bits, nullptr, nullptr, width, dst);
}

void key_channels(const float* rows, int64_t row_stride, int64_t cs, int64_t n, int64_t D, float* s,
                  int64_t* outliers) {
  std::vector<double> rms(static_cast<size_t>(D), 0.0);
  for (int64_t c = 0; c < D; ++c) {
    double sum = 0.0;
    int64_t count = 0;
    for (int64_t t = 0; t < n; ++t) {
      const double v = rows[t * row_stride + c * cs];
      if (std::isfinite(v)) sum += v * v, ++count;
    }
    rms[c] = count ? std::sqrt(sum / static_cast<double>(count)) : 0.0;
  }
  // Outliers: the largest channels of rms above kOutlierRatio · the median, at most
  // kCacheKeyOutliers, listed in channel order (-1 for unused entries).
  std::vector<int64_t> order(static_cast<size_t>(D));
  for (int64_t c = 0; c < D; ++c) order[c] = c;
  std::vector<double> sorted = rms;
  std::nth_element(sorted.begin(), sorted.begin() + D / 2, sorted.end());
  const double median = sorted[static_cast<size_t>(D / 2)];
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rms[a] > rms[b]; });
  std::vector<int64_t> picked;
  for (int64_t c : order) {
    if (static_cast<int64_t>(picked.size()) == kCacheKeyOutliers || !(rms[c] > kOutlierRatio * median)) break;
    picked.push_back(c);
  }
  std::sort(picked.begin(), picked.end());
  for (int64_t i = 0; i < kCacheKeyOutliers; ++i)
    outliers[i] = i < static_cast<int64_t>(picked.size()) ? picked[i] : -1;
  double mean = 0.0;  // over the channels left in the groups
  for (int64_t c = 0; c < D; ++c)
    if (!is_outlier(outliers, c)) mean += rms[c] / static_cast<double>(D - static_cast<int64_t>(picked.size()));
  for (int64_t c = 0; c < D; ++c) {
    const double r = std::max(rms[c], mean);
    const int exponent = r > 0.0 && std::isfinite(r) ? static_cast<int>(std::lround(std::log2(r))) : 0;
    s[c] = is_outlier(outliers, c) ? 1.0f : std::ldexp(1.0f, std::clamp(exponent, -30, 30));
  }
}

}  // namespace mha::kv_storage
