#include "mha/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "util/check.h"
#include "util/convert.h"
#include "util/fp16.h"

namespace mha {
namespace {

int quant_bits(CacheType t) { return t == CacheType::kInt8 ? 8 : t == CacheType::kInt4 ? 4 : 0; }

DType element_type(CacheType t) {
  switch (t) {
    case CacheType::kBF16: return DType::kBF16;
    case CacheType::kF16: return DType::kF16;
    case CacheType::kF32: return DType::kF32;
    default: return DType::kU8;  // codes
  }
}

int64_t quant_groups(int64_t width) { return (width + kCacheQuantGroup - 1) / kCacheQuantGroup; }

// Elements of storage per row of `width` values.
int64_t row_elements(CacheType t, int64_t width) {
  const int bits = quant_bits(t);
  return bits ? quant_groups(width) * kCacheQuantGroup * bits / 8 : width;
}

// Row (b, h, t) of x (any strides) into storage of dtype t at element `at`, rounded to it.
void store_row(const View<const float>& x, int64_t b, int64_t h, int64_t t, void* storage, int64_t at, int64_t width,
               DType dtype) {
  const float* row = x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
  if (dtype == DType::kF32) {
    float* dst = static_cast<float*>(storage) + at;
    for (int64_t d = 0; d < width; ++d) dst[d] = row[d * x.stride[3]];
    return;
  }
  auto* dst = static_cast<uint16_t*>(storage) + at;
  if (x.stride[3] == 1) {
    narrow_from_f32(row, dtype, dst, width);
    return;
  }
  for (int64_t d = 0; d < width; ++d) {
    const float v = row[d * x.stride[3]];
    dst[d] = dtype == DType::kBF16 ? float_to_bf16(v) : float_to_half(v);
  }
}

// Row (b, h, t) of x quantized to `bits`: codes (row_elements bytes) and (scale, minimum) pairs
// per group, in the format kv_cache.h describes.
// inv_channel (or nullptr): per-value multipliers (powers of two) applied first.
void quantize_row(const View<const float>& x, int64_t b, int64_t h, int64_t t, int64_t width, int bits,
                  const float* inv_channel, uint8_t* codes, float* scales) {
  const float* row = x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
  const int64_t cs = x.stride[3];
  const int levels = (1 << bits) - 1;
  const int64_t G = kCacheQuantGroup;
  std::fill(codes, codes + row_elements(bits == 8 ? CacheType::kInt8 : CacheType::kInt4, width), uint8_t{0});
  for (int64_t g = 0; g * G < width; ++g) {
    const int64_t n = std::min(G, width - g * G);
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    bool finite = true;
    auto value = [&](int64_t i) { return row[(g * G + i) * cs] * (inv_channel ? inv_channel[g * G + i] : 1.0f); };
    for (int64_t i = 0; i < n; ++i) {
      const float v = value(i);
      finite &= std::isfinite(v);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    if (!finite) {  // NaN for the whole group: never a finite stand-in for a non-finite value
      scales[2 * g] = scales[2 * g + 1] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    // hi/levels − lo/levels stays finite for any finite hi and lo (their difference may not).
    const float scale = hi / static_cast<float>(levels) - lo / static_cast<float>(levels);
    scales[2 * g] = scale;
    scales[2 * g + 1] = lo;
    if (!(scale > 0.0f)) continue;  // all equal: every code 0
    for (int64_t i = 0; i < n; ++i) {
      const double q = std::nearbyint((static_cast<double>(value(i)) - lo) / scale);
      const auto code = static_cast<uint8_t>(std::clamp(q, 0.0, static_cast<double>(levels)));
      if (bits == 8) {
        codes[g * G + i] = code;
      } else {  // byte i of the group's 16: value i low, value i + 16 high
        uint8_t& byte = codes[g * G / 2 + i % (G / 2)];
        byte = static_cast<uint8_t>(byte | (i < G / 2 ? code : code << 4));
      }
    }
  }
}

// Value c of a quantized row, dequantized as the decode kernel does (one fused multiply-add).
float dequantize(const uint8_t* codes, const float* scales, int64_t c, int bits) {
  const int64_t G = kCacheQuantGroup, g = c / G, i = c % G;
  const int code = bits == 8 ? codes[c] : (codes[g * G / 2 + i % (G / 2)] >> (i < G / 2 ? 0 : 4)) & 0xF;
  return std::fma(static_cast<float>(code), scales[2 * g], scales[2 * g + 1]);
}

// The key channel scales of one (sequence, kv head) from its first positions k[b, h, t0 .. t1):
// s_c = the power of two nearest max(rms_c, mean over channels of rms_c), in [2^-30, 2^30] —
// channels of ordinary size share one scale, outlier channels get their own. Non-finite
// values are left out of the statistics; no finite value at all gives 1.
void channel_scales(const View<const float>& k, int64_t b, int64_t h, int64_t t0, int64_t t1, float* s) {
  const int64_t D = k.shape[3];
  std::vector<double> rms(static_cast<size_t>(D), 0.0);
  double mean = 0.0;
  for (int64_t c = 0; c < D; ++c) {
    double sum = 0.0;
    int64_t n = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const double v = k.data[b * k.stride[0] + h * k.stride[1] + t * k.stride[2] + c * k.stride[3]];
      if (std::isfinite(v)) sum += v * v, ++n;
    }
    rms[c] = n ? std::sqrt(sum / static_cast<double>(n)) : 0.0;
    mean += rms[c] / static_cast<double>(D);
  }
  for (int64_t c = 0; c < D; ++c) {
    const double r = std::max(rms[c], mean);
    s[c] = r > 0.0 && std::isfinite(r) ? std::ldexp(1.0f, std::clamp(static_cast<int>(std::lround(std::log2(r))), -30, 30))
                                       : 1.0f;
  }
}

}  // namespace

const char* cache_type_name(CacheType type) {
  switch (type) {
    case CacheType::kF32: return "float32";
    case CacheType::kBF16: return "bfloat16";
    case CacheType::kF16: return "float16";
    case CacheType::kInt8: return "int8";
    case CacheType::kInt4: return "int4";
  }
  return "unknown";
}

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  const auto& c = config_;
  MHA_CHECK(c.batch >= 0 && c.kv_heads > 0 && c.head_dim_qk > 0 && c.head_dim_v > 0 && c.capacity >= 0 && c.window >= 0,
            "KvCache: batch {}, kv_heads {}, head dims ({}, {}), capacity {}, window {}: all must be positive "
            "(batch, capacity and window may be 0)",
            c.batch, c.kv_heads, c.head_dim_qk, c.head_dim_v, c.capacity, c.window);
  MHA_CHECK(c.dtype == CacheType::kF32 || c.dtype == CacheType::kBF16 || c.dtype == CacheType::kF16 ||
                c.dtype == CacheType::kInt8 || c.dtype == CacheType::kInt4,
            "KvCache: dtype must be float32, bfloat16, float16, int8 or int4; got value {}",
            static_cast<int>(c.dtype));
  // The storage's element counts must fit int64 (Tensor checks the allocation itself).
  const int64_t per_slot = checked_add(c.head_dim_qk, c.head_dim_v, "KvCache: head dims");
  checked_mul(checked_mul(c.batch, c.kv_heads, "KvCache: batch · kv_heads"), per_slot, "KvCache: storage per slot");
  length_.assign(static_cast<size_t>(c.batch), 0);
  channels_fixed_.assign(static_cast<size_t>(c.batch), 0);
  if (quantized()) {
    k_channels_ = Tensor(DType::kF32, {c.batch, c.kv_heads, c.head_dim_qk});
    std::fill(k_channels_.data<float>(), k_channels_.data<float>() + k_channels_.numel(), 1.0f);
  }
  const int64_t initial = c.capacity > 0 ? c.capacity : 16;
  reserve(c.window > 0 ? std::min(initial, c.window) : initial);
}

void KvCache::check_sequence(int64_t b, const char* accessor) const {
  MHA_CHECK(b >= 0 && b < config_.batch, "KvCache::{}: sequence {} is outside [0, batch = {})", accessor, b,
            config_.batch);
}

void KvCache::check_element_type(DType wanted, const char* accessor) const {
  MHA_CHECK(!quantized() && wanted == element_type(config_.dtype),
            "KvCache::{}: the cache stores {}; asked for {}{}", accessor, cache_type_name(config_.dtype),
            dtype_name(wanted), quantized() ? " (use key_codes()/key_scales() or keys_as_float())" : "");
}

void KvCache::check_quantized(const char* accessor) const {
  MHA_CHECK(quantized(), "KvCache::{}: the cache stores {}, not int8 or int4 codes; use keys()/values()", accessor,
            cache_type_name(config_.dtype));
}

View<const uint8_t> KvCache::key_codes() const {
  check_quantized("key_codes");
  return k_.view<uint8_t>();
}
View<const uint8_t> KvCache::value_codes() const {
  check_quantized("value_codes");
  return v_.view<uint8_t>();
}
View<const float> KvCache::key_scales() const {
  check_quantized("key_scales");
  return k_scales_.view<float>();
}
View<const float> KvCache::key_channel_scales() const {
  check_quantized("key_channel_scales");
  return k_channels_.view<float>();
}
View<const float> KvCache::value_scales() const {
  check_quantized("value_scales");
  return v_scales_.view<float>();
}

int64_t KvCache::nbytes() const {
  size_t n = k_.nbytes() + v_.nbytes();
  if (quantized()) n += k_scales_.nbytes() + v_scales_.nbytes();
  return static_cast<int64_t>(n);
}

Tensor KvCache::as_float(const Tensor& data, const Tensor& scales, const Tensor& channels, int64_t width) const {
  const auto& c = config_;
  if (!quantized()) return data.converted(DType::kF32);
  Tensor out(DType::kF32, {c.batch, c.kv_heads, capacity_, width});
  const int bits = quant_bits(c.dtype);
  const int64_t row_bytes = data.shape()[3], row_scales = scales.shape()[3];
  const int64_t rows = c.batch * c.kv_heads * capacity_;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (c.kv_heads * capacity_), slot = r % capacity_;
    float* dst = out.data<float>() + r * width;
    if (slot >= stored(b)) {
      std::fill(dst, dst + width, 0.0f);
      continue;
    }
    const uint8_t* codes = data.data<uint8_t>() + r * row_bytes;
    const float* sc = scales.data<float>() + r * row_scales;
    const float* ch = channels.defined() ? channels.data<float>() + r / capacity_ * width : nullptr;
    for (int64_t e = 0; e < width; ++e) dst[e] = dequantize(codes, sc, e, bits) * (ch ? ch[e] : 1.0f);
  }
  return out;
}

