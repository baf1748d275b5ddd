// The value pass of the decode kernel (flash_decode.cc) over an int8 cache with 16-bit integer
// products, on weights rounded to 16 bits by WordValueWeights: AVX-512 VNNI's vpdpwssd
// (Int8OutputVnni, AVX3 target where the CPU has VNNI: decode_vnni_word_values()) or AVX2's
// vpmaddwd (Int8Output256, AVX2 target: decode_byte_values()). MHA_DECODE_WORD_VALUES says
// whether this target has them. The float pass (DecodeOutput) converts every code to float (and
// on AVX3 dequantizes it), instructions more per value than the products they feed; here two
// keys' codes of a column share a 32-bit lane and one instruction multiplies and adds both:
// docs/ARCHITECTURE.md.
#if defined(MHA_KERNELS_CPU_DECODE_INT8_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_INT8_VALUES_INL_H_
#undef MHA_KERNELS_CPU_DECODE_INT8_VALUES_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_INT8_VALUES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "kernels/cpu/decode_block-inl.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/decode_value_scales-inl.h"
#include "kernels/cpu/prefetch.h"
#include "mha/kv_cache.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

#undef MHA_DECODE_WORD_VALUES
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2

// The largest weight word, and the most keys a pass sums (a block of the kernel): the int32 sums
// stay exact, |Σ| ≤ 255·32767 per key.
constexpr int32_t kWordWeightMax = 32767;
constexpr size_t kWordPassKeys = 128;
static_assert(int64_t{kWordPassKeys} * 255 * kWordWeightMax < (int64_t{1} << 31), "a pass's sums must fit int32");

// w (each lane at most 32767.5: P ≤ Pmax, scale ≤ Smax, up to float rounding) rounded to nearest
// (even) and saturated to 32767, stored as words at p. Intrinsics: Highway's NearestInt also
// fixes lanes that overflow int32, which cannot occur here (four instructions more per vector).
HWY_INLINE void StoreWords(hn::Vec<DF> w, int16_t* p) {
#if HWY_TARGET == HWY_AVX3
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(w.raw)));
#else
  const __m256i x = _mm256_cvtps_epi32(w.raw);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), words);
#endif
}

// The weights of Int8OutputVnni and Int8Output256 for rows r < R (P at pr + r·ldp, the block's keys
// j < jn) and value groups g < groups: w_j = P_j·scale_g(j) rounded to a multiple of step, u_j =
// w_j / step, with step the power of two at or above Pmax_r·Smax_g / 32767 (Pmax_r: the row's
// largest P in the block, from the softmax; Smax_g: the keys' largest scale in the group), so that
// no word passes 32767: u[(g·R + r)·ldp + j] (zeros from jn up to a whole vector), steps[g·R + r].
// A power of two keeps w / step exact. mins[g·R + r] = Σ_j P_j·minimum_g(j). The keys' scales are
// first staged into st (StageValueScales). False where a Pmax is not finite
// (BlockSoftmax makes it so where a P is not), a scale or a minimum is not finite, or a scale is
// negative: the float pass then takes the block. steps needs groups · (R + 1). (Centring the codes,
// as the int4 pass does, would halve the worst case of the roundings' effect, 6.0e-4 → 3.3e-4
// measured against the float pass, both far below the cache's own error; it took ~5% of the
// cache-resident step: docs/benchmarks.md.)
HWY_INLINE bool WordValueWeights(DF d, const float* pr, size_t ldp, size_t R, const float* pmax,
                                 const QuantKv<8>::Row* vrows, size_t jn, size_t groups, float* HWY_RESTRICT st,
                                 int16_t* HWY_RESTRICT u, float* steps, float* mins) {
  using V = hn::Vec<DF>;
  for (size_t r = 0; r < R; ++r)
    if (!std::isfinite(pmax[r])) return false;
  StageValueScales<QuantKv<8>>(d, ldp, vrows, jn, groups, st);
  const size_t N = hn::Lanes(d), jv = (jn + N - 1) / N * N;
  float* smax = steps + groups * R;
  if (!ValueScaleMaxima(d, st, ldp, jv, groups, smax)) return false;  // before any weight is written
  for (size_t g = 0; g < groups; ++g) {
    const float* scale = st + 2 * g * ldp;
    const float* minimum = scale + ldp;
    for (size_t r = 0; r < R; ++r) {
      const float* p = pr + r * ldp;
      const size_t i = g * R + r;
      steps[i] = PowerOfTwoAtOrAbove(pmax[r] * (smax[g] / static_cast<float>(kWordWeightMax)));  // < 2^114
      const V inv = hn::Set(d, steps[i] > 0.0f ? 1.0f / steps[i] : 0.0f);
      V m = hn::Zero(d);
      for (size_t j = 0; j < jv; j += N) {
        const V pj = hn::Load(d, p + j);
        const V w = hn::Mul(hn::Mul(pj, hn::Load(d, scale + j)), inv);
        m = hn::MulAdd(pj, hn::Load(d, minimum + j), m);
        StoreWords(w, u + i * ldp + j);
      }
      mins[i] = hn::GetLane(hn::SumOfLanes(d, m));
    }
  }
  return true;
}

