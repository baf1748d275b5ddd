// The value passes of the decode kernel (flash_decode.cc) over an int4 cache with integer or
// bfloat16 dot products: on weights rounded to bytes by ByteValueWeights, with AVX2's vpmaddubsw
// (Int4Output256, AVX2 target) or AVX-512 VNNI's vpdpbusd (Int4OutputVnni, AVX3 target where the
// CPU has VNNI and VBMI: decode_vnni_byte_values()), else with bfloat16 dot products on P rounded
// by PairWeights (decode_bf16_values-inl.h; Int4Output, AVX3 target where the CPU has AVX-512
// BF16). The float pass (DecodeOutput) dequantizes every value in registers; these take two or
// four keys' products per lane and instruction: docs/ARCHITECTURE.md. The AVX-512 ones are
// intrinsics in functions compiled for those features on top of the AVX3 target's flags, as
// decode_quant-inl.h's are.
// MHA_DECODE_BYTE_VALUES says whether this target has ByteValueWeights.
#if defined(MHA_KERNELS_CPU_DECODE_INT4_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_INT4_VALUES_INL_H_
#undef MHA_KERNELS_CPU_DECODE_INT4_VALUES_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_INT4_VALUES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "kernels/cpu/decode_bf16_values-inl.h"
#include "kernels/cpu/decode_block-inl.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "kernels/cpu/decode_value_scales-inl.h"
#include "kernels/cpu/prefetch.h"
#include "mha/kv_cache.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

#undef MHA_DECODE_BYTE_VALUES
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3
// The weights of Int4Output256 and Int4OutputVnni for rows r < R (P at pr + r·ldp, the block's keys
// j < jn) and value groups g < groups: w_j = P_j·scale_g(j) rounded to a byte, u_j = round(w_j /
// step) with step the power of two at or above Pmax_r·Smax_g / 255 (Pmax_r: the row's largest P in
// the block, from the softmax; Smax_g: the keys' largest scale in the group), so that no weight
// passes 255 steps (Pmax_r·Smax_g would take 128 to 255): u[(g·R + r)·ldp + j] (zeros from jn up to
// a whole vector), steps[g·R + r]. A power of two keeps w / step exact, so weights of 1 and 0, or
// all equal, are exact bytes. mins[g·R + r] = Σ_j P_j·(minimum_g(j) + 8·scale_g(j)), for the pass
// multiplies each u_j by code − 8. The keys' scales are first staged into st
// (StageValueScales). False where a Pmax is not finite, or a scale is negative or a scale or
// minimum not finite: the float pass then takes the block. steps needs groups · (R + 1).
template <class Kv>
HWY_INLINE bool ByteValueWeights(DF d, const float* pr, size_t ldp, size_t R, const float* pmax,
                                 const typename Kv::Row* vrows, size_t jn, size_t groups, float* HWY_RESTRICT st,
                                 uint8_t* HWY_RESTRICT u, float* steps, float* mins) {
  for (size_t r = 0; r < R; ++r)
    if (!std::isfinite(pmax[r])) return false;
  StageValueScales<Kv>(d, ldp, vrows, jn, groups, st);
  // 256-bit vectors on both targets (AVX2's packs and permutes below).
  const hn::Full256<float> d8;
  using V = hn::Vec<decltype(d8)>;
  const size_t N = hn::Lanes(d8), jv = (jn + N - 1) / N * N;
  float* smax = steps + groups * R;
  if (!ValueScaleMaxima(d8, st, ldp, jv, groups, smax)) return false;  // before any weight is written
  // Bytes 0-3 of each 128-bit half after the packs: keys 0-3, 8-11 | 4-7, 12-15 (words), then
  // 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31 (bytes): dwords 0, 4, 1, 5, 2, 6, 3, 7 in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (size_t g = 0; g < groups; ++g) {
    const float* scale = st + 2 * g * ldp;
    float* mid = st + (2 * g + 1) * ldp;
    for (size_t j = 0; j < jv; j += N)  // minimum + 8·scale
      hn::Store(hn::MulAdd(hn::Load(d8, scale + j), hn::Set(d8, 8.0f), hn::Load(d8, mid + j)), d8, mid + j);
    for (size_t r = 0; r < R; ++r) {
      const float* p = pr + r * ldp;
      const size_t i = g * R + r;
      steps[i] = PowerOfTwoAtOrAbove(pmax[r] * (smax[g] / 255.0f));  // finite, below 2^122
      const V inv = hn::Set(d8, steps[i] > 0.0f ? 1.0f / steps[i] : 0.0f);
      for (size_t j = 0; j < jv; j += 4 * N) {  // a last part may read past jv: its bytes are never used
        __m256i c[4];
        for (size_t k = 0; k < 4; ++k) {
          const V w = hn::Mul(hn::Load(d8, p + j + k * N), hn::Load(d8, scale + j + k * N));
          c[k] = _mm256_cvtps_epi32(hn::Mul(w, inv).raw);
        }
        const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + i * ldp + j), _mm256_permutevar8x32_epi32(b, order));
      }
    }
  }
  // mins: each row against 4 groups' mid rows at a time (4 independent sums), then the 4 sums
  // reduced together.
  for (size_t r = 0; r < R; ++r) {
    const float* p = pr + r * ldp;
    for (size_t g0 = 0; g0 < groups; g0 += 4) {
      const size_t ng = std::min<size_t>(4, groups - g0);
      __m256 m[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (size_t j = 0; j < jv; j += N) {
        const __m256 x = _mm256_loadu_ps(p + j);
        for (size_t k = 0; k < 4; ++k)
          if (k < ng) m[k] = _mm256_fmadd_ps(x, _mm256_loadu_ps(st + (2 * (g0 + k) + 1) * ldp + j), m[k]);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(m[0], m[1]), _mm256_hadd_ps(m[2], m[3]));
      float sums[4];
      _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      for (size_t k = 0; k < ng; ++k) mins[(g0 + k) * R + r] = sums[k];
    }
  }
  return true;
}

