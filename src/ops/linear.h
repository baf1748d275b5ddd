// Linear projections y = x · Wᵀ + b over row matrices (PyTorch's nn.Linear layout: W is
// (out, in)), on oneDNN's sgemm.
#ifndef MHA_OPS_LINEAR_H_
#define MHA_OPS_LINEAR_H_

#include <cstdint>

#include "mha/half.h"
#include "mha/tensor.h"

namespace mha::ops {

struct RowMatrix {
  const float* data;
  int64_t rows, cols, row_stride;  // elements
};

// y[n, o] = sum_i x[n, i] * w[o, i] + bias[o]   (bias may be null)
// x: (N, in) with row stride ldx; w: (out, in) with row stride ldw; y: (N, out), row stride ldy.
// The output is cut into tiles that depend on the shapes alone and each tile is one
// single-threaded sgemm, so the result has the same bits for any thread count.
void linear(RowMatrix x, RowMatrix w, const float* bias, float* y, int64_t ldy, int num_threads);

// The same in plain loops accumulating in double: the reference path.
void linear_ref(RowMatrix x, RowMatrix w, const float* bias, float* y, int64_t ldy, int num_threads);

// C (M × N, row stride ldc) = op(A) · op(B) + beta · C, row-major, op = transpose if trans_*.
// Tiled over C as linear() is (shapes alone decide the tiles; K is never split), so the
// result has the same bits for any thread count.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc, int num_threads);

// Backward of linear(): given dy (N, out), adds dyᵀ·x to grad_w (out, in, row stride ldgw) and
// column sums of dy (summed in double, rows in order) to grad_b (if not null), and writes
// dx = dy · w (N, in) if dx is not null.
void linear_backward(RowMatrix x, RowMatrix w, const float* dy, int64_t lddy, float* dx, int64_t lddx, float* grad_w,
                     int64_t ldgw, float* grad_b, int num_threads);

// bfloat16 rows: x (N, in) and w (out, in), products accumulated in float32 into y (float32),
// plus bias. On oneDNN's bf16 matmul (vdpbf16ps where the CPU has AVX512-BF16), tiled as
// linear(): the same bits for any thread count. Where oneDNN has no bf16 matmul for the CPU
// (AVX2 machines), each tile is widened to float32 and multiplied by sgemm: the same exact
// products, float32 sums in sgemm's order.
struct Bf16RowMatrix {
  const bfloat16* data;
  int64_t rows, cols, row_stride;
};
void linear_bf16(Bf16RowMatrix x, Bf16RowMatrix w, const float* bias, float* y, int64_t ldy, int num_threads);
// Whether this oneDNN has a bf16 matmul on this CPU: 2.6 has one only from AVX-512 up, so AVX2
// machines take linear_bf16's float32 path.
bool bf16_matmul_available();

// y = x · wᵀ + bias for x of float32 or bfloat16 (rows at x + n·ldx) and w of bfloat16 or
// float16 (rows at w + o·ldw), each tile's rows widened to float32 (exactly) into the thread's
// buffers and multiplied by sgemm, tiled as linear(): the same bits for any thread count. The
// float16 modules' projections (sgemm reads float32 only), where a whole widened copy of the
// weight per call cost more than the product at 128 rows (docs/benchmarks.md), and
// linear_bf16's path without a bf16 matmul.
// K is taken in panels of kWidenedPanel, so the buffers stay within 256 × kWidenedPanel floats
// per operand and thread whatever K (they are kept for the thread's later calls).
constexpr int64_t kWidenedPanel = 512;
void linear_widened(const void* x, DType x_type, int64_t ldx, int64_t M, const void* w, DType w_type, int64_t ldw,
                    int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, int num_threads);

}  // namespace mha::ops

#endif  // MHA_OPS_LINEAR_H_
