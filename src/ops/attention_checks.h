// Checks the public attention arguments and turns them into kernels::AttentionParams.
#ifndef MHA_OPS_ATTENTION_PARAMS_H_
#define MHA_OPS_ATTENTION_PARAMS_H_

#include "kernels/attention_params.h"
#include "mha/attention.h"

namespace mha::ops {

// Throws mha::Error naming the argument and shapes on any inconsistency (see attention.h).
// T: float, bfloat16 or float16 (sets p.dtype). For 16-bit T, out.weights is checked but
// p.weights stays null: the kernels write float32 weights, and the caller gives them a buffer.
template <typename T>
kernels::AttentionParams make_attention_params(const BasicAttentionInputs<T>& in,
                                               const BasicAttentionOutputs<T>& out,
                                               const AttentionOptions& options);

// Strides that broadcast a mask of rank <= 4 against `target` (B, Hq, Tq, Tk), right-aligned:
// each mask dimension must equal the target's or be 1 (stride 0). `name` is used in errors.
template <typename T>
kernels::Strides4 broadcast_strides(const View<T>& mask, const int64_t (&target)[4],
                                    const char* name);

// Whether the memory two float views address overlaps (an mha::Error naming a view whose byte
// span overflows int64).
bool views_overlap(const View<const float>& a, const char* a_name, const View<const float>& b, const char* b_name);

}  // namespace mha::ops

#endif  // MHA_OPS_ATTENTION_PARAMS_H_
