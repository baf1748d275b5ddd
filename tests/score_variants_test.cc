// Softcap, ALiBi and sinks through the public API: each against an equivalent formulation the
// library already had (ALiBi as an explicit bias, a sink as one more key), the fully masked
// row, and the argument checks; the module's rotary/QK-norm row kernels against a float64
// reference on every SIMD target. The attention kernels against the reference:
// flash_attention_test.cc and attention_backward_test.cc; the models' own formulas:
// tests/python/test_score_variants.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/cpu/qk_rows.h"
#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "modules/positional.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

double max_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
  return m;
}

TEST(ScoreVariants, AlibiEqualsItsExplicitBias) {
  Rng rng(base_seed() + 140);
  const int64_t B = 2, Hq = 4, Hkv = 2, D = 16;
  for (Causal causal : {Causal::kNone, Causal::kTopLeft, Causal::kBottomRight}) {
    for (int64_t Tq : {1, 5, 70}) {
      const int64_t Tk = Tq == 1 ? 300 : 90;
      SCOPED_TRACE("causal " + std::to_string(static_cast<int>(causal)) + " Tq " + std::to_string(Tq));
      const Tensor q = random_tensor(rng, {B, Hq, Tq, D}), k = random_tensor(rng, {B, Hkv, Tk, D}),
                   v = random_tensor(rng, {B, Hkv, Tk, D}), lengths = random_lengths(rng, B, Tk);
      Tensor slopes(DType::kF32, {B, Hq}), bias(DType::kF32, {B, Hq, Tq, Tk});
      for (int64_t x = 0; x < B * Hq; ++x) slopes.data<float>()[x] = std::exp2(-static_cast<float>(x % Hq + 1));
      for (int64_t b = 0; b < B; ++b) {
        const int64_t L = lengths.data<int64_t>()[b];
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t i = 0; i < Tq; ++i)
            for (int64_t j = 0; j < Tk; ++j) {
              const int64_t pos = causal == Causal::kTopLeft ? i : i + L - Tq;
              bias.view<float>().at(b, h, i, j) = -slopes.view<float>().at(b, h) * static_cast<float>(std::llabs(pos - j));
            }
      }
      AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
      in.key_lengths = lengths.view<int64_t>();
      Tensor out_a(DType::kF32, {B, Hq, Tq, D}), out_b(DType::kF32, {B, Hq, Tq, D});
      Tensor lse_a(DType::kF32, {B, Hq, Tq}), lse_b(DType::kF32, {B, Hq, Tq});
      AttentionOptions opt;
      opt.causal = causal;
      AttentionInputs with_alibi = in, with_bias = in;
      with_alibi.alibi_slopes = slopes.view<float>();
      with_bias.attn_bias = bias.view<float>();
      attention(with_alibi, {out_a.view<float>(), lse_a.view<float>()}, opt);
      attention(with_bias, {out_b.view<float>(), lse_b.view<float>()}, opt);
      EXPECT_LE(max_diff(out_a, out_b), 1e-5);
      // LSEs equal where finite (fully masked rows: -inf in both).
      for (int64_t x = 0; x < lse_a.numel(); ++x) {
        const float a = lse_a.data<float>()[x], b = lse_b.data<float>()[x];
        if (std::isinf(b)) {
          EXPECT_EQ(a, b) << x;
        } else {
          EXPECT_NEAR(a, b, 1e-4 * std::max(1.0f, std::fabs(b))) << x;
        }
      }
    }
  }
}

