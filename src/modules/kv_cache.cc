#include "mha/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "modules/kv_storage.h"
#include "util/check.h"

namespace mha {
using namespace kv_storage;

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
  MHA_CHECK(c.sink_tokens >= 0 && (c.sink_tokens == 0 || c.window > 0),
            "KvCache: sink_tokens = {} needs a window (window = {}); both >= 0", c.sink_tokens, c.window);
  MHA_CHECK(c.sink_tokens <= std::numeric_limits<int64_t>::max() - c.window,
            "KvCache: sink_tokens + window = {} + {} overflows int64", c.sink_tokens, c.window);
  MHA_CHECK(c.dtype == CacheType::kF32 || c.dtype == CacheType::kBF16 || c.dtype == CacheType::kF16 ||
                c.dtype == CacheType::kInt8 || c.dtype == CacheType::kInt4,
            "KvCache: dtype must be float32, bfloat16, float16, int8 or int4; got value {}",
            static_cast<int>(c.dtype));
  check_row_width(c.head_dim_qk, "KvCache: head_dim_qk");
  check_row_width(c.head_dim_v, "KvCache: head_dim_v");
  // The storage's element counts must fit int64 (Tensor checks the allocation itself); one
  // sequence's for batch 0, whose sizes per sequence are computed all the same.
  const int64_t per_slot = checked_add(c.head_dim_qk, c.head_dim_v, "KvCache: head dims");
  checked_mul(checked_mul(std::max<int64_t>(c.batch, 1), c.kv_heads, "KvCache: batch · kv_heads"), per_slot,
              "KvCache: storage per slot");
  const int64_t initial = std::min(c.capacity > 0 ? c.capacity : 16, kept_slots());
  try {
    if (quantized()) {
      k_channels_ = Tensor(DType::kF32, {c.batch, c.kv_heads, c.head_dim_qk});
      std::fill(k_channels_.data<float>(), k_channels_.data<float>() + k_channels_.numel(), 1.0f);
      k_outliers_ = Tensor(DType::kI64, {c.batch, c.kv_heads, kCacheKeyOutliers});
      std::fill(k_outliers_.data<int64_t>(), k_outliers_.data<int64_t>() + k_outliers_.numel(), int64_t{-1});
    }
    reserve(initial);
  } catch (const Error& e) {
    throw Error(fmt::format("KvCache: the storage of batch {}, kv_heads {}, {} slots: {}", c.batch, c.kv_heads,
                            initial, e.what()));
  }
  // After the storage: a batch too large to allocate is the storage's mha::Error, not
  // std::bad_alloc from these vectors (a few bytes per sequence; the storage holds 16 slots or more).
  length_.assign(static_cast<size_t>(c.batch), 0);
  channels_fixed_.assign(static_cast<size_t>(c.batch), 0);
}

namespace {
// n slots rounded up to whole key tiles.
int64_t tiles_of(int64_t n) {
  return checked_add(n, kCacheKeyTile - 1, "KvCache: capacity") / kCacheKeyTile * kCacheKeyTile;
}
}  // namespace

int64_t KvCache::kept_slots() const {
  return config_.window > 0 ? config_.sink_tokens + config_.window : std::numeric_limits<int64_t>::max();
}

