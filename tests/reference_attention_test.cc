// The reference attention against an independent naive formula, and its documented semantics:
// masks, causal alignment, fully masked rows, NaN, dropout, threads.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "mha/attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// A random problem: shapes, layouts, masks and options drawn from `rng`.
struct Problem {
  int64_t B, Hq, Hkv, Tq, Tk, D, Dv;
  Tensor q, k, v, keep, bias, lengths;
  AttentionInputs in;
  AttentionOptions opt;
  std::string describe() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "B=%ld Hq=%ld Hkv=%ld Tq=%ld Tk=%ld D=%ld Dv=%ld causal=%d window=%ld keep=%d bias=%d len=%d",
                  (long)B, (long)Hq, (long)Hkv, (long)Tq, (long)Tk, (long)D, (long)Dv, (int)opt.causal, (long)opt.window,
                  in.keep_mask.given(), in.attn_bias.given(), in.key_lengths.given());
    return buf;
  }
};

Problem random_problem(Rng& rng, int64_t max_t = 40, int64_t max_d = 40) {
  Problem p;
  p.B = rng.range(1, 3);
  p.Hkv = rng.range(1, 3);
  p.Hq = p.Hkv * (int64_t{1} << rng.range(0, 2));
  p.Tq = rng.range(1, max_t);
  p.Tk = rng.coin(0.3) ? p.Tq : rng.range(1, max_t);
  p.D = rng.range(1, max_d);
  p.Dv = rng.coin(0.5) ? p.D : rng.range(1, max_d);
  // Half the problems in (B, T, H, D) memory, seen through strides as (B, H, T, D).
  auto make = [&](int64_t H, int64_t T, int64_t D, Tensor* t) {
    if (rng.coin(0.5)) {
      *t = random_tensor(rng, {p.B, H, T, D});
      return View<const float>(t->data<float>(), {p.B, H, T, D});
    }
    *t = random_tensor(rng, {p.B, T, H, D});
    return View<const float>(t->data<float>(), {p.B, H, T, D}, {T * H * D, D, H * D, 1});
  };
  p.in.query = make(p.Hq, p.Tq, p.D, &p.q);
  p.in.key = make(p.Hkv, p.Tk, p.D, &p.k);
  p.in.value = make(p.Hkv, p.Tk, p.Dv, &p.v);
  const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
  if (rng.coin(0.4)) {
    p.keep = random_mask(rng, broadcast_shape(rng, full), 0.7);
    p.in.keep_mask = p.keep.view<uint8_t>();
  }
  if (rng.coin(0.4)) {
    p.bias = random_tensor(rng, broadcast_shape(rng, full));
    p.in.attn_bias = p.bias.view<float>();
  }
  if (rng.coin(0.3)) {
    p.lengths = random_lengths(rng, p.B, p.Tk);
    p.in.key_lengths = p.lengths.view<int64_t>();
  }
  p.opt.causal = static_cast<Causal>(rng.range(0, 2));
  if (p.opt.causal != Causal::kNone && rng.coin(0.3)) p.opt.window = rng.range(1, 8);
  if (rng.coin(0.2)) p.opt.scale = static_cast<float>(rng.uniform() * 0.5);
  p.opt.backend = Backend::kReference;
  return p;
}

