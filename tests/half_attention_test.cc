// bfloat16 and float16 attention (forward, weights, decode, backward) on every SIMD target,
// against the float64 reference run on the same 16-bit-rounded inputs widened to float32
// (exact), within half_problem.h's bound and exact-bits rule.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "half_problem.h"
#include "kernels/cpu/flash.h"
#include "mha/attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

// (SIMD target, dtype).
using Param = std::tuple<std::string, DType>;

class HalfTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { kernels::force_simd_target(std::get<0>(GetParam())); }
  void TearDown() override { kernels::force_simd_target(""); }
  DType dtype() const { return std::get<1>(GetParam()); }
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param) + "_" + dtype_name(std::get<1>(info.param));
}

TEST_P(HalfTest, SequenceLengthsAroundTileEdges) {
  Rng rng(base_seed() + 110);
  for (int64_t T : {1, 2, 47, 48, 49, 63, 64, 65, 113, 257}) {
    for (Causal c : {Causal::kNone, Causal::kTopLeft}) {
      Problem p;
      p.dtype = dtype();
      p.Tq = p.Tk = T;
      p.D = p.Dv = 64;
      p.opt.causal = c;
      p.make(rng);
      check(p);
    }
  }
}

TEST_P(HalfTest, HeadDimsAndStrides) {
  Rng rng(base_seed() + 111);
  for (int64_t D : {1, 7, 16, 17, 33, 80, 128}) {
    Problem p;
    p.dtype = dtype();
    p.Tq = 37;
    p.Tk = D == 33 ? 1100 : 70;  // >= 1024 strided keys are gathered first (src/ops/attention.cc)
    p.D = D;
    p.Dv = D == 1 ? 5 : D;
    p.bthd = D % 2 == 1;
    p.opt.causal = Causal::kBottomRight;
    p.make(rng);
    check(p);
  }
}

TEST_P(HalfTest, RandomProblems) {
  const uint64_t seed = base_seed() + 114;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with MHA_TEST_SEED)");
  Rng rng(seed);
  const int trials = std::get<0>(GetParam()) == "SCALAR" ? 10 : 40;
  for (int trial = 0; trial < trials; ++trial) {
    Problem p;
    p.dtype = dtype();
    p.B = rng.range(1, 2);
    p.Hkv = rng.range(1, 3);
    p.Hq = p.Hkv * rng.range(1, 4);
    p.Tq = rng.range(1, 130);
    p.Tk = rng.coin(0.3) ? p.Tq : rng.range(1, 130);
    p.D = rng.range(1, 72);
    p.Dv = rng.coin(0.5) ? p.D : rng.range(1, 72);
    p.bthd = rng.coin(0.5);
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.3)) p.keep = random_mask(rng, broadcast_shape(rng, full), rng.coin(0.5) ? 0.9 : 0.3);
    if (rng.coin(0.3)) p.bias = random_tensor(rng, broadcast_shape(rng, full));
    if (rng.coin(0.3)) p.lengths = random_lengths(rng, p.B, p.Tk);
    p.opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (p.opt.causal != Causal::kNone && rng.coin(0.3)) p.opt.window = rng.range(1, 80);
    if (rng.coin(0.2)) p.opt.dropout_p = 0.25f, p.opt.dropout_seed = rng.next();
    if (rng.coin(0.2)) p.opt.scale = static_cast<float>(rng.uniform());
    p.weights_rank = rng.coin(0.5) ? 0 : (rng.coin(0.5) ? 3 : 4);
    check(p);
  }
}

// Few query rows per kv head: the decode kernel, reading 16-bit K/V rows directly.
TEST_P(HalfTest, DecodeShapes) {
  Rng rng(base_seed() + 118);
  for (int64_t G : {1, 4, 8}) {
    for (int64_t Tk : {1, 17, 300, 3000}) {
      Problem p;
      p.dtype = dtype();
      p.B = 2;
      p.Hkv = 2;
      p.Hq = 2 * G;
      p.Tq = 1;
      p.Tk = Tk;
      p.D = Tk == 300 ? 33 : Tk == 17 ? 40 : 64;  // 33, 40: the stage by 4 vectors, then by 1
      p.Dv = Tk == 17 ? 20 : Tk == 3000 ? 48 : p.D;  // 48: a pass of 16 columns too
      p.bthd = Tk == 300;
      p.opt.causal = Causal::kBottomRight;
      p.make(rng);
      check(p);
    }
  }
  Problem p;  // key lengths and a window, keys split into chunks
  p.dtype = dtype();
  p.Hq = 4;
  p.Hkv = 1;
  p.Tk = 5000;
  p.D = p.Dv = 96;
  p.make(rng);
  p.lengths = Tensor(DType::kI64, {1});
  p.lengths.data<int64_t>()[0] = 4321;
  p.opt.causal = Causal::kBottomRight;
  p.opt.window = 700;
  check(p);
}

