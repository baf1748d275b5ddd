// The reference attention forward: the oracle every fast kernel is tested against.
//
// Written for clarity, not speed: one query row at a time, every score materialised, the
// softmax in two passes, accumulating in Acc (double for the oracle). Acc = float gives the
// "plain fp32" implementation that docs/numerics.md uses to derive the fast kernels' bound.
// Handles every option of AttentionParams; see mha/attention.h for the semantics.
#ifndef MHA_KERNELS_REF_ATTENTION_REF_H_
#define MHA_KERNELS_REF_ATTENTION_REF_H_

#include <cstdint>

#include "kernels/attention_params.h"

namespace mha::kernels {

// Computes query row i of batch b for every head h = 0..Hq-1 in order (so averaged weights
// are summed in a fixed order). Single-threaded; rows are independent.
template <typename Acc>
void attention_ref_row(const AttentionParams& p, int64_t b, int64_t i);

// Only the output row of (b, h, i), in double. The fast kernels use it for the rare rows whose
// result is not finite, so that non-finite values reach exactly the rows that attend to them.
void attention_ref_output_row(const AttentionParams& p, int64_t b, int64_t h, int64_t i);

}  // namespace mha::kernels

#endif  // MHA_KERNELS_REF_ATTENTION_REF_H_
