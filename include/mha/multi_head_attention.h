// MultiHeadAttention: projections + attention + output projection, covering PyTorch's
// nn.MultiheadAttention, GPT-style masked self-attention, BERT-style attention returning its
// weights, and self-attention with separate query/key and value widths and no output projection.
//
//   Q = query · Wqᵀ + bq      (B, Tq, qk_proj_dim)  split into Hq heads of qk_proj_dim/Hq
//   K = key   · Wkᵀ + bk      (B, Tk, Hkv·qk_proj_dim/Hq)
//   V = value · Wvᵀ + bv      (B, Tk, v_proj_dim·Hkv/Hq) split into Hkv heads of v_proj_dim/Hq
//   A = attention(Q, K, V)    (B, Tq, v_proj_dim) heads merged   (see mha/attention.h)
//   Y = A · Woᵀ + bo          (B, Tq, out_dim)              (or Y = A without out_proj)
//
// Self-attention (no key/value given, or key and value are the query itself) computes Q, K
// and V with one GEMM over the packed weight [Wq; Wk; Wv]. Layouts are batch-first (B, T, E)
// unless config.batch_first is false, then (T, B, E) as PyTorch's default.
//
// Masks, with the conventions spelled out because libraries disagree:
//   keep_mask        nonzero = attend (SDPA's polarity; PyTorch MHA's bool
//                    attn_mask is the opposite), broadcastable to (B, Hq, Tq, Tk)
//   attn_bias        float, added to the scaled scores, broadcastable to (B, Hq, Tq, Tk)
//   key_padding_mask (B, Tk), nonzero = padding (PyTorch's polarity)
//   key_lengths      (B,), keys at or past the length are padding
// A query row with no visible key returns zeros (PyTorch's MHA returns NaN there).
//
// Thread safety: forward(), backward() and step() are const, take their settings per call
// (MhaCallOptions) and may run from many threads at once on one module. Changing the weights
// (load_state_dict, weight(), an optimizer step) while a call runs is a data race.
#ifndef MHA_MULTI_HEAD_ATTENTION_H_
#define MHA_MULTI_HEAD_ATTENTION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mha/attention.h"
#include "mha/kv_cache.h"
#include "mha/optim.h"
#include "mha/safetensors.h"
#include "mha/tensor.h"

