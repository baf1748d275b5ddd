// The bfloat16 forward with AMX tile products (src/kernels/cpu/flash_amx-inl.h), where the CPU
// has them and Linux grants the tile state; skipped with a message elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "half_problem.h"
#include "kernels/cpu/flash.h"
#include "mha/attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

// The bfloat16 forward with AMX tile products (flash_amx-inl.h) within check's bound of the
// float64 reference, where the CPU has them, on the shapes its tiles cut: head dims of 1 … 8
// tiles of 32 channels, value dims of 1 … 16 tiles of 16 columns (odd counts leave the 2 × 2
// blocks' halves), row counts leaving an odd row tile (G · queries not a multiple of 32), key
// counts around 16, 32 and the 64-key block (the last tile's rows past Tk staged, probabilities
// past the block's keys zeroed), (B, T, H, D) strides, masks, a bias, windows with sink tokens,
// softcap, dropout and weights. check() also runs the float32 tiles (dot products off) for
// their exact bits. The tile path must be the one that ran: its P, rounded to bfloat16 for the
// second product, moves the output's bits in most problems.
TEST(HalfAmx, ForwardTilesStayWithinTheBound) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 140);
  int problems = 0, moved = 0;
  auto run = [&](Problem& p) {
    p.dtype = DType::kBF16;
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.3)) p.keep = random_mask(rng, broadcast_shape(rng, full), rng.coin(0.5) ? 0.9 : 0.3);
    if (rng.coin(0.3)) p.bias = random_tensor(rng, broadcast_shape(rng, full));
    if (rng.coin(0.2)) p.lengths = random_lengths(rng, p.B, p.Tk);
    check(p);
    kernels::allow_forward_amx(false);
    const Result tiles_off = run_dtype(p, Backend::kFast);
    kernels::allow_forward_amx(true);
    const Result tiles = run_dtype(p, Backend::kFast);
    ++problems;
    moved += !bitwise_equal(tiles.out, tiles_off.out);
  };
  for (int64_t D : {32, 64, 96, 128, 256}) {
    for (int64_t Dv : {16, 48, 64, 80, 256}) {
      Problem p;
      p.Hkv = 2;
      p.Hq = 2 * rng.range(1, 5);
      p.Tq = rng.range(1, 80);
      p.Tk = rng.range(1, 200);
      p.D = D;
      p.Dv = Dv;
      p.bthd = rng.coin(0.5);
      p.opt.causal = static_cast<Causal>(rng.range(0, 2));
      run(p);
    }
  }
  for (int64_t Tk : {1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 257}) {
    Problem p;
    p.B = 2;
    p.Hkv = 1;
    p.Hq = 3;
    p.Tq = 37;
    p.Tk = Tk;
    p.D = 64;
    p.Dv = 64;
    p.opt.causal = Tk % 2 ? Causal::kBottomRight : Causal::kNone;
    if (Tk > 100) p.opt.window = 40, p.opt.sink_tokens = 4;
    if (Tk == 65) p.opt.softcap = 5.0f;
    if (Tk == 129) p.opt.dropout_p = 0.25f, p.opt.dropout_seed = rng.next();
    p.weights_rank = Tk == 100 ? 4 : Tk == 257 ? 3 : 0;
    run(p);
  }
  EXPECT_GE(moved, problems / 2) << "the tile path did not run";
}