// A sink is a key whose score is the sink logit and whose value row is zero: prepend such a key
// (k = 0, v = 0, bias = sink for it, 0 for the others). Bottom-right alignment keeps every other
// key's visibility, since the extra key moves the last query's position by one as well.
TEST(ScoreVariants, SinkEqualsAnExtraKeyWithZeroValue) {
  Rng rng(base_seed() + 141);
  const int64_t B = 2, Hq = 6, Hkv = 3, D = 8, Dv = 5;
  for (Causal causal : {Causal::kNone, Causal::kBottomRight}) {
    for (int64_t Tq : {1, 3, 50}) {
      const int64_t Tk = Tq == 1 ? 2000 : 77;
      SCOPED_TRACE("causal " + std::to_string(static_cast<int>(causal)) + " Tq " + std::to_string(Tq));
      const Tensor q = random_tensor(rng, {B, Hq, Tq, D}), k = random_tensor(rng, {B, Hkv, Tk, D}),
                   v = random_tensor(rng, {B, Hkv, Tk, Dv}), sinks = random_tensor(rng, {Hq}, 2.0f);
      Tensor k1(DType::kF32, {B, Hkv, Tk + 1, D}), v1(DType::kF32, {B, Hkv, Tk + 1, Dv}), bias(DType::kF32, {Hq, 1, Tk + 1});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t j = 0; j <= Tk; ++j) {
            for (int64_t d = 0; d < D; ++d) k1.view<float>().at(b, h, j, d) = j ? k.view<float>().at(b, h, j - 1, d) : 0.0f;
            for (int64_t d = 0; d < Dv; ++d) v1.view<float>().at(b, h, j, d) = j ? v.view<float>().at(b, h, j - 1, d) : 0.0f;
          }
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t j = 0; j <= Tk; ++j) bias.view<float>().at(h, 0, j) = j ? 0.0f : sinks.data<float>()[h];
      AttentionOptions opt;
      opt.causal = causal;
      AttentionInputs with_sinks{q.view<float>(), k.view<float>(), v.view<float>()};
      with_sinks.sinks = sinks.view<float>();
      const AttentionInputs with_key{q.view<float>(), k1.view<float>(), v1.view<float>(), {}, bias.view<float>()};
      Tensor out_a(DType::kF32, {B, Hq, Tq, Dv}), out_b(DType::kF32, {B, Hq, Tq, Dv});
      Tensor lse_a(DType::kF32, {B, Hq, Tq}), lse_b(DType::kF32, {B, Hq, Tq});
      attention(with_sinks, {out_a.view<float>(), lse_a.view<float>()}, opt);
      attention(with_key, {out_b.view<float>(), lse_b.view<float>()}, opt);
      EXPECT_LE(max_diff(out_a, out_b), 1e-5);
      EXPECT_LE(max_diff(lse_a, lse_b), 1e-4);
      // The gradients of q, k, v are those of the extra-key formulation (its key 0 dropped).
      const Tensor dout = random_tensor(rng, {B, Hq, Tq, Dv});
      Tensor dq_a(DType::kF32, q.shape()), dk_a(DType::kF32, k.shape()), dv_a(DType::kF32, v.shape());
      Tensor dq_b(DType::kF32, q.shape()), dk_b(DType::kF32, k1.shape()), dv_b(DType::kF32, v1.shape());
      Tensor dsink(DType::kF32, {Hq});
      attention_backward(with_sinks, out_a.view<float>(), lse_a.view<float>(), dout.view<float>(),
                         {dq_a.view<float>(), dk_a.view<float>(), dv_a.view<float>(), dsink.view<float>()}, opt);
      attention_backward(with_key, out_b.view<float>(), lse_b.view<float>(), dout.view<float>(),
                         {dq_b.view<float>(), dk_b.view<float>(), dv_b.view<float>()}, opt);
      EXPECT_LE(max_diff(dq_a, dq_b), 1e-5);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t j = 0; j < Tk; ++j) {
            for (int64_t d = 0; d < D; ++d)
              EXPECT_NEAR(dk_a.view<float>().at(b, h, j, d), dk_b.view<float>().at(b, h, j + 1, d), 1e-5);
            for (int64_t d = 0; d < Dv; ++d)
              EXPECT_NEAR(dv_a.view<float>().at(b, h, j, d), dv_b.view<float>().at(b, h, j + 1, d), 1e-5);
          }
    }
  }
}