#if HWY_TARGET == HWY_AVX3
// The value pass over an int8 cache with AVX-512 VNNI, RT rows and the NV vectors of 16 columns
// from c0 (a multiple of 64: groups c0 / 32 and, for NV > 2, the next): O = alpha·O + mins +
// Σ_j step·u_j·code_j per group, on WordValueWeights's words u, steps and mins (a row's at +1, a
// group's at +ldg, words of a row ldu apart). Keys by pairs: the two keys' 32 bytes of a group
// interleaved (vpunpcklbw / vpunpckhbw) and widened to words, so that each 32-bit lane holds a
// column's two codes, and vpdpwssd adds the two products code × word into the column's lane: 32
// products per instruction and no conversion, where the float pass converts each code and
// dequantizes it before its FMAs. The interleave leaves a group's columns in the two sums as 0-7,
// 16-23 | 8-15, 24-31 (by 128-bit lanes: 0-3, 4-7, 16-19, 20-23); the flush puts them back in
// order. The sums stay exact in int32 over a block, then are converted and added into O in float,
// times the step, once.
template <size_t RT, size_t NV>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512vnni"))) void Int8OutputVnni(
    const int16_t* u, size_t ldu, size_t ldg, const QuantKv<8>::Row* vrows, size_t c0, size_t jn,
    const float* alpha, const float* mins, const float* steps, float* o, size_t ldo, LineStream& ahead) {
  static_assert(kCacheQuantGroup == 32 && NV <= 4, "a group is two vectors of 16 columns; two groups a pass");
  constexpr size_t NG = (NV + 1) / 2;  // groups of the pass
  ScaleAndAddMins<RT, NV>(DF(), alpha, mins, ldg, o, ldo);
  __m512i acc[RT][2 * NG];
  for (size_t r = 0; r < RT; ++r)
    for (size_t c = 0; c < 2 * NG; ++c) acc[r][c] = _mm512_setzero_si512();
  for (size_t j = 0; j < jn; j += 2) {  // u holds zeros from jn up to a whole vector
    ahead.Issue(kInt8VnniValueWork * 2 * RT * NV * 16);
    const uint8_t* p0 = QuantKv<8>::Columns(vrows[j], c0).codes;
    const uint8_t* p1 = QuantKv<8>::Columns(vrows[j + 1], c0).codes;  // vrows[jn]: weighted 0
    __m512i x[2 * NG];
    for (size_t g = 0; g < NG; ++g) {  // rows hold whole groups: 32 bytes each
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * g));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * g));
      x[2 * g] = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(a, b));
      x[2 * g + 1] = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(a, b));
    }
    for (size_t r = 0; r < RT; ++r)
      for (size_t g = 0; g < NG; ++g) {
        int32_t pair;
        std::memcpy(&pair, u + g * ldg * ldu + r * ldu + j, sizeof(pair));
        const __m512i wv = _mm512_set1_epi32(pair);
        acc[r][2 * g] = _mm512_dpwssd_epi32(acc[r][2 * g], x[2 * g], wv);
        acc[r][2 * g + 1] = _mm512_dpwssd_epi32(acc[r][2 * g + 1], x[2 * g + 1], wv);
      }
  }
  for (size_t r = 0; r < RT; ++r)
    for (size_t c = 0; c < NV; ++c) {
      const __m512i lo = acc[r][c / 2 * 2], hi = acc[r][c / 2 * 2 + 1];
      // Columns 0-15 of the group: 128-bit lanes 0, 1 of both sums; 16-31: lanes 2, 3.
      const __m512i sum = c % 2 == 0 ? _mm512_shuffle_i64x2(lo, hi, 0x44) : _mm512_shuffle_i64x2(lo, hi, 0xEE);
      float* out = o + r * ldo + c * 16;
      const __m512 st = _mm512_set1_ps(steps[c / 2 * ldg + r]);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), st, _mm512_loadu_ps(out)));
    }
}

#endif  // HWY_TARGET == HWY_AVX3

