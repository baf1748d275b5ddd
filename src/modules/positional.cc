#include "modules/positional.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "util/check.h"
#include "util/parallel.h"

namespace mha::modules {

void check_rotary(const RotaryConfig& r, int64_t head_dim) {
  if (r.dims == 0) return;
  MHA_CHECK(r.dims > 0 && r.dims % 2 == 0 && r.dims <= head_dim,
            "MultiHeadAttention: rotary.dims must be even and in [0, head_dim_qk = {}]; got {}", head_dim, r.dims);
  MHA_CHECK(r.dims <= 2 * kMaxRotaryPairs, "MultiHeadAttention: rotary.dims {} is above the supported {}", r.dims,
            2 * kMaxRotaryPairs);
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

namespace {

// mean(x²) of n floats at stride e: float sums in 8 interleaved lanes (vectorised for e = 1;
// relative error ≲ (n/8 + 3)·u, as torch's float32 RMSNorm), returned as double.
double mean_square(const float* x, int64_t n, int64_t e) {
  float lanes[8] = {};
  int64_t d = 0;
  if (e == 1) {
    for (; d + 8 <= n; d += 8)
      for (int l = 0; l < 8; ++l) lanes[l] += x[d + l] * x[d + l];
  }
  for (; d < n; ++d) lanes[d % 8] += x[d * e] * x[d * e];
  double sum = 0;
  for (float l : lanes) sum += l;
  return sum / static_cast<double>(n);
}

// Row t of batch b of each transform's src, optionally normalised (QK-norm with its weight),
// then rotated by the angles of position first[b] + t (f.dims may be 0), into its dst. One task
// per (b, t) over every head of every view: one cos/sin computation per position, each row
// read and written once.
void transform_rows(const RotaryFreqs& f, float eps, std::initializer_list<HeadTransform> xs,
                    const std::vector<int64_t>& first, bool inverse, int num_threads) {
  const View<const float>& x0 = xs.begin()->src;
  const int64_t B = x0.shape[0], T = x0.shape[2], half = f.dims / 2;
  // cos and sin of position first[b] + t: one table of T positions when every sequence starts at
  // the same position (a forward), else computed per row (decoding).
  const bool shared = std::all_of(first.begin(), first.end(), [&](int64_t x) { return x == first[0]; });
  std::vector<float> table(shared ? static_cast<size_t>(2 * T * half) : 0);
  auto angles = [&](int64_t pos, float* c, float* s) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos) * f.inv_freq[i];  // double: exact enough anywhere
      c[i] = static_cast<float>(std::cos(angle) * f.attention_factor);
      s[i] = static_cast<float>((inverse ? -1 : 1) * std::sin(angle) * f.attention_factor);
    }
  };
  if (shared && half > 0) {
    parallel_for(T, num_threads, [&](int64_t t) { angles(first[0] + t, &table[2 * t * half], &table[(2 * t + 1) * half]); });
  }
  parallel_for(B * T, num_threads, [&](int64_t bt) {
    const int64_t b = bt / T, t = bt % T;
    float own[2 * kMaxRotaryPairs];
    const float* c = own;
    const float* s = own + half;
    if (shared) {
      c = table.data() + 2 * t * half;
      s = c + half;
    } else {
      angles(first[static_cast<size_t>(b)] + t, own, own + half);
    }
    for (const HeadTransform& x : xs) {
      const int64_t D = x.src.shape[3], se = x.src.stride[3], de = x.dst.stride[3];
      for (int64_t h = 0; h < x.src.shape[1]; ++h) {
        const float* in = x.src.data + b * x.src.stride[0] + h * x.src.stride[1] + t * x.src.stride[2];
        float* row = x.dst.data + b * x.dst.stride[0] + h * x.dst.stride[1] + t * x.dst.stride[2];
        if (x.norm_weight) {
          const float inv = static_cast<float>(1.0 / std::sqrt(mean_square(in, D, se) + eps));
          if (se == 1 && de == 1) {  // unit strides spelled out: the compiler vectorises this one
            for (int64_t d = 0; d < D; ++d) row[d] = in[d] * inv * x.norm_weight[d];
          } else {
            for (int64_t d = 0; d < D; ++d) row[d * de] = in[d * se] * inv * x.norm_weight[d];
          }
        } else if (row != in) {
          for (int64_t d = 0; d < D; ++d) row[d * de] = in[d * se];
        }
        if (de == 1 && !f.interleaved) {  // half-split, unit stride: vectorised
          float* ra = row;
          float* rz = row + half;
          for (int64_t i = 0; i < half; ++i) {
            const float xa = ra[i], xz = rz[i];
            ra[i] = xa * c[i] - xz * s[i];
            rz[i] = xa * s[i] + xz * c[i];
          }
          continue;
        }
        for (int64_t i = 0; i < half; ++i) {
          const int64_t a = f.interleaved ? 2 * i : i, z = f.interleaved ? 2 * i + 1 : i + half;
          const float xa = row[a * de], xz = row[z * de];
          row[a * de] = xa * c[i] - xz * s[i];
          row[z * de] = xa * s[i] + xz * c[i];
        }
      }
    }
  });
}

}  // namespace

