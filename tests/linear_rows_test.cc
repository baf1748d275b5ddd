// kernels::linear_rows16, the projection of a few rows by a 16-bit weight read as stored (the
// decode steps of bfloat16 and float16 modules), against a double-precision reference on the
// same (widened) values, on each SIMD target: random shapes with K off the vector width and N
// off the 4-row passes, 1 to kLinearRowsMax rows (pairs and an odd last row), with and without
// a bias. Bound: the products are exact (bfloat16 · bfloat16) or one FMA rounding each, and K
// terms are summed in some order, so |y − y_ref| ≤ (K + 1)·u · Σ_k |x·w| (u = 2^-24) plus the
// bias addition's u·|y|; the test allows that and checks that the thread count leaves the bits.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/flash.h"
#include "kernels/cpu/linear_rows.h"
#include "mha/half.h"
#include "ops/linear.h"
#include "test_util.h"

namespace mha {
namespace {

using test::base_seed;
using test::Rng;

class LinearRows : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { kernels::force_simd_target(GetParam()); }
  void TearDown() override { kernels::force_simd_target(""); }
};

// Random operands of one product: x (M × K, row stride ldx) as float32 and, when x16, as the
// same values in bfloat16; w (N × K, row stride ldw) of type wt, and as float32; a bias. Then
// |y[m][n] − the double product| over its bound (K + 1)·u·Σ_k |x·w| + u·|y|.
struct Operands {
  int64_t M, N, K, ldx, ldw;
  bool x16;
  DType wt;
  std::vector<float> xf, wf, bias;
  std::vector<bfloat16> xb, wb;
  std::vector<float16> wh;

  Operands(Rng& rng, int64_t M_, int64_t N_, int64_t K_, int64_t ldx_, int64_t ldw_, bool x16_, DType wt_)
      : M(M_), N(N_), K(K_), ldx(ldx_), ldw(ldw_), x16(x16_), wt(wt_), xf(static_cast<size_t>(M * ldx)),
        wf(static_cast<size_t>(N * ldw)), bias(static_cast<size_t>(N)), xb(xf.size()), wb(wf.size()), wh(wf.size()) {
    for (size_t i = 0; i < xf.size(); ++i) {
      xb[i] = to_bfloat16(rng.normal());
      xf[i] = x16 ? to_float(xb[i]) : rng.normal();
    }
    for (size_t i = 0; i < wf.size(); ++i) {
      wb[i] = to_bfloat16(rng.normal());
      wh[i] = to_float16(rng.normal());
      wf[i] = wt == DType::kBF16 ? to_float(wb[i]) : to_float(wh[i]);
    }
    for (float& b : bias) b = rng.normal();
  }
  const void* x() const { return x16 ? static_cast<const void*>(xb.data()) : xf.data(); }
  DType x_type() const { return x16 ? DType::kBF16 : DType::kF32; }
  const void* w() const { return wt == DType::kBF16 ? static_cast<const void*>(wb.data()) : wh.data(); }
  double error_over_bound(int64_t m, int64_t n, float got, bool with_bias) const {
    constexpr double u = 1.0 / (1 << 24);
    double want = with_bias ? bias[static_cast<size_t>(n)] : 0.0, mass = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double p = static_cast<double>(xf[static_cast<size_t>(m * ldx + k)]) * wf[static_cast<size_t>(n * ldw + k)];
      want += p;
      mass += std::fabs(p);
    }
    return std::fabs(got - want) / (static_cast<double>(K + 1) * u * mass + u * std::fabs(want) + 1e-30);
  }
};