TEST_P(HalfTest, SameBitsForOneAndTwoThreads) {
  Rng rng(base_seed() + 119);
  for (int64_t Tq : {1, 200}) {
    Problem p;
    p.dtype = dtype();
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = Tq;
    p.Tk = 2000;
    p.D = p.Dv = 64;
    p.weights_rank = Tq == 1 ? 0 : 3;
    p.opt.causal = Causal::kBottomRight;
    p.opt.dropout_p = Tq == 1 ? 0.0f : 0.1f;
    p.make(rng);
    const Result one = run_dtype(p, Backend::kFast, 1), two = run_dtype(p, Backend::kFast, 2);
    EXPECT_TRUE(bitwise_equal(one.out, two.out)) << p.describe();
    EXPECT_TRUE(bitwise_equal(one.lse, two.lse)) << p.describe();
    if (p.weights_rank) EXPECT_TRUE(bitwise_equal(one.weights, two.weights)) << p.describe();
  }
}

// Overflow and special values: float16 outputs beyond 65504 are infinite, NaN stays NaN, and a
// fully masked row is zeros (never NaN) in every dtype.
TEST_P(HalfTest, SpecialValues) {
  Rng rng(base_seed() + 120);
  Problem p;
  p.dtype = dtype();
  p.Tq = 3;
  p.Tk = 5;
  p.D = p.Dv = 16;
  p.make(rng);
  auto set = [&](Tensor& t16, Tensor& t32, int64_t i, float x) {
    if (p.dtype == DType::kBF16) {
      t16.data<bfloat16>()[i] = to_bfloat16(x);
    } else {
      t16.data<float16>()[i] = to_float16(x);
    }
    t32 = t16.to_f32();
  };
  // Every value of key 0's V row is 1e5 (finite in bf16, infinite in fp16).
  for (int64_t c = 0; c < p.Dv; ++c) set(p.v16, p.v32, c, 1e5f);
  p.keep = Tensor(DType::kU8, {p.Tq, p.Tk});
  for (int64_t j = 0; j < p.Tk; ++j) p.keep.data<uint8_t>()[j] = 0;  // query 0 sees nothing
  for (int64_t i = p.Tk; i < p.keep.numel(); ++i) p.keep.data<uint8_t>()[i] = 1;
  const Result r = run_dtype(p, Backend::kFast);
  for (int64_t h = 0; h < p.Hq; ++h) {
    const float* row0 = r.out.data<float>() + h * p.Tq * p.Dv;
    for (int64_t c = 0; c < p.Dv; ++c) EXPECT_EQ(row0[c], 0.0f);
    EXPECT_EQ(r.lse.data<float>()[h * p.Tq], -std::numeric_limits<float>::infinity());
  }
  check(p);
}

