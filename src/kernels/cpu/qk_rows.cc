// The row kernels of qk_rows.h, per SIMD target. Hand-written for the reason positional.h gives;
// compiled per target because the library's baseline is plain x86-64, where these loops ran one
// float at a time (~3 ns per element in RMSNorm's backward, a quarter of the cost of QK-norm and
// rotary in a training step).
//
// Sums (mean(x²), RMSNorm's backward dot product) run in one vector of lanes, then across the
// lanes: relative error ≲ (D/N + log₂N)·u for N lanes, as torch's float32 RMSNorm.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/qk_rows.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cmath>

#include "hwy/highway.h"
#include "kernels/cpu/qk_rows.h"

HWY_BEFORE_NAMESPACE();
namespace mha::kernels::HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// 1 / sqrt(mean(x²) + eps) of D floats (the mean and the root in double).
float InvRms(DF d, const float* HWY_RESTRICT x, int64_t D, float eps) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  auto acc = hn::Zero(d);
  int64_t i = 0;
  for (; i + N <= D; i += N) {
    const auto v = hn::LoadU(d, x + i);
    acc = hn::MulAdd(v, v, acc);
  }
  float sum = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; i < D; ++i) sum += x[i] * x[i];
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(sum) / static_cast<double>(D) + eps));
}

// Rotates the first 2·r.pairs floats of row in place.
void Rotate(DF d, float* HWY_RESTRICT row, const RowRotation& r) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), half = r.pairs;
  const float* HWY_RESTRICT c = r.cos;
  const float* HWY_RESTRICT s = r.sin;
  int64_t i = 0;
  if (!r.interleaved) {
    float* HWY_RESTRICT a = row;
    float* HWY_RESTRICT z = row + half;
    for (; i + N <= half; i += N) {
      const auto xa = hn::LoadU(d, a + i), xz = hn::LoadU(d, z + i);
      const auto ci = hn::LoadU(d, c + i), si = hn::LoadU(d, s + i);
      hn::StoreU(hn::NegMulAdd(xz, si, hn::Mul(xa, ci)), d, a + i);  // xa·c − xz·s
      hn::StoreU(hn::MulAdd(xa, si, hn::Mul(xz, ci)), d, z + i);     // xa·s + xz·c
    }
    for (; i < half; ++i) {
      const float xa = a[i], xz = z[i];
      a[i] = xa * c[i] - xz * s[i];
      z[i] = xa * s[i] + xz * c[i];
    }
    return;
  }
#if HWY_TARGET != HWY_SCALAR
  for (; i + N <= 2 * half; i += N) {  // N is even: no pair straddles two vectors
    const auto x = hn::LoadU(d, row + i);
    hn::StoreU(hn::MulAdd(hn::Reverse2(d, x), hn::LoadU(d, s + i), hn::Mul(x, hn::LoadU(d, c + i))), d, row + i);
  }
#endif
  for (; i < 2 * half; i += 2) {
    const float xa = row[i], xz = row[i + 1];
    row[i] = xa * c[i] + xz * s[i];
    row[i + 1] = xz * c[i + 1] + xa * s[i + 1];
  }
}

}  // namespace

void QkRowsForward(const float* in, int64_t in_stride, float* out, int64_t out_stride, int64_t rows, int64_t D,
                   const float* w, float eps, const RowRotation& r) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t row = 0; row < rows; ++row) {
    const float* x = in + row * in_stride;
    float* y = out + row * out_stride;
    if (w) {
      const float inv = InvRms(d, x, D, eps);
      const auto vinv = hn::Set(d, inv);
      int64_t i = 0;
      for (; i + N <= D; i += N) hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, x + i), vinv), hn::LoadU(d, w + i)), d, y + i);
      for (; i < D; ++i) y[i] = x[i] * inv * w[i];
    } else if (y != x) {
      for (int64_t i = 0; i < D; ++i) y[i] = x[i];
    }
    if (r.pairs > 0) Rotate(d, y, r);
  }
}

// With x̂ = x·inv, y = x̂ ⊙ w and u = g ⊙ w: dL/dx = inv·(u − x̂·mean(u ⊙ x̂)), dL/dw += g ⊙ x̂.
void QkRowsBackward(const float* x, int64_t x_stride, float* g, int64_t g_stride, int64_t rows, int64_t D,
                    const float* w, float eps, const RowRotation& r, float* dw) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t row = 0; row < rows; ++row) {
    float* HWY_RESTRICT gr = g + row * g_stride;
    if (r.pairs > 0) Rotate(d, gr, r);
    if (!w) continue;
    const float* HWY_RESTRICT xr = x + row * x_stride;
    const float inv = InvRms(d, xr, D, eps);
    const auto vinv = hn::Set(d, inv);
    auto dot = hn::Zero(d);
    int64_t i = 0;
    for (; i + N <= D; i += N) {
      const auto xh = hn::Mul(hn::LoadU(d, xr + i), vinv), gi = hn::LoadU(d, gr + i);
      hn::StoreU(hn::MulAdd(gi, xh, hn::LoadU(d, dw + i)), d, dw + i);
      dot = hn::MulAdd(hn::Mul(gi, hn::LoadU(d, w + i)), xh, dot);
    }
    float sum = hn::GetLane(hn::SumOfLanes(d, dot));
    for (int64_t j = i; j < D; ++j) {
      const float xh = xr[j] * inv;
      dw[j] += gr[j] * xh;
      sum += gr[j] * w[j] * xh;
    }
    const float mean = sum / static_cast<float>(D);
    const auto vmean = hn::Set(d, mean);
    for (i = 0; i + N <= D; i += N) {
      const auto xh = hn::Mul(hn::LoadU(d, xr + i), vinv);
      const auto u = hn::Mul(hn::LoadU(d, gr + i), hn::LoadU(d, w + i));
      hn::StoreU(hn::Mul(vinv, hn::NegMulAdd(xh, vmean, u)), d, gr + i);
    }
    for (; i < D; ++i) gr[i] = inv * (gr[i] * w[i] - xr[i] * inv * mean);
  }
}

}  // namespace mha::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::kernels {

HWY_EXPORT(QkRowsForward);
HWY_EXPORT(QkRowsBackward);

void qk_rows_forward(const float* in, int64_t in_stride, float* out, int64_t out_stride, int64_t rows, int64_t D,
                     const float* w, float eps, const RowRotation& r) {
  HWY_DYNAMIC_DISPATCH(QkRowsForward)(in, in_stride, out, out_stride, rows, D, w, eps, r);
}

void qk_rows_backward(const float* x, int64_t x_stride, float* g, int64_t g_stride, int64_t rows, int64_t D,
                      const float* w, float eps, const RowRotation& r, float* dw) {
  HWY_DYNAMIC_DISPATCH(QkRowsBackward)(x, x_stride, g, g_stride, rows, D, w, eps, r, dw);
}

}  // namespace mha::kernels
#endif  // HWY_ONCE
