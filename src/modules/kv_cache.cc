#include "mha/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "util/check.h"

namespace mha {

KvCache::KvCache(const KvCacheConfig& config) : config_(config) {
  const auto& c = config_;
  MHA_CHECK(c.batch >= 0 && c.kv_heads > 0 && c.head_dim_qk > 0 && c.head_dim_v > 0 && c.capacity >= 0 && c.window >= 0,
            "KvCache: batch {}, kv_heads {}, head dims ({}, {}), capacity {}, window {}: all must be positive "
            "(batch, capacity and window may be 0)",
            c.batch, c.kv_heads, c.head_dim_qk, c.head_dim_v, c.capacity, c.window);
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
  Tensor k(DType::kF32, {c.batch, c.kv_heads, slots, c.head_dim_qk});
  Tensor v(DType::kF32, {c.batch, c.kv_heads, slots, c.head_dim_v});
  if (capacity_ > 0) {
    // Rows [0, stored) keep their slots: a ring only grows before it wraps (capacity < window).
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.kv_heads; ++h) {
        const int64_t rows = stored(b);
        std::memcpy(k.data<float>() + (b * c.kv_heads + h) * slots * c.head_dim_qk,
                    k_.data<float>() + (b * c.kv_heads + h) * capacity_ * c.head_dim_qk,
                    static_cast<size_t>(rows * c.head_dim_qk) * sizeof(float));
        std::memcpy(v.data<float>() + (b * c.kv_heads + h) * slots * c.head_dim_v,
                    v_.data<float>() + (b * c.kv_heads + h) * capacity_ * c.head_dim_v,
                    static_cast<size_t>(rows * c.head_dim_v) * sizeof(float));
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
      float* kd = k_.data<float>() + (b * c.kv_heads + h) * capacity_ * c.head_dim_qk;
      float* vd = v_.data<float>() + (b * c.kv_heads + h) * capacity_ * c.head_dim_v;
      for (int64_t t = first; t < cnt; ++t) {
        const int64_t pos = length_[b] + t;
        const int64_t slot = c.window > 0 ? pos % c.window : pos;
        for (int64_t d = 0; d < c.head_dim_qk; ++d) kd[slot * c.head_dim_qk + d] = k.at(b, h, t, d);
        for (int64_t d = 0; d < c.head_dim_v; ++d) vd[slot * c.head_dim_v + d] = v.at(b, h, t, d);
      }
    }
    length_[b] += cnt;
  }
}

View<const float> KvCache::keys() const { return k_.view<float>(); }
View<const float> KvCache::values() const { return v_.view<float>(); }

}  // namespace mha