// Keys and values seen backwards through negative row strides (values read so by the tiles,
// keys by the float32 tiles: a tile load steps forward) give what the same rows copied in that
// order give, within the tiles' rounding: attention without a mask does not depend on key order.
TEST(HalfAmx, ReversedRowsThroughNegativeStrides) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  Rng rng(base_seed() + 142);
  const int64_t Hq = 4, Tq = 70, Tk = 150, D = 64;
  const Tensor q = random_tensor(rng, {1, Hq, Tq, D}).converted(DType::kBF16);
  const Tensor k = random_tensor(rng, {1, 1, Tk, D}).converted(DType::kBF16);
  const Tensor v = random_tensor(rng, {1, 1, Tk, D}).converted(DType::kBF16);
  Tensor k_rev(DType::kBF16, {1, 1, Tk, D}), v_rev(DType::kBF16, {1, 1, Tk, D});
  for (int64_t j = 0; j < Tk; ++j) {
    for (int64_t c = 0; c < D; ++c) {
      k_rev.data<bfloat16>()[j * D + c] = k.data<bfloat16>()[(Tk - 1 - j) * D + c];
      v_rev.data<bfloat16>()[j * D + c] = v.data<bfloat16>()[(Tk - 1 - j) * D + c];
    }
  }
  auto run = [&](const View<const bfloat16>& key, const View<const bfloat16>& value) {
    Tensor out(DType::kBF16, {1, Hq, Tq, D}), lse(DType::kF32, {1, Hq, Tq});
    BasicAttentionInputs<bfloat16> in;
    in.query = q.view<bfloat16>();
    in.key = key;
    in.value = value;
    attention(in, {out.view<bfloat16>(), lse.view<float>(), View<bfloat16>()});
    return out.to_f32();
  };
  const std::initializer_list<int64_t> backwards = {Tk * D, Tk * D, -D, 1};
  const View<const bfloat16> k_back(k.data<bfloat16>() + (Tk - 1) * D, {1, 1, Tk, D}, backwards);
  const View<const bfloat16> v_back(v.data<bfloat16>() + (Tk - 1) * D, {1, 1, Tk, D}, backwards);
  const Tensor copied = run(k_rev.view<bfloat16>(), v_rev.view<bfloat16>());
  const double bound = 2 * unit_roundoff(DType::kBF16) * finite_max_abs(copied);
  EXPECT_LE(abs_error(run(k_rev.view<bfloat16>(), v_back), copied), bound) << "values backwards (tiles)";
  EXPECT_LE(abs_error(run(k_back, v_back), copied), bound) << "keys and values backwards (float32 tiles)";
}

// Where q·k passes the float range but (q·scale)·k does not (a small explicit scale), the
// tile sums are infinite: those scores are taken as the float path takes them (finite), and an
// infinite key entry still gives that key infinite or NaN scores, as on the float path.
TEST(HalfAmx, ScoresPastTheFloatRangeTakeTheFloatPath) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 141);
  auto problem = [&](std::optional<float> scale) {
    Problem p;
    p.dtype = DType::kBF16;
    p.Hkv = 1;
    p.Hq = 2;
    p.Tq = 20;
    p.Tk = 40;
    p.D = p.Dv = 64;
    p.opt.scale = scale;
    p.make(rng);
    return p;
  };
  Problem big = problem(1e-30f);
  for (int64_t i = 0; i < big.q16.numel(); ++i) big.q16.data<bfloat16>()[i] = to_bfloat16(i % 2 ? 1e19f : -1e19f);
  for (int64_t i = 0; i < big.k16.numel(); ++i) big.k16.data<bfloat16>()[i] = to_bfloat16(i % 3 ? 1e19f : -1e19f);
  big.q32 = big.q16.to_f32();
  big.k32 = big.k16.to_f32();
  const Result tiles = run_dtype(big, Backend::kFast);
  for (int64_t i = 0; i < tiles.lse.numel(); ++i) EXPECT_TRUE(std::isfinite(tiles.lse.data<float>()[i])) << i;
  check(big);
  Problem inf = problem(std::nullopt);
  inf.k16.data<bfloat16>()[7 * 64 + 3] = to_bfloat16(std::numeric_limits<float>::infinity());
  inf.k32 = inf.k16.to_f32();
  kernels::allow_forward_amx(false);
  const Result off = run_dtype(inf, Backend::kFast);
  kernels::allow_forward_amx(true);
  const Result on = run_dtype(inf, Backend::kFast);
  for (int64_t i = 0; i < on.lse.numel(); ++i) {
    const float a = on.lse.data<float>()[i], b = off.lse.data<float>()[i];
    EXPECT_EQ(std::isnan(a), std::isnan(b)) << i;
    EXPECT_EQ(std::isinf(a), std::isinf(b)) << i;
  }
  check(inf);
}

}  // namespace
}  // namespace mha::test
