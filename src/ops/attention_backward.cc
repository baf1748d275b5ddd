// attention_backward(): argument checks, then the reference or the fast kernel.
#include <array>
#include <cmath>
#include <new>
#include <vector>
#include <type_traits>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_bwd_ref.h"
#include "kernels/workspace.h"
#include "mha/attention.h"
#include "ops/attention_checks.h"
#include "util/check.h"
#include "util/convert.h"
#include "util/parallel.h"

namespace mha {
namespace {

template <typename T>
kernels::Strides4 strides(const View<T>& v) {
  return {v.stride[0], v.stride[1], v.stride[2], v.stride[3]};
}

template <typename T>
void check_like(const View<T>& g, const View<const T>& like, const char* name, const char* of) {
  MHA_CHECK(g.rank == 4 && g.shape == like.shape, "attention_backward: {} must have the shape of {} {}; got {}", name,
            of, shape_string(like), shape_string(g));
  MHA_CHECK(g.numel() == 0 || g.data, "attention_backward: {} has a null data pointer", name);
}

// A contiguous float32 copy of a rank-4 view of 16-bit elements.
template <typename T>
Tensor widen(const View<const T>& v, int num_threads) {
  Tensor t(DType::kF32, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]});
  float* dst = t.data<float>();
  const int64_t rows = v.shape[0] * v.shape[1] * v.shape[2], cols = v.shape[3];
  parallel_for(rows, num_threads, [&](int64_t r) {
    const int64_t a = r / (v.shape[1] * v.shape[2]), b = r / v.shape[2] % v.shape[1], c = r % v.shape[2];
    const T* row = v.data + a * v.stride[0] + b * v.stride[1] + c * v.stride[2];
    if (v.stride[3] == 1) {
      widen_to_f32(row, DTypeOf<T>::value, dst + r * cols, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[r * cols + j] = to_float(row[j * v.stride[3]]);
    }
  });
  return t;
}

// dst = src (contiguous float32 of dst's shape) rounded to T.
template <typename T>
void narrow(const Tensor& src, const View<T>& dst, int num_threads) {
  const float* s = src.data<float>();
  const int64_t rows = dst.shape[0] * dst.shape[1] * dst.shape[2], cols = dst.shape[3];
  parallel_for(rows, num_threads, [&](int64_t r) {
    const int64_t a = r / (dst.shape[1] * dst.shape[2]), b = r / dst.shape[2] % dst.shape[1], c = r % dst.shape[2];
    T* row = dst.data + a * dst.stride[0] + b * dst.stride[1] + c * dst.stride[2];
    if (dst.stride[3] == 1) {
      narrow_from_f32(s + r * cols, DTypeOf<T>::value, row, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j)
        kernels::store_element(row, j * dst.stride[3], s[r * cols + j], DTypeOf<T>::value);
    }
  });
}

// dL/d sink_h = -Σ_{b,i} P_sink[b,h,i] · D[b,h,i], P_sink = exp(sink_h - lse), D = dO·O (the sink
// takes no value, so its score's gradient is P_sink·(0 - D)). Double sums in a fixed order per
// head: the same bits for any thread count.
void sink_gradients(const kernels::AttentionParams& p, const void* grad_out, const kernels::Strides4& go_stride,
                    const View<float>& grad_sinks, int num_threads) {
  parallel_for(p.q_heads, num_threads, [&](int64_t h) {
    const double sink = kernels::sink_logit(p, h);
    double total = 0.0;
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t o = b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
        const int64_t go = b * go_stride[0] + h * go_stride[1] + i * go_stride[2];
        double dot = 0.0;
        for (int64_t c = 0; c < p.head_dim_v; ++c) {
          dot += static_cast<double>(kernels::load_element(p.out, o + c * p.out_stride[3], p.dtype)) *
                 kernels::load_element(grad_out, go + c * go_stride[3], p.dtype);
        }
        const double lse = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]];
        total -= std::exp(sink - lse) * dot;
      }
    }
    grad_sinks.data[h * grad_sinks.stride[0]] = static_cast<float>(total);
  });
}

