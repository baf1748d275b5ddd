// int8 and int4 KV caches: the stored format is the one kv_cache.h documents (key tiles too); the
// decode kernel reading the codes agrees with the float32 kernel over their dequantized values
// within derived bounds (float and integer dot products); non-finite queries; step() over them.
// Exact int4 passes and the error against a float32 cache: kv_cache_quant_accuracy_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/flash.h"
#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

int bits_of(CacheType t) { return t == CacheType::kInt8 ? 8 : 4; }

// Element `index` of the 16 rows of (b, h)'s tile of `slot` (key tiles: kv_cache.h).
template <typename T>
T tile_element(const View<const T>& x, int64_t b, int64_t h, int64_t slot, int64_t index) {
  const int64_t width = x.shape[3], first = slot / 16 * 16;
  return x.at(b, h, first + index / width, index % width);
}

// Scale word e of slot `slot` of (b, h) of a quantized plane: keys' and values' scale words are
// transposed by tiles (word e of the tile's slot l at index 16e + l).
uint32_t word_at(const View<const uint32_t>& scales, int64_t b, int64_t h, int64_t slot, int64_t e) {
  return tile_element(scales, b, h, slot, 16 * e + slot % 16);
}
float float_of_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
// Scale words per group: int8 two (float32 scale, minimum), int4 one (bfloat16 scale in the low
// half, minimum in the high half). A key row's outlier slot i is word words_per_group · groups + i.
int64_t words_per_group(int bits) { return bits == 8 ? 2 : 1; }
float group_scale(const View<const uint32_t>& scales, int64_t b, int64_t h, int64_t slot, int64_t g, int bits) {
  if (bits == 8) return float_of_bits(word_at(scales, b, h, slot, 2 * g));
  return float_of_bits((word_at(scales, b, h, slot, g) & 0xFFFF) << 16);
}
float group_minimum(const View<const uint32_t>& scales, int64_t b, int64_t h, int64_t slot, int64_t g, int bits) {
  if (bits == 8) return float_of_bits(word_at(scales, b, h, slot, 2 * g + 1));
  return float_of_bits(word_at(scales, b, h, slot, g) >> 16 << 16);
}

// Value c of a slot of (b, h) of a quantized plane, decoded from the documented format
// independently of the library.
double decode(const View<const uint8_t>& codes, const View<const uint32_t>& scales, int64_t b, int64_t h, int64_t slot,
              int64_t c, int bits, bool keys) {
  const int64_t g = c / 32, i = c % 32;
  int code;
  if (keys) {  // words of 64 bytes, 4 per slot of the tile: 4 (int8) or 8 (int4) channels each
    const int64_t per_word = 32 / bits, k = c % per_word;
    const uint8_t byte = tile_element(codes, b, h, slot, c / per_word * 64 + slot % 16 * 4 + k % 4);
    code = bits == 8 ? byte : k < 4 ? byte & 0xF : byte >> 4;
  } else {
    const uint8_t byte = bits == 8 ? codes.at(b, h, slot, c) : codes.at(b, h, slot, g * 16 + i % 16);
    code = bits == 8 ? byte : i < 16 ? byte & 0xF : byte >> 4;
  }
  return group_minimum(scales, b, h, slot, g, bits) +
         static_cast<double>(group_scale(scales, b, h, slot, g, bits)) * code;
}

class KvCacheQuant : public ::testing::TestWithParam<CacheType> {};

std::string type_param(const ::testing::TestParamInfo<CacheType>& info) { return cache_type_name(info.param); }

