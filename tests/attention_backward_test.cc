// The attention backward: the reference against finite differences of a float64 forward, the
// fast kernel against the reference (2x the error of plain float32, docs/numerics.md) on
// every SIMD target, and the same bits for 1 and 2 threads; the bias's gradient (summed over
// its broadcast dimensions) in each of these, and its arguments' checks.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/dropout.h"
#include "kernels/ref/attention_bwd_ref.h"
#include "mha/attention.h"
#include "ops/attention_checks.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr double kU = 1.0 / (1 << 24);

struct Problem {
  int64_t B = 1, Hq = 2, Hkv = 1, Tq = 5, Tk = 6, D = 4, Dv = 3;
  Tensor q, k, v, keep, bias, lengths, dout, alibi, sinks;
  AttentionInputs in;
  AttentionOptions opt;

  void make(Rng& rng) {
    auto uniform = [&](std::vector<int64_t> shape) {
      Tensor t(DType::kF32, std::move(shape));
      for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(2 * rng.uniform() - 1);
      return t;
    };
    q = uniform({B, Hq, Tq, D});
    k = uniform({B, Hkv, Tk, D});
    v = uniform({B, Hkv, Tk, Dv});
    dout = uniform({B, Hq, Tq, Dv});
    in.query = q.view<float>();
    in.key = k.view<float>();
    in.value = v.view<float>();
  }
  std::string describe() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "B=%ld Hq=%ld Hkv=%ld Tq=%ld Tk=%ld D=%ld Dv=%ld causal=%d window=%ld p=%g", (long)B,
                  (long)Hq, (long)Hkv, (long)Tq, (long)Tk, (long)D, (long)Dv, (int)opt.causal, (long)opt.window,
                  opt.dropout_p);
    return buf + std::string(in.keep_mask.given() ? " keep" : "") + (in.attn_bias.given() ? " bias" : "") +
           (in.key_lengths.given() ? " lengths" : "") + (opt.softcap > 0 ? " softcap" : "") +
           (in.alibi_slopes.given() ? " alibi" : "") + (in.sinks.given() ? " sinks" : "") +
           (opt.sink_tokens ? " sink_tokens=" + std::to_string(opt.sink_tokens) : "");
  }
  void add_variants(Rng& rng, double chance) {
    add_score_variants(rng, chance, B, Hq, 1.0f, in, opt, &alibi, &sinks);
  }

};

struct Grads {
  Tensor dq, dk, dv, dsink, dbias;
  explicit Grads(const Problem& p)
      : dq(DType::kF32, {p.B, p.Hq, p.Tq, p.D}), dk(DType::kF32, {p.B, p.Hkv, p.Tk, p.D}),
        dv(DType::kF32, {p.B, p.Hkv, p.Tk, p.Dv}) {
    if (p.in.sinks.given()) dsink = Tensor(DType::kF32, {p.Hq});
    if (p.in.attn_bias.given()) dbias = Tensor(DType::kF32, p.bias.shape());
    if (dbias.defined()) std::fill(dbias.data<float>(), dbias.data<float>() + dbias.numel(), NAN);  // all written
  }
  AttentionInputGrads views() {
    return {dq.view<float>(), dk.view<float>(), dv.view<float>(), dsink.defined() ? dsink.view<float>() : View<float>(),
            dbias.defined() ? dbias.view<float>() : View<float>()};
  }
};

// The bias's element that score (b, h, i, j) reads: its shape right-aligned, 1s broadcast.
int64_t bias_index(const std::vector<int64_t>& shape, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t at[4] = {b, h, i, j};
  const int shift = 4 - static_cast<int>(shape.size());
  int64_t index = 0;
  for (size_t d = 0; d < shape.size(); ++d) index = index * shape[d] + (shape[d] == 1 ? 0 : at[shift + d]);
  return index;
}

// A random bias of a shape that broadcasts to (B, Hq, Tq, Tk), or of that shape itself.
void add_bias(Problem& p, Rng& rng) {
  const std::vector<int64_t> full = {p.B, p.Hq, p.Tq, p.Tk};
  p.bias = random_tensor(rng, rng.coin(0.3) ? full : broadcast_shape(rng, full));
  p.in.attn_bias = p.bias.view<float>();
}

