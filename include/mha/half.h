// 16-bit floating-point element types: bfloat16 (1 sign, 8 exponent, 7 mantissa bits: float32's
// range at 3 significant digits) and float16 (IEEE binary16: 5 exponent, 10 mantissa bits,
// largest finite value 65504). Both are storage types: mha computes in float32 and rounds once
// when it writes a 16-bit result.
//
// to_float is exact (every bf16 and fp16 value is a float). The conversions from float round to
// nearest, ties to even, as PyTorch's .to(torch.bfloat16) / .to(torch.float16) do: NaN stays NaN
// (quiet), infinities stay infinite, and float16 overflows to ±inf above 65504 (values from
// 65520 up) and keeps subnormals down to 2⁻²⁴.
#ifndef MHA_HALF_H_
#define MHA_HALF_H_

#include <cstdint>

namespace mha {

struct bfloat16 {
  uint16_t bits = 0;
};

struct float16 {
  uint16_t bits = 0;
};

float to_float(bfloat16 x);
float to_float(float16 x);
bfloat16 to_bfloat16(float x);
float16 to_float16(float x);

}  // namespace mha

#endif  // MHA_HALF_H_