TEST_P(KvCacheQuant, StoresTheDocumentedFormat) {
  const int bits = bits_of(GetParam());
  KvCacheConfig c;
  c.batch = 2;
  c.kv_heads = 2;
  c.head_dim_qk = 40;  // a whole group and a partial one
  c.head_dim_v = 70;
  c.capacity = 1;  // whole key tiles: 16 slots, grown to 32 below (copying the first tile)
  c.dtype = GetParam();
  KvCache cache(c);
  EXPECT_EQ(cache.capacity(), 16);
  Rng rng(base_seed() + 800);
  Tensor k = random_tensor(rng, {2, 2, 20, 40}), v = random_tensor(rng, {2, 2, 20, 70});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 20; ++t) k.view<float>().at(b, 1, t, 3) *= 20;  // an outlier channel in head 1
  cache.append(k.view<float>(), v.view<float>(), {3, 5});
  cache.append(k.view<float>(), v.view<float>(), {14, 15});
  ASSERT_EQ(cache.length(0), 17);
  ASSERT_EQ(cache.length(1), 20);
  EXPECT_EQ(cache.capacity(), 32);
  const View<const uint8_t> kc = cache.key_codes(), vc = cache.value_codes();
  const View<const uint32_t> ks = cache.key_scales(), vs = cache.value_scales();
  const View<const float> ch = cache.key_channel_scales();
  const View<const int64_t> outliers = cache.key_outlier_channels();
  EXPECT_EQ(kc.shape[3], 64 * bits / 8);
  EXPECT_EQ(vc.shape[3], 96 * bits / 8);
  const int64_t w = words_per_group(bits);
  EXPECT_EQ(ks.shape[3], 2 * w + kCacheKeyOutliers);  // 2 groups' words, then the outlier values
  EXPECT_EQ(vs.shape[3], 3 * w);
  EXPECT_EQ(outliers.shape[2], kCacheKeyOutliers);
  EXPECT_EQ(cache.nbytes(), 2 * 2 * cache.capacity() * ((64 + 96) * bits / 8 + (5 * w + kCacheKeyOutliers) * 4));
  const Tensor kf = cache.keys_as_float(), vf = cache.values_as_float();
  const int levels = (1 << bits) - 1;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h) {
      // The outlier channels: ascending, then -1s; channel 3 of head 1 among them.
      auto outlier_index = [&](int64_t e) {
        for (int64_t i = 0; i < kCacheKeyOutliers; ++i)
          if (outliers.at(b, h, i) == e) return i;
        return int64_t{-1};
      };
      for (int64_t i = 1; i < kCacheKeyOutliers; ++i)
        EXPECT_TRUE(outliers.at(b, h, i) == -1 || outliers.at(b, h, i) > outliers.at(b, h, i - 1));
      if (h == 1) EXPECT_GE(outlier_index(3), 0);
      for (int64_t e = 0; e < 40; ++e) {  // powers of two, 1 for an outlier
        int exponent = 0;
        EXPECT_EQ(std::frexp(ch.at(b, h, e), &exponent), 0.5f);
        if (outlier_index(e) >= 0) EXPECT_EQ(ch.at(b, h, e), 1.0f);
      }
      for (int64_t slot = 0; slot < cache.length(b); ++slot) {
        // Sequence 0 appended positions 0-2 from rows 0-2, then 3-16 from rows 0-13; sequence 1
        // positions 0-4, then 5-19 from rows 0-14.
        const int64_t first = b == 0 ? 3 : 5;
        const int64_t t = slot >= first ? slot - first : slot;
        auto check_row = [&](const View<const uint8_t>& codes, const View<const uint32_t>& scales, const Tensor& x,
                             const Tensor& read, int64_t width, bool keys) {
          for (int64_t e = 0; e < width; ++e) {
            const double chs = keys ? ch.at(b, h, e) : 1.0;
            const double want = x.view<float>().at(b, h, t, e);
            const int64_t oi = keys ? outlier_index(e) : -1;
            auto minimum = [&](int64_t c) { return group_minimum(scales, b, h, slot, c / 32, bits); };
            if (oi >= 0) {  // kept exactly after the groups' words; its code is 0
              EXPECT_EQ(float_of_bits(word_at(scales, b, h, slot, 2 * w + oi)), static_cast<float>(want));
              EXPECT_EQ(read.view<float>().at(b, h, slot, e), static_cast<float>(want));
              EXPECT_EQ(decode(codes, scales, b, h, slot, e, bits, keys), minimum(e));
              continue;
            }
            const double got = decode(codes, scales, b, h, slot, e, bits, keys) * chs;
            EXPECT_EQ(static_cast<float>(got), read.view<float>().at(b, h, slot, e)) << b << h << slot << e;
            // Rounded to the nearest code: half a step of the group (plus the float rounding).
            const double step = group_scale(scales, b, h, slot, e / 32, bits) * chs;
            EXPECT_LE(std::fabs(got - want), step / 2 + 1e-6 * (std::fabs(want) + step * levels)) << e;
          }
          for (int64_t e = width; e < (width + 31) / 32 * 32; ++e)
            EXPECT_EQ(decode(codes, scales, b, h, slot, e, bits, keys),
                      group_minimum(scales, b, h, slot, e / 32, bits));
          // Each group's minimum is its least value (int4: rounded down to bfloat16) and its
          // scale covers max − minimum (int4: rounded up; the next bfloat16 either way would not).
          for (int64_t g = 0; g * 32 < width; ++g) {
            double lo = INFINITY, hi = -INFINITY;
            for (int64_t e = g * 32; e < std::min(width, g * 32 + 32); ++e) {
              if (keys && outlier_index(e) >= 0) continue;
              const double y = static_cast<double>(x.view<float>().at(b, h, t, e)) / (keys ? ch.at(b, h, e) : 1.0);
              lo = std::min(lo, y), hi = std::max(hi, y);
            }
            const double minimum = group_minimum(scales, b, h, slot, g, bits);
            const double step = group_scale(scales, b, h, slot, g, bits);
            if (bits == 8) {
              EXPECT_EQ(minimum, lo) << g;
              EXPECT_EQ(step, static_cast<float>(hi) / 255 - static_cast<float>(lo) / 255) << g;
              continue;
            }
            const double ulp = 0x1p-7 * std::ldexp(1.0, std::ilogb(lo == 0 ? 1.0 : lo));  // bfloat16's at lo
            EXPECT_LE(minimum, lo) << g;
            EXPECT_LT(lo - minimum, ulp) << g;
            EXPECT_GE(step * levels, hi - minimum) << g;
            EXPECT_LE(step * levels, (hi - minimum) * (1 + 0x1p-7)) << g;
          }
        };
        check_row(kc, ks, k, kf, 40, true);
        check_row(vc, vs, v, vf, 70, false);
      }
      // Slots past the stored positions read as zeros.
      for (int64_t slot = cache.length(b); slot < cache.capacity(); ++slot)
        EXPECT_EQ(kf.view<float>().at(b, h, slot, 0), 0.0f);
    }
  // The accessors of the other representation are errors.
  expect_error([&] { cache.keys(); }, {"keys", cache_type_name(GetParam()), "keys_as_float"});
  expect_error([&] { cache.values<bfloat16>(); }, {"values", cache_type_name(GetParam())});
  // as_stored: what append would store, without appending.
  const auto [ak, av] = cache.as_stored(k.view<float>(), v.view<float>());
  EXPECT_EQ(cache.length(0), 17);
  cache.append(k.view<float>(), v.view<float>());
  const Tensor kf2 = cache.keys_as_float();
  for (int64_t t = 0; t < 20; ++t)
    for (int64_t e = 0; e < 40; ++e) EXPECT_EQ(ak.view<float>().at(1, 1, t, e), kf2.view<float>().at(1, 1, 20 + t, e));
}

