#include "tiny_gpt/reverse_task.h"

#include <chrono>

#include "mha/optim.h"

namespace mha::examples {
namespace {

class Digits {
 public:
  explicit Digits(uint64_t seed) : state_(seed) {}
  int32_t next(int64_t n) {  // splitmix64, uniform in [0, n)
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return static_cast<int32_t>((z ^ (z >> 31)) % static_cast<uint64_t>(n));
  }

 private:
  uint64_t state_;
};

struct Batch {
  std::vector<int32_t> tokens, targets;
  std::vector<std::vector<int32_t>> sequences;
};

Batch make_batch(Digits& rng, const ReverseTaskOptions& o, int64_t count) {
  const int64_t L = o.length, T = 2 * L;
  const int32_t sep = static_cast<int32_t>(o.digits);
  Batch b;
  for (int64_t s = 0; s < count; ++s) {
    std::vector<int32_t> x(static_cast<size_t>(L));
    for (auto& d : x) d = rng.next(o.digits);
    std::vector<int32_t> full(x);
    full.push_back(sep);
    full.insert(full.end(), x.rbegin(), x.rend());  // 2L + 1 tokens
    for (int64_t t = 0; t < T; ++t) {
      b.tokens.push_back(full[t]);
      b.targets.push_back(t >= L ? full[t + 1] : -1);
    }
    b.sequences.push_back(std::move(x));
  }
  return b;
}

}  // namespace

TinyGptConfig reverse_task_model(const ReverseTaskOptions& o) {
  TinyGptConfig c;
  c.vocab = o.digits + 1;
  c.dim = 64;
  c.heads = 4;
  c.kv_heads = 4;
  c.layers = 2;
  c.hidden = 128;
  c.max_len = 2 * o.length + 1;
  c.seed = o.seed;
  c.num_threads = o.num_threads;
  return c;
}

ReverseTaskReport train_reverse_task(const ReverseTaskOptions& o,
                                     const std::function<void(const ReverseTaskReport&)>& progress,
                                     std::unique_ptr<TinyGpt>* trained) {
  auto owned = std::make_unique<TinyGpt>(reverse_task_model(o));
  TinyGpt& model = *owned;
  AdamOptions adam_options;
  adam_options.lr = o.lr;
  Adam adam(model.parameters(), adam_options);
  Digits rng(o.seed * 7919 + 1), eval_rng(o.seed * 104729 + 2);
  const int64_t T = 2 * o.length;
  ReverseTaskReport report;
  report.parameters = model.parameter_count();

  auto evaluate = [&] {
    const Batch b = make_batch(eval_rng, o, o.eval_sequences);
    // Teacher-forced token accuracy: a forward with no gradients kept.
    const Tensor logits = model.forward(b.tokens, o.eval_sequences, T);
    int64_t counted = 0, correct = 0;
    for (size_t i = 0; i < b.targets.size(); ++i) {
      if (b.targets[i] < 0) continue;
      const float* row = logits.data<float>() + static_cast<int64_t>(i) * (o.digits + 1);
      correct += std::max_element(row, row + o.digits + 1) - row == b.targets[i];
      ++counted;
    }
    report.token_accuracy = static_cast<double>(correct) / static_cast<double>(counted);
    // Greedy generation of a few whole sequences.
    const int64_t n = std::min<int64_t>(64, o.eval_sequences);
    int64_t right = 0;
    for (int64_t s = 0; s < n; ++s) {
      std::vector<int32_t> prompt = b.sequences[s];
      prompt.push_back(static_cast<int32_t>(o.digits));
      const std::vector<int32_t> out = model.generate(prompt, o.length);
      right += std::equal(out.begin(), out.end(), b.sequences[s].rbegin());
    }
    report.sequence_accuracy = static_cast<double>(right) / static_cast<double>(n);
  };

  double seconds = 0;
  for (int64_t step = 1; step <= o.max_steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const Batch b = make_batch(rng, o, o.batch);
    adam.zero_grad();
    report.last_loss = model.forward_backward(b.tokens, b.targets, o.batch, T).loss;
    adam.step();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report.steps = step;
    report.seconds = seconds;
    if (step % o.eval_every == 0 || step == o.max_steps) {
      evaluate();
      if (progress) progress(report);
      if (report.token_accuracy >= o.target_accuracy) break;
    }
  }
  if (trained) *trained = std::move(owned);
  return report;
}

}  // namespace mha::examples