// Forward (to get out and lse) then backward on one backend.
Grads run(Problem& p, Backend backend, int threads = 0) {
  Tensor out(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), lse(DType::kF32, {p.B, p.Hq, p.Tq});
  AttentionOptions opt = p.opt;
  opt.backend = backend;
  opt.num_threads = threads;
  attention(p.in, {out.view<float>(), lse.view<float>()}, opt);
  Grads g(p);
  attention_backward(p.in, out.view<float>(), lse.view<float>(), p.dout.view<float>(), g.views(), opt);
  return g;
}

// The float32 reference backward: the "plain float32" implementation of the bound.
Grads run_plain(Problem& p) {
  Tensor out(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), lse(DType::kF32, {p.B, p.Hq, p.Tq});
  AttentionOptions opt = p.opt;
  opt.backend = Backend::kReference;
  attention(p.in, {out.view<float>(), lse.view<float>()}, opt);
  const kernels::AttentionParams ap = ops::make_attention_params(p.in, {out.view<float>(), lse.view<float>()}, opt);
  Grads g(p);
  kernels::AttentionGradParams gp;
  gp.grad_out = p.dout.data<float>();
  gp.grad_out_stride = {p.Hq * p.Tq * p.Dv, p.Tq * p.Dv, p.Dv, 1};
  gp.grad_q = g.dq.data<float>();
  gp.grad_q_stride = {p.Hq * p.Tq * p.D, p.Tq * p.D, p.D, 1};
  gp.grad_k = g.dk.data<float>();
  gp.grad_k_stride = {p.Hkv * p.Tk * p.D, p.Tk * p.D, p.D, 1};
  gp.grad_v = g.dv.data<float>();
  gp.grad_v_stride = {p.Hkv * p.Tk * p.Dv, p.Tk * p.Dv, p.Dv, 1};
  std::vector<double> dsink(static_cast<size_t>(p.B * p.Hq), 0.0);
  gp.grad_sinks_by_batch = dsink.data();
  std::vector<float> dscores(static_cast<size_t>(p.B * p.Hq * p.Tq * p.Tk), 0.0f);
  gp.grad_scores = g.dbias.defined() ? dscores.data() : nullptr;
  gp.grad_scores_stride = {p.Hq * p.Tq * p.Tk, p.Tq * p.Tk, p.Tk, 1};
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t hk = 0; hk < p.Hkv; ++hk) kernels::attention_bwd_ref_head<float>(ap, gp, b, hk);
  if (g.dbias.defined()) {  // summed over the bias's broadcast dimensions in float32
    std::fill(g.dbias.data<float>(), g.dbias.data<float>() + g.dbias.numel(), 0.0f);
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t i = 0; i < p.Tq; ++i)
          for (int64_t j = 0; j < p.Tk; ++j)
            g.dbias.data<float>()[bias_index(p.bias.shape(), b, h, i, j)] +=
                dscores[static_cast<size_t>(((b * p.Hq + h) * p.Tq + i) * p.Tk + j)];
  }
  for (int64_t h = 0; g.dsink.defined() && h < p.Hq; ++h) {
    double total = 0;
    for (int64_t b = 0; b < p.B; ++b) total += dsink[static_cast<size_t>(b * p.Hq + h)];
    g.dsink.data<float>()[h] = static_cast<float>(total);
  }
  return g;
}

// Σ dout ⊙ out in float64 (the loss whose gradient the backward computes), with dropout.
double loss(const Problem& p) {
  const NaiveResult r = naive_attention(p.in, p.opt);  // per-head weights before dropout
  const kernels::Dropout drop(p.opt.dropout_p, p.opt.dropout_seed);  // the library's keep decisions
  double l = 0;
  const int64_t B = p.B, H = p.Hq, T = p.Tq, S = p.Tk;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t c = 0; c < p.Dv; ++c) {
          double o = 0;
          for (int64_t j = 0; j < S; ++j) {
            double w = r.weights[((b * H + h) * T + i) * S + j];
            if (drop.active()) w = drop.keep(b, h, i, j) ? w * drop.scale() : 0.0;
            o += w * p.in.value.at(b, h * p.Hkv / H, j, c);
          }
          l += o * p.dout.data<float>()[((b * H + h) * T + i) * p.Dv + c];
        }
      }
  return l;
}

