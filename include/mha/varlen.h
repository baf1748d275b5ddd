// Attention over packed sequences of different lengths, without padding: FlashAttention's
// "varlen" layout (flash_attn_varlen_func). S sequences are concatenated along the token axis;
// cu_seqlens_q / cu_seqlens_k (S + 1 cumulative offsets, starting at 0) say where each begins.
// Sequence s attends only within itself: its queries query[cu_q[s] .. cu_q[s+1]) to its keys
// key[cu_k[s] .. cu_k[s+1]), exactly as attention() on that sequence alone (B = 1), with every
// option of AttentionOptions; causal masking aligns per sequence (kBottomRight is
// FlashAttention's causal=True). A sequence with no keys gives zeros (LSE −inf); one with no
// queries is skipped.
//
// Dropout: sequence s draws its mask as attention() does with dropout_seed =
// varlen_dropout_seed(options.dropout_seed, s), so sequences get independent masks and the
// backward regenerates them.
#ifndef MHA_VARLEN_H_
#define MHA_VARLEN_H_

#include <cstdint>

#include "mha/attention.h"

namespace mha {

template <typename T>
struct BasicVarlenInputs {
  View<const T> query;               // (total_q, Hq, Dqk)
  View<const T> key;                 // (total_k, Hkv, Dqk), Hq a multiple of Hkv
  View<const T> value;               // (total_k, Hkv, Dv)
  View<const int64_t> cu_seqlens_q;  // (S + 1,): 0 = c[0] <= c[1] <= ... <= c[S] = total_q
  View<const int64_t> cu_seqlens_k;  // (S + 1,): the same for the keys, ending at total_k
  View<const float> alibi_slopes;    // optional (Hq,) or (S, Hq): ALiBi per sequence (mha/attention.h);
                                     // options.softcap applies as in attention()
};

template <typename T>
struct BasicVarlenGrads {
  View<T> grad_query;  // (total_q, Hq, Dqk)
  View<T> grad_key;    // (total_k, Hkv, Dqk)
  View<T> grad_value;  // (total_k, Hkv, Dv)
};

// out (total_q, Hq, Dv); lse optional, (Hq, total_q) as FlashAttention returns it. Every
// inconsistency (ranks, heads, head dims, offsets not starting at 0, decreasing or not ending at
// the totals) is an mha::Error naming the argument. One overload per element type.
void varlen_attention(const BasicVarlenInputs<float>& in, const View<float>& out, const View<float>& lse = {},
                      const AttentionOptions& options = {});
void varlen_attention(const BasicVarlenInputs<bfloat16>& in, const View<bfloat16>& out, const View<float>& lse = {},
                      const AttentionOptions& options = {});
void varlen_attention(const BasicVarlenInputs<float16>& in, const View<float16>& out, const View<float>& lse = {},
                      const AttentionOptions& options = {});

// The backward: in and options as given to the forward, its out and lse (required here), and
// grad_out = dL/d out. Each sequence's gradients are attention_backward()'s on it alone.
void varlen_attention_backward(const BasicVarlenInputs<float>& in, const View<const float>& out,
                               const View<const float>& lse, const View<const float>& grad_out,
                               const BasicVarlenGrads<float>& grads, const AttentionOptions& options = {});
void varlen_attention_backward(const BasicVarlenInputs<bfloat16>& in, const View<const bfloat16>& out,
                               const View<const float>& lse, const View<const bfloat16>& grad_out,
                               const BasicVarlenGrads<bfloat16>& grads, const AttentionOptions& options = {});
void varlen_attention_backward(const BasicVarlenInputs<float16>& in, const View<const float16>& out,
                               const View<const float>& lse, const View<const float16>& grad_out,
                               const BasicVarlenGrads<float16>& grads, const AttentionOptions& options = {});

// The dropout seed sequence s of a varlen call uses.
inline uint64_t varlen_dropout_seed(uint64_t seed, int64_t s) {
  return seed + static_cast<uint64_t>(s) * 0x9E3779B97F4A7C15ULL;
}

}  // namespace mha

#endif  // MHA_VARLEN_H_