// After reset(), keys_as_float()/values_as_float() read zeros in every slot, whatever the
// storage type (the slots still hold the old positions' bytes).
TEST(KvCacheAsFloat, SlotsPastTheStoredPositionsAreZerosAfterReset) {
  Rng rng(base_seed() + 150);
  for (CacheType type : {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4}) {
    SCOPED_TRACE(cache_type_name(type));
    KvCacheConfig c;
    c.batch = 2;
    c.kv_heads = 2;
    c.head_dim_qk = c.head_dim_v = 8;
    c.dtype = type;
    KvCache cache(c);
    const Tensor k = random_tensor(rng, {2, 2, 6, 8}), v = random_tensor(rng, {2, 2, 6, 8});
    cache.append(k.view<float>(), v.view<float>());
    cache.reset();
    cache.append(View<const float>(k.data<float>(), {2, 2, 2, 8}, {96, 48, 8, 1}),
                 View<const float>(v.data<float>(), {2, 2, 2, 8}, {96, 48, 8, 1}));
    for (const Tensor& t : {cache.keys_as_float(), cache.values_as_float()}) {
      const View<const float> x = t.view<float>();
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t slot = 2; slot < cache.capacity(); ++slot)
            for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(x.at(b, h, slot, e), 0.0f) << b << h << slot << e;
    }
  }
}

// One sequence, one kv head of 64 channels (two groups).
KvCacheConfig one_head_of_64(CacheType type) {
  KvCacheConfig c;
  c.kv_heads = 1;
  c.head_dim_qk = c.head_dim_v = 64;
  c.dtype = type;
  return c;
}

TEST_P(KvCacheQuant, NonFiniteValuesMakeTheirGroupNaN) {
  KvCache cache(one_head_of_64(GetParam()));
  Rng rng(base_seed() + 801);
  Tensor k = random_tensor(rng, {1, 1, 3, 64}), v = random_tensor(rng, {1, 1, 3, 64});
  for (int64_t t = 0; t < 3; ++t) k.view<float>().at(0, 0, t, 50) *= 40;  // an outlier channel
  cache.append(k.view<float>(), v.view<float>());  // fixes the channel scales from finite rows
  ASSERT_EQ(cache.key_outlier_channels().at(0, 0, 0), 50);
  k.view<float>().at(0, 0, 1, 5) = std::numeric_limits<float>::infinity();
  k.view<float>().at(0, 0, 1, 50) = -std::numeric_limits<float>::infinity();  // the outlier alone is NaN
  v.view<float>().at(0, 0, 2, 40) = std::nanf("");
  cache.append(k.view<float>(), v.view<float>());
  const Tensor kf = cache.keys_as_float(), vf = cache.values_as_float();
  for (int64_t e = 0; e < 64; ++e) {
    EXPECT_EQ(std::isnan(kf.view<float>().at(0, 0, 4, e)), e < 32 || e == 50) << e;
    EXPECT_EQ(std::isnan(vf.view<float>().at(0, 0, 5, e)), e >= 32) << e;
    EXPECT_TRUE(std::isfinite(kf.view<float>().at(0, 0, 3, e)));
  }
}

