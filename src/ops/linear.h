// Linear projections y = x · Wᵀ + b over row matrices (PyTorch's nn.Linear layout: W is
// (out, in)), on oneDNN's sgemm.
#ifndef MHA_OPS_LINEAR_H_
#define MHA_OPS_LINEAR_H_

#include <cstdint>

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

}  // namespace mha::ops

#endif  // MHA_OPS_LINEAR_H_
