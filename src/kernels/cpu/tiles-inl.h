// Register-tiled micro-kernels of the fast attention kernels, in the "lanes = query rows"
// layout (as gemma.cpp's flash attention): the tiles are stored transposed, one SIMD vector
// holding N query rows, so K and V are read in their natural row layout by scalar broadcasts
// (never packed or transposed) and the softmax needs no horizontal reductions.
//
//   Qt (D  × M)   query rows, pre-scaled by scale·log2(e)      M = rows of the task, padded to N
//   St (Bk × M)   scores, then probabilities, of one key block
//   Ot (Dv × M)   the output accumulator
//
//   QkTile:  St[j][r]  = Σ_d K[j][d] · Qt[d][r]                   (KR keys × RV row vectors)
//   PvTile:  Ot[c][r]  = alpha[r] · Ot[c][r] + Σ_j V[j][c] · St[j][r]   (CR columns × RV row vectors)
//
// KR·RV (or CR·RV) accumulators stay in registers; each FMA takes one broadcast operand.
#if defined(MHA_KERNELS_CPU_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_TILES_INL_H_
#undef MHA_KERNELS_CPU_TILES_INL_H_
#else
#define MHA_KERNELS_CPU_TILES_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// St[kr][rv] for keys krows[0..KR) (each a row of D values, element stride kd: 1 when kUnit)
// and row vectors rv0..rv0+RV of Qt (row stride ldq). St row stride lds.
template <size_t KR, size_t RV, bool kUnit, class D>
HWY_INLINE void QkTile(D d, const float* HWY_RESTRICT qt, size_t ldq, const float* const* krows, int64_t kd,
                       size_t depth, float* HWY_RESTRICT st, size_t lds) {
  using V = hn::Vec<D>;
  const size_t N = hn::Lanes(d);
  V acc[KR][RV];
  for (size_t kr = 0; kr < KR; ++kr)
    for (size_t rv = 0; rv < RV; ++rv) acc[kr][rv] = hn::Zero(d);
  const float* k[KR];
  for (size_t kr = 0; kr < KR; ++kr) k[kr] = krows[kr];
  for (size_t dd = 0; dd < depth; ++dd) {
    V q[RV];
    for (size_t rv = 0; rv < RV; ++rv) q[rv] = hn::Load(d, qt + dd * ldq + rv * N);
    for (size_t kr = 0; kr < KR; ++kr) {
      const V kb = hn::Set(d, kUnit ? k[kr][dd] : k[kr][static_cast<int64_t>(dd) * kd]);
      for (size_t rv = 0; rv < RV; ++rv) acc[kr][rv] = hn::MulAdd(kb, q[rv], acc[kr][rv]);
    }
  }
  for (size_t kr = 0; kr < KR; ++kr)
    for (size_t rv = 0; rv < RV; ++rv) hn::Store(acc[kr][rv], d, st + kr * lds + rv * N);
}

// Ot[c][rv] = alpha[rv] · Ot[c][rv] + Σ_{j < jn} v[j·vs + c·vd] · St[j][rv], for CR columns and
// RV row vectors. v points at column c0 of the block's first key.
template <size_t CR, size_t RV, bool kUnit, class D>
HWY_INLINE void PvTile(D d, const float* HWY_RESTRICT st, size_t lds, const float* HWY_RESTRICT v, int64_t vs,
                       int64_t vd, size_t jn, const float* HWY_RESTRICT alpha, float* HWY_RESTRICT ot,
                       size_t ldo) {
  using V = hn::Vec<D>;
  const size_t N = hn::Lanes(d);
  V acc[CR][RV];
  for (size_t rv = 0; rv < RV; ++rv) {
    const V a = hn::Load(d, alpha + rv * N);
    for (size_t c = 0; c < CR; ++c) acc[c][rv] = hn::Mul(hn::Load(d, ot + c * ldo + rv * N), a);
  }
  for (size_t j = 0; j < jn; ++j) {
    V p[RV];
    for (size_t rv = 0; rv < RV; ++rv) p[rv] = hn::Load(d, st + j * lds + rv * N);
    const float* vj = v + static_cast<int64_t>(j) * vs;
    for (size_t c = 0; c < CR; ++c) {
      const V vb = hn::Set(d, kUnit ? vj[c] : vj[static_cast<int64_t>(c) * vd]);
      for (size_t rv = 0; rv < RV; ++rv) acc[c][rv] = hn::MulAdd(vb, p[rv], acc[c][rv]);
    }
  }
  for (size_t c = 0; c < CR; ++c)
    for (size_t rv = 0; rv < RV; ++rv) hn::Store(acc[c][rv], d, ot + c * ldo + rv * N);
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_TILES_INL_H_
