// Entry points of the attention op for mha's own modules (not public API).
#ifndef MHA_OPS_ATTENTION_INTERNAL_H_
#define MHA_OPS_ATTENTION_INTERNAL_H_

#include <cstdint>
#include <vector>

#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/paged_kv_cache.h"

namespace mha::ops {

// The per-head score inputs of attention over caches (see mha/attention.h): ALiBi slopes (Hq,)
// and sink logits (Hq,), each optional; checked by the caller (a module's own tensors).
struct ScoreHeads {
  View<const float> alibi_slopes, sinks;
};

// attention() with explicit per-batch causal offsets: query i of batch b sits at key position
// i + causal_offset[b] (B values; options.causal must not be kNone). The KV cache uses it for
// sequences of different lengths and for windowed chunks.
void attention_with_offsets(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                            const int64_t* causal_offset);
void attention_with_offsets(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset);
void attention_with_offsets(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset);

// Attention of float32 queries q (B, Hq, n, Dk) over the positions an int8/int4 cache stores,
// read in its stored format by the decode kernel, into out (B, Hq, n, Dv); sequence b sees its
// cache.stored(b) slots. causal_offset: as above (bottom-right masking), or nullptr for none.
// Returns false, computing nothing, where the decode kernel does not apply (more than
// kMaxDecodeRows query rows per kv head); the caller then attends over keys_as_float().
bool attention_over_quantized_cache(const View<const float>& q, const KvCache& cache, const View<float>& out,
                                    const AttentionOptions& options, const int64_t* causal_offset,
                                    const ScoreHeads& score = {});

// attend() over a paged pool (checked by the caller): the decode kernel through the sequences'
// block tables for up to kMaxDecodeRows query rows per kv head, else per sequence over float32
// copies. 16-bit pools attend in their type (queries rounded to it, the result widened back).
void attention_over_paged_cache(const View<const float>& q, const PagedKvCache& cache, const std::vector<int64_t>& ids,
                                const View<float>& out, const AttentionOptions& options, const ScoreHeads& score = {});

}  // namespace mha::ops

#endif  // MHA_OPS_ATTENTION_INTERNAL_H_
