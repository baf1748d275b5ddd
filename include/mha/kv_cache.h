// KvCache: the keys and values of earlier positions, for incremental decoding.
//
// Storage per (sequence, kv head) is a row-major (capacity, head_dim) block (int8/int4 keys: by
// tiles of 16 rows, below), so a decoding step streams each head's keys and values once. The
// capacity grows by doubling (one copy, amortised O(1) per token), never by concatenating per
// step. Each sequence of the batch has its own length (positions seen so far).
//
// With window = W > 0 (sliding-window attention) the cache keeps only the last W positions of
// each sequence in a ring buffer of W slots: position p lives in slot p mod W, and a query at
// position P sees the positions P-W+1 .. P (itself and the W-1 before it). With sink_tokens
// S > 0 as well, positions 0 .. S-1 stay in slots 0 .. S-1 for good, the others ring through
// slots S .. S+W-1 (position p >= S in slot S + (p - S) mod W), and a query sees both.
//
// Storage types (CacheType): float32, bfloat16 and float16 store each value; int8 and int4
// quantize each row (one position of one kv head) in groups of kCacheQuantGroup = 32
// consecutive values with a scale and minimum per group:
//   value = minimum + scale · code,  code in [0, 2^bits − 1], code rounded to nearest.
// int8: float32 scale and minimum, two 32-bit words (their bits; cache_word_float()):
//   minimum = min(group), scale = max(group)/255 − min(group)/255.
// int4: bfloat16 scale and minimum, one 32-bit word (the scale's bits in the low half, the
// minimum's in the high half: cache_group_scale(), cache_group_minimum()):
//   minimum = min(group) rounded down to bfloat16,
//   scale = (max(group) − minimum) / 15 rounded up to bfloat16;
//   values beyond ±2^127 are taken as ±2^127 first (so that no code's value overflows float32).
// Either way every value stays within half a step (scale / 2) of its code's value.
// Rows are padded with zero codes to a multiple of 32 values. int4 packs two codes per byte:
// in each group's 16 bytes, byte i holds value i (low nibble) and value i + 16 (high nibble).
// Keys are divided by per-channel scales first (key = channel_scale · value above): powers of
// two fixed by each sequence's first append (per kv head), one shared by the channels of
// ordinary size and one per larger channel, so that such a channel does not coarsen its group.
// Attention multiplies them into the query instead. Outlier key channels (the few channels of
// real keys that are many times larger: rms above 4× the median channel's in the first append,
// the largest kCacheKeyOutliers of them) are kept exactly instead: each key row's scale words
// end with their kCacheKeyOutliers float32 values' bits (in the order of key_outlier_channels(),
// 0 where a slot is unused); their codes are 0 and take no part in their group's minimum and scale.
// A group holding a NaN or an infinity stores NaN for all 32 values (its scale and minimum are NaN).
// Key tiles: int8/int4 keys are stored by tiles of kCacheKeyTile = 16 consecutive slots (the
// capacity is a multiple of 16), laid out for the decode kernel to read 16 keys in the lanes of
// a vector. A tile's codes (its 16 rows of key_codes()) are words of 64 bytes, lane l (the tile's
// slot l) at bytes 4l .. 4l + 3 of each: word w holds the codes of channels 4w .. 4w + 3 (int8,
// byte k: channel 4w + k) or 8w .. 8w + 7 (int4, byte k: channel 8w + k in the low nibble,
// 8w + 4 + k in the high one). A tile's scale words (its 16 rows of key_scales()) are transposed:
// word e of lane l at index 16e + l of the tile's 16 · (w · groups + 4) words (w = 2 for int8,
// 1 for int4). Values' codes are stored a row per slot, as above; their scale words are
// transposed by tiles of 16 slots the same way (16 · w · groups words a tile), so that the kernel
// reads 16 keys' scales per vector.
// Error bounds: docs/numerics.md ("KV cache storage").
#ifndef MHA_KV_CACHE_H_
#define MHA_KV_CACHE_H_

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "mha/attention.h"
#include "mha/tensor.h"

