// N×N float transposes in registers (N = lanes: 16 on AVX-512, 8 on AVX2, 1 on scalar), used
// to move query rows into the lanes-as-rows tiles and back: out of 256 elements, AVX-512 needs
// 64 shuffles instead of 256 scalar moves.
//
//   Transpose(d, rows, ncols, dst, ldd, scale): rows[r] points at N floats (only the first
//   ncols are read); dst[c·ldd + r] = scale · rows[r][c] for c < ncols and all N lanes r.
#if defined(MHA_KERNELS_CPU_TRANSPOSE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_TRANSPOSE_INL_H_
#undef MHA_KERNELS_CPU_TRANSPOSE_INL_H_
#else
#define MHA_KERNELS_CPU_TRANSPOSE_INL_H_
#endif

#include <cstddef>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3
// 16×16 in place: r[i] becomes column i.
HWY_INLINE void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + h + 2]);
      r[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));      // column 2h
      r[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));  // column 2h + 1
    }
  }
  // Now r[4i + k] holds, in each 128-bit block b, element k of rows 4i..4i+3 of block b.
  for (int k = 0; k < 4; ++k) {
    const __m512 a0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), a1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 b0 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), b1 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    t[k] = _mm512_shuffle_f32x4(a0, b0, 0x88);
    t[8 + k] = _mm512_shuffle_f32x4(a0, b0, 0xDD);
    t[4 + k] = _mm512_shuffle_f32x4(a1, b1, 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(a1, b1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#elif HWY_TARGET == HWY_AVX2
HWY_INLINE void Transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);      // column 2h
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);  // column 2h + 1
    }
  }
  // u[4i + k]: element k of rows 4i..4i+3, in each 128-bit half.
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
#endif

template <class D>
HWY_INLINE void Transpose(D d, const float* const* rows, size_t ncols, float* HWY_RESTRICT dst, size_t ldd,
                          float scale) {
  const size_t N = hn::Lanes(d);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2
  using V = hn::Vec<D>;
  decltype(V().raw) r[16];
  if (ncols == N) {
    for (size_t i = 0; i < N; ++i) r[i] = hn::LoadU(d, rows[i]).raw;
  } else {
    const auto m = hn::FirstN(d, ncols);
    for (size_t i = 0; i < N; ++i) r[i] = hn::MaskedLoad(m, d, rows[i]).raw;
  }
#if HWY_TARGET == HWY_AVX3
  Transpose16(r);
#else
  Transpose8(r);
#endif
  const V sv = hn::Set(d, scale);
  for (size_t c = 0; c < ncols; ++c) hn::Store(hn::Mul(V{r[c]}, sv), d, dst + c * ldd);
#else
  for (size_t r = 0; r < N; ++r)
    for (size_t c = 0; c < ncols; ++c) dst[c * ldd + r] = scale * rows[r][c];
#endif
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_TRANSPOSE_INL_H_
