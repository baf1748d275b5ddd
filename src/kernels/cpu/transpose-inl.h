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

#if HWY_TARGET == HWY_AVX3
// SumLanesOfEach on AVX-512 in two halves, for callers that hold four accumulators at a time:
// SumLanesOfFour takes acc[0..3] (accumulators 4g .. 4g + 3) to a vector whose lane k of each
// 128-bit block holds accumulator 4g + k's sum over that block (the tree's levels 1 and 2);
// JoinFours takes the four such vectors (g = 0 .. 3) to the 16 sums, accumulator x in lane x
// (levels 3 and 4). Together they are SumLanesOfEach: the same operations in the same order.
HWY_INLINE __m512 SumLanesOfFour(const __m512* acc) {
  // Level 1: per 128-bit block, [a0+a2, b0+b2, a1+a3, b1+b3] of a pair (a, b).
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  // Level 2: per block, lane k holds accumulator k's partial sum over that block.
  const __m512d a = _mm512_castps_pd(t0), b = _mm512_castps_pd(t1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

HWY_INLINE __m512 JoinFours(const __m512* u) {
  // Levels 3 and 4: sum the four blocks, accumulator group g into block g.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}
#endif

// Lane x of the result is the sum of the lanes of acc[x] (x < N): N horizontal sums by a
// reduction tree (AVX-512: 45 operations for 16 sums instead of a transpose and 15 adds).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V SumLanesOfEach(D d, const V* acc) {
#if HWY_TARGET == HWY_AVX3
  __m512 u[4];
  for (int g = 0; g < 4; ++g) {
    const __m512 four[4] = {acc[4 * g].raw, acc[4 * g + 1].raw, acc[4 * g + 2].raw, acc[4 * g + 3].raw};
    u[g] = SumLanesOfFour(four);
  }
  (void)d;
  return V{JoinFours(u)};
#elif HWY_TARGET == HWY_AVX2
  __m256 t[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = acc[2 * i].raw, b = acc[2 * i + 1].raw;
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  __m256 u[2];
  for (int g = 0; g < 2; ++g) {
    const __m256d a = _mm256_castps_pd(t[2 * g]), b = _mm256_castps_pd(t[2 * g + 1]);
    u[g] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  (void)d;
  return V{_mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31))};
#else
  const size_t N = hn::Lanes(d);
  HWY_ALIGN float sums[hn::MaxLanes(D())];
  for (size_t i = 0; i < N; ++i) sums[i] = hn::GetLane(hn::SumOfLanes(d, acc[i]));
  return hn::Load(d, sums);
#endif
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_TRANSPOSE_INL_H_