int64_t KvCache::slot(int64_t p) const {
  const auto& c = config_;
  MHA_CHECK(p >= 0, "KvCache::slot: position {} is negative", p);
  if (c.window == 0 || p < c.sink_tokens) return p;
  return c.sink_tokens + (p - c.sink_tokens) % c.window;
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
View<const uint32_t> KvCache::key_scales() const {
  check_quantized("key_scales");
  return View<const uint32_t>(scale_words(k_scales_), k_scales_.shape());
}
View<const float> KvCache::key_channel_scales() const {
  check_quantized("key_channel_scales");
  return k_channels_.view<float>();
}
View<const int64_t> KvCache::key_outlier_channels() const {
  check_quantized("key_outlier_channels");
  return k_outliers_.view<int64_t>();
}
View<const uint32_t> KvCache::value_scales() const {
  check_quantized("value_scales");
  return View<const uint32_t>(scale_words(v_scales_), v_scales_.shape());
}

int64_t KvCache::nbytes() const {
  size_t n = k_.nbytes() + v_.nbytes();
  if (quantized()) n += k_scales_.nbytes() + v_scales_.nbytes();
  return static_cast<int64_t>(n);
}

Tensor KvCache::as_float(const Tensor& data, const Tensor& scales, bool keys, int64_t width) const {
  const auto& c = config_;
  if (!quantized()) {
    // Slots past stored(b) may hold positions from before a reset(): zeros, as documented.
    Tensor out = data.converted(DType::kF32);
    for (int64_t r = 0; r < c.batch * c.kv_heads * capacity_; ++r) {
      if (r % capacity_ < stored(r / (c.kv_heads * capacity_))) continue;
      std::fill(out.data<float>() + r * width, out.data<float>() + (r + 1) * width, 0.0f);
    }
    return out;
  }
  Tensor out(DType::kF32, {c.batch, c.kv_heads, capacity_, width});
  const int64_t rows = c.batch * c.kv_heads * capacity_;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / (c.kv_heads * capacity_), slot = r % capacity_;
    float* dst = out.data<float>() + r * width;
    if (slot >= stored(b)) {
      std::fill(dst, dst + width, 0.0f);
      continue;
    }
    const float* ch = keys ? k_channels_.data<float>() + r / capacity_ * width : nullptr;
    const int64_t* outliers = keys ? k_outliers_.data<int64_t>() + r / capacity_ * kCacheKeyOutliers : nullptr;
    if (keys)
      read_key_row(data.data<uint8_t>(), scale_words(scales), r, ch, outliers, width, c.dtype, dst);
    else
      read_value_row(data.data<uint8_t>(), scale_words(scales), r, width, c.dtype, dst);
  }
  return out;
}

std::pair<Tensor, Tensor> KvCache::as_stored(const View<const float>& k, const View<const float>& v,
                                             const std::vector<int64_t>& counts) const {
  KvCacheConfig c = config_;
  c.window = 0;
  c.sink_tokens = 0;
  c.capacity = k.rank == 4 ? std::max<int64_t>(k.shape[2], 1) : 1;
  KvCache tmp(c);
  if (quantized()) {
    tmp.k_channels_ = k_channels_.clone();
    tmp.k_outliers_ = k_outliers_.clone();
    tmp.channels_fixed_ = channels_fixed_;
  }
  tmp.append(k, v, counts);  // checks the shapes
  return {tmp.keys_as_float(), tmp.values_as_float()};
}

Tensor KvCache::keys_as_float() const { return as_float(k_, k_scales_, true, config_.head_dim_qk); }
Tensor KvCache::values_as_float() const { return as_float(v_, v_scales_, false, config_.head_dim_v); }

int64_t KvCache::length(int64_t b) const {
  check_sequence(b, "length");
  return length_[b];
}

int64_t KvCache::stored(int64_t b) const {
  check_sequence(b, "stored");
  return std::min(length_[b], kept_slots());
}

void KvCache::reset() {
  std::fill(length_.begin(), length_.end(), 0);
  std::fill(channels_fixed_.begin(), channels_fixed_.end(), 0);
  if (quantized()) {
    std::fill(k_channels_.data<float>(), k_channels_.data<float>() + k_channels_.numel(), 1.0f);
    std::fill(k_outliers_.data<int64_t>(), k_outliers_.data<int64_t>() + k_outliers_.numel(), int64_t{-1});
  }
}