TEST(AttentionBackward, ReferenceMatchesFiniteDifferences) {
  Rng rng(base_seed() + 30);
  for (int trial = 0; trial < 30; ++trial) {
    Problem p;
    p.B = rng.range(1, 2);
    p.Hkv = rng.range(1, 2);
    p.Hq = p.Hkv * rng.range(1, 2);
    p.Tq = rng.range(1, 5);
    p.Tk = rng.range(1, 6);
    p.D = rng.range(1, 4);
    p.Dv = rng.range(1, 4);
    p.make(rng);
    if (trial % 3 == 1) {
      p.keep = random_mask(rng, {p.Tq, p.Tk}, 0.7);
      p.in.keep_mask = p.keep.view<uint8_t>();
    }
    if (trial % 3 == 2) add_bias(p, rng);
    p.opt.causal = static_cast<Causal>(trial % 3);
    if (trial % 4 == 3) p.opt.dropout_p = 0.3f, p.opt.dropout_seed = 11;
    if (trial >= 12) p.add_variants(rng, 0.7);  // softcap, ALiBi, sinks (issue 14)
    if (trial >= 24) p.opt.causal = Causal::kBottomRight, p.opt.window = 2, p.opt.sink_tokens = 1;
    SCOPED_TRACE(p.describe());
    const Grads g = run(p, Backend::kReference);
    const double h = 1.0 / 1024;  // exact on inputs in [-1, 1]
    std::vector<std::tuple<Tensor*, const Tensor*, const char*>> wrt = {{&p.q, &g.dq, "dq"}, {&p.k, &g.dk, "dk"},
                                                                         {&p.v, &g.dv, "dv"}};
    if (p.in.sinks.given()) wrt.emplace_back(&p.sinks, &g.dsink, "dsink");
    if (p.in.attn_bias.given()) wrt.emplace_back(&p.bias, &g.dbias, "dbias");
    for (auto [t, grad, name] : wrt) {
      for (int64_t i = 0; i < t->numel(); ++i) {
        float& x = t->data<float>()[i];
        const float x0 = x;
        x = x0 + static_cast<float>(h);
        const double lp = loss(p);
        x = x0 - static_cast<float>(h);
        const double lm = loss(p);
        x = x0;
        const double fd = (lp - lm) / (2 * h);
        ASSERT_NEAR(grad->data<float>()[i], fd, 1e-4 * std::max(1.0, std::fabs(fd))) << name << " index " << i;
      }
    }
  }
}

class BackwardTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { kernels::force_simd_target(GetParam()); }
  void TearDown() override { kernels::force_simd_target(""); }
};

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double e = std::fabs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]);
    m = std::isnan(e) ? INFINITY : std::max(m, e);
  }
  return m;
}

// The floor of the 2x rule per gradient (docs/numerics.md): each probability carries a relative
// error of up to ~8u (exp2's polynomial, 3.4u, and the rounding of (s - lse)·log2 e) that plain
// float32's exp does not have, so a gradient may move by 8u times the sum of its terms' absolute
// values: dV_j by 8u·Σ_i P_ij·|dO_i|, dQ_i by 8u·scale·Σ_j |dS_ij|·|K_j| with |dS_ij| taken as
// P_ij·(|dO_i|·|V_j| + |D_i|), dK_j likewise over the rows. Computed from the naive float64 P.
struct Floors {
  double dq = 0, dk = 0, dv = 0, dsink = 0, dbias = 0;  // dbias: 8u·Σ P_ij·(|dP_ij| + |D_i|) it sums
};
Floors floors(const Problem& p) {
  const NaiveResult r = naive_attention(p.in, p.opt);
  const double drop = p.opt.dropout_p > 0 && p.opt.dropout_p < 1 ? 1.0 / (1.0 - p.opt.dropout_p) : 1.0;
  const double scale = p.opt.scale ? *p.opt.scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  const int64_t G = p.Hq / p.Hkv;
  std::vector<double> aq(p.D), ak(static_cast<size_t>(p.Tk * p.D)), av(static_cast<size_t>(p.Tk * p.Dv));
  std::vector<double> asink(static_cast<size_t>(p.Hq));  // dsink_h: Σ_{b,i} P_sink·|D_i|, D_i ≤ Σ_d |dO|·|O|
  std::vector<double> abias(p.in.attn_bias.given() ? static_cast<size_t>(p.bias.numel()) : 0);
  Floors f;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::fill(ak.begin(), ak.end(), 0.0);
      std::fill(av.begin(), av.end(), 0.0);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
        for (int64_t i = 0; i < p.Tq; ++i) {
          auto dO = [&](int64_t d) { return std::fabs(double{p.dout.data<float>()[((b * p.Hq + h) * p.Tq + i) * p.Dv + d]}); };
          double drow = 0;
          for (int64_t d = 0; d < p.Dv; ++d) drow += dO(d) * std::fabs(r.out[((b * p.Hq + h) * p.Tq + i) * p.Dv + d]);
          const double lse = r.lse[(b * p.Hq + h) * p.Tq + i];
          if (p.in.sinks.given() && std::isfinite(lse)) asink[h] += std::exp(double{p.in.sinks.at(h)} - lse) * drow;
          std::fill(aq.begin(), aq.end(), 0.0);
          for (int64_t j = 0; j < p.Tk; ++j) {
            const double P = r.weights[((b * p.Hq + h) * p.Tq + i) * p.Tk + j] * drop;
            if (P == 0) continue;
            double dp = 0;
            for (int64_t d = 0; d < p.Dv; ++d) {
              dp += dO(d) * std::fabs(double{p.in.value.at(b, hk, j, d)});
              av[j * p.Dv + d] += P * dO(d);
            }
            if (!abias.empty()) abias[static_cast<size_t>(bias_index(p.bias.shape(), b, h, i, j))] += P * (dp + drow);
            const double ds = P * (dp + drow) * scale;
            for (int64_t d = 0; d < p.D; ++d) {
              aq[d] += ds * std::fabs(double{p.in.key.at(b, hk, j, d)});
              ak[j * p.D + d] += ds * std::fabs(double{p.in.query.at(b, h, i, d)});
            }
          }
          for (double x : aq) f.dq = std::max(f.dq, x);
        }
      for (double x : ak) f.dk = std::max(f.dk, x);
      for (double x : av) f.dv = std::max(f.dv, x);
    }
  for (double x : asink) f.dsink = std::max(f.dsink, x);
  for (double x : abias) f.dbias = std::max(f.dbias, x);
  return f;
}

