// The one parameter struct every attention kernel takes: raw pointers and element strides,
// with masks already resolved to 4-D broadcast strides (0 where a mask dimension is 1).
// The op layer (src/ops/attention.cc) fills it after checking every argument, so kernels
// trust it and never throw.
#ifndef MHA_KERNELS_ATTENTION_PARAMS_H_
#define MHA_KERNELS_ATTENTION_PARAMS_H_

#include <algorithm>
#include <array>
#include <cstdint>

#include "mha/attention.h"

namespace mha::kernels {

using Strides4 = std::array<int64_t, 4>;  // (batch, head, row, column) in elements

struct AttentionParams {
  int64_t batch = 0, q_heads = 0, kv_heads = 0;
  int64_t q_len = 0, kv_len = 0;
  int64_t head_dim_qk = 0, head_dim_v = 0;

  // The element type of q, k, v and out: kF32, kBF16 or kF16 (then the pointers hold
  // mha::bfloat16 / mha::float16 elements); kernels cast them to the type they were written for.
  DType dtype = DType::kF32;
  const void* q = nullptr;  Strides4 q_stride{};   // (B, Hq, Tq, Dqk)
  const void* k = nullptr;  Strides4 k_stride{};   // (B, Hkv, Tk, Dqk)
  const void* v = nullptr;  Strides4 v_stride{};   // (B, Hkv, Tk, Dv)

  // Internal (int8/int4 KV caches, decode kernel only): with kv_bits = 8 or 4, k and v hold the
  // cache's codes (uint8_t; k_stride/v_stride count bytes, a row padded to whole groups) and
  // k_scales/v_scales its scale words: a group of kCacheQuantGroup values' scale and minimum
  // (int8: two float32 words, int4: one word of two bfloat16; strides in words over (batch,
  // head, row)); q and out stay of `dtype`. See kv_cache.h.
  int kv_bits = 0;
  const uint32_t* k_scales = nullptr;  Strides4 k_scale_stride{};
  const uint32_t* v_scales = nullptr;  Strides4 v_scale_stride{};
  // Key channel scales (B, Hkv, Dqk), strides (batch, head, channel): the stored keys are
  // divided by them, so the query is multiplied by them.
  const float* k_channel_scales = nullptr;  Strides4 k_channel_stride{};
  // Outlier key channels (B, Hkv, kCacheKeyOutliers), strides (batch, head): ascending channel
  // indices, then -1s; their exact float32 values end each key's scale words (after the groups'
  // words); their codes are to be ignored (the query's entries there are zeroed).
  const int64_t* k_outliers = nullptr;  Strides4 k_outlier_stride{};
  // Internal (paged KV caches, decode kernel only): if block_tables is set, key and value j of
  // batch b are row j & (2^page_shift − 1) of pool page block_tables[b][j >> page_shift] (each
  // sequence's own table, read in place: no batch × longest-table copy); k_stride[0], v_stride[0]
  // and the scale strides' [0] step between pages, [1] between kv heads.
  const int64_t* const* block_tables = nullptr;
  int page_shift = 0;
  const uint8_t* keep = nullptr;  Strides4 keep_stride{};  // nonzero = attend
  const float* attn_bias = nullptr;  Strides4 attn_bias_stride{};
  const int64_t* key_lengths = nullptr;  int64_t key_lengths_stride = 0;

  float scale = 1.0f;
  float softcap = 0.0f;  // > 0: s = softcap·tanh(s / softcap) before bias and masks
  // ALiBi slopes, element (b, h) at b·alibi_stride[0] + h·alibi_stride[1] (batch stride 0 for
  // (Hq,) slopes); sinks (Hq,) with stride sinks_stride.
  const float* alibi = nullptr;  std::array<int64_t, 2> alibi_stride{};
  const float* sinks = nullptr;  int64_t sinks_stride = 0;
  Causal causal = Causal::kNone;
  // Internal (KV caches): if set, query i of batch b sits at key position i + causal_offset[b],
  // overriding the alignment (top-left: 0, bottom-right: L_b - Tq). Needs causal != kNone.
  const int64_t* causal_offset = nullptr;
  int64_t window = 0;
  int64_t sink_tokens = 0;  // with a window: keys below it stay visible (StreamingLLM)
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0;