// A query row with a NaN or an infinity gives NaN in its own output row only, whether or not the
// kernel rounds queries to integers for integer dot products (a non-finite row turns them off for
// its kv head: the other rows then take the float path for their keys) or rounds the weights of
// its value passes (the row's P is NaN, which gives the block's values to the float pass, every
// row's). The other rows then move from the clean call by what those roundings move the output,
// QuantDecode's bounds below (docs/numerics.md): 2^-12 for int8 keys' 16-bit query, 2^-9 where
// an int8 cache's values also take 16-bit weights (AVX2, AVX3 with VNNI; on AVX2 at seed 88 a row
// moved by 2.5e-4, past 2^-12), 2^-4 for int4 keys' 8-bit query, whose rounding step is 256× as
// large.
TEST_P(KvCacheQuant, NonFiniteQueriesReachOnlyTheirRows) {
  KvCache cache(one_head_of_64(GetParam()));
  Rng rng(base_seed() + 803);
  const Tensor k = random_tensor(rng, {1, 1, 40, 64}), v = random_tensor(rng, {1, 1, 40, 64});
  cache.append(k.view<float>(), v.view<float>());
  Tensor q = random_tensor(rng, {1, 4, 1, 64});
  Tensor clean(DType::kF32, {1, 4, 1, 64}), got(DType::kF32, {1, 4, 1, 64});
  attend(q.view<float>(), cache, clean.view<float>());
  q.view<float>().at(0, 1, 0, 7) = std::nanf("");
  q.view<float>().at(0, 2, 0, 60) = std::numeric_limits<float>::infinity();
  attend(q.view<float>(), cache, got.view<float>());
  for (int64_t h = 0; h < 4; ++h) {
    double diff = 0, norm = 0;  // norm-wise, as the bound is (the row's scale)
    for (int64_t e = 0; e < 64; ++e) {
      const double x = got.view<float>().at(0, h, 0, e), want = clean.view<float>().at(0, h, 0, e);
      if (h == 1 || h == 2) EXPECT_TRUE(std::isnan(x)) << h << " " << e;
      diff += (x - want) * (x - want);
      norm += want * want;
    }
    const double bound = std::max(decode_rounding(GetParam()).either(), 1.0 / (1 << 12));
    if (h == 0 || h == 3) EXPECT_LE(std::sqrt(diff), std::sqrt(norm) * bound) << h;
  }
}

// A value group that is not finite (stored as NaN) reaches the output only in the rows that see
// its key, and only in its group's columns. The decode kernel weights a key a row does not see by
// P = 0, and 0 × NaN is NaN: the rows of such a block are redone over the keys they see. That
// holds whether values are dequantized in registers or their scales folded into the weights
// (AVX2; docs/numerics.md): checked on every target compiled in and supported here, with and
// without the dot products.
TEST_P(KvCacheQuant, NonFiniteValuesReachOnlyTheRowsThatSeeThem) {
  KvCache cache(one_head_of_64(GetParam()));
  Rng rng(base_seed() + 805);
  const Tensor k = random_tensor(rng, {1, 1, 40, 64});
  Tensor v = random_tensor(rng, {1, 1, 40, 64});
  cache.append(k.view<float>(), v.view<float>(), {37});  // fixes the channel scales from finite rows
  v.view<float>().at(0, 0, 2, 40) = std::nanf("");  // position 39's value, group 1 (columns 32 .. 63)
  const View<const float> k3(k.data<float>(), {1, 1, 3, 64}), v3(v.data<float>(), {1, 1, 3, 64});
  cache.append(k3, v3);
  ASSERT_EQ(cache.length(0), 40);
  // Query rows at positions 37, 38, 39: only the last sees position 39.
  const Tensor q = random_tensor(rng, {1, 1, 3, 64});
  Tensor out(DType::kF32, {1, 1, 3, 64});
  const RestoreKernelSwitches restore;
  for (const std::string& t : kernels::simd_targets())
    for (const bool dots : {false, true}) {
      kernels::force_simd_target(t);
      kernels::allow_decode_dot_products(dots);
      attend(q.view<float>(), cache, out.view<float>());
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t e = 0; e < 64; ++e)
          EXPECT_EQ(std::isnan(out.view<float>().at(0, 0, i, e)), i == 2 && e >= 32)
              << t << (dots ? " dots" : "") << " row " << i << " column " << e;
    }
}

