// MultiHeadAttention::backward: against torch autograd (the parity vectors' grads.safetensors),
// against central finite differences of the module's own forward for the options torch's
// vectors do not cover (GQA, dropout regenerated from the seeds, key lengths, windows, causal
// alignments, no output projection), the same bits for 1 and 2 threads, accumulation, errors.
// And the optimizers against their update rules.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <utility>

#include <nlohmann/json.hpp>

#include "io/weight_names.h"
#include "mha/multi_head_attention.h"
#include "mha/optim.h"
#include "mha/safetensors.h"
#include "test_util.h"

namespace mha::test {
namespace {

// Gradients against torch autograd: both sides are float32 chains of a few GEMMs and a softmax;
// the bound is the forward parity bound (docs/numerics.md).
constexpr double kGradParityBound = 1e-5;

// The key projection's bias has a gradient of exactly zero in exact arithmetic: it adds
// <q_i, b_k> to every score of row i, and the softmax does not change under a shift of its row.
// Computed values are rounding noise, so they are measured on the scale of the value bias's
// gradient instead of their own.
double max_abs_of(const View<const float>& v) {
  double m = 0;
  for (int64_t i = 0; i < v.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(v.data[i])));
  return m;
}

double sum_product(const Tensor& a, const Tensor& r) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a.data<float>()[i]) * r.data<float>()[i];
  return s;
}

// --- Parity with torch autograd ----------------------------------------------------------------

