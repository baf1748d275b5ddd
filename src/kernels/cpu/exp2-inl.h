// 2^x (and tanh, for the softcap) on SIMD lanes, shared by every fast kernel (forward and
// backward must round alike).
//
// Hand-written rather than Highway's contrib Exp because the kernels work in base 2 (scale·log2e
// is folded into Q, so each probability is one exp2 of s - m), and because its edge cases are
// part of the attention semantics: exp2(-inf) = 0 exactly (masked keys), NaN stays NaN (never
// hidden), nothing overflows for x <= 0.
//
//   x = n + f,  n = round(x),  f in [-1/2, 1/2]
//   2^f ~ 1 + f·(c1 + f·(c2 + ... + f·c6))   (Cephes exp2f minimax, relative error < 2e-7)
//   2^x = 2^f · 2^n: vscalefps on AVX-512, else built in the exponent field. Accurate for
//   x <= 0, the only inputs the kernels pass.
//   x < -100 gives exactly 0 (so does exp2(-inf): masked keys). The kernels pass x = (s - m)·log2 e
//   with m the row maximum, so a flushed term is below 2^-100 of the row's largest, ~2^-76 of one
//   float ulp of any sum it joins — and without the flush, terms of 2^-126 .. 2^-150 are
//   subnormal floats, whose every multiply takes a microcode assist: the backward with ALiBi
//   (scores falling by slope·distance) ran at 27% of plain attention's speed before it, 95% after.
#if defined(MHA_KERNELS_CPU_EXP2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_KERNELS_CPU_EXP2_INL_H_
#undef MHA_KERNELS_CPU_EXP2_INL_H_
#else
#define MHA_KERNELS_CPU_EXP2_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class D, class V = hn::Vec<D>>
HWY_INLINE V Exp2(D d, V x) {
  // Only the lower clamp matters: the kernels call this with x <= 0 (a score minus its row
  // maximum). On x86, Max returns its second operand when either is NaN, so NaN stays NaN;
  // other targets test for it explicitly below.
  // Clamped to -101, not to scalef's own underflow at -150: a result below 2^-126 would be a
  // subnormal float, and computing one costs a microcode assist per vector on Intel cores even
  // though the `tiny` lanes are zeroed right after (the ALiBi backward spent 40% of its time on
  // that one instruction). -inf (masked keys) clamps to -101 and is zeroed as tiny.
  const V xc = hn::Max(hn::Set(d, -101.0f), x);
  const V n = hn::Round(xc);
  const V f = hn::Sub(xc, n);
  V p = hn::Set(d, 1.535336188319500e-4f);
  p = hn::MulAdd(p, f, hn::Set(d, 1.339887440266574e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 9.618437357674640e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 5.550332471162809e-2f));
  p = hn::MulAdd(p, f, hn::Set(d, 2.402264791363012e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 6.931472028550421e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 1.0f));
  const auto tiny = hn::Lt(x, hn::Set(d, -100.0f));  // false for NaN: NaN stays NaN
#if HWY_TARGET == HWY_AVX3
  return hn::IfThenZeroElse(tiny, V{_mm512_scalef_ps(p.raw, n.raw)});  // p · 2^n in one instruction
#else
  // 2^n for n in [-101, 0]: the exponent field n + 127.
  const hn::RebindToSigned<D> di;
  const auto bits = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  const V r = hn::Mul(p, hn::BitCast(d, bits));
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
  return hn::IfThenZeroElse(tiny, r);
#else
  return hn::IfThenZeroElse(tiny, hn::IfThenElse(hn::IsNaN(x), x, r));
#endif
#endif
}

// tanh(x) for the softcap, within ~3 ulp. |x| < 0.75: x + x³·q(x²), q of degree 5 fitted to
// tanh (1.3 ulp; near 0, where a score's own rounding is relative, it is exact enough); else
// (1 − e)/(1 + e) with e = 2^(−2|x|·log2 e) from Exp2 (no cancellation there: 1 − e > 0.77) and
// the division as an approximate reciprocal plus one Newton step. A vector whose lanes are all
// on one side computes one branch: with Gemma 2's cap of 50 most scaled scores are small.
// (Highway's Tanh is an expm1 and a division: vdivps costs ~16 cycles per vector on these cores
// and the softcapped forward ran at ~80% of plain attention's speed with it.) NaN stays NaN, ±inf
// gives ±1.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V SoftcapTanh(D d, V x) {
  const V ax = hn::Abs(x);
  const auto small = hn::Lt(ax, hn::Set(d, 0.75f));
  auto poly = [&] {
    const V y = hn::Mul(x, x);
    V q = hn::Set(d, 0.001742537715472281f);
    q = hn::MulAdd(q, y, hn::Set(d, -0.007667089346796274f));
    q = hn::MulAdd(q, y, hn::Set(d, 0.021458545699715614f));
    q = hn::MulAdd(q, y, hn::Set(d, -0.05389472097158432f));
    q = hn::MulAdd(q, y, hn::Set(d, 0.13332721590995789f));
    q = hn::MulAdd(q, y, hn::Set(d, -0.33333316445350647f));
    return hn::MulAdd(hn::Mul(x, y), q, x);
  };
  auto exp_form = [&] {
    const V e = Exp2(d, hn::Mul(ax, hn::Set(d, -2.0f * 1.4426950408889634f)));
    const V den = hn::Add(hn::Set(d, 1.0f), e);
    V r = hn::ApproximateReciprocal(den);
    r = hn::Mul(r, hn::NegMulAdd(den, r, hn::Set(d, 2.0f)));  // r·(2 − den·r)
    return hn::CopySign(hn::Mul(hn::Sub(hn::Set(d, 1.0f), e), r), x);
  };
  if (hn::AllTrue(d, small)) return poly();
  if (hn::AllFalse(d, small)) return exp_form();
  return hn::IfThenElse(small, poly(), exp_form());
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MHA_KERNELS_CPU_EXP2_INL_H_
