// The decode kernel's bfloat16 value passes against its float pass (the values widened, float32
// FMAs), both after the same key scores: with AMX tiles (AmxBf16Values, decode_amx-inl.h) and with
// vdpbf16ps on key pairs (Bf16Output, decode_bf16_values-inl.h; forced on where the CPU has
// AVX-512 BF16 but runs it slowly, so that it is checked wherever it can run). Over query rows
// per kv head (the tiles take up to 8), head dims, cache lengths around the 16-key steps, the key
// pairs and the 128-key blocks, windowed rings and paged pools (rows not evenly spaced: the
// tiles' staged steps), and on infinite values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "kernels/cpu/flash.h"
#include "mha/kv_cache.h"
#include "mha/paged_kv_cache.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr double kU = 1.0 / (1 << 24), kU16 = 1.0 / 256;

// The two bfloat16 value passes, each tested against the float pass.
enum class Pass { kAmx, kDots };

std::string PassName(const ::testing::TestParamInfo<Pass>& info) { return info.param == Pass::kAmx ? "AMX" : "Dots"; }
void PrintTo(Pass pass, std::ostream* os) { *os << (pass == Pass::kAmx ? "AMX tiles" : "vdpbf16ps pairs"); }

// Whether `pass` can run here. The AMX pass implies the key tiles it shares (decode_amx_bf16()).
bool Available(Pass pass) {
  if (pass == Pass::kAmx) return kernels::decode_amx_bf16_values();
  return kernels::decode_bf16_dots();
}

// The most query rows per kv head that `pass` takes (more: the float pass on both sides).
int64_t MaxRows(Pass pass) { return pass == Pass::kAmx ? 8 : 16; }

// attend()'s float32 output with `pass` on, or with the float pass (both off).
template <typename Cache>
Tensor Attend(Pass pass, const Tensor& q, const Cache& cache, bool on, const std::vector<int64_t>& ids = {}) {
  kernels::allow_decode_amx_values(on && pass == Pass::kAmx);
  kernels::force_decode_bf16_values(on && pass == Pass::kDots);
  kernels::allow_decode_bf16_values(on && pass == Pass::kDots);
  Tensor out = Tensor::zeros({q.shape()[0], q.shape()[1], q.shape()[2], cache.config().head_dim_v});
  if constexpr (std::is_same_v<Cache, KvCache>) {
    attend(q.view<float>(), cache, out.view<float>());
  } else {
    attend(q.view<float>(), cache, ids, out.view<float>());
  }
  return out;
}

// The bound on one output element of either pass against the float pass: P rounded to bfloat16
// (≤ u16 relative per weight) and both passes' float32 sums of Tk products in other orders
// (≤ 2(Tk + 2)u between them), each on the scale A = Σ_j P_j·|v_jc| / l, from float64
// weights of the cached (bfloat16) keys over the positions the query sees; ×1.01 for the
// kernel's own P (its scores within ~1e-5 of the float64 ones). attend() rounds the output to
// the cache's type: each side by ≤ u16 of its value.
struct Reference {
  std::vector<double> scale;  // A per (query row, value column)
};

Reference Scales(const Tensor& q, const Tensor& k, const Tensor& v, int64_t first, int64_t last) {
  // q (1, Hq, 1, D), k (1, Hkv, L, D), v (1, Hkv, L, Dv) widened from the cache; keys [first, last).
  const int64_t Hq = q.shape()[1], D = q.shape()[3], Hkv = k.shape()[1], L = k.shape()[2], Dv = v.shape()[3];
  const int64_t G = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Reference ref;
  ref.scale.assign(static_cast<size_t>(Hq * Dv), 0.0);
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / G;
    std::vector<double> s(static_cast<size_t>(L), 0.0);
    double m = -INFINITY;
    for (int64_t j = first; j < last; ++j) {
      double a = 0;
      for (int64_t c = 0; c < D; ++c)
        a += static_cast<double>(q.data<float>()[h * D + c]) * k.data<float>()[(hk * L + j) * D + c];
      s[static_cast<size_t>(j)] = a * scale;
      m = std::max(m, a * scale);
    }
    double l = 0;
    for (int64_t j = first; j < last; ++j) l += std::exp(s[static_cast<size_t>(j)] - m);
    for (int64_t j = first; j < last; ++j) {
      const double p = std::exp(s[static_cast<size_t>(j)] - m) / l;
      for (int64_t c = 0; c < Dv; ++c)
        ref.scale[static_cast<size_t>(h * Dv + c)] += p * std::fabs(double{v.data<float>()[(hk * L + j) * Dv + c]});
    }
  }
  return ref;
}

