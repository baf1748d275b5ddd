// Hostile inputs, one class of defect per test group (docs/reliability.md lists the classes and
// their guards): index widths past 2^31, accessor bounds, thread counts, degenerate and
// overflowing sizes, dropout counters, 16-bit element types. Each must give a correct result or an mha::Error naming
// the argument — never a crash, a hang, or a silently wrong answer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/linear.h"
#include "mha/multi_head_attention.h"
#include "mha/paged_kv_cache.h"
#include "mha/varlen.h"
#include "kernels/cpu/flash.h"
#include "modules/positional.h"
#include "test_util.h"

namespace mha::test {
namespace {

constexpr int64_t kPast31 = (int64_t{1} << 31) + 5;  // more keys than an int32 index reaches

template <typename T>
T to_half(float x) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return to_bfloat16(x);
  } else {
    return to_float16(x);
  }
}

// A (1, 1, T, D) view repeating one row (stride 0 over T): huge key counts cost no memory.
View<const float> repeated(const float* row, int64_t T, int64_t D) {
  return View<const float>(row, {1, 1, T, D}, {0, 0, 0, 1});
}

// ---- Index widths: key positions past 2^31 -------------------------------------------------

// All keys visible: every score is 0 and every value row 1, so each output is 1 and the LSE is
// log(Tk). Past 2^24 keys a float running sum of 1.0s stops growing (the decode path gave
// 0.0625 here); the kernels bound every float sum's length and merge the parts.
void expect_all_keys_seen(int64_t Tq, int64_t Tk) {
  const float zero_row[4] = {0, 0, 0, 0}, one_row[4] = {1, 1, 1, 1};
  Tensor q(DType::kF32, {1, 1, Tq, 4}), out(DType::kF32, {1, 1, Tq, 4}), lse(DType::kF32, {1, 1, Tq});
  attention({q.view<float>(), repeated(zero_row, Tk, 4), repeated(one_row, Tk, 4)},
            {out.view<float>(), lse.view<float>()});
  for (int64_t i = 0; i < Tq; ++i) {
    for (int d = 0; d < 4; ++d) ASSERT_NEAR(out.data<float>()[i * 4 + d], 1.0f, 1e-5f) << "row " << i;
    EXPECT_NEAR(lse.data<float>()[i], std::log(static_cast<double>(Tk)), 1e-5 * std::log(static_cast<double>(Tk)));
  }
}

TEST(HostileIndexWidths, LongRowsSumAccuratelyOnEveryPath) {
  const int64_t Tk = (int64_t{1} << 25) + 3;  // past float's 2^24 integers
  expect_all_keys_seen(1, Tk);   // decode path
  expect_all_keys_seen(40, Tk);  // tiled path
}

// Every row must see exactly `expected_visible` keys (read from its LSE: all scores are 0) and
// return the value rows' 1.0.
void expect_window_rows(Causal causal, const View<const int64_t>& lengths, int64_t Tq, int64_t window,
                        int64_t expected_visible, int num_threads) {
  const float zero_row[4] = {0, 0, 0, 0}, one_row[4] = {1, 1, 1, 1};
  Tensor q(DType::kF32, {1, 1, Tq, 4}), out(DType::kF32, {1, 1, Tq, 4}), lse(DType::kF32, {1, 1, Tq});
  AttentionInputs in{q.view<float>(), repeated(zero_row, kPast31, 4), repeated(one_row, kPast31, 4)};
  in.key_lengths = lengths;
  AttentionOptions opt;
  opt.causal = causal;
  opt.window = window;
  opt.num_threads = num_threads;
  attention(in, {out.view<float>(), lse.view<float>()}, opt);
  for (int64_t i = 0; i < Tq; ++i) {
    for (int d = 0; d < 4; ++d) ASSERT_EQ(out.data<float>()[i * 4 + d], 1.0f) << "row " << i;
    EXPECT_NEAR(lse.data<float>()[i], std::log(static_cast<double>(expected_visible)), 1e-6) << "row " << i;
  }
}