namespace mha {

// Rotary position embeddings (RoPE, Su et al. 2021) applied to q and k inside the module, per
// head, after QK-norm (Llama, Qwen3 and Gemma order). Position p rotates each pair of rotated
// dims (x_a, x_b) by the angle p·f_i, f_i = theta^(-2i/dims), i < dims/2. docs/semantics.md
// ("Rotary position embeddings") gives positions, layouts and the scalings exactly.
enum class RopeScaling : uint8_t {
  kNone,
  kLinear,  // positions divided by factor (position interpolation)
  kNtk,     // NTK-aware: theta multiplied by factor^(dims / (dims - 2))
  kYarn,    // YaRN (Peng et al. 2023): per-frequency interpolation ramp, attention factor
};
struct RotaryConfig {
  int64_t dims = 0;          // rotated dims per head: even, at most head_dim_qk (fewer: partial
                             // rotary, the rest pass through); 0: no rotary embeddings
  float theta = 10000.0f;    // base
  bool interleaved = false;  // false: pairs (x_i, x_{i+dims/2}) (Llama, GPT-NeoX "rotate_half");
                             // true: pairs (x_{2i}, x_{2i+1}) (GPT-J)
  RopeScaling scaling = RopeScaling::kNone;
  float factor = 1.0f;       // > 0; the context extension factor of the scalings
  int64_t original_max_positions = 0;  // YaRN: the pre-training context length (> 0)
  float beta_fast = 32.0f, beta_slow = 1.0f;  // YaRN's ramp bounds (in rotations), as in its paper
};

struct MultiHeadAttentionConfig {
  // Three kinds of width, named apart: input widths (embed_dim, kdim, vdim, as PyTorch names
  // them), projection widths over all query heads (*_proj_dim, out_dim), and per-head dims
  // (head_dim_qk() = qk_proj_dim / num_heads, head_dim_v() = v_proj_dim / num_heads).
  int64_t embed_dim = 0;      // E: width of the query input
  int64_t num_heads = 1;      // Hq
  int64_t num_kv_heads = 0;   // Hkv, dividing Hq (0: Hq). Fewer than Hq is GQA; 1 is MQA.
  int64_t kdim = 0;           // width of the key input (0: E)
  int64_t vdim = 0;           // width of the value input (0: E)
  int64_t qk_proj_dim = 0;    // query projection width over all Hq heads (0: E)
  int64_t v_proj_dim = 0;     // value projection width over all Hq heads = the merged output (0: E)
  int64_t out_dim = 0;        // output projection width (0: E); unused without out_proj
  bool bias = true;           // biases on the projections
  bool out_proj = true;       // false: no output projection, output width v_proj_dim
  float attn_dropout = 0.0f;  // dropout on attention probabilities, in training mode only
  float out_dropout = 0.0f;   // dropout on the output, in training mode only
  Causal causal = Causal::kNone;
  int64_t window = 0;         // sliding window (needs causal): each query sees itself and the
                              // window-1 positions before it; 0: no window
  int64_t sink_tokens = 0;    // with a window: the first sink_tokens positions stay visible too
                              // (StreamingLLM; the cache keeps them); not with alibi
  int64_t max_seq_len = 0;    // 0: unlimited; else Tq or Tk above it is an error (block_size)
  bool batch_first = true;    // (B, T, E); false: (T, B, E)
  // Element type of the weights, the inputs and the outputs: kF32, kBF16 or kF16. A 16-bit
  // module stores its weight matrices in that type (half the memory) and computes in float32:
  // bfloat16 projections run on oneDNN's bf16 matmul (float32 accumulation); float16 ones widen
  // the weights per call (no float16 arithmetic on x86 without AVX512-FP16). Projections,
  // attention and its weights stay float32 inside; outputs are rounded once to dtype. Biases are
  // float32 in every module. 16-bit modules run forward() and step(); backward() needs float32.
  DType dtype = DType::kF32;
  // Score variants and position handling of current models (docs/semantics.md); all off by
  // default. softcap, alibi and sinks behave as in mha/attention.h.
  float softcap = 0.0f;       // > 0: Gemma 2's logit softcap
  bool alibi = false;         // ALiBi with the standard slopes 2^(-8(h+1)/H) (BLOOM's, also for
                              // head counts that are not powers of two); fixed, not trained
  bool sinks = false;         // a learnable sink logit per query head (gpt-oss): parameter "sinks",
                              // initialised to 0
  RotaryConfig rotary;        // rotary.dims > 0: rotary position embeddings on q and k
  bool qk_norm = false;       // RMSNorm per head on q and k (Qwen3, Gemma 3): learnable weights
                              // "q_norm.weight", "k_norm.weight" of head_dim_qk, initialised to 1
  float qk_norm_eps = 1e-6f;  // the RMSNorm's epsilon: x / sqrt(mean(x²) + eps) · weight
};

// The data of one call: inputs and masks. Views are read during the call only. T is the
// module's dtype (float, bfloat16 or float16).
template <typename T>
struct BasicMhaInputs {
  View<const T> query;                 // (B, Tq, E)
  View<const T> key;                   // (B, Tk, kdim); not given: self-attention
  View<const T> value;                 // (B, Tk, vdim); not given: self-attention
  View<const uint8_t> keep_mask;       // optional, nonzero = attend
  View<const float> attn_bias;         // optional, added to scores
  View<const uint8_t> key_padding_mask;  // optional (B, Tk), nonzero = padding
  View<const int64_t> key_lengths;     // optional (B,)
};
using MhaInputs = BasicMhaInputs<float>;

// The settings of one call. None of them is stored in the module: calls with different
// settings may run at the same time on one module.
struct MhaCallOptions {
  bool training = false;         // dropout (config attn_dropout, out_dropout) applies only if true
  bool need_weights = false;     // also return the attention weights
  bool average_weights = true;   // (B, Tq, Tk) averaged over heads, else (B, Hq, Tq, Tk)
  std::optional<Causal> causal;  // this call's causal masking instead of config().causal
                                 // (PyTorch's is_causal); config().window needs it causal
  std::optional<uint64_t> dropout_seed;  // training: the seed of this call (default: the next
                                         // from the module's counter, see the constructor)
  int num_threads = 0;           // 0: all available; above kMaxThreads is an error
  Backend backend = Backend::kAuto;
};

struct MhaOutputs {
  Tensor output;   // (B, Tq, out_dim) or (Tq, B, out_dim) when not batch_first; the module's dtype
  Tensor weights;  // if need_weights; the module's dtype
};

// Gradient buffers of a module's parameters, in the module's own storage layout; backward()
// adds to them, zero() clears them. Make them with MultiHeadAttention::make_grads().
struct MhaParamGrads {
  Tensor in_weight, in_bias, out_weight, out_bias;
  Tensor sinks, q_norm, k_norm;  // defined when the module has them
  void zero();
};

// Gradients with respect to the inputs, each the shape of its input. For self-attention (key
// and value not given, or the very view of query) the whole gradient is in `query` and key and
// value are undefined; when key and value are given, add them yourself if they are one tensor.
struct MhaInputGrads {
  Tensor query, key, value;
};

// What a training forward saves for backward(): copies of the inputs and masks, the
// projections, the attention output and its log-sum-exp, and the dropout seeds — O(T·width)
// per sequence, never O(T²). Opaque; movable.
class MhaTape {
 public:
  MhaTape();
  ~MhaTape();
  MhaTape(MhaTape&&) noexcept;
  MhaTape& operator=(MhaTape&&) noexcept;
  bool recorded() const { return state_ != nullptr; }

