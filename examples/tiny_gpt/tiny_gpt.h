// TinyGpt: a small GPT-style decoder built from mha layers — token and position embeddings,
// pre-LayerNorm blocks of causal MultiHeadAttention and a GELU MLP, a final LayerNorm and an
// output head tied to the token embedding. Used by `mha demo` (generation with KV caches) and
// `mha train` (learning to reverse sequences: MultiHeadAttention::backward with hand-written
// backward passes of the small layers around it, and mha::Adam).
#ifndef MHA_EXAMPLES_TINY_GPT_H_
#define MHA_EXAMPLES_TINY_GPT_H_

#include <cstdint>
#include <vector>

#include "mha/multi_head_attention.h"
#include "mha/optim.h"

namespace mha::examples {

struct TinyGptConfig {
  int64_t vocab = 256;
  int64_t dim = 128;
  int64_t heads = 4;
  int64_t kv_heads = 4;
  int64_t layers = 2;
  int64_t hidden = 512;   // MLP width
  int64_t max_len = 256;
  uint64_t seed = 0;
  int num_threads = 0;
};

class TinyGpt {
 public:
  explicit TinyGpt(const TinyGptConfig& config);

  // Logits (B, T, vocab) of tokens (B·T values, row-major), full causal attention.
  Tensor forward(const std::vector<int32_t>& tokens, int64_t B, int64_t T) const;

  // Greedy decoding with one KV cache per layer: prefill the prompt in one step, then one token
  // per step. Returns the n new tokens; prefill_seconds / decode_seconds if not null. The caches
  // store keys and values as cache_type; cache_bytes (if not null) gets their total size.
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, int64_t n, double* prefill_seconds = nullptr,
                                double* decode_seconds = nullptr, CacheType cache_type = CacheType::kF32,
                                int64_t* cache_bytes = nullptr) const;

  // Training with teacher forcing: the mean cross-entropy of the next-token logits over the
  // positions whose target is >= 0 (others are ignored), with gradients *added* to the buffers
  // behind parameters(). tokens and targets hold B·T values, row-major.
  struct StepResult {
    double loss = 0;
    int64_t counted = 0;  // positions with a target
    int64_t correct = 0;  // of which the argmax of the logits is the target
  };
  StepResult forward_backward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets, int64_t B,
                              int64_t T);
  // Every trainable tensor with its gradient buffer (for an optimizer).
  std::vector<Parameter> parameters();
  void zero_grad();

  const TinyGptConfig& config() const { return config_; }
  int64_t parameter_count() const;

 private:
  MhaCallOptions attn_options(bool training) const {
    MhaCallOptions o;
    o.training = training;
    o.num_threads = config_.num_threads;
    return o;
  }
  struct Block {
    Tensor ln1_g, ln1_b, ln2_g, ln2_b;
    MultiHeadAttention attn;
    Tensor fc1_w, fc1_b, fc2_w, fc2_b;
  };
  struct BlockGrads {
    Tensor ln1_g, ln1_b, ln2_g, ln2_b;
    MhaParamGrads attn;
    Tensor fc1_w, fc1_b, fc2_w, fc2_b;
  };
  // h (rows, dim) in place: h += attention(ln1(h)); h += mlp(ln2(h)). With a cache the rows are
  // the newest positions of one sequence (a step); without, B sequences of T rows.
  void block(const Block& blk, Tensor& h, int64_t B, int64_t T, KvCache* cache) const;
  Tensor embed(const std::vector<int32_t>& tokens, int64_t B, int64_t T, int64_t first_position) const;
  Tensor logits(const Tensor& h) const;

  TinyGptConfig config_;
  Tensor tok_emb_, pos_emb_, lnf_g_, lnf_b_;
  std::vector<Block> blocks_;
  // Gradient buffers, same shapes as the parameters.
  Tensor g_tok_emb_, g_pos_emb_, g_lnf_g_, g_lnf_b_;
  std::vector<BlockGrads> g_blocks_;
};

}  // namespace mha::examples

#endif  // MHA_EXAMPLES_TINY_GPT_H_