INSTANTIATE_TEST_SUITE_P(Types, KvCacheQuant, ::testing::Values(CacheType::kInt8, CacheType::kInt4), type_param);

// The decode kernel on the codes against the float32 kernel on the values they stand for (a
// float32 cache fed as_stored() of the same appends). The error is measured on the scale of the
// output's terms, max|Δo| / max_e Σ_j P_j·|v_je| (a third cache holds |v| for it): the roundings
// below are proportional to those terms, and an average over many keys can make the output
// itself far smaller (seed 119: appends of 1,500 keys, D = 8, an output 1/30 of its terms; on
// the output's own scale 8.1e-2, past the 2^-4 then allowed).
// The kernel sums each key group's code products before scaling them (Σ_g scale_g·Σ_c q_c·code_c
// + minimum_g·Σ_c q_c): the same terms as the float32 kernel's, rounded in another order, which
// moves scores by about √32·u of Σ_c |q_c|·(|k_c| + 2|minimum|) (docs/numerics.md). The float32
// kernel it is compared with rounds too: on the SCALAR target its scores are one chain of D
// products (≤ γ_D, about √D·u of the same sum). The test allows 128u (measured ≤ 62u over seeds
// 1–40, with D = 128, an outlier channel and sink tokens).
// With integer dot products (AVX-512 VNNI; AVX2's vpmaddubsw / vpmaddwd: the same integer sums)
// the query is rounded first, to 16 bits for int8 keys and to 8 bits for int4 keys: the bound
// then adds that rounding's effect, derived per trial from the query and the stored keys (below).
// A constant would not do: with an outlier channel the keys are larger, and so is the effect
// (seed 40: 9.2e-2 for int4 keys at D = 128, against 2^-4 then allowed).
// With bfloat16 dot products (AVX-512 BF16) an int4 cache's values and the weights P are rounded
// to bfloat16 in the value pass (u = 2^-8 each): a product moves by at most 2^-7 of itself, and
// the output, the roundings being independent, by ~2^-9 of its terms: 2^-6 is added for it. The
// integer value passes round the weights P·scale on a step of the block's largest weight: to
// bytes for int4 (AVX2; AVX3 with VNNI and VBMI; ~2^-8), 2^-6 added as for bfloat16; to 16-bit
// words for int8 (AVX2; AVX3 with VNNI), 2^-9 added (measured, with the 16-bit query, ≤ 1.3e-3
// over seeds 1–40).
// Every third trial has a key channel 20× larger (an outlier); short first appends pick some too.
struct KernelCase {
  std::string target;
  CacheType type;
  // Dot products where the CPU has them: integer for keys; for int4 values bfloat16 on AVX3, bytes on AVX2.
  bool dots;
  bool vnni = true;  // AVX3: false takes the AVX2 integer path, as a CPU without AVX-512 VNNI does
};

class QuantDecode : public ::testing::TestWithParam<KernelCase> {
 protected:
  void SetUp() override {
    kernels::force_simd_target(GetParam().target);
    kernels::allow_decode_dot_products(GetParam().dots);
    kernels::allow_decode_avx512_vnni(GetParam().vnni);
  }
  void TearDown() override { restore_kernel_switches(); }
};