 private:
  friend class MultiHeadAttention;
  struct State;
  std::unique_ptr<State> state_;
};

// What load_state_dict found.
struct LoadReport {
  std::string layout;                 // e.g. "nn.MultiheadAttention (in_proj_weight)"
  std::vector<std::string> used;      // names read
  std::vector<std::string> ignored;   // names present but not weights of this module
  std::vector<std::string> converted; // names converted to the module's dtype from another dtype
};

class MultiHeadAttention {
 public:
  // Weights are initialised as nn.Linear does (uniform in ±1/sqrt(fan_in)) from `seed`. A
  // training call without a dropout_seed draws its seed from `seed` and a call counter (atomic).
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config, uint64_t seed = 0);
  MultiHeadAttention(MultiHeadAttention&& other) noexcept;
  MultiHeadAttention(const MultiHeadAttention&) = delete;
  MultiHeadAttention& operator=(const MultiHeadAttention&) = delete;

  // Infers the configuration (widths, head dims, kv heads, bias, output projection) from the
  // weights' names and shapes; `base` supplies num_heads and the non-weight settings.
  static MultiHeadAttention from_state_dict(const StateDict& weights, const MultiHeadAttentionConfig& base,
                                            LoadReport* report = nullptr, const std::string& prefix = "");

  // Copies weights in; names and shapes must match this module (see docs/weights.md).
  LoadReport load_state_dict(const StateDict& weights, const std::string& prefix = "");
  // nn.MultiheadAttention's names when they can express this module, else q_proj/k_proj/...
  StateDict state_dict() const;

