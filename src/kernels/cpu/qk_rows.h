// Row kernels of MultiHeadAttention's per-head transforms of q and k — QK-norm (RMSNorm per head)
// and rotary embeddings, forward and backward — compiled per SIMD target like the attention
// kernels (modules/positional.cc builds the angle tables, splits the tasks and sums the weight
// gradients). A call handles `rows` rows of D contiguous floats, row r at base + r·stride: the
// heads of one token. Not public API.
#ifndef MHA_KERNELS_CPU_QK_ROWS_H_
#define MHA_KERNELS_CPU_QK_ROWS_H_

#include <cstdint>

namespace mha::kernels {

// The rotation of one position's rows (pairs = 0: none).
//  - half-split (Llama/NeoX): pair i is (x[i], x[i + pairs]); cos, sin: `pairs` values.
//  - interleaved (GPT-J): pair i is (x[2i], x[2i + 1]); cos, sin: 2·pairs values, cos[2i] =
//    cos[2i+1] = cos θᵢ, sin[2i] = −sin θᵢ, sin[2i+1] = sin θᵢ, so that
//    y = x ⊙ cos + swap_pairs(x) ⊙ sin.
// The inverse rotation is the same with every sin negated.
struct RowRotation {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t pairs = 0;
  bool interleaved = false;
};

// out_r = rotate(norm(in_r)) for each row, norm(x) = x / sqrt(mean(x²) + eps) ⊙ w when w is
// not null (QK-norm), x otherwise. out may be in (in place).
void qk_rows_forward(const float* in, int64_t in_stride, float* out, int64_t out_stride, int64_t rows, int64_t D,
                     const float* w, float eps, const RowRotation& r);

// The backward of qk_rows_forward for the same rows, with r the inverse rotation: g_r (dL/d out_r)
// becomes dL/d in_r in place, and dw (D floats) accumulates dL/dw of these rows. x: the forward's
// input rows, read only when w is set.
void qk_rows_backward(const float* x, int64_t x_stride, float* g, int64_t g_stride, int64_t rows, int64_t D,
                      const float* w, float eps, const RowRotation& r, float* dw);

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_QK_ROWS_H_
