// linear_rows16 (linear_rows.h), per SIMD target. Hand-written because the two libraries that
// multiply here cannot read a float16 weight (sgemm: float32 only) or, on CPUs without AVX-512,
// a bfloat16 one (Debian's oneDNN 2.6 has no bf16 matmul there): without it each decode step
// widened the whole weight. A few rows against a weight read once is a matrix-vector product,
// bound by the weight's bytes; the kernel widens each vector of weights in registers.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/linear_rows.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>

#include "hwy/highway.h"
#include "kernels/cpu/linear_rows.h"
#include "mha/half.h"
#include "util/check.h"
#include "util/convert-inl.h"
#include "util/convert.h"
#include "util/parallel.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

constexpr int64_t kWeightRows = 4;   // weight rows per pass: 4 accumulators per row of x
constexpr int64_t kRowsPerPass = 2;  // rows of x per pass: 8 accumulators (16 registers on AVX2)
constexpr int64_t kTaskOutputs = 64;

// Outputs [n0, n0 + nw) (nw ≤ kWeightRows) of MR rows of x from row m0.
template <size_t MR, typename TX, typename TW>
HWY_INLINE void Pass(DF d, const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t n0, int64_t nw, int64_t K,
                     const float* bias, float* y, int64_t ldy) {
  using V = hn::Vec<DF>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  // Rows past nw repeat the last one (computed, not stored): every pass has kWeightRows loads.
  const TW* wr[kWeightRows];
  for (int64_t i = 0; i < kWeightRows; ++i) wr[i] = w + (n0 + std::min(i, nw - 1)) * ldw;
  V acc[MR][kWeightRows];
  for (size_t m = 0; m < MR; ++m)
    for (int64_t i = 0; i < kWeightRows; ++i) acc[m][i] = hn::Zero(d);
  int64_t k = 0;
  for (; k + N <= K; k += N) {
    V xv[MR];
    for (size_t m = 0; m < MR; ++m) xv[m] = LoadAsFloat(d, x + static_cast<int64_t>(m) * ldx + k);
    for (int64_t i = 0; i < kWeightRows; ++i) {
      const V wv = LoadAsFloat(d, wr[i] + k);
      for (size_t m = 0; m < MR; ++m) acc[m][i] = hn::MulAdd(xv[m], wv, acc[m][i]);
    }
  }
  if (k < K) {
    const size_t tail = static_cast<size_t>(K - k);
    V xv[MR];
    for (size_t m = 0; m < MR; ++m) xv[m] = LoadTailAsFloat(d, x + static_cast<int64_t>(m) * ldx + k, tail);
    for (int64_t i = 0; i < kWeightRows; ++i) {
      const V wv = LoadTailAsFloat(d, wr[i] + k, tail);
      for (size_t m = 0; m < MR; ++m) acc[m][i] = hn::MulAdd(xv[m], wv, acc[m][i]);
    }
  }
  for (size_t m = 0; m < MR; ++m)
    for (int64_t i = 0; i < nw; ++i) {
      const float sum = hn::GetLane(hn::SumOfLanes(d, acc[m][i]));
      y[static_cast<int64_t>(m) * ldy + n0 + i] = sum + (bias ? bias[n0 + i] : 0.0f);
    }
}

template <typename TX, typename TW>
void Rows(const TX* x, int64_t ldx, int64_t M, const TW* w, int64_t ldw, int64_t N, int64_t K, const float* bias,
          float* y, int64_t ldy, int num_threads) {
  const DF d;
  parallel_for((N + kTaskOutputs - 1) / kTaskOutputs, num_threads, [&](int64_t t) {
    const int64_t end = std::min(N, (t + 1) * kTaskOutputs);
    for (int64_t n0 = t * kTaskOutputs; n0 < end; n0 += kWeightRows) {
      const int64_t nw = std::min(kWeightRows, end - n0);
      // The weight rows of this pass stay in L1 for the next rows of x.
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
        const TX* xm = x + m0 * ldx;
        float* ym = y + m0 * ldy;
        if (M - m0 >= kRowsPerPass) {
          Pass<kRowsPerPass>(d, xm, ldx, w, ldw, n0, nw, K, bias, ym, ldy);
        } else {
          Pass<1>(d, xm, ldx, w, ldw, n0, nw, K, bias, ym, ldy);
        }
      }
    }
  });
}

void LinearRows16(const void* x, DType x_type, int64_t ldx, int64_t M, const void* w, DType w_type, int64_t ldw,
                  int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, int num_threads) {
  const auto* wb = static_cast<const bfloat16*>(w);
  const auto* wh = static_cast<const float16*>(w);
  if (x_type == DType::kBF16) {
    const auto* xb = static_cast<const bfloat16*>(x);
    if (w_type == DType::kBF16) return Rows(xb, ldx, M, wb, ldw, N, K, bias, y, ldy, num_threads);
    return Rows(xb, ldx, M, wh, ldw, N, K, bias, y, ldy, num_threads);
  }
  const auto* xf = static_cast<const float*>(x);
  if (w_type == DType::kBF16) return Rows(xf, ldx, M, wb, ldw, N, K, bias, y, ldy, num_threads);
  return Rows(xf, ldx, M, wh, ldw, N, K, bias, y, ldy, num_threads);
}

}  // namespace
}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {

HWY_EXPORT(LinearRows16);

void linear_rows16(const void* x, DType x_type, int64_t ldx, int64_t M, const void* w, DType w_type, int64_t ldw,
                   int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, int num_threads) {
  check_widening_operands("linear_rows16", x_type, w_type);
  MHA_CHECK(M >= 0 && N >= 0 && K >= 0, "linear_rows16: negative size ({} x {}) · ({} x {})ᵀ", M, K, N, K);
  if (M == 0 || N == 0) return;
  HWY_DYNAMIC_DISPATCH(LinearRows16)(x, x_type, ldx, M, w, w_type, ldw, N, K, bias, y, ldy, num_threads);
}

}  // namespace mha::kernels
#endif  // HWY_ONCE
