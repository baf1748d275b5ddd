// Vector conversions between float32 and the 16-bit element types (mha/half.h) for the fast
// kernels, which compute in float32 and convert while reading and writing.
//
// Loads widen exactly (bf16: a 16-bit shift; fp16: F16C's vcvtph2ps, and the scalar routine on
// the portable target, whose PromoteTo turns infinities into finite values). Stores round to nearest
// even, matching the scalar to_bfloat16 / to_float16: bf16 by integer rounding on the float's
// bits (Highway 1.0's DemoteTo truncates), fp16 by vcvtps2ph on x86 and by the scalar routine on
// the portable target (whose DemoteTo truncates and mishandles infinities).
#if defined(MHA_UTIL_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_UTIL_CONVERT_INL_H_
#undef MHA_UTIL_CONVERT_INL_H_
#else
#define MHA_UTIL_CONVERT_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "hwy/highway.h"
#include "mha/half.h"
#include "util/fp16.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// N floats from N elements at p (unaligned).
template <class DF>
HWY_INLINE hn::Vec<DF> LoadAsFloat(DF d, const float* p) {
  return hn::LoadU(d, p);
}
template <class DF>
HWY_INLINE hn::Vec<DF> LoadAsFloat(DF d, const bfloat16* p) {
  const hn::Rebind<hwy::bfloat16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::bfloat16_t*>(p)));
}
template <class DF>
HWY_INLINE hn::Vec<DF> LoadAsFloat(DF d, const float16* p) {
#if HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
  HWY_ALIGN float tmp[hn::MaxLanes(DF())];
  for (size_t i = 0; i < hn::Lanes(d); ++i) tmp[i] = half_to_float(p[i].bits);
  return hn::Load(d, tmp);
#else
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#endif
}

// The first n (< N) elements at p as floats, zeros after them; nothing past p + n is read.
template <class DF>
HWY_INLINE hn::Vec<DF> LoadTailAsFloat(DF d, const float* p, size_t n) {
  return hn::MaskedLoad(hn::FirstN(d, n), d, p);
}
template <class DF, typename T>
HWY_INLINE hn::Vec<DF> LoadTailAsFloat(DF d, const T* p, size_t n) {
  HWY_ALIGN float tmp[hn::MaxLanes(DF())] = {};
  for (size_t i = 0; i < n; ++i) tmp[i] = to_float(p[i]);
  return hn::Load(d, tmp);
}

// The first n (<= N) lanes of v to p, rounded to p's type.
template <class DF>
HWY_INLINE void StoreFromFloat(DF d, hn::Vec<DF> v, size_t n, float* p) {
  if (n == hn::Lanes(d)) {
    hn::StoreU(v, d, p);
  } else {
    hn::BlendedStore(v, hn::FirstN(d, n), d, p);
  }
}
template <class DF>
HWY_INLINE void StoreFromFloat(DF d, hn::Vec<DF> v, size_t n, bfloat16* p) {
  (void)d;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> du16;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb));
  const auto quiet_nan = hn::Or(bits, hn::Set(du, 0x00400000u));
  const auto out = hn::ShiftRight<16>(hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded));
  HWY_ALIGN uint16_t tmp[hn::MaxLanes(DF())];
  hn::Store(hn::DemoteTo(du16, hn::BitCast(di, out)), du16, tmp);
  for (size_t i = 0; i < n; ++i) p[i].bits = tmp[i];
}
template <class DF>
HWY_INLINE void StoreFromFloat(DF d, hn::Vec<DF> v, size_t n, float16* p) {
#if HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
  HWY_ALIGN float tmp[hn::MaxLanes(DF())];
  hn::Store(v, d, tmp);
  for (size_t i = 0; i < n; ++i) p[i].bits = float_to_half(tmp[i]);
#else
  const hn::Rebind<hwy::float16_t, DF> dh;
  HWY_ALIGN hwy::float16_t tmp[hn::MaxLanes(DF())];
  hn::Store(hn::DemoteTo(dh, v), dh, tmp);
  for (size_t i = 0; i < n; ++i) std::memcpy(&p[i].bits, &tmp[i], 2);
#endif
}

// dst[0..n) = src[0], src[stride], ... as floats.
template <typename T>
HWY_INLINE void RowToFloat(const T* src, int64_t stride, size_t n, float* HWY_RESTRICT dst) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  if (stride == 1) {
    for (; i + N <= n; i += N) hn::StoreU(LoadAsFloat(d, src + i), d, dst + i);
  }
  for (; i < n; ++i) {
    const T x = src[static_cast<int64_t>(i) * stride];
    if constexpr (std::is_same_v<T, float>) {
      dst[i] = x;
    } else {
      dst[i] = to_float(x);
    }
  }
}

// dst[0], dst[stride], ... = src[0..n) · scale, rounded to T as to_bfloat16 / to_float16 round.
template <typename T>
HWY_INLINE void RowFromFloat(const float* HWY_RESTRICT src, float scale, size_t n, T* dst, int64_t stride) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  if (stride == 1) {
    for (; i + N <= n; i += N) StoreFromFloat(d, hn::Mul(hn::LoadU(d, src + i), hn::Set(d, scale)), N, dst + i);
  }
  for (; i < n; ++i) {
    const float x = src[i] * scale;
    T& out = dst[static_cast<int64_t>(i) * stride];
    if constexpr (std::is_same_v<T, float>) {
      out = x;
    } else if constexpr (std::is_same_v<T, bfloat16>) {
      out = to_bfloat16(x);
    } else {
      out = to_float16(x);
    }
  }
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_UTIL_CONVERT_INL_H_
