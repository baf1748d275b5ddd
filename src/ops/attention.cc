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

}  // namespace ops

}  // namespace mha
