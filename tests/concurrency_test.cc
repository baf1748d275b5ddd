// Thread safety: one module (and the attention op) shared by many threads gives the results of
// serial calls, bit for bit. The contract is in mha/multi_head_attention.h. Run under
// ThreadSanitizer by scripts/test.sh.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "mha/multi_head_attention.h"
#include "test_util.h"

namespace mha::test {
namespace {

TEST(Concurrency, ManyThreadsShareOneModule) {
  MultiHeadAttentionConfig c;
  c.embed_dim = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.causal = Causal::kBottomRight;
  c.attn_dropout = 0.2f;
  const MultiHeadAttention m(c, 3);
  constexpr int kThreads = 8, kCalls = 6;
  Rng rng(base_seed());
  std::vector<Tensor> inputs;
  for (int t = 0; t < kThreads; ++t) inputs.push_back(random_tensor(rng, {2, 40 + 7 * t, 64}));
  // Each call its own settings: training (dropout, explicitly seeded) or evaluation, weights or
  // not, causal or not, the reference or the fast backend, 1 or 2 threads.
  auto call = [&](int t, int k) {
    MhaInputs in;
    in.query = inputs[t].view<float>();
    MhaCallOptions o;
    o.training = (t + k) % 2 == 0;
    o.need_weights = k % 2 == 1;
    o.average_weights = k % 4 == 1;
    if (k % 3 == 2) o.causal = Causal::kNone;
    o.backend = t == 5 ? Backend::kReference : Backend::kAuto;
    o.num_threads = 1 + k % 2;
    o.dropout_seed = static_cast<uint64_t>(100 * t + k);
    return m.forward(in, o);
  };
  // Serial results first.
  std::vector<std::vector<MhaOutputs>> serial(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (int k = 0; k < kCalls; ++k) serial[t].push_back(call(t, k));
  // Then all threads at once, each with its inner parallelism on too.
  std::vector<std::vector<MhaOutputs>> concurrent(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kCalls; ++k) concurrent[t].push_back(call(t, k));
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    for (int k = 0; k < kCalls; ++k) {
      EXPECT_TRUE(bitwise_equal(serial[t][k].output, concurrent[t][k].output)) << t << " " << k;
      if (k % 2 == 1) EXPECT_TRUE(bitwise_equal(serial[t][k].weights, concurrent[t][k].weights)) << t << " " << k;
    }
}

TEST(Concurrency, ManyThreadsCallAttention) {
  Rng rng(base_seed() + 1);
  const Tensor q = random_tensor(rng, {1, 4, 100, 32}), k = random_tensor(rng, {1, 4, 130, 32});
  const AttentionInputs in{q.view<float>(), k.view<float>(), k.view<float>()};
  Tensor want(DType::kF32, {1, 4, 100, 32});
  AttentionOptions opt;
  opt.causal = Causal::kBottomRight;
  attention(in, {want.view<float>()}, opt);
  std::vector<Tensor> got(6);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      got[t] = Tensor(DType::kF32, {1, 4, 100, 32});
      attention(in, {got[t].view<float>()}, opt);
    });
  }
  for (auto& th : threads) th.join();
  for (const Tensor& g : got) EXPECT_TRUE(bitwise_equal(g, want));
}

}  // namespace
}  // namespace mha::test
