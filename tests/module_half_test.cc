// MultiHeadAttention in bfloat16 and float16: weights stored in the dtype, float32 inside,
// outputs rounded once. The oracle is a float32 module holding the same (rounded) weights, on
// the reference backend (double accumulation), fed the same rounded inputs. Bound, derived in
// docs/numerics.md ("16-bit modules"), per output element n, o:
//   |y16 - y| <= u16·|y| + [bf16 only] u16·Σ_i |a_ni|·|Wo_oi| + 1e-5·max|y|
// (the output's rounding; a bfloat16 module also rounds the attention output a before the
// output projection, each a_ni by at most u16·|a_ni|; the last term covers float32 arithmetic).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "mha/multi_head_attention.h"
#include "mha/safetensors.h"
#include "test_util.h"

namespace mha::test {
namespace {

double unit_roundoff(DType t) { return t == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048; }

class ModuleHalf : public ::testing::TestWithParam<DType> {};

std::string dtype_param(const ::testing::TestParamInfo<DType>& info) { return dtype_name(info.param); }

MultiHeadAttentionConfig config(DType t) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 48;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.dtype = t;
  return c;
}

// The 16-bit module's weights in a float32 module (exact: every 16-bit value is a float).
MultiHeadAttention float_twin(const MultiHeadAttention& m) {
  MultiHeadAttentionConfig c = m.config();
  c.dtype = DType::kF32;
  MultiHeadAttention f(c);
  const LoadReport r = f.load_state_dict(m.state_dict());
  EXPECT_FALSE(r.converted.empty());  // 16-bit tensors widened to float32
  return f;
}

template <typename T>
Tensor forward16(const MultiHeadAttention& m, const Tensor& x16, const MhaCallOptions& o = {}) {
  BasicMhaInputs<T> in;
  in.query = x16.view<T>();
  return m.forward(in, o).output;
}

Tensor forward_dtype(const MultiHeadAttention& m, const Tensor& x16, const MhaCallOptions& o = {}) {
  return x16.dtype() == DType::kBF16 ? forward16<bfloat16>(m, x16, o) : forward16<float16>(m, x16, o);
}

// max over elements of |got - want| - bound(n, o); <= 0 passes.
void expect_within_bound(const MultiHeadAttention& m, const MultiHeadAttention& f, const Tensor& x32,
                         const Tensor& got16, Causal causal) {
  const DType t = m.config().dtype;
  const double u16 = unit_roundoff(t);
  MhaCallOptions ref;
  ref.backend = Backend::kReference;
  ref.causal = causal;
  MhaInputs in;
  in.query = x32.view<float>();
  const Tensor want = f.forward(in, ref).output;
  // The attention output a of the reference: the module without its output projection.
  MultiHeadAttentionConfig nc = f.config();
  nc.out_proj = false;
  MultiHeadAttention noproj(nc);
  StateDict sd = f.state_dict();
  const Tensor wo = sd.at("out_proj.weight").clone();
  sd.erase("out_proj.weight");
  sd.erase("out_proj.bias");
  noproj.load_state_dict(sd);
  const Tensor a = noproj.forward(in, ref).output;
  const Tensor got = got16.to_f32();
  const int64_t rows = a.numel() / nc.v_proj_dim, O = f.output_dim(), I = nc.v_proj_dim;
  const double ymax = max_abs(want.view<float>());
  double worst = 0;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t o = 0; o < O; ++o) {
      double mixed = 0;
      for (int64_t i = 0; i < I; ++i)
        mixed += std::fabs(a.data<float>()[n * I + i]) * std::fabs(wo.data<float>()[o * I + i]);
      const double y = want.data<float>()[n * O + o];
      const double bound = u16 * std::fabs(y) + (t == DType::kBF16 ? u16 * mixed : 0.0) + 1e-5 * ymax;
      worst = std::max(worst, std::fabs(got.data<float>()[n * O + o] - y) / bound);
    }
  EXPECT_LE(worst, 1.0) << dtype_name(t) << ": error / bound";
  EXPECT_GT(worst, 0.0);  // the comparison saw rounding at all
}

TEST_P(ModuleHalf, ForwardWithinTheRoundingBound) {
  Rng rng(base_seed() + 300);
  for (Causal causal : {Causal::kNone, Causal::kTopLeft}) {
    MultiHeadAttention m(config(GetParam()), 7);
    const MultiHeadAttention f = float_twin(m);
    const Tensor x16 = random_tensor(rng, {3, 37, 48}).converted(GetParam());
    MhaCallOptions o;
    o.causal = causal;
    expect_within_bound(m, f, x16.to_f32(), forward_dtype(m, x16, o), causal);
  }
}

