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

// attention() on bfloat16 q (1, Hq, Tq, D) against one kv head's key and value views, on
// `threads` (0: all); the output in bfloat16.
Tensor AttendBf16(const Tensor& q, const View<const bfloat16>& key, const View<const bfloat16>& value,
                  int threads = 0) {
  const int64_t Hq = q.shape()[1], Tq = q.shape()[2], Dv = value.shape[3];
  Tensor out(DType::kBF16, {1, Hq, Tq, Dv}), lse(DType::kF32, {1, Hq, Tq});
  BasicAttentionInputs<bfloat16> in;
  in.query = q.view<bfloat16>();
  in.key = key;
  in.value = value;
  AttentionOptions opt;
  opt.num_threads = threads;
  attention(in, {out.view<bfloat16>(), lse.view<float>(), View<bfloat16>()}, opt);
  return out;
}

// The rows of t (1, 1, T, D) seen last to first through a negative row stride.
View<const bfloat16> Backwards(const Tensor& t) {
  const int64_t T = t.shape()[2], D = t.shape()[3];
  return View<const bfloat16>(t.data<bfloat16>() + (T - 1) * D, {1, 1, T, D}, {T * D, T * D, -D, 1});
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
    return AttendBf16(q, key, value).to_f32();
  };
  const View<const bfloat16> k_back = Backwards(k), v_back = Backwards(v);
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

// A thread keeps the value blocks it packs for its later tasks of the same kv head
// (ThreadValues, within forward_value_keep_limit()); packing every block in every task (limit
// 0) must give the same bits, on one thread and two, where tasks of a head see blocks whole and
// in part: several query blocks per head (Tq past 64 / G rows), GQA, both causal alignments,
// windows with sink tokens, key lengths, masks, values read backwards, a limit below one head.
TEST(HalfAmx, KeptValueBlocksGiveTheBitsOfPackingEachTime) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 143);
  for (int trial = 0; trial < 24; ++trial) {
    Problem p;
    p.B = rng.range(1, 3);
    p.Hkv = rng.range(1, 3);
    p.Hq = p.Hkv * (trial % 3 == 0 ? 4 : 1);
    p.Tq = rng.range(60, 400);
    p.Tk = trial % 4 == 0 ? p.Tq : rng.range(1, 500);
    p.D = 32 * rng.range(1, 4);
    p.Dv = 16 * rng.range(1, 8);
    p.bthd = rng.coin(0.3);
    p.opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (p.opt.causal != Causal::kNone && rng.coin(0.4)) {
      p.opt.window = rng.range(1, 200);
      p.opt.sink_tokens = rng.range(0, 8);
    }
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.25)) p.keep = random_mask(rng, broadcast_shape(rng, full), 0.8);
    if (rng.coin(0.3)) p.lengths = random_lengths(rng, p.B, p.Tk);
    SCOPED_TRACE(p.describe());
    kernels::set_forward_value_keep_limit(0);
    const Result packed = run_dtype(p, Backend::kFast, 1);
    for (const size_t limit : {kernels::kDefaultForwardValueKeepLimit, size_t{100} << 10}) {
      kernels::set_forward_value_keep_limit(limit);
      for (const int threads : {1, 2}) {
        const Result kept = run_dtype(p, Backend::kFast, threads);
        EXPECT_TRUE(bitwise_equal(kept.out, packed.out)) << "limit " << limit << ", threads " << threads;
        EXPECT_TRUE(bitwise_equal(kept.lse, packed.lse)) << "limit " << limit << ", threads " << threads;
      }
    }
  }
  // Values read backwards (a negative row stride) through kept blocks.
  const int64_t Hq = 2, Tq = 200, Tk = 300, D = 64;
  const Tensor q = random_tensor(rng, {1, Hq, Tq, D}).converted(DType::kBF16);
  const Tensor k = random_tensor(rng, {1, 1, Tk, D}).converted(DType::kBF16);
  const Tensor v = random_tensor(rng, {1, 1, Tk, D}).converted(DType::kBF16);
  auto run = [&] { return AttendBf16(q, k.view<bfloat16>(), Backwards(v), 2); };
  kernels::set_forward_value_keep_limit(0);
  const Tensor packed = run();
  kernels::set_forward_value_keep_limit(kernels::kDefaultForwardValueKeepLimit);
  EXPECT_TRUE(bitwise_equal(run(), packed)) << "values backwards";
}

// The blocks a thread keeps belong to one call: a second call on the same buffers, after their
// values changed in place, reads the new values (as a call packing every block does).
TEST(HalfAmx, KeptValueBlocksDoNotOutliveTheCall) {
  if (!kernels::forward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 144);
  Problem p;  // one kv head: both calls' tasks are of head 0
  p.Hkv = 1;
  p.Hq = 2;
  p.Tq = 256;
  p.Tk = 256;
  p.D = p.Dv = 64;
  p.make(rng);
  const Result first = run_dtype(p, Backend::kFast, 1);
  for (int64_t i = 0; i < p.v16.numel(); ++i) {
    p.v16.data<bfloat16>()[i] = to_bfloat16(-to_float(p.v16.data<bfloat16>()[i]) + 0.5f);
  }
  const Result second = run_dtype(p, Backend::kFast, 1);
  kernels::set_forward_value_keep_limit(0);
  const Result packed = run_dtype(p, Backend::kFast, 1);
  EXPECT_FALSE(bitwise_equal(first.out, packed.out)) << "the values did not change";
  EXPECT_TRUE(bitwise_equal(second.out, packed.out)) << "the second call read the first call's values";
}

}  // namespace
}  // namespace mha::test
