// The bfloat16 backward with AMX tile products (src/kernels/cpu/flash_bwd_amx-inl.h) against the
// float32 tiles on the same arguments, where the CPU has them and Linux grants the tile state;
// skipped with a message elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "half_problem.h"
#include "kernels/cpu/flash.h"
#include "mha/attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

// A problem's gradients (float32 tensors holding bfloat16 values) from the fast backward.
struct Grads {
  Tensor q, k, v;
};

// The problem's forward (fast path: out rounded to bfloat16, lse), and a random dO.
struct Forward {
  Tensor out16, lse, go16;
};

Forward RunForward(const Problem& p, Rng& rng) {
  const Result fwd = run_dtype(p, Backend::kFast);
  return {fwd.out.converted(DType::kBF16), fwd.lse.converted(DType::kF32),
          random_tensor(rng, {p.B, p.Hq, p.Tq, p.Dv}).converted(DType::kBF16)};
}

// The fast bfloat16 backward with the tiles on or off, on `threads` (0: all).
Grads RunBackward(const Problem& p, const Forward& f, bool tiles, int threads = 0) {
  kernels::allow_backward_amx(tiles);
  Tensor gq(DType::kBF16, {p.B, p.Hq, p.Tq, p.D}), gk(DType::kBF16, {p.B, p.Hkv, p.Tk, p.D}),
      gv(DType::kBF16, {p.B, p.Hkv, p.Tk, p.Dv});
  AttentionOptions opt = p.opt;
  opt.num_threads = threads;
  attention_backward(p.inputs16<bfloat16>(), f.out16.view<bfloat16>(), f.lse.view<float>(), f.go16.view<bfloat16>(),
                     {gq.view<bfloat16>(), gk.view<bfloat16>(), gv.view<bfloat16>()}, opt);
  kernels::allow_backward_amx(true);
  return {gq.to_f32(), gk.to_f32(), gv.to_f32()};
}

// Element (b, h, t, c) of a float32 tensor holding (B, H, T, C) in the problem's layout.
float At(const Tensor& x, const Problem& p, int64_t H, int64_t T, int64_t C, int64_t b, int64_t h, int64_t t,
         int64_t c) {
  const float* d = x.data<float>();
  return p.bthd ? d[((b * T + t) * H + h) * C + c] : d[((b * H + h) * T + t) * C + c];
}