// The bias's gradient: its view, right-aligned against the scores (B, Hq, Tq, Tk), as 4-D
// shape and strides (1 and 0 where it has no dimension or has size 1), as the forward reads the
// bias. Empty (all 1s, no data) when the view is not given.
struct BiasGrad {
  std::array<int64_t, 4> shape{1, 1, 1, 1};
  kernels::Strides4 stride{0, 0, 0, 0};
  float* data = nullptr;

  BiasGrad(const View<float>& v, const int64_t (&scores)[4]) : data(v.data) {
    if (!v.given()) return;
    stride = ops::broadcast_strides(View<const float>(v), scores, "grad_attn_bias");
    for (int i = 0; i < v.rank; ++i) shape[4 - v.rank + i] = v.shape[i];
  }
  float& at(int64_t a, int64_t h, int64_t i, int64_t j) const {
    return data[a * stride[0] + h * stride[1] + i * stride[2] + j * stride[3]];
  }
};

// A broadcast bias's full (B, Hq, Tq, Tk) gradient lives in the calling thread's scratch up to
// this size, kept between calls as the forward's gathered keys are (a new buffer each step cost
// its page faults: +18 ms on a 32 MiB one against +3–11 ms reused), and in a Tensor above it.
constexpr int64_t kKeptBiasGradBytes = int64_t{64} << 20;

void fill_zero(const BiasGrad& v, int num_threads) {
  parallel_for(v.shape[0] * v.shape[1] * v.shape[2], num_threads, [&](int64_t r) {
    const int64_t a = r / (v.shape[1] * v.shape[2]), h = r / v.shape[2] % v.shape[1], i = r % v.shape[2];
    for (int64_t j = 0; j < v.shape[3]; ++j) v.at(a, h, i, j) = 0.0f;
  });
}

// dst = full (contiguous (B, Hq, Tq, Tk)) summed over the dimensions dst broadcasts along (its
// size 1 where the scores' is larger): per element of dst, in double, in a fixed order.
void sum_to_bias_shape(const float* full, const int64_t (&scores)[4], const BiasGrad& dst, int num_threads) {
  const int64_t row_stride[3] = {scores[1] * scores[2] * scores[3], scores[2] * scores[3], scores[3]};
  const bool keys_summed = dst.shape[3] != scores[3];
  parallel_for(dst.shape[0] * dst.shape[1] * dst.shape[2], num_threads, [&](int64_t r) {
    const int64_t at[3] = {r / (dst.shape[1] * dst.shape[2]), r / dst.shape[2] % dst.shape[1], r % dst.shape[2]};
    int64_t lo[3], hi[3];  // the score rows this row of dst sums, per dimension
    for (int d = 0; d < 3; ++d) {
      const bool summed = dst.shape[d] != scores[d];
      lo[d] = summed ? 0 : at[d];
      hi[d] = summed ? scores[d] : at[d] + 1;
    }
    std::vector<double> acc(static_cast<size_t>(dst.shape[3]), 0.0);
    for (int64_t a = lo[0]; a < hi[0]; ++a)
      for (int64_t h = lo[1]; h < hi[1]; ++h)
        for (int64_t i = lo[2]; i < hi[2]; ++i) {
          const float* src = full + a * row_stride[0] + h * row_stride[1] + i * row_stride[2];
          if (keys_summed) {
            for (int64_t j = 0; j < scores[3]; ++j) acc[0] += src[j];
          } else {
            for (int64_t j = 0; j < scores[3]; ++j) acc[static_cast<size_t>(j)] += src[j];
          }
        }
    for (int64_t j = 0; j < dst.shape[3]; ++j) dst.at(at[0], at[1], at[2], j) = static_cast<float>(acc[static_cast<size_t>(j)]);
  });
}