std::pair<Tensor, Tensor> KvCache::as_stored(const View<const float>& k, const View<const float>& v,
                                             const std::vector<int64_t>& counts) const {
  KvCacheConfig c = config_;
  c.window = 0;
  c.capacity = k.rank == 4 ? std::max<int64_t>(k.shape[2], 1) : 1;
  KvCache tmp(c);
  if (quantized()) {
    tmp.k_channels_ = k_channels_.converted(DType::kF32);  // a copy
    tmp.channels_fixed_ = channels_fixed_;
  }
  tmp.append(k, v, counts);  // checks the shapes
  return {tmp.keys_as_float(), tmp.values_as_float()};
}

Tensor KvCache::keys_as_float() const { return as_float(k_, k_scales_, k_channels_, config_.head_dim_qk); }
Tensor KvCache::values_as_float() const { return as_float(v_, v_scales_, Tensor(), config_.head_dim_v); }

int64_t KvCache::length(int64_t b) const {
  check_sequence(b, "length");
  return length_[b];
}

int64_t KvCache::stored(int64_t b) const {
  check_sequence(b, "stored");
  return config_.window > 0 ? std::min(length_[b], config_.window) : length_[b];
}

void KvCache::reset() {
  std::fill(length_.begin(), length_.end(), 0);
  std::fill(channels_fixed_.begin(), channels_fixed_.end(), 0);
  if (quantized()) std::fill(k_channels_.data<float>(), k_channels_.data<float>() + k_channels_.numel(), 1.0f);
}

