// Training one MultiHeadAttention layer: forward records a tape, backward takes dL/d output and
// adds the parameters' gradients into MhaParamGrads, Adam updates the weights. Built and run by the
// test suite.
#include <cstdio>

#include "mha/multi_head_attention.h"
#include "mha/optim.h"

int main() {
  mha::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.causal = mha::Causal::kTopLeft;
  mha::MultiHeadAttention attn(config, /*seed=*/1);
  mha::MhaCallOptions training;
  training.training = true;  // dropout (none configured here) applies in training calls only

  mha::MhaParamGrads grads = attn.make_grads();
  mha::AdamOptions adam_options;
  adam_options.lr = 1e-2f;
  mha::Adam adam(attn.parameters(&grads), adam_options);

  // Fit y = attention(x) to a fixed target with a squared error.
  const int64_t B = 2, T = 6, E = 32, n = B * T * E;
  mha::Tensor x = mha::Tensor::zeros({B, T, E}), target = mha::Tensor::zeros({B, T, E});
  for (int64_t i = 0; i < n; ++i) {
    x.data<float>()[i] = static_cast<float>((i * 37) % 11) / 11.0f - 0.5f;
    target.data<float>()[i] = static_cast<float>((i * 53) % 7) / 7.0f - 0.5f;
  }
  mha::MhaInputs in;
  in.query = x.view<float>();
  double first = 0, last = 0;
  for (int step = 0; step < 100; ++step) {
    adam.zero_grad();
    mha::MhaTape tape;
    const mha::Tensor y = attn.forward(in, training, &tape).output;
    mha::Tensor dy = mha::Tensor::zeros({B, T, E});  // dL/dy of L = mean((y - target)^2)
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float d = y.data<float>()[i] - target.data<float>()[i];
      loss += static_cast<double>(d) * d / n;
      dy.data<float>()[i] = 2.0f * d / static_cast<float>(n);
    }
    attn.backward(tape, dy.view<float>(), &grads);  // before the weights change
    adam.step();
    if (step == 0) first = loss;
    last = loss;
  }
  std::printf("squared error: %.3e at the first step, %.3e after 100 Adam steps\n", first, last);
  return last < 0.5 * first ? 0 : 1;
}