// No visible key: the output is zeros and the LSE is the sink (its term is the whole
// denominator); the backward gives zero gradients, the sink's included.
TEST(ScoreVariants, FullyMaskedRowWithSinksGivesZeros) {
  Rng rng(base_seed() + 142);
  const int64_t B = 2, Hq = 2, Tq = 3, Tk = 5, D = 4;
  const Tensor q = random_tensor(rng, {B, Hq, Tq, D}), k = random_tensor(rng, {B, Hq, Tk, D}),
               v = random_tensor(rng, {B, Hq, Tk, D}), dout = random_tensor(rng, {B, Hq, Tq, D});
  Tensor sinks(DType::kF32, {Hq}), lengths(DType::kI64, {B});
  sinks.data<float>()[0] = 0.5f;
  sinks.data<float>()[1] = -3.0f;
  lengths.data<int64_t>()[0] = 0;
  lengths.data<int64_t>()[1] = 0;
  AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  in.sinks = sinks.view<float>();
  in.key_lengths = lengths.view<int64_t>();
  for (Backend backend : {Backend::kFast, Backend::kReference}) {
    for (int64_t tq : {Tq, int64_t{1}}) {  // flash and decode kernels
      AttentionInputs row = in;
      row.query = View<const float>(q.data<float>(), {B, Hq, tq, D}, {Hq * Tq * D, Tq * D, D, 1});
      Tensor out(DType::kF32, {B, Hq, tq, D}), lse(DType::kF32, {B, Hq, tq});
      AttentionOptions opt;
      opt.backend = backend;
      opt.causal = Causal::kBottomRight;
      opt.softcap = 2.0f;
      attention(row, {out.view<float>(), lse.view<float>()}, opt);
      for (int64_t x = 0; x < out.numel(); ++x) EXPECT_EQ(out.data<float>()[x], 0.0f);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t i = 0; i < tq; ++i) EXPECT_EQ(lse.view<float>().at(b, h, i), sinks.data<float>()[h]);
      Tensor dq(DType::kF32, {B, Hq, tq, D}), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape()), ds(DType::kF32, {Hq});
      const View<const float> dout_rows(dout.data<float>(), {B, Hq, tq, D}, {Hq * Tq * D, Tq * D, D, 1});
      attention_backward(row, out.view<float>(), lse.view<float>(), dout_rows,
                         {dq.view<float>(), dk.view<float>(), dv.view<float>(), ds.view<float>()}, opt);
      for (const Tensor* g : {&dq, &dk, &dv, &ds})
        for (int64_t x = 0; x < g->numel(); ++x) EXPECT_EQ(g->data<float>()[x], 0.0f);
    }
  }
}

// StreamingLLM's sink tokens: with a window W and S sink tokens, query i sees keys j <= i with
// j > i - W or j < S — the same as an explicit keep mask of that set.
TEST(ScoreVariants, SinkTokensEqualTheirKeepMask) {
  Rng rng(base_seed() + 145);
  const int64_t B = 2, H = 2, D = 16;
  for (int64_t T : {int64_t{1}, int64_t{9}, int64_t{150}, int64_t{700}}) {
    for (int64_t Tq : {T, int64_t{1}}) {  // prefill (flash kernel) and the last row alone (decode kernel)
      // At 700 keys, 300 sink tokens: the decode kernel's first two blocks of 128 keys lie wholly
      // in the sinks (no mask), the third partly, then the gap and the window.
      const int64_t W = 7, S = T == 700 ? 300 : 3, Tk = T;
      const Tensor q = random_tensor(rng, {B, H, Tq, D}), k = random_tensor(rng, {B, H, Tk, D}),
                   v = random_tensor(rng, {B, H, Tk, D});
      Tensor keep(DType::kU8, {Tq, Tk});
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t j = 0; j < Tk; ++j) {
          const int64_t pos = i + Tk - Tq;  // bottom-right
          keep.view<uint8_t>().at(i, j) = j <= pos && (j > pos - W || j < S);
        }
      AttentionOptions with;
      with.causal = Causal::kBottomRight;
      with.window = W;
      with.sink_tokens = S;
      AttentionInputs masked{q.view<float>(), k.view<float>(), v.view<float>()};
      masked.keep_mask = keep.view<uint8_t>();
      Tensor a(DType::kF32, {B, H, Tq, D}), b(DType::kF32, {B, H, Tq, D});
      attention({q.view<float>(), k.view<float>(), v.view<float>()}, {a.view<float>()}, with);
      attention(masked, {b.view<float>()});
      EXPECT_LE(max_diff(a, b), 1e-5) << "T " << T << " Tq " << Tq;
    }
  }
  AttentionOptions bad;
  bad.sink_tokens = 2;
  Tensor out(DType::kF32, {1, 1, 1, 4});
  const Tensor x = random_tensor(rng, {1, 1, 1, 4});
  expect_error([&] { attention({x.view<float>(), x.view<float>(), x.view<float>()}, {out.view<float>()}, bad); },
               {"sink_tokens = 2", "window > 0"});
}