void KvCache::reserve(int64_t slots) {
  if (slots <= capacity_) return;
  const auto& c = config_;
  const DType et = element_type(c.dtype);
  // Each plane is (B, Hkv, slots, width); rows [0, stored) keep their slots: a ring only grows
  // before it wraps (capacity < window).
  auto grow = [&](Tensor& plane, DType type, int64_t width) {
    Tensor t(type, {c.batch, c.kv_heads, slots, width});
    const int64_t row = width * static_cast<int64_t>(dtype_size(type));
    if (capacity_ > 0) {
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = 0; h < c.kv_heads; ++h)
          std::memcpy(static_cast<std::byte*>(t.raw()) + (b * c.kv_heads + h) * slots * row,
                      static_cast<const std::byte*>(plane.raw()) + (b * c.kv_heads + h) * capacity_ * row,
                      static_cast<size_t>(stored(b) * row));
    }
    plane = std::move(t);
  };
  grow(k_, et, row_elements(c.dtype, c.head_dim_qk));
  grow(v_, et, row_elements(c.dtype, c.head_dim_v));
  if (quantized()) {
    grow(k_scales_, DType::kF32, 2 * quant_groups(c.head_dim_qk));
    grow(v_scales_, DType::kF32, 2 * quant_groups(c.head_dim_v));
  }
  capacity_ = slots;
}

