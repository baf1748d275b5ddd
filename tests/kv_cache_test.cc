// Incremental decoding with a KV cache equals full causal attention over the whole sequence,
// at every step: MHA, GQA and MQA weights, sliding windows, chunked prefill, sequences of
// different lengths, capacity growth and ring wrap-around.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace mha::test
