// The training example: TinyGpt (mha layers + hand-written LayerNorm/GELU/embedding backward)
// against finite differences, and learning to reverse sequences to >= 99% token accuracy.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "test_util.h"
#include "tiny_gpt/reverse_task.h"
#include "tiny_gpt/tiny_gpt.h"

namespace mha::test {
namespace {

using examples::TinyGpt;
using examples::TinyGptConfig;

TinyGptConfig small_model() {
  TinyGptConfig c;
  c.vocab = 7, c.dim = 16, c.heads = 4, c.kv_heads = 2, c.layers = 2, c.hidden = 24, c.max_len = 8, c.seed = 3;
  return c;
}

TEST(TrainExample, TinyGptGradientsMatchFiniteDifferences) {
  TinyGpt model(small_model());
  Rng rng(base_seed() + 91);
  const int64_t B = 2, T = 6;
  std::vector<int32_t> tokens, targets;
  for (int64_t i = 0; i < B * T; ++i) {
    tokens.push_back(static_cast<int32_t>(rng.range(0, 6)));
    targets.push_back(i % 3 == 0 ? -1 : static_cast<int32_t>(rng.range(0, 6)));
  }
  model.zero_grad();
  model.forward_backward(tokens, targets, B, T);
  // Copy the gradients out: the loss evaluations below add to the buffers.
  std::vector<Parameter> params = model.parameters();
  std::vector<std::vector<float>> grads;
  for (const Parameter& p : params) grads.emplace_back(p.grad.data, p.grad.data + p.grad.numel());
  auto loss = [&] { return model.forward_backward(tokens, targets, B, T).loss; };
  // Loss in double from float activations: h = 1e-2 keeps rounding (~1e-7/h) and truncation
  // (~h²) near 1e-4 of the largest gradient entry.
  constexpr float h = 1e-2f;
  double worst = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    double scale = 0;
    for (float g : grads[k]) scale = std::max(scale, std::fabs(static_cast<double>(g)));
    if (params[k].name.find("k_proj.bias") != std::string::npos) continue;  // zero in exact arithmetic
    ASSERT_GT(scale, 0) << params[k].name;
    for (int s = 0; s < 6; ++s) {
      const int64_t i = rng.range(0, params[k].value.numel() - 1);
      float& w = params[k].value.data[i];
      const float saved = w;
      w = saved + h;
      const double up = loss();
      w = saved - h;
      const double down = loss();
      w = saved;
      const double err = std::fabs((up - down) / (2 * h) - grads[k][i]) / scale;
      worst = std::max(worst, err);
      EXPECT_LE(err, 2e-3) << params[k].name << "[" << i << "]";
    }
  }
  std::printf("TinyGpt backward vs finite differences: worst %.1e of max |grad| over %zu tensors\n", worst,
              params.size());
}

TEST(TrainExample, SameLossBitsForOneAndTwoThreads) {
  double loss[2];
  for (int threads : {1, 2}) {
    TinyGptConfig c = small_model();
    c.num_threads = threads;
    TinyGpt model(c);
    Adam adam(model.parameters(), AdamOptions{});
    std::vector<int32_t> tokens(16), targets(16);
    for (int i = 0; i < 16; ++i) tokens[i] = i % 7, targets[i] = (i * 3) % 7;
    for (int step = 0; step < 3; ++step) {
      adam.zero_grad();
      loss[threads - 1] = model.forward_backward(tokens, targets, 2, 8).loss;
      adam.step();
    }
  }
  EXPECT_EQ(loss[0], loss[1]);
}

TEST(TrainExample, LearnsToReverseSequences) {
  examples::ReverseTaskOptions o;  // 8 digits, batch 32, Adam 3e-3, seed 1
  std::unique_ptr<examples::TinyGpt> model;
  const examples::ReverseTaskReport r = examples::train_reverse_task(o, {}, &model);
  std::printf("reverse task: %.2f%% token accuracy, %.0f%% sequences, %ld steps, %.1f s\n", 100 * r.token_accuracy,
              100 * r.sequence_accuracy, static_cast<long>(r.steps), r.seconds);
  EXPECT_GE(r.token_accuracy, 0.99);
  EXPECT_GE(r.sequence_accuracy, 0.9);

  // The trained model decodes from quantized KV caches: int8 gives the float32 cache's greedy
  // tokens on every sequence; int4's agreement is reported (docs/numerics.md).
  ASSERT_TRUE(model);
  Rng rng(base_seed() + 700);
  const int sequences = 100;
  int right = 0, same8 = 0, same4 = 0;
  for (int s = 0; s < sequences; ++s) {
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < o.length; ++i) prompt.push_back(static_cast<int32_t>(rng.range(0, o.digits - 1)));
    const std::vector<int32_t> digits = prompt;
    prompt.push_back(static_cast<int32_t>(o.digits));  // SEP
    const auto f32 = model->generate(prompt, o.length);
    right += std::equal(f32.begin(), f32.end(), digits.rbegin());
    same8 += model->generate(prompt, o.length, nullptr, nullptr, CacheType::kInt8) == f32;
    same4 += model->generate(prompt, o.length, nullptr, nullptr, CacheType::kInt4) == f32;
  }
  std::printf("greedy decoding of %d sequences: float32 cache %d right; int8 cache %d, int4 cache %d the same\n",
              sequences, right, same8, same4);
  EXPECT_EQ(same8, sequences);
}

}  // namespace
}  // namespace mha::test
