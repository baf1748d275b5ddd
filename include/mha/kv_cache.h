// KvCache: the keys and values of earlier positions, for incremental decoding.
//
// Storage per (sequence, kv head) is a row-major (capacity, head_dim) block, so a decoding step
// streams each head's keys and values once. The capacity grows by doubling (one copy, amortised
// O(1) per token), never by concatenating per step. Each sequence of the batch has its own
// length (positions seen so far).
//
// With window = W > 0 (sliding-window attention) the cache keeps only the last W positions of
// each sequence in a ring buffer of W slots: position p lives in slot p mod W, and a query at
// position P sees the positions P-W+1 .. P (itself and the W-1 before it).
#ifndef MHA_KV_CACHE_H_
#define MHA_KV_CACHE_H_

#include <cstdint>
#include <vector>

#include "mha/tensor.h"

namespace mha {

struct KvCacheConfig {
  int64_t batch = 1;
  int64_t kv_heads = 1;
  int64_t head_dim_qk = 0;
  int64_t head_dim_v = 0;
  int64_t capacity = 0;  // initial slots per sequence (grown by doubling); 0: 16
  int64_t window = 0;    // 0: keep every position; else a ring of the last `window` positions
  // Storage type of keys and values: kF32, kBF16 or kF16. 16-bit caches hold half the bytes
  // (decoding reads half as much); append() rounds to them (nearest even), and attention over
  // the cache reads them widened to float32 (the query is rounded to the cache's type first).
  DType dtype = DType::kF32;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheConfig& config);

  const KvCacheConfig& config() const { return config_; }
  int64_t capacity() const { return capacity_; }
  // Positions seen by sequence b (may exceed the slots kept when windowed). b outside
  // [0, batch) is an mha::Error, here and in stored().
  int64_t length(int64_t b) const;
  // Slots of sequence b holding a position (min(length, window) when windowed).
  int64_t stored(int64_t b) const;
  void reset();

  // Appends count[b] new positions to each sequence b: k (B, Hkv, n, Dk) and v (B, Hkv, n, Dv),
  // any strides, rows [0, count[b]) of sequence b (all n if counts is empty). Grows the storage
  // as needed; windowed caches keep the last `window` positions.
  void append(const View<const float>& k, const View<const float>& v, const std::vector<int64_t>& counts = {});

  // The storage as (B, Hkv, capacity, D) views of the cache's dtype: T must be that type (float
  // for the default), else an mha::Error.
  template <typename T = float>
  View<const T> keys() const {
    check_dtype(DTypeOf<T>::value, "keys");
    return k_.view<T>();
  }
  template <typename T = float>
  View<const T> values() const {
    check_dtype(DTypeOf<T>::value, "values");
    return v_.view<T>();
  }
  // Bytes of key and value storage (capacity slots).
  int64_t nbytes() const { return static_cast<int64_t>(k_.nbytes() + v_.nbytes()); }

 private:
  void reserve(int64_t slots);
  void check_sequence(int64_t b, const char* accessor) const;
  void check_dtype(DType wanted, const char* accessor) const;

  KvCacheConfig config_;
  int64_t capacity_ = 0;
  Tensor k_, v_;
  std::vector<int64_t> length_;
};

}  // namespace mha

#endif  // MHA_KV_CACHE_H_
