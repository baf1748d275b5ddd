// What the decode kernel's value passes over int8/int4 values (flash_decode.cc) share: a block's
// value scales staged as float32 in key order (StageValueScales), their maxima (ValueScaleMaxima)
// and the power-of-two steps (PowerOfTwoAtOrAbove) of the integer passes' weights
// (decode_int8_values-inl.h, decode_int4_values-inl.h), where those passes start
// (ScaleAndAddMins, ScaleAndAddGroupMins), and the folded float pass's weights on AVX2
// (FoldValueWeights, read by DecodeOutput in decode_block-inl.h). Kv: how K and V are stored
// (decode_kv-inl.h).
#if defined(MHA_KERNELS_CPU_DECODE_VALUE_SCALES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_DECODE_VALUE_SCALES_INL_H_
#undef MHA_KERNELS_CPU_DECODE_VALUE_SCALES_INL_H_
#else
#define MHA_KERNELS_CPU_DECODE_VALUE_SCALES_INL_H_
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "kernels/cpu/decode_kv-inl.h"
#include "mha/kv_cache.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace decode {

// A block's value scales (keys j < jn from vrows, the block's first at a multiple of N) into st
// as float32: 2·groups rows of ldp floats, group g's scale of key j at st[2g·ldp + j] and its
// minimum at st[(2g + 1)·ldp + j], zeros past jn up to a whole vector, which the weights'
// products then read by vectors. The scale words lie by tiles of kCacheKeyTile rows (kv_cache.h):
// N keys from a multiple of N share a tile (N divides it), so a word of theirs is N adjacent
// words, one load (rows took transposes: docs/benchmarks.md).
template <class Kv>
HWY_INLINE void StageValueScales(DF d, size_t ldp, const typename Kv::Row* vrows, size_t jn, size_t groups,
                                 float* HWY_RESTRICT st) {
  const size_t N = hn::Lanes(d);
  for (size_t x0 = 0; x0 < jn; x0 += N) {
    const uint32_t* at = vrows[x0].scales;  // lane x0 % kCacheKeyTile of its tile: a multiple of N
    const auto keep = hn::FirstN(d, jn - x0);
    for (size_t g = 0; g < groups; ++g) {
      hn::Vec<DF> step, lo;
      GroupScales<Kv::kCodeBits>(d, at, g, 0, step, lo);
      hn::Store(hn::IfThenElseZero(keep, step), d, st + 2 * g * ldp + x0);
      hn::Store(hn::IfThenElseZero(keep, lo), d, st + (2 * g + 1) * ldp + x0);
    }
  }
}

// For the integer value passes' weights (ByteValueWeights, WordValueWeights): smax[g] = the
// largest scale of group g in st (StageValueScales's rows, keys j < jv, a multiple of
// Lanes(d)); false where a scale is negative or not finite, or a minimum not finite.
template <class D>
HWY_INLINE bool ValueScaleMaxima(D d, const float* st, size_t ldp, size_t jv, size_t groups, float* smax) {
  using V = hn::Vec<D>;
  for (size_t g = 0; g < groups; ++g) {
    const float* scale = st + 2 * g * ldp;
    V top = hn::Zero(d);
    auto ok = hn::Eq(top, top);
    for (size_t j = 0; j < jv; j += hn::Lanes(d)) {
      const V x = hn::Load(d, scale + j);
      ok = hn::And(ok, hn::And(hn::Ge(x, hn::Zero(d)), hn::IsFinite(hn::Load(d, scale + ldp + j))));
      top = hn::Max(top, x);
    }
    smax[g] = hn::GetLane(hn::MaxOfLanes(d, top));
    if (!hn::AllTrue(d, ok) || !std::isfinite(smax[g])) return false;
  }
  return true;
}