TEST_P(QuantDecode, EqualsTheFloatKernelOnTheStoredValues) {
  const CacheType type = GetParam().type;
  // SetUp's switches (dot products, VNNI) are those the kernel reads.
  const DecodeRounding rounding = decode_rounding(type, GetParam().target);
  const double query_levels = type == CacheType::kInt4 ? 127 : 32512;  // 8 or 16 bits (docs/numerics.md)
  Rng rng(base_seed() + 802);
  int with_outliers = 0, without = 0, with_sinks = 0;
  double worst_with_outliers = 0, worst = 0, worst_share = 0;
  for (int trial = 0; trial < 24; ++trial) {
    KvCacheConfig c;
    c.batch = rng.range(1, 3);
    c.kv_heads = rng.range(1, 3);
    const int64_t G = std::vector<int64_t>{1, 2, 4, 8}[rng.range(0, 3)];
    c.head_dim_qk = std::vector<int64_t>{8, 40, 64, 72, 128}[rng.range(0, 4)];
    c.head_dim_v = rng.coin(0.7) ? c.head_dim_qk : rng.range(1, 100);
    c.window = trial % 4 == 3 ? rng.range(1, 40) : 0;
    c.sink_tokens = trial % 8 == 7 ? rng.range(1, 300) : 0;  // with the window: StreamingLLM's, before the ring
    with_sinks += c.sink_tokens > 0;
    c.capacity = rng.range(0, 8);
    c.dtype = type;
    KvCacheConfig fc = c;
    fc.dtype = CacheType::kF32;
    KvCache q8(c), f32(fc), terms(fc);  // terms: the same keys, |values|
    std::vector<std::pair<Tensor, std::vector<int64_t>>> stored_keys;  // as_stored() keys and counts
    const int64_t n = c.window > 0 ? 1 : rng.range(1, std::max<int64_t>(1, 16 / G));
    const int64_t appends = rng.range(1, 4);
    for (int64_t a = 0; a < appends; ++a) {
      const int64_t len = trial % 6 == 0 ? 1500 : rng.range(n, 300);
      Tensor k = random_tensor(rng, {c.batch, c.kv_heads, len, c.head_dim_qk});
      const Tensor v = random_tensor(rng, {c.batch, c.kv_heads, len, c.head_dim_v});
      if (trial % 3 == 1)
        for (int64_t b = 0; b < c.batch; ++b)
          for (int64_t t = 0; t < len; ++t) k.view<float>().at(b, 0, t, c.head_dim_qk / 3) *= 20;
      std::vector<int64_t> counts(static_cast<size_t>(c.batch));
      for (auto& x : counts) x = rng.range(a == 0 ? n : 0, len);
      auto [ks, vs] = q8.as_stored(k.view<float>(), v.view<float>(), counts);
      q8.append(k.view<float>(), v.view<float>(), counts);
      f32.append(ks.view<float>(), vs.view<float>(), counts);
      for (int64_t i = 0; i < vs.numel(); ++i) vs.data<float>()[i] = std::fabs(vs.data<float>()[i]);
      terms.append(ks.view<float>(), vs.view<float>(), counts);  // the caches copy what they append
      stored_keys.emplace_back(std::move(ks), counts);
    }
    const int64_t Hq = c.kv_heads * G;
    const Tensor q = random_tensor(rng, {c.batch, Hq, n, c.head_dim_qk});
    Tensor got(DType::kF32, {c.batch, Hq, n, c.head_dim_v}), want(DType::kF32, {c.batch, Hq, n, c.head_dim_v});
    Tensor again(DType::kF32, {c.batch, Hq, n, c.head_dim_v});
    AttentionOptions one, two;
    one.num_threads = 1;
    two.num_threads = 2;
    attend(q.view<float>(), q8, got.view<float>(), two);
    attend(q.view<float>(), f32, want.view<float>(), two);
    attend(q.view<float>(), q8, again.view<float>(), one);
    Tensor scale(DType::kF32, {c.batch, Hq, n, c.head_dim_v});  // Σ_j P_j·|v_j|
    attend(q.view<float>(), terms, scale.view<float>(), two);
    SCOPED_TRACE("trial " + std::to_string(trial) + " B " + std::to_string(c.batch) + " Hkv " +
                 std::to_string(c.kv_heads) + " G " + std::to_string(G) + " D " + std::to_string(c.head_dim_qk) +
                 "/" + std::to_string(c.head_dim_v) + " window " + std::to_string(c.window) + " sinks " +
                 std::to_string(c.sink_tokens) + " n " +
                 std::to_string(n));
    EXPECT_TRUE(bitwise_equal(got, again));  // any thread count
    const View<const int64_t> outliers = q8.key_outlier_channels();  // (B, Hkv, kCacheKeyOutliers)
    const bool any_outlier =
        std::any_of(outliers.data, outliers.data + outliers.numel(), [](int64_t x) { return x >= 0; });
    ++(any_outlier ? with_outliers : without);
    // The integer products take the query as scale·q_c·cs_c and the keys' codes as k_c/cs_c (cs:
    // the key channel scales), without the outlier channels, which stay float32. Rounding that
    // query (step = its row's max/levels) moves a key's score by δ_j, a sum of D independent
    // roundings: σ_j = (step/√12)·‖k_j/cs‖₂ over those channels. Each normalised weight then
    // moves by a factor within e^{±δ}, δ = max_j |δ_j|, and the output by at most
    // (e^{2δ} − 1)·Σ_j P_j·|v_j|; δ is allowed 4σ of the largest (the largest of a few thousand
    // draws). Over seeds 1–40 (AMD EPYC Zen 4, 2026-12-07): ≤ 1.25σ where the query's is the only
    // rounding, ≤ 2.5σ with int4's byte values; every case within 0.56 of its bound.
    double sigma = 0;
    const View<const float> channel_scales = q8.key_channel_scales();  // (B, Hkv, Dk)
    for (int64_t b = 0; rounding.query > 0 && b < c.batch; ++b)
      for (int64_t hk = 0; hk < c.kv_heads; ++hk) {
        std::vector<bool> rounded(static_cast<size_t>(c.head_dim_qk), true);
        for (int64_t x = 0; x < outliers.shape[2]; ++x)
          if (outliers.at(b, hk, x) >= 0) rounded[static_cast<size_t>(outliers.at(b, hk, x))] = false;
        double key_l2 = 0, query_max = 0;
        for (const auto& [ks, counts] : stored_keys)
          for (int64_t t = 0; t < counts[static_cast<size_t>(b)]; ++t) {
            double l2 = 0;
            for (int64_t e = 0; e < c.head_dim_qk; ++e) {
              const double x = ks.view<float>().at(b, hk, t, e) / channel_scales.at(b, hk, e);
              if (rounded[static_cast<size_t>(e)]) l2 += x * x;
            }
            key_l2 = std::max(key_l2, std::sqrt(l2));
          }
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h)
          for (int64_t i = 0; i < n; ++i)
            for (int64_t e = 0; e < c.head_dim_qk; ++e)
              if (rounded[static_cast<size_t>(e)]) {
                const double x = double{q.view<float>().at(b, h, i, e)} * channel_scales.at(b, hk, e);
                query_max = std::max(query_max, std::fabs(x));
              }
        const double step = query_max / std::sqrt(static_cast<double>(c.head_dim_qk)) / query_levels;
        sigma = std::max(sigma, step / std::sqrt(12.0) * key_l2);
      }
    const double bound = std::expm1(2 * 4 * sigma) + std::max(rounding.values, 128.0 / (1 << 24));
    const double e = abs_error(got, want) / std::max(finite_max_abs(scale), 1e-30);
    if (any_outlier) worst_with_outliers = std::max(worst_with_outliers, e);
    worst = std::max(worst, e);
    EXPECT_LE(e, bound) << "query rounding's σ " << sigma;
    worst_share = std::max(worst_share, e / bound);
  }
  std::printf("%d trials with outlier channels (the largest error %.1fu), %d without; the largest of all %.1fu "
              "(%.2f of its bound); %d with sink tokens\n",
              with_outliers, worst_with_outliers * (1 << 24), without, worst * (1 << 24), worst_share, with_sinks);
  EXPECT_GE(with_outliers, 8);
  EXPECT_GE(without, 4);
  EXPECT_GE(with_sinks, 2);
}

