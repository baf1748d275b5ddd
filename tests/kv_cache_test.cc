// Incremental decoding with a KV cache equals full causal attention over the whole sequence,
// at every step: MHA, GQA and MQA weights, sliding windows, chunked prefill, sequences of
// different lengths, capacity growth and ring wrap-around; a random walk of appends, resets and
// bad counts against a model of each sequence's slots, for every cache type.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

MultiHeadAttentionConfig gpt(int64_t E, int64_t H, int64_t Hkv, int64_t window) {
  MultiHeadAttentionConfig c;
  c.embed_dim = E;
  c.num_heads = H;
  c.num_kv_heads = Hkv;
  c.causal = Causal::kTopLeft;
  c.window = window;
  return c;
}

// Rows [t0, t1) of sequence b of a (B, T, E) tensor, as a (1, t1 - t0, E) tensor.
Tensor rows(const Tensor& x, int64_t b, int64_t t0, int64_t t1) {
  const int64_t T = x.shape()[1], E = x.shape()[2];
  Tensor r(DType::kF32, {1, t1 - t0, E});
  std::copy(x.data<float>() + (b * T + t0) * E, x.data<float>() + (b * T + t1) * E, r.data<float>());
  return r;
}

// Feeds sequence x (1, T, E) through step() in the given chunk sizes and compares every new
// output row with the forward over the whole sequence.
void expect_steps_match_full(const MultiHeadAttention& m, const Tensor& x, const std::vector<int64_t>& chunks) {
  MhaInputs full_in;
  full_in.query = x.view<float>();
  const Tensor full = m.forward(full_in).output;
  KvCache cache = m.make_cache(1, 2);  // small, so that it grows
  const int64_t E = x.shape()[2];
  int64_t t = 0;
  for (int64_t n : chunks) {
    const Tensor xs = rows(x, 0, t, t + n);
    const Tensor y = m.step(xs.view<float>(), cache).output;
    const View<const float> got(y.data<float>(), {n, m.output_dim()});
    const View<const float> want(full.data<float>() + t * m.output_dim(), {n, m.output_dim()});
    ASSERT_LE(rel_error(got, want), 2e-6) << "positions " << t << " .. " << t + n;
    t += n;
  }
  EXPECT_EQ(cache.length(0), t);
  (void)E;
}