#if HWY_TARGET == HWY_AVX2
// The value pass over an int8 cache with AVX2's 16-bit integer products, RT rows and the columns
// [c0, c0 + ncols) of one group (ncols ≤ 32): O = alpha·O + mins + Σ_j step·u_j·code_j
// (WordValueWeights's words u, steps and mins of the rows; a row's at +ldu, +1). Keys in pairs:
// the two keys' 16 bytes of half a group, each widened to words as it is loaded (vpmovzxbw from
// memory), are merged by a shift and a word blend so that each 32-bit lane holds a column's two
// codes, the even columns in one vector and the odd in another; vpmaddwd multiplies them by the
// pair's two words and adds the products: 16 products and an add per instruction pair, where the
// float pass converts each code (two instructions per 8) and has one FMA per 8 products and row.
// (Interleaving the bytes first, then widening in registers, took 2 lane-crossing vpmovzxbw per
// key pair on the vector pipes: the int8 step at L = 2048, 1 thread, took ~3% longer.) Half a
// group at a time: 4 rows × 2 vectors of sums fit the 16 registers with the codes and a weight.
// The sums stay exact in int32 over a block (kWordPassKeys), then are converted, their even and
// odd columns joined back in order, and added into O in float, times the step, once.
template <size_t RT>
HWY_INLINE void Int8Output256(const int16_t* u, size_t ldu, const QuantKv<8>::Row* vrows, size_t c0, size_t ncols,
                              size_t jn, const float* alpha, const float* mins, const float* steps, float* o,
                              size_t ldo, LineStream& ahead) {
  static_assert(kCacheQuantGroup == 32, "a group is two halves of 16 columns");
  using VI = hn::Vec<hn::RebindToSigned<DF>>;
  const DF d;
  const size_t nv = (ncols + 7) / 8;
  ScaleAndAddGroupMins<RT>(d, alpha, mins, nv, o, ldo);
  for (size_t h = 0; h < nv; h += 2) {  // columns 8h .. 8h + 15
    __m256i acc[RT][2];
    for (size_t r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (size_t j = 0; j < jn; j += 2) {  // u holds zeros from jn up to a whole vector
      ahead.Issue(kAvx2IntWork * 2 * RT * 16);
      // Rows hold whole groups: 16 bytes from 8h are there. An odd last key pairs with itself
      // (vrows[jn]), weighted by u[jn] = 0.
      const uint8_t* pa = QuantKv<8>::Columns(vrows[j], c0).codes + 8 * h;
      const uint8_t* pb = QuantKv<8>::Columns(vrows[j + 1], c0).codes + 8 * h;
      const __m256i wa = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pa)));
      const __m256i wb = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb)));
      const __m256i x0 = _mm256_blend_epi16(wa, _mm256_slli_epi32(wb, 16), 0xAA);  // columns 0, 2 .. 14: (a, b)
      const __m256i x1 = _mm256_blend_epi16(_mm256_srli_epi32(wa, 16), wb, 0xAA);  // columns 1, 3 .. 15
      for (size_t r = 0; r < RT; ++r) {
        int32_t pair;
        std::memcpy(&pair, u + r * ldu + j, sizeof(pair));
        const __m256i wv = _mm256_set1_epi32(pair);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(x0, wv));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(x1, wv));
      }
    }
    for (size_t r = 0; r < RT; ++r) {
      hn::Vec<DF> sum[2];  // the even and odd columns joined: columns 0-7 and 8-15
      JoinedPairs(d, hn::ConvertTo(d, VI{acc[r][0]}), hn::ConvertTo(d, VI{acc[r][1]}), sum[0], sum[1]);
      for (size_t v = h; v < std::min(nv, h + 2); ++v) {
        float* out = o + r * ldo + v * 8;
        hn::StoreU(hn::MulAdd(sum[v - h], hn::Set(d, steps[r]), hn::LoadU(d, out)), d, out);
      }
    }
  }
}
#endif  // HWY_TARGET == HWY_AVX2

// This target's word value pass (Int8Output256 or Int8OutputVnni) for RT rows and the columns
// [c0, c0 + ncols) of a pass of kOutVecs vectors; a group's words, steps and mins ldg rows apart.
template <size_t RT>
HWY_INLINE void Int8WordPass(const int16_t* u, size_t ldu, size_t ldg, const QuantKv<8>::Row* vrows, size_t c0,
                             size_t ncols, size_t jn, const float* alpha, const float* mins, const float* steps,
                             float* o, size_t ldo, LineStream& ahead) {
#if HWY_TARGET == HWY_AVX2
  (void)ldg;  // one group a pass
  Int8Output256<RT>(u, ldu, vrows, c0, ncols, jn, alpha, mins, steps, o, ldo, ahead);
#else  // AVX3: two groups a pass
  WithPassVectors((ncols + 15) / 16, [&](auto nv) {
    Int8OutputVnni<RT, decltype(nv)::value>(u, ldu, ldg, vrows, c0, jn, alpha, mins, steps, o, ldo, ahead);
  });
#endif
}

#define MHA_DECODE_WORD_VALUES 1
#else
#define MHA_DECODE_WORD_VALUES 0
#endif

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_INT8_VALUES_INL_H_
