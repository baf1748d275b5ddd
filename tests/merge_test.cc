// merge_attention: attention over a split of the keys, merged by LSE, equals attention over all
// of them (the exact merge context-parallel ring attention relies on, python/mha/distributed.py),
// in either order; fully masked parts, NaN, thread counts and the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "mha/attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr double kU = std::numeric_limits<float>::epsilon() / 2;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Keys [s0, s1) of a (B, H, S, D) tensor (or of a (B, H, T, S) mask's last dim) as a view.
template <typename T>
View<const T> keys(const Tensor& x, int64_t s0, int64_t s1, bool last) {
  View<const T> v = const_cast<Tensor&>(x).view<T>();
  const int axis = last ? 3 : 2;
  v.data += s0 * v.stride[axis];
  v.shape[axis] = s1 - s0;
  return v;
}

struct Result {
  Tensor out, lse;
};

Result attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& keep, int64_t s0, int64_t s1) {
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], Dv = v.shape()[3];
  Result r{Tensor(DType::kF32, {B, H, T, Dv}), Tensor(DType::kF32, {B, H, T})};
  AttentionInputs in{q.view<float>(), keys<float>(k, s0, s1, false), keys<float>(v, s0, s1, false)};
  in.keep_mask = keys<uint8_t>(keep, s0, s1, true);
  AttentionOptions opt;
  opt.backend = Backend::kReference;  // float64 inside: each part within ~1 ulp
  opt.scale = 0.5f;
  attention(in, {r.out.view<float>(), r.lse.view<float>()}, opt);
  return r;
}

TEST(MergeAttention, SplitKeysMergeToAttentionOverAll) {
  Rng rng(base_seed() + 160);
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t B = rng.range(1, 2), H = rng.range(1, 3), T = rng.range(1, 9), S = rng.range(2, 40);
    const int64_t D = rng.range(1, 20), Dv = rng.range(1, 20), cut = rng.range(1, S - 1);
    const Tensor q = random_tensor(rng, {B, H, T, D}), k = random_tensor(rng, {B, H, S, D}),
                 v = random_tensor(rng, {B, H, S, Dv}, 3.0f);
    // Sparse masks leave rows that see nothing in one part, or in both.
    const Tensor keep = random_mask(rng, {B, H, T, S}, trial % 3 == 0 ? 0.08 : 0.7);
    const Result all = attend(q, k, v, keep, 0, S);
    for (bool forward_order : {true, false}) {
      Result acc = attend(q, k, v, keep, forward_order ? 0 : cut, forward_order ? cut : S);
      const Result part = attend(q, k, v, keep, forward_order ? cut : 0, forward_order ? S : cut);
      merge_attention(acc.out.view<float>(), acc.lse.view<float>(), part.out.view<float>(),
                      part.lse.view<float>(), 1 + trial % 2);
      // Each part and the full result are within ~1u of exact; the merge adds ≤ 2u of max|v|.
      const double vmax = max_abs(v.view<float>());
      for (int64_t i = 0; i < all.out.numel(); ++i)
        ASSERT_NEAR(acc.out.data<float>()[i], all.out.data<float>()[i], 8 * kU * vmax) << "trial " << trial << " " << i;
      for (int64_t i = 0; i < all.lse.numel(); ++i) {
        const float want = all.lse.data<float>()[i], got = acc.lse.data<float>()[i];
        if (want == -kInf) {
          ASSERT_EQ(got, -kInf) << "trial " << trial;  // a row that saw no key anywhere
          for (int64_t c = 0; c < Dv; ++c) ASSERT_EQ(acc.out.data<float>()[i * Dv + c], 0.0f);
        } else {
          ASSERT_NEAR(got, want, 4 * kU * std::max(1.0f, std::fabs(want))) << "trial " << trial;
        }
      }
    }
  }
}

TEST(MergeAttention, NanAndThreadCounts) {
  Rng rng(base_seed() + 161);
  const int64_t B = 2, H = 3, T = 17, Dv = 5;
  const Tensor o1 = random_tensor(rng, {B, H, T, Dv}), o2 = random_tensor(rng, {B, H, T, Dv});
  const Tensor l1 = random_tensor(rng, {B, H, T}, 4.0f), l2 = random_tensor(rng, {B, H, T}, 4.0f);
  Tensor a = o1.clone(), la = l1.clone(), b = o1.clone(), lb = l1.clone();
  la.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  la.data<float>()[4] = kInf;
  lb.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  lb.data<float>()[4] = kInf;
  merge_attention(a.view<float>(), la.view<float>(), o2.view<float>(), l2.view<float>(), 1);
  merge_attention(b.view<float>(), lb.view<float>(), o2.view<float>(), l2.view<float>(), 2);
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_TRUE(bitwise_equal(la, lb));
  for (int64_t row : {3, 4}) {
    EXPECT_TRUE(std::isnan(la.data<float>()[row]));
    for (int64_t c = 0; c < Dv; ++c) EXPECT_TRUE(std::isnan(a.data<float>()[row * Dv + c]));
  }
  EXPECT_FALSE(std::isnan(la.data<float>()[5]));
}

TEST(MergeAttention, BadArgumentsAreErrors) {
  Tensor o(DType::kF32, {1, 2, 3, 4}), l(DType::kF32, {1, 2, 3}), po(DType::kF32, {1, 2, 3, 4}), pl(DType::kF32, {1, 2, 3});
  Tensor o5(DType::kF32, {1, 2, 3, 5}), l4(DType::kF32, {1, 2, 4});
  expect_error([&] { merge_attention(o.view<float>(), l.view<float>(), o5.view<float>(), pl.view<float>()); },
               {"part_out", "(1, 2, 3, 4)", "(1, 2, 3, 5)"});
  expect_error([&] { merge_attention(o.view<float>(), l4.view<float>(), po.view<float>(), pl.view<float>()); },
               {"lse", "(1, 2, 3)", "(1, 2, 4)"});
  expect_error([&] { merge_attention(o.view<float>(), l.view<float>(), po.view<float>(), l4.view<float>()); },
               {"part_lse", "(1, 2, 4)"});
  expect_error([&] { merge_attention(o.view<float>(), l.view<float>(), o.view<float>(), pl.view<float>()); },
               {"out overlaps part_out"});
  expect_error([&] { merge_attention(o.view<float>(), l.view<float>(), po.view<float>(), pl.view<float>(), -1); },
               {"num_threads"});
  View<float> bad = o.view<float>();
  bad.rank = 3;
  expect_error([&] { merge_attention(bad, l.view<float>(), po.view<float>(), pl.view<float>()); },
               {"out", "4-D"});
  // Shapes whose element count overflows int64: an error before any address is formed.
  const int64_t big = int64_t{1} << 32;
  View<float> huge(o.data<float>(), {big, big, 1, 1}), huge_lse(l.data<float>(), {big, big, 1});
  View<const float> huge_part(po.data<float>(), {big, big, 1, 1}), huge_part_lse(pl.data<float>(), {big, big, 1});
  expect_error([&] { merge_attention(huge, huge_lse, huge_part, huge_part_lse); }, {"more elements than int64"});
  View<float> null_lse = l.view<float>();
  null_lse.data = nullptr;
  expect_error([&] { merge_attention(o.view<float>(), null_lse, po.view<float>(), pl.view<float>()); },
               {"null data pointer"});
}

}  // namespace
}  // namespace mha::test