TEST(ModuleBackward, MatchesTorchAutogradOnTheParityCases) {
  const std::string root = std::string(MHA_TEST_DATA) + "/parity";
  std::ifstream f(root + "/manifest.json");
  const nlohmann::json manifest = nlohmann::json::parse(f);
  int checked = 0;
  double worst = 0;
  for (const auto& c : manifest["cases"]) {
    if (!c.value("grads", false)) continue;
    const std::string name = c["name"], dir = root + "/" + name;
    SCOPED_TRACE(name);
    const SafetensorsFile weights = read_safetensors(dir + "/weights.safetensors");
    const SafetensorsFile inputs = read_safetensors(dir + "/inputs.safetensors");
    const SafetensorsFile want = read_safetensors(dir + "/grads.safetensors");
    MultiHeadAttentionConfig base;
    base.num_heads = c["heads"].get<int64_t>();
    base.causal = c.value("causal", "") == "top-left" ? Causal::kTopLeft : Causal::kNone;
    base.batch_first = !c.value("seq_first", false);
    MultiHeadAttention m = MultiHeadAttention::from_state_dict(weights.tensors, base);

    const StateDict& in = inputs.tensors;
    auto get = [&](const char* n) { return in.count(n) ? &in.at(n) : nullptr; };
    MhaInputs mi;
    const bool self = get("x") != nullptr;
    mi.query = (self ? get("x") : get("query"))->view<float>();
    if (!self) {
      mi.key = get("key")->view<float>();
      mi.value = get("value")->view<float>();
    }
    if (get("keep_mask")) mi.keep_mask = get("keep_mask")->view<uint8_t>();
    if (get("attn_bias")) mi.attn_bias = get("attn_bias")->view<float>();
    if (get("key_padding_mask")) mi.key_padding_mask = get("key_padding_mask")->view<uint8_t>();

    MhaTape tape;
    m.forward(mi, {}, &tape);
    MhaParamGrads grads = m.make_grads();
    const MhaInputGrads ig = m.backward(tape, want.tensors.at("grad_output").view<float>(), &grads);

    double err = 0;
    auto compare = [&](const View<const float>& got, const Tensor& expected, const std::string& what,
                       double scale_floor = 0) {
      ASSERT_EQ(got.numel(), expected.numel()) << what;
      const View<const float> w(expected.data<float>(), {expected.numel()});
      const View<const float> g(got.data, {got.numel()});
      double diff = 0;
      for (int64_t i = 0; i < g.numel(); ++i) diff = std::max(diff, std::fabs(static_cast<double>(g.data[i]) - w.data[i]));
      const double e = diff / std::max({max_abs_of(w), scale_floor, 1e-30});
      EXPECT_LE(e, kGradParityBound) << what;
      err = std::max(err, e);
    };
    if (self) {
      compare(ig.query.view<float>(), want.tensors.at("input.x"), "input x");
    } else {
      compare(ig.query.view<float>(), want.tensors.at("input.query"), "input query");
      compare(ig.key.view<float>(), want.tensors.at("input.key"), "input key");
      compare(ig.value.view<float>(), want.tensors.at("input.value"), "input value");
    }
    // Parameters: torch's names, found as the weights are (packed in_proj or separate Linears).
    const io::FoundWeights fw = io::find_weights(want.tensors, "param.");
    const std::vector<Parameter> params = m.parameters(&grads);
    auto param_grad = [&](const std::string& n) -> View<const float> {
      for (const Parameter& p : params)
        if (p.name == n) return p.grad;
      ADD_FAILURE() << "no parameter " << n;
      return {};
    };
    const char* proj[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
    int64_t row = 0;
    for (int p = 0; p < 4; ++p) {
      if (p == 3 && !fw.weight[3].tensor) continue;
      const View<const float> gw = param_grad(std::string(proj[p]) + ".weight");
      if (p < 3 && fw.in_proj_weight.tensor) {
        const Tensor& packed = *fw.in_proj_weight.tensor;
        const int64_t cols = packed.shape()[1];
        const Tensor block = to_tensor(View<const float>(packed.data<float>() + row * cols, {gw.shape[0], cols}));
        compare(gw, block, fw.in_proj_weight.name);
      } else {
        compare(gw, *fw.weight[p].tensor, fw.weight[p].name);
      }
      if (m.has_bias(static_cast<MultiHeadAttention::Proj>(p))) {
        const View<const float> gb = param_grad(std::string(proj[p]) + ".bias");
        const double floor = p == 1 ? max_abs_of(param_grad("v_proj.bias")) : 0.0;
        if (p < 3 && fw.in_proj_bias.tensor) {
          compare(gb, to_tensor(View<const float>(fw.in_proj_bias.tensor->data<float>() + row, {gb.shape[0]})),
                  fw.in_proj_bias.name, floor);
        } else {
          compare(gb, *fw.bias[p].tensor, fw.bias[p].name, floor);
        }
      }
      if (p < 3) row += gw.shape[0];
    }
    std::printf("grad parity %-26s max rel err %.2e\n", name.c_str(), err);
    worst = std::max(worst, err);
    ++checked;
  }
  EXPECT_GE(checked, 14);
  std::printf("grad parity: %d cases, worst rel err %.2e (bound %.0e)\n", checked, worst, kGradParityBound);
}

// --- Finite differences --------------------------------------------------------------------------

struct FdCase {
  const char* name;
  MultiHeadAttentionConfig config;
  int64_t B = 2, Tq = 7, Tk = 7;
  bool cross = false;       // separate key and value inputs
  bool lengths = false;     // key_lengths
  bool keep_mask = false;   // a random (B, 1, Tq, Tk) keep mask
  bool attn_bias = false;   // a random (Tq, Tk) bias
  bool training = false;    // dropout as configured
};

std::vector<FdCase> fd_cases() {
  auto base = [](int64_t E, int64_t H) {
    MultiHeadAttentionConfig c;
    c.embed_dim = E;
    c.num_heads = H;
    return c;
  };
  std::vector<FdCase> cases;
  {
    FdCase c{"self, causal, bias", base(16, 4)};
    c.config.causal = Causal::kTopLeft;
    cases.push_back(c);
  }
  {
    FdCase c{"GQA 4/2, keep mask, attn bias", base(16, 4)};
    c.config.num_kv_heads = 2;
    c.keep_mask = c.attn_bias = true;
    cases.push_back(c);
  }
  {
    FdCase c{"cross kdim/vdim, bottom-right causal, key lengths, sequence-first", base(12, 3)};
    c.config.kdim = 10, c.config.vdim = 6, c.config.causal = Causal::kBottomRight, c.config.batch_first = false;
    c.cross = c.lengths = true, c.Tq = 4, c.Tk = 9;
    cases.push_back(c);
  }
  {
    FdCase c{"seed 003 layout: no bias, no out_proj, dim_k != dim_v", base(8, 2)};
    c.config.bias = false, c.config.out_proj = false, c.config.qk_proj_dim = 12, c.config.v_proj_dim = 6;
    cases.push_back(c);
  }
  {
    FdCase c{"sliding window 3, MQA", base(16, 4)};
    c.config.num_kv_heads = 1, c.config.causal = Causal::kTopLeft, c.config.window = 3;
    cases.push_back(c);
  }
  {
    FdCase c{"softcap 1.5, ALiBi, sinks, GQA 4/2, causal", base(16, 4)};
    c.config.num_kv_heads = 2, c.config.causal = Causal::kTopLeft;
    c.config.softcap = 1.5f, c.config.alibi = true, c.config.sinks = true;
    cases.push_back(c);
  }
  {
    FdCase c{"rotary (half-split) + QK-norm, causal, window 4", base(16, 2)};
    c.config.causal = Causal::kTopLeft, c.config.window = 4;
    c.config.rotary.dims = 8, c.config.qk_norm = true;
    cases.push_back(c);
  }
  {
    FdCase c{"rotary interleaved, partial, YaRN; cross bottom-right, sinks", base(12, 2)};
    c.config.kdim = 10, c.config.vdim = 6, c.config.causal = Causal::kBottomRight;
    c.config.rotary.dims = 4, c.config.rotary.interleaved = true, c.config.rotary.scaling = RopeScaling::kYarn;
    c.config.rotary.factor = 4, c.config.rotary.original_max_positions = 4, c.config.sinks = true;
    c.cross = true, c.Tq = 4, c.Tk = 9;
    cases.push_back(c);
  }
  {
    FdCase c{"training: attention dropout 0.3 and output dropout 0.2", base(16, 2)};
    c.config.attn_dropout = 0.3f, c.config.out_dropout = 0.2f, c.config.causal = Causal::kTopLeft;
    c.training = true;
    cases.push_back(c);
  }
  return cases;
}

struct FdProblem {
  Tensor x, k, v, keep, bias, lengths, r;
  MhaInputs inputs(const FdCase& c) const {
    MhaInputs in;
    in.query = x.view<float>();
    if (c.cross) {
      in.key = k.view<float>();
      in.value = v.view<float>();
    }
    if (keep.defined()) in.keep_mask = keep.view<uint8_t>();
    if (bias.defined()) in.attn_bias = bias.view<float>();
    if (lengths.defined()) in.key_lengths = lengths.view<int64_t>();
    return in;
  }
  MhaCallOptions options(const FdCase& c) const {
    MhaCallOptions o;
    o.training = c.training;
    o.dropout_seed = 1234;  // the same dropout draws on every forward
    return o;
  }
};

TEST(ModuleBackward, MatchesFiniteDifferences) {
  Rng rng(base_seed() + 71);
  for (const FdCase& fc : fd_cases()) {
    SCOPED_TRACE(fc.name);
    MultiHeadAttention m(fc.config, 5);
    const auto& c = m.config();
    auto shape = [&](int64_t T, int64_t E) {
      return c.batch_first ? std::vector<int64_t>{fc.B, T, E} : std::vector<int64_t>{T, fc.B, E};
    };
    FdProblem p;
    p.x = random_tensor(rng, shape(fc.Tq, c.embed_dim));
    if (fc.cross) {
      p.k = random_tensor(rng, shape(fc.Tk, c.kdim));
      p.v = random_tensor(rng, shape(fc.Tk, c.vdim));
    }
    if (fc.keep_mask) {
      p.keep = random_mask(rng, {fc.B, 1, fc.Tq, fc.Tk}, 0.7);
      for (int64_t b = 0; b < fc.B; ++b)
        for (int64_t i = 0; i < fc.Tq; ++i) p.keep.data<uint8_t>()[(b * fc.Tq + i) * fc.Tk + i] = 1;
    }
    if (fc.attn_bias) p.bias = random_tensor(rng, {fc.Tq, fc.Tk});
    if (fc.lengths) {
      p.lengths = Tensor(DType::kI64, {fc.B});
      for (int64_t b = 0; b < fc.B; ++b) p.lengths.data<int64_t>()[b] = static_cast<int64_t>(fc.Tk - 2 * b);
    }
    p.r = random_tensor(rng, shape(fc.Tq, m.output_dim()));

    const MhaInputs in = p.inputs(fc);
    MhaCallOptions options = p.options(fc);
    MhaTape tape;
    m.forward(in, options, &tape);
    MhaParamGrads grads = m.make_grads();
    MhaInputGrads ig = m.backward(tape, p.r.view<float>(), &grads);

    // The loss in double from the plain reference forward: smooth enough for differences of
    // float outputs. Rounding of the loss is ~1e-7 |loss| per evaluation, so h = 1e-2 gives an
    // error ~1e-5 relative plus h² truncation ~1e-4: the check is on 1e-3 of the largest entry (observed: <= 1e-4).
    options.backend = Backend::kReference;
    auto loss = [&] { return sum_product(m.forward(in, options).output, p.r); };
    constexpr float h = 1e-2f;
    double worst = 0;
    const std::vector<Parameter> params = m.parameters(&grads);
    double v_bias_scale = 0;
    for (const Parameter& prm : params)
      if (prm.name == "v_proj.bias") v_bias_scale = max_abs_of(prm.grad);
    auto check = [&](float* value, View<const float> grad, int64_t count, const std::string& what) {
      const double scale = what == "k_proj.bias" ? v_bias_scale : max_abs_of(grad);
      ASSERT_GT(scale, 0) << what << ": gradient is zero";
      for (int64_t s = 0; s < count; ++s) {
        const int64_t i = rng.range(0, grad.numel() - 1);
        const float saved = value[i];
        value[i] = saved + h;
        const double up = loss();
        value[i] = saved - h;
        const double down = loss();
        value[i] = saved;
        const double fd = (up - down) / (2.0 * h);
        const double err = std::fabs(fd - grad.data[i]) / scale;
        worst = std::max(worst, err);
        EXPECT_LE(err, 1e-3) << what << "[" << i << "]: finite difference " << fd << ", backward " << grad.data[i];
      }
    };
    for (const Parameter& prm : params) check(prm.value.data, prm.grad, 12, prm.name);
    check(p.x.data<float>(), ig.query.view<float>(), 12, "query");
    if (fc.cross) {
      check(p.k.data<float>(), ig.key.view<float>(), 12, "key");
      check(p.v.data<float>(), ig.value.view<float>(), 12, "value");
    } else {
      EXPECT_FALSE(ig.key.defined());
    }
    std::printf("module backward vs finite differences, %-60s worst %.1e of max |grad|\n", fc.name, worst);
  }
}

TEST(ModuleBackward, FastAndReferencePathsAgree) {
  // The attention backward's bound rule (numerics.md) at module level, on a larger problem.
  MultiHeadAttentionConfig c;
  c.embed_dim = 64, c.num_heads = 4, c.num_kv_heads = 2, c.causal = Causal::kTopLeft;
  MultiHeadAttention m(c, 9);
  Rng rng(base_seed() + 72);
  const Tensor x = random_tensor(rng, {2, 70, 64}), r = random_tensor(rng, {2, 70, 64});
  MhaInputs in;
  in.query = x.view<float>();
  MhaParamGrads fast = m.make_grads(), ref = m.make_grads();
  MhaTape tape;
  m.forward(in, {}, &tape);
  const Tensor dx_fast = std::move(m.backward(tape, r.view<float>(), &fast).query);
  MhaCallOptions reference;
  reference.backend = Backend::kReference;
  m.forward(in, reference, &tape);
  const Tensor dx_ref = std::move(m.backward(tape, r.view<float>(), &ref, reference).query);
  EXPECT_LE(rel_error(dx_fast.view<float>(), dx_ref.view<float>()), 1e-5);
  const auto pf = m.parameters(&fast), pr = m.parameters(&ref);
  for (size_t i = 0; i < pf.size(); ++i) {
    if (pf[i].name == "k_proj.bias") {  // zero up to rounding: on the value bias's scale
      double diff = 0;
      for (int64_t j = 0; j < pf[i].grad.numel(); ++j)
        diff = std::max(diff, std::fabs(static_cast<double>(pf[i].grad.data[j]) - pr[i].grad.data[j]));
      EXPECT_LE(diff, 1e-5 * max_abs_of(pr[i + 2].grad)) << pf[i].name;  // v_proj.bias
      continue;
    }
    EXPECT_LE(rel_error(pf[i].grad, pr[i].grad), 1e-5) << pf[i].name;
  }
}

TEST(ModuleBackward, SameBitsForOneAndTwoThreads) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 48, c.num_heads = 6, c.num_kv_heads = 3, c.causal = Causal::kTopLeft;
  c.attn_dropout = 0.1f, c.out_dropout = 0.1f;
  Rng rng(base_seed() + 73);
  const Tensor x = random_tensor(rng, {3, 150, 48}), r = random_tensor(rng, {3, 150, 48});
  std::vector<Tensor> results[2];
  for (int threads : {1, 2}) {
    MultiHeadAttention m(c, 4);
    MhaCallOptions options;
    options.training = true;
    options.num_threads = threads;
    options.dropout_seed = 99;
    MhaInputs in;
    in.query = x.view<float>();
    MhaTape tape;
    m.forward(in, options, &tape);
    MhaParamGrads g = m.make_grads();
    Tensor dx = std::move(m.backward(tape, r.view<float>(), &g, options).query);
    auto& out = results[threads - 1];
    out.push_back(std::move(dx));
    for (Tensor* t : {&g.in_weight, &g.in_bias, &g.out_weight, &g.out_bias}) out.push_back(std::move(*t));
  }
  for (size_t i = 0; i < results[0].size(); ++i) EXPECT_TRUE(bitwise_equal(results[0][i], results[1][i])) << i;
}