// The power of two at or above a finite bound ≥ 0: the exponent's next step unless the mantissa
// is 0 (a subnormal bound gives 2^-126, 0 gives 0). The integer passes' weight steps: w / step
// is then exact.
inline float PowerOfTwoAtOrAbove(float bound) {
  uint32_t bits;
  std::memcpy(&bits, &bound, sizeof bits);
  bits = (bits + 0x007FFFFFu) & 0xFF800000u;
  float step;
  std::memcpy(&step, &bits, sizeof step);
  return step;
}

// O = alpha·O + mins for RT rows and NV vectors of columns (a group's mins at +ldg, the rows' at
// +1): where the AVX3 integer value passes (Int4OutputVnni, Int8OutputVnni) start.
template <size_t RT, size_t NV>
HWY_INLINE void ScaleAndAddMins(DF d, const float* alpha, const float* mins, size_t ldg, float* o, size_t ldo) {
  const size_t N = hn::Lanes(d), group_vecs = static_cast<size_t>(kCacheQuantGroup) / N;
  for (size_t r = 0; r < RT; ++r) {
    const auto a = hn::Set(d, alpha[r]);
    for (size_t c = 0; c < NV; ++c) {
      float* out = o + r * ldo + c * N;
      hn::StoreU(hn::MulAdd(hn::LoadU(d, out), a, hn::Set(d, mins[c / group_vecs * ldg + r])), d, out);
    }
  }
}

// The same for nv vectors (at run time) of one group's columns: where the AVX2 integer value
// passes (Int4Output256, Int8Output256) start.
template <size_t RT>
HWY_INLINE void ScaleAndAddGroupMins(DF d, const float* alpha, const float* mins, size_t nv, float* o, size_t ldo) {
  const size_t N = hn::Lanes(d);
  for (size_t r = 0; r < RT; ++r) {
    const auto a = hn::Set(d, alpha[r]), m = hn::Set(d, mins[r]);
    for (size_t c = 0; c < nv; ++c) {
      float* out = o + r * ldo + c * N;
      hn::StoreU(hn::MulAdd(hn::LoadU(d, out), a, m), d, out);
    }
  }
}

// The weights of a folded value pass over int8/int4 values: P·(scale·code + minimum) =
// (P·scale)·code + P·minimum per group, so that the pass needs one FMA per value and row where
// dequantizing took one more per value and row group (measured on the cache-resident int8 step:
// docs/benchmarks.md). For rows r < R, value groups g < groups and the block's keys j < jn:
// w[(g·R + r)·ldp + j] = P[r][j]·scale_g(j), and mins[g·R + r] = Σ_j P[r][j]·minimum_g(j) (N keys
// in the lanes, then across them: a fixed order), on the scales staged into st
// (StageValueScales).
template <class Kv>
HWY_INLINE void FoldValueWeights(DF d, const float* pr, size_t ldp, size_t R, const typename Kv::Row* vrows, size_t jn,
                                 size_t groups, float* HWY_RESTRICT st, float* HWY_RESTRICT w,
                                 float* HWY_RESTRICT mins) {
  using V = hn::Vec<DF>;
  const size_t N = hn::Lanes(d), jv = (jn + N - 1) / N * N;
  StageValueScales<Kv>(d, ldp, vrows, jn, groups, st);
  for (size_t g = 0; g < groups; ++g) {
    const float* scale = st + 2 * g * ldp;
    const float* minimum = scale + ldp;
    for (size_t r = 0; r < R; ++r) {
      const float* p = pr + r * ldp;
      float* wr = w + (g * R + r) * ldp;
      V m = hn::Zero(d);
      for (size_t j = 0; j < jv; j += N) {
        const V pj = hn::Load(d, p + j);
        hn::Store(hn::Mul(pj, hn::Load(d, scale + j)), d, wr + j);
        m = hn::MulAdd(pj, hn::Load(d, minimum + j), m);
      }
      mins[g * R + r] = hn::GetLane(hn::SumOfLanes(d, m));
    }
  }
}

}  // namespace decode
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_DECODE_VALUE_SCALES_INL_H_