// Every element type: the forward's checks with out and lse in their places (only read here)
// and the gradients' checks, then the fast kernel (16-bit arguments widened as read, gradients
// rounded once) or the reference — float32 only, so 16-bit arguments reach it as widened copies
// and its gradients are rounded once.
template <typename T>
void backward(const BasicAttentionInputs<T>& in, const View<const T>& out, const View<const float>& lse,
              const View<const T>& grad_out, const BasicAttentionInputGrads<T>& grads, const AttentionOptions& options) {
  MHA_CHECK(out.given() && lse.given(), "attention_backward: needs the forward's out and lse; got out {}, lse {}",
            shape_string(out), shape_string(lse));
  BasicAttentionOutputs<T> fwd;
  fwd.out.data = const_cast<T*>(out.data);
  fwd.out.rank = out.rank, fwd.out.shape = out.shape, fwd.out.stride = out.stride;
  fwd.lse.data = const_cast<float*>(lse.data);
  fwd.lse.rank = lse.rank, fwd.lse.shape = lse.shape, fwd.lse.stride = lse.stride;
  const kernels::AttentionParams p = ops::make_attention_params(in, fwd, options);
  MHA_CHECK(grad_out.rank == 4 && grad_out.shape == out.shape,
            "attention_backward: grad_out must have the shape of out {}; got {}", shape_string(out),
            shape_string(grad_out));
  check_like(grads.grad_query, in.query, "grad_query", "query");
  check_like(grads.grad_key, in.key, "grad_key", "key");
  check_like(grads.grad_value, in.value, "grad_value", "value");
  const auto& gs = grads.grad_sinks;
  if (in.sinks.given()) {
    MHA_CHECK(gs.given() && gs.rank == 1 && gs.shape[0] == p.q_heads && gs.data,
              "attention_backward: grad_sinks must be given with shape (Hq,) = ({},) when sinks are; got {}", p.q_heads,
              shape_string(gs));
  } else {
    MHA_CHECK(!gs.given(), "attention_backward: grad_sinks {} given without sinks", shape_string(gs));
  }
  const View<float>& gb = grads.grad_attn_bias;
  if (gb.given()) {
    MHA_CHECK(in.attn_bias.given(), "attention_backward: grad_attn_bias {} given without attn_bias",
              shape_string(gb));
    MHA_CHECK(gb.rank == in.attn_bias.rank && gb.shape == in.attn_bias.shape,
              "attention_backward: grad_attn_bias must have the shape of attn_bias {}; got {}",
              shape_string(in.attn_bias), shape_string(gb));
    MHA_CHECK(gb.numel() == 0 || gb.data, "attention_backward: grad_attn_bias has a null data pointer");
    for (int i = 0; i < gb.rank; ++i) {
      MHA_CHECK(gb.shape[i] <= 1 || gb.stride[i] != 0,
                "attention_backward: grad_attn_bias {} has stride 0 in dimension {}: its elements would overlap",
                shape_string(gb), i);
    }
    MHA_CHECK(!ops::views_overlap(gb, "grad_attn_bias", in.attn_bias, "attn_bias"),
              "attention_backward: grad_attn_bias overlaps attn_bias");
  }
  kernels::AttentionGradParams g;
  g.grad_out = grad_out.data;
  g.grad_out_stride = strides(grad_out);
  g.grad_q = grads.grad_query.data;
  g.grad_q_stride = strides(grads.grad_query);
  g.grad_k = grads.grad_key.data;
  g.grad_k_stride = strides(grads.grad_key);
  g.grad_v = grads.grad_value.data;
  g.grad_v_stride = strides(grads.grad_value);
  const int n = options.num_threads;
  try {
    // The bias's gradient: written by the kernels into the caller's view when it has the scores'
    // shape, else into a full float32 buffer summed down to it afterwards.
    const int64_t scores[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
    const BiasGrad bias_grad(gb, scores);
    Tensor full_tensor;
    float* full_grad = nullptr;
    // The fast kernel writes every element, zeros included; the reference writes only the
    // scores that contribute, so its buffer is zeroed first. (16-bit arguments on the reference
    // backend recurse as float32, which does this.)
    const bool zero_first = options.backend == Backend::kReference;
    if (gb.given() && (std::is_same_v<T, float> || options.backend != Backend::kReference)) {
      if (bias_grad.shape == std::array<int64_t, 4>{scores[0], scores[1], scores[2], scores[3]}) {
        if (zero_first) fill_zero(bias_grad, n);
        g.grad_scores = bias_grad.data;
        g.grad_scores_stride = bias_grad.stride;
      } else {
        int64_t count = 1;
        for (const int64_t s : scores) count = checked_mul(count, s, "attention_backward: the bias's gradient");
        if (count <= kKeptBiasGradBytes / static_cast<int64_t>(sizeof(float))) {
          full_grad = kernels::Workspace::local().get<float>(kernels::Workspace::kBwdBiasGradFull,
                                                             static_cast<size_t>(count));
          const View<float> full(full_grad, {scores[0], scores[1], scores[2], scores[3]});
          if (zero_first) fill_zero(BiasGrad(full, scores), n);
        } else {
          full_tensor = Tensor(DType::kF32, {scores[0], scores[1], scores[2], scores[3]});  // zero-filled
          full_grad = full_tensor.data<float>();
        }
        g.grad_scores = full_grad;
        g.grad_scores_stride = {scores[1] * scores[2] * scores[3], scores[2] * scores[3], scores[3], 1};
      }
    }
    if (options.backend != Backend::kReference) {
      kernels::flash_backward(p, g, n);
      if (p.sinks) sink_gradients(p, grad_out.data, g.grad_out_stride, gs, n);
      if (full_grad) sum_to_bias_shape(full_grad, scores, bias_grad, n);
    } else if constexpr (std::is_same_v<T, float>) {
      std::vector<double> by_batch(p.sinks ? static_cast<size_t>(p.batch * p.q_heads) : 0, 0.0);
      g.grad_sinks_by_batch = p.sinks ? by_batch.data() : nullptr;
      parallel_for(p.batch * p.kv_heads, n, [&](int64_t t) {
        kernels::attention_bwd_ref_head<double>(p, g, t / p.kv_heads, t % p.kv_heads);
      });
      for (int64_t h = 0; p.sinks && h < p.q_heads; ++h) {
        double total = 0.0;
        for (int64_t b = 0; b < p.batch; ++b) total += by_batch[static_cast<size_t>(b * p.q_heads + h)];
        gs.data[h * gs.stride[0]] = static_cast<float>(total);
      }
      if (full_grad) sum_to_bias_shape(full_grad, scores, bias_grad, n);
    } else {
      const Tensor q = widen(in.query, n), k = widen(in.key, n), v = widen(in.value, n);
      const Tensor o = widen(out, n), go = widen(grad_out, n);
      Tensor gq(DType::kF32, q.shape()), gk(DType::kF32, k.shape()), gv(DType::kF32, v.shape());
      const AttentionInputs in32{q.view<float>(), k.view<float>(), v.view<float>(), in.keep_mask, in.attn_bias,
                                 in.key_lengths, in.alibi_slopes, in.sinks};
      backward<float>(in32, o.view<float>(), lse, go.view<float>(),
                      {gq.view<float>(), gk.view<float>(), gv.view<float>(), gs, gb}, options);
      narrow(gq, grads.grad_query, n);
      narrow(gk, grads.grad_key, n);
      narrow(gv, grads.grad_value, n);
    }
  } catch (const std::bad_alloc&) {
    throw Error("attention_backward: out of memory for scratch buffers (query " + shape_string(in.query) + ")");
  }
}

}  // namespace

void attention_backward(const AttentionInputs& in, const View<const float>& out, const View<const float>& lse,
                        const View<const float>& grad_out, const AttentionInputGrads& grads,
                        const AttentionOptions& options) {
  backward(in, out, lse, grad_out, grads, options);
}

void attention_backward(const BasicAttentionInputs<bfloat16>& in, const View<const bfloat16>& out,
                        const View<const float>& lse, const View<const bfloat16>& grad_out,
                        const BasicAttentionInputGrads<bfloat16>& grads, const AttentionOptions& options) {
  backward(in, out, lse, grad_out, grads, options);
}

void attention_backward(const BasicAttentionInputs<float16>& in, const View<const float16>& out,
                        const View<const float>& lse, const View<const float16>& grad_out,
                        const BasicAttentionInputGrads<float16>& grads, const AttentionOptions& options) {
  backward(in, out, lse, grad_out, grads, options);
}

}  // namespace mha