std::vector<KernelCase> kernel_cases() {
  std::vector<KernelCase> cases;
  for (const std::string& t : kernels::simd_targets())
    for (CacheType type : {CacheType::kInt8, CacheType::kInt4}) {
      const bool dots = (t == "AVX3" && (kernels::decode_int8_dots() || kernels::decode_bf16_dots())) ||
                        (t == "AVX2" && kernels::decode_int8_dots());
      cases.push_back({t, type, dots});
      if (dots) cases.push_back({t, type, false});  // the target's float path too
      if (t == "AVX3" && kernels::decode_avx512_vnni()) cases.push_back({t, type, true, false});
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Targets, QuantDecode, ::testing::ValuesIn(kernel_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) {
                           return info.param.target + (info.param.dots ? "_dots_" : "_") +
                                  (info.param.vnni ? "" : "avx2_") + cache_type_name(info.param.type);
                         });

// step() over quantized caches: chunked prefill (more than 16 rows per kv head: the dequantized
// path) and token by token (the decode kernel) read the same stored values once the first
// append has fixed the channel scales, so they agree to float32 rounding; windowed chunks too.
// With the decode kernel's dot products (where the CPU has them) to QuantDecode's bounds above:
// int8 keys meet a query rounded to 16 bits (2^-12), and where int8 values take 16-bit weights
// (AVX2; AVX3 with VNNI) those are rounded too (2^-9; measured ≤ 6.9e-5 over seeds 1–60 on AVX2);
// int4 keys meet one rounded to 8 bits (2^-4) and int4 values are rounded to bfloat16 (2^-6; on
// AVX2 the weights to bytes, within the 2^-4 of its keys). The same stored values need the same keys and
// values from the projections, but a projection of 20 rows and one of a single row may round
// differently, and a last-bit difference can move a value that sits on a code's rounding
// boundary by a whole code (a later seed: int8, 3.4e-4 in the output). So the inputs and the
// q/k/v weights are multiples of 2^-4 and 2^-6: every projection is exact in any order, and the
// test checks that the two caches hold the same bits.
TEST(KvCacheQuantStep, ChunksAndTokensAgree) {
  const RestoreKernelSwitches restore;
  for (const bool dots : {false, true})
  for (CacheType type : {CacheType::kInt8, CacheType::kInt4}) {
    kernels::allow_decode_dot_products(dots);
    const double bound = std::max(decode_rounding(type).either(), 1e-5);
    for (int64_t window : {0, 7}) {
      MultiHeadAttentionConfig cfg;
      cfg.embed_dim = 64;
      cfg.num_heads = 4;
      cfg.num_kv_heads = 2;
      cfg.causal = Causal::kTopLeft;
      cfg.window = window;
      MultiHeadAttention m(cfg, 9);
      auto round_to = [](float* data, int64_t n, float grid) {
        for (int64_t i = 0; i < n; ++i) data[i] = std::nearbyint(data[i] / grid) * grid;
      };
      for (auto proj : {MultiHeadAttention::kQ, MultiHeadAttention::kK, MultiHeadAttention::kV}) {
        round_to(m.weight(proj).data, m.weight(proj).numel(), 1.0f / 64);
        if (m.has_bias(proj)) round_to(m.bias(proj).data, m.bias(proj).numel(), 1.0f / 64);
      }
      Rng rng(base_seed() + 804);
      Tensor x = random_tensor(rng, {1, 40, 64});
      round_to(x.data<float>(), x.numel(), 1.0f / 16);
      std::vector<Tensor> stored;  // each run's keys and values as float32
      auto run = [&](const std::vector<int64_t>& chunks) {
        KvCache cache = m.make_cache(1, 0, type);
        Tensor y(DType::kF32, {1, 40, 64});
        int64_t t = 0;
        for (int64_t n : chunks) {
          const View<const float> xs(x.data<float>() + t * 64, {1, n, 64});
          const Tensor o = m.step(xs, cache).output;
          std::copy(o.data<float>(), o.data<float>() + n * 64, y.data<float>() + t * 64);
          t += n;
        }
        EXPECT_EQ(cache.length(0), 40);
        stored.push_back(cache.keys_as_float());
        stored.push_back(cache.values_as_float());
        return y;
      };
      std::vector<int64_t> tokens(34, 1);
      tokens.insert(tokens.begin(), 6);
      const Tensor a = run({6, 20, 1, 13}), b = run(tokens);
      SCOPED_TRACE(std::string(cache_type_name(type)) + " window " + std::to_string(window) + " dots " +
                   std::to_string(dots));
      EXPECT_TRUE(bitwise_equal(stored[0], stored[2])) << "keys";
      EXPECT_TRUE(bitwise_equal(stored[1], stored[3])) << "values";
      EXPECT_LE(rel_error(a.view<float>(), b.view<float>()), bound);
    }
  }
}

TEST(KvCacheQuantStep, AttendChecksItsArguments) {
  KvCacheConfig c;
  c.batch = 2;
  c.kv_heads = 2;
  c.head_dim_qk = 16;
  c.head_dim_v = 8;
  c.dtype = CacheType::kInt8;
  KvCache cache(c);
  Rng rng(base_seed() + 805);
  const Tensor k = random_tensor(rng, {2, 2, 3, 16}), v = random_tensor(rng, {2, 2, 3, 8});
  cache.append(k.view<float>(), v.view<float>(), {3, 1});
  Tensor q = random_tensor(rng, {2, 4, 1, 16}), o(DType::kF32, {2, 4, 1, 8});
  expect_error([&] { attend(random_tensor(rng, {2, 3, 1, 16}).view<float>(), cache, o.view<float>()); },
               {"attend", "query", "kv_heads = 2", "(2, 3, 1, 16)"});
  expect_error([&] { attend(q.view<float>(), cache, Tensor(DType::kF32, {2, 4, 1, 9}).view<float>()); },
               {"attend", "out", "(2, 4, 1, 8)"});
  Tensor q2 = random_tensor(rng, {2, 4, 2, 16}), o2(DType::kF32, {2, 4, 2, 8});
  expect_error([&] { attend(q2.view<float>(), cache, o2.view<float>()); }, {"attend", "sequence 1", "1 positions"});
  AttentionOptions causal;
  causal.causal = Causal::kTopLeft;
  expect_error([&] { attend(q.view<float>(), cache, o.view<float>(), causal); }, {"attend", "causal"});
  expect_error([&] { (void)cache.as_stored(k.view<float>(), random_tensor(rng, {2, 2, 3, 7}).view<float>()); },
               {"append", "values", "(2, 2, 3, 7)"});
  KvCacheConfig f = c;
  f.dtype = CacheType::kBF16;
  expect_error([&] { KvCache(f).key_codes(); }, {"key_codes", "bfloat16"});
  expect_error([&] { KvCache(f).key_outlier_channels(); }, {"key_outlier_channels", "bfloat16"});
  attend(q.view<float>(), cache, o.view<float>());  // still usable
  for (int64_t i = 0; i < o.numel(); ++i) EXPECT_TRUE(std::isfinite(o.data<float>()[i]));
}

}  // namespace
}  // namespace mha::test