  // With a tape, forward also records what backward() needs (dropout draws included: backward
  // regenerates them from the seeds in the tape). backward() takes dL/d output (the output's
  // shape), *adds* the parameters' gradients into `grads`, and returns the inputs' gradients; of
  // its options it uses num_threads and backend. It reads the module's current weights: call it
  // before changing them (before the optimizer step). Both are const; one MhaParamGrads per thread.
  MhaOutputs forward(const MhaInputs& inputs, const MhaCallOptions& options = {}, MhaTape* tape = nullptr) const;
  // 16-bit modules (config().dtype kBF16 / kF16): inputs of that type; no tape (inference and
  // dropout only). The input type must be the module's dtype, else an mha::Error.
  MhaOutputs forward(const BasicMhaInputs<bfloat16>& inputs, const MhaCallOptions& options = {}) const;
  MhaOutputs forward(const BasicMhaInputs<float16>& inputs, const MhaCallOptions& options = {}) const;
  MhaInputGrads backward(const MhaTape& tape, const View<const float>& grad_output, MhaParamGrads* grads,
                         const MhaCallOptions& options = {}) const;
  MhaParamGrads make_grads() const;
  // Trainable tensors with their gradient buffers in `grads` (grad views empty if null), named
  // as state_dict() with separate projections: q_proj.weight, q_proj.bias, ..., out_proj.bias.
  // Biases the module lacks are not listed.
  std::vector<Parameter> parameters(MhaParamGrads* grads);

  // Incremental decoding (self-attention). x holds the newest positions of each sequence,
  // (B, n, E) (or (n, B, E) when not batch_first), of which the first new_tokens[b] rows of
  // sequence b are real (all n if new_tokens is empty; the output rows past them are zeros).
  // Their keys and values are appended to `cache`, and each attends to its sequence's earlier
  // positions and itself — bottom-right causal, within config().window if set — exactly as a
  // forward over the whole sequence with causal masking would. Prefill: n = prompt length;
  // decoding: n = 1. No dropout is applied; of the options it uses num_threads and backend.
  // Thread safety: one cache per thread.
  MhaOutputs step(const View<const float>& x, KvCache& cache, const std::vector<int64_t>& new_tokens = {},
                 const MhaCallOptions& options = {}) const;
  // 16-bit modules: x of the module's dtype; the cache may store any CacheType.
  MhaOutputs step(const View<const bfloat16>& x, KvCache& cache, const std::vector<int64_t>& new_tokens = {},
                  const MhaCallOptions& options = {}) const;
  MhaOutputs step(const View<const float16>& x, KvCache& cache, const std::vector<int64_t>& new_tokens = {},
                  const MhaCallOptions& options = {}) const;
  // A cache for this module's kv heads and head dims, with config().window, storing keys and
  // values as `dtype` (see KvCacheConfig::dtype) whatever the module's.
  KvCache make_cache(int64_t batch, int64_t capacity = 0, CacheType dtype = CacheType::kF32) const;

  const MultiHeadAttentionConfig& config() const { return config_; }
  int64_t head_dim_qk() const { return config_.qk_proj_dim / config_.num_heads; }
  int64_t head_dim_v() const { return config_.v_proj_dim / config_.num_heads; }
  int64_t output_dim() const { return config_.out_proj ? config_.out_dim : config_.v_proj_dim; }

  // Parameters, PyTorch layout: weight (out, in), bias (out). Bias views are empty (rank 0)
  // for a projection without bias. weight() is for float32 modules (an mha::Error otherwise:
  // read a 16-bit module's weights through state_dict()); bias() serves every module.
  enum Proj { kQ = 0, kK = 1, kV = 2, kOut = 3 };
  View<float> weight(Proj p);
  View<const float> weight(Proj p) const;
  View<float> bias(Proj p);
  View<const float> bias(Proj p) const;
  bool has_bias(Proj p) const {
    check_proj(p);
    return has_bias_[p];
  }
  // The sink logits (Hq) and the QK-norm weights (head_dim_qk) as float32 views; an mha::Error
  // for a module without them. ALiBi slopes are fixed: alibi_slopes() reads them.
  View<float> sinks();
  View<float> q_norm_weight();
  View<float> k_norm_weight();
  View<const float> alibi_slopes() const;

