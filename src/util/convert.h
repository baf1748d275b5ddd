// Bulk conversions between float32 and the 16-bit element types, vectorised and dispatched
// once per call to the best SIMD target (Highway); the same rounding as mha/half.h.
#ifndef MHA_UTIL_CONVERT_H_
#define MHA_UTIL_CONVERT_H_

#include <cstdint>

#include "mha/tensor.h"

namespace mha {

// dst[i] = src[i] widened, for n elements of dtype `from` (kBF16 or kF16; kF32 copies).
void widen_to_f32(const void* src, DType from, float* dst, int64_t n);
// dst[i] = src[i] rounded to `to` (kBF16 or kF16, to nearest even; kF32 copies).
void narrow_from_f32(const float* src, DType to, void* dst, int64_t n);
// The operand types of a projection that widens 16-bit weights as it multiplies (linear_rows16,
// linear_widened): x float32 or bfloat16, w bfloat16 or float16; else an mha::Error naming fn.
void check_widening_operands(const char* fn, DType x_type, DType w_type);

}  // namespace mha

#endif  // MHA_UTIL_CONVERT_H_