void check_fast(Problem& p) {
  SCOPED_TRACE(p.describe());
  const Floors floor = floors(p);
  const Grads fast = run(p, Backend::kFast), ref = run(p, Backend::kReference), plain = run_plain(p);
  // Errors relative to the largest reference gradient of the three: dQ and dK can be exactly
  // zero (one visible key: softmax is constant), where a relative error would be meaningless.
  double scale = 1e-30;
  for (const Tensor* r : {&ref.dq, &ref.dk, &ref.dv})
    for (int64_t i = 0; i < r->numel(); ++i) scale = std::max(scale, std::fabs(static_cast<double>(r->data<float>()[i])));
  for (auto [f, r, pl, fl, name] : {std::tuple<const Tensor*, const Tensor*, const Tensor*, double, const char*>{
                                        &fast.dq, &ref.dq, &plain.dq, floor.dq, "dq"},
                                    {&fast.dk, &ref.dk, &plain.dk, floor.dk, "dk"},
                                    {&fast.dv, &ref.dv, &plain.dv, floor.dv, "dv"}}) {
    const double ef = max_abs_diff(*f, *r) / scale, ep = max_abs_diff(*pl, *r) / scale;
    EXPECT_LE(ef, 2 * ep + std::max(4 * kU, 8 * kU * fl / scale)) << name << ": fast " << ef << " plain float32 " << ep;
  }
  if (p.in.sinks.given()) {
    // dsink sums B·Tq terms P_sink·(dO·O): on its own scale, the 2x-plain rule as above, with
    // the floor of P_sink's ~8u (the terms cancel: dsink can be much smaller than their sum).
    double sscale = 1e-30;
    for (int64_t i = 0; i < ref.dsink.numel(); ++i) sscale = std::max(sscale, std::fabs(double{ref.dsink.data<float>()[i]}));
    const double ef = max_abs_diff(fast.dsink, ref.dsink) / sscale, ep = max_abs_diff(plain.dsink, ref.dsink) / sscale;
    EXPECT_LE(ef, 2 * ep + std::max(4 * kU, 8 * kU * floor.dsink / sscale))
        << "dsink: fast " << ef << " plain float32 " << ep << " floor " << 8 * kU * floor.dsink / sscale;
  }
  if (p.in.attn_bias.given()) {
    // dbias sums P·(dP - D) over its broadcast dimensions: on its own scale, the same rule.
    double bscale = 1e-30;
    for (int64_t i = 0; i < ref.dbias.numel(); ++i) bscale = std::max(bscale, std::fabs(double{ref.dbias.data<float>()[i]}));
    const double ef = max_abs_diff(fast.dbias, ref.dbias) / bscale, ep = max_abs_diff(plain.dbias, ref.dbias) / bscale;
    EXPECT_LE(ef, 2 * ep + std::max(4 * kU, 8 * kU * floor.dbias / bscale))
        << "dbias " << shape_string(p.bias.view<float>()) << ": fast " << ef << " plain float32 " << ep;
  }
}

