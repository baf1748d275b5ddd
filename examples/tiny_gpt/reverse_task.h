// A synthetic task TinyGpt learns in seconds: reverse a sequence of digits.
//
//   input   x1 x2 ... xL SEP xL ... x2       (T = 2L tokens)
//   target   .  .  ...  .  xL ... x2  x1     (the next token, counted after SEP only)
//
// Accuracy is per target token with teacher forcing; generation accuracy is the share of whole
// sequences that greedy decoding (KV caches) reverses exactly.
#ifndef MHA_EXAMPLES_REVERSE_TASK_H_
#define MHA_EXAMPLES_REVERSE_TASK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "tiny_gpt/tiny_gpt.h"

namespace mha::examples {

struct ReverseTaskOptions {
  int64_t length = 8;       // L digits per sequence
  int64_t digits = 10;      // vocabulary of the sequence (SEP is one more token)
  int64_t batch = 32;
  int64_t max_steps = 3000;
  double target_accuracy = 0.99;  // stop when an evaluation reaches it
  int64_t eval_every = 100;
  int64_t eval_sequences = 512;
  float lr = 3e-3f;
  uint64_t seed = 1;
  int num_threads = 0;
};

struct ReverseTaskReport {
  int64_t steps = 0;
  double seconds = 0;            // training time (evaluations excluded)
  double last_loss = 0;
  double token_accuracy = 0;     // on fresh sequences, teacher forcing
  double sequence_accuracy = 0;  // greedy generation, whole sequence right
  int64_t parameters = 0;
};

// The model the task trains: 2 layers, dim 64, 4 heads.
TinyGptConfig reverse_task_model(const ReverseTaskOptions& options);

// Trains from scratch; `progress` (if set) is called after every evaluation; the trained model
// is moved to *trained if that is not null.
ReverseTaskReport train_reverse_task(const ReverseTaskOptions& options,
                                     const std::function<void(const ReverseTaskReport&)>& progress = {},
                                     std::unique_ptr<TinyGpt>* trained = nullptr);

}  // namespace mha::examples

#endif  // MHA_EXAMPLES_REVERSE_TASK_H_
