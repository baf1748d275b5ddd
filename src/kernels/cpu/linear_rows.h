// A projection of a few rows by a 16-bit weight, read as stored: the decode steps of bfloat16 and
// float16 modules (one row per sequence), where widening the whole weight to float32 for sgemm on
// every call read and wrote 5× the weight's bytes. Compiled per SIMD target. Not public API.
#ifndef MHA_KERNELS_CPU_LINEAR_ROWS_H_
#define MHA_KERNELS_CPU_LINEAR_ROWS_H_

#include <cstdint>

#include "mha/tensor.h"

namespace mha::kernels {

// Row counts up to which linear_rows16 serves a projection (modules/multi_head_attention.cc).
inline constexpr int64_t kLinearRowsMax = 4;

// y[m][n] = Σ_k x[m][k]·w[n][k] + bias[n] (bias may be null) for M rows of x (float32 or
// bfloat16, row m at x + m·ldx) and the N rows of w (bfloat16 or float16, row n at w + n·ldw),
// K columns each; y row m at y + m·ldy. The products are float32 FMAs of the widened values (a
// bfloat16 · bfloat16 product is exact), summed in float32 lanes, then across them: within
// (K + 1)·u of Σ_k |x·w|. Tasks of 64 outputs: each output has the same bits for any thread count.
void linear_rows16(const void* x, DType x_type, int64_t ldx, int64_t M, const void* w, DType w_type, int64_t ldw,
                   int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, int num_threads);

}  // namespace mha::kernels

#endif  // MHA_KERNELS_CPU_LINEAR_ROWS_H_