// docs/numerics.md ("The bfloat16 backward with AMX tiles"): per gradient element, the tiles'
// bfloat16 value ĝt against the float32 tiles' ĝf,
//   |ĝt − ĝf| <= 2.01·u16·|ĝf| + 1.01·[(u16 + 3δS + 2(n + 2)u)·A + (2δP + 3δS·MdP)·A_P],
// A: the element's sum of absolute terms (dV: Σ P_d·|dO|, dK: scale·Σ|dS|·|q|, dQ: scale·Σ|dS|·|k|;
// |dS| before the softcap's factor, which is at most 1), A_P: the same with P/(1 − p) for |dS| (dK,
// dQ), δS = (D + 2)·u·scale·max_row Σ|q|·max|k| and δP = (Dv + 2)·u·max_row Σ|dO|·max|v|/(1 − p)
// the scores' and dP's summation bounds, MdP = max_row Σ|dO|·max|v|·(1/(1 − p) + 1) a bound on
// |dP − D|, n the terms of the element's sum. P and dS come from the float64 reference (weights,
// and the gradient of a full-shape bias). Returns the largest ratio |ĝt − ĝf| / bound.
double ExpectWithinBound(const Problem& p, const Forward& f, const Grads& tiles, const Grads& plain) {
  SCOPED_TRACE(p.describe());
  const int64_t B = p.B, Hq = p.Hq, Hkv = p.Hkv, Tq = p.Tq, Tk = p.Tk, D = p.D, Dv = p.Dv, G = Hq / Hkv;
  const double u16 = unit_roundoff(DType::kBF16), u = kU, keep = 1.0 - p.opt.dropout_p;
  const double scale = p.opt.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  // The reference's P (weights) and dS (a full-shape bias's gradient: the problem's, which the
  // tests make full-shape, or zeros) on the widened arguments.
  Tensor zeros(DType::kF32, {B, Hq, Tq, Tk});
  std::fill(zeros.data<float>(), zeros.data<float>() + zeros.numel(), 0.0f);
  AttentionInputs in = p.inputs32();
  in.attn_bias = (p.bias.defined() ? p.bias : zeros).view<float>();
  AttentionOptions ro = p.opt;
  ro.backend = Backend::kReference;
  Tensor out(DType::kF32, {B, Hq, Tq, Dv}), lse(DType::kF32, {B, Hq, Tq}), w(DType::kF32, {B, Hq, Tq, Tk}),
      ds(DType::kF32, {B, Hq, Tq, Tk});
  attention(in, {out.view<float>(), lse.view<float>(), w.view<float>()}, ro);
  Tensor gq(DType::kF32, {B, Hq, Tq, D}), gk(DType::kF32, {B, Hkv, Tk, D}), gv(DType::kF32, {B, Hkv, Tk, Dv});
  const Tensor go = f.go16.to_f32();
  attention_backward(in, out.view<float>(), lse.view<float>(), go.view<float>(),
                     {gq.view<float>(), gk.view<float>(), gv.view<float>(), View<float>(), ds.view<float>()}, ro);
  auto P = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    return w.data<float>()[((b * Hq + h) * Tq + i) * Tk + j] / keep;
  };
  auto S = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    return std::fabs(ds.data<float>()[((b * Hq + h) * Tq + i) * Tk + j]);
  };
  auto q = [&](int64_t b, int64_t h, int64_t i, int64_t c) { return std::fabs(At(p.q32, p, Hq, Tq, D, b, h, i, c)); };
  auto k = [&](int64_t b, int64_t h, int64_t j, int64_t c) { return std::fabs(At(p.k32, p, Hkv, Tk, D, b, h, j, c)); };
  auto dO = [&](int64_t b, int64_t h, int64_t i, int64_t c) {
    return std::fabs(go.data<float>()[((b * Hq + h) * Tq + i) * Dv + c]);
  };
  double q_row = 0, do_row = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Tq; ++i) {
        double sq = 0, sd = 0;
        for (int64_t c = 0; c < D; ++c) sq += q(b, h, i, c);
        for (int64_t c = 0; c < Dv; ++c) sd += dO(b, h, i, c);
        q_row = std::max(q_row, sq);
        do_row = std::max(do_row, sd);
      }
  const double max_k = finite_max_abs(p.k32), max_v = finite_max_abs(p.v32);
  const double dS_ = (D + 2) * u * scale * q_row * max_k, dP_ = (Dv + 2) * u * do_row * max_v / keep;
  const double mdp = do_row * max_v * (1 / keep + 1);
  double worst = 0;
  auto expect = [&](const char* name, double t, double pf, double A, double AP, int64_t n, int64_t x, int64_t y,
                    int64_t z, int64_t c) {
    const double bound =
        2.01 * u16 * std::fabs(pf) + 1.01 * ((u16 + 3 * dS_ + 2 * (n + 2) * u) * A + (2 * dP_ + 3 * dS_ * mdp) * AP);
    const double err = std::fabs(t - pf);
    if (bound > 0) worst = std::max(worst, err / bound);
    if (!(err <= bound)) {
      ADD_FAILURE() << name << "[" << x << "," << y << "," << z << "," << c << "]: tiles " << t << ", float32 tiles "
                    << pf << ", bound " << bound;
    }
    return err <= bound;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t j = 0; j < Tk; ++j) {
        for (int64_t c = 0; c < Dv; ++c) {  // dV[j][c] = Σ P_d·dO
          double A = 0;
          for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
            for (int64_t i = 0; i < Tq; ++i) A += P(b, h, i, j) * dO(b, h, i, c);
          const int64_t x = ((b * Hkv + hk) * Tk + j) * Dv + c;
          if (!expect("dV", tiles.v.data<float>()[x], plain.v.data<float>()[x], A, 0, G * Tq, b, hk, j, c)) {
            return worst;
          }
        }
        for (int64_t c = 0; c < D; ++c) {  // dK[j][c] = scale·Σ dS·q
          double A = 0, AP = 0;
          for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
            for (int64_t i = 0; i < Tq; ++i) A += S(b, h, i, j) * q(b, h, i, c), AP += P(b, h, i, j) * q(b, h, i, c);
          const int64_t x = ((b * Hkv + hk) * Tk + j) * D + c;
          if (!expect("dK", tiles.k.data<float>()[x], plain.k.data<float>()[x], scale * A, scale * AP, G * Tq, b, hk, j,
                      c)) {
            return worst;
          }
        }
      }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t c = 0; c < D; ++c) {  // dQ[i][c] = scale·Σ dS·k
          double A = 0, AP = 0;
          for (int64_t j = 0; j < Tk; ++j)
            A += S(b, h, i, j) * k(b, h / G, j, c), AP += P(b, h, i, j) * k(b, h / G, j, c);
          const int64_t x = ((b * Hq + h) * Tq + i) * D + c;
          if (!expect("dQ", tiles.q.data<float>()[x], plain.q.data<float>()[x], scale * A, scale * AP, Tk, b, h, i,
                      c)) {
            return worst;
          }
        }
  return worst;
}

