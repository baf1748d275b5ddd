// mha demo: the three seed modules on built-in inputs. Each runs on the default (fast) path and
// on the plain double-accumulating reference path with the same weights; the table shows the
// output shape, the largest difference between the two, and the fast path's time. Then
// generation with KV caches, and a small model trained with mha's backward.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "mha/multi_head_attention.h"
#include "tiny_gpt/reverse_task.h"
#include "tiny_gpt/tiny_gpt.h"
#include "tools/commands.h"
#include "util/random.h"

namespace mha::tools {
namespace {

struct SeedCase {
  const char* seed;
  const char* name;
  MultiHeadAttentionConfig config;
  std::vector<int64_t> input_shape;  // (B, T, E)
  bool uniform_input;                // torch.rand (seed 000) or torch.randn
  bool need_weights;
};

Tensor make_input(const std::vector<int64_t>& shape, bool uniform, uint64_t seed) {
  Tensor x(DType::kF32, shape);
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = uniform ? uniform01(seed, i) : normal(seed, i);
  return x;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
  return m;
}

double max_abs(const Tensor& a) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(a.data<float>()[i])));
  return m;
}

double median_ms(const std::function<void()>& f, int runs) {
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::string shape_of(const Tensor& t) { return shape_string(t.shape().data(), t.rank()); }

// A small GPT-style stack of mha layers (random weights) generating bytes greedily with one KV
// cache per layer; the first tokens are checked against recomputing the whole sequence.
void run_generation(int threads) {
  examples::TinyGptConfig c;
  c.vocab = 256, c.dim = 256, c.heads = 8, c.kv_heads = 2, c.layers = 4, c.hidden = 1024, c.max_len = 512;
  c.seed = 1, c.num_threads = threads;
  const examples::TinyGpt model(c);
  const std::string text = "mha: multi-head attention in C++";
  const std::vector<int32_t> prompt(text.begin(), text.end());
  const int64_t n = 200;
  double prefill = 0, decode = 0;
  const std::vector<int32_t> out = model.generate(prompt, n, &prefill, &decode);

  // The same greedy tokens from full forwards over the growing sequence (no cache).
  std::vector<int32_t> seq = prompt;
  bool same = true;
  for (int64_t i = 0; i < 16; ++i) {
    const Tensor logits = model.forward(seq, 1, static_cast<int64_t>(seq.size()));
    const float* row = logits.data<float>() + (static_cast<int64_t>(seq.size()) - 1) * c.vocab;
    const int32_t tok = static_cast<int32_t>(std::max_element(row, row + c.vocab) - row);
    same &= tok == out[i];
    seq.push_back(tok);
  }
  std::string shown;
  for (int32_t t : out) shown += t >= 32 && t < 127 ? static_cast<char>(t) : '.';
  fmt::print("generation: TinyGpt, {} layers, dim {}, {} query / {} kv heads (GQA), {:.2f} M parameters, random "
             "weights\n",
             c.layers, c.dim, c.heads, c.kv_heads, static_cast<double>(model.parameter_count()) / 1e6);
  fmt::print("  prompt \"{}\" ({} tokens): prefill {:.2f} ms, {:.0f} tokens/s\n", text, prompt.size(), prefill * 1e3,
             static_cast<double>(prompt.size()) / prefill);
  fmt::print("  {} new tokens with KV caches: {:.2f} ms, {:.0f} tokens/s\n", n, decode * 1e3,
             static_cast<double>(n - 1) / decode);
  fmt::print("  first 16 tokens equal to recomputing the whole sequence each step: {}\n", same ? "yes" : "NO");
  fmt::print("  output bytes (gibberish: the weights are random): {}\n", shown.substr(0, 72));
  // The same generation from KV caches of every storage type.
  fmt::print("  {:<9} {:>10} {:>10} {:>26}\n", "KV cache", "cache MiB", "tokens/s", "tokens equal to float32's");
  for (CacheType t : {CacheType::kF32, CacheType::kBF16, CacheType::kF16, CacheType::kInt8, CacheType::kInt4}) {
    double tp = 0, td = 0;
    int64_t bytes = 0;
    const std::vector<int32_t> o = model.generate(prompt, n, &tp, &td, t, &bytes);
    int64_t equal = 0;
    while (equal < n && o[equal] == out[equal]) ++equal;
    fmt::print("  {:<9} {:>10.2f} {:>10.0f} {:>21} / {}\n", cache_type_name(t), static_cast<double>(bytes) / (1 << 20),
               static_cast<double>(n - 1) / td, equal, n);
  }
}

// Training with MultiHeadAttention::backward and Adam: TinyGpt learns to reverse digit
// sequences (the task of `mha train`), then the trained model reverses one with KV caches.
void run_training(int threads) {
  examples::ReverseTaskOptions o;
  o.num_threads = threads;
  std::unique_ptr<examples::TinyGpt> model;
  const examples::ReverseTaskReport r = examples::train_reverse_task(o, {}, &model);
  const examples::TinyGptConfig& c = model->config();
  fmt::print("\ntraining: TinyGpt ({} layers, dim {}, {} heads, {} parameters) learns to reverse {} digits:\n", c.layers,
             c.dim, c.heads, r.parameters, o.length);
  fmt::print("  {:.2f}% token accuracy, {:.0f}% of sequences reversed by greedy decoding, after {} Adam steps in "
             "{:.1f} s\n",
             100 * r.token_accuracy, 100 * r.sequence_accuracy, r.steps, r.seconds);
  const std::vector<int32_t> digits = {3, 1, 4, 1, 5, 9, 2, 6};
  std::vector<int32_t> prompt = digits;
  prompt.push_back(static_cast<int32_t>(o.digits));  // SEP
  const std::vector<int32_t> out = model->generate(prompt, o.length);
  auto text = [](const std::vector<int32_t>& v) {
    std::string s;
    for (int32_t t : v) s += std::to_string(t) + " ";
    return s;
  };
  fmt::print("  the trained model, given {}| writes {}\n", text(digits), text(out));
}

}  // namespace