namespace mha {

// What a KvCache stores keys and values as.
enum class CacheType : uint8_t { kF32, kBF16, kF16, kInt8, kInt4 };
// "float32", "bfloat16", "float16", "int8", "int4".
const char* cache_type_name(CacheType type);
// Values per quantization group of the int8 and int4 caches.
constexpr int64_t kCacheQuantGroup = 32;
// Key positions per tile of an int8/int4 cache, and the bytes of a tile's words (above: key
// tiles).
constexpr int64_t kCacheKeyTile = 16;
constexpr int64_t kCacheKeyTileBytes = 64;
// Outlier key channels an int8/int4 cache keeps exactly, per sequence and kv head.
constexpr int64_t kCacheKeyOutliers = 4;

// 32-bit scale words per group of an int8 (bits = 8: its float32 scale and minimum) or int4
// (bits = 4: one bfloat16 pair) cache.
constexpr int64_t cache_group_words(int bits) { return bits == 8 ? 2 : 1; }
// A float32 word of key_scales() / value_scales() (an int8 group's scale or minimum, an outlier
// channel's value) as its float.
inline float cache_word_float(uint32_t word) {
  float x;
  std::memcpy(&x, &word, sizeof x);
  return x;
}
// An int4 group's scale and minimum from its word of key_scales() / value_scales() (bfloat16
// bits in the low and the high half), exactly.
inline float cache_group_scale(uint32_t word) {
  const uint32_t bits = word << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline float cache_group_minimum(uint32_t word) {
  const uint32_t bits = word & 0xFFFF0000u;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

struct KvCacheConfig {
  int64_t batch = 1;
  int64_t kv_heads = 1;
  int64_t head_dim_qk = 0;  // head dims: 1 .. 2^40
  int64_t head_dim_v = 0;
  int64_t capacity = 0;  // initial slots per sequence (grown by doubling; int8/int4: rounded up to
                         // whole tiles of 16); 0: 16
  int64_t window = 0;    // 0: keep every position; else a ring of the last `window` positions
  int64_t sink_tokens = 0;  // with a window: positions [0, sink_tokens) are kept as well, in slots
                            // of their own before the ring (StreamingLLM's attention sinks)
  // Storage type of keys and values. 16-bit caches hold half the bytes (decoding reads half as
  // much); append() rounds to them (nearest even), and attention over the cache reads them
  // widened to float32 (the query is rounded to the cache's type first). int8 and int4 caches
  // hold 1.25 and 0.625 bytes per value (codes + group scales, see above; keys 16 bytes more
  // per row for the outlier channels); append() quantizes,
  // and attention reads the codes and dequantizes them in registers (float32 queries).
  CacheType dtype = CacheType::kF32;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheConfig& config);

  const KvCacheConfig& config() const { return config_; }
  int64_t capacity() const { return capacity_; }
  // Positions seen by sequence b (may exceed the slots kept when windowed). b outside
  // [0, batch) is an mha::Error, here and in stored().
  int64_t length(int64_t b) const;
  // The slot (third index of keys()/values()) that position p >= 0 is stored in, or will be:
  // p itself, or for a windowed cache p below sink_tokens, else sink_tokens + (p - sink_tokens)
  // mod window. Negative p is an mha::Error.
  int64_t slot(int64_t p) const;
  // Slots of sequence b holding a position (min(length, sink_tokens + window) when windowed).
  int64_t stored(int64_t b) const;
  void reset();

  // Appends count[b] new positions to each sequence b: k (B, Hkv, n, Dk) and v (B, Hkv, n, Dv),
  // any strides, rows [0, count[b]) of sequence b (all n if counts is empty). Grows the storage
  // as needed; windowed caches keep the last `window` positions.
  void append(const View<const float>& k, const View<const float>& v, const std::vector<int64_t>& counts = {});

  // The storage of a float32/bfloat16/float16 cache as (B, Hkv, capacity, D) views: T must be
  // its element type (float for the default), else an mha::Error.
  template <typename T = float>
  View<const T> keys() const {
    check_element_type(DTypeOf<T>::value, "keys");
    return k_.view<T>();
  }
  template <typename T = float>
  View<const T> values() const {
    check_element_type(DTypeOf<T>::value, "values");
    return v_.view<T>();
  }
  // The storage of an int8/int4 cache (an mha::Error for other types): codes (B, Hkv, capacity,
  // row bytes) and scale words (B, Hkv, capacity, w · groups), groups = ⌈D / 32⌉: a group's scale
  // and minimum (int8: w = 2 float32 words, cache_word_float(); int4: w = 1 word of two bfloat16,
  // cache_group_scale(), cache_group_minimum()), followed for keys by the kCacheKeyOutliers
  // outlier channel values' float32 bits (w · groups + 4 words); keys' codes and scales, and
  // values' scales, laid out by tiles of 16 slots (above).
  View<const uint8_t> key_codes() const;
  View<const uint8_t> value_codes() const;
  View<const uint32_t> key_scales() const;
  View<const uint32_t> value_scales() const;
  // (B, Hkv, Dk): the key channel scales (1 until a sequence's first append; 1 for outliers).
  View<const float> key_channel_scales() const;
  // (B, Hkv, kCacheKeyOutliers): the outlier key channels kept exactly, ascending, then -1s (all
  // -1 until a sequence's first append).
  View<const int64_t> key_outlier_channels() const;
  // Keys and values as float32 (B, Hkv, capacity, D) copies, whatever the storage type
  // (dequantized or widened); slots holding no position are zeros.
  Tensor keys_as_float() const;
  Tensor values_as_float() const;
  // k and v (B, Hkv, n, D) as append(k, v, counts) would store them now (rounded, or quantized
  // with this cache's key channel scales), read back as float32 (B, Hkv, ≥ n, D) copies; the
  // cache is unchanged.
  std::pair<Tensor, Tensor> as_stored(const View<const float>& k, const View<const float>& v,
                                      const std::vector<int64_t>& counts = {}) const;
  bool quantized() const { return config_.dtype == CacheType::kInt8 || config_.dtype == CacheType::kInt4; }
  // Bytes of key and value storage (capacity slots, with the group scales).
  int64_t nbytes() const;

 private:
  void reserve(int64_t slots);
  void check_sequence(int64_t b, const char* accessor) const;
  int64_t kept_slots() const;  // the most slots a sequence keeps
  void check_element_type(DType wanted, const char* accessor) const;
  void check_quantized(const char* accessor) const;
  Tensor as_float(const Tensor& data, const Tensor& scales, bool keys, int64_t width) const;

  KvCacheConfig config_;
  int64_t capacity_ = 0;
  // Per (b, h, slot) rows: values (or codes) of keys and values, and for quantized caches their
  // group scales; undefined tensors where unused.
  Tensor k_, v_, k_scales_, v_scales_;
  Tensor k_channels_;  // quantized caches: (B, Hkv, Dk) key channel scales
  Tensor k_outliers_;  // quantized caches: (B, Hkv, kCacheKeyOutliers) outlier key channels (int64)
  std::vector<uint8_t> channels_fixed_;  // per sequence: its key channel scales are set
  std::vector<int64_t> length_;
};

// Attention of float32 queries q (B, Hq, n, Dk), Hq a multiple of the cache's kv heads, over the
// positions `cache` holds, into out (B, Hq, n, Dv): what MultiHeadAttention::step does after
// appending. Query i of sequence b is position length(b) − n + i and sees every kept position
// up to itself (causal, bottom-right aligned); a windowed cache takes n = 1 (its ring then holds
// exactly the query's window). 16-bit caches round the queries to their type; int8/int4 caches
// are read in their stored format (dequantized in registers) for up to 16 query rows per kv
// head, else dequantized to float32 first; for integer dot products (x86: AVX2 or AVX-512
// VNNI) that kernel rounds the queries to 16 bits (int8 keys) or 8 bits (int4 keys) for the key
// scores, and over int4 values it rounds the weights times the values' scales to bytes (AVX2;
// AVX-512 VNNI and VBMI) or the attention weights and values to bfloat16 (AVX-512 BF16 without
// them) for the value pass, over int8 values the weights times the scales to 16-bit words
// (AVX-512 VNNI; the output moves by ~6e-4 norm-wise at most, 15× below int8's own error); over
// bfloat16 values with AMX tiles (CPUs with AMX-BF16, up to 8 query rows per kv head,
// Dv % 32 == 0) or with AVX-512 BF16 dot products (AMD CPUs with AVX-512 BF16, value columns by
// 32) it rounds the attention weights to bfloat16 (docs/numerics.md). options: scale,
// num_threads and backend (causal, window and dropout_p must be unset). Any violated shape is an
// mha::Error.
void attend(const View<const float>& q, const KvCache& cache, const View<float>& out,
            const AttentionOptions& options = {});

}  // namespace mha

#endif  // MHA_KV_CACHE_H_