// The tiles' gradients within the bound above of the float32 tiles', on the shapes the tiles
// cut: head dims of 1 … 4 pairs of 32 channels, row counts (G · queries per 64-row block)
// leaving an odd row tile or a half-empty 32-row step, key counts around 16, 32 and the 64-key
// block, GQA, both causal alignments, windows with sink tokens (blocks seen from a key past
// their first: the 32-key steps around them), key lengths, keep masks, a bias, softcap, dropout
// and (B, T, H, D) strides; the same bits on 1 and 2 threads; and the tiles must be the path
// that ran (P_d and dS rounded to bfloat16 move the gradients' bits).
TEST(HalfAmx, BackwardTilesStayWithinTheBound) {
  if (!kernels::backward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 150);
  int problems = 0, moved = 0;
  double worst = 0;
  auto run = [&](Problem& p) {
    p.dtype = DType::kBF16;
    p.make(rng);
    const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
    if (rng.coin(0.3)) p.keep = random_mask(rng, broadcast_shape(rng, full), rng.coin(0.5) ? 0.9 : 0.3);
    if (rng.coin(0.3)) p.bias = random_tensor(rng, full);
    if (rng.coin(0.2)) p.lengths = random_lengths(rng, p.B, p.Tk);
    const Forward f = RunForward(p, rng);
    const Grads plain = RunBackward(p, f, false), tiles = RunBackward(p, f, true), one = RunBackward(p, f, true, 1);
    worst = std::max(worst, ExpectWithinBound(p, f, tiles, plain));
    EXPECT_TRUE(bitwise_equal(one.q, tiles.q) && bitwise_equal(one.k, tiles.k) && bitwise_equal(one.v, tiles.v))
        << p.describe() << ": 1 and 2 threads differ";
    ++problems;
    moved += !bitwise_equal(tiles.q, plain.q) || !bitwise_equal(tiles.k, plain.k) || !bitwise_equal(tiles.v, plain.v);
  };
  for (int64_t D : {32, 64, 96, 128}) {
    for (int64_t Dv : {32, 64, 128}) {
      Problem p;
      p.Hkv = rng.range(1, 2);
      p.Hq = p.Hkv * rng.range(1, 4);
      p.Tq = rng.range(1, 90);
      p.Tk = rng.range(1, 200);
      p.D = D;
      p.Dv = Dv;
      p.bthd = rng.coin(0.5);
      p.opt.causal = static_cast<Causal>(rng.range(0, 2));
      if (p.opt.causal != Causal::kNone && rng.coin(0.3)) p.opt.window = rng.range(1, 50);
      run(p);
    }
  }
  for (int64_t Tk : {1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 257}) {
    Problem p;
    p.B = 2;
    p.Hkv = 1;
    p.Hq = 3;
    p.Tq = Tk % 3 == 0 ? 5 : 37;  // 15 or 111 rows: an odd row tile, a half-empty 32-row step
    p.Tk = Tk;
    p.D = 64;
    p.Dv = 64;
    p.opt.causal = Tk % 2 ? Causal::kBottomRight : Causal::kNone;
    if (Tk > 100) p.opt.window = 40, p.opt.sink_tokens = 4;
    if (Tk == 65) p.opt.softcap = 2.0f;
    if (Tk == 129 || Tk == 33) p.opt.dropout_p = 0.25f, p.opt.dropout_seed = rng.next();
    run(p);
  }
  {  // a window without sink tokens: key blocks seen from their 16th, 32nd or 48th key on
    Problem p;
    p.Hkv = 2;
    p.Hq = 2;
    p.Tq = 150;
    p.Tk = 300;
    p.D = 64;
    p.Dv = 32;
    p.opt.causal = Causal::kBottomRight;
    p.opt.window = 20;
    run(p);
  }
  EXPECT_GE(moved, problems / 2) << "the tile path did not run";
  std::printf("[ bound ] largest |tiles - float32 tiles| / bound: %.3f over %d problems\n", worst, problems);
}

