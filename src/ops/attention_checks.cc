#include "ops/attention_checks.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "util/check.h"
#include "util/parallel.h"

namespace mha::ops {
namespace {

using kernels::Strides4;

template <typename T>
Strides4 strides_of(const View<T>& v) {
  return {v.stride[0], v.stride[1], v.stride[2], v.stride[3]};
}

// [first, last] byte addresses a view touches; empty views touch nothing.
struct Extent {
  const char* lo = nullptr;
  const char* hi = nullptr;
  bool empty = true;
};

// Checks a view's dimensions (non-negative, element count within int64) and returns its element
// count; `name` is used in errors.
template <typename T>
int64_t checked_numel(const View<T>& v, const char* name) {
  int64_t n = 1;
  for (int i = 0; i < v.rank; ++i) {
    MHA_CHECK(v.shape[i] >= 0, "attention: {} has a negative dimension: {}", name, shape_string(v));
    if (__builtin_mul_overflow(n, v.shape[i], &n)) {
      throw Error(fmt::format("attention: {} {} has more elements than int64 can count", name, shape_string(v)));
    }
  }
  return v.given() ? n : 0;
}

template <typename T>
Extent extent_of(const View<T>& v, const char* name) {
  Extent e;
  if (!v.given() || checked_numel(v, name) == 0) return e;
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < v.rank; ++i) {
    int64_t span, bytes;
    bool overflow = __builtin_mul_overflow(v.shape[i] - 1, v.stride[i], &span);
    int64_t& end = span < 0 ? lo : hi;
    overflow = overflow || __builtin_add_overflow(end, span, &end) ||
               __builtin_mul_overflow(end, static_cast<int64_t>(sizeof(T)), &bytes);
    if (overflow) {
      throw Error(fmt::format("attention: {} {} with strides {} spans more bytes than a 64-bit offset holds", name,
                              shape_string(v), shape_string(v.stride.data(), v.rank)));
    }
  }
  e.lo = reinterpret_cast<const char*>(v.data + lo);
  e.hi = reinterpret_cast<const char*>(v.data + hi) + sizeof(T) - 1;
  e.empty = false;
  return e;
}

bool overlaps(const Extent& a, const Extent& b) {
  return !a.empty && !b.empty && a.lo <= b.hi && b.lo <= a.hi;
}

template <typename T>
void check_data(const View<T>& v, const char* name) {
  MHA_CHECK(checked_numel(v, name) == 0 || v.data != nullptr, "attention: {} {} has a null data pointer", name,
            shape_string(v));
}

void check_rank(int rank, int wanted, const int64_t* shape, const char* name, const char* layout) {
  MHA_CHECK(rank == wanted, "attention: {} must be {}-D {}; got {}", name, wanted, layout,
            shape_string(shape, rank));
}

}  // namespace

template <typename T>
Strides4 broadcast_strides(const View<T>& mask, const int64_t (&target)[4], const char* name) {
  MHA_CHECK(mask.rank >= 1 && mask.rank <= 4,
            "attention: {} must have 1 to 4 dimensions to broadcast to {}; got {}", name,
            shape_string(target, 4), shape_string(mask));
  Strides4 s{0, 0, 0, 0};
  const int shift = 4 - mask.rank;
  for (int i = 0; i < mask.rank; ++i) {
    const int64_t want = target[shift + i];
    const int64_t have = mask.shape[i];
    MHA_CHECK(have == want || have == 1,
              "attention: {} of shape {} does not broadcast to (B, Hq, Tq, Tk) = {}: dimension {} is "
              "{}, expected {}",
              name, shape_string(mask), shape_string(target, 4), i, have,
              want == 1 ? std::string("1") : fmt::format("{} or 1", want));
    s[shift + i] = have == 1 ? 0 : mask.stride[i];
  }
  return s;
}

template Strides4 broadcast_strides(const View<const uint8_t>&, const int64_t (&)[4], const char*);
template Strides4 broadcast_strides(const View<const float>&, const int64_t (&)[4], const char*);

