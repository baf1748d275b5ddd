// The README's C++ example: GPT-style causal self-attention, then the same module from a
// PyTorch state_dict. Built and run by the test suite.
#include <cstdio>

#include "mha/multi_head_attention.h"

int main() {
  mha::MultiHeadAttentionConfig config;
  config.embed_dim = 768;
  config.num_heads = 8;
  config.causal = mha::Causal::kTopLeft;  // j <= i, as GPT's tril mask
  config.max_seq_len = 10;                // GPT's block_size
  mha::MultiHeadAttention attn(config, /*seed=*/42);

  mha::Tensor x = mha::Tensor::zeros({10, 10, 768});  // (B, T, E)
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = 0.01f * static_cast<float>(i % 97);

  mha::MhaInputs in;
  in.query = x.view<float>();  // no key/value: self-attention, one packed QKV GEMM
  mha::MhaCallOptions options;  // this call's settings: the module holds none
  options.need_weights = true;  // averaged over heads: (B, T, T)
  mha::MhaOutputs out = attn.forward(in, options);
  std::printf("output (%lld, %lld, %lld), weights (%lld, %lld, %lld)\n",
              static_cast<long long>(out.output.shape()[0]), static_cast<long long>(out.output.shape()[1]),
              static_cast<long long>(out.output.shape()[2]), static_cast<long long>(out.weights.shape()[0]),
              static_cast<long long>(out.weights.shape()[1]), static_cast<long long>(out.weights.shape()[2]));

  // Weights saved from PyTorch (safetensors.torch.save_file(module.state_dict(), path)) load by name.
  mha::StateDict weights = attn.state_dict();
  mha::MultiHeadAttention loaded = mha::MultiHeadAttention::from_state_dict(weights, config);
  return loaded.forward(in).output.numel() == out.output.numel() ? 0 : 1;
}
