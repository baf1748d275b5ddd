// attention(): argument checks, then kernel choice and the split over threads.
#include "mha/attention.h"

#include <new>
#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "ops/attention_internal.h"
#include "ops/attention_checks.h"
#include "util/parallel.h"

namespace mha {

namespace {

void run_attention(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                   const int64_t* causal_offset) {
  kernels::AttentionParams p = ops::make_attention_params(in, out, options);
  p.causal_offset = causal_offset;
  if (p.no_work) return;
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

void checked_run(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                 const int64_t* causal_offset) {
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

namespace ops {

void attention_with_offsets(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                            const int64_t* causal_offset) {
  if (options.causal == Causal::kNone) throw Error("attention: causal offsets need causal masking");
  checked_run(in, out, options, causal_offset);
}

}  // namespace ops

}  // namespace mha
