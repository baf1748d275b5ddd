// varlen_attention: packed sequences of different lengths against each sequence run alone —
// the float64 naive attention on it (independent oracle) and attention() on a contiguous copy
// (the same bits: varlen only maps views); the backward against attention_backward() on the
// copies; bad offsets and shapes are errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "mha/varlen.h"
#include "test_util.h"

namespace mha::test {
namespace {

struct Packed {
  int64_t Hq = 4, Hkv = 2, D = 16, Dv = 16;
  std::vector<int64_t> nq, nk;  // per sequence
  Tensor q, k, v, cq, ck;       // (total, H, D) and offsets
  BasicVarlenInputs<float> in;

  void make(Rng& rng) {
    const int64_t S = static_cast<int64_t>(nq.size());
    cq = Tensor(DType::kI64, {S + 1});
    ck = Tensor(DType::kI64, {S + 1});
    cq.data<int64_t>()[0] = ck.data<int64_t>()[0] = 0;
    for (int64_t s = 0; s < S; ++s) {
      cq.data<int64_t>()[s + 1] = cq.data<int64_t>()[s] + nq[s];
      ck.data<int64_t>()[s + 1] = ck.data<int64_t>()[s] + nk[s];
    }
    q = random_tensor(rng, {cq.data<int64_t>()[S], Hq, D});
    k = random_tensor(rng, {ck.data<int64_t>()[S], Hkv, D});
    v = random_tensor(rng, {ck.data<int64_t>()[S], Hkv, Dv});
    in = {q.view<float>(), k.view<float>(), v.view<float>(), cq.view<int64_t>(), ck.view<int64_t>()};
  }
  int64_t q0(int64_t s) const { return cq.data<int64_t>()[s]; }
  int64_t k0(int64_t s) const { return ck.data<int64_t>()[s]; }
};

// Rows [r0, r0 + n) of x (total, H, D) as a contiguous (1, H, n, D) tensor, and back.
Tensor to_heads(const Tensor& x, int64_t r0, int64_t n) {
  const int64_t H = x.shape()[1], D = x.shape()[2];
  Tensor t(DType::kF32, {1, H, n, D});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) t.view<float>().at(0, h, i, e) = x.view<float>().at(r0 + i, h, e);
  return t;
}

void expect_rows_equal(const Tensor& packed, int64_t r0, const Tensor& heads, const std::string& what) {
  const int64_t H = heads.shape()[1], n = heads.shape()[2], D = heads.shape()[3];
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) {
        const float a = packed.view<float>().at(r0 + i, h, e), b = heads.view<float>().at(0, h, i, e);
        differ += !(a == b || (std::isnan(a) && std::isnan(b)));
      }
  EXPECT_EQ(differ, 0) << what;
}

TEST(Varlen, EachSequenceAsIfAlone) {
  Rng rng(base_seed() + 900);
  for (int trial = 0; trial < 30; ++trial) {
    Packed p;
    p.Hkv = rng.range(1, 3);
    p.Hq = p.Hkv * rng.range(1, 3);
    p.D = rng.range(1, 70);
    p.Dv = rng.coin() ? p.D : rng.range(1, 40);
    const int64_t S = rng.range(1, 5);
    for (int64_t s = 0; s < S; ++s) {
      p.nq.push_back(rng.coin(0.15) ? 0 : rng.range(1, 90));
      p.nk.push_back(rng.coin(0.1) ? 0 : rng.range(1, 90));
    }
    p.make(rng);
    AttentionOptions opt;
    opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (opt.causal != Causal::kNone && rng.coin(0.3)) opt.window = rng.range(1, 20);
    if (rng.coin(0.2)) opt.dropout_p = 0.2f, opt.dropout_seed = rng.next();
    const int64_t total_q = p.q.shape()[0];
    Tensor out(DType::kF32, {total_q, p.Hq, p.Dv}), lse(DType::kF32, {p.Hq, total_q});
    varlen_attention(p.in, out.view<float>(), lse.view<float>(), opt);
    Tensor dout = random_tensor(rng, {total_q, p.Hq, p.Dv});
    Tensor dq(DType::kF32, p.q.shape()), dk(DType::kF32, p.k.shape()), dv(DType::kF32, p.v.shape());
    varlen_attention_backward(p.in, out.view<float>(), lse.view<float>(), dout.view<float>(),
                              {dq.view<float>(), dk.view<float>(), dv.view<float>()}, opt);
    for (int64_t s = 0; s < S; ++s) {
      SCOPED_TRACE("trial " + std::to_string(trial) + " sequence " + std::to_string(s) + " nq " +
                   std::to_string(p.nq[s]) + " nk " + std::to_string(p.nk[s]) + " causal " +
                   std::to_string(static_cast<int>(opt.causal)) + " window " + std::to_string(opt.window));
      const Tensor qs = to_heads(p.q, p.q0(s), p.nq[s]), ks = to_heads(p.k, p.k0(s), p.nk[s]);
      const Tensor vs = to_heads(p.v, p.k0(s), p.nk[s]);
      const AttentionInputs alone{qs.view<float>(), ks.view<float>(), vs.view<float>()};
      AttentionOptions o = opt;
      o.dropout_seed = varlen_dropout_seed(opt.dropout_seed, s);
      Tensor want(DType::kF32, {1, p.Hq, p.nq[s], p.Dv}), want_lse(DType::kF32, {1, p.Hq, p.nq[s]});
      attention(alone, {want.view<float>(), want_lse.view<float>()}, o);
      expect_rows_equal(out, p.q0(s), want, "out");
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t i = 0; i < p.nq[s]; ++i) {
          const float a = lse.view<float>().at(h, p.q0(s) + i), b = want_lse.view<float>().at(0, h, i);
          EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << "lse " << h << " " << i;
        }
      if (p.nq[s] > 0 && opt.dropout_p == 0) {  // the independent oracle
        const NaiveResult r = naive_attention(alone, o);
        double err = 0, scale = 1e-30;
        for (size_t i = 0; i < r.out.size(); ++i) {
          err = std::max(err, std::fabs(want.data<float>()[i] - r.out[i]));
          scale = std::max(scale, std::fabs(r.out[i]));
        }
        EXPECT_LE(err / scale, 1e-5);
      }
      if (p.nq[s] == 0) {  // keys of a sequence without queries get zero gradient
        for (int64_t t = p.k0(s); t < p.k0(s) + p.nk[s]; ++t)
          for (int64_t e = 0; e < p.D; ++e) EXPECT_EQ(dk.view<float>().at(t, 0, e), 0.0f);
        continue;
      }
      const Tensor gs = to_heads(dout, p.q0(s), p.nq[s]);
      Tensor gq(DType::kF32, qs.shape()), gk(DType::kF32, ks.shape()), gv(DType::kF32, vs.shape());
      attention_backward(alone, want.view<float>(), want_lse.view<float>(), gs.view<float>(),
                         {gq.view<float>(), gk.view<float>(), gv.view<float>()}, o);
      expect_rows_equal(dq, p.q0(s), gq, "grad_query");
      expect_rows_equal(dk, p.k0(s), gk, "grad_key");
      expect_rows_equal(dv, p.k0(s), gv, "grad_value");
    }
  }
}