TEST_P(BackwardTest, TileEdgesHeadDimsAndOptions) {
  Rng rng(base_seed() + 31);
  for (int64_t T : {1, 2, 47, 48, 49, 63, 64, 65, 97, 130}) {
    Problem p;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = p.Tk = T;
    p.D = p.Dv = 32;
    p.opt.causal = T % 2 ? Causal::kTopLeft : Causal::kNone;
    p.make(rng);
    check_fast(p);
  }
  // Softcap, ALiBi and sinks together at the tile edges, both alignments, GQA, a window.
  for (int64_t T : {1, 47, 48, 49, 64, 65, 130}) {
    Problem p;
    p.B = 2;
    p.Hq = 4;
    p.Hkv = 2;
    p.Tq = T;
    p.Tk = T + T % 3;
    p.D = p.Dv = 24;
    p.opt.causal = T % 2 ? Causal::kTopLeft : Causal::kBottomRight;
    if (T > 60) p.opt.window = 37, p.opt.sink_tokens = 5;
    p.make(rng);
    p.add_variants(rng, 1.0);
    add_bias(p, rng);
    check_fast(p);
  }
  for (int64_t D : {1, 3, 16, 33, 64, 80, 128}) {
    Problem p;
    p.Tq = 70;
    p.Tk = 90;
    p.D = D;
    p.Dv = D % 5 + 7;
    p.opt.causal = Causal::kBottomRight;
    p.make(rng);
    check_fast(p);
  }
}

TEST_P(BackwardTest, RandomProblems) {
  const uint64_t seed = base_seed() + 32;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with MHA_TEST_SEED)");
  Rng rng(seed);
  const int trials = GetParam() == "AVX3" || GetParam() == "AVX2" ? 60 : 15;
  for (int trial = 0; trial < trials; ++trial) {
    Problem p;
    p.B = rng.range(1, 2);
    p.Hkv = rng.range(1, 2);
    p.Hq = p.Hkv * rng.range(1, 4);
    p.Tq = rng.range(1, 120);
    p.Tk = rng.coin(0.4) ? p.Tq : rng.range(1, 120);
    p.D = rng.range(1, 48);
    p.Dv = rng.coin(0.5) ? p.D : rng.range(1, 48);
    p.make(rng);
    if (rng.coin(0.3)) {
      p.keep = random_mask(rng, {p.B, 1, p.Tq, p.Tk}, rng.coin(0.5) ? 0.9 : 0.4);
      p.in.keep_mask = p.keep.view<uint8_t>();
    }
    if (rng.coin(0.3)) add_bias(p, rng);
    if (rng.coin(0.3)) {
      p.lengths = random_lengths(rng, p.B, p.Tk);
      p.in.key_lengths = p.lengths.view<int64_t>();
    }
    p.opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (p.opt.causal != Causal::kNone && rng.coin(0.3)) p.opt.window = rng.range(1, 40);
    if (rng.coin(0.3)) p.opt.dropout_p = 0.2f, p.opt.dropout_seed = rng.next();
    p.add_variants(rng, 0.3);
    if (p.opt.window > 0 && rng.coin(0.5)) p.opt.sink_tokens = rng.range(1, 70);
    check_fast(p);
  }
}

TEST_P(BackwardTest, SameBitsForOneAndTwoThreads) {
  Rng rng(base_seed() + 33);
  Problem p;
  p.B = 2;
  p.Hq = 6;
  p.Hkv = 3;
  p.Tq = 150;
  p.Tk = 170;
  p.D = p.Dv = 40;
  p.opt.causal = Causal::kBottomRight;
  p.opt.dropout_p = 0.1f;
  p.opt.dropout_seed = 3;
  p.make(rng);
  p.bias = random_tensor(rng, {p.Hq, 1, p.Tk});  // its gradient sums over batch and query rows
  p.in.attn_bias = p.bias.view<float>();
  const Grads a = run(p, Backend::kFast, 1), b = run(p, Backend::kFast, 2);
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
  EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
  EXPECT_TRUE(bitwise_equal(a.dbias, b.dbias));
}