void transform_qk(const RotaryFreqs& f, float eps, const HeadTransform& q, const std::vector<int64_t>& q_first,
                  const HeadTransform& k, const std::vector<int64_t>& k_first, bool inverse, int num_threads) {
  if (f.dims == 0 && !q.norm_weight) return;
  if (q_first == k_first && q.src.shape[2] == k.src.shape[2]) {  // self-attention: one pass for both
    transform_rows(f, eps, {q, k}, q_first, inverse, num_threads);
  } else {
    transform_rows(f, eps, {q}, q_first, inverse, num_threads);
    transform_rows(f, eps, {k}, k_first, inverse, num_threads);
  }
}

namespace {

// One row of RMSNorm's backward: x̂ = x·inv, y = x̂·w; with u = g·w: dx = inv·(u − x̂·mean(u·x̂))
// into g, and acc += g·x̂ (dw). The sums run in 8 interleaved lanes (as mean_square), and unit
// strides take a loop of their own, so the compiler vectorises the row (a single float sum is a
// serial chain: the backward ran at ~2.6 ns per element). Both loops add in the same order.
void norm_backward_row(const float* xr, int64_t xe, const float* w, float inv, int64_t D, float* gr, int64_t ge,
                       float* acc) {
  float lanes[8] = {};
  int64_t d = 0;
  if (xe == 1 && ge == 1) {
    for (; d + 8 <= D; d += 8) {
      for (int l = 0; l < 8; ++l) {
        const float xh = xr[d + l] * inv;
        acc[d + l] += gr[d + l] * xh;
        lanes[l] += gr[d + l] * w[d + l] * xh;
      }
    }
  }
  for (; d < D; ++d) {
    const float xh = xr[d * xe] * inv;
    acc[d] += gr[d * ge] * xh;
    lanes[d % 8] += gr[d * ge] * w[d] * xh;
  }
  float dot = 0;
  for (float l : lanes) dot += l;
  const float mean = dot / static_cast<float>(D);
  for (d = 0; d < D; ++d) gr[d * ge] = inv * (gr[d * ge] * w[d] - xr[d * xe] * inv * mean);
}

}  // namespace

void rms_norm_backward(const View<const float>& x, const float* w, float eps, const View<float>& g, float* dw,
                       int num_threads) {
  const int64_t B = x.shape[0], H = x.shape[1], T = x.shape[2], D = x.shape[3];
  // Tasks of kPositions tokens of one sequence, every head of each: the module's rows are
  // token-major, so a task reads and writes contiguous memory (a task per head strode ~9 KiB
  // from row to row and waited on memory for each). dw: a partial sum per task in a fixed order,
  // the partials summed in task order: the same bits for any thread count.
  constexpr int64_t kPositions = 32;
  const int64_t chunks = (T + kPositions - 1) / kPositions;
  std::vector<float> partial(static_cast<size_t>(B * chunks * D), 0.0f);
  parallel_for(B * chunks, num_threads, [&](int64_t task) {
    const int64_t b = task / chunks, t0 = task % chunks * kPositions, t1 = std::min(T, t0 + kPositions);
    const int64_t xe = x.stride[3], ge = g.stride[3];
    float* acc = partial.data() + task * D;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
        float* gr = g.data + b * g.stride[0] + h * g.stride[1] + t * g.stride[2];
        const float inv = static_cast<float>(1.0 / std::sqrt(mean_square(xr, D, xe) + eps));
        norm_backward_row(xr, xe, w, inv, D, gr, ge, acc);
      }
    }
  });
  for (int64_t d = 0; d < D; ++d) {
    double total = 0;
    for (int64_t task = 0; task < B * chunks; ++task) total += partial[static_cast<size_t>(task * D + d)];
    dw[d] += static_cast<float>(total);
  }
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
