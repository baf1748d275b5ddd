// Per-head transforms of q and k inside MultiHeadAttention: rotary position embeddings and
// QK-norm (RMSNorm per head), with their backward passes. Not public API.
//
// Hand-written rather than a library: they act on strided (B, H, T, D) views of the projection
// buffers in place, between the projection GEMM and attention, and no library in reach has a
// rotary embedding (oneDNN and Highway do not).
#ifndef MHA_MODULES_POSITIONAL_H_
#define MHA_MODULES_POSITIONAL_H_

#include <cstdint>
#include <vector>

#include "mha/multi_head_attention.h"
#include "mha/tensor.h"

namespace mha::modules {

// The most rotated pairs per head (rotary.dims / 2): head dims up to 1024.
constexpr int64_t kMaxRotaryPairs = 512;

// The rotation frequencies of a RotaryConfig (checked by check_rotary) for a head dim.
struct RotaryFreqs {
  std::vector<double> inv_freq;  // dims / 2 angles per position
  double attention_factor = 1;   // YaRN scales cos and sin by it; 1 otherwise
  int64_t dims = 0;
  bool interleaved = false;
};

// Throws mha::Error naming the field unless r describes a valid rotary embedding for heads of
// head_dim (or is off: dims = 0).
void check_rotary(const RotaryConfig& r, int64_t head_dim);
RotaryFreqs rotary_freqs(const RotaryConfig& r);

// One view's per-head transform: its rows from src, normalised with norm_weight (QK-norm; null:
// none, the rows copied when dst is not src), into dst (B, H, T, D).
struct HeadTransform {
  View<const float> src;
  View<float> dst;
  const float* norm_weight = nullptr;
};

// QK-norm (each view with a norm_weight: x / sqrt(mean(x²) + eps) · w) then rotation of the
// first f.dims dims (none if 0), for q (B, Hq, Tq, D) and k (B, Hkv, Tk, D): row t of batch b is
// at position q_first[b] + t (k_first for k). One pass over each row, vectorised
// (kernels/cpu/qk_rows.h); rows of unit stride.
void transform_qk(const RotaryFreqs& f, float eps, const HeadTransform& q, const std::vector<int64_t>& q_first,
                  const HeadTransform& k, const std::vector<int64_t>& k_first, int num_threads);

// One view's gradient through its transform: g (B, H, T, D), dL/d of the transformed rows,
// becomes dL/d of the rows before it, in place. With QK-norm (norm_weight set), x holds the
// forward's input rows and dw (D floats) accumulates dL/dw.
struct HeadGradient {
  View<const float> x;
  View<float> g;
  const float* norm_weight = nullptr;
  float* dw = nullptr;
};

// The backward of transform_qk with the same positions: the transposed rotation (with a YaRN
// attention factor a, the backward of a·R is a·Rᵀ) then RMSNorm's backward, one pass over each
// gradient row. dw sums in a fixed order: the same bits for any thread count.
void transform_qk_backward(const RotaryFreqs& f, float eps, const HeadGradient& q, const std::vector<int64_t>& q_first,
                           const HeadGradient& k, const std::vector<int64_t>& k_first, int num_threads);

// BLOOM's ALiBi slopes for H heads: 2^(-8(h+1)/n) for the closest power of two n <= H, then
// the odd ones of 2n for the remaining heads.
std::vector<float> alibi_slopes(int64_t heads);

}  // namespace mha::modules

#endif  // MHA_MODULES_POSITIONAL_H_
