// Numerical edge cases, on the fast path and the reference: huge logits, infinities and NaN in
// the inputs, denormals, the smallest and empty shapes, large tensors' alignment, allocation
// failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "mha/attention.h"
#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Case {
  Tensor q, k, v;
  Case(int64_t Tq, int64_t Tk, int64_t D, uint64_t seed = 1) {
    Rng rng(seed);
    q = random_tensor(rng, {1, 2, Tq, D});
    k = random_tensor(rng, {1, 2, Tk, D});
    v = random_tensor(rng, {1, 2, Tk, D});
  }
  // Output and LSE on one backend.
  std::pair<Tensor, Tensor> run(Backend backend, AttentionOptions opt = {}) const {
    Tensor out(DType::kF32, {q.shape()[0], 2, q.shape()[2], v.shape()[3]}), lse(DType::kF32, {q.shape()[0], 2, q.shape()[2]});
    opt.backend = backend;
    attention({q.view<float>(), k.view<float>(), v.view<float>()}, {out.view<float>(), lse.view<float>()}, opt);
    return {std::move(out), std::move(lse)};
  }
};

// Same NaN and infinity placement; finite entries within `tol` (relative to max |want|).
void expect_same(const Tensor& got, const Tensor& want, double tol) {
  double scale = 1e-30;
  for (int64_t i = 0; i < want.numel(); ++i)
    if (std::isfinite(want.data<float>()[i])) scale = std::max(scale, std::fabs(static_cast<double>(want.data<float>()[i])));
  for (int64_t i = 0; i < want.numel(); ++i) {
    const float g = got.data<float>()[i], w = want.data<float>()[i];
    if (std::isnan(w)) {
      ASSERT_TRUE(std::isnan(g)) << "index " << i;
    } else if (std::isinf(w)) {
      ASSERT_EQ(g, w) << "index " << i;
    } else {
      ASSERT_TRUE(std::isfinite(g)) << "index " << i << " got " << g;
      ASSERT_NEAR(g, w, tol * scale) << "index " << i;
    }
  }
}

void expect_backends_agree(const Case& c, AttentionOptions opt = {}) {
  const auto fast = c.run(Backend::kFast, opt), ref = c.run(Backend::kReference, opt);
  expect_same(fast.first, ref.first, 1e-5);
  expect_same(fast.second, ref.second, 1e-5);
}

TEST(EdgeCases, HugeLogitsDoNotOverflow) {
  for (float scale : {1e4f, -1e4f}) {
    Case c(70, 90, 16);
    AttentionOptions opt;
    opt.scale = scale;  // scores of order ±1e4
    const auto fast = c.run(Backend::kFast, opt);
    for (int64_t i = 0; i < fast.first.numel(); ++i) ASSERT_TRUE(std::isfinite(fast.first.data<float>()[i]));
    expect_backends_agree(c, opt);
  }
}

TEST(EdgeCases, InfinityInInputs) {
  // -inf in a query: scores become ±inf or NaN (k = 0 never occurs with random k); the
  // backends agree on which rows are NaN, zero (all -inf) or finite.
  Case c(50, 70, 8);
  c.q.data<float>()[3 * 8 + 2] = -kInf;
  c.k.data<float>()[(70 + 10) * 8 + 1] = kInf;  // head 1, key 10
  expect_backends_agree(c);
  AttentionOptions causal;
  causal.causal = Causal::kTopLeft;
  expect_backends_agree(c, causal);
}

TEST(EdgeCases, NaNReachesExactlyTheRowsThatAttendToIt) {
  Case c(96, 96, 8);
  c.v.data<float>()[40 * 8] = std::nanf("");   // head 0, value row 40
  c.k.data<float>()[(96 + 70) * 8] = std::nanf("");  // head 1, key row 70
  AttentionOptions opt;
  opt.causal = Causal::kTopLeft;
  for (Backend be : {Backend::kFast, Backend::kReference}) {
    const auto r = c.run(be, opt);
    for (int64_t i = 0; i < 96; ++i) {
      EXPECT_EQ(std::isnan(r.first.data<float>()[i * 8]), i >= 40) << "head 0 row " << i;
      EXPECT_EQ(std::isnan(r.first.data<float>()[(96 + i) * 8]), i >= 70) << "head 1 row " << i;
      EXPECT_EQ(std::isnan(r.second.data<float>()[96 + i]), i >= 70) << "head 1 lse " << i;
    }
  }
  // Masked away by key_lengths, the NaN is never read.
  Tensor len(DType::kI64, {1});
  len.data<int64_t>()[0] = 40;
  Tensor out(DType::kF32, {1, 2, 96, 8});
  attention({c.q.view<float>(), c.k.view<float>(), c.v.view<float>(), {}, {}, len.view<int64_t>()}, {out.view<float>()});
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data<float>()[i]));
}

