// attention_backward(): argument checks, then the reference or the fast kernel.
#include <new>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_bwd_ref.h"
#include "mha/attention.h"
#include "ops/attention_checks.h"
#include "util/check.h"
#include "util/parallel.h"

namespace mha {
namespace {

template <typename T>
kernels::Strides4 strides(const View<T>& v) {
  return {v.stride[0], v.stride[1], v.stride[2], v.stride[3]};
}

void check_like(const View<float>& g, const View<const float>& like, const char* name, const char* of) {
  MHA_CHECK(g.rank == 4 && g.shape == like.shape, "attention_backward: {} must have the shape of {} {}; got {}", name,
            of, shape_string(like), shape_string(g));
  MHA_CHECK(g.numel() == 0 || g.data, "attention_backward: {} has a null data pointer", name);
}

}  // namespace

void attention_backward(const AttentionInputs& in, const View<const float>& out, const View<const float>& lse,
                        const View<const float>& grad_out, const AttentionInputGrads& grads,
                        const AttentionOptions& options) {
  MHA_CHECK(out.given() && lse.given(), "attention_backward: needs the forward's out and lse; got out {}, lse {}",
            shape_string(out), shape_string(lse));
  // The forward's checks, with out and lse in their places (they are only read here).
  AttentionOutputs fwd;
  fwd.out.data = const_cast<float*>(out.data);
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
  kernels::AttentionGradParams g;
  g.grad_out = grad_out.data;
  g.grad_out_stride = strides(grad_out);
  g.grad_q = grads.grad_query.data;
  g.grad_q_stride = strides(grads.grad_query);
  g.grad_k = grads.grad_key.data;
  g.grad_k_stride = strides(grads.grad_key);
  g.grad_v = grads.grad_value.data;
  g.grad_v_stride = strides(grads.grad_value);
  try {
    if (options.backend == Backend::kReference) {
      parallel_for(p.batch * p.kv_heads, options.num_threads, [&](int64_t t) {
        kernels::attention_bwd_ref_head<double>(p, g, t / p.kv_heads, t % p.kv_heads);
      });
      return;
    }
    kernels::flash_backward(p, g, options.num_threads);
  } catch (const std::bad_alloc&) {
    throw Error("attention_backward: out of memory for scratch buffers (query " + shape_string(in.query) + ")");
  }
}

}  // namespace mha
