// attention(): argument checks, then kernel choice and the split over threads.
#include "mha/attention.h"

#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "ops/attention_params.h"
#include "util/parallel.h"

namespace mha {

void attention(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options) {
  const kernels::AttentionParams p = ops::make_attention_params(in, out, options);
  if (options.backend == Backend::kReference) {
    // One task per (b, query row); each task computes every head of its row.
    parallel_for(p.batch * p.q_len, options.num_threads, [&](int64_t t) {
      kernels::attention_ref_row<double>(p, t / p.q_len, t % p.q_len);
    });
    return;
  }
  // The weights pass needs every row's final log-sum-exp: O(B·Hq·Tq) floats.
  std::vector<float> lse2(p.weights ? static_cast<size_t>(p.batch * p.q_heads * p.q_len) : 0);
  kernels::flash_forward(p, p.weights ? lse2.data() : nullptr, options.num_threads);
  if (p.weights) kernels::flash_weights(p, lse2.data(), options.num_threads);
}

}  // namespace mha