TEST(ModuleBackward, GradientsAccumulateUntilZeroed) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 16, c.num_heads = 2;
  c.bias = false;
  MultiHeadAttention m(c, 1);
  Rng rng(base_seed() + 74);
  const Tensor x = random_tensor(rng, {1, 5, 16}), r = random_tensor(rng, {1, 5, 16});
  MhaInputs in;
  in.query = x.view<float>();
  MhaTape tape;
  m.forward(in, {}, &tape);
  MhaParamGrads g = m.make_grads();
  m.backward(tape, r.view<float>(), &g);
  const Tensor once = g.in_weight.clone();
  m.backward(tape, r.view<float>(), &g);
  for (int64_t i = 0; i < once.numel(); ++i) ASSERT_EQ(g.in_weight.data<float>()[i], 2 * once.data<float>()[i]);
  for (int64_t i = 0; i < g.in_bias.numel(); ++i) ASSERT_EQ(g.in_bias.data<float>()[i], 0.0f);  // no bias
  EXPECT_EQ(m.parameters(&g).size(), 4u);  // four weights, no biases
  g.zero();
  for (int64_t i = 0; i < g.in_weight.numel(); ++i) ASSERT_EQ(g.in_weight.data<float>()[i], 0.0f);
}

TEST(ModuleBackward, BadArgumentsAreErrors) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 16, c.num_heads = 2;
  MultiHeadAttention m(c, 1), other(c, 2);
  MultiHeadAttentionConfig c2 = c;
  c2.embed_dim = 8;
  MultiHeadAttention small(c2, 3);
  Rng rng(base_seed() + 75);
  const Tensor x = random_tensor(rng, {1, 5, 16}), r = random_tensor(rng, {1, 5, 16}), bad = random_tensor(rng, {1, 4, 16});
  MhaInputs in;
  in.query = x.view<float>();
  MhaParamGrads g = m.make_grads(), g_small = small.make_grads();
  MhaTape empty;
  EXPECT_THROW(m.backward(empty, r.view<float>(), &g), Error);
  MhaTape tape;
  m.forward(in, {}, &tape);
  EXPECT_THROW(other.backward(tape, r.view<float>(), &g), Error);
  EXPECT_THROW(m.backward(tape, r.view<float>(), &g_small), Error);
  EXPECT_THROW(m.backward(tape, r.view<float>(), nullptr), Error);
  try {
    m.backward(tape, bad.view<float>(), &g);
    FAIL() << "no error for a wrong grad_output shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grad_output must have the output's shape (1, 5, 16); got (1, 4, 16)"),
              std::string::npos)
        << e.what();
  }
}