TEST(ReferenceAttention, MatchesNaiveFormulaOnRandomProblems) {
  const uint64_t seed = base_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with MHA_TEST_SEED)");
  Rng rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    Problem p = random_problem(rng);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + p.describe());
    Tensor out(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), lse(DType::kF32, {p.B, p.Hq, p.Tq});
    Tensor w(DType::kF32, {p.B, p.Hq, p.Tq, p.Tk}), wavg(DType::kF32, {p.B, p.Tq, p.Tk});
    attention(p.in, {out.view<float>(), lse.view<float>(), w.view<float>()}, p.opt);
    Tensor out2(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv});
    attention(p.in, {out2.view<float>(), {}, wavg.view<float>()}, p.opt);
    ASSERT_TRUE(bitwise_equal(out, out2));

    const NaiveResult want = naive_attention(p.in, p.opt);
    const float* o = out.data<float>();
    double scale = 1e-30;
    for (double x : want.out) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < want.out.size(); ++i) ASSERT_NEAR(o[i], want.out[i], 1e-6 * scale) << "out index " << i;
    for (size_t i = 0; i < want.lse.size(); ++i) {
      if (std::isinf(want.lse[i])) {
        ASSERT_EQ(lse.data<float>()[i], -kInf) << "lse index " << i;
      } else {
        ASSERT_NEAR(lse.data<float>()[i], want.lse[i], 1e-6 * std::max(1.0, std::fabs(want.lse[i])));
      }
    }
    for (size_t i = 0; i < want.weights.size(); ++i) ASSERT_NEAR(w.data<float>()[i], want.weights[i], 1e-7);
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t i = 0; i < p.Tq; ++i)
        for (int64_t j = 0; j < p.Tk; ++j) {
          double mean = 0;
          for (int64_t h = 0; h < p.Hq; ++h) mean += want.weights[((b * p.Hq + h) * p.Tq + i) * p.Tk + j];
          ASSERT_NEAR(wavg.data<float>()[(b * p.Tq + i) * p.Tk + j], mean / p.Hq, 1e-7);
        }
  }
}

// Small fixed problem helpers.
struct Small {
  Tensor q, k, v, out, lse, w;
  AttentionInputs in;
  Small(int64_t Tq, int64_t Tk, int64_t D = 4, uint64_t seed = 1) {
    Rng rng(seed);
    q = random_tensor(rng, {1, 1, Tq, D});
    k = random_tensor(rng, {1, 1, Tk, D});
    v = random_tensor(rng, {1, 1, Tk, D});
    out = Tensor(DType::kF32, {1, 1, Tq, D});
    lse = Tensor(DType::kF32, {1, 1, Tq});
    w = Tensor(DType::kF32, {1, 1, Tq, Tk});
    in.query = q.view<float>();
    in.key = k.view<float>();
    in.value = v.view<float>();
  }
  void run(AttentionOptions opt) {
    opt.backend = Backend::kReference;
    attention(in, {out.view<float>(), lse.view<float>(), w.view<float>()}, opt);
  }
  float weight(int64_t i, int64_t j) const { return w.data<float>()[i * w.shape()[3] + j]; }
};

TEST(ReferenceAttention, CausalAlignmentsDifferWhenLengthsDiffer) {
  Small s(2, 4);
  AttentionOptions opt;
  opt.causal = Causal::kTopLeft;
  s.run(opt);
  // Top-left: query 0 sees key 0; query 1 sees keys 0..1.
  EXPECT_GT(s.weight(0, 0), 0.99f);
  EXPECT_EQ(s.weight(0, 1), 0.0f);
  EXPECT_EQ(s.weight(1, 2), 0.0f);
  opt.causal = Causal::kBottomRight;
  s.run(opt);
  // Bottom-right: query 0 sees keys 0..2; query 1 sees all 4.
  EXPECT_GT(s.weight(0, 2), 0.0f);
  EXPECT_EQ(s.weight(0, 3), 0.0f);
  EXPECT_GT(s.weight(1, 3), 0.0f);
}

TEST(ReferenceAttention, BottomRightAlignsWithKeyLengths) {
  Small s(2, 6);
  Tensor len(DType::kI64, {1});
  len.data<int64_t>()[0] = 4;
  s.in.key_lengths = len.view<int64_t>();
  AttentionOptions opt;
  opt.causal = Causal::kBottomRight;
  s.run(opt);
  // The last query sees keys 0..3 (the last valid key), the first 0..2.
  EXPECT_GT(s.weight(1, 3), 0.0f);
  EXPECT_EQ(s.weight(1, 4), 0.0f);
  EXPECT_GT(s.weight(0, 2), 0.0f);
  EXPECT_EQ(s.weight(0, 3), 0.0f);
}