// The backward packs each query block's Q and dO once per task and keeps them for its other key
// blocks (within backward_pack_limit()); packing them again for every key block (limit 0) must
// give the same bits: several query and key blocks per task, GQA, masks, a bias, dropout and
// softcap, tasks run one after another on each thread (stale packing from the last would show).
TEST_P(BackwardTest, KeptPackedQueryBlocksGiveTheBitsOfPackingEachTime) {
  const RestoreKernelSwitches restore;
  Rng rng(base_seed() + 36);
  for (int trial = 0; trial < 4; ++trial) {
    Problem p;
    p.B = 2;
    p.Hkv = 2;
    p.Hq = 2 * rng.range(1, 3);
    p.Tq = rng.range(60, 200);
    p.Tk = rng.range(60, 300);
    p.D = rng.range(8, 72);
    p.Dv = rng.coin(0.5) ? p.D : rng.range(8, 72);
    p.make(rng);
    if (rng.coin(0.5)) {
      p.keep = random_mask(rng, {p.B, 1, p.Tq, p.Tk}, 0.7);
      p.in.keep_mask = p.keep.view<uint8_t>();
    }
    add_bias(p, rng);
    p.opt.causal = static_cast<Causal>(rng.range(0, 2));
    if (rng.coin(0.5)) p.opt.dropout_p = 0.2f, p.opt.dropout_seed = rng.next();
    p.add_variants(rng, 0.5);
    SCOPED_TRACE(p.describe());
    kernels::set_backward_pack_limit(kernels::kDefaultBackwardPackLimit);
    const Grads kept = run(p, Backend::kFast, 2);
    kernels::set_backward_pack_limit(0);
    const Grads each = run(p, Backend::kFast, 2);
    EXPECT_TRUE(bitwise_equal(kept.dq, each.dq));
    EXPECT_TRUE(bitwise_equal(kept.dk, each.dk));
    EXPECT_TRUE(bitwise_equal(kept.dv, each.dv));
    EXPECT_TRUE(bitwise_equal(kept.dbias, each.dbias));
  }
}

// The fast kernel writes zeros itself where no block computes a score (nothing zeroes the buffer
// first), so a broadcast bias's full-gradient scratch, kept between calls, must not leak the last
// call's values: a call without masks dirties it, then a causal call with a window of 40 and keys
// 64–289 masked (whole 64-key blocks skipped, blocks whose rows' ranges start inside them) must
// give exact zeros wherever a key is hidden, as it is in every batch the sum runs over.
TEST_P(BackwardTest, BiasGradientIsZeroWhereNoBlockRunsAfterAnotherCall) {
  Rng rng(base_seed() + 34);
  Problem p;
  p.B = 2;
  p.Tq = p.Tk = 300;
  p.D = p.Dv = 16;
  p.make(rng);
  p.bias = random_tensor(rng, {p.Hq, p.Tq, p.Tk});  // summed over the batch: the scratch path
  p.in.attn_bias = p.bias.view<float>();
  (void)run(p, Backend::kFast, 1);
  p.opt.causal = Causal::kTopLeft;
  p.opt.window = 40;
  p.keep = Tensor(DType::kU8, {p.Tk});
  for (int64_t j = 0; j < p.Tk; ++j) p.keep.data<uint8_t>()[j] = j < 64 || j >= 290;
  p.in.keep_mask = p.keep.view<uint8_t>();
  const Grads g = run(p, Backend::kFast, 1);
  int64_t nonzero_visible = 0, nonzero_masked = 0, visible = 0;
  for (int64_t h = 0; h < p.Hq; ++h)
    for (int64_t i = 0; i < p.Tq; ++i)
      for (int64_t j = 0; j < p.Tk; ++j) {
        const bool masked = j > i || j <= i - 40 || !p.keep.data<uint8_t>()[j];
        visible += !masked;
        (masked ? nonzero_masked : nonzero_visible) += g.dbias.data<float>()[(h * p.Tq + i) * p.Tk + j] != 0.0f;
      }
  EXPECT_EQ(nonzero_masked, 0);
  EXPECT_GT(nonzero_visible, visible / 2);  // the visible scores have their gradients
}