// --- Optimizers ----------------------------------------------------------------------------------

TEST(Optim, AdamFollowsTorchUpdateRule) {
  // torch.optim.Adam: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²;
  // p -= lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps), with L2 decay added to g.
  for (bool decoupled : {false, true}) {
    std::vector<float> w = {0.5f, -1.0f, 2.0f}, g(3);
    AdamOptions o;
    o.lr = 0.1f, o.weight_decay = 0.01f, o.decoupled_weight_decay = decoupled;
    Adam adam({{"w", View<float>(w.data(), {3}), View<float>(g.data(), {3})}}, o);
    std::vector<double> wd(w.begin(), w.end()), m(3, 0), v(3, 0);
    for (int t = 1; t <= 5; ++t) {
      for (int i = 0; i < 3; ++i) g[i] = static_cast<float>(std::sin(t + i));
      adam.step();
      for (int i = 0; i < 3; ++i) {
        double gi = g[i];
        if (decoupled) {
          wd[i] *= 1 - 0.1 * 0.01;
        } else {
          gi += 0.01 * wd[i];
        }
        m[i] = 0.9 * m[i] + 0.1 * gi;
        v[i] = 0.999 * v[i] + 0.001 * gi * gi;
        wd[i] -= 0.1 / (1 - std::pow(0.9, t)) * m[i] / (std::sqrt(v[i]) / std::sqrt(1 - std::pow(0.999, t)) + 1e-8);
      }
    }
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(w[i], wd[i], 1e-5) << i << (decoupled ? " AdamW" : " Adam");
  }
}