void ExpectWithinBound(const Tensor& fast, const Tensor& plain, const Reference& ref, int64_t Tk, double* worst) {
  const double rel = kU16 + 2 * static_cast<double>(Tk + 2) * kU;
  for (int64_t i = 0; i < plain.numel(); ++i) {
    const double a = fast.data<float>()[i], b = plain.data<float>()[i];
    const double bound = 1.01 * rel * ref.scale[static_cast<size_t>(i)] + kU16 * (std::fabs(a) + std::fabs(b)) + 1e-30;
    ASSERT_LE(std::fabs(a - b), bound) << "element " << i << ": " << a << ", float pass " << b;
    *worst = std::max(*worst, std::fabs(a - b) / bound);
  }
}

// A bfloat16 KvCache holding k (1, Hkv, Tk, D) and v (1, Hkv, Tk, Dv).
KvCache Bf16Cache(const Tensor& k, const Tensor& v) {
  KvCacheConfig c;
  c.kv_heads = k.shape()[1];
  c.head_dim_qk = k.shape()[3];
  c.head_dim_v = v.shape()[3];
  c.dtype = CacheType::kBF16;
  KvCache cache(c);
  cache.append(k.view<float>(), v.view<float>());
  return cache;
}

class DecodeBf16Values : public ::testing::TestWithParam<Pass> {
 protected:
  void SetUp() override {
    if (!Available(GetParam()))
      GTEST_SKIP() << (GetParam() == Pass::kAmx ? "this CPU has no AMX-BF16 tiles" : "this CPU has no AVX-512 BF16")
                   << ": the float pass alone runs";
  }
  RestoreKernelSwitches restore_;  // puts the switches back after each test
};

TEST_P(DecodeBf16Values, StayWithinTheBoundOfTheFloatPass) {
  const Pass pass = GetParam();
  Rng rng(base_seed() + 910);
  double worst = 0;
  int cases = 0, taken = 0, taken_narrow = 0;
  for (int64_t G : {1, 4, 8, 16})
    for (int64_t D : {32, 64, 128})
      for (int64_t Dv : {32, 96, 128})
        for (int64_t Tk : {1, 2, 15, 16, 17, 127, 128, 129, 300}) {
          if ((D + Dv + Tk + G) % 3 != 0 && !(D == 128 && Dv == 128)) continue;  // a third of the mixed dims
          SCOPED_TRACE(::testing::Message() << "G=" << G << " D=" << D << " Dv=" << Dv << " Tk=" << Tk);
          const Tensor k = random_tensor(rng, {1, 2, Tk, D}), v = random_tensor(rng, {1, 2, Tk, Dv});
          const KvCache cache = Bf16Cache(k, v);
          const Tensor q = random_tensor(rng, {1, 2 * G, 1, D});
          const Tensor fast = Attend(pass, q, cache, true), plain = Attend(pass, q, cache, false);
          if (G > MaxRows(pass)) {  // more rows than the pass takes: the float pass on both sides
            EXPECT_TRUE(bitwise_equal(fast, plain));
            continue;
          }
          Tensor kc = cache.keys_as_float(), vc = cache.values_as_float();
          // The stored rows (capacity ≥ Tk) cut to Tk positions for the reference.
          Tensor kt = Tensor::zeros({1, 2, Tk, D}), vt = Tensor::zeros({1, 2, Tk, Dv});
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t j = 0; j < Tk; ++j) {
              for (int64_t e = 0; e < D; ++e) kt.view<float>().at(0, h, j, e) = kc.view<float>().at(0, h, j, e);
              for (int64_t e = 0; e < Dv; ++e) vt.view<float>().at(0, h, j, e) = vc.view<float>().at(0, h, j, e);
            }
          Tensor q16 = q.converted(DType::kBF16).to_f32();  // the kernel rounds the query to the cache's type
          ExpectWithinBound(fast, plain, Scales(q16, kt, vt, 0, Tk), Tk, &worst);
          ++cases;
          // P rounded to bfloat16 moves the outputs' bits where the pass ran (from two keys on; one
          // key's P is 1, exact): the pass ran, for Dv = 32 too (a pass of 32 columns).
          if (Tk >= 2 && !bitwise_equal(fast, plain)) ++(Dv < 64 ? taken_narrow : taken);
        }
  EXPECT_GT(cases, 20);
  EXPECT_GT(taken, 0) << "the pass took none of the problems";
  EXPECT_GT(taken_narrow, 0) << "the pass took none of the problems with Dv = 32";
  std::printf("%s value pass: largest |pass − float pass| / bound %.3f over %d problems\n",
              pass == Pass::kAmx ? "AMX" : "vdpbf16ps", worst, cases);
}

