// attention(): argument checks, then kernel choice and the split over threads.
#include "mha/attention.h"

#include <cmath>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "ops/attention_internal.h"
#include "ops/attention_checks.h"
#include "util/check.h"
#include "util/convert.h"
#include "util/parallel.h"

namespace mha {

namespace {

// The forward's kernel family: reference, decode, or flash (+ the weights pass).
void compute(const kernels::AttentionParams& p, const AttentionOptions& options) {
  if (options.backend == Backend::kReference) {
    // One task per (b, query row); each task computes every head of its row.
    parallel_for(p.batch * p.q_len, options.num_threads, [&](int64_t t) {
      kernels::attention_ref_row<double>(p, t / p.q_len, t % p.q_len);
    });
    return;
  }
  if (kernels::decode_applies(p)) {  // few query rows against many keys: bound by reading K/V
    kernels::flash_decode(p, options.num_threads);
    return;
  }
  // The weights pass needs every row's final log-sum-exp: O(B·Hq·Tq) floats.
  std::vector<float> row_lse(p.weights ? static_cast<size_t>(p.batch * p.q_heads * p.q_len) : 0);
  kernels::flash_forward(p, p.weights ? row_lse.data() : nullptr, options.num_threads);
  if (p.weights) kernels::flash_weights(p, row_lse.data(), options.num_threads);
}

// dst = src rounded to T, both (B, Hq, Tq, Tk) or (B, Tq, Tk); src contiguous.
template <typename T>
void round_weights(const Tensor& src, const View<T>& dst, int num_threads) {
  const float* w = src.data<float>();
  const int64_t rows = dst.shape[0] * dst.shape[1] * (dst.rank == 4 ? dst.shape[2] : 1);
  const int64_t cols = dst.shape[dst.rank - 1];
  const int64_t inner = dst.rank == 4 ? dst.shape[2] : 1;
  parallel_for(rows, num_threads, [&](int64_t r) {
    const int64_t a = r / (dst.shape[1] * inner), b = r / inner % dst.shape[1], c = r % inner;
    T* row = dst.data + a * dst.stride[0] + b * dst.stride[1] + (dst.rank == 4 ? c * dst.stride[2] : 0);
    const int64_t cs = dst.stride[dst.rank - 1];
    if (cs == 1) {
      narrow_from_f32(w + r * cols, DTypeOf<T>::value, row, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j) kernels::store_element(row, j * cs, w[r * cols + j], DTypeOf<T>::value);
    }
  });
}

template <typename T>
void run_attention(const BasicAttentionInputs<T>& in, const BasicAttentionOutputs<T>& out,
                   const AttentionOptions& options, const int64_t* causal_offset) {
  kernels::AttentionParams p = ops::make_attention_params(in, out, options);
  p.causal_offset = causal_offset;
  if (p.no_work) return;
  // 16-bit weights: the kernels write float32 weights here, rounded once into out.weights.
  Tensor weights32;
  if (!std::is_same_v<T, float> && out.weights.given()) {
    const auto& w = out.weights;
    weights32 = Tensor(DType::kF32, std::vector<int64_t>(w.shape.begin(), w.shape.begin() + w.rank));
    const View<float> v = weights32.view<float>();
    p.weights = v.data;
    p.weights_stride = p.weights_averaged ? kernels::Strides4{v.stride[0], 0, v.stride[1], v.stride[2]}
                                          : kernels::Strides4{v.stride[0], v.stride[1], v.stride[2], v.stride[3]};
  }
  compute(p, options);
  if (weights32.defined()) round_weights(weights32, out.weights, options.num_threads);
}

template <typename T>
void checked_run(const BasicAttentionInputs<T>& in, const BasicAttentionOutputs<T>& out,
                 const AttentionOptions& options, const int64_t* causal_offset) {
  try {
    run_attention(in, out, options, causal_offset);
  } catch (const std::bad_alloc&) {
    // Scratch memory (per thread, O(rows · (D + Dv + key block))) or the LSE buffer.
    throw Error("attention: out of memory for scratch buffers (query " + shape_string(in.query) + ")");
  }
}

}  // namespace

void attention(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options) {
  checked_run(in, out, options, nullptr);
}
void attention(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
               const AttentionOptions& options) {
  checked_run(in, out, options, nullptr);
}
void attention(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
               const AttentionOptions& options) {
  checked_run(in, out, options, nullptr);
}

namespace ops {

namespace {
template <typename T>
void with_offsets(const BasicAttentionInputs<T>& in, const BasicAttentionOutputs<T>& out, const AttentionOptions& options,
                  const int64_t* causal_offset) {
  if (options.causal == Causal::kNone) throw Error("attention: causal offsets need causal masking");
  checked_run(in, out, options, causal_offset);
}
}  // namespace

void attention_with_offsets(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                            const int64_t* causal_offset) {
  with_offsets(in, out, options, causal_offset);
}
void attention_with_offsets(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset) {
  with_offsets(in, out, options, causal_offset);
}
void attention_with_offsets(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset) {
  with_offsets(in, out, options, causal_offset);
}

bool attention_over_quantized_cache(const View<const float>& q, const KvCache& cache, const View<float>& out,
                                    const AttentionOptions& options, const int64_t* causal_offset) {
  const KvCacheConfig& c = cache.config();
  MHA_CHECK(cache.quantized() && q.rank == 4 && out.rank == 4 && q.shape[0] == c.batch &&
                q.shape[1] % c.kv_heads == 0 && q.shape[3] == c.head_dim_qk && out.shape[0] == q.shape[0] &&
                out.shape[1] == q.shape[1] && out.shape[2] == q.shape[2] && out.shape[3] == c.head_dim_v,
            "attention over a {} cache: query {} and output {} do not fit it", cache_type_name(c.dtype),
            shape_string(q), shape_string(out));
  std::vector<int64_t> lengths(static_cast<size_t>(c.batch));
  for (int64_t b = 0; b < c.batch; ++b) lengths[b] = cache.stored(b);
  const View<const uint8_t> kc = cache.key_codes(), vc = cache.value_codes();
  const View<const float> ks = cache.key_scales(), vs = cache.value_scales();
  kernels::AttentionParams p;
  p.batch = c.batch;
  p.q_heads = q.shape[1];
  p.kv_heads = c.kv_heads;
  p.q_len = q.shape[2];
  p.kv_len = cache.capacity();
  p.head_dim_qk = c.head_dim_qk;
  p.head_dim_v = c.head_dim_v;
  p.q = q.data;
  p.q_stride = {q.stride[0], q.stride[1], q.stride[2], q.stride[3]};
  p.k = kc.data;
  p.k_stride = {kc.stride[0], kc.stride[1], kc.stride[2], kc.stride[3]};
  p.v = vc.data;
  p.v_stride = {vc.stride[0], vc.stride[1], vc.stride[2], vc.stride[3]};
  p.kv_bits = c.dtype == CacheType::kInt8 ? 8 : 4;
  p.k_scales = ks.data;
  p.k_scale_stride = {ks.stride[0], ks.stride[1], ks.stride[2], ks.stride[3]};
  p.v_scales = vs.data;
  p.v_scale_stride = {vs.stride[0], vs.stride[1], vs.stride[2], vs.stride[3]};
  const View<const float> ch = cache.key_channel_scales();
  p.k_channel_scales = ch.data;
  p.k_channel_stride = {ch.stride[0], ch.stride[1], ch.stride[2], 0};
  p.key_lengths = lengths.data();
  p.key_lengths_stride = 1;
  p.scale = options.scale ? *options.scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim_qk));
  MHA_CHECK(std::isfinite(p.scale), "attention: scale must be finite; got {}", p.scale);
  p.causal = causal_offset ? Causal::kBottomRight : Causal::kNone;
  p.causal_offset = causal_offset;
  p.out = out.data;
  p.out_stride = {out.stride[0], out.stride[1], out.stride[2], out.stride[3]};
  if (!kernels::decode_applies(p)) return false;
  kernels::flash_decode(p, options.num_threads);
  return true;
}

}  // namespace ops

}  // namespace mha