  void* out = nullptr;       Strides4 out_stride{};     // (B, Hq, Tq, Dv)
  float* lse = nullptr;      Strides4 lse_stride{};     // (B, Hq, Tq), last entry unused
  // (B, Hq, Tq, Tk); head stride 0 if averaged. Always float32: for 16-bit calls the op layer
  // passes a float32 buffer and rounds it into the caller's weights afterwards.
  float* weights = nullptr;  Strides4 weights_stride{};
  bool weights_averaged = false;
  // Set by the checks: no output element to write (no query row, or Dv = 0 without lse and
  // weights). The op returns before any kernel runs.
  bool no_work = false;

  int64_t group() const { return q_heads / kv_heads; }
  int64_t key_length(int64_t b) const {
    return key_lengths ? key_lengths[b * key_lengths_stride] : kv_len;
  }
};

// One element of a q/k/v/out/weights array of element type t, as float (reference kernels and
// rare paths; the fast kernels convert whole vectors).
inline float load_element(const void* base, int64_t index, DType t) {
  switch (t) {
    case DType::kBF16: return to_float(static_cast<const bfloat16*>(base)[index]);
    case DType::kF16: return to_float(static_cast<const float16*>(base)[index]);
    default: return static_cast<const float*>(base)[index];
  }
}
inline void store_element(void* base, int64_t index, float x, DType t) {
  switch (t) {
    case DType::kBF16: static_cast<bfloat16*>(base)[index] = to_bfloat16(x); break;
    case DType::kF16: static_cast<float16*>(base)[index] = to_float16(x); break;
    default: static_cast<float*>(base)[index] = x; break;
  }
}

// Query i's key position: the key it is aligned with (see mha/attention.h). The causal limit
// and ALiBi distances are measured from it.
inline int64_t query_position(const AttentionParams& p, int64_t b, int64_t i) {
  if (p.causal_offset) return i + p.causal_offset[b];
  return p.causal == Causal::kTopLeft ? i : i + p.key_length(b) - p.q_len;
}

inline float alibi_slope(const AttentionParams& p, int64_t b, int64_t h) {
  return p.alibi ? p.alibi[b * p.alibi_stride[0] + h * p.alibi_stride[1]] : 0.0f;
}
inline float sink_logit(const AttentionParams& p, int64_t h) { return p.sinks[h * p.sinks_stride]; }

// The keys that causal alignment, the window, sink tokens and key_lengths leave visible to query
// row i of batch b (keep_mask and bias still apply inside): [lo, hi) and, when sink tokens are
// cut off from the window by a gap, also [0, sink_hi) (sink_hi < lo; else sink_hi = 0). Empty
// ranges are {0, 0, 0}.
struct KeyRange {
  int64_t lo, hi;
  int64_t sink_hi = 0;
  bool visible(int64_t j) const { return (j >= lo && j < hi) || j < sink_hi; }
  // Whether every key of [a, b) (a < b, a >= 0) is visible. The two spans never touch
  // (visible_keys), so one of them must hold all of [a, b).
  bool covers(int64_t a, int64_t b) const { return (lo <= a && hi >= b) || sink_hi >= b; }
  int64_t first() const { return sink_hi > 0 ? 0 : lo; }  // the span [first(), hi) holds them all
};

inline KeyRange visible_keys(const AttentionParams& p, int64_t b, int64_t i) {
  const int64_t len = p.key_length(b);
  int64_t lo = 0, hi = len;
  if (p.causal != Causal::kNone) {
    const int64_t last = query_position(p, b, i);
    hi = std::min(hi, last + 1);
    if (p.window > 0) lo = std::max<int64_t>(0, last - p.window + 1);
  }
  // Sink tokens (with a window): keys below sink_tokens stay visible up to the causal limit.
  const int64_t sink_hi = p.window > 0 ? std::min(p.sink_tokens, hi) : 0;
  if (sink_hi <= 0) return hi > lo ? KeyRange{lo, hi} : KeyRange{0, 0};  // empty ranges are canonical
  if (hi <= lo) return KeyRange{0, sink_hi};   // the window is past the keys: the sinks alone
  if (sink_hi >= lo) return KeyRange{0, hi};   // the sinks touch the window: one range
  return KeyRange{lo, hi, sink_hi};
}

}  // namespace mha::kernels

#endif  // MHA_KERNELS_ATTENTION_PARAMS_H_