 private:
  struct Dims {
    int64_t rows[4];  // output rows of q, k, v, out
    int64_t cols[4];  // input widths of q, k, v, out
  };
  Dims dims() const;
  void check_proj(Proj p) const;  // an mha::Error unless p is kQ, kK, kV or kOut
  // The weight matrix of p in the module's dtype, (rows[p], cols[p]) row-major.
  void* weight_data(Proj p);
  const void* weight_data(Proj p) const;
  // y (rows × out, row stride ldy) = x (rows × in, contiguous) · Wᵀ + b of projection p, on the
  // module's backend. x's type is the module's dtype (float32 rows for float32 and float16
  // modules; bfloat16 rows for bfloat16 modules, see modules::InputRows).
  void project(Proj p, const void* x, int64_t rows, float* y, int64_t ldy, const MhaCallOptions& options) const;
  // Rows of [q | k | v] = x · [Wq; Wk; Wv]ᵀ + [bq; bk; bv]: self-attention's one GEMM.
  void project_qkv(const void* x, int64_t rows, float* qkv, const MhaCallOptions& options) const;
  // y = x · Wᵀ + b for a weight matrix at `w` (rows × cols, in the module's dtype).
  void linear_rows(const void* w, int64_t w_rows, int64_t w_cols, const float* b, const void* x, int64_t rows, float* y,
                   int64_t ldy, const MhaCallOptions& options) const;
  template <typename T>
  MhaOutputs forward_impl(const BasicMhaInputs<T>& inputs, const MhaCallOptions& options, MhaTape* tape) const;
  template <typename T>
  MhaOutputs step_impl(const View<const T>& x, KvCache& cache, const std::vector<int64_t>& new_tokens,
                       const MhaCallOptions& options) const;
  void check_dtype(DType input, const char* where) const;
  // QK-norm then rotary embeddings of q (B, Hq, Tq, D) and k (B, Hkv, Tk, D) into q_out and k_out
  // (which may be q and k; without QK-norm they must be); row t of batch b sits at position
  // q_first[b] + t (k_first for keys).
  void transform_qk(const View<float>& q, const View<float>& k, const View<float>& q_out, const View<float>& k_out,
                    const std::vector<int64_t>& q_first, const std::vector<int64_t>& k_first, int num_threads) const;
  // The module's ALiBi slopes and sinks into attention inputs.
  void score_inputs(AttentionInputs& in) const;
  // (B, T, output_dim()) or (T, B, output_dim()).
  std::vector<int64_t> output_shape(int64_t B, int64_t T) const;
  bool packed() const { return config_.kdim == config_.embed_dim && config_.vdim == config_.embed_dim; }

  MultiHeadAttentionConfig config_;
  // q, k and v weights back to back: exactly the packed (Rq + Rk + Rv, E) matrix when
  // kdim == vdim == E, else three matrices of their own widths.
  Tensor in_weight_;
  Tensor in_bias_;   // (Rq + Rk + Rv); zeros where a projection has no bias
  Tensor out_weight_, out_bias_;
  Tensor alibi_slopes_;      // (Hq) if config().alibi
  Tensor sinks_;             // (Hq) if config().sinks
  Tensor q_norm_, k_norm_;   // (head_dim_qk) if config().qk_norm
  bool has_bias_[4] = {false, false, false, false};
  uint64_t seed_ = 0;
  mutable std::atomic<uint64_t> calls_{0};
};

// Fills a config's zero (= default) fields from the others; throws mha::Error naming the field
// when dims are inconsistent (not positive, heads not dividing widths, ...).
MultiHeadAttentionConfig resolve_config(const MultiHeadAttentionConfig& config);

}  // namespace mha

#endif  // MHA_MULTI_HEAD_ATTENTION_H_