// The 16-bit backward is the float32 backward on the widened arguments, rounded once: the
// same bits as doing that by hand — the fast kernel reading 16-bit arguments directly, and the
// reference backend on widened copies.
TEST_P(HalfTest, BackwardIsRoundedFloat32Backward) {
  Rng rng(base_seed() + 121);
  for (Causal c : {Causal::kNone, Causal::kBottomRight}) {
    Problem p;
    p.dtype = dtype();
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = 50;
    p.Tk = 70;
    p.D = 24;
    p.Dv = 20;
    p.bthd = c == Causal::kNone;
    p.opt.causal = c;
    p.opt.dropout_p = 0.2f;
    p.opt.dropout_seed = 7;
    p.make(rng);
    const Result fwd = run_dtype(p, Backend::kFast);
    const Tensor out16 = fwd.out.converted(p.dtype), go32 = random_tensor(rng, {p.B, p.Hq, p.Tq, p.Dv});
    const Tensor go16 = go32.converted(p.dtype);
    // By hand: float32 backward on the widened values.
    const Tensor out32 = out16.to_f32(), gow = go16.to_f32();
    Tensor gq(DType::kF32, {p.B, p.Hq, p.Tq, p.D}), gk(DType::kF32, {p.B, p.Hkv, p.Tk, p.D}),
        gv(DType::kF32, {p.B, p.Hkv, p.Tk, p.Dv});
    attention_backward(p.inputs32(), out32.view<float>(), fwd.lse.view<float>(), gow.view<float>(),
                       {gq.view<float>(), gk.view<float>(), gv.view<float>()}, p.opt);
    Tensor hq(p.dtype, gq.shape()), hk(p.dtype, gk.shape()), hv(p.dtype, gv.shape());
    if (p.dtype == DType::kBF16) {
      attention_backward(p.inputs16<bfloat16>(), out16.view<bfloat16>(), fwd.lse.view<float>(),
                         go16.view<bfloat16>(), {hq.view<bfloat16>(), hk.view<bfloat16>(), hv.view<bfloat16>()},
                         p.opt);
    } else {
      attention_backward(p.inputs16<float16>(), out16.view<float16>(), fwd.lse.view<float>(),
                         go16.view<float16>(), {hq.view<float16>(), hk.view<float16>(), hv.view<float16>()},
                         p.opt);
    }
    EXPECT_TRUE(bitwise_equal(hq, gq.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(hk, gk.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(hv, gv.converted(p.dtype))) << p.describe();
    // The reference backend: the float64-accumulating reference on the widened arguments, rounded.
    AttentionOptions ro = p.opt;
    ro.backend = Backend::kReference;
    attention_backward(p.inputs32(), out32.view<float>(), fwd.lse.view<float>(), gow.view<float>(),
                       {gq.view<float>(), gk.view<float>(), gv.view<float>()}, ro);
    Tensor rq(p.dtype, gq.shape()), rk(p.dtype, gk.shape()), rv(p.dtype, gv.shape());
    if (p.dtype == DType::kBF16) {
      attention_backward(p.inputs16<bfloat16>(), out16.view<bfloat16>(), fwd.lse.view<float>(),
                         go16.view<bfloat16>(), {rq.view<bfloat16>(), rk.view<bfloat16>(), rv.view<bfloat16>()}, ro);
    } else {
      attention_backward(p.inputs16<float16>(), out16.view<float16>(), fwd.lse.view<float>(), go16.view<float16>(),
                         {rq.view<float16>(), rk.view<float16>(), rv.view<float16>()}, ro);
    }
    EXPECT_TRUE(bitwise_equal(rq, gq.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(rk, gk.converted(p.dtype))) << p.describe();
    EXPECT_TRUE(bitwise_equal(rv, gv.converted(p.dtype))) << p.describe();
    // And the gradients are not trivially zero.
    EXPECT_GT(max_abs(hq.to_f32().view<float>()), 0.0);
    EXPECT_GT(max_abs(hv.to_f32().view<float>()), 0.0);
  }
}

// The decode kernel's bfloat16 keys scored with vdpbf16ps (AVX-512 BF16) against its float path
// on the same inputs (dot products off). Both sum the same exact products q_i·k_i in float32 in
// other orders (the float path scales q first, the dots scale the sum): each score is within
// (D + 2)·u·scale·Σ_i|q_i·k_i| of the exact one (u = 2^-24), so the two within twice that, δ.
// lse = log Σ_j exp(s_j) then moves by ≤ δ plus each path's own rounding of the sum of Tk
// exponentials (≤ (Tk + 8)·u relative apiece); the bfloat16 outputs by one rounding each
// (2^-8 of |o|) plus ≤ 4δ·max|v|. A wrong mask of the last 32 channels, scale or pairing
// moves them by orders of magnitude more.
void expect_dots_near_float_path(const Problem& p) {
  SCOPED_TRACE(p.describe());
  const Result dots = run_dtype(p, Backend::kFast), plain = run_dots_off(p);
  const int64_t D = p.D, Tk = p.Tk, G = p.Hq / p.Hkv;
  const float* q = p.q32.data<float>();
  const float* k = p.k32.data<float>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D)), u = kU;
  double vmax = 0;
  for (int64_t i = 0; i < p.v32.numel(); ++i) vmax = std::max(vmax, std::fabs(double{p.v32.data<float>()[i]}));
  for (int64_t h = 0; h < p.Hq; ++h) {  // B = 1, Tq = 1: row h
    double delta = 0;  // the largest δ of the row's keys
    for (int64_t j = 0; j < Tk; ++j) {
      double a = 0;
      for (int64_t i = 0; i < D; ++i) a += std::fabs(static_cast<double>(q[h * D + i]) * k[((h / G) * Tk + j) * D + i]);
      delta = std::max(delta, 2 * (D + 2) * u * scale * a);
    }
    const double l0 = dots.lse.data<float>()[h], l1 = plain.lse.data<float>()[h];
    if (!std::isfinite(l1)) {  // NaN stays NaN (a NaN query takes the float path: the same bits)
      EXPECT_EQ(std::isnan(l0), std::isnan(l1)) << "lse of row " << h << ": " << l0 << " vs " << l1;
      continue;
    }
    EXPECT_LE(std::fabs(l0 - l1), delta + 2 * (Tk + 8) * u * (1 + std::fabs(l1))) << "lse of row " << h;
    for (int64_t c = 0; c < D; ++c) {
      const double o0 = dots.out.data<float>()[h * D + c], o1 = plain.out.data<float>()[h * D + c];
      EXPECT_LE(std::fabs(o0 - o1), (std::fabs(o0) + std::fabs(o1)) / 256 + 4 * delta * vmax + 1e-30)
          << "out of row " << h << ", column " << c;
    }
  }
}

// The decode kernel's bfloat16 dot products against its float path (expect_dots_near_float_path)
// over head dims, groups and key counts around the tiles, and on special values.
void expect_bf16_dots_near_float_path(uint64_t seed) {
  Rng rng(seed);
  // G = 1 .. 4 take AmxBf16Scores' permutes, 5 and 16 its gathers.
  for (int64_t D : {8, 20, 32, 33, 64, 100, 128})
    for (int64_t G : {1, 3, 4, 5, 16})
      for (int64_t Tk : {1, 15, 17, 129, 300}) {
        Problem p;
        p.dtype = DType::kBF16;
        p.Hkv = 2;
        p.Hq = 2 * G;
        p.Tk = Tk;
        p.D = p.Dv = D;
        p.opt.causal = Causal::kBottomRight;
        p.make(rng);
        expect_dots_near_float_path(p);
      }
  // Special values: a NaN query entry (that row takes the float path), an infinite key entry
  // (the rows of its kv head get an infinite or NaN score, on both paths alike).
  Problem p;
  p.Hkv = 2;
  p.Hq = 8;
  p.Tk = 40;
  p.D = p.Dv = 64;
  p.make(rng);
  p.q16.data<bfloat16>()[1 * 64 + 5] = to_bfloat16(std::nanf(""));
  p.k16.data<bfloat16>()[(1 * 40 + 7) * 64 + 3] = to_bfloat16(std::numeric_limits<float>::infinity());
  p.q32 = p.q16.to_f32();
  p.k32 = p.k16.to_f32();
  expect_dots_near_float_path(p);
  // Sums past the float range before the scale: q·k = 64 · 1e38 overflows, (q·scale)·k with
  // scale 1e-30 does not. Those rows take the float path's scores: its bits, finite.
  Problem big;
  big.Hkv = 1;
  big.Hq = 4;
  big.Tk = 40;
  big.D = big.Dv = 64;
  big.opt.scale = 1e-30f;
  big.make(rng);
  for (int64_t i = 0; i < big.q16.numel(); ++i) big.q16.data<bfloat16>()[i] = to_bfloat16(1e19f);
  for (int64_t i = 0; i < big.k16.numel(); ++i)
    big.k16.data<bfloat16>()[i] = to_bfloat16(i % 3 == 0 ? 1e19f : -1e19f);
  big.q32 = big.q16.to_f32();
  big.k32 = big.k16.to_f32();
  const Result dots = run_dtype(big, Backend::kFast), plain = run_dots_off(big);
  EXPECT_TRUE(bitwise_equal(dots.out, plain.out));
  EXPECT_TRUE(bitwise_equal(dots.lse, plain.lse));
  for (int64_t i = 0; i < dots.lse.numel(); ++i) EXPECT_TRUE(std::isfinite(dots.lse.data<float>()[i]));
}

TEST(HalfDecode, Bf16DotScoresStayWithinFloat32Sums) {
  if (!kernels::decode_bf16_dots()) GTEST_SKIP() << "this CPU has no AVX-512 BF16: the float path alone runs";
  // Both paths where the CPU has AMX: its tiles (head dims 32, 64 and 128 here; vdpbf16ps for the
  // others and for a partial tile of keys) and vdpbf16ps alone.
  const RestoreKernelSwitches restore;
  std::vector<bool> amx_paths{false};
  if (kernels::decode_amx_bf16()) amx_paths.push_back(true);
  for (const bool amx : amx_paths) {
    SCOPED_TRACE(amx ? "AMX tiles" : "vdpbf16ps");
    kernels::allow_decode_amx(amx);
    // The keys' products alone (the values': decode_bf16_values_test.cc).
    kernels::allow_decode_amx_values(false);
    kernels::allow_decode_bf16_values(false);
    expect_bf16_dots_near_float_path(base_seed() + 130);
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, HalfTest,
                         ::testing::Combine(::testing::ValuesIn(kernels::simd_targets()),
                                            ::testing::Values(DType::kBF16, DType::kF16)),
                         param_name);

}  // namespace
}  // namespace mha::test
