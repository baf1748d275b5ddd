// attention(): argument checks, then kernel choice and the split over threads.
#include "mha/attention.h"

#include <cmath>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/cpu/flash.h"
#include "kernels/ref/attention_ref.h"
#include "kernels/workspace.h"
#include "ops/attention_internal.h"
#include "ops/attention_checks.h"
#include "ops/rows.h"
#include "util/check.h"
#include "util/convert.h"
#include "util/parallel.h"

namespace mha {

namespace {

// Keys and values of many rows whose rows are not adjacent in memory — (B, T, H, D) projections
// viewed as (B, H, T, D), as transformers and the module pass them: rows of one head lie H·D
// elements apart, a 4 KiB page holds a few rows of a head — cost the flash forward, which
// streams every key of a (batch, kv head) once per query tile, TLB misses and prefetches the
// hardware prefetcher does not make (the kernel's software prefetches recover only part of it:
// (1, 12/4 heads, 8192, 64) causal ran 1.2× slower than on contiguous heads). They are gathered
// head-major into this thread's Workspace first: O(S·D) copies against O(T·S·D) work, and the
// kernel's arithmetic does not depend on strides, so the bits are those of the strided call.
// Not for short keys (nothing to win), nor above kGatherMaxBytes (the copy's memory).
constexpr int64_t kGatherMinKeys = 1024;
constexpr int64_t kGatherMaxBytes = int64_t{64} << 20;

bool rows_apart(const kernels::Strides4& s, int64_t width) { return s[3] == 1 && s[2] != width; }

// Rows [0, S) × W elements of every (b, h) plane of src (element strides s; elements of 2 or 4
// bytes, copied as such) into dst, head-major and contiguous: plane (b, h) at (b·H + h)·S·W.
template <typename Bits>
void gather_planes(const void* src, const kernels::Strides4& s, int64_t B, int64_t H, int64_t S, int64_t W, void* dst,
                   int num_threads) {
  parallel_for(B * H, num_threads, [&](int64_t bh) {  // element offsets fit: the views were checked
    ops::gather_rows(static_cast<const Bits*>(src) + (bh / H) * s[0] + (bh % H) * s[1], s[2], s[3], S, W,
                     static_cast<Bits*>(dst) + bh * S * W);
  });
}

// p with its keys and values gathered head-major where that pays (see above); p itself otherwise.
kernels::AttentionParams with_gathered_kv(const kernels::AttentionParams& p, int num_threads) {
  if (p.block_tables || p.k_scales || p.v_scales || p.kv_len < kGatherMinKeys ||
      !(rows_apart(p.k_stride, p.head_dim_qk) || rows_apart(p.v_stride, p.head_dim_v)))
    return p;
  const int64_t es = static_cast<int64_t>(dtype_size(p.dtype));
  const int64_t rows = checked_mul(p.batch * p.kv_heads, p.kv_len, "attention: gathered keys");
  const int64_t kn = checked_mul(rows, p.head_dim_qk, "attention: gathered keys");
  const int64_t vn = checked_mul(rows, p.head_dim_v, "attention: gathered values");
  if (kn > kGatherMaxBytes / es || vn > kGatherMaxBytes / es - kn) return p;
  auto& ws = kernels::Workspace::local();
  char* kd = ws.get<char>(kernels::Workspace::kGatherKey, static_cast<size_t>(kn * es));
  char* vd = ws.get<char>(kernels::Workspace::kGatherValue, static_cast<size_t>(vn * es));
  kernels::AttentionParams g = p;
  const int64_t S = p.kv_len, D = p.head_dim_qk, Dv = p.head_dim_v;
  const auto gather = es == 2 ? gather_planes<uint16_t> : gather_planes<uint32_t>;
  gather(p.k, p.k_stride, p.batch, p.kv_heads, S, D, kd, num_threads);
  gather(p.v, p.v_stride, p.batch, p.kv_heads, S, Dv, vd, num_threads);
  g.k = kd;
  g.v = vd;
  g.k_stride = {p.kv_heads * S * D, S * D, D, 1};
  g.v_stride = {p.kv_heads * S * Dv, S * Dv, Dv, 1};
  return g;
}

// The forward's kernel family: reference, decode, or flash (+ the weights pass).
void compute(const kernels::AttentionParams& p, const AttentionOptions& options) {
  if (options.backend == Backend::kReference) {
    // One task per (b, query row); each task computes every head of its row.
    parallel_for(p.batch * p.q_len, options.num_threads, [&](int64_t t) {
      kernels::attention_ref_row<double>(p, t / p.q_len, t % p.q_len);
    });
    return;
  }
  if (kernels::decode_applies(p)) {  // few query rows against many keys: bound by reading K/V
    kernels::flash_decode(p, options.num_threads);
    return;
  }
  // The weights pass needs every row's final log-sum-exp: O(B·Hq·Tq) floats.
  std::vector<float> row_lse(p.weights ? static_cast<size_t>(p.batch * p.q_heads * p.q_len) : 0);
  const kernels::AttentionParams g = with_gathered_kv(p, options.num_threads);
  kernels::flash_forward(g, g.weights ? row_lse.data() : nullptr, options.num_threads);
  if (g.weights) kernels::flash_weights(g, row_lse.data(), options.num_threads);
}

// dst = src rounded to T, both (B, Hq, Tq, Tk) or (B, Tq, Tk); src contiguous.
template <typename T>
void round_weights(const Tensor& src, const View<T>& dst, int num_threads) {
  const float* w = src.data<float>();
  const int64_t rows = dst.shape[0] * dst.shape[1] * (dst.rank == 4 ? dst.shape[2] : 1);
  const int64_t cols = dst.shape[dst.rank - 1];
  const int64_t inner = dst.rank == 4 ? dst.shape[2] : 1;
  parallel_for(rows, num_threads, [&](int64_t r) {
    const int64_t a = r / (dst.shape[1] * inner), b = r / inner % dst.shape[1], c = r % inner;
    T* row = dst.data + a * dst.stride[0] + b * dst.stride[1] + (dst.rank == 4 ? c * dst.stride[2] : 0);
    const int64_t cs = dst.stride[dst.rank - 1];
    if (cs == 1) {
      narrow_from_f32(w + r * cols, DTypeOf<T>::value, row, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j) kernels::store_element(row, j * cs, w[r * cols + j], DTypeOf<T>::value);
    }
  });
}

template <typename T>
void run_attention(const BasicAttentionInputs<T>& in, const BasicAttentionOutputs<T>& out,
                   const AttentionOptions& options, const int64_t* causal_offset) {
  kernels::AttentionParams p = ops::make_attention_params(in, out, options);
  p.causal_offset = causal_offset;
  if (p.no_work) return;
  // 16-bit weights: the kernels write float32 weights here, rounded once into out.weights.
  Tensor weights32;
  if (!std::is_same_v<T, float> && out.weights.given()) {
    const auto& w = out.weights;
    weights32 = Tensor(DType::kF32, std::vector<int64_t>(w.shape.begin(), w.shape.begin() + w.rank));
    const View<float> v = weights32.view<float>();
    p.weights = v.data;
    p.weights_stride = p.weights_averaged ? kernels::Strides4{v.stride[0], 0, v.stride[1], v.stride[2]}
                                          : kernels::Strides4{v.stride[0], v.stride[1], v.stride[2], v.stride[3]};
  }
  compute(p, options);
  if (weights32.defined()) round_weights(weights32, out.weights, options.num_threads);
}

template <typename T>
void checked_run(const BasicAttentionInputs<T>& in, const BasicAttentionOutputs<T>& out,
                 const AttentionOptions& options, const int64_t* causal_offset) {
  try {
    run_attention(in, out, options, causal_offset);
  } catch (const std::bad_alloc&) {
    // Scratch memory (per thread, O(rows · (D + Dv + key block))) or the LSE buffer.
    throw Error("attention: out of memory for scratch buffers (query " + shape_string(in.query) + ")");
  }
}

}  // namespace

void attention(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options) {
  checked_run(in, out, options, nullptr);
}
void attention(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
               const AttentionOptions& options) {
  checked_run(in, out, options, nullptr);
}
void attention(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
               const AttentionOptions& options) {
  checked_run(in, out, options, nullptr);
}

namespace ops {

namespace {
template <typename T>
void with_offsets(const BasicAttentionInputs<T>& in, const BasicAttentionOutputs<T>& out, const AttentionOptions& options,
                  const int64_t* causal_offset) {
  if (options.causal == Causal::kNone) throw Error("attention: causal offsets need causal masking");
  checked_run(in, out, options, causal_offset);
}
}  // namespace

void attention_with_offsets(const AttentionInputs& in, const AttentionOutputs& out, const AttentionOptions& options,
                            const int64_t* causal_offset) {
  with_offsets(in, out, options, causal_offset);
}
void attention_with_offsets(const BasicAttentionInputs<bfloat16>& in, const BasicAttentionOutputs<bfloat16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset) {
  with_offsets(in, out, options, causal_offset);
}
void attention_with_offsets(const BasicAttentionInputs<float16>& in, const BasicAttentionOutputs<float16>& out,
                            const AttentionOptions& options, const int64_t* causal_offset) {
  with_offsets(in, out, options, causal_offset);
}

}  // namespace ops

}  // namespace mha