TEST(HostileIndexWidths, WindowPast2To31Keys) {
  // 32 queries aligned bottom-right on 2^31 + 5 keys, window 4: each row sees exactly 4 keys,
  // all past index 2^31. The tile kept key ranges in int32: rows 26–31 came back 0.
  expect_window_rows(Causal::kBottomRight, {}, 32, 4, 4, 0);
  expect_window_rows(Causal::kBottomRight, {}, 97, 7, 7, 1);  // several query tiles
  expect_window_rows(Causal::kBottomRight, {}, 1, 3, 3, 0);   // the decode path
  expect_window_rows(Causal::kBottomRight, {}, 16, 70, 70, 2);
}

TEST(HostileIndexWidths, KeyLengthsPast2To31) {
  // key_lengths are int64: a length past 2^31 is a length, not a wrapped negative number.
  Tensor len(DType::kI64, {1});
  len.data<int64_t>()[0] = kPast31 - 2;
  expect_window_rows(Causal::kBottomRight, len.view<int64_t>(), 40, 5, 5, 0);
  len.data<int64_t>()[0] = int64_t{1} << 32;  // past Tk: an error naming the argument
  EXPECT_THROW(
      {
        try {
          expect_window_rows(Causal::kBottomRight, len.view<int64_t>(), 1, 5, 5, 0);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("key_lengths[0] = 4294967296"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

TEST(HostileIndexWidths, DropoutRefusesIndicesItsCounterCannotHold) {
  const float row[4] = {0, 0, 0, 0};
  Tensor q(DType::kF32, {1, 1, 1, 4}), out(DType::kF32, {1, 1, 1, 4});
  const int64_t Tk = int64_t{1} << 35;  // key / 4 needs 33 bits
  AttentionOptions opt;
  opt.dropout_p = 0.5f;
  expect_error([&] { attention({q.view<float>(), repeated(row, Tk, 4), repeated(row, Tk, 4)}, {out.view<float>()}, opt); },
               {"dropout", "32 bits", "34359738368"});
}

// ---- Accessor bounds ------------------------------------------------------------------------

TEST(HostileAccessors, KvCacheSequenceIndexIsChecked) {
  KvCacheConfig c;
  c.batch = 1;
  c.head_dim_qk = c.head_dim_v = 4;
  KvCache cache(c);
  EXPECT_EQ(cache.length(0), 0);
  for (int64_t b : {int64_t{-1}, int64_t{1}, int64_t{5}, int64_t{1000000000000}, std::numeric_limits<int64_t>::min()}) {
    expect_error([&] { cache.length(b); }, {"KvCache::length", std::to_string(b), "batch = 1"});
    expect_error([&] { cache.stored(b); }, {"KvCache::stored", std::to_string(b)});
  }
}

TEST(HostileAccessors, ViewAccessorsAreChecked) {
  float data[6] = {0, 1, 2, 3, 4, 5};
  const View<const float> v(data, {2, 3});
  EXPECT_EQ(v.at(1, 2), 5.0f);
  expect_error([&] { v.at(2, 0); }, {"View::at", "(2, 0, 0, 0)", "(2, 3)"});
  expect_error([&] { v.at(0, -1); }, {"View::at", "(0, -1, 0, 0)"});
  expect_error([&] { v.at(0, 0, 1); }, {"View::at", "past the rank"});
  expect_error([&] { v.at(int64_t{1} << 40); }, {"View::at", "1099511627776"});
  EXPECT_EQ(v.transposed(0, 1).at(2, 1), 5.0f);
  expect_error([&] { (void)v.transposed(0, 2); }, {"View::transposed", "0 and 2", "[0, 2)", "(2, 3)"});
  expect_error([&] { (void)v.transposed(-1, 0); }, {"View::transposed", "-1"});
  expect_error([&] { (void)View<const float>().transposed(0, 0); }, {"View::transposed", "[0, 0)"});
  // A shape whose element count overflows int64: the row-major strides wrap (no undefined
  // behaviour) and numel() is an error naming the shape.
  const int64_t big = int64_t{1} << 32;
  const View<const float> huge(data, {big, big, 1});
  expect_error([&] { (void)huge.numel(); }, {"View::numel", "(4294967296, 4294967296, 1)", "int64"});
}

TEST(HostileAccessors, ModuleProjectionAccessors) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 8;
  c.num_heads = 2;
  c.out_proj = false;
  MultiHeadAttention m(c);
  expect_error([&] { m.weight(MultiHeadAttention::kOut); }, {"no output projection"});
  expect_error([&] { m.weight(static_cast<MultiHeadAttention::Proj>(7)); }, {"projection", "7"});
  expect_error([&] { m.bias(static_cast<MultiHeadAttention::Proj>(-1)); }, {"projection", "-1"});
}

// ---- Thread counts --------------------------------------------------------------------------

TEST(HostileThreads, OutOfRangeCountsAreErrorsEverywhere) {
  Rng rng(base_seed() + 500);
  const Tensor q = random_tensor(rng, {1, 2, 9, 8});
  Tensor out(DType::kF32, {1, 2, 9, 8});
  for (int threads : {-1, kMaxThreads + 1, 5000, 100000}) {
    AttentionOptions opt;
    opt.num_threads = threads;
    expect_error([&] { attention({q.view<float>(), q.view<float>(), q.view<float>()}, {out.view<float>()}, opt); },
                 {"num_threads", std::to_string(threads)});
    opt.backend = Backend::kReference;
    expect_error([&] { attention({q.view<float>(), q.view<float>(), q.view<float>()}, {out.view<float>()}, opt); },
                 {"num_threads", std::to_string(threads)});

    MultiHeadAttentionConfig c;
    c.embed_dim = 8;
    c.num_heads = 2;
    const MultiHeadAttention m(c);
    const Tensor x = random_tensor(rng, {1, 5, 8});
    MhaInputs in;
    in.query = x.view<float>();
    MhaCallOptions o;
    o.num_threads = threads;
    expect_error([&] { m.forward(in, o); }, {"num_threads", std::to_string(threads)});
    KvCache cache = m.make_cache(1);
    expect_error([&] { m.step(x.view<float>(), cache, {}, o); }, {"num_threads", std::to_string(threads)});

    Tensor y(DType::kF32, {5, 8});
    expect_error([&] { linear(View<const float>(x.data<float>(), {5, 8}), m.weight(MultiHeadAttention::kQ), {},
                              y.view<float>(), threads); },
                 {"num_threads", std::to_string(threads)});
  }
}

TEST(HostileThreads, TheLargestCountRunsWithTheSameBits) {
  Rng rng(base_seed() + 501);
  const Tensor q = random_tensor(rng, {2, 3, 70, 16});
  Tensor a(DType::kF32, {2, 3, 70, 16}), b(DType::kF32, {2, 3, 70, 16});
  AttentionOptions opt;
  opt.num_threads = 1;
  attention({q.view<float>(), q.view<float>(), q.view<float>()}, {a.view<float>()}, opt);
  opt.num_threads = kMaxThreads;  // clamped to a few per core: no thread-creation failure
  attention({q.view<float>(), q.view<float>(), q.view<float>()}, {b.view<float>()}, opt);
  EXPECT_TRUE(bitwise_equal(a, b));
}

// ---- Degenerate and overflowing sizes -------------------------------------------------------

TEST(HostileSizes, NothingToComputeReturnsAtOnce) {
  // 2^40 batches of an empty output (Dv = 0, stride 0): no element to write, no LSE asked for.
  // This looped over every batch entry; a hang here fails by the test's timeout.
  const float row[4] = {0, 0, 0, 0};
  const int64_t B = int64_t{1} << 40;
  const View<const float> q(row, {B, 2, 3, 4}, {0, 0, 0, 1});
  const View<const float> k(row, {B, 1, 5, 4}, {0, 0, 0, 1});
  const View<const float> v(row, {B, 1, 5, 0}, {0, 0, 0, 1});
  float sink = 0;
  const View<float> out(&sink, {B, 2, 3, 0}, {0, 0, 0, 1});
  Tensor len(DType::kI64, {1});
  const View<const int64_t> lengths(len.data<int64_t>(), {B}, {0});
  for (Backend backend : {Backend::kFast, Backend::kReference}) {
    AttentionOptions opt;
    opt.backend = backend;
    opt.causal = Causal::kBottomRight;
    AttentionInputs in{q, k, v};
    in.key_lengths = lengths;
    attention(in, {out}, opt);
  }
}

TEST(HostileSizes, CountsThatOverflowInt64AreErrors) {
  const float row[4] = {0, 0, 0, 0};
  const int64_t big = int64_t{1} << 40;
  float sink[4] = {};
  // Query rows · keys beyond int64.
  {
    const View<const float> q(row, {big, 1, big, 4}, {0, 0, 0, 1});
    const View<const float> k(row, {big, 1, big, 4}, {0, 0, 0, 1});
    const View<float> out(sink, {big, 1, big, 4}, {0, 0, 0, 1});
    expect_error([&] { attention({q, k, k}, {out}); }, {"query", "int64"});
  }
  // A stride whose span does not fit a 64-bit byte offset.
  {
    const View<const float> q(row, {1, 1, 4, 4}, {0, 0, int64_t{1} << 62, 1});
    Tensor out(DType::kF32, {1, 1, 4, 4});
    expect_error([&] { attention({q, q, q}, {out.view<float>()}); }, {"query", "64-bit offset"});
  }
  // Negative dimensions in a hand-made view.
  {
    View<const float> q(row, {1, 1, 4, 4}, {0, 0, 4, 1});
    q.shape[2] = -4;
    Tensor out(DType::kF32, {1, 1, 4, 4});
    expect_error([&] { attention({q, q, q}, {out.view<float>()}); }, {"negative"});
  }
}

TEST(HostileSizes, ModuleAndCacheSizesAreChecked) {
  MultiHeadAttentionConfig c;
  c.embed_dim = int64_t{1} << 31;  // 3·E² weights: 64-bit overflow, not a "negative dimension"
  c.num_heads = 1;
  expect_error([&] { MultiHeadAttention m(c); }, {"MultiHeadAttention", "overflows 64 bits"});
  c.embed_dim = int64_t{1} << 20;  // fits int64, far too large to allocate
  expect_error([&] { MultiHeadAttention m(c); }, {"MultiHeadAttention", "cannot allocate", "(3298534883328,)"});
  KvCacheConfig k;
  k.batch = int64_t{1} << 40;
  k.kv_heads = int64_t{1} << 30;
  k.head_dim_qk = k.head_dim_v = 4;
  expect_error([&] { KvCache cache(k); }, {"KvCache", "overflows 64 bits"});
  // A batch whose storage fits int64 but not memory: the storage's error, where the per-sequence
  // lengths once threw std::bad_alloc first (8 TiB of them).
  k.kv_heads = 2;
  expect_error([&] { KvCache cache(k); },
               {"KvCache: the storage of batch 1099511627776, kv_heads 2, 16 slots", "(1099511627776, 2, 16, 4)"});
  k.dtype = CacheType::kInt8;  // its key channel scales are allocated first
  expect_error([&] { KvCache cache(k); }, {"KvCache: the storage of batch 1099511627776", "(1099511627776, 2, 4)"});
  k.dtype = CacheType::kF32;
  // Found by fuzz/cache_fuzz.cc (UBSan: signed overflow in the checks or in row sizes): a
  // negative window; head dims that a batch of 0 allocates nothing for; a head dim whose row of
  // int8 groups overflows in a paged pool.
  k = KvCacheConfig{};
  k.head_dim_qk = k.head_dim_v = 4;
  k.window = -1;  // with no sink tokens: sink_tokens + window was checked before the window's sign
  expect_error([&] { KvCache cache(k); }, {"KvCache", "window -1", "must be positive"});
  k.window = 0;
  k.batch = 0;
  k.head_dim_qk = int64_t{1} << 62;
  expect_error([&] { KvCache cache(k); }, {"KvCache: head_dim_qk", "4611686018427387904", "not in [1, 2^40]"});
  k.head_dim_qk = 4;
  k.kv_heads = int64_t{1} << 62;
  expect_error([&] { KvCache cache(k); }, {"KvCache", "overflows 64 bits"});
  PagedKvCacheConfig p;
  p.head_dim_qk = 16;
  p.head_dim_v = std::numeric_limits<int64_t>::max();
  p.dtype = CacheType::kInt8;
  expect_error([&] { PagedKvCache cache(p); }, {"PagedKvCache: head_dim_v", "not in [1, 2^40]"});
}

// ---- 16-bit element types -------------------------------------------------------------------

// Keys past 2^31 in bfloat16 and float16, through the block widening (tiled path) and the
// register widening (decode): a window of 100 at the end of the sequence, every score 0 and
// every value 1, so each row returns exactly 1 and LSE log(100).
template <typename T>
void expect_window_rows_16(int64_t Tq) {
  const T zero_row[4] = {}, one_row[4] = {to_half<T>(1.0f), to_half<T>(1.0f), to_half<T>(1.0f), to_half<T>(1.0f)};
  Tensor q(DTypeOf<T>::value, {1, 1, Tq, 4}), out(DTypeOf<T>::value, {1, 1, Tq, 4}), lse(DType::kF32, {1, 1, Tq});
  const View<const T> k(zero_row, {1, 1, kPast31, 4}, {0, 0, 0, 1}), v(one_row, {1, 1, kPast31, 4}, {0, 0, 0, 1});
  AttentionOptions opt;
  opt.causal = Causal::kBottomRight;
  opt.window = 100;
  attention(BasicAttentionInputs<T>{q.view<T>(), k, v}, BasicAttentionOutputs<T>{out.view<T>(), lse.view<float>()},
            opt);
  const Tensor o = out.to_f32();
  for (int64_t i = 0; i < Tq; ++i) {
    for (int d = 0; d < 4; ++d) ASSERT_EQ(o.data<float>()[i * 4 + d], 1.0f) << "row " << i;
    EXPECT_NEAR(lse.data<float>()[i], std::log(100.0), 1e-6) << "row " << i;
  }
}

TEST(HostileSixteenBit, KeysPast2To31) {
  for (int64_t Tq : {1, 40}) {
    expect_window_rows_16<bfloat16>(Tq);
    expect_window_rows_16<float16>(Tq);
  }
}

// The overlap and shape checks count 16-bit elements as 2 bytes: an output overlapping an
// input by one element is refused, one just past it is not.
TEST(HostileSixteenBit, OverlapIsMeasuredInTheirBytes) {
  Tensor buf(DType::kBF16, {2 * 4 * 8});
  bfloat16* p = buf.data<bfloat16>();
  const View<const bfloat16> q(p, {1, 1, 4, 8});
  const View<bfloat16> overlapping(p + 31, {1, 1, 4, 8}), after(p + 32, {1, 1, 4, 8});
  expect_error([&] { attention(BasicAttentionInputs<bfloat16>{q, q, q}, BasicAttentionOutputs<bfloat16>{overlapping}); },
               {"out", "overlaps", "query"});
  attention(BasicAttentionInputs<bfloat16>{q, q, q}, BasicAttentionOutputs<bfloat16>{after});
  // A 16-bit output of the wrong shape names it.
  const View<bfloat16> wrong(p + 32, {1, 1, 4, 7});
  expect_error([&] { attention(BasicAttentionInputs<bfloat16>{q, q, q}, BasicAttentionOutputs<bfloat16>{wrong}); },
               {"out", "(1, 1, 4, 8)", "(1, 1, 4, 7)"});
}

// Quantized caches near the float range: group scales stay finite (int8: max/levels −
// min/levels; int4 takes values beyond ±2^127 as ±2^127, kv_cache.h), dequantized values stay
// within half a step of the values (so taken), attention over them stays finite on the targets
// with fused multiply-add (every SIMD target here): minimum + scale·code is then one rounding.
// The portable SCALAR target rounds scale·code first, which can overflow above ~1e36 (where a
// build has only it, say with MHA_SKIP_SIMD_TARGETS), so the check runs on each other target
// compiled in and supported here.
TEST(HostileCaches, QuantizedValuesNearTheFloatRange) {
  for (CacheType type : {CacheType::kInt8, CacheType::kInt4}) {
    KvCacheConfig c;
    c.head_dim_qk = c.head_dim_v = 32;
    c.dtype = type;
    KvCache cache(c);
    Tensor k(DType::kF32, {1, 1, 2, 32}), v(DType::kF32, {1, 1, 2, 32});
    for (int64_t e = 0; e < 32; ++e) {
      k.view<float>().at(0, 0, 0, e) = e % 2 ? 1e37f : -1e37f;
      k.view<float>().at(0, 0, 1, e) = 1.0f;  // a constant group: scale 0, exact
      v.view<float>().at(0, 0, 0, e) = e % 2 ? 3e38f : -3e38f;
      v.view<float>().at(0, 0, 1, e) = 1e-30f;
    }
    cache.append(k.view<float>(), v.view<float>());
    const Tensor kf = cache.keys_as_float(), vf = cache.values_as_float();
    for (int64_t e = 0; e < 32; ++e) {
      EXPECT_TRUE(std::isfinite(kf.view<float>().at(0, 0, 0, e))) << e;
      if (type == CacheType::kInt8) {
        // The group's extremes are codes 0 and levels: the minimum exact, the maximum within rounding.
        EXPECT_NEAR(vf.view<float>().at(0, 0, 0, e), v.view<float>().at(0, 0, 0, e), 3e38 * 1e-6) << e;
        EXPECT_EQ(vf.view<float>().at(0, 0, 1, e), 1e-30f);
        // Key row 0's scale and minimum: words 0 and 1 of lane 0, at 0 and 16 of its tile.
        EXPECT_TRUE(std::isfinite(cache_word_float(cache.key_scales().data[0])));
        EXPECT_TRUE(std::isfinite(cache_word_float(cache.key_scales().data[16])));
        continue;
      }
      // int4: ±3e38 taken as ±2^127: the minimum exact (a bfloat16), the maximum within half a step.
      const uint32_t word = cache.value_scales().at(0, 0, 0, 0);
      EXPECT_EQ(cache_group_minimum(word), -0x1p127f);
      EXPECT_NEAR(vf.view<float>().at(0, 0, 0, e), e % 2 ? 0x1p127f : -0x1p127f, cache_group_scale(word) / 2) << e;
      // A constant group: 1e-30 is no bfloat16, so within half a step (of at most 2^-7 · 2^-100).
      const uint32_t tiny = cache.value_scales().at(0, 0, 1, 0);
      EXPECT_NEAR(vf.view<float>().at(0, 0, 1, e), 1e-30f, cache_group_scale(tiny) / 2) << e;
      EXPECT_LE(cache_group_scale(tiny), 0x1p-107f);
      EXPECT_TRUE(std::isfinite(cache_group_scale(cache.key_scales().at(0, 0, 0, 0))));
      EXPECT_TRUE(std::isfinite(cache_group_minimum(cache.key_scales().at(0, 0, 0, 0))));
    }
    const Tensor q = Tensor::zeros({1, 1, 1, 32});
    Tensor out(DType::kF32, {1, 1, 1, 32});
    int checked = 0;
    for (const std::string& t : kernels::simd_targets()) {
      if (t == "SCALAR" || t == "EMU128") continue;
      const RestoreKernelSwitches restore;
      kernels::force_simd_target(t);
      attend(q.view<float>(), cache, out.view<float>());
      for (int64_t e = 0; e < 32; ++e) EXPECT_TRUE(std::isfinite(out.view<float>().at(0, 0, 0, e))) << t << " " << e;
      ++checked;
    }
    std::printf("%s: attention over the cache checked finite on %d SIMD target(s)%s\n", cache_type_name(type),
                checked, checked ? "" : " (none here: only the portable target runs, which may overflow)");
  }
}

TEST(HostileCaches, PagedIdsAndEmptyBatches) {
  PagedKvCacheConfig c;
  c.head_dim_qk = c.head_dim_v = 16;
  c.page_size = 16;
  PagedKvCache cache(c);
  const int64_t s = cache.add_sequence();
  cache.free_sequence(s);
  for (int64_t id : {s, int64_t{-1}, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    expect_error([&] { cache.free_sequence(id); }, {"free_sequence", "not live"});
    expect_error([&] { cache.fork(id); }, {"fork", "not live"});
    expect_error([&] { cache.block_table(id); }, {"block_table", "not live"});
    expect_error([&] { cache.key_channel_scales(id); }, {"key_channel_scales", "not live"});
    expect_error([&] { cache.key_outlier_channels(id); }, {"key_outlier_channels", "not live"});
  }
  const int64_t t = cache.add_sequence();
  EXPECT_EQ(t, s + 1);  // ids are never reused
  expect_error([&] { cache.append(t, View<const float>(nullptr, {1, 3, 16}), View<const float>(nullptr, {1, 3, 16})); },
               {"append", "null data pointer"});
  EXPECT_EQ(cache.length(t), 0);
  const Tensor q = Tensor::zeros({0, 1, 1, 16});
  Tensor out(DType::kF32, {0, 1, 1, 16});
  attend(q.view<float>(), cache, {}, out.view<float>());  // nothing to do
  EXPECT_EQ(cache.free_pages(), cache.pages());
}

TEST(HostileCaches, VarlenOffsetsAtTheInt64Limits) {
  const Tensor q = Tensor::zeros({5, 1, 8}), k = Tensor::zeros({5, 1, 8});
  Tensor out(DType::kF32, {5, 1, 8});
  for (std::vector<int64_t> cu : {std::vector<int64_t>{0, std::numeric_limits<int64_t>::max()},
                                  std::vector<int64_t>{0, std::numeric_limits<int64_t>::min()},
                                  std::vector<int64_t>{0, 7, 5}}) {
    Tensor t(DType::kI64, {static_cast<int64_t>(cu.size())});
    std::copy(cu.begin(), cu.end(), t.data<int64_t>());
    Tensor ok(DType::kI64, {static_cast<int64_t>(cu.size())});
    for (size_t i = 0; i < cu.size(); ++i) ok.data<int64_t>()[i] = i == 0 ? 0 : 5;
    const BasicVarlenInputs<float> in{q.view<float>(), k.view<float>(), k.view<float>(), t.view<int64_t>(),
                                      ok.view<int64_t>()};
    expect_error([&] { varlen_attention(in, out.view<float>()); }, {"varlen_attention", "cu_seqlens_q"});
  }
}

// Score variants at the limits: sink tokens and windows of int64's size, slopes that overflow a
// score to -inf, a sink of float max, rotary positions past 2^31.
TEST(HostileVariants, LimitsOfSinkTokensSlopesAndPositions) {
  Rng rng(base_seed() + 160);
  const Tensor q = random_tensor(rng, {1, 2, 3, 8}), k = random_tensor(rng, {1, 2, 5, 8}), v = random_tensor(rng, {1, 2, 5, 8});
  Tensor out(DType::kF32, {1, 2, 3, 8}), lse(DType::kF32, {1, 2, 3});
  AttentionOptions opt;
  opt.causal = Causal::kBottomRight;
  opt.window = std::numeric_limits<int64_t>::max();
  opt.sink_tokens = std::numeric_limits<int64_t>::max();
  attention({q.view<float>(), k.view<float>(), v.view<float>()}, {out.view<float>()}, opt);  // everything visible
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data<float>()[i]));
  // Slopes so steep that far keys' scores become -inf: those keys get weight 0, never NaN.
  Tensor slopes(DType::kF32, {2});
  slopes.data<float>()[0] = 3e38f;
  slopes.data<float>()[1] = 1.0f;
  AttentionInputs in{q.view<float>(), k.view<float>(), v.view<float>()};
  in.alibi_slopes = slopes.view<float>();
  AttentionOptions plain;
  plain.causal = Causal::kBottomRight;
  for (Backend backend : {Backend::kFast, Backend::kReference}) {
    plain.backend = backend;
    attention(in, {out.view<float>(), lse.view<float>()}, plain);
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data<float>()[i])) << i;
  }
  // A sink of float max: every row's weights underflow to 0 — zeros, LSE = the sink.
  Tensor sinks(DType::kF32, {2});
  sinks.data<float>()[0] = sinks.data<float>()[1] = std::numeric_limits<float>::max();
  AttentionInputs with_sinks{q.view<float>(), k.view<float>(), v.view<float>()};
  with_sinks.sinks = sinks.view<float>();
  attention(with_sinks, {out.view<float>(), lse.view<float>()});
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.data<float>()[i], 0.0f);
  for (int64_t i = 0; i < lse.numel(); ++i) ASSERT_EQ(lse.data<float>()[i], std::numeric_limits<float>::max());
  // A KvCache whose sink tokens and window overflow int64 together is refused.
  KvCacheConfig kc;
  kc.head_dim_qk = kc.head_dim_v = 8;
  kc.window = 2;
  kc.sink_tokens = std::numeric_limits<int64_t>::max();
  expect_error([&] { KvCache cache(kc); }, {"sink_tokens + window", "overflows"});
  // Rotary at position 2^40: the angle pos·f is formed in double (exact here) and reduced by
  // std::cos/sin, so the first pair rotates by exactly cos(2^40), sin(2^40); the inverse undoes it.
  RotaryConfig r;
  r.dims = 4;
  const modules::RotaryFreqs f = modules::rotary_freqs(r);
  Tensor x(DType::kF32, {1, 1, 1, 4}), y(DType::kF32, {1, 1, 1, 4});
  for (int i = 0; i < 4; ++i) x.data<float>()[i] = y.data<float>()[i] = static_cast<float>(i + 1);
  const std::vector<int64_t> first{int64_t{1} << 40};
  modules::transform_qk(f, 0.0f, {y.view<float>(), y.view<float>()}, first, {y.view<float>(), y.view<float>()}, first, 1);
  const long double a = std::ldexp(1.0L, 40);
  // The q and k views alias here: the pair was rotated twice, by 2·2^40.
  const long double c2 = std::cos(2 * a), s2 = std::sin(2 * a);
  EXPECT_NEAR(y.data<float>()[0], static_cast<float>(1 * c2 - 3 * s2), 1e-5);
  EXPECT_NEAR(y.data<float>()[2], static_cast<float>(1 * s2 + 3 * c2), 1e-5);
  modules::transform_qk_backward(f, 0.0f, {View<const float>(), y.view<float>()}, first,
                                 {View<const float>(), y.view<float>()}, first, 1);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y.data<float>()[i], x.data<float>()[i], 1e-5) << i;
}

}  // namespace
}  // namespace mha::test
