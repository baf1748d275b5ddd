// KV caches storing bfloat16 or float16: append rounds to the cache's type, attention reads it
// widened, and decoding from a 16-bit cache stays within its rounding of decoding from a
// float32 cache — unwindowed, windowed (single steps and chunks past the ring), GQA.
#include <gtest/gtest.h>

#include <cstring>

#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

double unit_roundoff(DType t) { return t == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048; }

class KvCacheHalf : public ::testing::TestWithParam<DType> {};

CacheType cache_type(DType t) { return t == DType::kBF16 ? CacheType::kBF16 : CacheType::kF16; }

std::string dtype_param(const ::testing::TestParamInfo<DType>& info) { return dtype_name(info.param); }

TEST_P(KvCacheHalf, AppendRoundsAndViewsAreTyped) {
  KvCacheConfig c;
  c.batch = 2;
  c.kv_heads = 2;
  c.head_dim_qk = 5;
  c.head_dim_v = 3;
  c.capacity = 1;  // grows twice below
  c.dtype = cache_type(GetParam());
  KvCache cache(c);
  Rng rng(base_seed() + 400);
  const Tensor k = random_tensor(rng, {2, 2, 3, 5}), v = random_tensor(rng, {2, 2, 3, 3});
  cache.append(k.view<float>(), v.view<float>());
  const Tensor kr = k.converted(GetParam()), vr = v.converted(GetParam());
  auto check = [&](auto tag) {
    using T = decltype(tag);
    const View<const T> ck = cache.keys<T>(), cv = cache.values<T>();
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t t = 0; t < 3; ++t) {
          for (int64_t e = 0; e < 5; ++e) EXPECT_EQ(ck.at(b, h, t, e).bits, kr.view<T>().at(b, h, t, e).bits);
          for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(cv.at(b, h, t, e).bits, vr.view<T>().at(b, h, t, e).bits);
        }
  };
  if (GetParam() == DType::kBF16) {
    check(bfloat16{});
  } else {
    check(float16{});
  }
  EXPECT_EQ(cache.nbytes(), 2 * 2 * cache.capacity() * (5 + 3) * 2);
  expect_error([&] { cache.keys(); }, {"keys", cache_type_name(c.dtype), "F32"});
  expect_error([&] { cache.values<float>(); }, {"values", cache_type_name(c.dtype)});
  expect_error([&] { cache.key_codes(); }, {"key_codes", cache_type_name(c.dtype), "int8 or int4"});
  c.dtype = static_cast<CacheType>(9);
  expect_error([&] { KvCache bad(c); }, {"dtype", "value 9"});
}

// Decoding through step() from a 16-bit cache against the same steps from a float32 cache:
// the cache rounds q, k, v and the attention output once each (each ≤ u16 relative). Rounding
// v and the output moves the attention output by ≤ 2·u16·max|v|; rounding q and k moves each
// score by ≤ 2·u16·scale·Σ|q_i·k_i| (≤ 2 here: unit-variance projections), hence every
// probability by a relative ≤ 2·that, the output by ≤ 4·u16·2·max|v|: 8·u16 of the scale in
// all (docs/numerics.md). Observed ≤ 1.3·u16 over 6 seeds.
void expect_close_to_f32_cache(const MultiHeadAttentionConfig& cfg, DType cache_dtype, std::vector<int64_t> chunks) {
  MultiHeadAttention m(cfg, 17);
  Rng rng(base_seed() + 401);
  int64_t T = 0;
  for (int64_t n : chunks) T += n;
  const Tensor x = random_tensor(rng, {2, T, cfg.embed_dim});
  KvCache c32 = m.make_cache(2, 2), c16 = m.make_cache(2, 2, cache_type(cache_dtype));
  int64_t t = 0;
  double worst = 0;
  for (int64_t n : chunks) {
    Tensor chunk(DType::kF32, {2, n, cfg.embed_dim});
    for (int64_t b = 0; b < 2; ++b)
      std::memcpy(chunk.data<float>() + b * n * cfg.embed_dim, x.data<float>() + (b * T + t) * cfg.embed_dim,
                  static_cast<size_t>(n * cfg.embed_dim) * sizeof(float));
    const Tensor a = m.step(chunk.view<float>(), c32).output, b = m.step(chunk.view<float>(), c16).output;
    worst = std::max(worst, rel_error(b.view<float>(), a.view<float>()));
    t += n;
  }
  EXPECT_LE(worst, 8 * unit_roundoff(cache_dtype)) << dtype_name(cache_dtype);
  EXPECT_GT(worst, 0.0);  // the 16-bit cache did round something
}

TEST_P(KvCacheHalf, StepsMatchTheFloat32Cache) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 48;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.causal = Causal::kTopLeft;
  expect_close_to_f32_cache(c, GetParam(), {7, 1, 1, 5, 1});
  c.window = 4;  // single steps in the ring, and chunks longer than the ring
  expect_close_to_f32_cache(c, GetParam(), {3, 1, 1, 6, 1, 2});
}

TEST_P(KvCacheHalf, SixteenBitModuleWithSixteenBitCache) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 32;
  c.num_heads = 4;
  c.causal = Causal::kTopLeft;
  c.dtype = GetParam();
  MultiHeadAttention m(c, 5);
  Rng rng(base_seed() + 402);
  const Tensor x = random_tensor(rng, {1, 9, 32}).converted(GetParam());
  KvCache cache = m.make_cache(1, 0, cache_type(GetParam()));
  const Tensor full = GetParam() == DType::kBF16 ? m.step(x.view<bfloat16>(), cache).output
                                                 : m.step(x.view<float16>(), cache).output;
  EXPECT_EQ(full.dtype(), GetParam());
  EXPECT_EQ(cache.length(0), 9);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvCacheHalf, ::testing::Values(DType::kBF16, DType::kF16), dtype_param);

}  // namespace
}  // namespace mha::test
