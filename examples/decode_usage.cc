// Incremental decoding with a KV cache: prefill a prompt in one step, then one position per step.
// Every step's output equals the matching rows of a causal forward over the whole sequence.
// Built and run by the test suite.
#include <cmath>
#include <cstdio>

#include "mha/multi_head_attention.h"

int main() {
  mha::MultiHeadAttentionConfig config;
  config.embed_dim = 64;
  config.num_heads = 8;
  config.num_kv_heads = 2;  // grouped-query attention: the cache holds 2 heads, not 8
  config.causal = mha::Causal::kTopLeft;
  mha::MultiHeadAttention attn(config, /*seed=*/7);

  const int64_t T = 9, prompt = 5, E = 64;
  mha::Tensor x = mha::Tensor::zeros({1, T, E});  // the whole sequence, (B, T, E)
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = std::sin(0.1f * static_cast<float>(i));

  mha::KvCache cache = attn.make_cache(/*batch=*/1);
  mha::Tensor steps = mha::Tensor::zeros({1, T, E});
  auto rows = [&](int64_t t0, int64_t n) {  // positions t0 .. t0+n-1 of x, as (1, n, E)
    return mha::View<const float>(x.data<float>() + t0 * E, {1, n, E});
  };
  mha::Tensor y = attn.step(rows(0, prompt), cache).output;  // prefill
  std::copy(y.data<float>(), y.data<float>() + prompt * E, steps.data<float>());
  for (int64_t t = prompt; t < T; ++t) {  // one position per step
    y = attn.step(rows(t, 1), cache).output;
    std::copy(y.data<float>(), y.data<float>() + E, steps.data<float>() + t * E);
  }

  mha::MhaInputs in;
  in.query = x.view<float>();
  const mha::Tensor full = attn.forward(in).output;
  float diff = 0;
  for (int64_t i = 0; i < full.numel(); ++i)
    diff = std::fmax(diff, std::fabs(full.data<float>()[i] - steps.data<float>()[i]));
  std::printf("cache holds %lld positions; max |steps - full forward| = %.2e\n",
              static_cast<long long>(cache.length(0)), diff);
  return diff < 1e-5f ? 0 : 1;
}
