// Scalar conversions between float32 and the 16-bit types (include/mha/half.h). The kernels
// convert whole vectors in registers (util/convert-inl.h, util/convert.h); these serve the reference
// kernels, tests and I/O and define the rounding the vector code must match.
#include "mha/half.h"

#include <cstring>

#include "util/fp16.h"

namespace mha {

float to_float(bfloat16 x) { return bf16_to_float(x.bits); }
float to_float(float16 x) { return half_to_float(x.bits); }

bfloat16 to_bfloat16(float x) { return bfloat16{float_to_bf16(x)}; }
float16 to_float16(float x) { return float16{float_to_half(x)}; }

}  // namespace mha
