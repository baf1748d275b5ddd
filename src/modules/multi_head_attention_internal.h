// Pieces shared by the MultiHeadAttention sources (multi_head_attention.cc: weights and
// forward; multi_head_attention_backward.cc: training; multi_head_attention_step.cc: decoding).
// Not public API.
#ifndef MHA_MODULES_MULTI_HEAD_ATTENTION_INTERNAL_H_
#define MHA_MODULES_MULTI_HEAD_ATTENTION_INTERNAL_H_

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/dropout.h"
#include "kernels/workspace.h"
#include "mha/multi_head_attention.h"
#include "util/convert.h"
#include "util/random.h"

namespace mha {
namespace modules {

// Rows of the q, k and v projection weights: Hq heads of qk_proj_dim/Hq, Hkv heads of the same, and
// Hkv heads of v_proj_dim/Hq.
inline std::array<int64_t, 3> qkv_rows(const MultiHeadAttentionConfig& c) {
  const int64_t group = c.num_heads / c.num_kv_heads;
  return {c.qk_proj_dim, c.qk_proj_dim / group, c.v_proj_dim / group};
}

// A row matrix of B*T rows holding a (B, T, E) or (T, B, E) sequence.
struct Layout {
  int64_t B, T;
  bool batch_first;
  // Strides (in rows) of batch and time.
  int64_t batch_rows() const { return batch_first ? T : 1; }
  int64_t time_rows() const { return batch_first ? 1 : B; }
};

// A (B, H, T, D) view of H heads of D floats at `base` inside a row matrix whose rows have
// `width` floats.
inline View<float> heads_view(float* base, const Layout& l, int64_t width, int64_t H, int64_t D) {
  return View<float>(base, {l.B, H, l.T, D}, {l.batch_rows() * width, D, l.time_rows() * width, 1});
}

struct QkvHeads {
  View<float> q, k, v;
};

// Head views of the q, k and v projections of a module with config c: in one packed buffer of
// rows [q | k | v] when k and v are null, else in three buffers of their own widths. Projection
// outputs and their gradients share these layouts.
inline QkvHeads qkv_heads(const MultiHeadAttentionConfig& c, float* q, float* k, float* v, const Layout& lq,
                          const Layout& lk) {
  const std::array<int64_t, 3> rows = qkv_rows(c);
  const int64_t dqk = c.qk_proj_dim / c.num_heads, dv = c.v_proj_dim / c.num_heads;
  if (k == nullptr) {
    const int64_t width = rows[0] + rows[1] + rows[2];
    return {heads_view(q, lq, width, c.num_heads, dqk), heads_view(q + rows[0], lk, width, c.num_kv_heads, dqk),
            heads_view(q + rows[0] + rows[1], lk, width, c.num_kv_heads, dv)};
  }
  return {heads_view(q, lq, rows[0], c.num_heads, dqk), heads_view(k, lk, rows[1], c.num_kv_heads, dqk),
          heads_view(v, lk, rows[2], c.num_kv_heads, dv)};
}

// Rows of a (B, T, E) or (T, B, E) input, contiguous (copied if the view is not), in what the
// module's projections read: float32 rows for float32 and float16 modules (float16 widened),
// bfloat16 rows for bfloat16 modules.
struct InputRows {
  const void* data = nullptr;
  Tensor holder;  // the copy, when one was needed
};
inline InputRows input_rows(const View<const float>& v) {
  if (v.is_contiguous()) return {v.data, Tensor()};
  InputRows r{nullptr, to_tensor(v)};
  r.data = r.holder.raw();
  return r;
}
inline InputRows input_rows(const View<const bfloat16>& v) {
  if (v.is_contiguous()) return {v.data, Tensor()};
  InputRows r{nullptr, to_tensor(v)};
  r.data = r.holder.raw();
  return r;
}
inline InputRows input_rows(const View<const float16>& v) {
  InputRows r;
  if (v.is_contiguous()) {
    r.holder = Tensor(DType::kF32, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.rank));
    widen_to_f32(v.data, DType::kF16, r.holder.data<float>(), v.numel());
  } else {
    r.holder = to_tensor(v).to_f32();
  }
  r.data = r.holder.raw();
  return r;
}

inline uint64_t derive_seed(uint64_t seed, uint64_t stream) { return splitmix64(seed ^ splitmix64(stream)); }

// Output dropout on `rows` rows of `width` floats, in place: the decision for element (n, o) is
// Philox(seed) at (0, 0, n, o), so the backward applies the same mask to the gradient.
inline void apply_output_dropout(float p, uint64_t seed, float* y, int64_t rows, int64_t width) {
  const kernels::Dropout drop(p, seed);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t o = 0; o < width; ++o) y[n * width + o] = drop.keep(0, 0, n, o) ? y[n * width + o] * drop.scale() : 0.0f;
}

template <typename T>
View<const T> view_or_empty(const Tensor& t) {
  return t.defined() ? t.view<T>() : View<const T>();
}

// q and k after QK-norm and rotary in a training step, where the projections must stay as they
// were (QK-norm's backward reads them): rows laid out as the projections' (token-major; the
// transform writes each token's heads contiguously), in this thread's kernels::Workspace. The
// forward fills them for its attention call and the backward recomputes them for its own (one
// more pass over q and k, ~1.4 ms at gpt2-512 on 2 threads) — fresh buffers kept in the tape cost
// more: 2 × 6 MiB of new pages per step, ~7 ms of page faults. Released at the end of a call when
// they hold more than Workspace::kKeepBytes.
class NormalizedQk {
 public:
  NormalizedQk(const Layout& lq, const Layout& lk, int64_t Hq, int64_t Hk, int64_t D) {
    auto& ws = kernels::Workspace::local();
    q = heads_view(ws.get<float>(kernels::Workspace::kModuleNormedQuery, static_cast<size_t>(lq.B * lq.T * Hq * D)), lq,
                   Hq * D, Hq, D);
    k = heads_view(ws.get<float>(kernels::Workspace::kModuleNormedKey, static_cast<size_t>(lk.B * lk.T * Hk * D)), lk,
                   Hk * D, Hk, D);
  }
  NormalizedQk(const NormalizedQk&) = delete;
  NormalizedQk& operator=(const NormalizedQk&) = delete;
  ~NormalizedQk() {
    kernels::Workspace::local().trim(kernels::Workspace::kModuleNormedQuery, kernels::Workspace::kModuleNormedKey);
  }

  View<float> q, k;
};

}  // namespace modules

// Everything backward() reads, owned (the caller's buffers may change after forward returns).
struct MhaTape::State {
  const MultiHeadAttention* module = nullptr;
  int64_t B = 0, Tq = 0, Tk = 0;
  bool self = false;
  std::vector<int64_t> query_shape, key_shape, value_shape, output_shape;
  Tensor xq, xk, xv;        // input rows (xk, xv only when not self-attention)
  Tensor qkv, kbuf, vbuf;   // projections: packed [q | k | v] rows (self), or q, k, v apart
  Tensor merged;            // attention output, heads merged, before out_proj and dropout
  Tensor lse;               // (B, Hq, Tq)
  Tensor keep, bias, lengths;
  AttentionOptions options;  // causal, window, dropout of the attention
  std::vector<int64_t> q_first;  // rotary: query positions start here per batch (keys at 0)
  uint64_t out_dropout_seed = 0;
  float out_dropout = 0.0f;
};

}  // namespace mha

#endif  // MHA_MODULES_MULTI_HEAD_ATTENTION_INTERNAL_H_