TEST_P(ModuleHalf, StepMatchesForward) {
  Rng rng(base_seed() + 301);
  auto c = config(GetParam());
  c.causal = Causal::kTopLeft;
  MultiHeadAttention m(c, 9);
  const Tensor x16 = random_tensor(rng, {2, 20, 48}).converted(GetParam());
  const Tensor full = forward_dtype(m, x16).to_f32();
  KvCache cache = m.make_cache(2);
  // Prefill 12 positions, then 8 single steps.
  Tensor steps(DType::kF32, {2, 20, 48});
  auto run_step = [&](int64_t t0, int64_t n) {
    Tensor chunk(GetParam(), {2, n, 48});
    for (int64_t b = 0; b < 2; ++b)
      std::memcpy(static_cast<uint16_t*>(chunk.raw()) + b * n * 48,
                  static_cast<const uint16_t*>(x16.raw()) + (b * 20 + t0) * 48, n * 48 * 2);
    const Tensor y = GetParam() == DType::kBF16
                         ? m.step(chunk.view<bfloat16>(), cache).output
                         : m.step(chunk.view<float16>(), cache).output;
    EXPECT_EQ(y.dtype(), GetParam());
    const Tensor yf = y.to_f32();
    for (int64_t b = 0; b < 2; ++b)
      std::memcpy(steps.data<float>() + (b * 20 + t0) * 48, yf.data<float>() + b * n * 48, n * 48 * 4);
  };
  run_step(0, 12);
  for (int64_t t = 12; t < 20; ++t) run_step(t, 1);
  // Both round a float32 result once; the float32 results differ by attention's kernel choice.
  EXPECT_LE(rel_error(steps.view<float>(), full.view<float>()), 2 * unit_roundoff(GetParam()));
}

TEST_P(ModuleHalf, WeightsDtypeAndRoundTrip) {
  MultiHeadAttention m(config(GetParam()), 3);
  const StateDict sd = m.state_dict();
  for (const auto& [name, t] : sd) EXPECT_EQ(t.dtype(), GetParam()) << name;
  MultiHeadAttention n(config(GetParam()), 4);
  const LoadReport r = n.load_state_dict(sd);
  EXPECT_TRUE(r.converted.empty());
  for (const auto& [name, t] : n.state_dict()) EXPECT_TRUE(bitwise_equal(t, sd.at(name))) << name;
  // A float32 dict converts (and says so).
  auto c32 = config(GetParam());
  c32.dtype = DType::kF32;
  MultiHeadAttention f(c32, 5);
  const LoadReport rf = n.load_state_dict(f.state_dict());
  EXPECT_EQ(rf.converted.size(), rf.used.size());
  for (const auto& [name, t] : n.state_dict()) {
    EXPECT_TRUE(bitwise_equal(t, f.state_dict().at(name).converted(GetParam()))) << name;
  }
}

// 16-bit weights through a safetensors file: BF16/F16 written and read back, the module
// rebuilt from them with the same bits and the same outputs.
TEST_P(ModuleHalf, SafetensorsRoundTrip) {
  MultiHeadAttention m(config(GetParam()), 21);
  const std::string path = std::string(MHA_TEST_TMP) + "/half_" + dtype_name(GetParam()) + ".safetensors";
  write_safetensors(path, m.state_dict());
  const StateDict sd = std::move(read_safetensors(path).tensors);
  for (const auto& [name, t] : sd) EXPECT_EQ(t.dtype(), GetParam()) << name;
  MultiHeadAttentionConfig base;
  base.num_heads = 6;
  base.dtype = GetParam();
  LoadReport r;
  const MultiHeadAttention n = MultiHeadAttention::from_state_dict(sd, base, &r);
  EXPECT_TRUE(r.converted.empty());
  EXPECT_EQ(n.config().num_kv_heads, 2);
  Rng rng(base_seed() + 302);
  const Tensor x16 = random_tensor(rng, {2, 9, 48}).converted(GetParam());
  EXPECT_TRUE(bitwise_equal(forward_dtype(m, x16), forward_dtype(n, x16)));
}

TEST_P(ModuleHalf, ClearErrors) {
  MultiHeadAttention m(config(GetParam()), 3);
  const Tensor x = Tensor::zeros({1, 4, 48});
  MhaInputs in;
  in.query = x.view<float>();
  expect_error([&] { m.forward(in); }, {"dtype", dtype_name(GetParam()), "F32"});
  MhaTape tape;
  expect_error([&] { m.forward(in, {}, &tape); }, {"dtype"});
  expect_error([&] { m.weight(MultiHeadAttention::kQ); }, {"weight", dtype_name(GetParam()), "state_dict"});
  KvCache cache = m.make_cache(1);
  expect_error([&] { m.step(x.view<float>(), cache); }, {"step", "dtype"});
  // A float32 module refuses 16-bit inputs.
  auto c32 = config(GetParam());
  c32.dtype = DType::kF32;
  MultiHeadAttention f(c32, 3);
  const Tensor x16 = x.converted(GetParam());
  expect_error([&] { forward_dtype(f, x16); }, {"dtype", "F32", dtype_name(GetParam())});
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ModuleHalf, ::testing::Values(DType::kBF16, DType::kF16), dtype_param);

TEST(ModuleHalfConfig, RejectsOtherDtypes) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 8;
  c.dtype = DType::kI8;
  expect_error([&] { MultiHeadAttention m(c); }, {"dtype", "I8"});
}

}  // namespace
}  // namespace mha::test
