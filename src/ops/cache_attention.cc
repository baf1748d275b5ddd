// Attention over KV cache storage read in place by the decode kernel: an int8/int4 KvCache's
// codes, and a PagedKvCache's pool through block tables (every storage type). The caches have
// checked their own consistency; these build the kernel's parameters.
#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/attention_params.h"
#include "kernels/cpu/flash.h"
#include "mha/paged_kv_cache.h"
#include "modules/kv_storage.h"
#include "ops/attention_internal.h"
#include "ops/heads_as.h"
#include "util/check.h"
#include "util/convert.h"

namespace mha::ops {
namespace {

kernels::Strides4 strides_of(const std::array<int64_t, kMaxRank>& s) { return {s[0], s[1], s[2], s[3]}; }

// The parameters every cache decode shares: queries and output (B, Hq, n, D) of element type
// `dtype`, kv heads and head dims, scale, bottom-right causal offsets (or none), window.
template <typename T>
kernels::AttentionParams decode_params(const View<const T>& q, const View<T>& out, int64_t kv_heads, int64_t dk,
                                       int64_t dv, const AttentionOptions& options, const int64_t* causal_offset,
                                       int64_t window, const ScoreHeads& score) {
  kernels::AttentionParams p;
  p.batch = q.shape[0];
  p.q_heads = q.shape[1];
  p.kv_heads = kv_heads;
  p.q_len = q.shape[2];
  p.head_dim_qk = dk;
  p.head_dim_v = dv;
  p.dtype = DTypeOf<T>::value;
  p.q = q.data;
  p.q_stride = strides_of(q.stride);
  p.out = out.data;
  p.out_stride = strides_of(out.stride);
  p.scale = options.scale ? *options.scale : 1.0f / std::sqrt(static_cast<float>(dk));
  MHA_CHECK(std::isfinite(p.scale), "attention: scale must be finite; got {}", p.scale);
  p.causal = causal_offset ? Causal::kBottomRight : Causal::kNone;
  p.causal_offset = causal_offset;
  p.window = causal_offset ? window : 0;
  MHA_CHECK(std::isfinite(options.softcap) && options.softcap >= 0.0f,
            "attention: softcap must be finite and >= 0 (0 turns it off); got {}", options.softcap);
  p.softcap = options.softcap;
  if (score.alibi_slopes.given()) p.alibi = score.alibi_slopes.data, p.alibi_stride = {0, score.alibi_slopes.stride[0]};
  if (score.sinks.given()) p.sinks = score.sinks.data, p.sinks_stride = score.sinks.stride[0];
  return p;
}

// The decode over a paged pool in element type T (float for float32, int8 and int4 pools).
template <typename T>
void paged_decode(const View<const T>& q, const PagedKvCache& cache, const std::vector<int64_t>& ids,
                  const View<T>& out, const AttentionOptions& options, const ScoreHeads& score) {
  const PagedKvCacheConfig& c = cache.config();
  const int64_t S = q.shape[0], n = q.shape[2], P = c.page_size;
  std::vector<int64_t> lengths(static_cast<size_t>(S)), offsets(static_cast<size_t>(S));
  // Each sequence's block table, read in place (a copy of S × the longest table once took
  // 52 GB for 100,000 ids of one long sequence: std::bad_alloc).
  std::vector<const int64_t*> tables(static_cast<size_t>(S));
  static constexpr int64_t kNoPages[1] = {0};  // the table of a sequence without pages (none is read)
  const bool quantized = kv_storage::quant_bits(c.dtype) != 0;
  std::vector<float> channels(quantized ? static_cast<size_t>(S * c.kv_heads * c.head_dim_qk) : 0);
  std::vector<int64_t> outliers(quantized ? static_cast<size_t>(S * c.kv_heads * kCacheKeyOutliers) : 0);
  int64_t kv_len = n;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t first = cache.first_position(ids[s]);  // kernel key j is position first + j
    lengths[s] = cache.length(ids[s]) - first;
    offsets[s] = lengths[s] - n;
    kv_len = std::max(kv_len, lengths[s]);
    const std::vector<int64_t>& t = cache.block_table(ids[s]);
    tables[s] = t.empty() ? kNoPages : t.data();
    if (quantized) {
      const std::vector<float>& ch = cache.key_channel_scales(ids[s]);
      std::copy(ch.begin(), ch.end(), channels.begin() + s * c.kv_heads * c.head_dim_qk);
      const std::vector<int64_t>& out_ch = cache.key_outlier_channels(ids[s]);
      std::copy(out_ch.begin(), out_ch.end(), outliers.begin() + s * c.kv_heads * kCacheKeyOutliers);
    }
  }
  kernels::AttentionParams p =
      decode_params(q, out, c.kv_heads, c.head_dim_qk, c.head_dim_v, options, offsets.data(), c.window, score);
  p.kv_len = kv_len;
  p.key_lengths = lengths.data();
  p.key_lengths_stride = 1;
  p.block_tables = tables.data();
  p.page_shift = static_cast<int>(std::lround(std::log2(static_cast<double>(P))));
  const Tensor& kp = cache.key_pool();
  const Tensor& vp = cache.value_pool();
  p.k = kp.raw();
  p.v = vp.raw();
  // Head-major pools (Hkv, pages, page_size, width), as PagedKvCache::pool_row: stride[0] steps
  // a page, stride[1] a head.
  const int64_t pages = cache.pages();
  p.k_stride = {P * kp.shape()[3], pages * P * kp.shape()[3], kp.shape()[3], 1};
  p.v_stride = {P * vp.shape()[3], pages * P * vp.shape()[3], vp.shape()[3], 1};
  if (quantized) {
    const Tensor& ks = cache.key_scale_pool();
    const Tensor& vs = cache.value_scale_pool();
    p.kv_bits = kv_storage::quant_bits(c.dtype);
    p.k_scales = kv_storage::scale_words(ks);
    p.v_scales = kv_storage::scale_words(vs);
    p.k_scale_stride = {P * ks.shape()[3], pages * P * ks.shape()[3], ks.shape()[3], 1};
    p.v_scale_stride = {P * vs.shape()[3], pages * P * vs.shape()[3], vs.shape()[3], 1};
    p.k_channel_scales = channels.data();
    p.k_channel_stride = {c.kv_heads * c.head_dim_qk, c.head_dim_qk, 1, 0};
    p.k_outliers = outliers.data();
    p.k_outlier_stride = {c.kv_heads * kCacheKeyOutliers, kCacheKeyOutliers, 1, 0};
  }
  if (kernels::decode_applies(p)) {
    kernels::flash_decode(p, options.num_threads);
    return;
  }
  // More query rows than the decode kernel takes: each sequence over a float32 copy of its
  // positions (widened or dequantized), as attention() in T.
  for (int64_t s = 0; s < S; ++s) {
    Tensor kt = cache.keys_as_float(ids[s]), vt = cache.values_as_float(ids[s]);
    if constexpr (!std::is_same_v<T, float>) {
      kt = kt.converted(DTypeOf<T>::value);  // exact: the pool holds T
      vt = vt.converted(DTypeOf<T>::value);
    }
    auto one = [&](const auto& x) {  // sequence s of a (S, H, n, D) view as (1, H, n, D)
      using V = std::remove_cv_t<std::remove_reference_t<decltype(x)>>;
      return V(x.data + s * x.stride[0], {1, x.shape[1], x.shape[2], x.shape[3]},
               {x.stride[0], x.stride[1], x.stride[2], x.stride[3]});
    };
    const int64_t L = lengths[s];
    BasicAttentionInputs<T> in;
    in.alibi_slopes = score.alibi_slopes;
    in.sinks = score.sinks;
    in.query = one(q);
    in.key = View<const T>(kt.data<T>(), {1, c.kv_heads, L, c.head_dim_qk});
    in.value = View<const T>(vt.data<T>(), {1, c.kv_heads, L, c.head_dim_v});
    BasicAttentionOutputs<T> o;
    o.out = one(out);
    AttentionOptions opt = options;
    opt.causal = Causal::kBottomRight;
    opt.window = c.window;
    attention(in, o, opt);
  }
}

}  // namespace