#define MHA_DECODE_BYTE_VALUES 1
#else
#define MHA_DECODE_BYTE_VALUES 0
#endif

#if HWY_TARGET == HWY_AVX2
// The value pass over an int4 cache with AVX2's 8-bit integer products, RT rows and the columns
// [c0, c0 + ncols) of one group (ncols ≤ 32): O = alpha·O + mins + Σ_j step·u_j·(code_j − 8)
// (ByteValueWeights's bytes u, steps and mins of the rows). Keys in pairs: the two keys' 16 bytes
// of the group interleaved, so that each 16-bit lane holds a column's two codes (low nibbles:
// columns 0-15, high: 16-31), and vpmaddubsw multiplies them by the pair's two weights and adds
// the products: 32 products per instruction, where an FMA has 8. The 16-bit sums take 8 pairs:
// |Σ| ≤ 16·255·8 = 32640, then are widened and added into O in float, times the step.
template <size_t RT, bool kWhole>
HWY_INLINE void Int4Output256(const uint8_t* u, size_t ldu, const QuantKv<4>::Row* vrows,
                              size_t c0, size_t ncols, size_t jn, const float* alpha, const float* mins,
                              const float* steps, float* o, size_t ldo, LineStream& ahead) {
  const size_t nv = kWhole ? 4 : (ncols + 7) / 8;
  ScaleAndAddGroupMins<RT>(DF(), alpha, mins, nv, o, ldo);
  const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  // Key pairs [j, j1) into the rows' 16-bit sums.
  auto add_pairs = [&](size_t j, size_t j1, __m256i* lo, __m256i* hi) HWY_ATTR {
    for (; j < j1; j += 2) {
      ahead.Issue(kAvx2IntWork * 2 * RT * ncols);
      // An odd last key pairs with itself (vrows[jn]), weighted by u[jn] = 0.
      const __m128i xa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(QuantKv<4>::Columns(vrows[j], c0).codes));
      const __m128i xb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(QuantKv<4>::Columns(vrows[j + 1], c0).codes));
      const __m256i x = _mm256_set_m128i(_mm_unpackhi_epi8(xa, xb), _mm_unpacklo_epi8(xa, xb));
      const __m256i cl = _mm256_sub_epi8(_mm256_and_si256(x, nibble), eight);
      const __m256i ch = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), nibble), eight);
      for (size_t r = 0; r < RT; ++r) {
        int16_t pair;
        std::memcpy(&pair, u + r * ldu + j, sizeof(pair));
        const __m256i wv = _mm256_set1_epi16(pair);
        lo[r] = _mm256_add_epi16(_mm256_maddubs_epi16(wv, cl), lo[r]);
        hi[r] = _mm256_add_epi16(_mm256_maddubs_epi16(wv, ch), hi[r]);
      }
    }
  };
  for (size_t j0 = 0; j0 < jn; j0 += 16) {
    __m256i lo[RT], hi[RT];
    for (size_t r = 0; r < RT; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    add_pairs(j0, std::min(jn, j0 + 16), lo, hi);
    for (size_t r = 0; r < RT; ++r) {
      const __m256 st = _mm256_set1_ps(steps[r]);
      float* out = o + r * ldo;
      const __m256i s32[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo[r])),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo[r], 1)),
                              _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi[r])),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi[r], 1))};
      for (size_t v = 0; v < nv; ++v)
        _mm256_storeu_ps(out + v * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[v]), st, _mm256_loadu_ps(out + v * 8)));
    }
  }
}
#endif