// KeyRange (the keys a row sees: causal alignment, window, sink tokens, key_lengths) against its
// own visible(): covers(a, b) must hold exactly when every key of [a, b) is visible, for the
// ranges visible_keys gives and for them clipped to a chunk [k0, k1) as the decode kernel clips
// them (it skips the softmax's mask and the saving of outputs on covers).
TEST(ScoreVariants, KeyRangeCoversExactlyItsVisibleSpans) {
  Rng rng(base_seed() + 146);
  int64_t covered = 0, checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    kernels::AttentionParams p;
    p.batch = 1;
    p.q_len = rng.range(1, 6);
    p.kv_len = rng.range(p.q_len, 40);
    p.causal = trial % 3 == 0 ? Causal::kNone : trial % 3 == 1 ? Causal::kTopLeft : Causal::kBottomRight;
    p.window = p.causal == Causal::kNone ? 0 : rng.range(0, 12);
    p.sink_tokens = rng.range(0, 6);
    int64_t length = rng.range(0, p.kv_len);  // key_lengths on two trials in five
    if (trial % 5 < 2) p.key_lengths = &length;
    for (int64_t i = 0; i < p.q_len; ++i) {
      const kernels::KeyRange full = kernels::visible_keys(p, 0, i);
      const int64_t k0 = rng.range(0, p.kv_len - 1), k1 = rng.range(k0 + 1, p.kv_len);
      const kernels::KeyRange chunk{std::max(full.lo, k0), std::min(full.hi, k1), std::min(full.sink_hi, k1)};
      for (const kernels::KeyRange& k : {full, chunk}) {
        for (int64_t a = 0; a < p.kv_len; ++a) {
          for (int64_t b = a + 1; b <= p.kv_len; ++b) {
            bool all = true;
            for (int64_t j = a; j < b; ++j) all = all && k.visible(j);
            ASSERT_EQ(k.covers(a, b), all) << "trial " << trial << " keys [" << a << ", " << b << ") of range {"
                                           << k.lo << ", " << k.hi << ", " << k.sink_hi << "}";
            covered += all;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(covered, checked / 20);  // the check met both answers often
  EXPECT_LT(covered, checked - checked / 20);
}

TEST(ScoreVariants, BadArgumentsAreErrors) {
  Rng rng(base_seed() + 143);
  const Tensor q = random_tensor(rng, {1, 4, 3, 8}), k = random_tensor(rng, {1, 2, 5, 8}),
               v = random_tensor(rng, {1, 2, 5, 8});
  Tensor out(DType::kF32, {1, 4, 3, 8}), lse(DType::kF32, {1, 4, 3});
  const AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  auto run = [&](const AttentionInputs& x, const AttentionOptions& o) { attention(x, {out.view<float>()}, o); };
  Tensor slopes3(DType::kF32, {3}), slopes4(DType::kF32, {4}), sinks(DType::kF32, {4});
  std::fill(slopes4.data<float>(), slopes4.data<float>() + 4, 0.1f);
  std::fill(sinks.data<float>(), sinks.data<float>() + 4, 0.0f);
  AttentionInputs x = in;
  x.alibi_slopes = slopes3.view<float>();
  expect_error([&] { run(x, {}); }, {"alibi_slopes", "(Hq,) = (4,)", "(3,)"});
  slopes4.data<float>()[2] = std::nanf("");
  x.alibi_slopes = slopes4.view<float>();
  expect_error([&] { run(x, {}); }, {"alibi_slopes[2]", "not finite"});
  x = in;
  x.sinks = slopes3.view<float>();
  expect_error([&] { run(x, {}); }, {"sinks", "(Hq,) = (4,)"});
  sinks.data<float>()[1] = kNegInf;
  x.sinks = sinks.view<float>();
  expect_error([&] { run(x, {}); }, {"sinks[1]", "not finite"});
  AttentionOptions o;
  o.softcap = -1.0f;
  expect_error([&] { run(in, o); }, {"softcap", "-1"});
  o.softcap = std::numeric_limits<float>::infinity();
  expect_error([&] { run(in, o); }, {"softcap", "inf"});
  // The backward needs grad_sinks exactly when sinks are given.
  sinks.data<float>()[1] = 0.0f;
  x.sinks = sinks.view<float>();
  attention(x, {out.view<float>(), lse.view<float>()});
  Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape()), ds(DType::kF32, {2});
  expect_error([&] { attention_backward(x, out.view<float>(), lse.view<float>(), out.view<float>(),
                                        {dq.view<float>(), dk.view<float>(), dv.view<float>()}); },
               {"grad_sinks", "(Hq,) = (4,)"});
  expect_error([&] { attention_backward(x, out.view<float>(), lse.view<float>(), out.view<float>(),
                                        {dq.view<float>(), dk.view<float>(), dv.view<float>(), ds.view<float>()}); },
               {"grad_sinks", "(Hq,) = (4,)", "(2,)"});
  expect_error([&] { attention_backward(in, out.view<float>(), lse.view<float>(), out.view<float>(),
                                        {dq.view<float>(), dk.view<float>(), dv.view<float>(), ds.view<float>()}); },
               {"grad_sinks", "without sinks"});
}

// The module with every variant on: decoding (prefill, then one token at a time) gives the
// forward's output on every cache type — the cache holds rotated keys, ALiBi measures positions
// (a windowed ring holds them out of order), sinks and softcap reach the decode kernel.
TEST(ModuleVariants, StepEqualsForwardOnCacheTypes) {
  Rng rng(base_seed() + 144);
  struct Case {
    int64_t window, sink_tokens;
    bool alibi;
  };
  // No window; a window (its ring gathered for ALiBi); a window with StreamingLLM sink tokens.
  for (const Case cs : {Case{0, 0, true}, Case{5, 0, true}, Case{4, 3, false}}) {
    const int64_t window = cs.window;
    MultiHeadAttentionConfig c;
    c.embed_dim = 32;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.causal = Causal::kTopLeft;
    c.window = window;
    c.sink_tokens = cs.sink_tokens;
    c.softcap = 3.0f;
    c.alibi = cs.alibi;
    c.sinks = c.qk_norm = true;
    c.rotary.dims = 6;
    MultiHeadAttention m(c, 3);
    const View<float> sinks = m.sinks();
    for (int64_t h = 0; h < 4; ++h) sinks.data[h] = static_cast<float>(rng.uniform() - 0.5);
    const View<float> qn = m.q_norm_weight();
    for (int64_t d = 0; d < 8; ++d) qn.data[d] = static_cast<float>(0.5 + rng.uniform());
    const int64_t B = 2, T = 15, E = 32;
    const Tensor x = random_tensor(rng, {B, T, E});
    const Tensor full = std::move(m.forward({x.view<float>()}).output);
    for (CacheType type : {CacheType::kF32, CacheType::kBF16, CacheType::kInt8}) {
      SCOPED_TRACE(std::string("window ") + std::to_string(window) + " sink tokens " + std::to_string(cs.sink_tokens) +
                   " cache " + cache_type_name(type));
      KvCache cache = m.make_cache(B, 0, type);
      Tensor got(DType::kF32, {B, T, E});
      int64_t t0 = 0;
      for (int64_t n : {int64_t{6}, int64_t{1}, int64_t{1}, int64_t{3}, int64_t{1}, int64_t{1}, int64_t{1},
                        int64_t{1}}) {
        const View<const float> xs(x.data<float>() + t0 * E, {B, n, E}, {T * E, E, 1});
        const Tensor y = std::move(m.step(xs, cache).output);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < n; ++t)
            for (int64_t e = 0; e < E; ++e) got.view<float>().at(b, t0 + t, e) = y.view<float>().at(b, t, e);
        t0 += n;
      }
      ASSERT_EQ(t0, T);
      double scale = 0;
      for (int64_t i = 0; i < full.numel(); ++i) scale = std::max(scale, std::fabs(double{full.data<float>()[i]}));
      // float32: the same computation in another order; bfloat16 and int8 store k and v rounded
      // (their own bounds, docs/numerics.md); a wrong position would be off by O(1).
      const double bound = type == CacheType::kF32 ? 1e-5 : 3e-2;
      EXPECT_LE(max_diff(got, full) / scale, bound);
    }
  }
}

TEST(ModuleVariants, ConfigAndWeightErrors) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 16;
  c.num_heads = 2;
  auto make = [&](auto edit) {
    MultiHeadAttentionConfig x = c;
    edit(x);
    MultiHeadAttention m(x);
  };
  expect_error([&] { make([](auto& x) { x.rotary.dims = 5; }); }, {"rotary.dims", "even", "8", "5"});
  expect_error([&] { make([](auto& x) { x.rotary.dims = 10; }); }, {"rotary.dims", "head_dim_qk = 8"});
  expect_error([&] { make([](auto& x) { x.rotary.dims = 8, x.rotary.theta = 0.5f; }); }, {"rotary.theta"});
  expect_error([&] { make([](auto& x) { x.rotary.dims = 8, x.rotary.factor = 0; }); }, {"rotary.factor"});
  expect_error([&] { make([](auto& x) { x.rotary.dims = 8, x.rotary.scaling = RopeScaling::kYarn; }); },
               {"YaRN", "original_max_positions"});
  expect_error([&] { make([](auto& x) { x.softcap = -2; }); }, {"softcap", "-2"});
  expect_error([&] { make([](auto& x) { x.qk_norm_eps = 0; }); }, {"qk_norm_eps"});
  expect_error([&] { make([](auto& x) { x.sink_tokens = 4; }); }, {"sink_tokens = 4", "window > 0"});
  expect_error([&] { make([](auto& x) { x.causal = Causal::kTopLeft, x.window = 8, x.sink_tokens = 4, x.alibi = true; }); },
               {"sink_tokens with alibi"});
  MultiHeadAttention plain(c);
  expect_error([&] { plain.sinks(); }, {"sinks", "config.sinks is false"});
  expect_error([&] { plain.q_norm_weight(); }, {"QK-norm"});
  expect_error([&] { (void)static_cast<const MultiHeadAttention&>(plain).alibi_slopes(); }, {"ALiBi"});
  // Weights: the file and the module must agree on sinks and QK-norm.
  MultiHeadAttentionConfig with = c;
  with.sinks = with.qk_norm = true;
  MultiHeadAttention m(with);
  StateDict sd = m.state_dict();
  ASSERT_EQ(sd.count("sinks"), 1u);
  ASSERT_EQ(sd.count("q_norm.weight"), 1u);
  expect_error([&] { plain.load_state_dict(sd); }, {"'sinks'", "built without it"});
  sd.erase("k_norm.weight");
  expect_error([&] { m.load_state_dict(sd); }, {"'k_norm.weight' is missing"});
  // from_state_dict turns sinks and QK-norm on from the names.
  const MultiHeadAttention back = MultiHeadAttention::from_state_dict(m.state_dict(), c);
  EXPECT_TRUE(back.config().sinks);
  EXPECT_TRUE(back.config().qk_norm);
  // ALiBi slopes: BLOOM's for a head count that is not a power of two (6: 2^-8/4·{1..4}, then
  // 2^-8/8·{1, 3}).
  MultiHeadAttentionConfig six = c;
  six.embed_dim = 24;
  six.num_heads = 6;
  six.alibi = true;
  const MultiHeadAttention a(six);
  const float want[6] = {0.25f, 0.0625f, 0.015625f, 0.00390625f, 0.5f, 0.125f};
  for (int h = 0; h < 6; ++h) EXPECT_EQ(a.alibi_slopes().data[h], want[h]) << h;
}

// The vectorised rows of QK-norm and rotary (kernels/cpu/qk_rows.cc) against a float64 reference
// on random shapes: head dims around the vector widths (tails, pairs straddling vectors in
// neither layout), partial rotary dims, in place and not, views strided as the module's packed
// projections, positions shared (a forward) or per sequence (decoding), > 32 tokens (the
// backward's task chunks). Bounds: docs/numerics.md ("Rotary … QK-norm").
class PositionalRows : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { kernels::force_simd_target(GetParam()); }
  void TearDown() override { kernels::force_simd_target(""); }
};

