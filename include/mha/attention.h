// Scaled dot-product attention on strided views.
//
//   out[b,h,i,:] = sum_j  drop(P)[b,h,i,j] * value[b, h/G, j, :]
//   P[b,h,i,:]   = softmax_j( scale * <query[b,h,i,:], key[b,h/G,j,:]> + bias[b,h,i,j] )
//                  taken over the keys j that are *visible* (see below)
//
// Shapes (strides are free; nothing is copied or expanded):
//   query (B, Hq, Tq, Dqk)   key (B, Hkv, Tk, Dqk)   value (B, Hkv, Tk, Dv)   out (B, Hq, Tq, Dv)
//   G = Hq / Hkv query heads share one key/value head (grouped-query attention; Hkv = 1 is
//   multi-query). Query head h reads key/value head h / G, as torch's enable_gqa does.
//
// Visibility of key j to query i in batch b — all of these must hold:
//   keep_mask[b,h,i,j] != 0                  (if given; broadcast to (B, Hq, Tq, Tk))
//   j < key_lengths[b]                       (if given; keys past the length are padding)
//   causal kTopLeft:     j <= i              (PyTorch SDPA's is_causal)
//   causal kBottomRight: j <= i + L_b - Tq   (FlashAttention, KV-cache decoding), where
//                        L_b = key_lengths[b] if given, else Tk: the last query sees the last key
//   window W > 0 (needs causal): j > c - W, where c is the causal limit above: each query
//                        sees at most W keys, itself and the W-1 before it — or, with
//                        sink_tokens S > 0, j < S (StreamingLLM's attention sinks: the first
//                        S keys stay visible however far the window has moved; still j <= c)
// The two alignments agree when Tq == Tk and no key_lengths are given.
// The bias is added to the scaled scores; an element with bias -inf is not counted as masked
// but contributes exp(-inf) = 0. A row whose visible set is empty, or whose every visible score
// is -inf, is *fully masked*: its output row is zeros and its LSE is -inf (never NaN). A finite
// bias such as -1e9 on every key is not masking: that row is a uniform average.
// NaN anywhere in a row's visible scores gives a NaN output row: NaN is never hidden.
//
// Score variants of current models (each optional; they compose with everything above):
//   softcap c > 0 (Gemma 2):  the scaled score s = scale·<q, k> becomes c·tanh(s / c), before
//                        the bias, ALiBi and masking are applied (as Gemma 2 and FlashAttention do).
//   alibi_slopes (BLOOM, MPT): adds -slope[b?, h] · |pos_i - j| to the score of key j, where
//                        pos_i is query i's key position: i with causal kTopLeft, else
//                        i + L_b - Tq (bottom-right, as FlashAttention aligns ALiBi; L_b as
//                        above). No (Tq, Tk) bias is materialised. No gradient for the slopes.
//   sinks (gpt-oss):     a logit per query head that joins every row's softmax denominator and
//                        takes no value: P_j = exp(s_j) / (exp(sink_h) + Σ_k exp(s_k)). Rows
//                        then sum to less than 1; a fully masked row still gives zeros, with
//                        LSE = sink_h (the sink is its whole denominator). LSE includes the
//                        sink; weights are the keys' P_j. attention_backward gives its gradient.
//
// Dropout (dropout_p > 0): after the softmax, each P[b,h,i,j] is kept with probability 1-p and
// scaled by 1/(1-p), else zeroed. The decision comes from Philox4x32-10 keyed by dropout_seed
// and indexed by (b, h, i, j) alone, so it does not depend on threads or blocking, and a
// backward pass regenerates it. dropout_p = 1 gives zeros. LSE is of the undropped scores.
//
// Element types: query, key, value, out, weights (and the gradients) share one element type T:
// float, bfloat16 or float16 (mha/half.h); mixing them does not compile. Every type computes in
// float32 — scores, the online softmax, P and P·V accumulate in float32, as PyTorch's CPU
// kernels do for half types — and out and weights are rounded once to T (round to nearest
// even). attn_bias and lse are float32 for every T. float16 results beyond ±65504 become ±inf.
//
// Optional outputs:
//   lse     (B, Hq, Tq): log sum_j exp(score[b,h,i,j]) over visible j (natural log).
//   weights (B, Hq, Tq, Tk) per head, or (B, Tq, Tk) averaged over the Hq heads: the attention
//           probabilities actually applied, dropout included (as PyTorch's MultiheadAttention
//           returns them); zeros where masked.
#ifndef MHA_ATTENTION_H_
#define MHA_ATTENTION_H_

#include <cstdint>
#include <optional>

#include "mha/tensor.h"

