// Bulk float32 <-> 16-bit conversions (util/convert.h) on the in-register conversions of
// util/convert-inl.h, compiled per SIMD target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "util/convert.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cstring>

#include "hwy/highway.h"
#include "util/check.h"
#include "util/convert-inl.h"
#include "util/convert.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

template <typename T>
void WidenN(const T* src, float* dst, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadAsFloat(d, src + i), d, dst + i);
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void NarrowN(const float* src, T* dst, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) StoreFromFloat(d, hn::LoadU(d, src + i), static_cast<size_t>(N), dst + i);
  if (i < n) {
    HWY_ALIGN float tail[hn::MaxLanes(hn::ScalableTag<float>())] = {};
    std::memcpy(tail, src + i, static_cast<size_t>(n - i) * sizeof(float));
    StoreFromFloat(d, hn::Load(d, tail), static_cast<size_t>(n - i), dst + i);
  }
}

}  // namespace

void Widen(const void* src, DType from, float* dst, int64_t n) {
  switch (from) {
    case DType::kBF16: WidenN(static_cast<const bfloat16*>(src), dst, n); break;
    case DType::kF16: WidenN(static_cast<const float16*>(src), dst, n); break;
    default: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); break;
  }
}

void Narrow(const float* src, DType to, void* dst, int64_t n) {
  switch (to) {
    case DType::kBF16: NarrowN(src, static_cast<bfloat16*>(dst), n); break;
    case DType::kF16: NarrowN(src, static_cast<float16*>(dst), n); break;
    default: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); break;
  }
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha {
namespace kernels {
HWY_EXPORT(Widen);
HWY_EXPORT(Narrow);
}  // namespace kernels

void widen_to_f32(const void* src, DType from, float* dst, int64_t n) {
  HWY_DYNAMIC_DISPATCH(kernels::Widen)(src, from, dst, n);
}

void narrow_from_f32(const float* src, DType to, void* dst, int64_t n) {
  HWY_DYNAMIC_DISPATCH(kernels::Narrow)(src, to, dst, n);
}

void check_widening_operands(const char* fn, DType x_type, DType w_type) {
  MHA_CHECK(x_type == DType::kF32 || x_type == DType::kBF16, "{}: x must be float32 or bfloat16, not {}", fn,
            dtype_name(x_type));
  MHA_CHECK(w_type == DType::kBF16 || w_type == DType::kF16, "{}: w must be bfloat16 or float16, not {}", fn,
            dtype_name(w_type));
}

}  // namespace mha
#endif  // HWY_ONCE
