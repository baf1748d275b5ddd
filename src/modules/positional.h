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

// Rotates the first f.dims dims of every row of x (B, H, T, D) in place: row t of batch b is at
// position first[b] + t. inverse: the transposed rotation (the backward of a rotation by the same
// angles; with a YaRN attention factor a, the backward of a·R is a·Rᵀ).
void rotate(const RotaryFreqs& f, const View<float>& x, const std::vector<int64_t>& first, bool inverse, int num_threads);

// x (B, H, T, D) in place: x / sqrt(mean(x²) + eps) · w per row (w: D floats).
void rms_norm(const View<float>& x, const float* w, float eps, int num_threads);
// Given the normalised rows' input x and g = dL/d(output) (both (B, H, T, D)): g becomes dL/dx
// and dw (D floats) accumulates Σ g·x̂ over the rows (in a fixed order: the same bits for any
// thread count).
void rms_norm_backward(const View<const float>& x, const float* w, float eps, const View<float>& g, float* dw);

// BLOOM's ALiBi slopes for H heads: 2^(-8(h+1)/n) for the closest power of two n <= H, then
// the odd ones of 2n for the remaining heads.
std::vector<float> alibi_slopes(int64_t heads);

}  // namespace mha::modules

#endif  // MHA_MODULES_POSITIONAL_H_