void KvCache::reserve(int64_t slots) {
  if (slots <= capacity_) return;
  const auto& c = config_;
  // int8/int4 keys are stored by tiles of kCacheKeyTile slots: whole tiles.
  if (quantized()) slots = tiles_of(slots);
  const DType et = element_type(c.dtype);
  // Each plane is (B, Hkv, slots, width); rows [0, stored) keep their slots: a ring only grows
  // before it wraps (capacity < window). Whole key tiles are copied (both capacities are
  // multiples of kCacheKeyTile where there are tiles).
  auto grow = [&](Tensor& plane, DType type, int64_t width) {
    Tensor t(type, {c.batch, c.kv_heads, slots, width});
    const int64_t row = width * static_cast<int64_t>(dtype_size(type));
    if (capacity_ > 0) {
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = 0; h < c.kv_heads; ++h)
          std::memcpy(static_cast<std::byte*>(t.raw()) + (b * c.kv_heads + h) * slots * row,
                      static_cast<const std::byte*>(plane.raw()) + (b * c.kv_heads + h) * capacity_ * row,
                      static_cast<size_t>(std::min(capacity_, tiles_of(stored(b))) * row));
    }
    plane = std::move(t);
  };
  grow(k_, et, row_elements(c.dtype, c.head_dim_qk));
  grow(v_, et, row_elements(c.dtype, c.head_dim_v));
  if (quantized()) {
    grow(k_scales_, kScaleWordType, scale_elements(c.head_dim_qk, true, c.dtype));
    grow(v_scales_, kScaleWordType, scale_elements(c.head_dim_v, false, c.dtype));
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
  need = std::min(need, kept_slots());
  if (need > capacity_) reserve(std::max(need, std::min(2 * capacity_, kept_slots())));

  const int bits = quant_bits(c.dtype);
  const int64_t kw = k_.shape()[3], vw = v_.shape()[3], es = static_cast<int64_t>(dtype_size(k_.dtype()));
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t cnt = counts.empty() ? n : counts[b];
    // A windowed cache only needs the last `window` of the new positions, and its sink positions.
    const int64_t first = c.window > 0 ? std::max<int64_t>(0, cnt - c.window) : 0;
    const int64_t sinks_left = std::max<int64_t>(0, std::min(cnt, c.sink_tokens - length_[b]));
    std::vector<float> inv(bits ? static_cast<size_t>(c.head_dim_qk) : 0);
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      float* ch = bits ? k_channels_.data<float>() + (b * c.kv_heads + h) * c.head_dim_qk : nullptr;
      int64_t* outliers = bits ? k_outliers_.data<int64_t>() + (b * c.kv_heads + h) * kCacheKeyOutliers : nullptr;
      // A sequence's first positions fix its key channel scales and outlier channels.
      if (bits && !channels_fixed_[b] && cnt > 0)
        key_channels(k.data + b * k.stride[0] + h * k.stride[1], k.stride[2], k.stride[3], cnt, c.head_dim_qk, ch,
                     outliers);
      for (size_t e = 0; e < inv.size(); ++e) inv[e] = 1.0f / ch[e];
      for (int64_t t = 0; t < cnt; ++t) {
        if (t < first && t >= sinks_left) continue;  // overwritten later in this append
        const int64_t pos = length_[b] + t;
        const int64_t row = (b * c.kv_heads + h) * capacity_ + slot(pos);
        const float* key = k.data + b * k.stride[0] + h * k.stride[1] + t * k.stride[2];
        if (bits)
          write_key_row(key, k.stride[3], c.head_dim_qk, c.dtype, inv.data(), outliers, k_.data<uint8_t>(),
                        scale_words(k_scales_), row);
        else
          write_row(key, k.stride[3], c.head_dim_qk, c.dtype, static_cast<std::byte*>(k_.raw()) + row * kw * es);
        const float* value = v.data + b * v.stride[0] + h * v.stride[1] + t * v.stride[2];
        if (bits)
          write_value_row(value, v.stride[3], c.head_dim_v, c.dtype, v_.data<uint8_t>(), scale_words(v_scales_), row);
        else
          write_row(value, v.stride[3], c.head_dim_v, c.dtype, static_cast<std::byte*>(v_.raw()) + row * vw * es);
      }
    }
    length_[b] += cnt;
    if (bits && cnt > 0) channels_fixed_[b] = 1;
  }
}

}  // namespace mha