// Values whose float pass and dot products are exact: values that are small integers (exact in
// bfloat16) and one key's weight 1, the others' 0 (scores of that key far above the rest): the
// output is that key's value row, bit for bit, on both passes, for each key position in turn
// (an odd last key, a pair's second key, a block's last). A mispaired or dropped key, or columns
// out of order, moves it.
TEST_P(DecodeBf16Values, OneKeyWeightedOneGivesItsRow) {
  const Pass pass = GetParam();
  const int64_t D = 32, Dv = 64, Tk = 131;
  Tensor k = Tensor::zeros({1, 1, Tk, D}), v = Tensor::zeros({1, 1, Tk, Dv});
  for (int64_t j = 0; j < Tk; ++j)
    for (int64_t c = 0; c < Dv; ++c) v.view<float>().at(0, 0, j, c) = static_cast<float>((j * 7 + c * 3) % 29 - 14);
  for (int64_t target : {int64_t{0}, int64_t{1}, int64_t{64}, int64_t{127}, int64_t{128}, Tk - 1}) {
    SCOPED_TRACE(::testing::Message() << "key " << target);
    for (int64_t j = 0; j < Tk; ++j) k.view<float>().at(0, 0, j, 0) = j == target ? 64.0f : 0.0f;
    const KvCache cache = Bf16Cache(k, v);
    Tensor q = Tensor::zeros({1, 4, 1, D});
    for (int64_t h = 0; h < 4; ++h) q.view<float>().at(0, h, 0, 0) = 64.0f;  // scores 64²/√32 ≈ 724 against 0
    const Tensor fast = Attend(pass, q, cache, true);
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t c = 0; c < Dv; ++c)
        ASSERT_EQ(fast.view<float>().at(0, h, 0, c), v.view<float>().at(0, 0, target, c))
            << "row " << h << ", column " << c;
  }
}

