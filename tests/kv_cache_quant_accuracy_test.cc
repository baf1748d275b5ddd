// int4 and int8 KV caches read exactly where every path's roundings are exact (values, key
// scores), the integer value passes within their derived bounds, and
// the error of int8/int4 caches against a float32 cache on random and outlier-heavy keys
// (docs/numerics.md, "KV cache storage"; issue 13's accuracy target). The stored format and the
// decode kernel against the float32 kernel: kv_cache_quant_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cpu/flash.h"
#include "mha/kv_cache.h"
#include "test_util.h"

namespace mha::test {
namespace {

// The int4 and int8 value passes exactly, on problems where every path's roundings are exact: value
// rows whose groups each hold a 0 and the largest code, 15 or 255 (scale 1, minimum 0: the values
// are their codes, exact in bfloat16 too; weights of 1 round to whole bytes and words) and
// attention weights of exactly 1 and 0 (a query 100× one key of ±1 entries, the keys drawn at least
// 4 signs apart: every other score is then 100 · 2 · 4 / √32 ≈ 141 or more below, and its exp
// underflows; keys 1 or 2 signs apart, which random keys were at some seeds, left weights of
// 1e-45). Each query head then reads its target key's value row exactly, whether the value pass
// runs float FMAs, bfloat16 dot products on key pairs or integer products on rounded weights: every
// position of three blocks is a target in turn (both keys of a pair, the odd last key of a partial
// block, value heads of 40 columns: a partial group). A query of zeros then attends uniformly: the
// mean of integers, exact in float32 sums, which a dropped or doubled key would move by ~1/L. The
// 2^-6 bound of QuantDecode catches such a key only while it is a large share of the output (short
// sequences).
TEST(KvCacheQuantAccuracy, IntegerValuesExactWhereTheRoundingsAre) {
  constexpr int64_t G = 6, L = 301, Dk = 32;
  for (const auto& [type, Dv] : std::vector<std::pair<CacheType, int64_t>>{
           {CacheType::kInt4, 40}, {CacheType::kInt4, 128}, {CacheType::kInt8, 40}, {CacheType::kInt8, 128}}) {
    const int64_t top = type == CacheType::kInt4 ? 15 : 255;  // the largest code
    KvCacheConfig c;
    c.kv_heads = 1;
    c.head_dim_qk = Dk;
    c.head_dim_v = Dv;
    c.dtype = type;
    KvCache cache(c);
    Rng rng(base_seed() + 805);
    Tensor k(DType::kF32, {1, 1, L, Dk}), v(DType::kF32, {1, 1, L, Dv});
    for (int64_t t = 0; t < L; ++t) {
      float* row = k.data<float>() + t * Dk;
      for (bool near = true; near;) {  // redrawn until at least 4 signs from every earlier key
        for (int64_t e = 0; e < Dk; ++e) row[e] = rng.coin() ? 1.0f : -1.0f;
        near = false;
        for (int64_t u = 0; u < t && !near; ++u) {
          int64_t apart = 0;
          for (int64_t e = 0; e < Dk; ++e) apart += row[e] != k.data<float>()[u * Dk + e];
          near = apart < 4;
        }
      }
    }
    for (int64_t t = 0; t < L; ++t)
      for (int64_t e = 0; e < Dv; ++e)
        v.view<float>().at(0, 0, t, e) = static_cast<float>(e % 32 == 0 ? 0 : e % 32 == 1 ? top : rng.range(0, top));
    cache.append(k.view<float>(), v.view<float>());
    const Tensor stored = cache.values_as_float();  // (1, 1, capacity >= L, Dv)
    for (int64_t t = 0; t < L; ++t)                 // the values are their codes
      for (int64_t e = 0; e < Dv; ++e) ASSERT_EQ(stored.view<float>().at(0, 0, t, e), v.view<float>().at(0, 0, t, e));
    const Tensor keys = cache.keys_as_float();
    const RestoreKernelSwitches restore;
    for (bool dots : {true, false}) {
      kernels::allow_decode_dot_products(dots);
      SCOPED_TRACE(std::string(cache_type_name(type)) + " Dv " + std::to_string(Dv) +
                   (dots ? ", dot products where the CPU has them" : ", float path"));
      Tensor q(DType::kF32, {1, G, 1, Dk}), out(DType::kF32, {1, G, 1, Dv});
      for (int64_t t0 = 0; t0 < L; t0 += G) {
        for (int64_t h = 0; h < G; ++h)
          for (int64_t e = 0; e < Dk; ++e)
            q.view<float>().at(0, h, 0, e) = 100.0f * keys.view<float>().at(0, 0, std::min(t0 + h, L - 1), e);
        attend(q.view<float>(), cache, out.view<float>());
        for (int64_t h = 0; h < G; ++h)
          for (int64_t e = 0; e < Dv; ++e)
            ASSERT_EQ(out.view<float>().at(0, h, 0, e), v.view<float>().at(0, 0, std::min(t0 + h, L - 1), e))
                << "target key " << std::min(t0 + h, L - 1) << ", column " << e;
      }
      std::fill(q.data<float>(), q.data<float>() + q.numel(), 0.0f);
      attend(q.view<float>(), cache, out.view<float>());
      for (int64_t e = 0; e < Dv; ++e) {
        double sum = 0;
        for (int64_t t = 0; t < L; ++t) sum += v.view<float>().at(0, 0, t, e);
        for (int64_t h = 0; h < G; ++h)
          ASSERT_EQ(out.view<float>().at(0, h, 0, e), static_cast<float>(sum / L)) << "column " << e;
      }
    }
  }
}

// A cache of one int4 kv head of head dim D, for the exact problems below.
KvCacheConfig Int4Config(int64_t D) {
  KvCacheConfig c;
  c.kv_heads = 1;
  c.head_dim_qk = c.head_dim_v = D;
  c.dtype = CacheType::kInt4;
  return c;
}

// Entries of k and v (1, 1, L, D) that the cache stores differently: 0 where the codes are the values.
int64_t StoredDifferently(const KvCache& cache, const Tensor& k, const Tensor& v) {
  const Tensor keys = cache.keys_as_float(), values = cache.values_as_float();
  int64_t differ = 0;
  for (int64_t t = 0; t < k.shape()[2]; ++t)
    for (int64_t e = 0; e < k.shape()[3]; ++e) {
      differ += keys.view<float>().at(0, 0, t, e) != k.view<float>().at(0, 0, t, e);
      differ += values.view<float>().at(0, 0, t, e) != v.view<float>().at(0, 0, t, e);
    }
  return differ;
}

// G query rows of D integers of [-127, 127], row h with ±127 at entry h: the 8-bit query of the
// integer key products is then the integers themselves.
Tensor IntegerQueries(Rng& rng, int64_t G, int64_t D) {
  Tensor q(DType::kF32, {1, G, 1, D});
  for (int64_t h = 0; h < G; ++h)
    for (int64_t e = 0; e < D; ++e)
      q.view<float>().at(0, h, 0, e) = e == h ? (h % 2 ? -127.0f : 127.0f) : static_cast<float>(rng.range(-127, 127));
  return q;
}

// The int4 keys' scores exactly, on problems where every path's roundings are exact, so that
// an error of the key pass short of QuantDecode's 2^-4 (a score off by 1%, say) still shows. Key
// t's channel c is (t + c) mod 16: every channel holds the same values (key channel scales all
// 8, no outlier channel) and every group of a key holds 0 and 15 (codes = the values, scale 1/8
// of the stored k/8, minimum 0); query entries are integers of [-127, 127] with one of ±127 and
// the scale is 2^-10. The 8-bit query of the dot products is then the integers themselves, and
// both paths' scores are the exact Σ q·k / 1024 (integer sums far below 2^24, times powers of
// two). Values are their codes too. So the float path gives softmax(s)·V to float32 rounding
// (16u allowed), and the dot products to within their value pass's rounding of P to bfloat16,
// 2^-8 of each term, all terms positive (2^-8 · (1 + 2^-10) allowed; the AVX2 value pass on
// byte weights is turned off: its rounding, Int4ByteValuesWithinTheirBound below, would hide
// what this test looks for). A score off by 1% moves P by ~4% here (scores spread over ±7).
TEST(KvCacheQuantAccuracy, Int4KeyScoresExactWhereTheRoundingsAre) {
  constexpr int64_t G = 4, L = 45, D = 64;
  KvCache cache(Int4Config(D));
  Rng rng(base_seed() + 806);
  Tensor k(DType::kF32, {1, 1, L, D}), v(DType::kF32, {1, 1, L, D});
  for (int64_t t = 0; t < L; ++t)
    for (int64_t e = 0; e < D; ++e) {
      k.view<float>().at(0, 0, t, e) = static_cast<float>((t + e) % 16);
      v.view<float>().at(0, 0, t, e) = static_cast<float>((3 * t + 5 * e) % 16);
    }
  cache.append(k.view<float>(), v.view<float>());
  ASSERT_EQ(StoredDifferently(cache, k, v), 0);
  const Tensor q = IntegerQueries(rng, G, D);
  Tensor out(DType::kF32, {1, G, 1, D});
  AttentionOptions options;
  options.scale = 1.0f / 1024;
  const NaiveResult want = naive_attention({q.view<float>(), k.view<float>(), v.view<float>()}, options);
  const RestoreKernelSwitches restore;
  kernels::allow_decode_byte_values(false);
  for (bool dots : {false, true}) {
    kernels::allow_decode_dot_products(dots);
    SCOPED_TRACE(dots ? "dot products where the CPU has them" : "float path");
    const bool bf16_values = dots && kernels::decode_bf16_dots();
    attend(q.view<float>(), cache, out.view<float>(), options);
    for (int64_t h = 0; h < G; ++h)
      for (int64_t e = 0; e < D; ++e) {
        const double w = want.out[static_cast<size_t>(h * D + e)];
        const double tol = bf16_values ? w / 256 * (1 + 1.0 / 1024) : 16 * w / (1 << 24) + 1e-30;
        ASSERT_NEAR(out.view<float>().at(0, h, 0, e), w, tol) << "head " << h << ", column " << e;
      }
  }
}

// The integer value passes on rounded weights, each on its target, against the exact attention of
// an exact problem: int4 on byte weights (AVX2: Int4Output256; AVX3 with VNNI and VBMI:
// Int4OutputVnni), int8 on 16-bit weights (AVX2: Int8Output256; AVX3 with VNNI: Int8OutputVnni).
// Integer products as in Int4KeyScoresExactWhereTheRoundingsAre (int8 keys alike: every group of a
// key holds a 0 and a 255, every channel a 255), with random codes; L = 301: several blocks, the
// last partial. The scores are exact, so that the pass differs from naive_attention by the weights'
// rounding and the float pass's own (16u of the output). Values are their codes (scale 1, minimum
// 0: each group holds a 0 and the largest code). Per block, row and group the pass rounds w_j =
// P_j·scale_j to a multiple of a step below 2·Pmax·Smax/M (M = 255 bytes, 32767 words;
// docs/numerics.md), so each w_j moves by less than Pmax·Smax/M, and the output by that times the
// code the pass multiplies: |code_j − 8| ≤ 8 for int4, code_j ≤ 255 for int8. In final softmax
// weights p (naive_attention's), Pmax/l is the largest p of the key's block, at most p̂_j = the
// largest of the 2·block − 1 keys around j (an int8/int4 block has 128 keys on both targets): |Δo|
// ≤ (c/M)·Σ_j p̂_j with c the largest code multiplied. That is the worst case, all roundings one
// way (~20% of the output here); the roundings are independent, each uniform within ±step/2, so Δo
// has σ ≤ √(Σ_j p̂_j²·c_j²/3)/M, and 6σ is checked too. The pass must differ from the target's pass
// with the integer value passes turned off (float FMAs, or AVX3's bfloat16 dot products for int4)
// somewhere: else it did not run.
void CheckValuePassBound(CacheType type, const std::vector<std::string>& targets, uint64_t seed) {
  constexpr int64_t kBlock = 128;  // keys per int8/int4 block, on both targets
  const bool int4 = type == CacheType::kInt4;
  const int64_t top = int4 ? 15 : 255, offset = int4 ? 8 : 0;  // the pass multiplies code − offset
  const double levels = int4 ? 255 : 32767;
  constexpr int64_t G = 4, L = 301, D = 64;
  KvCacheConfig config = Int4Config(D);
  config.dtype = type;
  KvCache cache(config);
  Rng rng(seed);
  Tensor k(DType::kF32, {1, 1, L, D}), v(DType::kF32, {1, 1, L, D});
  // Random codes, each group of a key or value row with a 0 and the largest code, and every key
  // channel with the largest (keys 0 and 1 alternate them): the codes are the values, the key
  // channel scales all equal. Random, so that the scores (and the weights' roundings) do not
  // repeat.
  for (int64_t t = 0; t < L; ++t)
    for (int64_t e = 0; e < D; ++e) {
      const int64_t at = ((e - 2 * t) % 32 + 32) % 32;
      const int64_t key = t < 2 ? ((e + t) % 2 ? 0 : top) : at == 0 ? 0 : at == 1 ? top : rng.range(0, top);
      k.view<float>().at(0, 0, t, e) = static_cast<float>(key);
      v.view<float>().at(0, 0, t, e) = static_cast<float>(e % 32 == 0 ? 0 : e % 32 == 1 ? top : rng.range(0, top));
    }
  cache.append(k.view<float>(), v.view<float>());
  ASSERT_EQ(StoredDifferently(cache, k, v), 0);
  AttentionOptions options;
  options.scale = 1.0f / 1024;
  // The queries are drawn again until some row's weights are not one key's alone (the others'
  // at least 1e-3 together). Where every row's are, the integer pass has nothing to round and
  // gives the other pass's bits, and "did it run?" below cannot tell (MHA_TEST_SEED=150 drew such
  // queries for int8, whose scores spread widely: codes up to 255).
  Tensor q = IntegerQueries(rng, G, D);
  NaiveResult want = naive_attention({q.view<float>(), k.view<float>(), v.view<float>()}, options);
  auto spread = [&] {
    for (int64_t h = 0; h < G; ++h)
      if (*std::max_element(want.weights.begin() + h * L, want.weights.begin() + (h + 1) * L) < 1 - 1e-3) return true;
    return false;
  };
  for (int draws = 1; !spread(); ++draws) {
    ASSERT_LT(draws, 100) << "no query spreads its weights";
    q = IntegerQueries(rng, G, D);
    want = naive_attention({q.view<float>(), k.view<float>(), v.view<float>()}, options);
  }
  for (const std::string& target : targets) {
    SCOPED_TRACE(target);
    Tensor rounded(DType::kF32, {1, G, 1, D}), other(DType::kF32, {1, G, 1, D});
    const RestoreKernelSwitches restore;
    kernels::force_simd_target(target);
    attend(q.view<float>(), cache, rounded.view<float>(), options);
    kernels::allow_decode_byte_values(false);
    attend(q.view<float>(), cache, other.view<float>(), options);
    int64_t differ = 0;
    double worst = 0, worst_sigmas = 0, diff2 = 0, norm2 = 0;
    for (int64_t h = 0; h < G; ++h) {
      const double* p = want.weights.data() + h * L;
      std::vector<double> near(L);  // p̂_j
      for (int64_t j = 0; j < L; ++j)
        near[j] = *std::max_element(p + std::max<int64_t>(0, j - kBlock + 1), p + std::min(L, j + kBlock));
      double worst_case = 0;
      const double largest = static_cast<double>(std::max(offset, top - offset));  // |code − offset|
      for (int64_t j = 0; j < L; ++j) worst_case += largest / levels * near[j];
      for (int64_t e = 0; e < D; ++e) {
        double var = 0;
        for (int64_t j = 0; j < L; ++j) {
          const double x = near[j] * (v.view<float>().at(0, 0, j, e) - static_cast<double>(offset));
          var += x * x / 3;
        }
        const double sigma = std::sqrt(var) / levels, rounding = 16.0 * static_cast<double>(top) / (1 << 24);
        const double got = rounded.view<float>().at(0, h, 0, e), ref = want.out[static_cast<size_t>(h * D + e)];
        EXPECT_LE(std::abs(got - ref), worst_case + rounding) << "head " << h << ", column " << e;
        EXPECT_LE(std::abs(got - ref), 6 * sigma + rounding) << "head " << h << ", column " << e;
        differ += got != other.view<float>().at(0, h, 0, e);
        diff2 += (got - ref) * (got - ref);
        norm2 += ref * ref;
        worst = std::max(worst, std::abs(got - ref));
        worst_sigmas = std::max(worst_sigmas, std::abs(got - ref) / sigma);
      }
    }
    EXPECT_GT(differ, 0) << "the integer value pass gave the other pass's bits: did it run?";
    std::printf("%s %s value pass against exact attention: %lld of %lld outputs differ from the pass without "
                "integer values; the largest error %.3g (%.2f sigma), norm-wise %.3g\n",
                target.c_str(), cache_type_name(type), static_cast<long long>(differ), static_cast<long long>(G * D),
                worst, worst_sigmas, std::sqrt(diff2 / norm2));
  }
}

bool HasTarget(const char* t) {
  const std::vector<std::string> targets = kernels::simd_targets();
  return std::find(targets.begin(), targets.end(), t) != targets.end();
}

TEST(KvCacheQuantAccuracy, Int4ByteValuesWithinTheirBound) {
  std::vector<std::string> targets;
  if (HasTarget("AVX2") && kernels::decode_byte_values()) targets.push_back("AVX2");
  if (HasTarget("AVX3") && kernels::decode_vnni_byte_values()) targets.push_back("AVX3");
  if (targets.empty()) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512 VNNI and VBMI: no byte value pass runs";
  CheckValuePassBound(CacheType::kInt4, targets, base_seed() + 807);
}

TEST(KvCacheQuantAccuracy, Int8WordValuesWithinTheirBound) {
  std::vector<std::string> targets;
  if (HasTarget("AVX2") && kernels::decode_byte_values()) targets.push_back("AVX2");
  if (HasTarget("AVX3") && kernels::decode_vnni_word_values()) targets.push_back("AVX3");
  if (targets.empty()) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512 VNNI: no word value pass runs";
  CheckValuePassBound(CacheType::kInt8, targets, base_seed() + 808);
}

// The error of decoding from a quantized cache against a float32 cache of the same keys and
// values: GQA 4:1, D = 128, 1024 positions, 1024 query rows per case (4 draws of K and V, 32
// steps of 8 rows each); per-row relative error ‖o − o32‖ / ‖o32‖, its 99th percentile. (Of the
// 128 rows this test first had, that is the third largest: 1.003e-2 for int8 at one seed, where
// 8192 rows give 8.6e-3 and 9.1e-3.) Keys random, or with 4 outlier channels 20× larger (as real
// keys have). Bounds: int8 ≤ 1e-2 on both (issue 13's target; measured 8.3–8.9e-3 /
// 8.7–9.4e-3 over twelve seeds); int4 ≤ 0.2 (0.14–0.16). With the outlier channels left in
// their groups, outlier-heavy keys measured 1.2e-2 (int8) and 0.22 (int4) on 128 rows; without
// the key channel scales too, 6.4e-2 and 1.27. docs/numerics.md, "KV cache storage".
double p99_error(CacheType type, bool outliers, uint64_t seed) {
  KvCacheConfig c;
  c.batch = 1;
  c.kv_heads = 2;
  c.head_dim_qk = c.head_dim_v = 128;
  const int64_t L = 1024, G = 4;
  Rng rng(seed);
  std::vector<double> errors;
  for (int draw = 0; draw < 4; ++draw) {
    Tensor k = random_tensor(rng, {1, 2, L, 128});
    const Tensor v = random_tensor(rng, {1, 2, L, 128});
    if (outliers)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t t = 0; t < L; ++t)
          for (int64_t e : {7, 30, 64, 101}) k.view<float>().at(0, h, t, e) *= 20;
    KvCacheConfig qc = c;
    qc.dtype = type;
    KvCache f32(c), quant(qc);
    f32.append(k.view<float>(), v.view<float>());
    quant.append(k.view<float>(), v.view<float>());
    for (int step = 0; step < 32; ++step) {
      const Tensor q = random_tensor(rng, {1, 2 * G, 1, 128});
      Tensor a(DType::kF32, {1, 2 * G, 1, 128}), b(DType::kF32, {1, 2 * G, 1, 128});
      attend(q.view<float>(), f32, a.view<float>());
      attend(q.view<float>(), quant, b.view<float>());
      for (int64_t r = 0; r < 2 * G; ++r) {
        double num = 0, den = 0;
        for (int64_t e = 0; e < 128; ++e) {
          const double x = a.view<float>().at(0, r, 0, e), y = b.view<float>().at(0, r, 0, e);
          num += (y - x) * (y - x);
          den += x * x;
        }
        errors.push_back(std::sqrt(num / den));
      }
    }
  }
  std::sort(errors.begin(), errors.end());
  return errors[static_cast<size_t>(0.99 * static_cast<double>(errors.size() - 1))];
}

TEST(KvCacheQuantAccuracy, AgainstAFloat32Cache) {
  for (CacheType type : {CacheType::kInt8, CacheType::kInt4}) {
    for (bool outliers : {false, true}) {
      const double e = p99_error(type, outliers, base_seed() + 803);
      std::printf("%s cache, %s keys: p99 relative error %.2e\n", cache_type_name(type),
                  outliers ? "outlier-heavy" : "random", e);
      const double bound = type == CacheType::kInt8 ? 1e-2 : 0.2;
      EXPECT_LE(e, bound);
    }
  }
}

}  // namespace
}  // namespace mha::test
