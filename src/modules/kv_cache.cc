#include "mha/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "util/check.h"
#include "util/convert.h"
#include "util/fp16.h"

namespace mha {
namespace {

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

}  // namespace

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  const auto& c = config_;
  MHA_CHECK(c.batch >= 0 && c.kv_heads > 0 && c.head_dim_qk > 0 && c.head_dim_v > 0 && c.capacity >= 0 && c.window >= 0,
            "KvCache: batch {}, kv_heads {}, head dims ({}, {}), capacity {}, window {}: all must be positive "
            "(batch, capacity and window may be 0)",
            c.batch, c.kv_heads, c.head_dim_qk, c.head_dim_v, c.capacity, c.window);
  MHA_CHECK(c.dtype == DType::kF32 || c.dtype == DType::kBF16 || c.dtype == DType::kF16,
            "KvCache: dtype must be F32, BF16 or F16; got {}", dtype_name(c.dtype));
  // The storage's element counts must fit int64 (Tensor checks the allocation itself).
  const int64_t per_slot = checked_add(c.head_dim_qk, c.head_dim_v, "KvCache: head dims");
  checked_mul(checked_mul(c.batch, c.kv_heads, "KvCache: batch · kv_heads"), per_slot, "KvCache: storage per slot");
  length_.assign(static_cast<size_t>(c.batch), 0);
  const int64_t initial = c.capacity > 0 ? c.capacity : 16;
  reserve(c.window > 0 ? std::min(initial, c.window) : initial);
}

void KvCache::check_sequence(int64_t b, const char* accessor) const {
  MHA_CHECK(b >= 0 && b < config_.batch, "KvCache::{}: sequence {} is outside [0, batch = {})", accessor, b,
            config_.batch);
}

void KvCache::check_dtype(DType wanted, const char* accessor) const {
  MHA_CHECK(wanted == config_.dtype, "KvCache::{}: the cache stores {}; asked for {}", accessor,
            dtype_name(config_.dtype), dtype_name(wanted));
}

int64_t KvCache::length(int64_t b) const {
  check_sequence(b, "length");
  return length_[b];
}

int64_t KvCache::stored(int64_t b) const {
  check_sequence(b, "stored");
  return config_.window > 0 ? std::min(length_[b], config_.window) : length_[b];
}

void KvCache::reset() { std::fill(length_.begin(), length_.end(), 0); }

void KvCache::reserve(int64_t slots) {
  if (slots <= capacity_) return;
  const auto& c = config_;
  Tensor k(c.dtype, {c.batch, c.kv_heads, slots, c.head_dim_qk});
  Tensor v(c.dtype, {c.batch, c.kv_heads, slots, c.head_dim_v});
  const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
  if (capacity_ > 0) {
    // Rows [0, stored) keep their slots: a ring only grows before it wraps (capacity < window).
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.kv_heads; ++h) {
        const int64_t rows = stored(b);
        std::memcpy(static_cast<std::byte*>(k.raw()) + (b * c.kv_heads + h) * slots * c.head_dim_qk * es,
                    static_cast<const std::byte*>(k_.raw()) + (b * c.kv_heads + h) * capacity_ * c.head_dim_qk * es,
                    static_cast<size_t>(rows * c.head_dim_qk * es));
        std::memcpy(static_cast<std::byte*>(v.raw()) + (b * c.kv_heads + h) * slots * c.head_dim_v * es,
                    static_cast<const std::byte*>(v_.raw()) + (b * c.kv_heads + h) * capacity_ * c.head_dim_v * es,
                    static_cast<size_t>(rows * c.head_dim_v * es));
      }
  }
  k_ = std::move(k);
  v_ = std::move(v);
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

  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t cnt = counts.empty() ? n : counts[b];
    // A windowed cache only needs the last `window` of the new positions.
    const int64_t first = c.window > 0 ? std::max<int64_t>(0, cnt - c.window) : 0;
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      const int64_t kh = (b * c.kv_heads + h) * capacity_ * c.head_dim_qk;
      const int64_t vh = (b * c.kv_heads + h) * capacity_ * c.head_dim_v;
      for (int64_t t = first; t < cnt; ++t) {
        const int64_t pos = length_[b] + t;
        const int64_t slot = c.window > 0 ? pos % c.window : pos;
        store_row(k, b, h, t, k_.raw(), kh + slot * c.head_dim_qk, c.head_dim_qk, c.dtype);
        store_row(v, b, h, t, v_.raw(), vh + slot * c.head_dim_v, c.head_dim_v, c.dtype);
      }
    }
    length_[b] += cnt;
  }
}


}  // namespace mha