void KvCache::append(const View<const float>& k, const View<const float>& v, const std::vector<int64_t>& counts) {
  const auto& c = config_;
  MHA_CHECK(k.rank == 4 && k.shape[0] == c.batch && k.shape[1] == c.kv_heads && k.shape[3] == c.head_dim_qk,
            "KvCache::append: keys must be (B, Hkv, n, Dk) = ({}, {}, n, {}); got {}", c.batch, c.kv_heads, c.head_dim_qk,
            shape_string(k));
  MHA_CHECK(v.rank == 4 && v.shape[0] == c.batch && v.shape[1] == c.kv_heads && v.shape[2] == k.shape[2] &&
                v.shape[3] == c.head_dim_v,
            "KvCache::append: values must be (B, Hkv, n, Dv) = ({}, {}, {}, {}); got {}", c.batch, c.kv_heads,
            k.shape[2], c.head_dim_v, shape_string(v));
  MHA_CHECK((k.numel() == 0 || k.data) && (v.numel() == 0 || v.data), "KvCache::append: keys {} or values {} have a "
            "null data pointer", shape_string(k), shape_string(v));
  const int64_t n = k.shape[2];
  MHA_CHECK(counts.empty() || static_cast<int64_t>(counts.size()) == c.batch,
            "KvCache::append: {} counts for a batch of {}", counts.size(), c.batch);
  int64_t need = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t cnt = counts.empty() ? n : counts[b];
    MHA_CHECK(cnt >= 0 && cnt <= n, "KvCache::append: count[{}] = {} outside [0, {}]", b, cnt, n);
    need = std::max(need, length_[b] + cnt);
  }
  if (c.window > 0) need = std::min(need, c.window);
  if (need > capacity_) reserve(std::max(need, std::min(2 * capacity_, c.window > 0 ? c.window : INT64_MAX)));

  const int bits = quant_bits(c.dtype);
  const DType et = element_type(c.dtype);
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t cnt = counts.empty() ? n : counts[b];
    // A windowed cache only needs the last `window` of the new positions.
    const int64_t first = c.window > 0 ? std::max<int64_t>(0, cnt - c.window) : 0;
    std::vector<float> inv(bits ? static_cast<size_t>(c.head_dim_qk) : 0);
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      float* ch = bits ? k_channels_.data<float>() + (b * c.kv_heads + h) * c.head_dim_qk : nullptr;
      // A sequence's first positions fix its key channel scales.
      if (bits && !channels_fixed_[b] && cnt > 0) channel_scales(k, b, h, 0, cnt, ch);
      for (size_t e = 0; e < inv.size(); ++e) inv[e] = 1.0f / ch[e];
      for (int64_t t = first; t < cnt; ++t) {
        const int64_t pos = length_[b] + t;
        const int64_t row = (b * c.kv_heads + h) * capacity_ + (c.window > 0 ? pos % c.window : pos);
        if (bits) {
          quantize_row(k, b, h, t, c.head_dim_qk, bits, inv.data(), k_.data<uint8_t>() + row * k_.shape()[3],
                       k_scales_.data<float>() + row * k_scales_.shape()[3]);
          quantize_row(v, b, h, t, c.head_dim_v, bits, nullptr, v_.data<uint8_t>() + row * v_.shape()[3],
                       v_scales_.data<float>() + row * v_scales_.shape()[3]);
        } else {
          store_row(k, b, h, t, k_.raw(), row * c.head_dim_qk, c.head_dim_qk, et);
          store_row(v, b, h, t, v_.raw(), row * c.head_dim_v, c.head_dim_v, et);
        }
      }
    }
    length_[b] += cnt;
    if (bits && cnt > 0) channels_fixed_[b] = 1;
  }
}


}  // namespace mha
