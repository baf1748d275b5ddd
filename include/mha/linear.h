// y = x · Wᵀ + b (PyTorch's nn.Linear), on the same GEMM the attention module uses.
#ifndef MHA_LINEAR_H_
#define MHA_LINEAR_H_

#include "mha/tensor.h"

namespace mha {

// x (N, in), weight (out, in), bias (out,) or not given, y (N, out); rows of x and y may have
// any stride, their elements must be contiguous. Same bits for any thread count.
void linear(const View<const float>& x, const View<const float>& weight, const View<const float>& bias,
            const View<float>& y, int num_threads = 0);

// Backward of linear() for dy = dL/dy (N, out): *adds* dyᵀ·x to grad_weight (out, in) and the
// column sums of dy to grad_bias (if given), and writes dL/dx = dy · weight into grad_x (if
// given). Same bits for any thread count.
void linear_backward(const View<const float>& x, const View<const float>& weight, const View<const float>& dy,
                     const View<float>& grad_x, const View<float>& grad_weight, const View<float>& grad_bias,
                     int num_threads = 0);

}  // namespace mha

#endif  // MHA_LINEAR_H_