// Q and dO whose channels are not adjacent (a (B, H, D, T) buffer seen as (B, H, T, D)) take the
// tiles' element-by-element packing: the same words, so the same gradient bits as contiguous
// copies of the same values (on the tiles both times: only K's and V's rows must be unit-stride).
TEST(HalfAmx, BackwardChannelStridedQueryAndGradOutGiveTheBitsOfContiguousOnes) {
  if (!kernels::backward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  Rng rng(base_seed() + 152);
  const int64_t Hq = 4, Hkv = 2, Tq = 70, Tk = 90, D = 64, Dv = 32;
  const Tensor q = random_tensor(rng, {1, Hq, Tq, D}).converted(DType::kBF16);
  const Tensor k = random_tensor(rng, {1, Hkv, Tk, D}).converted(DType::kBF16);
  const Tensor v = random_tensor(rng, {1, Hkv, Tk, Dv}).converted(DType::kBF16);
  const Tensor go = random_tensor(rng, {1, Hq, Tq, Dv}).converted(DType::kBF16);
  // The same values with each head's matrix transposed in memory (T contiguous).
  auto transposed = [](const Tensor& x) {
    const int64_t H = x.shape()[1], T = x.shape()[2], C = x.shape()[3];
    Tensor y(DType::kBF16, {1, H, C, T});
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < C; ++c)
          y.data<bfloat16>()[(h * C + c) * T + t] = x.data<bfloat16>()[(h * T + t) * C + c];
    return y;
  };
  const Tensor qt = transposed(q), got = transposed(go);
  const View<const bfloat16> q_strided(qt.data<bfloat16>(), {1, Hq, Tq, D}, {Hq * D * Tq, D * Tq, 1, Tq});
  const View<const bfloat16> go_strided(got.data<bfloat16>(), {1, Hq, Tq, Dv}, {Hq * Dv * Tq, Dv * Tq, 1, Tq});
  AttentionOptions opt;
  opt.causal = Causal::kBottomRight;
  Tensor out(DType::kBF16, {1, Hq, Tq, Dv}), lse(DType::kF32, {1, Hq, Tq});
  BasicAttentionInputs<bfloat16> in;
  in.query = q.view<bfloat16>();
  in.key = k.view<bfloat16>();
  in.value = v.view<bfloat16>();
  attention(in, {out.view<bfloat16>(), lse.view<float>(), View<bfloat16>()}, opt);
  auto grads = [&](const View<const bfloat16>& query, const View<const bfloat16>& grad_out) {
    Grads g{Tensor(DType::kBF16, {1, Hq, Tq, D}), Tensor(DType::kBF16, {1, Hkv, Tk, D}),
            Tensor(DType::kBF16, {1, Hkv, Tk, Dv})};
    BasicAttentionInputs<bfloat16> x = in;
    x.query = query;
    attention_backward(x, out.view<bfloat16>(), lse.view<float>(), grad_out,
                       {g.q.view<bfloat16>(), g.k.view<bfloat16>(), g.v.view<bfloat16>()}, opt);
    return g;
  };
  const Grads contiguous = grads(q.view<bfloat16>(), go.view<bfloat16>()), strided = grads(q_strided, go_strided);
  EXPECT_TRUE(bitwise_equal(contiguous.q, strided.q));
  EXPECT_TRUE(bitwise_equal(contiguous.k, strided.k));
  EXPECT_TRUE(bitwise_equal(contiguous.v, strided.v));
  EXPECT_GT(max_abs(contiguous.k.to_f32().view<float>()), 0.0);
}

// A call with an infinite or NaN argument takes the float32 tiles (a tile product would add
// 0 · Inf = NaN for keys around a block's range): its gradients are theirs, bit for bit, Inf and
// NaN included; the same call on finite arguments takes the tiles.
TEST(HalfAmx, BackwardWithNonFiniteArgumentsTakesTheFloatTiles) {
  if (!kernels::backward_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 here (or no tile state granted): it is not run";
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 151);
  for (int which = 0; which < 4; ++which) {
    Problem p;
    p.dtype = DType::kBF16;
    p.B = 2;
    p.Hkv = 1;
    p.Hq = 2;
    p.Tq = 40;
    p.Tk = 150;
    p.D = 64;
    p.Dv = 64;
    p.opt.causal = Causal::kBottomRight;
    p.opt.window = 30;  // keys outside a block's range but inside its 32-key steps
    p.make(rng);
    Forward f = RunForward(p, rng);
    const Grads finite = RunBackward(p, f, true), finite_plain = RunBackward(p, f, false);
    EXPECT_FALSE(bitwise_equal(finite.q, finite_plain.q) && bitwise_equal(finite.k, finite_plain.k) &&
                 bitwise_equal(finite.v, finite_plain.v))
        << "the tiles did not run on finite arguments";
    // After the forward, one key, value, query or dO entry of batch 1 infinite.
    Tensor* t = which == 0 ? &p.k16 : which == 1 ? &p.v16 : which == 2 ? &p.q16 : &f.go16;
    t->data<bfloat16>()[t->numel() / 2 + 7] = to_bfloat16(std::numeric_limits<float>::infinity());
    const Grads plain = RunBackward(p, f, false), tiles = RunBackward(p, f, true);
    auto same = [](const Tensor& a, const Tensor& b) {  // bits, NaN included
      return std::memcmp(a.data<float>(), b.data<float>(), static_cast<size_t>(a.numel()) * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same(tiles.q, plain.q) && same(tiles.k, plain.k) && same(tiles.v, plain.v))
        << "argument " << which << ": not the float32 tiles' gradients";
  }
}

}  // namespace
}  // namespace mha::test