TEST(ReferenceAttention, SlidingWindowSeesWKeys) {
  Small s(6, 6);
  AttentionOptions opt;
  opt.causal = Causal::kTopLeft;
  opt.window = 2;
  s.run(opt);
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 6; ++j) EXPECT_EQ(s.weight(i, j) > 0.0f, j <= i && j > i - 2) << i << "," << j;
}

TEST(ReferenceAttention, FullyMaskedRowsGiveZerosAndMinusInfLse) {
  // Tq > Tk with bottom-right alignment leaves the first Tq - Tk queries with no key.
  Small s(5, 3);
  AttentionOptions opt;
  opt.causal = Causal::kBottomRight;
  s.run(opt);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(s.lse.data<float>()[i], -kInf);
    for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(s.out.data<float>()[i * 4 + d], 0.0f);
  }
  EXPECT_TRUE(std::isfinite(s.lse.data<float>()[2]));

  // All keys masked by keep_mask, by key_lengths = 0, or by a -inf bias.
  Small m(3, 4);
  Tensor keep(DType::kU8, {4});  // all false
  m.in.keep_mask = keep.view<uint8_t>();
  m.run({});
  Tensor len(DType::kI64, {1});
  Small l(3, 4);
  l.in.key_lengths = len.view<int64_t>();
  l.run({});
  Small n(3, 4);
  Tensor bias(DType::kF32, {1});
  bias.data<float>()[0] = -kInf;
  n.in.attn_bias = bias.view<float>();
  n.run({});
  for (const Small* x : {&m, &l, &n}) {
    for (int64_t i = 0; i < x->out.numel(); ++i) ASSERT_EQ(x->out.data<float>()[i], 0.0f);
    for (int64_t i = 0; i < 3; ++i) ASSERT_EQ(x->lse.data<float>()[i], -kInf);
    for (int64_t i = 0; i < x->w.numel(); ++i) ASSERT_EQ(x->w.data<float>()[i], 0.0f);
  }
}

TEST(ReferenceAttention, FiniteHugeNegativeBiasIsNotMasking) {
  // A finite bias on every key shifts the scores; softmax ignores shifts, so even -1e9 leaves
  // the row as it was (the reference adds in double). Only keep_mask, lengths, causal or -inf mask.
  Small plain(2, 4), shifted(2, 4);
  plain.run({});
  Tensor bias(DType::kF32, {1});
  bias.data<float>()[0] = -1e9f;
  shifted.in.attn_bias = bias.view<float>();
  shifted.run({});
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 4; ++j) EXPECT_NEAR(shifted.weight(i, j), plain.weight(i, j), 1e-6f);
  EXPECT_GT(shifted.weight(0, 0), 0.0f);
}

TEST(ReferenceAttention, NaNPropagatesAndIsNeverHidden) {
  Small s(3, 4);
  s.q.data<float>()[1 * 4 + 2] = std::nanf("");  // query row 1
  s.run({});
  for (int64_t d = 0; d < 4; ++d) EXPECT_TRUE(std::isnan(s.out.data<float>()[4 + d]));
  EXPECT_TRUE(std::isnan(s.lse.data<float>()[1]));
  EXPECT_FALSE(std::isnan(s.out.data<float>()[0]));

  Small t(3, 4);
  t.v.data<float>()[2 * 4] = std::nanf("");  // value row 2 reaches every query
  t.run({});
  for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(std::isnan(t.out.data<float>()[i * 4]));
}

