// MultiHeadAttention decoding: a KvCache per stream, step() for prefill and one token at a time.
#include <algorithm>
#include <type_traits>

#include "mha/multi_head_attention.h"
#include "modules/multi_head_attention_internal.h"
#include "ops/attention_internal.h"
#include "util/check.h"
#include "util/convert.h"

namespace mha {

namespace {

// x (B, H, n, D) with contiguous rows, rounded to T (a contiguous copy; float: copied as is).
template <typename T>
Tensor rounded_heads(const View<float>& x) {
  Tensor t(DTypeOf<T>::value, {x.shape[0], x.shape[1], x.shape[2], x.shape[3]});
  T* dst = t.data<T>();
  for (int64_t b = 0; b < x.shape[0]; ++b)
    for (int64_t h = 0; h < x.shape[1]; ++h)
      for (int64_t i = 0; i < x.shape[2]; ++i) {
        narrow_from_f32(x.data + b * x.stride[0] + h * x.stride[1] + i * x.stride[2], DTypeOf<T>::value, dst,
                        x.shape[3]);
        dst += x.shape[3];
      }
  return t;
}

// The new positions' attention over the cache — appending their keys and values — into `out`
// (float32 heads of the merged rows). T is the cache's element type: a 16-bit cache attends in
// T (the queries rounded to it, as ggml does for its f16 caches) and its result is widened into
// out; float32 attends in place.
template <typename T>
void attend_cache(const MultiHeadAttentionConfig& c, const modules::QkvHeads& heads, const std::vector<int64_t>& counts,
                  KvCache& cache, const View<float>& out, AttentionOptions opt) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const int64_t B = out.shape[0], n = out.shape[2], Hkv = c.num_kv_heads;
  const int64_t dqk = heads.q.shape[3], dv = out.shape[3];
  const View<float>& kh = heads.k;
  const View<float>& vh = heads.v;
  Tensor q16, out16;
  View<const T> q;
  View<T> o;
  if constexpr (kF32) {
    q = heads.q;
    o = out;
  } else {
    q16 = rounded_heads<T>(heads.q);
    q = q16.view<T>();
    out16 = Tensor(DTypeOf<T>::value, {B, out.shape[1], n, dv});
    o = out16.view<T>();
  }
  BasicAttentionOutputs<T> ao;
  ao.out = o;
  Tensor lengths(DType::kI64, {B});
  std::vector<int64_t> offsets(static_cast<size_t>(B));

  const bool windowed = c.window > 0;
  bool single = true;  // one new position per sequence: a windowed ring then holds exactly what it sees
  for (int64_t b = 0; b < B; ++b) single &= counts[b] == 1;
  if (!windowed || single) {
    // Append first, then attend to the cache.
    cache.append(kh, vh, counts);
    for (int64_t b = 0; b < B; ++b) {
      lengths.data<int64_t>()[b] = cache.stored(b);
      offsets[b] = cache.length(b) - counts[b];  // query i sits at position length - count + i
    }
    const BasicAttentionInputs<T> ai{q, cache.keys<T>(), cache.values<T>(), {}, {}, lengths.view<int64_t>()};
    if (windowed) {
      attention(ai, ao, opt);  // the ring holds exactly the window: every stored key is visible
    } else {
      opt.causal = Causal::kBottomRight;
      ops::attention_with_offsets(ai, ao, opt, offsets.data());
    }
  } else {
    // A windowed chunk: its first query needs up to window-1 positions before the chunk, which
    // the chunk's own append could overwrite in the ring. Gather them, in position order,
    // followed by the chunk's keys (rounded to the cache's type, as appending stores them);
    // attend; then append.
    const int64_t before = c.window - 1, span = before + n;
    Tensor kt(DTypeOf<T>::value, {B, Hkv, span, dqk}), vt(DTypeOf<T>::value, {B, Hkv, span, dv});
    const View<const T> ck = cache.keys<T>(), cv = cache.values<T>();
    const Tensor kn = rounded_heads<T>(kh), vn = rounded_heads<T>(vh);
    const View<const T> knv = kn.view<T>(), vnv = vn.view<T>();
    const View<T> ktv = kt.view<T>(), vtv = vt.view<T>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L0 = cache.length(b), kept = std::min(L0, before);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t t = 0; t < kept; ++t) {
          const int64_t slot = (L0 - kept + t) % c.window;
          for (int64_t e = 0; e < dqk; ++e) ktv.at(b, h, t, e) = ck.at(b, h, slot, e);
          for (int64_t e = 0; e < dv; ++e) vtv.at(b, h, t, e) = cv.at(b, h, slot, e);
        }
        for (int64_t t = 0; t < counts[b]; ++t) {
          for (int64_t e = 0; e < dqk; ++e) ktv.at(b, h, kept + t, e) = knv.at(b, h, t, e);
          for (int64_t e = 0; e < dv; ++e) vtv.at(b, h, kept + t, e) = vnv.at(b, h, t, e);
        }
      }
      lengths.data<int64_t>()[b] = kept + counts[b];
      offsets[b] = kept;
    }
    opt.causal = Causal::kBottomRight;
    opt.window = c.window;
    const BasicAttentionInputs<T> ai{q, kt.view<T>(), vt.view<T>(), {}, {}, lengths.view<int64_t>()};
    ops::attention_with_offsets(ai, ao, opt, offsets.data());
    cache.append(kh, vh, counts);
  }
  if constexpr (!kF32) {  // widen the result into the float32 merged rows
    const T* src = out16.data<T>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < out.shape[1]; ++h)
        for (int64_t i = 0; i < n; ++i) {
          widen_to_f32(src, DTypeOf<T>::value, out.data + b * out.stride[0] + h * out.stride[1] + i * out.stride[2], dv);
          src += dv;
        }
  }
}

}  // namespace