TEST(EdgeCases, DenormalInputs) {
  Case c(33, 47, 16);
  for (Tensor* t : {&c.q, &c.k, &c.v})
    for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] *= 1e-39f;  // subnormal floats
  expect_backends_agree(c);
  const auto fast = c.run(Backend::kFast);
  for (int64_t i = 0; i < fast.first.numel(); ++i) ASSERT_TRUE(std::isfinite(fast.first.data<float>()[i]));
}

TEST(EdgeCases, SmallestAndEmptyShapes) {
  expect_backends_agree(Case(1, 1, 1));      // T = 1, head dim 1
  expect_backends_agree(Case(1, 300, 1));
  expect_backends_agree(Case(300, 1, 1));
  for (auto [Tq, Tk] : {std::pair<int64_t, int64_t>{0, 5}, {5, 0}, {0, 0}}) {
    const Case c(Tq, Tk, 4);
    for (Backend be : {Backend::kFast, Backend::kReference}) {
      const auto r = c.run(be);
      for (int64_t i = 0; i < r.first.numel(); ++i) EXPECT_EQ(r.first.data<float>()[i], 0.0f);
      for (int64_t i = 0; i < r.second.numel(); ++i) EXPECT_EQ(r.second.data<float>()[i], -kInf);
    }
  }
  // B = 0 through the module.
  MultiHeadAttentionConfig cfg;
  cfg.embed_dim = 8;
  cfg.num_heads = 2;
  MultiHeadAttention m(cfg);
  Tensor x(DType::kF32, {0, 5, 8});
  MhaInputs in;
  in.query = x.view<float>();
  MhaCallOptions weights;
  weights.need_weights = true;
  const MhaOutputs out = m.forward(in, weights);
  EXPECT_EQ(out.output.shape(), (std::vector<int64_t>{0, 5, 8}));
  EXPECT_EQ(out.weights.shape(), (std::vector<int64_t>{0, 5, 5}));
}

// Tensors of 2 MiB or more (with their padding) start on a 2 MiB boundary, for transparent huge
// pages (src/util/tensor.cc), smaller ones on a cache line; either is zeroed up to its end,
// whatever its size around that boundary.
TEST(EdgeCases, LargeTensorsStartOnA2MiBBoundaryAndAreZeroed) {
  constexpr int64_t kHuge = int64_t{2} << 20;
  for (int64_t bytes : {kHuge - 128, kHuge - 64, kHuge, kHuge + 4, 3 * kHuge + 12}) {
    Tensor t(DType::kU8, {bytes});
    const auto at = reinterpret_cast<uintptr_t>(t.raw());
    const bool huge = (bytes + 63) / 64 * 64 + 64 >= kHuge;  // with the tensor's one line of padding
    EXPECT_EQ(at % static_cast<uintptr_t>(huge ? kHuge : 64), 0u) << bytes << " bytes";
    const uint8_t* p = t.data<uint8_t>();
    int64_t nonzero = 0;
    for (int64_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0) << bytes << " bytes";
    t.data<uint8_t>()[bytes - 1] = 1;  // the last byte is writable
  }
}

TEST(EdgeCases, AllocationFailureIsAnErrorAndTheModuleStaysUsable) {
  MultiHeadAttentionConfig cfg;
  cfg.embed_dim = 8;
  cfg.num_heads = 2;
  MultiHeadAttention m(cfg, 1);
  // (B, T, T) weights of 2^40 floats cannot be allocated here.
  Tensor tiny(DType::kF32, {1, 4, 8});
  MhaInputs ok;
  ok.query = tiny.view<float>();
  const Tensor before = m.forward(ok).output;
  const View<const float> huge(tiny.data<float>(), {1, int64_t{1} << 20, 8}, {0, 0, 1});
  MhaInputs in;
  in.query = huge;
  MhaCallOptions weights;
  weights.need_weights = true;
  EXPECT_THROW(m.forward(in, weights), Error);
  EXPECT_TRUE(bitwise_equal(m.forward(ok).output, before));
}

}  // namespace
}  // namespace mha::test
