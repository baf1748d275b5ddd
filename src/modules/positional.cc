#include "modules/positional.h"

#include <algorithm>
#include <cmath>

#include "util/check.h"
#include "util/parallel.h"

namespace mha::modules {

void check_rotary(const RotaryConfig& r, int64_t head_dim) {
  if (r.dims == 0) return;
  MHA_CHECK(r.dims > 0 && r.dims % 2 == 0 && r.dims <= head_dim,
            "MultiHeadAttention: rotary.dims must be even and in [0, head_dim_qk = {}]; got {}", head_dim, r.dims);
  MHA_CHECK(std::isfinite(r.theta) && r.theta > 1.0f, "MultiHeadAttention: rotary.theta must be finite and > 1; got {}",
            r.theta);
  MHA_CHECK(std::isfinite(r.factor) && r.factor > 0.0f, "MultiHeadAttention: rotary.factor must be finite and > 0; got {}",
            r.factor);
  MHA_CHECK(r.scaling != RopeScaling::kNtk || r.dims > 2, "MultiHeadAttention: NTK rotary scaling needs rotary.dims > 2");
  if (r.scaling == RopeScaling::kYarn) {
    MHA_CHECK(r.original_max_positions > 0,
              "MultiHeadAttention: YaRN rotary scaling needs rotary.original_max_positions > 0; got {}",
              r.original_max_positions);
    MHA_CHECK(std::isfinite(r.beta_fast) && std::isfinite(r.beta_slow) && r.beta_fast > 0 && r.beta_slow > 0,
              "MultiHeadAttention: rotary.beta_fast and beta_slow must be finite and > 0; got {} and {}", r.beta_fast,
              r.beta_slow);
  }
  MHA_CHECK(r.scaling >= RopeScaling::kNone && r.scaling <= RopeScaling::kYarn,
            "MultiHeadAttention: rotary.scaling {} is not a RopeScaling", static_cast<int>(r.scaling));
}

RotaryFreqs rotary_freqs(const RotaryConfig& r) {
  RotaryFreqs f;
  f.dims = r.dims;
  f.interleaved = r.interleaved;
  const int64_t half = r.dims / 2;
  const double dims = static_cast<double>(r.dims);
  double theta = r.theta;
  if (r.scaling == RopeScaling::kNtk) theta *= std::pow(static_cast<double>(r.factor), dims / (dims - 2));
  f.inv_freq.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f.inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / dims);
  if (r.scaling == RopeScaling::kLinear) {
    for (double& x : f.inv_freq) x /= r.factor;
  } else if (r.scaling == RopeScaling::kYarn) {
    // Frequencies that turn fewer than beta_slow times over the original context are
    // interpolated (divided by factor), those turning more than beta_fast times kept, with a
    // linear ramp between (transformers' _compute_yarn_parameters).
    const double L = static_cast<double>(r.original_max_positions), two_pi = 2 * M_PI;
    auto correction_dim = [&](double rotations) {
      return dims * std::log(L / (rotations * two_pi)) / (2 * std::log(static_cast<double>(r.theta)));
    };
    const double low = std::max(0.0, std::floor(correction_dim(r.beta_fast)));
    double high = std::min(dims - 1, std::ceil(correction_dim(r.beta_slow)));
    if (high == low) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1 - ramp;  // weight of the original frequency
      f.inv_freq[i] = f.inv_freq[i] / r.factor * (1 - extrapolation) + f.inv_freq[i] * extrapolation;
    }
    f.attention_factor = r.factor > 1 ? 0.1 * std::log(static_cast<double>(r.factor)) + 1.0 : 1.0;
  }
  return f;
}

void rotate(const RotaryFreqs& f, const View<float>& x, const std::vector<int64_t>& first, bool inverse, int num_threads) {
  const int64_t B = x.shape[0], H = x.shape[1], T = x.shape[2], half = f.dims / 2;
  if (f.dims == 0) return;
  parallel_for(B * T, num_threads, [&](int64_t bt) {
    const int64_t b = bt / T, t = bt % T;
    const double pos = static_cast<double>(first[static_cast<size_t>(b)] + t);
    std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * f.inv_freq[i];  // double: exact enough at any position
      c[i] = static_cast<float>(std::cos(angle) * f.attention_factor);
      s[i] = static_cast<float>((inverse ? -1 : 1) * std::sin(angle) * f.attention_factor);
    }
    for (int64_t h = 0; h < H; ++h) {
      float* row = x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
      const int64_t e = x.stride[3];
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = f.interleaved ? 2 * i : i, z = f.interleaved ? 2 * i + 1 : i + half;
        const float xa = row[a * e], xz = row[z * e];
        row[a * e] = xa * c[i] - xz * s[i];
        row[z * e] = xa * s[i] + xz * c[i];
      }
    }
  });
}

void rms_norm(const View<float>& x, const float* w, float eps, int num_threads) {
  const int64_t B = x.shape[0], H = x.shape[1], T = x.shape[2], D = x.shape[3], e = x.stride[3];
  parallel_for(B * H * T, num_threads, [&](int64_t r) {
    float* row = x.data + r / (H * T) * x.stride[0] + r / T % H * x.stride[1] + r % T * x.stride[2];
    double sq = 0;
    for (int64_t d = 0; d < D; ++d) sq += static_cast<double>(row[d * e]) * row[d * e];
    const float inv = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(D) + eps));
    for (int64_t d = 0; d < D; ++d) row[d * e] = row[d * e] * inv * w[d];
  });
}

void rms_norm_backward(const View<const float>& x, const float* w, float eps, const View<float>& g, float* dw) {
  const int64_t B = x.shape[0], H = x.shape[1], T = x.shape[2], D = x.shape[3];
  std::vector<double> acc(static_cast<size_t>(D), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        double sq = 0, dot = 0;
        for (int64_t d = 0; d < D; ++d) sq += static_cast<double>(x.at(b, h, t, d)) * x.at(b, h, t, d);
        const double inv = 1.0 / std::sqrt(sq / static_cast<double>(D) + eps);
        // x̂ = x·inv; y = x̂·w; with u = g·w: dx = inv·(u - x̂·mean(u·x̂)), dw += g·x̂.
        for (int64_t d = 0; d < D; ++d) {
          const double xh = x.at(b, h, t, d) * inv;
          acc[d] += g.at(b, h, t, d) * xh;
          dot += g.at(b, h, t, d) * static_cast<double>(w[d]) * xh;
        }
        const double mean = dot / static_cast<double>(D);
        for (int64_t d = 0; d < D; ++d) {
          const double xh = x.at(b, h, t, d) * inv;
          g.at(b, h, t, d) = static_cast<float>(inv * (g.at(b, h, t, d) * static_cast<double>(w[d]) - xh * mean));
        }
      }
  for (int64_t d = 0; d < D; ++d) dw[d] += static_cast<float>(acc[d]);
}

std::vector<float> alibi_slopes(int64_t heads) {
  int64_t n = 1;
  while (n * 2 <= heads) n *= 2;
  std::vector<float> s;
  for (int64_t h = 0; h < n; ++h) s.push_back(static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / n)));
  for (int64_t h = 0; static_cast<int64_t>(s.size()) < heads; ++h)
    s.push_back(static_cast<float>(std::exp2(-8.0 * static_cast<double>(2 * h + 1) / (2 * n))));
  return s;
}

}  // namespace mha::modules