KvCache MultiHeadAttention::make_cache(int64_t batch, int64_t capacity, DType dtype) const {
  KvCacheConfig k;
  k.batch = batch;
  k.kv_heads = config_.num_kv_heads;
  k.head_dim_qk = head_dim_qk();
  k.head_dim_v = head_dim_v();
  k.capacity = capacity;
  k.window = config_.window;
  k.dtype = dtype;
  return KvCache(k);
}

MhaOutputs MultiHeadAttention::step(const View<const float>& x, KvCache& cache, const std::vector<int64_t>& new_tokens,
                                    const MhaCallOptions& options) const {
  return step_impl(x, cache, new_tokens, options);
}
MhaOutputs MultiHeadAttention::step(const View<const bfloat16>& x, KvCache& cache,
                                    const std::vector<int64_t>& new_tokens, const MhaCallOptions& options) const {
  return step_impl(x, cache, new_tokens, options);
}
MhaOutputs MultiHeadAttention::step(const View<const float16>& x, KvCache& cache, const std::vector<int64_t>& new_tokens,
                                    const MhaCallOptions& options) const {
  return step_impl(x, cache, new_tokens, options);
}

// T: x's element type, the module's dtype. Projections are float32; attention runs in the
// cache's dtype (attend_cache); the output is rounded once to T.
template <typename T>
MhaOutputs MultiHeadAttention::step_impl(const View<const T>& x, KvCache& cache, const std::vector<int64_t>& new_tokens,
                                         const MhaCallOptions& options) const {
  check_dtype(DTypeOf<T>::value, "step");
  const auto& c = config_;
  const Dims d = dims();
  const bool batch_first = c.batch_first;
  MHA_CHECK(x.rank == 3 && x.shape[2] == c.embed_dim, "MultiHeadAttention::step: x must be {} with E = {}; got {}",
            batch_first ? "(B, n, E)" : "(n, B, E)", c.embed_dim, shape_string(x));
  MHA_CHECK(packed(), "MultiHeadAttention::step: decoding is self-attention; this module has kdim {} / vdim {} != {}",
            c.kdim, c.vdim, c.embed_dim);
  const int64_t B = x.shape[batch_first ? 0 : 1], n = x.shape[batch_first ? 1 : 0];
  const KvCacheConfig& kc = cache.config();
  MHA_CHECK(kc.batch == B && kc.kv_heads == c.num_kv_heads && kc.head_dim_qk == head_dim_qk() &&
                kc.head_dim_v == head_dim_v() && kc.window == c.window,
            "MultiHeadAttention::step: the cache (batch {}, kv heads {}, head dims {}/{}, window {}) does not fit this "
            "module and input (batch {}, kv heads {}, head dims {}/{}, window {}); use make_cache()",
            kc.batch, kc.kv_heads, kc.head_dim_qk, kc.head_dim_v, kc.window, B, c.num_kv_heads, head_dim_qk(),
            head_dim_v(), c.window);
  std::vector<int64_t> counts = new_tokens.empty() ? std::vector<int64_t>(static_cast<size_t>(B), n) : new_tokens;
  MHA_CHECK(static_cast<int64_t>(counts.size()) == B, "MultiHeadAttention::step: {} new_tokens for a batch of {}",
            counts.size(), B);
  for (int64_t b = 0; b < B; ++b) {
    MHA_CHECK(counts[b] >= 0 && counts[b] <= n, "MultiHeadAttention::step: new_tokens[{}] = {} outside [0, {}]", b,
              counts[b], n);
    if (c.max_seq_len > 0) {
      MHA_CHECK(cache.length(b) + counts[b] <= c.max_seq_len,
                "MultiHeadAttention::step: sequence {} would reach {} positions, beyond max_seq_len (block_size) = {}",
                b, cache.length(b) + counts[b], c.max_seq_len);
    }
  }

  // One GEMM for the new positions' q, k and v.
  const int64_t N = checked_mul(B, n, "MultiHeadAttention::step: rows B·n");
  const int64_t dv = head_dim_v();
  const modules::InputRows xr = modules::input_rows(x);
  Tensor qkv(DType::kF32, {N, d.rows[0] + d.rows[1] + d.rows[2]});
  project_qkv(xr.data, N, qkv.data<float>(), options);
  const modules::Layout l{B, n, batch_first};
  const modules::QkvHeads heads = modules::qkv_heads(c, qkv.data<float>(), nullptr, nullptr, l, l);

  const int64_t out_width = output_dim();
  const std::vector<int64_t> out_shape = output_shape(B, n);
  Tensor merged = c.out_proj ? Tensor(DType::kF32, {N, c.v_proj_dim}) : Tensor(DType::kF32, out_shape);
  const View<float> attn_out = modules::heads_view(merged.data<float>(), l, c.v_proj_dim, c.num_heads, dv);
  AttentionOptions opt;
  opt.num_threads = options.num_threads;
  opt.backend = options.backend;

  switch (cache.config().dtype) {
    case DType::kBF16: attend_cache<bfloat16>(c, heads, counts, cache, attn_out, opt); break;
    case DType::kF16: attend_cache<float16>(c, heads, counts, cache, attn_out, opt); break;
    default: attend_cache<float>(c, heads, counts, cache, attn_out, opt); break;
  }

  // Rows past new_tokens[b] are padding: zeros.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = counts[b]; t < n; ++t) {
      float* row = merged.data<float>() + (b * l.batch_rows() + t * l.time_rows()) * c.v_proj_dim;
      std::fill(row, row + c.v_proj_dim, 0.0f);
    }
  MhaOutputs result;
  if (c.out_proj) {
    result.output = Tensor(DType::kF32, out_shape);
    const Tensor merged16 = c.dtype == DType::kBF16 ? merged.converted(DType::kBF16) : Tensor();
    project(kOut, merged16.defined() ? merged16.raw() : merged.raw(), N, result.output.data<float>(), out_width,
            options);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = counts[b]; t < n; ++t) {
        float* row = result.output.data<float>() + (b * l.batch_rows() + t * l.time_rows()) * out_width;
        std::fill(row, row + out_width, 0.0f);
      }
  } else {
    result.output = std::move(merged);
  }
  if (c.dtype != DType::kF32) result.output = result.output.converted(c.dtype);
  return result;
}

template MhaOutputs MultiHeadAttention::step_impl(const View<const float>&, KvCache&, const std::vector<int64_t>&,
                                                  const MhaCallOptions&) const;
template MhaOutputs MultiHeadAttention::step_impl(const View<const bfloat16>&, KvCache&, const std::vector<int64_t>&,
                                                  const MhaCallOptions&) const;
template MhaOutputs MultiHeadAttention::step_impl(const View<const float16>&, KvCache&, const std::vector<int64_t>&,
                                                  const MhaCallOptions&) const;

}  // namespace mha