// grad_attn_bias: only with attn_bias, of its shape, its elements distinct, apart from it.
TEST(AttentionBackward, BiasGradientArgumentsAreChecked) {
  Rng rng(base_seed() + 35);
  Problem p;
  p.make(rng);
  p.bias = random_tensor(rng, {p.Hq, p.Tq, p.Tk});
  Tensor out(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), lse(DType::kF32, {p.B, p.Hq, p.Tq});
  Tensor dbias(DType::kF32, {p.Hq, p.Tq, p.Tk}), wrong(DType::kF32, {p.Hq, 1, p.Tk});
  Grads g(p);
  auto backward = [&](bool with_bias, View<float> grad) {
    AttentionInputs in = p.in;
    if (with_bias) in.attn_bias = p.bias.view<float>();
    attention(in, {out.view<float>(), lse.view<float>()}, p.opt);
    AttentionInputGrads grads = g.views();
    grads.grad_attn_bias = grad;
    attention_backward(in, out.view<float>(), lse.view<float>(), p.dout.view<float>(), grads, p.opt);
  };
  EXPECT_NO_THROW(backward(true, dbias.view<float>()));
  EXPECT_NO_THROW(backward(true, View<float>()));  // the bias without its gradient
  expect_error([&] { backward(false, dbias.view<float>()); }, {"grad_attn_bias (2, 5, 6) given without attn_bias"});
  expect_error([&] { backward(true, wrong.view<float>()); },
               {"grad_attn_bias must have the shape of attn_bias (2, 5, 6); got (2, 1, 6)"});
  expect_error([&] { backward(true, View<float>(dbias.data<float>(), {p.Hq, p.Tq, p.Tk}, {p.Tq * p.Tk, 0, 1})); },
               {"grad_attn_bias (2, 5, 6) has stride 0 in dimension 1"});
  expect_error([&] { backward(true, View<float>(p.bias.data<float>(), {p.Hq, p.Tq, p.Tk})); },
               {"grad_attn_bias overlaps attn_bias"});
  expect_error([&] { backward(true, View<float>(nullptr, {p.Hq, p.Tq, p.Tk})); }, {"grad_attn_bias has a null data pointer"});
}

// (B, T, H, D) storage viewed as (B, H, T, D), the layout of projections: the forward prefetches
// its rows and the backward copies K and V blocks; neither changes a bit of out or the gradients.
TEST_P(BackwardTest, TokenMajorViewsGiveTheBitsOfContiguousHeads) {
  Rng rng(base_seed() + 34);
  Problem p;
  p.B = 2;
  p.Hq = 4;
  p.Hkv = 2;
  p.Tq = 130;
  p.Tk = 150;
  p.D = 40;
  p.Dv = 24;
  p.opt.causal = Causal::kBottomRight;
  p.make(rng);
  auto token_major = [](const Tensor& x, Tensor* storage) {  // a (B, H, T, D) copy stored (B, T, H, D)
    const int64_t B = x.shape()[0], H = x.shape()[1], T = x.shape()[2], D = x.shape()[3];
    *storage = Tensor(DType::kF32, {B, T, H, D});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < D; ++c)
            storage->data<float>()[((b * T + t) * H + h) * D + c] = x.data<float>()[((b * H + h) * T + t) * D + c];
    return View<const float>(storage->data<float>(), {B, H, T, D}, {T * H * D, D, H * D, 1});
  };
  Tensor out_a(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), lse_a(DType::kF32, {p.B, p.Hq, p.Tq});
  Tensor out_b(DType::kF32, {p.B, p.Hq, p.Tq, p.Dv}), lse_b(DType::kF32, {p.B, p.Hq, p.Tq});
  attention(p.in, {out_a.view<float>(), lse_a.view<float>()}, p.opt);
  const Grads a = run(p, Backend::kFast);
  Tensor qs, ks, vs;
  p.in.query = token_major(p.q, &qs);
  p.in.key = token_major(p.k, &ks);
  p.in.value = token_major(p.v, &vs);
  attention(p.in, {out_b.view<float>(), lse_b.view<float>()}, p.opt);
  const Grads b = run(p, Backend::kFast);
  EXPECT_TRUE(bitwise_equal(out_a, out_b));
  EXPECT_TRUE(bitwise_equal(lse_a, lse_b));
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
  EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
}

INSTANTIATE_TEST_SUITE_P(Targets, BackwardTest, ::testing::ValuesIn(kernels::simd_targets()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace mha::test