#if HWY_TARGET == HWY_AVX3
// The value pass over an int4 cache with bfloat16 dot products (AVX-512 BF16, checked at run
// time): keys in pairs (j, j + 1), so that one vdpbf16ps adds P_j·V_j[c] + P_{j+1}·V_{j+1}[c]
// to column c's lane, 32 products per instruction where the float pass has 16 and a dequantizing
// FMA. P comes as bfloat16 pairs (PairWeights: the dword jp of a row holds P[2jp], P[2jp + 1]).
// The values come from a table per group and key pair: the 16 values min + scale·code of key
// j, then of key j + 1, as bfloat16 (32 words); vpermw picks each lane's word by its 4-bit code,
// plus 16 for key j + 1. Each rounding to bfloat16 (nearest even) moves its factor by at most
// 2^-8 of it, a product by at most 2^-7 (docs/numerics.md); the sums stay float32.
template <size_t RG, size_t NV>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) void Int4Output(
    const uint32_t* pw, size_t ldw, const QuantKv<4>::Row* vrows, size_t c0, size_t jn,
    const float* alpha, float* o, size_t ldo, LineStream& ahead) {
  static_assert(kCacheQuantGroup == 32, "a group is two vectors of 16 columns");
  constexpr size_t NG = (NV + 1) / 2;  // groups of the pass
  __m512 acc[RG][NV];
  for (size_t r = 0; r < RG; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (size_t c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + c * 16), a);
  }
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i second = _mm512_set1_epi32(0x00100000);  // word 2i + 1: key j + 1's half of the table
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  for (size_t j = 0; j < jn; j += 2) {
    // An odd last key pairs with itself (vrows[jn]), weighted by P[jn] = 0 (masked: keys past jn
    // are -inf).
    const QuantKv<4>::Row a = QuantKv<4>::Columns(vrows[j], c0);
    const QuantKv<4>::Row b = QuantKv<4>::Columns(vrows[j + 1], c0);
    ahead.Issue(kFloatWork * 2 * RG * NV * 16);
    for (size_t g = 0; g < NG; ++g) {
      const __m512 ta = _mm512_fmadd_ps(iota, _mm512_set1_ps(a.scale(2 * g)), _mm512_set1_ps(a.scale(2 * g + 1)));
      const __m512 tb = _mm512_fmadd_ps(iota, _mm512_set1_ps(b.scale(2 * g)), _mm512_set1_ps(b.scale(2 * g + 1)));
      const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(tb, ta));  // words 0-15: key j's
      // Byte i of a group's 16 holds column i (low nibble) and i + 16 (high): key j's bytes in the
      // low words of dwords, key j + 1's in the high.
      const __m512i w = _mm512_or_si512(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.codes + g * 16))),
          _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.codes + g * 16))),
                            16));
      const __m512i lo = _mm512_ternarylogic_epi32(w, nibble, second, 0xEA);  // (w & nibble) | second
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(w, 4), second);   // vpermw reads bits 0-4
      const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(lo, table));
      const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(hi, table));
      for (size_t r = 0; r < RG; ++r) {
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pw[r * ldw + j / 2])));
        acc[r][2 * g] = _mm512_dpbf16_ps(acc[r][2 * g], x0, p);
        if (2 * g + 1 < NV) acc[r][2 * g + 1] = _mm512_dpbf16_ps(acc[r][2 * g + 1], x1, p);
      }
    }
  }
  for (size_t r = 0; r < RG; ++r)
    for (size_t c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * ldo + c * 16, acc[r][c]);
}