namespace mha {

enum class Causal : uint8_t {
  kNone,
  kTopLeft,      // j <= i
  kBottomRight,  // j <= i + L_b - Tq
};

// Which implementation runs: kReference is the plain double-accumulating oracle.
enum class Backend : uint8_t { kAuto, kReference, kFast };

// The most threads a call may ask for; more is an mha::Error.
inline constexpr int kMaxThreads = 256;

template <typename T>
struct BasicAttentionInputs {
  View<const T> query;                // (B, Hq, Tq, Dqk)
  View<const T> key;                  // (B, Hkv, Tk, Dqk)
  View<const T> value;                // (B, Hkv, Tk, Dv)
  View<const uint8_t> keep_mask;      // optional, broadcastable to (B, Hq, Tq, Tk); nonzero = attend
  View<const float> attn_bias;        // optional, broadcastable to (B, Hq, Tq, Tk); added to scores
  // Both masks are read key by key along their last stride: any stride is correct, but keys
  // spaced apart (a permuted bias) cost a cache line each. Python copies such a mask once.
  View<const int64_t> key_lengths;    // optional (B,): 0 <= key_lengths[b] <= Tk
  View<const float> alibi_slopes;     // optional (Hq,) or (B, Hq): finite ALiBi slopes
  View<const float> sinks;            // optional (Hq,): finite sink logits
};

template <typename T>
struct BasicAttentionOutputs {
  View<T> out;          // (B, Hq, Tq, Dv), required
  View<float> lse;      // optional (B, Hq, Tq)
  View<T> weights;      // optional (B, Hq, Tq, Tk) per head or (B, Tq, Tk) averaged over heads
};

using AttentionInputs = BasicAttentionInputs<float>;
using AttentionOutputs = BasicAttentionOutputs<float>;

struct AttentionOptions {
  std::optional<float> scale;  // default 1/sqrt(Dqk)
  Causal causal = Causal::kNone;
  int64_t window = 0;          // 0: no sliding window
  float dropout_p = 0.0f;      // in [0, 1]
  uint64_t dropout_seed = 0;
  int num_threads = 0;         // 0: all available; at most kMaxThreads
  Backend backend = Backend::kAuto;
  float softcap = 0.0f;        // > 0: scores → softcap·tanh(scores / softcap); 0: off
  int64_t sink_tokens = 0;     // with a window: keys j < sink_tokens stay visible (StreamingLLM)
};

// Throws mha::Error naming the argument and shapes on any inconsistency. Outputs must not
// overlap the inputs. One overload per element type (see "Element types" above).
// Memory: O(T·D) scratch per thread, kept for the thread's next call; keys and values of
// >= 1024 rows that are not adjacent in memory (e.g. (B, T, H, D) projections seen as heads)
// are first copied head-major into up to 64 MiB more of the calling thread's scratch, kept
// like the rest (the kernel reads them faster; the result has the same bits).
void attention(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options = {});
void attention(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
               const AttentionOptions& options = {});
void attention(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
               const AttentionOptions& options = {});

// Gradients of a loss with respect to query, key and value (overwritten).
template <typename T>
struct BasicAttentionInputGrads {
  View<T> grad_query;  // (B, Hq, Tq, Dqk)
  View<T> grad_key;    // (B, Hkv, Tk, Dqk): summed over the query heads of each group
  View<T> grad_value;  // (B, Hkv, Tk, Dv)
  View<float> grad_sinks;  // (Hq,): required when inputs.sinks is given, summed over batch and rows
  // Optional, only with inputs.attn_bias and of its shape: dL/d attn_bias, summed over the
  // dimensions the bias broadcasts along (float32 for every element type).
  View<float> grad_attn_bias;
};
using AttentionInputGrads = BasicAttentionInputGrads<float>;

// The backward of attention(): `in` and `options` as given to the forward (the same dropout
// seed regenerates the same dropout mask), its output `out` and `lse`, and grad_out = dL/d out.
// Memory O(T·D) per thread; the same bits for any thread count (no atomics). Masked keys and
// fully masked rows receive zero gradient. Gradients of keep_mask and key_lengths are not
// computed; attn_bias's is when grad_attn_bias is given: the gradient of the score the bias is
// added to, P ⊙ (dP − D) (zero where a key is masked or its score is −inf), summed over the
// bias's broadcast dimensions in double in a fixed order. A bias that broadcasts takes a float32
// (B, Hq, Tq, Tk) buffer for that: the calling thread's scratch, kept, up to 64 MiB, a new
// allocation above (a full-shape bias's gradient is written in place).
// bfloat16/float16: the gradients are accumulated in float32 and rounded once to T.
void attention_backward(const AttentionInputs& in, const View<const float>& out, const View<const float>& lse,
                        const View<const float>& grad_out, const AttentionInputGrads& grads,
                        const AttentionOptions& options = {});
void attention_backward(const BasicAttentionInputs<bfloat16>& in, const View<const bfloat16>& out,
                        const View<const float>& lse, const View<const bfloat16>& grad_out,
                        const BasicAttentionInputGrads<bfloat16>& grads, const AttentionOptions& options = {});
void attention_backward(const BasicAttentionInputs<float16>& in, const View<const float16>& out,
                        const View<const float>& lse, const View<const float16>& grad_out,
                        const BasicAttentionInputGrads<float16>& grads, const AttentionOptions& options = {});

// Merges attention over two disjoint sets of keys for the same queries — the partial results of
// a split of the keys (context-parallel ring attention, a KV cache plus new keys) — into the
// result over their union, in place in (out, lse):
//   l = log(e^lse + e^part_lse),   out ← out·e^(lse − l) + part_out·e^(part_lse − l),   lse ← l,
// per element in double (≤ 1 float ulp beyond the parts' own errors). Any partition of the keys
// merges back to attention over all of them, in any order, to within rounding. A part that saw
// no key (lse = −inf, out = 0: mha's fully masked row) leaves the other unchanged, and two such
// parts stay zeros with −inf. A NaN or +inf LSE in either part makes the row NaN (NaN in, NaN
// out). out, part_out: (B, H, T, Dv) float32, lse, part_lse: (B, H, T), any strides; the
// accumulator must not overlap the part. The same bits for any thread count.
void merge_attention(const View<float>& out, const View<float>& lse, const View<const float>& part_out,
                     const View<const float>& part_lse, int num_threads = 0);

}  // namespace mha

#endif  // MHA_ATTENTION_H_