// Many heads and sequences of many queries: varlen runs them as (sequence, kv head) tasks of one
// thread each (ops/varlen.cc), decode-like ones whole. Still the bits of each sequence alone,
// for every thread count, with ALiBi per sequence, softcap, windows and tile-edge head dims,
// and with an output whose elements lie 2 apart (then every sequence runs whole).
TEST(Varlen, HeadTasksGiveEachSequenceAloneBits) {
  Rng rng(base_seed() + 903);
  for (int trial = 0; trial < 8; ++trial) {
    Packed p;
    p.Hkv = rng.range(1, 4);
    p.Hq = p.Hkv * (int64_t{1} << rng.range(0, 2));
    p.D = rng.range(1, 3) * 32 + rng.range(-1, 1);
    p.Dv = rng.coin() ? p.D : rng.range(1, 80);
    const int64_t G = p.Hq / p.Hkv;
    for (int s = 0; s < 10; ++s) {  // sizes within 2.8× of each other: the tasks balance
      p.nq.push_back(rng.range(150, 250));
      p.nk.push_back(rng.coin(0.3) ? p.nq.back() + rng.range(0, 40) : p.nq.back());
    }
    p.nq.push_back(rng.range(1, 16 / G));  // decode-like: runs whole
    p.nk.push_back(rng.range(1, 300));
    p.nq.push_back(0);
    p.nk.push_back(rng.range(0, 5));
    p.nq.push_back(rng.range(20, 40));  // many queries, no keys: zeros, lse -inf
    p.nk.push_back(0);
    p.make(rng);
    const int64_t S = static_cast<int64_t>(p.nq.size());
    Tensor slopes = random_tensor(rng, {S, p.Hq}, 0.1f);
    if (rng.coin()) p.in.alibi_slopes = slopes.view<float>();
    AttentionOptions opt;
    opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (opt.causal != Causal::kNone && rng.coin(0.3)) opt.window = rng.range(1, 60);
    if (rng.coin(0.3)) opt.softcap = 5.0f;
    const int64_t total_q = p.q.shape()[0];
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE("trial " + std::to_string(trial) + " threads " + std::to_string(threads));
      opt.num_threads = threads;
      Tensor out(DType::kF32, {total_q, p.Hq, p.Dv}), lse(DType::kF32, {p.Hq, total_q});
      if (trial == 0 && threads == 3) {  // output elements 2 apart: every sequence runs whole
        Tensor spread(DType::kF32, {total_q, p.Hq, 2 * p.Dv});
        const View<float> o(spread.data<float>(), {total_q, p.Hq, p.Dv}, {p.Hq * 2 * p.Dv, 2 * p.Dv, 2});
        varlen_attention(p.in, o, lse.view<float>(), opt);
        for (int64_t i = 0; i < total_q; ++i)
          for (int64_t h = 0; h < p.Hq; ++h)
            for (int64_t e = 0; e < p.Dv; ++e) out.view<float>().at(i, h, e) = o.at(i, h, e);
      } else {
        varlen_attention(p.in, out.view<float>(), lse.view<float>(), opt);
      }
      for (int64_t s = 0; s < S; ++s) {
        SCOPED_TRACE("sequence " + std::to_string(s) + " nq " + std::to_string(p.nq[s]) + " nk " +
                     std::to_string(p.nk[s]) + " D " + std::to_string(p.D) + " Dv " + std::to_string(p.Dv));
        const Tensor qs = to_heads(p.q, p.q0(s), p.nq[s]), ks = to_heads(p.k, p.k0(s), p.nk[s]);
        const Tensor vs = to_heads(p.v, p.k0(s), p.nk[s]);
        AttentionInputs alone{qs.view<float>(), ks.view<float>(), vs.view<float>()};
        if (p.in.alibi_slopes.given()) alone.alibi_slopes = View<const float>(slopes.data<float>() + s * p.Hq, {p.Hq});
        Tensor want(DType::kF32, {1, p.Hq, p.nq[s], p.Dv}), want_lse(DType::kF32, {1, p.Hq, p.nq[s]});
        attention(alone, {want.view<float>(), want_lse.view<float>()}, opt);
        expect_rows_equal(out, p.q0(s), want, "out");
        int64_t differ = 0;
        for (int64_t h = 0; h < p.Hq; ++h)
          for (int64_t i = 0; i < p.nq[s]; ++i) {
            const float a = lse.view<float>().at(h, p.q0(s) + i), b = want_lse.view<float>().at(0, h, i);
            differ += !(a == b || (std::isnan(a) && std::isnan(b)));
          }
        EXPECT_EQ(differ, 0) << "lse";
      }
    }
  }
}

