// The value pass of the decode kernel (flash_decode.cc) over a bfloat16 cache with bfloat16 dot
// products (Bf16Output, AVX3 target, where the CPU has AVX-512 BF16 and runs vdpbf16ps at the
// FMAs' instruction rate: decode_bf16_values()), and the weights it and the int4 pass Int4Output
// read (PairWeights). The float pass (DecodeOutput) widens each value and spends a row's FMA on
// 16 products; vdpbf16ps takes two keys' products per lane, 32 per instruction, on P rounded to
// bfloat16: docs/ARCHITECTURE.md. Intrinsics in functions compiled for AVX-512 BF16 on top of the
// AVX3 target's flags, as decode_quant-inl.h's are.
#if defined(MHA_KERNELS_CPU_DECODE_BF16_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_BF16_VALUES_INL_H_
#undef MHA_KERNELS_CPU_DECODE_BF16_VALUES_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_BF16_VALUES_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/cpu/decode_block-inl.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/prefetch.h"
#include "mha/half.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

#if HWY_TARGET == HWY_AVX3
// The rows' P (R rows of `block` floats, block a multiple of 32) as bfloat16, rounded to
// nearest even, in order: dword jp of a row holds P[2jp] (low half) and P[2jp + 1].
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) inline void PairWeights(const float* s, int64_t R,
                                                                                  size_t block, uint32_t* pw) {
  for (int64_t r = 0; r < R; ++r)
    for (size_t k = 0; k < block; k += 32) {
      const float* x = s + r * static_cast<int64_t>(block) + k;
      const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
      _mm512_storeu_si512(pw + r * static_cast<int64_t>(block / 2) + k / 2, reinterpret_cast<__m512i>(p));
    }
}

// O[r][c0 .. c0 + 16·NV) = alpha[r]·O + Σ_{j < jn} P[r][j]·V_j[c] for rows r < RG, V_j = vrows[j]
// (bfloat16), P as PairWeights's pairs (a row's at r·ldw). Keys by pairs (j, j + 1): the two
// keys' 32 columns interleaved by words (vpunpcklwd / vpunpckhwd), so that each 32-bit lane holds
// a column's two values and one vdpbf16ps adds P_j·V_j[c] + P_{j+1}·V_{j+1}[c] into the column's
// float32 lane. The interleave leaves 32 columns in two sums as 0-3, 8-11, 16-19, 24-27 | 4-7,
// 12-15, 20-23, 28-31 (by 128-bit lanes); the flush puts them back in order. The block's sums
// start at 0 and are added to alpha·O at the end (the float pass adds each product to alpha·O
// in turn). An odd last key pairs with vrows[jn] (the last row again), weighted by P[jn] = 0.
// vdpbf16ps takes denormal inputs as zero and flushes denormal results. Returns false, O
// unchanged, where a sum is not finite: a weight of 0 (the partner of an odd last key, or a key a
// row does not see) times an infinite or NaN value is NaN where the float pass skips it, so the
// caller takes the float pass for these rows and columns.
template <size_t RG, size_t NV>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) bool Bf16Output(const uint32_t* pw, size_t ldw,
                                                                          const bfloat16* const* vrows, size_t c0,
                                                                          size_t jn, const float* alpha, float* o,
                                                                          size_t ldo, LineStream& ahead) {
  static_assert(NV % 2 == 0, "32 columns of both keys interleave into two vectors");
  __m512 acc[RG][NV];
  for (size_t r = 0; r < RG; ++r)
    for (size_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (size_t j = 0; j < jn; j += 2) {
    ahead.Issue(kFloatWork * 2 * RG * NV * 16);
    const bfloat16* a = vrows[j] + c0;
    const bfloat16* b = vrows[j + 1] + c0;
    __m512bh x[NV];
    for (size_t c = 0; c < NV; c += 2) {
      const __m512i va = _mm512_loadu_si512(a + 16 * c), vb = _mm512_loadu_si512(b + 16 * c);
      x[c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(va, vb));
      x[c + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(va, vb));
    }
    for (size_t r = 0; r < RG; ++r) {
      const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[r * ldw + j / 2])));
      for (size_t c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x[c], p);
    }
  }
  __mmask16 bad = 0;
  for (size_t r = 0; r < RG; ++r)
    for (size_t c = 0; c < NV; ++c) bad |= NotFinite(acc[r][c]);
  if (bad != 0) return false;
  // Columns 0-15 of 32: 128-bit lanes 0 and 1 of the low sums (0-3, 8-11) and of the high (4-7, 12-15).
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (size_t r = 0; r < RG; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (size_t c = 0; c < NV; c += 2) {
      float* out = o + r * ldo + 16 * c;
      const __m512 lo = _mm512_permutex2var_ps(acc[r][c], first, acc[r][c + 1]);
      const __m512 hi = _mm512_permutex2var_ps(acc[r][c], second, acc[r][c + 1]);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), al, lo));
      _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_loadu_ps(out + 16), al, hi));
    }
  }
  return true;
}

// Whether a value pass over Dv columns (passes of kOutVecs vectors, DecodeOutputCols's) has a
// multiple of 32 columns, which Bf16OutputCols takes: if none has, PairWeights is not needed.
inline bool Bf16Passes(size_t Dv) {
  static_assert(kOutVecs * 16 % 32 == 0, "a whole pass is a multiple of 32 columns");
  return Dv >= kOutVecs * 16 || Dv % 32 == 0;
}

// Bf16Output for the rg rows of a pass (ForRowGroups's) of nc columns from c0 (DecodeOutputCols's):
// true if it took them; false, O unchanged, where nc is not a multiple of 32 or a sum is not
// finite, and the float pass then takes them.
inline bool Bf16OutputCols(size_t rg, const uint32_t* pw, size_t ldw, const bfloat16* const* vrows, size_t c0,
                           size_t nc, size_t jn, const float* alpha, float* o, size_t ldo, LineStream& ahead) {
  if (nc % 32 != 0) return false;
  bool done = false;
  WithRowGroup(rg, [&](auto g) {
    WithPassVectors(nc / 16, [&](auto nv) {
      constexpr size_t NV = decltype(nv)::value;
      if constexpr (NV % 2 == 0) {
        done = Bf16Output<decltype(g)::value, NV>(pw, ldw, vrows, c0, jn, alpha, o, ldo, ahead);
      }
    });
  });
  return done;
}
#endif  // HWY_TARGET == HWY_AVX3

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_BF16_VALUES_INL_H_