// The value pass over an int4 cache with AVX-512 VNNI, RT rows and the NV vectors of 16 columns
// from c0 (a multiple of 64: groups c0 / 32 and, for NV > 2, the next): O = alpha·O + mins +
// Σ_j step·u_j·(code_j − 8) per group, on ByteValueWeights's bytes u, steps and mins (a row's
// at +1, a group's at +ldg, bytes of a row ldu apart; vrows[jn .. jn + 2] the last row again, the
// partners of the last keys, weighted 0). Keys by fours: vpermt2b (AVX-512 VBMI)
// gathers the four keys' bytes of a column pair into a dword, and vpdpbusd adds the four products
// weight × (code − 8) into the column's 32-bit lane: 64 products per instruction, where the
// bfloat16 pass has 32 (and vdpbf16ps ran at a quarter of the FMAs' rate on the Xeon that
// measured this, docs/benchmarks.md). The sums stay exact in int32 over a block (|Σ| ≤ 255·8
// per key), then are converted and added into O in float, times the step, once.
template <size_t RT, size_t NV>
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512vnni,avx512vbmi"))) void Int4OutputVnni(
    const uint8_t* u, size_t ldu, size_t ldg, const QuantKv<4>::Row* vrows, size_t c0,
    size_t jn, const float* alpha, const float* mins, const float* steps, float* o, size_t ldo, LineStream& ahead) {
  static_assert(kCacheQuantGroup == 32 && NV <= 4, "a group is two vectors of 16 columns; two groups a pass");
  constexpr size_t NG = (NV + 1) / 2;  // groups of the pass
  ScaleAndAddMins<RT, NV>(DF(), alpha, mins, ldg, o, ldo);
  // The four keys' 32 bytes (two groups) as [key 0 | key 1] and [key 2 | key 3]; dword i of the
  // gathers holds byte i (first) or 16 + i (second) of keys 0-3. Byte i of a group holds its
  // column i (low nibble) and i + 16 (high).
  __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
  {
    alignas(64) uint8_t idx[2][64];
    for (int i = 0; i < 16; ++i)
      for (int k = 0; k < 4; ++k) {
        idx[0][4 * i + k] = static_cast<uint8_t>(32 * k + i);
        idx[1][4 * i + k] = static_cast<uint8_t>(32 * k + 16 + i);
      }
    first = _mm512_load_si512(idx[0]);
    second = _mm512_load_si512(idx[1]);
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  __m512i acc[RT][NV];
  for (size_t r = 0; r < RT; ++r)
    for (size_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_si512();
  auto load = [&](size_t j) HWY_ATTR {  // key j's bytes of the pass (vrows past jn: the last, weighted 0)
    const uint8_t* p = QuantKv<4>::Columns(vrows[j], c0).codes;
    if constexpr (NG == 2) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  for (size_t j = 0; j < jn; j += 4) {  // u holds zeros from jn up to a multiple of 8
    ahead.Issue(kInt4VnniValueWork * 4 * RT * NV * 16);
    const __m512i k01 = _mm512_inserti64x4(_mm512_castsi256_si512(load(j)), load(j + 1), 1);
    const __m512i k23 = _mm512_inserti64x4(_mm512_castsi256_si512(load(j + 2)), load(j + 3), 1);
    __m512i x[2 * NG];
    for (size_t g = 0; g < NG; ++g) {
      const __m512i w = _mm512_permutex2var_epi8(k01, g == 0 ? first : second, k23);
      x[2 * g] = _mm512_sub_epi8(_mm512_and_si512(w, nibble), eight);
      x[2 * g + 1] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(w, 4), nibble), eight);
    }
    for (size_t r = 0; r < RT; ++r)
      for (size_t g = 0; g < NG; ++g) {
        int32_t quad;
        std::memcpy(&quad, u + g * ldg * ldu + r * ldu + j, sizeof(quad));
        const __m512i wv = _mm512_set1_epi32(quad);
        acc[r][2 * g] = _mm512_dpbusd_epi32(acc[r][2 * g], wv, x[2 * g]);
        if (2 * g + 1 < NV) acc[r][2 * g + 1] = _mm512_dpbusd_epi32(acc[r][2 * g + 1], wv, x[2 * g + 1]);
      }
  }
  for (size_t r = 0; r < RT; ++r)
    for (size_t c = 0; c < NV; ++c) {
      float* out = o + r * ldo + c * 16;
      const __m512 st = _mm512_set1_ps(steps[c / 2 * ldg + r]);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), st, _mm512_loadu_ps(out)));
    }
}
#endif

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_INT4_VALUES_INL_H_