TEST(Varlen, SequencesWithoutKeysGiveZeros) {
  Rng rng(base_seed() + 901);
  Packed p;
  p.nq = {3, 2};
  p.nk = {0, 4};
  p.make(rng);
  Tensor out(DType::kF32, {5, p.Hq, p.Dv}), lse(DType::kF32, {p.Hq, 5});
  varlen_attention(p.in, out.view<float>(), lse.view<float>());
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t h = 0; h < p.Hq; ++h) {
      EXPECT_EQ(lse.view<float>().at(h, i), -std::numeric_limits<float>::infinity());
      for (int64_t e = 0; e < p.Dv; ++e) EXPECT_EQ(out.view<float>().at(i, h, e), 0.0f);
    }
  EXPECT_TRUE(std::isfinite(lse.view<float>().at(0, 3)));
}

TEST(Varlen, BadOffsetsAndShapesAreErrors) {
  Rng rng(base_seed() + 902);
  Packed p;
  p.nq = {3, 2};
  p.nk = {4, 4};
  p.make(rng);
  Tensor out(DType::kF32, {5, p.Hq, p.Dv});
  auto run = [&](const BasicVarlenInputs<float>& in) { varlen_attention(in, out.view<float>()); };
  auto with = [&](std::vector<int64_t> q, std::vector<int64_t> k) {
    Tensor tq(DType::kI64, {static_cast<int64_t>(q.size())}), tk(DType::kI64, {static_cast<int64_t>(k.size())});
    std::copy(q.begin(), q.end(), tq.data<int64_t>());
    std::copy(k.begin(), k.end(), tk.data<int64_t>());
    BasicVarlenInputs<float> in = p.in;
    in.cu_seqlens_q = tq.view<int64_t>();
    in.cu_seqlens_k = tk.view<int64_t>();
    run(in);
  };
  expect_error([&] { with({0, 4, 3}, {0, 4, 8}); }, {"cu_seqlens_q", "must not decrease", "4", "3"});
  expect_error([&] { with({1, 3, 5}, {0, 4, 8}); }, {"cu_seqlens_q[0]", "0", "1"});
  expect_error([&] { with({0, 3, 5}, {0, 4, 7}); }, {"cu_seqlens_k[S] = 7", "key rows (8)"});
  expect_error([&] { with({0, 3, 5}, {0, 4, 6, 8}); }, {"same length", "3", "4"});
  expect_error([&] { with({0, 3, 6}, {0, 4, 8}); }, {"cu_seqlens_q[S] = 6", "query rows (5)"});
  BasicVarlenInputs<float> bad = p.in;
  bad.key = View<const float>(p.k.data<float>(), {8, 3, p.D});
  expect_error([&] { run(bad); }, {"varlen_attention", "key (8, 3, 16)", "multiple"});
  expect_error([&] { varlen_attention(p.in, Tensor(DType::kF32, {5, p.Hq, p.Dv + 1}).view<float>()); },
               {"out", "(5, 4, 16)", "(5, 4, 17)"});
  expect_error([&] { varlen_attention(p.in, out.view<float>(), Tensor(DType::kF32, {5, p.Hq}).view<float>()); },
               {"lse", "(4, 5)", "(5, 4)"});
}

}  // namespace
}  // namespace mha::test