template <typename T>
kernels::AttentionParams make_attention_params(const BasicAttentionInputs<T>& in,
                                               const BasicAttentionOutputs<T>& out,
                                               const AttentionOptions& options) {
  const auto& q = in.query;
  const auto& k = in.key;
  const auto& v = in.value;
  check_rank(q.rank, 4, q.shape.data(), "query", "(B, Hq, Tq, Dqk)");
  check_rank(k.rank, 4, k.shape.data(), "key", "(B, Hkv, Tk, Dqk)");
  check_rank(v.rank, 4, v.shape.data(), "value", "(B, Hkv, Tk, Dv)");
  // Formatted only when a check fails (MHA_CHECK evaluates its message lazily): a small call
  // spent ~5% of its time formatting this.
  const auto shapes = [&] {
    return fmt::format("(query {}, key {}, value {})", shape_string(q), shape_string(k), shape_string(v));
  };
  MHA_CHECK(k.shape[0] == q.shape[0] && v.shape[0] == q.shape[0],
            "attention: query, key and value must have the same batch size {}", shapes());
  MHA_CHECK(k.shape[1] == v.shape[1], "attention: key and value must have the same number of heads {}",
            shapes());
  MHA_CHECK(k.shape[2] == v.shape[2], "attention: key and value must have the same length {}", shapes());
  MHA_CHECK(k.shape[3] == q.shape[3], "attention: query and key must have the same head dim {}", shapes());
  MHA_CHECK(q.shape[3] >= 1, "attention: the query/key head dim must be at least 1 {}", shapes());
  MHA_CHECK(k.shape[1] >= 1, "attention: key and value need at least one head {}", shapes());
  MHA_CHECK(q.shape[1] % k.shape[1] == 0,
            "attention: key has {} heads, which does not divide query's {} heads {}", k.shape[1],
            q.shape[1], shapes());
  check_data(q, "query");
  check_data(k, "key");
  check_data(v, "value");

  kernels::AttentionParams p;
  p.dtype = DTypeOf<T>::value;
  p.batch = q.shape[0];
  p.q_heads = q.shape[1];
  p.kv_heads = k.shape[1];
  p.q_len = q.shape[2];
  p.kv_len = k.shape[2];
  p.head_dim_qk = q.shape[3];
  p.head_dim_v = v.shape[3];
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  const int64_t target[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};

  if (in.keep_mask.given()) {
    p.keep_stride = broadcast_strides(in.keep_mask, target, "keep_mask");
    check_data(in.keep_mask, "keep_mask");
    p.keep = in.keep_mask.data;
  }
  if (in.attn_bias.given()) {
    p.attn_bias_stride = broadcast_strides(in.attn_bias, target, "attn_bias");
    check_data(in.attn_bias, "attn_bias");
    p.attn_bias = in.attn_bias.data;
  }
  if (in.key_lengths.given()) {
    const auto& len = in.key_lengths;
    MHA_CHECK(len.rank == 1 && len.shape[0] == p.batch,
              "attention: key_lengths must have shape (B,) = ({},); got {}", p.batch, shape_string(len));
    check_data(len, "key_lengths");
    p.key_lengths = len.data;
    p.key_lengths_stride = len.stride[0];
  }

  if (in.alibi_slopes.given()) {
    const auto& a = in.alibi_slopes;
    const bool per_head = a.rank == 1 && a.shape[0] == p.q_heads;
    const bool per_batch = a.rank == 2 && a.shape[0] == p.batch && a.shape[1] == p.q_heads;
    MHA_CHECK(per_head || per_batch, "attention: alibi_slopes must have shape (Hq,) = ({},) or (B, Hq) = ({}, {}); got {}",
              p.q_heads, p.batch, p.q_heads, shape_string(a));
    check_data(a, "alibi_slopes");
    p.alibi = a.data;
    p.alibi_stride = per_head ? std::array<int64_t, 2>{0, a.stride[0]} : std::array<int64_t, 2>{a.stride[0], a.stride[1]};
    for (int64_t b = 0; b < (per_head ? 1 : p.batch); ++b)
      for (int64_t h = 0; h < p.q_heads; ++h)
        MHA_CHECK(std::isfinite(kernels::alibi_slope(p, b, h)), "attention: alibi_slopes{} = {} is not finite",
                  per_head ? fmt::format("[{}]", h) : fmt::format("[{}, {}]", b, h), kernels::alibi_slope(p, b, h));
  }
  if (in.sinks.given()) {
    const auto& s = in.sinks;
    MHA_CHECK(s.rank == 1 && s.shape[0] == p.q_heads, "attention: sinks must have shape (Hq,) = ({},); got {}", p.q_heads,
              shape_string(s));
    check_data(s, "sinks");
    p.sinks = s.data;
    p.sinks_stride = s.stride[0];
    for (int64_t h = 0; h < p.q_heads; ++h)
      MHA_CHECK(std::isfinite(kernels::sink_logit(p, h)), "attention: sinks[{}] = {} is not finite", h,
                kernels::sink_logit(p, h));
  }
  MHA_CHECK(std::isfinite(options.softcap) && options.softcap >= 0.0f,
            "attention: softcap must be finite and >= 0 (0 turns it off); got {}", options.softcap);
  p.softcap = options.softcap;

  p.scale = options.scale ? *options.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim_qk));
  MHA_CHECK(std::isfinite(p.scale), "attention: scale must be finite; got {}", p.scale);
  MHA_CHECK(options.dropout_p >= 0.0f && options.dropout_p <= 1.0f,
            "attention: dropout_p must be in [0, 1]; got {}", options.dropout_p);
  MHA_CHECK(options.window >= 0, "attention: window must be >= 0; got {}", options.window);
  MHA_CHECK(options.window == 0 || options.causal != Causal::kNone,
            "attention: a sliding window (window = {}) needs causal masking", options.window);
  MHA_CHECK(options.sink_tokens >= 0, "attention: sink_tokens must be >= 0; got {}", options.sink_tokens);
  MHA_CHECK(options.sink_tokens == 0 || options.window > 0,
            "attention: sink_tokens = {} keep the first keys visible past a sliding window; they need window > 0",
            options.sink_tokens);
  check_num_threads(options.num_threads, "attention: ");
  p.causal = options.causal;
  p.window = options.window;
  p.sink_tokens = options.sink_tokens;
  p.dropout_p = options.dropout_p;
  p.dropout_seed = options.dropout_seed;

  // Outputs.
  const auto& o = out.out;
  MHA_CHECK(o.given(), "attention: out is required");
  MHA_CHECK(o.rank == 4 && o.shape[0] == p.batch && o.shape[1] == p.q_heads && o.shape[2] == p.q_len &&
                o.shape[3] == p.head_dim_v,
            "attention: out must have shape (B, Hq, Tq, Dv) = {}; got {}",
            shape_string(std::vector<int64_t>{p.batch, p.q_heads, p.q_len, p.head_dim_v}.data(), 4),
            shape_string(o));
  check_data(o, "out");
  p.out = o.data;
  p.out_stride = strides_of(o);
  if (out.lse.given()) {
    const auto& l = out.lse;
    MHA_CHECK(l.rank == 3 && l.shape[0] == p.batch && l.shape[1] == p.q_heads && l.shape[2] == p.q_len,
              "attention: lse must have shape (B, Hq, Tq) = ({}, {}, {}); got {}", p.batch, p.q_heads,
              p.q_len, shape_string(l));
    check_data(l, "lse");
    p.lse = l.data;
    p.lse_stride = {l.stride[0], l.stride[1], l.stride[2], 0};
  }
  if (out.weights.given()) {
    const auto& w = out.weights;
    const bool per_head = w.rank == 4 && w.shape[0] == p.batch && w.shape[1] == p.q_heads &&
                          w.shape[2] == p.q_len && w.shape[3] == p.kv_len;
    const bool averaged =
        w.rank == 3 && w.shape[0] == p.batch && w.shape[1] == p.q_len && w.shape[2] == p.kv_len;
    MHA_CHECK(per_head || averaged,
              "attention: weights must have shape (B, Hq, Tq, Tk) = ({}, {}, {}, {}) or, averaged over "
              "heads, (B, Tq, Tk) = ({}, {}, {}); got {}",
              p.batch, p.q_heads, p.q_len, p.kv_len, p.batch, p.q_len, p.kv_len, shape_string(w));
    check_data(w, "weights");
    if constexpr (std::is_same_v<T, float>) p.weights = w.data;
    p.weights_averaged = averaged;
    p.weights_stride = averaged ? Strides4{w.stride[0], 0, w.stride[1], w.stride[2]} : strides_of(w);
  }

  // Every count the kernels form fits int64: rows B·Hq·Tq, scores per head row·Tk, elements.
  const int64_t rows =
      checked_mul(checked_mul(p.batch, p.q_heads, "attention: B·Hq"), p.q_len, "attention: B·Hq·Tq (query rows)");
  checked_mul(rows, std::max({p.kv_len, p.head_dim_qk, p.head_dim_v, int64_t{1}}), "attention: query rows · max(Tk, D)");
  // Nothing to compute (no row, or Dv = 0 with neither lse nor weights asked for): the call
  // returns at once, however large the other dimensions (AttentionParams::no_work).
  p.no_work = rows == 0 || (p.head_dim_v == 0 && !p.lse && !out.weights.given());
  if (p.key_lengths && !p.no_work) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t l = p.key_lengths[b * p.key_lengths_stride];
      MHA_CHECK(l >= 0 && l <= p.kv_len, "attention: key_lengths[{}] = {} is outside [0, Tk = {}]", b, l,
                p.kv_len);
    }
  }
  // Dropout draws are indexed by (b, h, i, j/4), each a 32-bit Philox counter word.
  if (p.dropout_p > 0 && !p.no_work) {
    constexpr int64_t kWord = int64_t{1} << 32;
    MHA_CHECK(p.batch < kWord && p.q_heads < kWord && p.q_len < kWord && p.kv_len / 4 < kWord,
              "attention: dropout indexes (batch, head, query, key / 4) with 32 bits each; got (B, Hq, Tq, Tk) = "
              "({}, {}, {}, {})",
              p.batch, p.q_heads, p.q_len, p.kv_len);
  }

  // Outputs may not overlap inputs or each other.
  const Extent inputs[] = {extent_of(q, "query"),
                           extent_of(k, "key"),
                           extent_of(v, "value"),
                           extent_of(in.keep_mask, "keep_mask"),
                           extent_of(in.attn_bias, "attn_bias"),
                           extent_of(in.key_lengths, "key_lengths"),
                           extent_of(in.alibi_slopes, "alibi_slopes"),
                           extent_of(in.sinks, "sinks")};
  const char* input_names[] = {"query", "key", "value", "keep_mask", "attn_bias", "key_lengths", "alibi_slopes", "sinks"};
  constexpr int kInputs = sizeof(input_names) / sizeof(input_names[0]);
  const Extent outputs[] = {extent_of(o, "out"), extent_of(out.lse, "lse"), extent_of(out.weights, "weights")};
  const char* output_names[] = {"out", "lse", "weights"};
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < kInputs; ++b)
      MHA_CHECK(!overlaps(outputs[a], inputs[b]), "attention: output {} overlaps input {}",
                output_names[a], input_names[b]);
    for (int b = a + 1; b < 3; ++b)
      MHA_CHECK(!overlaps(outputs[a], outputs[b]), "attention: outputs {} and {} overlap",
                output_names[a], output_names[b]);
  }
  return p;
}

template kernels::AttentionParams make_attention_params(const BasicAttentionInputs<float>&,
                                                        const BasicAttentionOutputs<float>&, const AttentionOptions&);
template kernels::AttentionParams make_attention_params(const BasicAttentionInputs<bfloat16>&,
                                                        const BasicAttentionOutputs<bfloat16>&,
                                                        const AttentionOptions&);
template kernels::AttentionParams make_attention_params(const BasicAttentionInputs<float16>&,
                                                        const BasicAttentionOutputs<float16>&,
                                                        const AttentionOptions&);

bool views_overlap(const View<const float>& a, const char* a_name, const View<const float>& b, const char* b_name) {
  return overlaps(extent_of(a, a_name), extent_of(b, b_name));
}

}  // namespace mha::ops