TEST_P(LinearRows, MatchesTheDoubleProductWithinTheSummationBound) {
  Rng rng(base_seed() + 1101);
  int checked = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const bool x16 = trial % 2 == 0;  // bfloat16 rows (a bfloat16 module) or float32 rows
    const DType wt = x16 || rng.coin() ? DType::kBF16 : DType::kF16;
    const int64_t M = rng.range(1, kernels::kLinearRowsMax), N = rng.range(1, 150), K = rng.range(0, 300);
    const int64_t ldx = K + rng.range(0, 3), ldw = K + rng.range(0, 3), ldy = N + rng.range(0, 3);
    const Operands op(rng, M, N, K, ldx, ldw, x16, wt);
    const bool with_bias = rng.coin();
    const float* bias = with_bias ? op.bias.data() : nullptr;
    std::vector<float> y(static_cast<size_t>(M * ldy), -7.0f), again = y;
    kernels::linear_rows16(op.x(), op.x_type(), ldx, M, op.w(), wt, ldw, N, K, bias, y.data(), ldy, 2);
    kernels::linear_rows16(op.x(), op.x_type(), ldx, M, op.w(), wt, ldw, N, K, bias, again.data(), ldy, 1);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": M " + std::to_string(M) + " N " + std::to_string(N) + " K " +
                 std::to_string(K));
    EXPECT_EQ(y, again);  // any thread count: the same bits
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < ldy; ++n) {
        const float got = y[static_cast<size_t>(m * ldy + n)];
        if (n >= N) {  // the padding of a row is not written
          EXPECT_EQ(got, -7.0f);
          continue;
        }
        EXPECT_LE(op.error_over_bound(m, n, got, with_bias), 1.0) << "row " << m << ", output " << n;
        ++checked;
      }
  }
  EXPECT_GT(checked, 1000);
}

// ops::linear_widened, the tiled sgemm path of the same products for more rows (float16
// modules' projections; bfloat16 ones where oneDNN has no bf16 matmul): shapes across the
// 256 × 256 output tiles, the same bound, the same bits for 1 and 2 threads.
TEST(LinearWidened, MatchesTheDoubleProductWithinTheSummationBound) {
  Rng rng(base_seed() + 1102);
  for (int trial = 0; trial < 8; ++trial) {
    const bool x16 = trial % 2 == 0;
    const DType wt = trial % 4 < 2 ? DType::kBF16 : DType::kF16;
    // K past a panel of the widened operands (ops::kWidenedPanel): one whole panel, and several
    // with a partial last.
    const int64_t panel = ops::kWidenedPanel;
    const int64_t M = rng.range(1, 300), N = rng.range(1, 300);
    const int64_t K = trial == 7                 ? 0
                      : trial == 3               ? panel
                      : trial == 5 || trial == 6 ? 2 * panel + rng.range(1, panel - 1)  // x float32, bfloat16
                                                 : rng.range(1, 80);
    const int64_t ldx = K + rng.range(0, 3), ldw = K + rng.range(0, 3), ldy = N + rng.range(0, 3);
    const Operands op(rng, M, N, K, ldx, ldw, x16, wt);
    std::vector<float> y(static_cast<size_t>(M * ldy), -7.0f), again = y;
    ops::linear_widened(op.x(), op.x_type(), ldx, M, op.w(), wt, ldw, N, K, op.bias.data(), y.data(), ldy, 2);
    ops::linear_widened(op.x(), op.x_type(), ldx, M, op.w(), wt, ldw, N, K, op.bias.data(), again.data(), ldy, 1);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": M " + std::to_string(M) + " N " + std::to_string(N) + " K " +
                 std::to_string(K));
    EXPECT_EQ(y, again);
    double worst = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n)
        worst = std::max(worst, op.error_over_bound(m, n, y[static_cast<size_t>(m * ldy + n)], true));
    EXPECT_LE(worst, 1.0) << "error / bound";
  }
}

TEST(LinearRowsErrors, NameTheArgument) {
  float y = 0, x = 0;
  const bfloat16 w{};
  test::expect_error([&] { kernels::linear_rows16(&x, DType::kF16, 1, 1, &w, DType::kBF16, 1, 1, 1, nullptr, &y, 1, 1); },
                     {"x must be", "not F16"});
  test::expect_error([&] { kernels::linear_rows16(&x, DType::kF32, 1, 1, &w, DType::kF32, 1, 1, 1, nullptr, &y, 1, 1); },
                     {"w must be", "not F32"});
  test::expect_error([&] { kernels::linear_rows16(&x, DType::kF32, 1, -1, &w, DType::kBF16, 1, 1, 1, nullptr, &y, 1, 1); },
                     {"negative"});
}

INSTANTIATE_TEST_SUITE_P(Targets, LinearRows, ::testing::ValuesIn(kernels::simd_targets()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace mha
