// MultiHeadAttention decoding: a KvCache per stream, step() for prefill and one token at a time.
#include <algorithm>
#include <type_traits>
#include <utility>

#include "mha/multi_head_attention.h"
#include "modules/multi_head_attention_internal.h"
#include "ops/attention_internal.h"
#include "ops/heads_as.h"
#include "util/check.h"
#include "util/convert.h"

namespace mha {

namespace {

using ops::HeadsAs;
using ops::rounded_heads;

// The cache's keys and values as views of T: its storage, or for an int8/int4 cache (T = float)
// dequantized copies kept in `hold`.
template <typename T>
std::pair<View<const T>, View<const T>> stored_kv(const KvCache& cache, Tensor (&hold)[2]) {
  if constexpr (std::is_same_v<T, float>) {
    if (cache.quantized()) {
      hold[0] = cache.keys_as_float();
      hold[1] = cache.values_as_float();
      return {hold[0].view<float>(), hold[1].view<float>()};
    }
  }
  return {cache.keys<T>(), cache.values<T>()};
}

// New keys and values k, v (B, Hkv, n, D) as `cache` would store them, as T: rounded to the
// cache's 16-bit type, or quantized and dequantized (int8/int4; T = float).
template <typename T>
std::pair<Tensor, Tensor> as_stored(const View<const float>& k, const View<const float>& v,
                                    const std::vector<int64_t>& counts, const KvCache& cache) {
  if (cache.quantized()) return cache.as_stored(k, v, counts);
  return {rounded_heads<T>(k), rounded_heads<T>(v)};
}

// attend() in T (the cache's element type; float for float32, int8 and int4 caches). counts[b]:
// the real queries of sequence b (its newest positions; rows past them are padding), or nullptr
// for all n.
template <typename T>
void attend_stored(const View<const float>& q, const KvCache& cache, const View<float>& out, AttentionOptions opt,
                   const int64_t* counts, const ops::ScoreHeads& score = {}) {
  const int64_t B = q.shape[0], n = q.shape[2];
  const bool windowed = cache.config().window > 0;
  Tensor lengths(DType::kI64, {B});
  std::vector<int64_t> offsets(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    lengths.data<int64_t>()[b] = cache.stored(b);
    offsets[b] = cache.length(b) - (counts ? counts[b] : n);  // query i sits at position offset + i
  }
  // A windowed ring holds exactly the window of its one query: every stored key is visible.
  const int64_t* causal_offset = windowed ? nullptr : offsets.data();
  if constexpr (std::is_same_v<T, float>) {
    if (cache.quantized() && ops::attention_over_quantized_cache(q, cache, out, opt, causal_offset, score)) return;
  }
  Tensor hold[2];
  const auto [ck, cv] = stored_kv<T>(cache, hold);
  const HeadsAs<T> io(q, out);
  BasicAttentionOutputs<T> ao;
  ao.out = io.o;
  const BasicAttentionInputs<T> ai{io.q, ck, cv, {}, {}, lengths.view<int64_t>(), score.alibi_slopes, score.sinks};
  if (windowed) {
    attention(ai, ao, opt);
  } else {
    opt.causal = Causal::kBottomRight;
    ops::attention_with_offsets(ai, ao, opt, causal_offset);
  }
  io.finish();
}

// A windowed chunk (some sequence gets more than one position): its first query needs up to
// window-1 positions before the chunk, which the chunk's own append could overwrite in the ring.
// Gather them, in position order — after the sink positions, if the cache keeps them — followed
// by the chunk's keys (as the cache stores them); attend; then append. Index j of the gathered
// keys is position j up to the sinks, then shifted by the positions between them and the window,
// which moves every query by the same amount: causal limits and windows are the same in indices.
// T as in attend_stored.
template <typename T>
void attend_window_chunk(const View<const float>& q, const View<const float>& kh, const View<const float>& vh,
                         const std::vector<int64_t>& counts, KvCache& cache, const View<float>& out,
                         AttentionOptions opt, const ops::ScoreHeads& score) {
  const KvCacheConfig& c = cache.config();
  const int64_t B = q.shape[0], n = q.shape[2], Hkv = c.kv_heads, dqk = c.head_dim_qk, dv = c.head_dim_v;
  const int64_t S = c.sink_tokens, span = S + c.window - 1 + n;
  Tensor kt(DTypeOf<T>::value, {B, Hkv, span, dqk}), vt(DTypeOf<T>::value, {B, Hkv, span, dv});
  Tensor hold[2];
  const auto [ck, cv] = stored_kv<T>(cache, hold);
  const auto [kn, vn] = as_stored<T>(kh, vh, counts, cache);
  const View<const T> knv = kn.template view<T>(), vnv = vn.template view<T>();
  const View<T> ktv = kt.view<T>(), vtv = vt.view<T>();
  Tensor lengths(DType::kI64, {B});
  std::vector<int64_t> offsets(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L0 = cache.length(b);
    // Positions before the chunk: the sinks [0, min(S, L0)), then the window's [w0, L0).
    std::vector<int64_t> positions;
    for (int64_t p = 0; p < std::min(S, L0); ++p) positions.push_back(p);
    for (int64_t p = std::max(S, L0 - (c.window - 1)); p < L0; ++p) positions.push_back(p);
    const int64_t kept = static_cast<int64_t>(positions.size());
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t t = 0; t < kept; ++t) {
        const int64_t slot = cache.slot(positions[static_cast<size_t>(t)]);
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
  opt.sink_tokens = S;
  const HeadsAs<T> io(q, out);
  BasicAttentionOutputs<T> ao;
  ao.out = io.o;
  const BasicAttentionInputs<T> ai{io.q,         kt.view<T>(), vt.view<T>(), {}, {}, lengths.view<int64_t>(),
                                   score.alibi_slopes, score.sinks};
  ops::attention_with_offsets(ai, ao, opt, offsets.data());
  io.finish();
  cache.append(kh, vh, counts);
}

// Runs f with the element type attention over `cache` runs in.
template <class F>
void with_cache_type(const KvCache& cache, const F& f) {
  switch (cache.config().dtype) {
    case CacheType::kBF16: f(bfloat16{}); break;
    case CacheType::kF16: f(float16{}); break;
    default: f(0.0f); break;
  }
}

}  // namespace

KvCache MultiHeadAttention::make_cache(int64_t batch, int64_t capacity, CacheType dtype) const {
  KvCacheConfig k;
  k.batch = batch;
  k.kv_heads = config_.num_kv_heads;
  k.head_dim_qk = head_dim_qk();
  k.head_dim_v = head_dim_v();
  k.capacity = capacity;
  k.window = config_.window;
  k.sink_tokens = config_.sink_tokens;
  k.dtype = dtype;
  return KvCache(k);
}

void attend(const View<const float>& q, const KvCache& cache, const View<float>& out, const AttentionOptions& options) {
  const KvCacheConfig& c = cache.config();
  MHA_CHECK(q.rank == 4 && q.shape[0] == c.batch && q.shape[1] > 0 && q.shape[1] % c.kv_heads == 0 &&
                q.shape[3] == c.head_dim_qk,
            "attend: query must be (B, Hq, n, Dk) with B = {}, Hq a multiple of kv_heads = {}, Dk = {}; got {}",
            c.batch, c.kv_heads, c.head_dim_qk, shape_string(q));
  MHA_CHECK(out.rank == 4 && out.shape[0] == q.shape[0] && out.shape[1] == q.shape[1] && out.shape[2] == q.shape[2] &&
                out.shape[3] == c.head_dim_v,
            "attend: out must be (B, Hq, n, Dv) = ({}, {}, {}, {}); got {}", q.shape[0], q.shape[1], q.shape[2],
            c.head_dim_v, shape_string(out));
  MHA_CHECK((q.numel() == 0 || q.data) && (out.numel() == 0 || out.data),
            "attend: query {} or out {} has a null data pointer", shape_string(q), shape_string(out));
  MHA_CHECK(options.causal == Causal::kNone && options.window == 0 && options.dropout_p == 0.0f,
            "attend: causal masking and the window come from the cache; options.causal, window and dropout_p must "
            "be unset");
  const int64_t n = q.shape[2];
  MHA_CHECK(c.window == 0 || n <= 1, "attend: a windowed cache takes one query per sequence; got {} (use "
            "MultiHeadAttention::step for chunks)", n);
  for (int64_t b = 0; b < c.batch; ++b)
    MHA_CHECK(cache.length(b) >= n, "attend: sequence {} holds {} positions, fewer than the {} queries", b,
              cache.length(b), n);
  with_cache_type(cache, [&](auto tag) { attend_stored<decltype(tag)>(q, cache, out, options, nullptr); });
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
                kc.head_dim_v == head_dim_v() && kc.window == c.window && kc.sink_tokens == c.sink_tokens,
            "MultiHeadAttention::step: the cache (batch {}, kv heads {}, head dims {}/{}, window {}, sink tokens {}) "
            "does not fit this module and input (batch {}, kv heads {}, head dims {}/{}, window {}, sink tokens {}); "
            "use make_cache()",
            kc.batch, kc.kv_heads, kc.head_dim_qk, kc.head_dim_v, kc.window, kc.sink_tokens, B, c.num_kv_heads,
            head_dim_qk(), head_dim_v(), c.window, c.sink_tokens);
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
  // QK-norm and rotary embeddings: the new rows of sequence b are positions length(b) + t, and
  // the cache stores the rotated keys.
  std::vector<int64_t> first(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) first[b] = cache.length(b);
  transform_qk(heads.q, heads.k, heads.q, heads.k, first, first, options.num_threads);

