// Entry points of the attention op for mha's own modules (not public API).
#ifndef MHA_OPS_ATTENTION_INTERNAL_H_
#define MHA_OPS_ATTENTION_INTERNAL_H_

#include <cstdint>

#include "mha/attention.h"

namespace mha::ops {

// attention() with explicit per-batch causal offsets: query i of batch b sits at key position
// i + causal_offset[b] (B values; options.causal must not be kNone). The KV cache uses it for
// sequences of different lengths and for windowed chunks.
void attention_with_offsets(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                            const int64_t* causal_offset);
void attention_with_offsets(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset);
void attention_with_offsets(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset);

}  // namespace mha::ops

#endif  // MHA_OPS_ATTENTION_INTERNAL_H_