bool attention_over_quantized_cache(const View<const float>& q, const KvCache& cache, const View<float>& out,
                                    const AttentionOptions& options, const int64_t* causal_offset,
                                    const ScoreHeads& score) {
  const KvCacheConfig& c = cache.config();
  MHA_CHECK(cache.quantized() && q.rank == 4 && out.rank == 4 && q.shape[0] == c.batch &&
                q.shape[1] % c.kv_heads == 0 && q.shape[3] == c.head_dim_qk && out.shape[0] == q.shape[0] &&
                out.shape[1] == q.shape[1] && out.shape[2] == q.shape[2] && out.shape[3] == c.head_dim_v,
            "attention over a {} cache: query {} and output {} do not fit it", cache_type_name(c.dtype),
            shape_string(q), shape_string(out));
  std::vector<int64_t> lengths(static_cast<size_t>(c.batch));
  for (int64_t b = 0; b < c.batch; ++b) lengths[b] = cache.stored(b);
  const View<const uint8_t> kc = cache.key_codes(), vc = cache.value_codes();
  const View<const uint32_t> ks = cache.key_scales(), vs = cache.value_scales();
  const View<const float> ch = cache.key_channel_scales();
  kernels::AttentionParams p =
      decode_params(q, out, c.kv_heads, c.head_dim_qk, c.head_dim_v, options, causal_offset, 0, score);
  p.kv_len = cache.capacity();
  p.key_lengths = lengths.data();
  p.key_lengths_stride = 1;
  p.k = kc.data;
  p.k_stride = strides_of(kc.stride);
  p.v = vc.data;
  p.v_stride = strides_of(vc.stride);
  p.kv_bits = kv_storage::quant_bits(c.dtype);
  p.k_scales = ks.data;
  p.k_scale_stride = strides_of(ks.stride);
  p.v_scales = vs.data;
  p.v_scale_stride = strides_of(vs.stride);
  p.k_channel_scales = ch.data;
  p.k_channel_stride = {ch.stride[0], ch.stride[1], ch.stride[2], 0};
  const View<const int64_t> outliers = cache.key_outlier_channels();
  p.k_outliers = outliers.data;
  p.k_outlier_stride = {outliers.stride[0], outliers.stride[1], outliers.stride[2], 0};
  if (!kernels::decode_applies(p)) return false;
  kernels::flash_decode(p, options.num_threads);
  return true;
}

void attention_over_paged_cache(const View<const float>& q, const PagedKvCache& cache, const std::vector<int64_t>& ids,
                                const View<float>& out, const AttentionOptions& options, const ScoreHeads& score) {
  auto in_type = [&](auto tag) {  // 16-bit pools: queries rounded to T, the result widened back
    using T = decltype(tag);
    const HeadsAs<T> io(q, out);
    paged_decode<T>(io.q, cache, ids, io.o, options, score);
    io.finish();
  };
  switch (cache.config().dtype) {
    case CacheType::kBF16: in_type(bfloat16{}); break;
    case CacheType::kF16: in_type(float16{}); break;
    default: paged_decode<float>(q, cache, ids, out, options, score); break;
  }
}

}  // namespace mha::ops