TEST(Optim, SgdWithMomentumFollowsTorchUpdateRule) {
  std::vector<float> w = {1.0f, -2.0f}, g(2);
  SgdOptions o;
  o.lr = 0.1f, o.momentum = 0.9f;
  Sgd sgd({{"w", View<float>(w.data(), {2}), View<float>(g.data(), {2})}}, o);
  std::vector<double> wd(w.begin(), w.end()), buf(2, 0);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 2; ++i) g[i] = static_cast<float>(0.5 * (t + 1) - i);
    sgd.step();
    for (int i = 0; i < 2; ++i) {
      buf[i] = t == 0 ? g[i] : 0.9 * buf[i] + g[i];
      wd[i] -= 0.1 * buf[i];
    }
  }
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(w[i], wd[i], 1e-6);
  sgd.zero_grad();
  EXPECT_EQ(g[0], 0.0f);
  EXPECT_EQ(g[1], 0.0f);
}

TEST(Optim, MismatchedParameterIsAnError) {
  std::vector<float> w(4), g(3);
  EXPECT_THROW(Adam({{"w", View<float>(w.data(), {4}), View<float>(g.data(), {3})}}, AdamOptions{}), Error);
  AdamOptions bad;
  bad.beta1 = 1.0f;
  EXPECT_THROW(Adam({}, bad), Error);
}