TEST_P(PositionalRows, EqualFloat64Reference) {
  Rng rng(base_seed() + 150);
  constexpr double u = std::numeric_limits<float>::epsilon() / 2;
  const int64_t head_dims[] = {2, 6, 8, 16, 30, 32, 48, 64, 72, 130};
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t B = rng.range(1, 2), H = rng.range(1, 3), T = rng.range(1, 40), D = head_dims[trial % 10];
    RotaryConfig rc;
    rc.dims = 2 * rng.range(0, D / 2);
    rc.interleaved = rng.coin();
    rc.theta = rng.coin() ? 10000.0f : 100.0f;
    if (rc.dims > 2 && rng.coin()) rc.scaling = RopeScaling::kYarn, rc.factor = 4, rc.original_max_positions = 16;
    const bool norm = rc.dims == 0 || rng.coin(), in_place = !norm || rng.coin(), shared = rng.coin();
    const float eps = 1e-6f;
    const modules::RotaryFreqs f = modules::rotary_freqs(rc);
    std::vector<int64_t> first(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) first[static_cast<size_t>(b)] = shared ? 3 : rng.range(0, 100);
    // Token-major rows of width W > H·D (a packed projection), heads at offset 1 (unaligned).
    const int64_t W = H * D + 5;
    auto heads = [&](Tensor& t) { return View<float>(t.data<float>() + 1, {B, H, T, D}, {T * W, D, W, 1}); };
    Tensor x = random_tensor(rng, {B, T, W}), y = in_place ? Tensor() : random_tensor(rng, {B, T, W});
    Tensor g = random_tensor(rng, {B, T, W}), w = random_tensor(rng, {D}), dw(DType::kF32, {D});
    std::fill(dw.data<float>(), dw.data<float>() + D, 0.5f);
    const Tensor x0 = x.clone(), g0 = g.clone();
    // k: a copy of q's rows, which must come out with the same bits.
    Tensor kx = x.clone(), ky = in_place ? Tensor() : y.clone(), kg = g.clone(), kdw = dw.clone();
    const float* wp = norm ? w.data<float>() : nullptr;
    const View<float> xv = heads(x), yv = in_place ? xv : heads(y), kxv = heads(kx), kyv = in_place ? kxv : heads(ky);
    modules::transform_qk(f, eps, {xv, yv, wp}, first, {kxv, kyv, wp}, first, 1);
    // The backward reads the forward's input rows.
    Tensor xin = x0.clone();
    modules::transform_qk_backward(f, eps, {heads(xin), heads(g), wp, norm ? dw.data<float>() : nullptr}, first,
                                   {heads(xin), heads(kg), wp, norm ? kdw.data<float>() : nullptr}, first, 2);
    const Tensor& qout = in_place ? x : y;
    const Tensor& kout = in_place ? kx : ky;
    ASSERT_EQ(max_diff(qout, kout), 0.0) << GetParam() << " trial " << trial;
    ASSERT_EQ(max_diff(g, kg), 0.0) << GetParam() << " trial " << trial;
    ASSERT_EQ(max_diff(dw, kdw), 0.0) << GetParam() << " trial " << trial;
    std::vector<double> dw_ref(static_cast<size_t>(D), 0.0), dw_mag(static_cast<size_t>(D), 0.0);
    const float* out = in_place ? x.data<float>() : y.data<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const double pos = static_cast<double>(first[static_cast<size_t>(b)] + t);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = (b * T + t) * W + 1 + h * D;
          const float* xr = x0.data<float>() + at;
          double ms = 0;
          for (int64_t d = 0; d < D; ++d) ms += static_cast<double>(xr[d]) * xr[d];
          const double inv = norm ? 1 / std::sqrt(ms / D + eps) : 1;
          std::vector<double> xh(static_cast<size_t>(D)), yr(static_cast<size_t>(D)), gr(static_cast<size_t>(D));
          double ymax = 0;
          for (int64_t d = 0; d < D; ++d) {
            xh[d] = xr[d] * inv;
            yr[d] = norm ? xh[d] * w.data<float>()[d] : xr[d];
            ymax = std::max(ymax, std::fabs(yr[d]));
            gr[d] = g0.data<float>()[at + d];
          }
          // Rotate y by +angle (forward) and g by −angle (the transpose).
          for (int64_t i = 0; i < rc.dims / 2; ++i) {
            const double angle = pos * f.inv_freq[static_cast<size_t>(i)];
            const double c = std::cos(angle) * f.attention_factor, s = std::sin(angle) * f.attention_factor;
            const int64_t a = rc.interleaved ? 2 * i : i, z = rc.interleaved ? 2 * i + 1 : i + rc.dims / 2;
            const double ya = yr[a], yz = yr[z], ga = gr[a], gz = gr[z];
            yr[a] = ya * c - yz * s, yr[z] = ya * s + yz * c;
            gr[a] = ga * c + gz * s, gr[z] = -ga * s + gz * c;
          }
          // Forward: mean of squares (≤ (D + 2)u relative), the scaling and the rotation (≤ 6u).
          const double ytol = (static_cast<double>(D) + 16) * u * ymax * f.attention_factor;
          for (int64_t d = 0; d < D; ++d) ASSERT_NEAR(out[at + d], yr[d], ytol) << GetParam() << " trial " << trial << " d " << d;
          // Backward: dx = inv·(g' ⊙ w − x̂·mean(g' ⊙ w ⊙ x̂)), dw += g' ⊙ x̂.
          double dot = 0, dot_mag = 0, gmax = 0, xmax = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double gw = norm ? gr[d] * w.data<float>()[d] : gr[d];
            dot += gw * xh[d], dot_mag += std::fabs(gw * xh[d]);
            gmax = std::max(gmax, std::fabs(gw)), xmax = std::max(xmax, std::fabs(xh[d]));
            dw_ref[d] += gr[d] * xh[d], dw_mag[d] += std::fabs(gr[d] * xh[d]);
          }
          const double gtol = (static_cast<double>(D) + 16) * u * inv * (gmax + xmax * dot_mag / D) *
                              std::max(1.0, f.attention_factor);
          for (int64_t d = 0; d < D; ++d) {
            const double want = norm ? inv * (gr[d] * w.data<float>()[d] - xh[d] * dot / D) : gr[d];
            ASSERT_NEAR(g.data<float>()[at + d], want, gtol) << GetParam() << " trial " << trial << " d " << d;
          }
        }
      }
    }
    // dw: per task of ≤ 32 tokens a float sum of ≤ 32·H terms, the tasks summed in double.
    if (norm) {
      for (int64_t d = 0; d < D; ++d) {
        const double tol = (32.0 * static_cast<double>(H) + 16) * u * dw_mag[d] + 0.5 * u;
        ASSERT_NEAR(dw.data<float>()[d], 0.5 + dw_ref[d], tol) << GetParam() << " trial " << trial << " dw " << d;
      }
    }
  }
}