// A windowed cache's ring (rows not in position order past the wrap) and a paged pool with pages
// of 16 (a block's rows across pages; the tiles take staged steps) keep the same bound.
TEST_P(DecodeBf16Values, RingsAndPagesKeepTheBound) {
  const Pass pass = GetParam();
  Rng rng(base_seed() + 911);
  const int64_t D = 64, Dv = 64, G = 4, L = 300;
  const Tensor k = random_tensor(rng, {1, 2, L, D}), v = random_tensor(rng, {1, 2, L, Dv});
  const Tensor q = random_tensor(rng, {1, 2 * G, 1, D});
  const Tensor q16 = q.converted(DType::kBF16).to_f32();
  const Tensor k16 = k.converted(DType::kBF16).to_f32(), v16 = v.converted(DType::kBF16).to_f32();
  double worst = 0;
  {
    KvCacheConfig c;
    c.kv_heads = 2;
    c.head_dim_qk = D;
    c.head_dim_v = Dv;
    c.window = 200;
    c.dtype = CacheType::kBF16;
    KvCache cache(c);
    cache.append(k.view<float>(), v.view<float>());
    // The query (position 299 after the append... seen as the last position) sees the last 200.
    const Tensor fast = Attend(pass, q, cache, true), plain = Attend(pass, q, cache, false);
    ExpectWithinBound(fast, plain, Scales(q16, k16, v16, L - 200, L), 200, &worst);
  }
  for (int64_t page : {16, 64}) {
    PagedKvCacheConfig c;
    c.kv_heads = 2;
    c.head_dim_qk = D;
    c.head_dim_v = Dv;
    c.page_size = page;
    c.pages = 4;  // grown as the two sequences take turns: their pages interleave
    c.dtype = CacheType::kBF16;
    PagedKvCache cache(c);
    const int64_t a = cache.add_sequence(), b = cache.add_sequence();
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - j0);
      const View<const float> kv = k.view<float>(), vv = v.view<float>();
      const View<const float> ks(kv.data + j0 * D, {2, n, D}, {L * D, D, 1});
      const View<const float> vs(vv.data + j0 * Dv, {2, n, Dv}, {L * Dv, Dv, 1});
      cache.append(a, ks, vs);
      cache.append(b, ks, vs);
    }
    Tensor q2 = Tensor::zeros({2, 2 * G, 1, D});
    for (int64_t i = 0; i < q.numel(); ++i) q2.data<float>()[i] = q2.data<float>()[q.numel() + i] = q.data<float>()[i];
    const Tensor fast = Attend(pass, q2, cache, true, {a, b}), plain = Attend(pass, q2, cache, false, {a, b});
    const Reference ref = Scales(q16, k16, v16, 0, L);
    Reference both;
    both.scale = ref.scale;
    both.scale.insert(both.scale.end(), ref.scale.begin(), ref.scale.end());
    ExpectWithinBound(fast, plain, both, L, &worst);
  }
  std::printf("%s value pass, rings and pages: largest |pass − float pass| / bound %.3f\n",
              pass == Pass::kAmx ? "AMX" : "vdpbf16ps", worst);
}

// An infinite value makes a sum NaN in the column beside it (AMX: 0 × Inf in the odd or even
// words) or, as the last key's partner weighted 0 (vdpbf16ps's pairs), in its own column: the
// block's columns then take the float pass, whose bits the rows of that kv head have (one block
// of keys); the other kv head's rows keep the pass's sums.
TEST_P(DecodeBf16Values, AnInfiniteValueTakesTheFloatPass) {
  const Pass pass = GetParam();
  Rng rng(base_seed() + 912);
  const int64_t D = 64, Dv = 64;
  for (const int64_t Tk : {100, 101}) {  // key 7 infinite; with 101 keys also the odd last key
    SCOPED_TRACE(::testing::Message() << "Tk=" << Tk);
    Tensor k = random_tensor(rng, {1, 2, Tk, D}), v = random_tensor(rng, {1, 2, Tk, Dv});
    v.view<float>().at(0, 1, 7, 5) = std::numeric_limits<float>::infinity();
    if (Tk % 2 == 1) v.view<float>().at(0, 1, Tk - 1, 9) = -std::numeric_limits<float>::infinity();
    const KvCache cache = Bf16Cache(k, v);
    const Tensor q = random_tensor(rng, {1, 8, 1, D});
    const Tensor fast = Attend(pass, q, cache, true), plain = Attend(pass, q, cache, false);
    for (int64_t h = 4; h < 8; ++h)
      for (int64_t c = 0; c < Dv; ++c) {
        const float a = fast.view<float>().at(0, h, 0, c), b = plain.view<float>().at(0, h, 0, c);
        EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "row " << h << ", column " << c << ": " << a << " vs " << b;
      }
    // Column 5 of kv head 1's rows is infinite, column 4 beside it finite.
    EXPECT_TRUE(std::isinf(fast.view<float>().at(0, 4, 0, 5)));
    EXPECT_TRUE(std::isfinite(fast.view<float>().at(0, 4, 0, 4)));
    if (Tk % 2 == 1) EXPECT_TRUE(std::isinf(fast.view<float>().at(0, 4, 0, 9)));
    for (int64_t h = 0; h < 4; ++h)  // kv head 0: finite values, the pass's sums
      for (int64_t c = 0; c < Dv; ++c) EXPECT_TRUE(std::isfinite(fast.view<float>().at(0, h, 0, c)));
  }
}

INSTANTIATE_TEST_SUITE_P(Passes, DecodeBf16Values, ::testing::Values(Pass::kAmx, Pass::kDots), PassName);

}  // namespace
}  // namespace mha::test
