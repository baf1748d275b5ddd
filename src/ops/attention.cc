// attention(): argument checks, then kernel choice and the split over threads.
#include "mha/attention.h"

#include "kernels/ref/attention_ref.h"
#include "ops/attention_params.h"
#include "util/parallel.h"

namespace mha {

void attention(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options) {
  const kernels::AttentionParams p = ops::make_attention_params(in, out, options);
  // One task per (b, query row); each task computes every head of its row.
  parallel_for(p.batch * p.q_len, options.num_threads, [&](int64_t t) {
    kernels::attention_ref_row<double>(p, t / p.q_len, t % p.q_len);
  });
}

}  // namespace mha