// The same row gives the same bits wherever its buffers lie (docs/numerics.md, "Same bits"):
// the row kernels with x, g, dw (backward) or in, out (forward) placed at many distances from
// each other in one buffer. Built with GCC's default FMA contraction, the backward at D = 8
// differed for two placements in three: the compiler versions a loop by pointer checks and fused
// its two copies differently.
TEST_P(PositionalRows, SameBitsAtAnyAddress) {
  Rng rng(base_seed() + 151);
  for (const int64_t D : {2, 6, 8, 12, 16, 30, 72}) {
    std::vector<float> x0(static_cast<size_t>(D)), g0(x0), w(x0), c(x0), sn(x0);
    for (int64_t d = 0; d < D; ++d) {
      x0[d] = rng.normal(), g0[d] = rng.normal(), w[d] = rng.normal();
      c[d] = std::cos(0.3f * d), sn[d] = std::sin(0.3f * d);
    }
    for (const bool rotate : {false, true}) {
      const kernels::RowRotation r{c.data(), sn.data(), rotate ? D / 2 : 0, false};
      std::vector<float> want_g, want_y;
      int placements = 0;
      for (int64_t gap = -3 * D; gap <= 3 * D; gap += 1 + D / 8) {
        for (int64_t dw_gap = -3 * D; dw_gap <= 3 * D; dw_gap += 1 + D / 3) {
          if (std::abs(gap) < D || std::abs(dw_gap) < D || std::abs(gap - dw_gap) < D) continue;  // disjoint rows
          std::vector<float> buf(static_cast<size_t>(8 * D), 0.0f);
          float* x = buf.data() + 4 * D;
          float* g = x + gap;
          float* dw = x + dw_gap;
          std::copy(x0.begin(), x0.end(), x), std::copy(g0.begin(), g0.end(), g);
          kernels::qk_rows_backward(x, D, g, D, 1, D, w.data(), 1e-6f, r, dw);
          const std::vector<float> got_g(g, g + D);
          // The forward: x → g's place (out of place), dw's place unused.
          kernels::qk_rows_forward(x, D, g, D, 1, D, w.data(), 1e-6f, r);
          const std::vector<float> got_y(g, g + D);
          if (placements++ == 0) want_g = got_g, want_y = got_y;
          ASSERT_EQ(got_g, want_g) << GetParam() << " D " << D << " gap " << gap << " dw_gap " << dw_gap;
          ASSERT_EQ(got_y, want_y) << GetParam() << " D " << D << " gap " << gap;
        }
      }
      ASSERT_GT(placements, 10);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, PositionalRows, ::testing::ValuesIn(kernels::simd_targets()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace mha::test