// An infinite rate or decay turned every weight into inf or NaN at the first step, and eps = 0
// divided 0 by 0; options() could set any of them after the constructor's check.
TEST(Optim, OptionsAreFiniteAndCheckedAtEachStep) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> w = {0.5f, -1.0f}, g = {0.0f, 1.0f};
  const std::vector<Parameter> params = {{"w", View<float>(w.data(), {2}), View<float>(g.data(), {2})}};
  const std::pair<float AdamOptions::*, const char*> adam_fields[] = {
      {&AdamOptions::lr, "lr"}, {&AdamOptions::weight_decay, "weight_decay"}, {&AdamOptions::eps, "eps"}};
  const std::pair<float SgdOptions::*, const char*> sgd_fields[] = {
      {&SgdOptions::lr, "lr"}, {&SgdOptions::momentum, "momentum"}, {&SgdOptions::weight_decay, "weight_decay"}};
  for (float x : {inf, -inf, nan}) {
    for (const auto& [field, name] : adam_fields) {
      AdamOptions a;
      a.*field = x;
      expect_error([&] { Adam(params, a); }, {"Adam", name});
    }
    for (const auto& [field, name] : sgd_fields) {
      SgdOptions o;
      o.*field = x;
      expect_error([&] { Sgd(params, o); }, {"Sgd", name});
    }
  }
  AdamOptions zero_eps;
  zero_eps.eps = 0.0f;
  expect_error([&] { Adam(params, zero_eps); }, {"Adam", "eps must be finite and > 0", "got 0"});

  Adam adam(params, AdamOptions{});
  adam.step();
  const std::vector<float> after_one = w;
  for (float x : {inf, nan, -0.5f}) {
    adam.options().lr = x;
    expect_error([&] { adam.step(); }, {"Adam", "lr"});
    EXPECT_EQ(w, after_one);  // a refused step changes nothing
    EXPECT_EQ(adam.steps(), 1);
  }
  adam.options().lr = 1e-3f;
  adam.options().beta2 = 1.0f;
  expect_error([&] { adam.step(); }, {"Adam", "betas"});
  adam.options().beta2 = 0.999f;
  adam.step();
  EXPECT_EQ(adam.steps(), 2);
  EXPECT_NE(w, after_one);
  for (float x : w) EXPECT_TRUE(std::isfinite(x));
}

}  // namespace
}  // namespace mha::test