int run_demo(int threads) {
  std::vector<SeedCase> cases;
  {
    // 000: GPT-style masked self-attention: q/k/v/out Linear with bias, causal, block_size 10.
    MultiHeadAttentionConfig c;
    c.embed_dim = 768, c.num_heads = 8, c.causal = Causal::kTopLeft, c.max_seq_len = 10;
    c.attn_dropout = 0.1f, c.out_dropout = 0.1f;  // inactive: the demo runs in eval mode
    cases.push_back({"000", "GPT masked self-attention", c, {10, 10, 768}, true, false});
  }
  {
    // 002: BERT-style attention returning per-head weights.
    MultiHeadAttentionConfig c;
    c.embed_dim = 512, c.num_heads = 8, c.attn_dropout = 0.1f;
    cases.push_back({"002", "BERT attention + weights", c, {2, 10, 512}, false, true});
  }
  {
    // 003: single-head self-attention, dim_in != dim_k != dim_v, no bias, no output projection.
    MultiHeadAttentionConfig c;
    c.embed_dim = 48, c.num_heads = 1, c.qk_proj_dim = 32, c.v_proj_dim = 40, c.bias = false, c.out_proj = false;
    cases.push_back({"003", "single-head, dim_k != dim_v", c, {4, 12, 48}, false, false});
  }
  {
    // 003: multi-head self-attention with dim_k != dim_v and one packed QKV matrix.
    MultiHeadAttentionConfig c;
    c.embed_dim = 64, c.num_heads = 8, c.qk_proj_dim = 128, c.v_proj_dim = 96, c.bias = false, c.out_proj = false;
    cases.push_back({"003", "multi-head, dim_k != dim_v", c, {4, 12, 64}, false, false});
  }

  fmt::print("{:<5} {:<28} {:<15} {:<16} {:>13} {:>10}\n", "seed", "module", "output", "weights", "max|fast-ref|",
             "time");
  uint64_t seed = 1;
  for (const SeedCase& sc : cases) {
    const MultiHeadAttention module(sc.config, seed);
    const Tensor x = make_input(sc.input_shape, sc.uniform_input, seed + 100);
    MhaInputs in;
    in.query = x.view<float>();
    MhaCallOptions fast;
    fast.need_weights = sc.need_weights;
    fast.average_weights = false;
    fast.num_threads = threads;
    MhaCallOptions ref = fast;
    ref.backend = Backend::kReference;
    MhaOutputs got = module.forward(in, fast);
    const MhaOutputs want = module.forward(in, ref);
    const double ms = median_ms([&] { got = module.forward(in, fast); }, 7);
    double diff = max_abs_diff(got.output, want.output) / std::max(1e-30, max_abs(want.output));
    if (sc.need_weights) diff = std::max(diff, max_abs_diff(got.weights, want.weights));
    fmt::print("{:<5} {:<28} {:<15} {:<16} {:>13.2e} {:>7.3f} ms\n", sc.seed, sc.name, shape_of(got.output),
               sc.need_weights ? shape_of(got.weights) : "-", diff, ms);
    ++seed;
  }
  fmt::print("max|fast-ref|: largest difference relative to the largest |output| (and absolute for weights).\n\n");
  run_generation(threads);
  run_training(threads);
  return 0;
}

}  // namespace mha::tools
