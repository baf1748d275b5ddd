#include "modules/positional.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "kernels/cpu/qk_rows.h"
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

// The rotations of rows at positions first[b] + t, in the kernels' layout (kernels::RowRotation):
// one table of T positions when every sequence starts at the same position (a forward), else
// computed per row (decoding). inverse: sin negated (the transposed rotation).
class RotationTable {
 public:
  RotationTable(const RotaryFreqs& f, bool inverse, const std::vector<int64_t>& first, int64_t T, int num_threads)
      : f_(f), inverse_(inverse), first_(first), width_(f.interleaved ? f.dims : f.dims / 2) {
    shared_ = !first.empty() && std::all_of(first.begin(), first.end(), [&](int64_t x) { return x == first[0]; });
    if (!shared_ || width_ == 0) return;
    table_.resize(static_cast<size_t>(2 * T * width_));
    parallel_for(T, num_threads, [&](int64_t t) { fill(first[0] + t, &table_[static_cast<size_t>(2 * t * width_)]); });
  }

  // The rotation of row t of sequence b; own: room for kOwnFloats, used when not shared.
  static constexpr int64_t kOwnFloats = 4 * kMaxRotaryPairs;
  kernels::RowRotation at(int64_t b, int64_t t, float* own) const {
    if (width_ == 0) return {};
    const float* cs = own;
    if (shared_) {
      cs = table_.data() + 2 * t * width_;
    } else {
      fill(first_[static_cast<size_t>(b)] + t, own);
    }
    return {cs, cs + width_, f_.dims / 2, f_.interleaved};
  }

 private:
  // cos then sin of position pos (width_ values each) into cs.
  void fill(int64_t pos, float* cs) const {
    float* c = cs;
    float* s = cs + width_;
    for (int64_t i = 0; i < f_.dims / 2; ++i) {
      const double angle = static_cast<double>(pos) * f_.inv_freq[i];  // double: exact enough anywhere
      const float ci = static_cast<float>(std::cos(angle) * f_.attention_factor);
      const float si = static_cast<float>((inverse_ ? -1 : 1) * std::sin(angle) * f_.attention_factor);
      if (f_.interleaved) {
        c[2 * i] = c[2 * i + 1] = ci;
        s[2 * i] = -si, s[2 * i + 1] = si;
      } else {
        c[i] = ci, s[i] = si;
      }
    }
  }

  const RotaryFreqs& f_;
  bool inverse_, shared_ = false;
  const std::vector<int64_t>& first_;
  int64_t width_;
  std::vector<float> table_;
};

// The kernels take a token's heads as rows of contiguous floats.
void check_rows(const View<const float>& x, const char* what) {
  MHA_CHECK(x.rank == 4 && x.stride[3] == 1, "positional: {} must be (B, H, T, D) rows of unit stride (internal)", what);
}

// Row t of batch b of each transform's src, optionally normalised (QK-norm with its weight),
// then rotated by the angles of position first[b] + t (f.dims may be 0), into its dst. One task
// per (b, t) over every head of every view: one cos/sin computation per position, each row
// read and written once.
void transform_rows(const RotaryFreqs& f, float eps, std::initializer_list<HeadTransform> xs,
                    const std::vector<int64_t>& first, int num_threads) {
  const View<const float>& x0 = xs.begin()->src;
  const int64_t B = x0.shape[0], T = x0.shape[2];
  for (const HeadTransform& x : xs) check_rows(x.src, "src"), check_rows(x.dst, "dst");
  const RotationTable rotation(f, false, first, T, num_threads);
  parallel_for(B * T, num_threads, [&](int64_t bt) {
    const int64_t b = bt / T, t = bt % T;
    float own[RotationTable::kOwnFloats];
    const kernels::RowRotation r = rotation.at(b, t, own);
    for (const HeadTransform& x : xs) {
      const float* in = x.src.data + b * x.src.stride[0] + t * x.src.stride[2];
      float* out = x.dst.data + b * x.dst.stride[0] + t * x.dst.stride[2];
      kernels::qk_rows_forward(in, x.src.stride[1], out, x.dst.stride[1], x.src.shape[1], x.src.shape[3], x.norm_weight,
                               eps, r);
    }
  });
}

