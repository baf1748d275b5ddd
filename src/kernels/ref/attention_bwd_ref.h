// The reference attention backward: the oracle for the fast backward.
//
// For each query row (recomputing P exactly as attention_ref does):
//   dP_d = dO · Vᵀ,  dP = dP_d ⊙ Z/(1 - p)   (Z: the forward's dropout keep decisions)
//   D    = rowsum(dO ⊙ O) = Σ_j P_d,j dP_d,j
//   dS   = P ⊙ (dP - D)                      (⊙ (1 - tanh²) with a softcap)
//   dBias = P ⊙ (dP - D)                     (the gradient of the score the bias is added to)
//   dsink = -P_sink · D                       (sinks: P_sink = exp(sink - lse))
//   dQ   = scale · dS · K,  dK += scale · dSᵀ · Q,  dV += P_dᵀ · dO
// accumulating in double. Masked keys and keys with a -inf score get dS = 0 (they never touch
// K or V), as in the forward.
#ifndef MHA_KERNELS_REF_ATTENTION_BWD_REF_H_
#define MHA_KERNELS_REF_ATTENTION_BWD_REF_H_

#include <cstdint>

#include "kernels/attention_params.h"

namespace mha::kernels {

// Elements of the AttentionParams' dtype (the reference backward takes float32 only).
struct AttentionGradParams {
  const void* grad_out = nullptr;  Strides4 grad_out_stride{};  // dO (B, Hq, Tq, Dv)
  void* grad_q = nullptr;          Strides4 grad_q_stride{};    // (B, Hq, Tq, Dqk)
  void* grad_k = nullptr;          Strides4 grad_k_stride{};    // (B, Hkv, Tk, Dqk)
  void* grad_v = nullptr;          Strides4 grad_v_stride{};    // (B, Hkv, Tk, Dv)
  // Sinks (reference only): dL/d sink_h summed over the rows of batch b, at [b · Hq + h]. The op
  // sums over b; the fast path computes it from out, lse and dO instead.
  double* grad_sinks_by_batch = nullptr;
  // Optional, (B, Hq, Tq, Tk): dL/d score for the score the bias is added to (after the softcap),
  // P ⊙ (dP - D), at every element that counts; the kernels write nothing elsewhere, so the op
  // zero-fills it first. Summed over the bias's broadcast dimensions by the op.
  float* grad_scores = nullptr;  Strides4 grad_scores_stride{};
};

// Writes dQ for the query heads of kv head hk and dK, dV of (b, hk). Single-threaded.
template <typename Acc>
void attention_bwd_ref_head(const AttentionParams& p, const AttentionGradParams& g, int64_t b, int64_t hk);

}  // namespace mha::kernels

#endif  // MHA_KERNELS_REF_ATTENTION_BWD_REF_H_