  const int64_t out_width = output_dim();
  const std::vector<int64_t> out_shape = output_shape(B, n);
  Tensor merged = c.out_proj ? Tensor(DType::kF32, {N, c.v_proj_dim}) : Tensor(DType::kF32, out_shape);
  const View<float> attn_out = modules::heads_view(merged.data<float>(), l, c.v_proj_dim, c.num_heads, dv);
  AttentionOptions opt;
  opt.num_threads = options.num_threads;
  opt.backend = options.backend;
  opt.softcap = c.softcap;
  AttentionInputs score_in;
  score_inputs(score_in);
  const ops::ScoreHeads score{score_in.alibi_slopes, score_in.sinks};

  // The new positions' attention over the cache, appending their keys and values.
  bool single = true;  // one new position per sequence: a windowed ring then holds exactly what it sees
  for (int64_t b = 0; b < B; ++b) single &= counts[b] == 1;
  with_cache_type(cache, [&](auto tag) {
    using E = decltype(tag);
    // ALiBi measures key positions, which a windowed ring holds out of order: gather them.
    if (c.window > 0 && (!single || c.alibi)) {
      attend_window_chunk<E>(heads.q, heads.k, heads.v, counts, cache, attn_out, opt, score);
    } else {
      cache.append(heads.k, heads.v, counts);
      attend_stored<E>(heads.q, cache, attn_out, opt, counts.data(), score);
    }
  });

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