// The backward of transform_rows for each view's rows. Tasks of kPositions tokens of one
// sequence, every head of each (the module's rows are token-major, so a task reads and writes
// contiguous memory). dw: a partial sum per task in a fixed order, the partials summed in task
// order: the same bits for any thread count.
void backward_rows(const RotaryFreqs& f, float eps, std::initializer_list<HeadGradient> gs,
                   const std::vector<int64_t>& first, int num_threads) {
  const View<float>& g0 = gs.begin()->g;
  const int64_t B = g0.shape[0], T = g0.shape[2];
  int64_t width = 0;  // partial dw floats per task, all views
  for (const HeadGradient& x : gs) {
    check_rows(x.g, "g");
    if (x.norm_weight) check_rows(x.x, "x"), width += x.g.shape[3];
  }
  constexpr int64_t kPositions = 32;
  const int64_t chunks = (T + kPositions - 1) / kPositions;
  std::vector<float> partial(static_cast<size_t>(B * chunks * width), 0.0f);
  const RotationTable rotation(f, true, first, T, num_threads);
  parallel_for(B * chunks, num_threads, [&](int64_t task) {
    const int64_t b = task / chunks, t0 = task % chunks * kPositions, t1 = std::min(T, t0 + kPositions);
    float own[RotationTable::kOwnFloats];
    for (int64_t t = t0; t < t1; ++t) {
      const kernels::RowRotation r = rotation.at(b, t, own);
      float* acc = partial.data() + task * width;
      for (const HeadGradient& x : gs) {
        const float* xr = x.norm_weight ? x.x.data + b * x.x.stride[0] + t * x.x.stride[2] : nullptr;
        float* gr = x.g.data + b * x.g.stride[0] + t * x.g.stride[2];
        const int64_t D = x.g.shape[3];
        kernels::qk_rows_backward(xr, x.norm_weight ? x.x.stride[1] : 0, gr, x.g.stride[1], x.g.shape[1], D,
                                  x.norm_weight, eps, r, acc);
        if (x.norm_weight) acc += D;
      }
    }
  });
  int64_t offset = 0;
  for (const HeadGradient& x : gs) {
    if (!x.norm_weight) continue;
    const int64_t D = x.g.shape[3];
    for (int64_t d = 0; d < D; ++d) {
      double total = 0;
      for (int64_t task = 0; task < B * chunks; ++task) total += partial[static_cast<size_t>(task * width + offset + d)];
      x.dw[d] += static_cast<float>(total);
    }
    offset += D;
  }
}

}  // namespace

void transform_qk(const RotaryFreqs& f, float eps, const HeadTransform& q, const std::vector<int64_t>& q_first,
                  const HeadTransform& k, const std::vector<int64_t>& k_first, int num_threads) {
  if (f.dims == 0 && !q.norm_weight) return;
  if (q_first == k_first && q.src.shape[2] == k.src.shape[2]) {  // self-attention: one pass for both
    transform_rows(f, eps, {q, k}, q_first, num_threads);
  } else {
    transform_rows(f, eps, {q}, q_first, num_threads);
    transform_rows(f, eps, {k}, k_first, num_threads);
  }
}

void transform_qk_backward(const RotaryFreqs& f, float eps, const HeadGradient& q, const std::vector<int64_t>& q_first,
                           const HeadGradient& k, const std::vector<int64_t>& k_first, int num_threads) {
  if (f.dims == 0 && !q.norm_weight) return;
  if (q_first == k_first && q.g.shape[2] == k.g.shape[2]) {
    backward_rows(f, eps, {q, k}, q_first, num_threads);
  } else {
    backward_rows(f, eps, {q}, q_first, num_threads);
    backward_rows(f, eps, {k}, k_first, num_threads);
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