TEST(ReferenceAttention, ZeroSizedInputsAreDefined) {
  for (auto [Tq, Tk] : {std::pair<int64_t, int64_t>{0, 5}, {5, 0}, {0, 0}}) {
    Small s(Tq, Tk);
    s.run({});
    for (int64_t i = 0; i < s.out.numel(); ++i) EXPECT_EQ(s.out.data<float>()[i], 0.0f);
    for (int64_t i = 0; i < s.lse.numel(); ++i) EXPECT_EQ(s.lse.data<float>()[i], -kInf);
  }
  Tensor q(DType::kF32, {0, 2, 3, 4}), k(DType::kF32, {0, 1, 3, 4}), out(DType::kF32, {0, 2, 3, 4});
  for (Backend backend : {Backend::kReference, Backend::kFast}) {
    AttentionOptions opt;
    opt.backend = backend;
    attention({q.view<float>(), k.view<float>(), k.view<float>()}, {out.view<float>()}, opt);
  }
}

TEST(ReferenceAttention, SameBitsForAnyThreadCount) {
  Rng rng(base_seed() + 1);
  for (int trial = 0; trial < 20; ++trial) {
    Problem p = random_problem(rng);
    p.opt.dropout_p = trial % 2 ? 0.3f : 0.0f;
    p.opt.dropout_seed = 77;
    Tensor a(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), b(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv});
    p.opt.backend = Backend::kReference;
    p.opt.num_threads = 1;
    attention(p.in, {a.view<float>()}, p.opt);
    p.opt.num_threads = 2;
    attention(p.in, {b.view<float>()}, p.opt);
    ASSERT_TRUE(bitwise_equal(a, b)) << p.describe();
  }
}

TEST(ReferenceAttention, DropoutIsSeededRegenerableAndHasTheRightRate) {
  Rng rng(base_seed() + 2);
  const int64_t B = 2, H = 3, T = 64, S = 80, D = 8;
  Tensor q = random_tensor(rng, {B, H, T, D}), k = random_tensor(rng, {B, H, S, D}), v = random_tensor(rng, {B, H, S, D});
  AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  auto run = [&](float p, uint64_t seed, Tensor* w) {
    Tensor out(DType::kF32, {B, H, T, D});
    *w = Tensor(DType::kF32, {B, H, T, S});
    AttentionOptions opt;
    opt.backend = Backend::kReference;
    opt.dropout_p = p;
    opt.dropout_seed = seed;
    attention(in, {out.view<float>(), {}, w->view<float>()}, opt);
    return out;
  };
  Tensor w0, w1, w2, w3;
  run(0.0f, 0, &w0);
  const Tensor a = run(0.25f, 5, &w1);
  const Tensor b = run(0.25f, 5, &w2);
  run(0.25f, 6, &w3);
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_TRUE(bitwise_equal(w1, w2));
  EXPECT_FALSE(bitwise_equal(w1, w3));
  // Kept weights are the undropped ones scaled by 1/(1-p); the dropped fraction is p.
  int64_t dropped = 0;
  const int64_t n = w0.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float x = w1.data<float>()[i], x0 = w0.data<float>()[i];
    if (x == 0.0f) {
      ++dropped;
    } else {
      ASSERT_NEAR(x, x0 / 0.75f, 1e-6f);
    }
  }
  const double rate = static_cast<double>(dropped) / n, sigma = std::sqrt(0.25 * 0.75 / n);
  EXPECT_NEAR(rate, 0.25, 5 * sigma);
  // The output is the dropped weights times V.
  for (int64_t r = 0; r < B * H * T; ++r)
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0;
      const int64_t bh = r / T;
      for (int64_t j = 0; j < S; ++j) acc += static_cast<double>(w1.data<float>()[r * S + j]) * v.data<float>()[(bh * S + j) * D + d];
      ASSERT_NEAR(a.data<float>()[r * D + d], acc, 1e-5);
    }
  // p = 1 drops everything.
  const Tensor z = run(1.0f, 5, &w1);
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.data<float>()[i], 0.0f);
}

}  // namespace
}  // namespace mha::test