TEST(KvCache, StepsEqualFullCausalAttention) {
  Rng rng(base_seed());
  for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {8, 2}, {4, 1}}) {  // MHA, GQA, MQA
    for (int64_t window : {0, 5}) {
      SCOPED_TRACE("H " + std::to_string(H) + " Hkv " + std::to_string(Hkv) + " window " + std::to_string(window));
      MultiHeadAttention m(gpt(32, H, Hkv, window), 7);
      const Tensor x = random_tensor(rng, {1, 40, 32});
      expect_steps_match_full(m, x, {6, 1, 1, 1, 3, 1, 1, 8, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
      expect_steps_match_full(m, x, std::vector<int64_t>(40, 1));  // token by token from the start
      expect_steps_match_full(m, x, {40});                         // one prefill
    }
  }
}

TEST(KvCache, SequencesOfDifferentLengths) {
  Rng rng(base_seed() + 1);
  for (int64_t window : {0, 3}) {
    MultiHeadAttention m(gpt(16, 4, 2, window), 9);
    const Tensor x = random_tensor(rng, {2, 12, 16});
    KvCache cache = m.make_cache(2);
    // Prompts of 5 and 2 tokens in one padded prefill, then both decode token by token.
    Tensor prompt(DType::kF32, {2, 5, 16});
    for (int64_t b = 0; b < 2; ++b) {
      const Tensor r = rows(x, b, 0, 5);
      std::copy(r.data<float>(), r.data<float>() + r.numel(), prompt.data<float>() + b * 5 * 16);
    }
    const Tensor y0 = m.step(prompt.view<float>(), cache, {5, 2}).output;
    EXPECT_EQ(cache.length(0), 5);
    EXPECT_EQ(cache.length(1), 2);
    for (int64_t t = 2; t < 5; ++t)  // padding rows of sequence 1 are zeros
      for (int64_t e = 0; e < 16; ++e) EXPECT_EQ(y0.data<float>()[(5 + t) * 16 + e], 0.0f);
    std::vector<Tensor> outs[2];
    for (int64_t b = 0; b < 2; ++b) outs[b].push_back(y0.clone());
    int64_t pos[2] = {5, 2};
    for (int step = 0; step < 6; ++step) {
      Tensor tok(DType::kF32, {2, 1, 16});
      for (int64_t b = 0; b < 2; ++b) {
        const Tensor r = rows(x, b, pos[b], pos[b] + 1);
        std::copy(r.data<float>(), r.data<float>() + 16, tok.data<float>() + b * 16);
      }
      const Tensor y = m.step(tok.view<float>(), cache).output;
      for (int64_t b = 0; b < 2; ++b) {
        MhaInputs in;
        const Tensor seq = rows(x, b, 0, pos[b] + 1);
        in.query = seq.view<float>();
        const Tensor full = m.forward(in).output;
        const View<const float> got(y.data<float>() + b * 16, {1, 16});
        const View<const float> want(full.data<float>() + pos[b] * 16, {1, 16});
        ASSERT_LE(rel_error(got, want), 2e-6) << "sequence " << b << " position " << pos[b];
        ++pos[b];
      }
    }
  }
}

TEST(KvCache, GrowsByDoublingAndWindowsWrap) {
  KvCacheConfig c;
  c.batch = 1;
  c.kv_heads = 1;
  c.head_dim_qk = c.head_dim_v = 2;
  c.capacity = 2;
  KvCache grow(c);
  Tensor k(DType::kF32, {1, 1, 1, 2});
  for (int i = 0; i < 9; ++i) {
    k.data<float>()[0] = static_cast<float>(i);
    grow.append(k.view<float>(), k.view<float>());
  }
  EXPECT_EQ(grow.capacity(), 16);  // 2 → 4 → 8 → 16
  for (int i = 0; i < 9; ++i) EXPECT_EQ(grow.keys().at(0, 0, i, 0), static_cast<float>(i));
  c.window = 4;
  KvCache ring(c);
  for (int i = 0; i < 11; ++i) {
    k.data<float>()[0] = static_cast<float>(i);
    ring.append(k.view<float>(), k.view<float>());
  }
  EXPECT_EQ(ring.capacity(), 4);
  EXPECT_EQ(ring.length(0), 11);
  EXPECT_EQ(ring.stored(0), 4);
  for (int p = 7; p < 11; ++p) EXPECT_EQ(ring.keys().at(0, 0, p % 4, 0), static_cast<float>(p));
}

TEST(KvCache, MismatchedCacheIsAnError) {
  MultiHeadAttention m(gpt(16, 4, 2, 0), 1);
  KvCacheConfig c;
  c.batch = 1;
  c.kv_heads = 4;  // the module has 2
  c.head_dim_qk = c.head_dim_v = 4;
  KvCache wrong(c);
  Tensor x(DType::kF32, {1, 1, 16});
  EXPECT_THROW(m.step(x.view<float>(), wrong), Error);
  KvCache right = m.make_cache(1);
  EXPECT_THROW(m.step(x.view<float>(), right, {2}), Error);  // more new tokens than rows
}

// Random appends (counts per sequence, chunks longer than the window), resets and bad counts
// against a model of each sequence's positions: after every call each sequence's length, the
// slots it keeps (the window's ring after the sink tokens, within the capacity) and their
// contents, position p in slot(p); a call with bad counts is an error and changes nothing.
TEST(KvCache, RandomAppendsKeepEachPositionInItsSlot) {
  Rng rng(base_seed() + 2);
  constexpr int64_t B = 3, Hkv = 2, D = 16, Dv = 8;
  int wraps = 0, bad_counts = 0;
  for (CacheType type : {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4}) {
    for (const std::pair<int64_t, int64_t>& ring : {std::pair<int64_t, int64_t>{0, 0}, {5, 0}, {12, 3}}) {
      const int64_t window = ring.first, sinks = ring.second;  // not bound: clang 14's lambdas cannot capture that
      SCOPED_TRACE(std::string(cache_type_name(type)) + " window " + std::to_string(window) + " sinks " +
                   std::to_string(sinks));
      KvCacheConfig c;
      c.batch = B;
      c.kv_heads = Hkv;
      c.head_dim_qk = D;
      c.head_dim_v = Dv;
      c.capacity = rng.range(1, 8);
      c.window = window;
      c.sink_tokens = sinks;
      c.dtype = type;
      KvCache cache(c);
      // Each sequence's appended rows, position by position: (Hkv, D) keys then (Hkv, Dv) values.
      std::vector<std::vector<float>> model(B);
      // The stored rows against the model's (float32 exactly; the others round them: 16-bit by
      // 2^-8 / 2^-11 of each value, int8 / int4 by half a step of a group's range, norm-wise
      // loosely here; a row from another position is off by ~1.4).
      const double bound = type == CacheType::kF32    ? 0.0
                           : type == CacheType::kBF16 ? 1.0 / 256
                           : type == CacheType::kF16  ? 1.0 / 2048
                           : type == CacheType::kInt8 ? 1.0 / 16
                                                      : 1.0 / 2;
      auto check = [&](const std::string& op) {
        SCOPED_TRACE(op);
        const Tensor ks = cache.keys_as_float(), vs = cache.values_as_float();
        const int64_t cap = cache.capacity();
        for (int64_t b = 0; b < B; ++b) {
          const int64_t L = static_cast<int64_t>(model[b].size()) / (Hkv * (D + Dv));
          ASSERT_EQ(cache.length(b), L);
          const int64_t kept = window > 0 ? std::min(L, sinks + window) : L;
          ASSERT_EQ(cache.stored(b), kept);
          ASSERT_GE(cap, kept);
          for (int64_t p = 0; p < L; ++p) {
            if (window > 0 && p >= sinks && p < L - window) continue;  // dropped from the ring
            const int64_t slot = cache.slot(p);
            ASSERT_EQ(slot, window > 0 && p >= sinks ? sinks + (p - sinks) % window : p) << "position " << p;
            const float* row = model[b].data() + p * Hkv * (D + Dv);
            const View<const float> k(ks.data<float>() + (b * Hkv * cap + slot) * D, {Hkv, D}, {cap * D, 1});
            const View<const float> v(vs.data<float>() + (b * Hkv * cap + slot) * Dv, {Hkv, Dv}, {cap * Dv, 1});
            ASSERT_LE(rel_error(k, View<const float>(row, {Hkv, D})), bound) << "keys, sequence " << b << " at " << p;
            ASSERT_LE(rel_error(v, View<const float>(row + Hkv * D, {Hkv, Dv})), bound)
                << "values, sequence " << b << " at " << p;
          }
        }
      };
      for (int step = 0; step < 150; ++step) {
        if (HasFatalFailure()) return;  // a failed check (ASSERT in a lambda) ends the walk
        SCOPED_TRACE("step " + std::to_string(step));
        const double u = rng.uniform();
        if (u < 0.05) {
          cache.reset();
          for (auto& m : model) m.clear();
          check("reset");
          continue;
        }
        const int64_t n = rng.range(0, 2 * std::max<int64_t>(window, 8));
        const Tensor k = random_tensor(rng, {B, Hkv, n, D}), v = random_tensor(rng, {B, Hkv, n, Dv});
        std::vector<int64_t> counts;
        if (rng.coin(0.7))
          for (int64_t b = 0; b < B; ++b) counts.push_back(rng.range(0, n));
        if (u < 0.12) {  // a count out of [0, n], or one count too few: nothing changes
          if (counts.empty() || rng.coin()) {
            counts.assign(B - 1, 0);
            expect_error([&] { cache.append(k.view<float>(), v.view<float>(), counts); }, {"append", "count"});
          } else {
            const int64_t b = rng.range(0, B - 1);
            counts[static_cast<size_t>(b)] = rng.coin() ? -1 : n + 1;
            expect_error([&] { cache.append(k.view<float>(), v.view<float>(), counts); },
                         {"append", "count[" + std::to_string(b) + "]"});
          }
          ++bad_counts;
          check("a bad append");
          continue;
        }
        cache.append(k.view<float>(), v.view<float>(), counts);
        for (int64_t b = 0; b < B; ++b) {
          const int64_t cnt = counts.empty() ? n : counts[static_cast<size_t>(b)];
          wraps += window > 0 && cnt > window;
          for (int64_t t = 0; t < cnt; ++t) {
            for (int64_t h = 0; h < Hkv; ++h)
              for (int64_t e = 0; e < D; ++e) model[b].push_back(k.view<float>().at(b, h, t, e));
            for (int64_t h = 0; h < Hkv; ++h)
              for (int64_t e = 0; e < Dv; ++e) model[b].push_back(v.view<float>().at(b, h, t, e));
          }
        }
        check("append of " + std::to_string(n));
      }
    }
  }

  EXPECT_GE(wraps, 20);  // chunks longer than the window: the ring wraps within one append
  EXPECT_GE(bad_counts, 20);
}

}  // namespace
}  // namespace mha::test
