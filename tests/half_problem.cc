#include "half_problem.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "ops/attention_checks.h"

namespace mha::test {

Result alloc(const Problem& p, DType out_dtype) {
  Result r;
  r.out = Tensor(out_dtype, {p.B, p.Hq, p.Tq, p.Dv});
  r.lse = Tensor(DType::kF32, {p.B, p.Hq, p.Tq});
  if (p.weights_rank) r.weights = Tensor(out_dtype, p.weights_shape());
  return r;
}

Result run_dtype(const Problem& p, Backend backend, int threads) {
  return p.dtype == DType::kBF16 ? run16<bfloat16>(p, backend, threads) : run16<float16>(p, backend, threads);
}

Result run_dots_off(const Problem& p) {
  // The dot products back on however run_dtype returns; the fixture's SIMD target stays (not
  // RestoreKernelSwitches, which would reset it).
  struct DotsBackOn {
    ~DotsBackOn() { kernels::allow_decode_dot_products(true); }
  } const back_on;
  kernels::allow_decode_dot_products(false);
  return run_dtype(p, Backend::kFast);
}

template <typename Acc>
Result run32(const Problem& p) {
  Result r = alloc(p, DType::kF32);
  const AttentionOutputs o{r.out.view<float>(), r.lse.view<float>(),
                           p.weights_rank ? r.weights.view<float>() : View<float>()};
  const kernels::AttentionParams kp = ops::make_attention_params(p.inputs32(), o, p.opt);
  for (int64_t b = 0; b < kp.batch; ++b)
    for (int64_t i = 0; i < kp.q_len; ++i) kernels::attention_ref_row<Acc>(kp, b, i);
  return r;
}

template Result run32<double>(const Problem& p);
template Result run32<float>(const Problem& p);

void check(const Problem& p) {
  SCOPED_TRACE(p.describe());
  const double u16 = unit_roundoff(p.dtype);
  const Result fast = run_dtype(p, Backend::kFast), ref = run32<double>(p), plain32 = run32<float>(p);
  const Result ref16 = run_dtype(p, Backend::kReference);
  auto rounded = [&](const Tensor& t) { return t.converted(p.dtype).to_f32(); };
  // floor: the fast path's own error beyond 2x plain, relative to max|r|: 4u, or for the LSE
  // (float32 for every dtype) what its terms allow where that is more (lse_floor, test_util.h):
  // a seed measured fast at 8.6u of max|lse| = 18.6 (D = 55, a bias) against plain's 1.7u.
  auto expect_bound = [&](const Tensor& f, const Tensor& r, const Tensor& pl32, double u_out, double floor,
                          const char* what) {
    const double scale = std::max(finite_max_abs(r), 1e-30);
    const double ef = abs_error(f, r) / scale, e32 = abs_error(pl32, r) / scale;
    const double e16 = u_out > 0 ? abs_error(rounded(pl32), r) / scale : e32;
    EXPECT_LE(ef, std::max(2 * e16, 2 * e32 + floor + u_out))
        << what << ": fast " << ef << " vs plain16 " << e16 << ", plain32 " << e32 << ", max|ref| " << scale;
  };
  const double lse_max = std::max(finite_max_abs(ref.lse), 1e-30);
  const double lse_terms = lse_floor(p.inputs32(), p.opt, lse_max);
  // Where the forward's AMX tiles run (bfloat16, head dims they take), P is rounded to bfloat16
  // for P·V: each weight by at most u16 relative (one rounding), so a row's output by at most
  // u16·max|v| more (docs/numerics.md).
  const bool tiles = p.dtype == DType::kBF16 && kernels::forward_amx_bf16() && p.D % 32 == 0 && p.Dv % 16 == 0;
  const double p_rounding = tiles ? u16 * finite_max_abs(p.v32) / std::max(finite_max_abs(ref.out), 1e-30) : 0.0;
  expect_bound(fast.out, ref.out, plain32.out, u16, 4 * kU + p_rounding, "out");
  expect_bound(fast.lse, ref.lse, plain32.lse, 0.0, std::max(4 * kU, lse_terms / lse_max), "lse");
  if (p.weights_rank) expect_bound(fast.weights, ref.weights, plain32.weights, u16, 4 * kU, "weights");
  // The fast 16-bit path widens its inputs exactly and runs the float32 tiles: its results are
  // the float32 fast path's on the widened inputs, rounded once (round to nearest even). Not so
  // the decode kernel's bfloat16 keys with bfloat16 dot products, nor the forward's AMX tiles
  // (other sums, the scale applied after them, P rounded; the bound above holds them): the bits
  // are checked with the dot products off, which turns both off.
  const Result widened = run_dots_off(p);
  Result fast32 = alloc(p, DType::kF32);
  AttentionOptions fo = p.opt;
  fo.backend = Backend::kFast;
  attention(p.inputs32(),
            {fast32.out.view<float>(), fast32.lse.view<float>(),
             p.weights_rank ? fast32.weights.view<float>() : View<float>()},
            fo);
  EXPECT_TRUE(bitwise_equal(widened.out, rounded(fast32.out))) << "out is not the rounded float32 result";
  EXPECT_TRUE(bitwise_equal(widened.lse, fast32.lse)) << "lse differs from the float32 path's";
  if (p.weights_rank) EXPECT_TRUE(bitwise_equal(widened.weights, rounded(fast32.weights)));
  if (!(p.dtype == DType::kBF16 && kernels::decode_bf16_dots())) {  // then the same path
    EXPECT_TRUE(bitwise_equal(fast.out, widened.out));
    EXPECT_TRUE(bitwise_equal(fast.lse, widened.lse));
  }
  // The 16-bit reference path is the float64 reference rounded once.
  EXPECT_LE(abs_error(ref16.out, ref.out), u16 * std::max(finite_max_abs(ref.out), 1e-30) + 1e-30);
}

}  // namespace mha::test
